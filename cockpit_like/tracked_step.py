"""One tracked step, between :meth:`Cockpit.begin` and :meth:`Cockpit.end`.

:class:`TrackedStep` is one backward pass of a step: it collects the needs of
the quantities active at the step (:class:`~cockpit_like.quantities.needs.StepNeeds`),
meets them through :class:`~cockpit_like.backends.step.StepExecution`, and
after the step's last backward pass (``info["micro_batches"]``) merges the
partitions (:mod:`cockpit_like.backends.partitions`), tracks the quantities
and hands what they stored to the cockpit (stream, listeners, diagnosis).
:class:`StepContext` is what ``with cockpit(step, info=...)`` returns.

The cockpit hands each step what it needs as one explicit value,
:class:`StepEnvironment` (its parameters, tracer, ranks, output and callables
for names and schedules), and the state its steps share across steps,
:class:`StepRun`; this module never imports the cockpit.

May import torch, :mod:`cockpit_like.backends`, :mod:`cockpit_like.checks`, the quantity base
modules, :mod:`cockpit_like.run_output` and :mod:`cockpit_like.context`.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import warnings
from dataclasses import replace
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cockpit_like import context
from cockpit_like.backends.partitions import StepGradients, StepPartitions, grad_scale, is_dtensor, loss_scale, passes_in_block_of
from cockpit_like.backends.distributed import UnequalBatchError
from cockpit_like.backends.hvp import GraphModifiedError, MissingGraphError, NoSecondDerivativeError
from cockpit_like.backends.step import StepExecution
from cockpit_like.backends.loss_curvature import LossCurvatureCheck
from cockpit_like.backends.user_state import gradient_changes, guard_module_hooks
from cockpit_like.checks import CHECKS_KEY, GradientProbe, LossFactor, StepChecks, check_losses_mean
from cockpit_like.checks.loss_factor import OutputReference
from cockpit_like.checks.roots import BackwardRoots, undeclared_terms
from cockpit_like.checks.invariants import notable, tolerance_for
from cockpit_like.checks.probe import probe_directions, project, project_all
from cockpit_like.checks.prints import NonFinitePrint, any_nonfinite, finite_print, nonfinite_counts, parts, print_of
from cockpit_like.checks.rows import coupled_rows, declared_output_gradients
from cockpit_like.diagnosis.findings import Finding
from cockpit_like.diagnosis.recorder.control import gradients_finite, loss_finite
from cockpit_like.quantities.needs import StepNeeds
from cockpit_like.quantities.quantity import Quantity

__all__ = ["TrackedStep", "StepContext", "StepEnvironment", "StepRun"]


@dataclass
class StepRun:
    """What the tracked steps of one cockpit share across steps (owned by the cockpit, changed by its steps)."""

    #: the step the next forward pass belongs to
    next_step: int = 0
    #: the optimizer step whose backward passes (micro-batches) are being collected
    partitions: StepPartitions | None = None
    #: ``(step, backward passes done, micro_batches)`` of a step with declared micro-batches in progress
    micro: tuple[int, int, int] | None = None
    #: the last backward pass of a step whose end is not declared, finished at the optimizer's step
    pending: Any = None
    #: the loop was seen to run several backward passes per optimizer step without declaring them
    accumulates: bool = False
    #: a backpropagated loss was seen scaled (BackPACK's Hessian diagonal then gets the GGN beside it)
    scaled_losses: bool = False
    #: :func:`~cockpit_like.backends.user_state.gradient_changes` as the open step's first backward pass began
    gradient_changes: int = 0
    #: the loop was seen to run several backward passes inside one block (two losses): the hook backend sums
    #: each call's output gradients over them from then on
    multi_pass: bool = False
    #: the diagnosis heard of stale gradients (a forgotten zero_grad) once
    stale_reported: bool = False
    #: ``(step, names of the quantities it tracked)`` of the step finished last
    finished: tuple[int, set[str]] | None = None
    #: steps found invalid after they were stored: late values of their quantities are dropped
    invalid_steps: set[int] = field(default_factory=set)
    #: the optimizer (``info["optimizer"]``) whose ``step(closure)`` is running: backward passes begun meanwhile
    #: are its closure's evaluations
    stepping: Any = None
    #: tracked backward passes begun during the running ``step(closure)``
    evaluations: int = 0
    #: ``{id(optimizer): step}``: optimizers seen to evaluate their closure several times in one step (LBFGS),
    #: with the step where it was seen
    multi_evaluation: dict[int, int] = field(default_factory=dict)
    #: ``(step, optimizer, parameter projections, gradient projections or None)`` of the last tracked block
    #: outside its optimizer's step, compared when that optimizer steps (:meth:`Cockpit._check_optimizer_step`)
    watch: Any = None
    #: ``(step, optimizer class)``: the step finished last, once an optimizer stepped after it: a pass with that number
    #: again is a new optimizer step under a repeated number (:meth:`Cockpit.__call__` refuses it)
    stepped: tuple[int, str] | None = None
    #: ``[step, id(optimizer), count]``: the steps ``info["optimizer"]`` of the step finished last has made since
    #: (its step post-hook counts them); more than one before the next tracked step, and the values of two-step
    #: quantities that start at that step and end at the next (UpdateSize, Alpha) would span several updates
    updates: list | None = None
    #: the step finished last, where its ``info["optimizer"]`` (one that runs its step hooks) did not step before the
    #: step that begins now: p.grad found not zero then means both are micro-batches of one optimizer step
    unstepped: int | None = None
    #: that step, once the step after it found its gradients in p.grad: withdrawn by the cockpit (:meth:`Cockpit._split_step`)
    split_step: int | None = None
    #: a warning said once that the step numbers skip the end steps of two-step quantities
    gap_warned: bool = False
    #: a warning said once that a tracked step's loss is not finite (a run gone NaN warned at every step after:
    #: 298 lines of stderr in outside trial 15)
    loss_told: bool = False
    #: a warning said once that a tracked step left its per-sample quantities out (rows that are not the samples':
    #: coupled through the batch, or a module called on parts of it); every such step's note says it too
    rows_told: bool = False
    #: steps whose block raised (nothing of them stored): the notes of the values that ended there say so
    raised: set[int] = field(default_factory=set)
    #: failed steps whose take-down was itself interrupted: finished when the next step begins
    loose: list = field(default_factory=list)


@dataclass(frozen=True)
class StepEnvironment:
    """What a tracked step needs from its cockpit, as one explicit value."""

    params: list[torch.Tensor]
    tracer: Any
    collector: Any
    ranks: Any
    output: Any
    run: StepRun
    memory_budget: int | None
    self_checks: bool
    keeps_output: Callable[[], bool]
    active_at: Callable[[int], list[Quantity]]
    create_graph: Callable[[int], bool]
    name_of: Callable[[Quantity], str]
    param_names: Callable[[], dict[int, str]]
    param_name_list: Callable[[], list[str]]
    models: Callable[[], list[torch.nn.Module]]
    diagnose: Callable[[dict[int, dict[str, Any]]], None]
    #: store a finding of the cockpit's own (and call ``on_finding``)
    report: Callable[[Any], None]

    def store_skipped(self, step: int, why: dict[str, Any]) -> None:
        if self.keeps_output():
            self.output.store_skipped(step, why)

    def store_checks(self, step: int, record: dict[str, Any]) -> None:
        if self.keeps_output():
            self.output.store_checks(step, record)

    def add_note(self, step: int, text: str) -> None:
        """Add ``text`` to the notes of ``step``'s checks (stored already, or stored with it)."""
        record = dict(self.output.checks.get(step, {"valid": True, "failed": [], "notes": []}))
        record["notes"] = list(record.get("notes", [])) + [text]
        self.store_checks(step, record)


class StepContext:
    """What ``cockpit(step, ...)`` returns: ``with`` calls the cockpit's ``begin`` and ``end``."""

    def __init__(self, begin: Callable[..., None], end: Callable[[BaseException | None], None], global_step: int,
                 exts: tuple, info: dict, debug: bool):  # fmt: skip
        self._begin, self._end = begin, end
        self.step = global_step
        self.exts = exts
        self.info = info
        self.debug = debug

    def __enter__(self) -> StepContext:
        self._entered = True
        self._begin(self.step, *self.exts, info=self.info, debug=self.debug)
        return self

    def __del__(self) -> None:
        # ``cockpit(step, info=info)`` on a line of its own (without ``with``) opens nothing, silently: say so
        if not self.__dict__.get("_entered", False) and not sys.is_finalizing():
            try:
                warnings.warn(
                    f"[cockpit_like] cockpit({self.step}, info=...) was called but never entered, so step {self.step} "
                    "is not tracked: write `with cockpit(step, info=info): loss.backward()` (or cockpit.begin(step, "
                    "info=info) before backward and cockpit.end() after)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            except Exception:  # noqa: BLE001 - never raise from a finaliser
                pass

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self._end(exc)
        return False


#: the self-checks that concern only the per-sample rows and what was computed beside them: a step that fails only
#: these keeps the quantities that read none (:meth:`TrackedStep._left_out_by_failed_checks`). Not
#: ``backpropagated_loss``: a sum backpropagated where a mean is declared scales ``p.grad`` itself
ROW_CHECKS = frozenset({"gradient", "forward_in_block"})


def _ran_again_reason(step: int, modules: list[str]) -> str:
    return (
        f"the BackPACK-extended module(s) {modules} ran again inside the cockpit's block of step {step}, after the "
        "forward pass of the loss it backpropagates (a forward pass with gradients enabled, such as metrics on an "
        "evaluation batch): BackPACK keeps one call's input and output per module, so the per-sample rows (and "
        "BackPACK's curvature) would describe that call's inputs. Run other forward passes under torch.no_grad(), "
        "or before the block, or use the model without backpack.extend (Cockpit(..., model=model))"
    )


class TrackedStep:
    """One backward pass of a step, from :meth:`Cockpit.begin` to :meth:`Cockpit.end`.

    A step is one optimizer step: with ``info["micro_batches"] = K`` its ``K``
    backward passes are partitions of its rows
    (:mod:`cockpit_like.backends.partitions`), merged after the last one, when
    the quantities are tracked.
    """

    def __init__(
        self, env: StepEnvironment, global_step: int, exts: tuple, info: dict, debug: bool, micro: int,
        micro_batches: int, ignored: bool = False,
    ):
        self.env = env
        self.step = global_step
        self.user_exts = exts
        self.info = info
        self.debug = debug
        self.micro, self.micro_batches = micro, micro_batches
        self.last = micro == micro_batches - 1
        if micro == 0:  # the user's hooks that change gradients, counted from the step's first backward pass on
            env.run.gradient_changes = gradient_changes()[0]
        self.active: list[Quantity] = []
        #: the step's quantities were tracked (its last backward pass, not skipped)
        self.completed = False
        #: the step's scaled gradients are not finite: a GradScaler skips it (stored as skipped)
        self.skipped = False
        self._execution: StepExecution | None = None
        self._loss_is_finite = True
        self._loss_finite: bool | None | object = _UNCHECKED
        #: the step's end is not known in advance: more backward passes of this step may follow, and the
        #: step is finished when the optimizer steps or the next step begins (undeclared micro-batches)
        #: (also where a quantity's computation must wait for the optimizer's step: Quantity.waits_for_optimizer,
        #: unless the block runs inside that step, a closure's evaluation, or the step needs a closure)
        optimizer = info.get("optimizer")
        #: the quantities scheduled at this step (``active`` once the block is entered, unless ignored)
        self._scheduled = list(env.active_at(global_step))
        #: the block runs inside the optimizer's step(closure), or its optimizer needs one: nothing can wait for it
        self._inside_step = env.run.stepping is not None or needs_closure(optimizer)
        waits = not self._inside_step and any(q.waits_for_optimizer(global_step) for q in self._scheduled)
        # (with declared micro-batches only their last backward pass waits for the optimizer: the step's end is known)
        finished_by_optimizer = env.ranks is None and _is_optimizer(optimizer)
        #: more backward passes of this step may follow: the loop was seen to accumulate undeclared micro-batches
        #: (a step open only because a quantity waits for the optimizer's step has the passes it is seen to have)
        self.accumulating = env.run.accumulates and "micro_batches" not in info and finished_by_optimizer
        self.open_ended = self.accumulating or (waits and self.last and finished_by_optimizer)
        #: the gradients as the step's backward passes left them, kept where the step waits for the optimizer's
        #: step for a quantity (Alpha) and the loop may change them before (clipping by value, gradient noise):
        #: the quantities describe these, the look-ahead steps with the optimizer's (:meth:`_step_scale`)
        self._waits = waits and self.open_ended
        self._kept: list[torch.Tensor | None] | None = None
        self._use_kept = False
        self._split = micro_batches > 1 or env.ranks is not None or self.open_ended
        #: a backward pass of a step already withdrawn (see Cockpit._invalidate): nothing is computed
        self.ignored = ignored
        self._factor: LossFactor | None = None
        self._roots: BackwardRoots | None = None
        #: whether a backward pass ran inside the block (None: not watched), for the error of a block that ends
        #: without gradients
        self._backward_seen: bool | None = None
        self._probe: GradientProbe | None = None
        #: the active quantities that asked for anything computed in or after the backward pass (``StepNeeds.askers``)
        self._askers: frozenset[str] = frozenset()
        self._fingerprint: dict[int, float | None] | None = None
        #: the other ranks were told that this step failed (:meth:`_abandon`)
        self._told = False
        #: ``{id(quantity): (len(output), its last two items)}`` as the step's finish began (:meth:`_take_back`)
        self._outputs_before: dict[int, tuple[int, dict]] = {}

    # ---- enter: collect the needs -----------------------------------------------
    def __enter__(self) -> TrackedStep:
        env, step = self.env, self.step
        env.run.next_step = step + 1 if self.last else step  # the next forward pass belongs to this step
        self.active = [] if self.ignored else self._scheduled
        if not self.active and (not self.user_exts or self.ignored):
            env.tracer.drop_calls()  # nothing tracked: drop what the forward pass noted
            if self.debug:
                print(f"[cockpit_like|step {step}] nothing scheduled")
            return self

        for quantity in self.active:
            quantity.observe_info(step, self.info)
        for quantity in self.active:
            for key in sorted(quantity.required_info(step)):
                if key not in self.info:
                    raise context.MissingInfoError(key, env.name_of(quantity), step)
        if self.micro_batches > 1 and self.active and "batch_size" not in self.info:
            raise context.MissingInfoError("batch_size", f"gradient accumulation (info['micro_batches'] = {self.micro_batches})", step)
        if "batch_size" in self.info:
            _check_batch_size(self.info["batch_size"], step)
            _check_losses_match(self.info, step, self.micro_batches)
        if "sample_ids" in self.info:
            check_sample_ids(self.info, step, self.micro_batches, distributed=env.ranks is not None)
        if env.self_checks:
            check_losses_mean(self.info, step)
        loss_warning = self._check_loss()
        create_graph = env.create_graph(step)
        if env.ranks is not None and self.active:
            owners = tuple(env.name_of(q) for q in self.active if q.create_graph(step))
            env.ranks.check_step(step, env.models(), self.info, create_graph, self.last, owners)
        needs = StepNeeds.collect(self.active, step, env.name_of, self.user_exts, create_graph)
        self._askers = needs.askers
        if needs.stats and env.self_checks:  # the self-check of the per-sample decomposition (checks.probe)
            self._probe = GradientProbe(seed=_probe_seed(step))
            needs = replace(needs, stats=tuple(needs.stats) + (self._probe,))
        if self._split:  # the form each backward pass computes when the step has several (equal results)
            needs = needs.partitioned()
        if self.active and (env.run.partitions is None or env.run.partitions.step != step):
            scaler = grad_scale(self.info, step)
            factor = scaler * loss_scale(self.info, step)
            env.run.partitions = StepPartitions(step, factor, skippable=scaler != 1.0, grad_scaler=scaler)
            env.run.partitions.checks = StepChecks(step)
            if env.self_checks:  # what p.grad held before this step's first backward pass (zero after zero_grad)
                env.run.partitions.checks.stale = _stale_gradients(env.params, _probe_seed(step))
                self._stale_at_entry = bool(env.run.partitions.checks.stale)
            env.run.partitions.checks.assumed = factor / max(self.micro_batches, 1)
            env.run.partitions.checks.declared = self.micro_batches
        self._warn_loss(loss_warning)
        if self.active and env.run.partitions.partitions:
            first = env.run.partitions.partitions[0].info
            if ("sample_ids" in first) != ("sample_ids" in self.info):
                raise ValueError(
                    f"cockpit step {step}: info['sample_ids'] was given to "
                    f"{'the first' if 'sample_ids' in first else 'this'} backward pass of the step but not to "
                    f"{'this one' if 'sample_ids' in first else 'the first'}; pass sample ids with every micro-batch "
                    "of a step (each its own rows', in order) or with none"
                )
        scale = env.run.partitions.scale if self.active else 1.0
        self._output_reference = None  # (made by the row check, where it runs)
        if self.active and passes_in_block_of(self.info, step) > 1:  # declared: the rows summed from this step on
            env.run.multi_pass = True
        try:
            self._execution = StepExecution(
                step,
                env.params,
                needs,
                tracer=env.tracer,
                collector=env.collector,
                names=env.param_names(),
                info=self.info,
                row_scale=self.micro_batches / scale,
                memory_budget=env.memory_budget,
                scaled_losses=env.run.scaled_losses,
                accumulate_passes=env.run.multi_pass,
                row_check=self._row_check(needs) if env.self_checks else None,
            )
        except BaseException:
            env.tracer.drop_calls()
            raise
        try:
            if self.active and env.self_checks:  # (made, then started: take-down finds what an interrupt let on)
                self._factor = LossFactor(
                    self.info.get("loss"), on_factor=self._execution.observe_loss_factor,
                    losses=self.info.get("individual_losses"), outputs=self._execution.root_outputs,
                    reference=self._output_reference,
                )  # fmt: skip
                self._factor.start()  # (before the execution's hooks: the factor is seen before the rows use it)
            if self.debug:
                print(
                    f"[cockpit_like|step {step}] quantities: {[env.name_of(q) for q in self.active]}; "
                    f"{self._execution.describe()}; per-sample statistics: {list(needs.stats)}; "
                    f"create_graph: {create_graph}; backward pass {self.micro + 1} of {self.micro_batches}"
                )
            self._execution.enter()
            if self._factor is not None:  # what the user's backward passes propagate (last: nothing after it raises)
                # which gradients the block found: a block that runs no backward pass and writes no p.grad (a
                # validation batch) is told so, whatever stale gradients it finds (outside trial 9)
                self._grads_at_entry = [(id(p.grad), p.grad._version) if p.grad is not None else None
                                        for p in env.params]
                self._roots = BackwardRoots()
                checks, seed, execution = env.run.partitions.checks, _probe_seed(step), self._execution
                stale = getattr(self, "_stale_at_entry", False)

                def first_backward() -> None:
                    if stale:
                        # p.grad was not zero at the block's entry: read it again when the backward pass begins (a
                        # loop that calls optimizer.zero_grad() inside the block, before backward(), is not stale)
                        checks.stale = _stale_gradients(env.params, seed)
                    again = execution.ran_again()
                    if again:
                        checks.fail("forward_in_block", _ran_again_reason(step, again))

                self._roots.on_first = first_backward
                self._roots.start()
        except BaseException:  # (a KeyboardInterrupt too): nothing of the step stays set up
            self._abandon(None)
            raise
        return self

    def _row_check(self, needs):
        """The check that each row's loss reads its own row of the output (:mod:`cockpit_like.checks.rows`),
        bound to this pass's losses, where per-sample statistics are needed; where they are not but a quantity
        reads the loss's derivatives beyond ``p.grad`` (``needs.askers``: curvature, Alpha), only the declared
        loss's gradient at the outputs, which the user's backward pass must bring there."""
        losses, batch = self.info.get("individual_losses"), self.info.get("batch_size")
        if not (needs.stats or needs.askers) or not isinstance(losses, torch.Tensor) or batch is None:
            return None
        batch = int(batch)
        seed = _probe_seed(self.step) + 1 + self.micro
        # the plain sum's gradients at the outputs, kept as projections: the user's backward pass must bring
        # the loss factor times the declared loss's gradient there (a term of value 0 with a gradient does not)
        self._output_reference = reference = OutputReference(seed + 0x51, losses.numel())
        if not needs.stats:
            return functools.partial(declared_output_gradients, losses, on_gradients=reference.keep)
        return lambda outputs, scalars=(), row_nodes=frozenset(): coupled_rows(
            losses, outputs, batch, seed, tolerance_for, on_gradients=reference.keep, scalars=scalars,
            row_nodes=row_nodes,
        )

    def loss_finite(self) -> bool | None:
        """Whether ``info["loss"]`` is finite (``None``: no loss given), computed once per step."""
        if self._loss_finite is _UNCHECKED:
            self._loss_finite = loss_finite(self.info.get("loss"))
        return self._loss_finite

    def _check_loss(self) -> str | None:
        """The warning for a non-finite ``info["loss"]`` (``None``: finite, or no loss given)."""
        if self.loss_finite() is not False:
            return None
        self._loss_is_finite = False
        loss = self.info["loss"]
        return (
            f"[cockpit_like] step {self.step}: the loss is {float(loss.detach() if isinstance(loss, torch.Tensor) else loss):g}; quantities "
            "that cannot be computed store NaN for this step. cockpit.records (docs/recorder.md) names the operation "
            "that made the first non-finite value; lower the learning rate, clip the gradients or check the inputs"
        )

    def _warn_loss(self, message: str | None) -> None:
        """Warn of a non-finite loss now, or, where a ``GradScaler`` may skip the step, once the step is known to be
        tracked (:meth:`finish`): a skipped step stores no value and no record, so the warning would be false."""
        if message is None:
            return
        partitions = self.env.run.partitions
        if partitions is not None and partitions.step == self.step and partitions.skippable:
            partitions.loss_warning = partitions.loss_warning or message
            return
        self._tell_loss(message)

    def _tell_loss(self, message: str) -> None:
        """The warning of a non-finite loss, once per run (each such step's checks and NaN values say it too)."""
        if self.env.run.loss_told:
            return
        self.env.run.loss_told = True
        warnings.warn(message + " (told once: later steps whose loss is not finite store NaN the same way, and "
                      "their checks note the non-finite gradients)", RuntimeWarning, stacklevel=_user_stacklevel())

    # ---- exit: compute, store, free ---------------------------------------------
    def __exit__(self, exc_type, exc, traceback) -> bool:
        execution = self._execution
        if execution is None:
            return False
        env = self.env
        ranks = env.ranks if self.active else None
        try:
            self._leave_backward(exc_type, exc, traceback)
            if exc_type is not None:
                self._abandon(ranks)
                return False
            if not self.active:
                execution.free()
                return False
            if self.open_ended:  # more backward passes of this step may follow: finished by Cockpit._flush
                self._watch_parameters()
                self._fingerprint = _fingerprint(env.params, self.step)
                if self._waits and not any(is_dtensor(p) for p in env.params):  # one copy of the gradients, until then
                    # (with the graph of p.grad where the step has one: Hessian-vector products run through it at the
                    # optimizer's step, after the loop changed p.grad in place)
                    self._kept = [None if p.grad is None else _kept_copy(p.grad) for p in env.params]
                env.run.pending = self
                return False
            if not self.last:  # more declared micro-batches to come
                self._watch_parameters()
                execution.free()
                return False
        except BaseException:  # anything, a KeyboardInterrupt too: the step is dropped, nothing stays set up
            self._abandon(ranks)
            raise
        self.finish()
        # after the step's merge: under DDP the cockpit's own reduction of a graph step writes p.grad there
        self._watch_parameters()
        return False

    def _grads_untouched(self) -> bool:
        return _same_gradients(self.env.params, getattr(self, "_grads_at_entry", None))

    def _leave_backward(self, exc_type, exc, traceback) -> None:
        """Take down what watched the backward pass and keep what it computed as one partition of the step."""
        env, execution = self.env, self._execution
        partitions = env.run.partitions
        factor, roots = self._factor, self._roots
        if factor is not None:
            factor.remove()
        if roots is not None:
            roots.remove()
            self._roots = None
        execution.exit(exc_type, exc, traceback)
        if roots is not None:
            self._backward_seen = roots.calls > 0
        if roots is not None and roots.calls == 0 and exc_type is None and self.active and (
                _no_gradients(self.env.params) or self._grads_untouched()):
            # (a loop that sets p.grad itself, from torch.autograd.grad or torch.func, has gradients: it goes on)
            raise NoBackwardPassError(
                f"cockpit step {self.step}: no backward pass ran inside the cockpit's block, so there is nothing to "
                "compute the quantities from (nothing is stored for this step). The block must hold the backward "
                "pass: `with cockpit(step, info=info): loss.backward()`; a loss.backward() after the block, or a "
                "block that returns before it, leaves the cockpit nothing to read. A validation batch needs no "
                "block: log its loss with cockpit.log(step, valid_loss=...)."
            )
        if exc_type is not None or not self.active:
            return
        partition = execution.partition(self._split)
        partition.factor = None if factor is None else factor.factor
        partitions.add(partition)
        partitions.checks.factors.append(partition.factor)
        if factor is not None and factor.factor is None and factor.watched and factor.calls == 0:
            partitions.checks.loss_unreached = True
        if factor is not None and factor.factor is None and factor.seeable:
            partitions.checks.note(
                "loss factor not verified: info['loss'] got no gradient (the tensor backpropagated is neither "
                "info['loss'] nor computed from it), so a GradScaler or a division of the loss could not be "
                "seen and the declared factor was used. Pass the loss you call backward() on (or the one a "
                "GradScaler scales) as info['loss'], and its rows, computed with the same function and options "
                "(label_smoothing, weight=, ...) and reduction='none', as info['individual_losses']."
            )
        elif factor is not None and not factor.seeable:
            partitions.checks.note(
                "loss factor not verified: neither info['loss'] nor info['individual_losses'] is a tensor "
                "with its graph (detached, or numbers), so a GradScaler, a sum-reduced or divided loss "
                "could not be seen and the declared factor was used. Pass the loss tensor you call "
                "backward() on as info['loss'] (or individual_losses with their graph)."
            )
        if roots is not None:
            used = partition.factor if partition.factor is not None else partitions.checks.assumed
            why = undeclared_terms(roots, self.info.get("loss"), used, seen=partition.factor is not None,
                                   rows=self.info.get("individual_losses"))
            known = any(entry["check"] == "backpropagated_loss" for entry in partitions.checks.failed)
            if why is None and not known and factor is not None and factor.calls <= 1:
                why = _output_mismatch(factor.reference, used, _changing_hook(env.run))
            if why is not None and not known:  # (once per step: the first micro-batch that shows it)
                where = f", backward pass {self.micro + 1} of {self.micro_batches}" if self.micro_batches > 1 else ""
                partitions.checks.fail("backpropagated_loss", f"step {self.step}{where}: {why}.")
        for note in execution.notes:
            partitions.checks.note(note)
        if execution.rows_note is not None and not env.run.rows_told:
            env.run.rows_told = True
            warnings.warn(
                f"[cockpit_like] step {self.step}: {execution.rows_note} (told once: every such step's note is in "
                "cockpit.checks[step]['notes'] and the log)", UserWarning, stacklevel=_user_stacklevel())
        partitions.checks.declared_in_block = passes_in_block_of(self.info, self.step)
        if not execution.repeated_passes:  # several passes summed by the rows (declared or learned): counted
            partitions.checks.merged_passes += execution.passes_in_block - 1
        else:
            partitions.checks.extra_passes += execution.passes_in_block - 1
            learned = execution.merges_passes and not env.run.multi_pass
            partitions.checks.fail(
                "backward_passes",
                f"several backward passes ran inside the cockpit's block at step {self.step} (two losses with "
                "retain_graph=True, or the same loss twice; or torch.autograd.grad called inside the backward pass, "
                "such as a hook that solves an implicit layer's adjoint in a deep equilibrium model, whose passes "
                "are not the loss's), and the per-sample rows saw only one of them"
                + (". The cockpit has learned that this loop does so: from the next tracked step on it sums "
                   "each layer's output gradients over the block's backward passes (exact for separate losses; the "
                   "gradient check says where they are not)" if learned else
                   " (BackPACK's hooks cannot sum them: backpropagate the sum of the losses once)")
                + ".",
            )
            if learned:
                env.run.multi_pass = True

    def _watch_parameters(self) -> None:
        """Keep a projection of the parameters (and, for a step finished at the block's end, of the gradients) as
        the block leaves them, to be compared when ``info["optimizer"]`` steps (:meth:`Cockpit._check_optimizer_step`):
        the parameters must be those the optimizer steps from. Not for a block inside the optimizer's
        ``step(closure)`` (its closure: the parameters are the optimizer's by construction) or sharded ones."""
        env, optimizer = self.env, self.info.get("optimizer")
        if not (env.self_checks and _is_optimizer(optimizer)) or env.run.stepping is optimizer:
            return
        if needs_closure(optimizer):  # the block is inside its step (the first step's, before the hooks were set)
            return
        if any(is_dtensor(p) for p in env.params):
            return
        # the gradients as the step's last backward pass leaves them, where the step ends at this block (a deferred
        # step checks its own when it finishes)
        grads = _fingerprint(env.params, self.step) if self.last and not self.open_ended else None
        watch = env.run.watch
        if watch is not None and watch[0] == self.step and watch[1] is optimizer:
            # a further backward pass of the step: the parameters are compared with the first one's
            env.run.watch = (*watch[:3], grads)
            return
        env.run.watch = (self.step, optimizer, parameter_prints(env.params, self.step), grads)

    def finish(self, at_optimizer_step: bool = False) -> None:
        """Merge the step's backward passes, check them, track the quantities and publish what they stored
        (``at_optimizer_step``: called as ``info["optimizer"]`` begins its step).

        All or nothing: until the step's stream lines are queued (:meth:`RunOutput.commit`), a failure (any
        exception, a ``KeyboardInterrupt`` anywhere) takes back what the step stored in memory, so that it stores
        nothing, in memory as in the stream, and its next steps run as if it had raised in its block."""
        env, run, output = self.env, self.env.run, self.env.output
        guard_module_hooks(env.models())  # before the next forward pass hands them to its graph
        before = (run.finished, run.updates)
        self._outputs_before = {}
        output.hold()
        try:
            for quantity in self.active:  # how each output ends now: a failure puts it back so
                self._outputs_before[id(quantity)] = (len(quantity.output), dict(_last_items(quantity.output, 2)))
            new_values = self._compute_and_store(at_optimizer_step)
            held = output.commit()
        except BaseException:
            if output.rollback():  # not stored: as if the step had raised in its block
                self._take_back(before)
                self._abandon(None)
            else:
                self._abandon(None, stored=True)
            raise
        output.deliver(held)  # the stream, then the listeners
        if new_values:
            env.diagnose(new_values)

    def _take_back(self, before: tuple) -> None:
        """The step failed before it was stored: its quantities' outputs end as they did before it (the values
        it stored are dropped, whether or not the failure let the step note them) and what they started at it is
        dropped (:meth:`Quantity.forget`: it can be tracked again); the run's bookkeeping of finished steps is as it
        was ``before``."""
        for quantity in self.active:
            if id(quantity) not in self._outputs_before:
                continue  # (nothing was tracked before its snapshot)
            count, tail = self._outputs_before[id(quantity)]
            output = quantity.output
            for step in list(itertools.islice(reversed(output), max(len(output) - count, 0))):  # added since
                del output[step]
            for step, value in tail.items():  # replaced since
                if output.get(step, _MISSING) is not value:
                    output[step] = value
            quantity.forget(self.step)
        self.env.run.finished, self.env.run.updates = before
        self.completed = self.skipped = False

    def _compute_and_store(self, at_optimizer_step: bool) -> dict[int, dict[str, Any]] | None:
        """The body of :meth:`finish`: what to diagnose (``None``: nothing, the step stores no values)."""
        env, execution = self.env, self._execution
        ranks = env.ranks if self.active else None
        partitions = env.run.partitions
        env.run.partitions = None
        if env.run.pending is self:
            env.run.pending = None
        checks: StepChecks = partitions.checks
        new_values: dict[int, dict[str, Any]] = {}
        params = env.params
        scale, changed = self._step_scale(partitions, checks)
        if scale is None:  # the gradients are gone (cleared before the step finished)
            execution.free()
            env.store_checks(self.step, checks.to_dict())
            return None
        if changed is not None:
            checks.note(
                f"the gradients were scaled by {changed:.6g} between the end of the backward pass and the optimizer "
                "step (gradient clipping, GradScaler.unscale_): the quantities describe them as backward left them"
            )
        hook = _changing_hook(env.run)
        if hook is not None:
            checks.note(
                f"a backward hook of yours ({hook}) returned a new gradient in this step's backward pass: every "
                "quantity reads the gradients as the hooks left them, the curvature's products too (their graph "
                "holds what the hook did), so they describe the hooked gradient, not the loss's; where that shows "
                "(the gradient at the model's output, products that are not symmetric) nothing is stored"
            )
        untouched = self._untouched_stale(checks, params)
        for index in untouched:  # zero at this step: nothing of theirs for the per-sample check to take off
            del checks.stale[index]
        _record_coverage(checks, params, env.param_names(), untouched)
        if all(p.grad is None for p in params):
            execution.free()
            hooked = [name for name, p in zip(env.param_name_list(), params) if getattr(p, "_post_accumulate_grad_hooks", None)]
            if hooked:
                raise RuntimeError(
                    f"cockpit step {self.step}: no tracked parameter has a gradient after the backward pass, and "
                    f"{len(hooked)} of them have post-accumulate-grad hooks ({', '.join(hooked[:4])}"
                    f"{', ...' if len(hooked) > 4 else ''}): an optimizer stepped inside the backward pass "
                    "(`p.register_post_accumulate_grad_hook`, stepping and zeroing each gradient as it arrives) "
                    "leaves no gradient to read, and moves the parameters while the cockpit computes. The cockpit "
                    "reads a step's gradients after the backward pass: on tracked steps, keep the gradients to the "
                    "end of the backward pass and step the optimizer after the cockpit's block (e.g. make the hook "
                    "do nothing at steps where `any(q.is_active(step) for q in cockpit.quantities)`), or leave this loop "
                    "untracked."
                )
            clear = ("optimizer.zero_grad() or model.zero_grad() between loss.backward() and the block's end: call "
                     "it before the forward pass or after optimizer.step(), outside the block")
            if self._backward_seen:
                raise RuntimeError(
                    f"cockpit step {self.step}: a backward pass ran inside the cockpit's block, yet no tracked "
                    f"parameter has a gradient at the end of it. Either the gradients were cleared (set to None) inside "
                    f"the block after the backward pass ({clear}), or the loss does not depend on the parameters "
                    "given to Cockpit(params) (pass those of the model you train, e.g. Cockpit(model.parameters(), ...))."
                )
            raise RuntimeError(
                f"cockpit step {self.step}: no tracked parameter has a gradient at the end of the cockpit's block. "
                "Call loss.backward() inside the block; do not clear the gradients inside it after the backward "
                f"pass ({clear}); and pass the parameters the loss depends on to Cockpit(params)."
            )
        # the optimizer steps on p.grad as it is at its step: without a declared GradScaler's scale, which the
        # scaler takes off before (where the step finishes at the optimizer's step, it has already)
        view = StepGradients(
            params, scale, unscaled_later=1.0 if at_optimizer_step else partitions.grad_scaler, zeros=untouched,
            kept=self._kept if self._use_kept else None, graph_scale=None if changed is None else scale / changed,
        )
        self._kept = None  # the view holds them while the quantities read them
        try:
            try:
                reduction = None if ranks is None else ranks.synchronise(self.step, params, partitions)
            except UnequalBatchError as error:
                raise UnequalBatchError(f"{error}{_ending_here(self.active, self.step, env)}") from error
            skippable = partitions.skippable or scale / max(len(partitions.partitions), 1) > 1.0
            if skippable and not gradients_finite(params):
                env.store_skipped(self.step, {"reason": "grad_scaler", "scale": scale})
                self.skipped = True
                self._count_updates()
                self._end_at_skipped_step(params)
                return None
            if partitions.loss_warning is not None:  # the step is tracked after all: its non-finite loss is told now
                self._tell_loss(partitions.loss_warning)
            view.apply()  # unscaled, whole gradients (GradScaler, FSDP2); zeros for parameters without one
            if ranks is not None:
                ranks.unscale_graph_grads(view)
            # in one process the needs computed after the backward pass (Hessian-vector products through p.grad)
            # wait for the checks: a step that failed one (stale gradients, a second pass, changed parameters)
            # stores no number, and its p.grad (or its graph) may not be the step's. Under DDP every rank
            # computes them, as its collectives must match the other ranks'
            whole = {} if ranks is None else execution.whole_step_results()
            stats, info = partitions.merge(params, whole, reduction)
            if len(partitions.partitions) > 1 and "micro_batches" not in self.info:
                env.run.accumulates = True
            names = env.param_name_list()
            if checks.stale or untouched:
                self._judge_stale(checks, names, scale, untouched)
            if self._probe is not None and self._probe in stats:
                checks.compare_probe(stats[self._probe], self._probe.seed, view.params,
                                     lambda p: p.grad, lambda i: names[i], stale_scale=scale)  # fmt: skip
            if not self._loss_is_finite or checks.nonfinite_gradients or any_nonfinite(self._fingerprint):
                _note_nonfinite_gradients(checks, self.step, view.params, names)
            if execution.curvature_unscaled:
                checks.fail(
                    "loss_factor",
                    f"the backpropagated loss was {checks.factors[-1]:g} x info['loss'] where {checks.assumed:g} was "
                    "assumed, and BackPACK's Hessian diagonal of a scaled loss cannot be corrected at this step (it "
                    "needs the GGN diagonal, which the cockpit now computes beside it from the next step on)",
                )
                env.run.scaled_losses = True
            graph_gone = False
            # the loss's own second derivative is not that of the cross-entropy its value and gradient declare
            # (backends/loss_curvature.py): the quantities that read Hessian-vector products store nothing at the
            # step, and their products are not computed (in one process; under DDP they ran before the merge)
            wrong_curvature = getattr(stats.get(LossCurvatureCheck()), "wrong", False)
            products = {env.name_of(q) for q in self.active if q.hessian_products(self.step)}
            if ranks is None and checks.valid:
                try:
                    leave_out = products if wrong_curvature else set()
                    stats.update(partitions.merge_whole(execution.whole_step_results(leave_out)))
                except (MissingGraphError, GraphModifiedError) as error:
                    if not at_optimizer_step:
                        raise
                    # the step waited for the optimizer, and the loop dropped the gradients' graph meanwhile (p.grad
                    # detached or replaced before optimizer.step()) or changed what it reads in place (SAM moving the
                    # weights and back): no products, the run goes on
                    what = ("carried no graph (p.grad detached or replaced between the backward pass and "
                            "optimizer.step())" if isinstance(error, MissingGraphError) else
                            "could not be differentiated again (parameters or gradients changed in place between the "
                            "backward pass and optimizer.step(), as a SAM step that moves the weights and back does)")  # fmt: skip
                    checks.note(
                        f"no Hessian-vector products at step {self.step}: the step waited for the optimizer's step "
                        f"(see the notes above), and by then the gradients {what}, so the quantities that need them "
                        f"store nothing at this step ({error})"
                    )
                    graph_gone = True
            stats.update({asked: stats[met_by] for asked, met_by in execution.aliases if met_by in stats})
            record = context.StepRecord(
                global_step=self.step, info=info, params=view.params, stats=stats,
                loss_is_finite=self._loss_is_finite, live_params=params, at_optimizer_step=at_optimizer_step,
                rows_tolerance=float((checks.gradient or {}).get("tolerance", 0.0)),
                inside_optimizer_step=self._inside_step, gradient_hook=hook,
            )
            context._activate(record)
            # a step that failed a check stores no numbers (never a wrong one): its checks say why; where every
            # failed check concerns only the per-sample rows, the quantities that read none are kept
            skipped = set() if checks.valid else self._left_out_by_failed_checks(checks)
            skipped |= execution.left_out_owners().union(*(partition.left_out for partition in partitions.partitions))
            if graph_gone:
                skipped |= products
            if wrong_curvature and products - skipped:
                checks.note(stats[LossCurvatureCheck()].note(self.step, sorted(products - skipped)))
                skipped |= products
            rows = info.get("batch_size")
            if isinstance(rows, int) and rows < 2:
                single = sorted(env.name_of(q) for q in self.active if q.needs_two_samples and env.name_of(q) not in skipped)
                if single:
                    skipped |= set(single)
                    checks.note(
                        f"{', '.join(single)} left out: the step has {rows} sample(s), and they estimate a variance "
                        "over the step's samples (divisor B - 1), undefined with one (Cockpit stores inf or NaN); "
                        "the two-step ones (Alpha) also store nothing for the step before"
                    )
            self._note_lost_ends(checks)
            for quantity in self.active:  # (a quantity that fails: finish takes back what the step stored)
                if env.name_of(quantity) in skipped:
                    quantity.skip_at(self.step, view.params)
                    continue
                self._track(quantity, new_values, view.params)
            self.completed = True
            for note in record.notes:  # what the quantities said about their numbers
                checks.note(note)
            checks.standard_errors.update(record.standard_errors)
            if not env.keeps_output():  # DDP: computed on every rank, kept on the log rank only
                for quantity in self.active:
                    for step in new_values:
                        quantity.output.pop(step, None)
                new_values = {}
        except NoSecondDerivativeError as error:
            if error.kernel:
                raise
            # name the quantities of this step that need Hessian-vector products
            products = tuple(env.name_of(q) for q in self.active if q.hessian_products(self.step))
            raise error.for_step(self.step, products) from error.error
        finally:
            view.restore()
            context._activate(None)
            if ranks is not None:
                ranks.end_step()
            execution.free()
        record = checks.to_dict()
        env.store_checks(self.step, record)
        tracked_names = {env.name_of(q) for q in self.active}
        env.run.finished = (self.step, tracked_names)
        self._count_updates()
        env.output.note_tracked(self.step)
        for step in [s for s in new_values if s in env.run.invalid_steps]:  # late values of a withdrawn step
            for name in [n for n in new_values[step] if n in tracked_names]:
                del new_values[step][name]
                for quantity in self.active:
                    if env.name_of(quantity) == name:
                        quantity.output.pop(step, None)
        for step, values in sorted(new_values.items()):
            env.output.publish(step, values)
        if env.keeps_output() and notable(record):  # the rules read the checks a log holds (frozen parameters)
            new_values[self.step] = {**new_values.get(self.step, {}), CHECKS_KEY: record}
        return new_values

    def _left_out_by_failed_checks(self, checks: StepChecks) -> set[str]:
        """The quantities a step that failed ``checks`` stores nothing for: every active one, unless each failed
        check is one of :data:`ROW_CHECKS`, which concern only what the per-sample rows (and the curvature the
        backward pass computed beside them) describe. ``p.grad`` is then the gradient autograd accumulated in the
        block from zero (the stale-gradient check passed), unscaled by the loss factors seen (:meth:`_step_scale`:
        a GradScaler or micro-batches need not be declared; where a factor was not seen, nothing is kept), so the quantities that asked for nothing beyond the
        backward pass (``StepNeeds.askers``: Loss, GradNorm, UpdateSize, Distance, ParamNorm, DataStats,
        ActivationStats, the optimizer's settings) are right and are kept, with a note (outside trial 9: a
        Bayes-by-backprop loss with its KL term on the parameters failed the gradient check at every step, and
        the run stored no gradient norm, no loss, no input scale, so its diagnosis saw nothing)."""
        names = {self.env.name_of(q) for q in self.active}
        if not {failed.get("check") for failed in checks.failed} <= ROW_CHECKS:
            return names
        if not checks.factors or any(f is None for f in checks.factors):
            return names  # a loss factor not seen: p.grad is unscaled by the declared one, which nothing verified
        if len(checks.factors) + checks.extra_passes > checks.declared:
            # backward passes nobody declared, taken for micro-batches accumulating into p.grad: where the step
            # fails the gradient check, that reading is what failed (outside trial 12: SAM's two passes in blocks
            # of one step, p.grad zeroed between them, stored GradNorm as half of it and Loss as the mean of the
            # losses at two points)
            return names
        skipped = names & set(self._askers)
        kept = sorted(names - skipped)
        if kept and skipped:
            checks.note(
                f"{', '.join(kept)} stored although the step failed the "
                f"{' and '.join(sorted({f.get('check') for f in checks.failed}))} check: they read only p.grad, the "
                f"parameters, the loss and the forward pass, which that check does not concern; "
                f"{', '.join(sorted(skipped))} not stored"
            )
        return skipped

    def _end_at_skipped_step(self, params: list[torch.Tensor]) -> None:
        """A GradScaler skips the step: it stores nothing, but the update of the step before was made and the
        parameters are fine: the values that end here and read only the parameters (UpdateSize) are stored, the
        others (Alpha: this step's loss and gradients) are not, and a note at their step says why."""
        env = self.env
        new_values: dict[int, dict[str, Any]] = {}
        lost: dict[int, list[str]] = {}
        for quantity in self.active:
            name = env.name_of(quantity)
            before = dict(_last_items(quantity.output, 2))
            for start in quantity.skip_optimizer_step(self.step, params):
                lost.setdefault(start, []).append(name)
            for step, value in _last_items(quantity.output, 2):
                if before.get(step, _MISSING) is not value:
                    if step in env.run.invalid_steps or not env.keeps_output():
                        quantity.output.pop(step, None)
                    else:
                        new_values.setdefault(step, {})[name] = value
        for step, values in sorted(new_values.items()):
            env.output.publish(step, values)
        for start, names in sorted(lost.items()):
            names = sorted(names)
            env.add_note(start, (
                f"{not_stored(names, start)}: a GradScaler skipped step {self.step} (its gradients are not finite), "
                f"and {_they(names, 'it ends', 'they end')} with that step's loss and gradients (the update from "
                f"step {start} to {self.step} was made: what reads only the parameters, UpdateSize, is stored)."
            ))  # fmt: skip

    def _note_lost_ends(self, checks: StepChecks) -> None:
        """Values of two-step quantities (UpdateSize, Alpha) whose end step the loop's step numbers skipped (0, 2,
        4, ...): as in Cockpit they are not stored; a note here, and a warning once per run, say why."""
        lost: dict[tuple[int, int], list[str]] = {}
        for quantity in self.active:
            for start, end in quantity.lost_ends(self.step):
                lost.setdefault((start, end), []).append(self.env.name_of(quantity))
        raised = {pair: sorted(names) for pair, names in lost.items() if pair[1] in self.env.run.raised}
        lost = {pair: sorted(names) for pair, names in lost.items() if pair not in raised}
        for (start, end), names in sorted(raised.items()):  # entered, but its block raised: nothing of it stored
            checks.note(f"{not_stored(names, start)}: {_they(names, 'it ends', 'they end')} at step {end}, whose block "
                        "raised (nothing of that step was stored).")  # fmt: skip
        for (start, end), names in sorted(lost.items()):
            checks.note(
                f"{not_stored(names, start)}: {_they(names, 'it needs', 'they need')} the cockpit entered at step "
                f"{end} (the parameters after the update of step {start}), and the next step it was entered at is "
                f"{self.step}. Quantities of two steps end at the next step number: number the optimizer steps 0, 1, "
                "2, ... (a schedule picks the steps whose quantities are computed)."
            )  # fmt: skip
        if lost and not self.env.run.gap_warned:
            self.env.run.gap_warned = True
            (start, end), names = min(lost.items())
            warnings.warn(
                f"[cockpit_like] the step numbers skip step {end} (step {self.step} follows step {start}): "
                f"{not_stored(names, start)}, as in Cockpit (they end at the next step number). Quantities of two "
                "steps need consecutive step numbers, one per optimizer step; the notes of the steps in the checks say "
                "which values are missing.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )

    def _count_updates(self) -> None:
        """From now on count the steps of the step's ``info["optimizer"]`` (:attr:`StepRun.updates`)."""
        optimizer = self.info.get("optimizer")
        hooked = bool(getattr(getattr(type(optimizer), "step", None), "hooked", False))
        self.env.run.updates = [self.step, id(optimizer), 0, hooked] if _is_optimizer(optimizer) else None

    def _optimized(self) -> set[int] | None:
        """``id`` of the parameters ``info["optimizer"]`` updates (``None``: no optimizer given)."""
        optimizer = self.info.get("optimizer")
        if not _is_optimizer(optimizer):
            return None
        return {id(p) for group in optimizer.param_groups for p in group["params"]}

    def _untouched_stale(self, checks: StepChecks, params: list[torch.Tensor]) -> list[int]:
        """Parameters outside ``info["optimizer"]`` whose p.grad held earlier steps' gradients and that this step's
        backward passes left as they were (a replaced layer's old parameters, a branch no longer used): their
        gradient at this step is zero, not what p.grad holds."""
        optimized = self._optimized()
        if not checks.stale or optimized is None:
            return []
        now = _stale_gradients([params[i] for i in checks.stale], _probe_seed(self.step), list(checks.stale))
        return [i for i, before in checks.stale.items() if id(params[i]) not in optimized and now.get(i) == before]

    def _judge_stale(self, checks: StepChecks, names: list[str], scale: float, untouched: list[int] = ()) -> None:
        """Gradients that were not zero when the step's first backward pass began: for parameters the optimizer
        updates, the step's gradient is not its own (a forgotten ``zero_grad``): the step fails and the
        diagnosis hears of it once; for others (left out of the optimizer, so never zeroed) a note, and those
        the step's backward passes did not reach count as zero."""
        optimized = self._optimized()
        params = self.env.params
        stale = [i for i in checks.stale if optimized is None or id(params[i]) in optimized]
        others = [i for i in checks.stale if i not in stale and i not in untouched]
        if untouched:
            checks.note(
                f"p.grad of {', '.join(names[i] for i in untouched[:3])}{' ...' if len(untouched) > 3 else ''} (not "
                "in info['optimizer']) holds gradients of earlier steps and got nothing from this step's backward "
                "pass: counted as zero (in no_gradient). Parameters no longer in the model (a replaced layer) stay "
                "tracked by this cockpit: to track the new ones, create a new Cockpit with them."
            )
        if others:
            checks.note(
                f"p.grad of {', '.join(names[i] for i in others[:3])}{' ...' if len(others) > 3 else ''} (not in "
                "info['optimizer'], so never zeroed) holds gradients of earlier steps: GradNorm, the gradient tests "
                "(NormTest, InnerTest, OrthoTest, which compare the rows with p.grad) and the other quantities that "
                "read p.grad see their sum with this step's gradient; the per-sample check compared this step's part. "
                "Zero these gradients with the others (model.zero_grad(), or add the parameters to the optimizer)"
            )
        if not stale:
            return
        shown = ", ".join(names[i] for i in stale[:3]) + (" ..." if len(stale) > 3 else "")
        previous = self.env.run.unstepped
        if previous is not None and previous < self.step:
            # numbered per micro-batch: the previous step's values describe a part of this optimizer step
            self.env.run.split_step = previous
            reason = (
                f"p.grad of {len(stale)} parameters ({shown}) was not zero when the backward pass of step {self.step} "
                f"began, and info['optimizer'] of step {previous} did not step between the two: they are micro-batches "
                "of one optimizer step entered under two step numbers (the values of both describe a part of it, "
                f"and step {previous}'s are withdrawn). Give every micro-batch of an optimizer step the same "
                "global_step (count optimizer steps, not micro-batches), with info['micro_batches'] = their number."
            )
        else:
            reason = (
                f"p.grad of {len(stale)} parameters ({shown}) was not zero when the backward pass of step {self.step} "
                "began, so the gradient of the step adds up gradients of earlier backward passes: a forgotten "
                "optimizer.zero_grad(), or a backward pass outside the cockpit's block (a micro-batch of this optimizer "
                "step: enter the cockpit around every micro-batch, with the same global_step and info['micro_batches'] "
                "= their number). Call optimizer.zero_grad() before each optimizer step's first backward pass."
            )
        checks.fail("stale_gradient", reason, parameters=[names[i] for i in stale])
        if not self.env.run.stale_reported:
            self.env.run.stale_reported = True
            self.env.report(Finding(
                rule="gradients-accumulate", severity="warning", step=self.step,
                message=(f"the gradients add up over steps: p.grad was not zero when step {self.step}'s backward pass "
                         f"began ({len(stale)} parameters, e.g. {names[stale[0]]}); the cockpit's self-check saw it"),
                fix="call optimizer.zero_grad() before each optimizer step's first backward pass",
                evidence={"strength": "conclusive", "parameters": len(stale), "source": "self-check"},
            ))  # fmt: skip

    def _step_scale(self, partitions: StepPartitions, checks: StepChecks) -> tuple[float | None, float | None]:
        """The factor between the accumulated gradients and the step's mean-loss gradient, and the uniform
        factor by which the gradients changed after backward (``None``: unchanged).

        Each backward pass ``k`` propagated ``f_k x`` its mean loss (``f_k`` seen by the hook on
        ``info["loss"]``, else what was declared); with ``K`` equal passes the step's mean-loss gradient
        is ``p.grad / (f K)``; with passes of ``B_k`` rows whose seen factors are ``f_k = c B_k / B`` (their shares
        of the step's rows) it is ``p.grad / c`` (:meth:`StepPartitions.gradient_scale`)."""
        passes = len(partitions.partitions)
        factors = [p.factor for p in partitions.partitions]
        if all(f is not None for f in factors):
            scale = partitions.gradient_scale()
            if scale is not None and _undeclared_factor(scale, partitions.scale):
                ratio = scale / partitions.scale
                # a GradScaler's scale is a power of two: nothing to declare for it (docs/your_training_loop.md), and
                # the note said "declare" at every step of that documented loop (outside trial 29)
                scaler = ratio > 1 and math.frexp(ratio)[0] == 0.5
                cause = _factor_cause(ratio, checks) or (
                         "a power of two, as a GradScaler's scale is (nothing needs declaring for one: "
                         "info['grad_scaler'] = scaler says so and ends this note); else a sum-reduced loss with "
                         "info['loss'] its mean or a loss multiplied by hand (declare info['loss_scale'] where intended)"
                         if scaler else "an undeclared GradScaler, a sum-reduced loss with info['loss'] its mean, a "
                         "loss multiplied by hand: declare the factor, info['grad_scaler'] or info['loss_scale'], where "
                         "it is intended")  # fmt: skip
                checks.note(
                    f"the gradients are {scale:.6g} x those of the step's mean loss (info['loss'], over the step's "
                    f"micro-batches), where the declarations say {partitions.scale:.6g}: the quantities describe "
                    f"the mean loss (GradNorm is ||p.grad|| / {scale:.6g}; the per-sample rows and the curvature are "
                    f"divided alike). The factor is {cause}."
                )
            if scale is None:
                rows = [p.rows for p in partitions.partitions]
                checks.fail("loss_factor", f"the backward passes of step {self.step} propagated their losses with "
                            f"different factors {factors}" + (f" over micro-batches of {rows} rows" if len(set(rows)) > 1
                            else "") + ": the accumulated gradient is not a multiple of the step's mean-loss gradient "
                            "and cannot be unscaled (each micro-batch's factor must be the same share of its rows)")
                scale = factors[0] * passes
        else:
            declared = checks.declared
            scale = partitions.scale * passes / declared if declared > 1 else partitions.scale
        if self._fingerprint is None:
            return scale, None
        factor = gradient_factor(self._fingerprint, _fingerprint(self.env.params, self.step))
        if factor == CLEARED:
            reason = (f"the gradients were cleared before step {self.step} was finished: the step ends when "
                      "info['optimizer'] steps or the next step begins")
            if scale / passes > 1.0:
                self.env.store_skipped(self.step, {"reason": "grad_scaler", "scale": scale})
            checks.fail("gradient", reason)
            return None, None
        if factor is not None and abs(factor - 1.0) <= 1e-6:
            return scale, None
        if factor is not None:
            return scale * factor, factor
        if self._kept is not None:  # the step waited for the optimizer (Alpha) and kept the backward pass's gradients
            self._use_kept = True
            checks.note(f"the gradients changed between the end of the backward pass of step {self.step} and the "
                        "optimizer step, and not by one factor ("
                        + (NONFINITE_CHANGE if any_nonfinite(self._fingerprint) else
                           "clipping by value, gradient noise, SAM's second pass") + "): "
                        "the quantities describe the gradients of the backward pass (kept until the optimizer's step), "
                        "Alpha predicts the update from those the optimizer steps with")
            return scale, None
        checks.fail("gradient", f"the gradients of step {self.step} changed between the end of the backward pass and "
                    "the optimizer step, and not by one factor ("
                    + (NONFINITE_CHANGE if any_nonfinite(self._fingerprint) else
                       "per-parameter clipping? an optimizer wrapper?") + "): the "
                    "cockpit cannot tell the gradient the per-sample rows belong to")
        return scale, None

    def _abandon(self, ranks, stored: bool = False) -> None:
        """The step failed (an exception in the user's backward pass, or anywhere in the cockpit's own work, a
        ``KeyboardInterrupt`` included): it is dropped (the other ranks are told, once), and everything it set up
        is taken down (:meth:`release`). ``stored``: the step was stored before the failure; only the take-down.
        A take-down that is itself interrupted is finished when the next step begins (:attr:`StepRun.loose`)."""
        run = self.env.run
        if self not in run.loose:
            run.loose.append(self)
        try:
            if not stored:
                run.partitions = None
                if run.pending is self:
                    run.pending = None
                if run.watch is not None and run.watch[0] == self.step:
                    run.watch = None  # (no check at the optimizer's step of a step that stored nothing)
                run.raised.add(self.step)
                if ranks is not None and not self._told:  # tell the other ranks (backends/distributed.py)
                    self._told = True
                    ranks.abandon_step(self.step, self.env.params, int(self.info.get("batch_size", 0)))
        finally:
            self.release()

    def release(self) -> None:
        """Take down what the step set up around the user's backward pass, from whatever state a failure left:
        the hooks on the loss, the watcher of ``torch.autograd.backward``, BackPACK's context, the hook backend's
        hooks, the warning filter (:meth:`StepExecution.close`), and free its buffers. Safe to call again."""
        if self._factor is not None:
            self._factor.remove()
        if self._roots is not None:
            self._roots.remove()
        if self._execution is not None:
            self._execution.close()
        self._kept = None
        run = self.env.run
        if self in run.loose:
            run.loose.remove(self)

    def _track(self, quantity: Quantity, new_values: dict[int, dict[str, Any]], params: list[torch.Tensor]) -> None:
        name = self.env.name_of(quantity)
        before = dict(_last_items(quantity.output, 2))
        record = context.get_record(self.step)
        record.quantity = name  # a standard error it keeps is filed under its name in the cockpit
        try:
            quantity.track(self.step, params, self.info.get("loss"))
        except Exception as error:
            if self._loss_is_finite:
                raise
            warnings.warn(
                f"[cockpit_like] step {self.step}: {name} failed on the non-finite loss "
                f"({type(error).__name__}: {error}); storing NaN. Find where the loss became non-finite with "
                "cockpit.records (docs/recorder.md)",
                RuntimeWarning,
                stacklevel=4,
            )
            quantity.output[self.step] = math.nan
        finally:
            record.quantity = None
        for step, value in _last_items(quantity.output, 2):
            if before.get(step, _MISSING) is not value:
                new_values.setdefault(step, {})[name] = value


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def not_stored(names: list[str], start: int) -> str:
    """``"A, B of step 3 are not stored"``: the start of the notes on two-step values that are lost."""
    return f"{', '.join(names)} of step {start} {_they(names, 'is', 'are')} not stored"


def _they(names: list[str], one: str, several: str) -> str:
    return one if len(names) == 1 else several


def _kept_copy(grad: torch.Tensor) -> torch.Tensor:
    """A copy of ``grad`` that the loop's in-place changes (clipping, noise) leave alone; with its graph (a clone
    is differentiable) where it has one."""
    with torch.enable_grad():
        return grad.clone() if grad.requires_grad else grad.detach().clone()


def _same_gradients(params, entry) -> bool:
    """Whether every ``p.grad`` is the tensor (and version) it was at the block's entry: nothing wrote one."""
    return entry is not None and len(entry) == len(params) and all(
        (None if p.grad is None else (id(p.grad), p.grad._version)) == seen for p, seen in zip(params, entry))


def _changing_hook(run) -> str | None:
    """The name of a backward hook of the user's that returned a new gradient since the open step's first backward
    pass began (:func:`~cockpit_like.backends.user_state.gradient_changes`), else ``None``."""
    count, name = gradient_changes()
    return name if count > run.gradient_changes else None


def _factor_cause(ratio: float, checks: StepChecks) -> str | None:
    """The likelier cause of an undeclared factor ``ratio`` between the step's gradients and its mean loss's, where
    the step says more than a GradScaler would (outside trial 34: a gradient penalty's second pass through the loss,
    undeclared micro-batches and a loss not divided by its micro-batches were each read as a GradScaler or a factor
    to declare, and declaring it changed nothing): a ratio of 1/K with no micro-batches declared, K where K are
    declared, a check the step failed; else ``None``."""
    if not ratio > 0:
        return None
    failed = sorted({entry.get("check") for entry in checks.failed} - {None})
    whole = round(ratio) if ratio >= 1 else round(1 / ratio)
    near = whole >= 2 and abs((ratio if ratio >= 1 else 1 / ratio) - whole) <= 1e-6 * whole
    # (where the loss backpropagated has other terms, the factor is part of them: outside trial 43, a distillation
    # loss 0.5 CE + 0.5 KD was told to declare 2 micro-batches, which then raised)
    if near and ratio < 1 and checks.declared == 1 and "backpropagated_loss" not in failed:
        return (f"1/{whole}: most likely the loss divided by {whole}, as gradient accumulation over {whole} "
                f"micro-batches does; then declare info['micro_batches'] = {whole} at each micro-batch's block (the "
                f"same step number), not info['loss_scale']; a loss multiplied by 1/{whole} by hand for another "
                "reason is declared with info['loss_scale']")
    if near and ratio > 1 and checks.declared == whole:
        return (f"the number of declared micro-batches, {whole}: each micro-batch's loss was backpropagated as it "
                f"is, not divided by {whole} (loss / {whole} forgotten, or intended: then nothing needs changing, "
                "the quantities describe the mean loss)")
    if failed:
        several = len(failed) > 1
        return (f"most likely what the failed {' and '.join(failed)} check{'s' if several else ''} of this step "
                f"name{'' if several else 's'} (see {'their reasons' if several else 'its reason'}); declaring a "
                "factor does not mend that")
    return None


def _output_mismatch(reference, factor: float | None, hook: str | None = None) -> str | None:
    """The reason where the gradient the user's backward pass brought to the model's output is not ``factor``
    times the declared loss's there (:class:`~cockpit_like.checks.loss_factor.OutputReference`), else None;
    ``hook``: a backward hook of the user's that returned a new gradient in the pass (named first)."""
    if reference is None or factor is None:
        return None
    error = reference.mismatch(factor, tolerance_for)
    if error is None:
        return None
    if hook is not None:
        return (
            f"the gradient the backward pass brought to the model's output is {error:.3g} (relative) off {factor:.6g} "
            f"times the gradient of info['loss'] there, and a backward hook of yours ({hook}) returned a new "
            "gradient in that pass: the per-sample rows and the curvature's products would describe the hooked "
            "gradient, not the loss's. Change the gradients after the cockpit's block (on p.grad, before the "
            "optimizer's step) instead of in a hook (docs/your_model.md, hooks)"
        )
    return (
        f"the gradient the backward pass brought to the model's output is {error:.3g} (relative) off {factor:.6g} "
        "times the gradient of info['loss'] there, although the value backpropagated is that multiple of "
        "info['loss']: the tensor backpropagated has a term whose value is 0 but whose gradient is not (a - "
        "a.detach(), a stop-gradient surrogate, a straight-through or DiCE-style estimator) or a backward "
        "function that is not its forward's derivative, between the model's output and the loss. The per-sample "
        "rows follow that gradient and info['individual_losses'] do not, so the quantities that read both "
        "(Alpha, the per-sample tests against the loss) would mix two losses. Declare the loss whose gradient "
        "you backpropagate, or backpropagate info['loss'] alone (docs/your_training_loop.md#self-checks)"
    )


def _undeclared_factor(seen: float | None, assumed: float) -> bool:
    """Whether the factor seen between the step's gradient and its mean-loss gradient (from the factors seen at
    ``info["loss"]``, :meth:`StepPartitions.gradient_scale`) is not the declared one beyond rounding (they are read
    from gradients, in the loss's dtype: a relative 1e-3 holds half precision)."""
    return seen is not None and abs(seen - assumed) > 1e-3 * max(abs(assumed), abs(seen))


def _no_gradients(params) -> bool:
    """Whether no tracked parameter holds a gradient (each ``p.grad`` None or zero)."""
    with torch.no_grad():
        return all(p.grad is None or not bool(p.grad.any()) for p in params)


class NoBackwardPassError(RuntimeError):
    """A tracked step's ``with`` block ended without a backward pass in it."""


def _user_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warnings.warn`, called from the caller of this function, that names the first
    frame outside ``cockpit_like`` (the user's ``with cockpit(...)``, ``cockpit.end()`` or ``optimizer.step()``)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level


_MISSING = object()
_UNCHECKED = object()


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _ending_here(active, step: int, env) -> str:
    """Where the quantities tracking ``step`` only end there (two-step quantities started at the step before, whose
    schedule leaves ``step`` out): the note for an error whose advice is to leave the step untracked."""
    ending = sorted(env.name_of(q) for q in active if getattr(q, "is_end", None) and q.is_end(step)
                    and not q.is_start(step))
    if not ending or len(ending) < len(active):
        return ""
    return (f" (Step {step} is tracked although the schedule leaves it out: {ending} started at step "
            f"{step - 1} end here, at the parameters after its update. Give the ranks equal rows at the step after a "
            "tracked one too, or leave those quantities out.)")


def needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS: it evaluates the loss itself, possibly several times)."""
    return _is_optimizer(optimizer) and _closure_required(type(optimizer))


@functools.lru_cache(maxsize=None)
def _closure_required(cls: type) -> bool:
    """:func:`needs_closure` of an optimizer class (its ``step`` signature, read once per class)."""
    import inspect

    try:
        closure = inspect.signature(cls.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


#: steps that share the probe's directions (drawn again every so many steps, kept in between)
PROBE_PERIOD = 16


def _probe_seed(step: int) -> int:
    """The seed of a step's probe directions (the cockpit's own generator, independent of every user stream):
    new directions every :data:`PROBE_PERIOD` steps."""
    return 0x5EED_C0C0 + 7 * (int(step) // PROBE_PERIOD)


class Fingerprint(dict):
    """``{index: print}`` of the gradients (:func:`_fingerprint`) with ``spreads[index]``: the standard deviation
    of each projection over its probe's first direction, the scale of its rounding error (a projection drawn near
    0 is no more precise than the terms it sums)."""

    def __init__(self, prints: dict, spreads: dict[int, float]):
        super().__init__(prints)
        self.spreads = spreads


def _fingerprint(params: list[torch.Tensor], step: int) -> Fingerprint:
    """A projection of each gradient on a fixed random direction: compared at the step's end, it tells
    whether (and by which factor) the gradients changed after the backward pass. A gradient with NaN or
    infinite entries gets a :class:`~cockpit_like.checks.prints.NonFinitePrint` (NaN at the same places is
    unchanged)."""
    seed = _probe_seed(step) + 1
    prints, spreads = {}, {}
    with torch.no_grad():
        for index, p in enumerate(params):
            if p.grad is None:
                prints[index] = None
                continue
            directions = probe_directions(seed, index, p.shape, p.device)
            value, spread = torch.stack(project(p.grad, directions, spread=True)).tolist()
            prints[index] = value if math.isfinite(value) else finite_print(p.grad, directions)
            spreads[index] = spread if math.isfinite(spread) else 0.0
    return Fingerprint(prints, spreads)


def parameter_prints(params: list[torch.Tensor], step: int) -> list[float | NonFinitePrint]:
    """A projection of each parameter on a fixed random rank-one direction (the cockpit's own generator, another
    seed than the gradients'), ``O(numel)`` and one read from the device: compared when the optimizer steps, it
    tells whether the parameters are still those of the tracked backward pass. A parameter with NaN or infinite
    entries gets a :class:`~cockpit_like.checks.prints.NonFinitePrint` (read again, only then)."""
    seed = _probe_seed(step) + 2
    with torch.no_grad():
        values = project_all(seed, [(index, p.detach()) for index, p in enumerate(params)])
        return [
            value if math.isfinite(value) else finite_print(p, probe_directions(seed, index, p.shape, p.device))
            for index, (p, value) in enumerate(zip(params, values))
        ]


def parameters_moved(params: list[torch.Tensor], step: int, before: list[float | NonFinitePrint]) -> list[int]:
    """The indices of the parameters whose projection (:func:`parameter_prints`) differs from ``before`` by more
    than rounding: a perturbation added and subtracted again (``p.add_(e); p.sub_(e)``) is off by at most a few
    units of the last place of each entry, which projects to at most ``4 eps sqrt(numel) ||p||``. Non-finite
    entries are unchanged where they are the same ones (NaN where NaN was): only the finite ones are compared."""
    now = parameter_prints(params, step)
    moved = []
    for index, (then, later) in enumerate(zip(before, now)):
        (a, where_a), (b, where_b) = parts(then), parts(later)
        if where_a != where_b:  # non-finite entries appeared, went or moved
            moved.append(index)
            continue
        if a == b:
            continue
        param = params[index].detach()
        dtype = param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32
        eps = max(torch.finfo(dtype).eps, torch.finfo(param.dtype).eps if param.dtype.is_floating_point else 0.0)
        with torch.no_grad():
            if where_b:  # the norm of the finite entries
                param = torch.where(torch.isfinite(param), param, 0.0)
            scale = float(param.to(dtype).norm()) * math.sqrt(max(param.numel(), 1))
        if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > 4 * eps * scale:
            moved.append(index)
    return moved


#: why gradients that were not finite at the end of the backward pass changed before the optimizer's step
NONFINITE_CHANGE = ("they were not finite at the end of the backward pass, and NaN entries are not where they were: "
                    "clipping by the norm, for one, makes every entry of a non-finite gradient NaN")

#: :func:`gradient_factor` of gradients cleared in between
CLEARED = "cleared"


def gradient_factor(
    before: dict[int, float | NonFinitePrint | None], now: dict[int, float | NonFinitePrint | None]
) -> float | str | None:
    """The one factor the gradients were scaled by between two :func:`_fingerprint` projections (``1.0``:
    unchanged; clipping by the norm, ``GradScaler.unscale_``), :data:`CLEARED` where every gradient was cleared
    since, ``None`` where they changed other than by one factor (a gradient appeared, went, or moved apart, or
    its non-finite entries are not the same ones: NaN at the same places is unchanged, a factor leaves them)."""
    if all(v is None for v in now.values()):
        return CLEARED if any(v is not None for v in before.values()) else 1.0
    if any((before[i] is None) != (now.get(i) is None) for i in before):
        return None
    pairs = {i: (parts(before[i]), parts(now[i])) for i in before if before[i] is not None}
    if any(then[1] != later[1] for then, later in pairs.values()):
        return None
    finite = {i: (then[0], later[0]) for i, (then, later) in pairs.items()}
    if any(a == 0.0 and b != 0.0 for a, b in finite.values()):
        return None
    # each projection compared at the scale of its rounding (a float32 projection drawn near 0 by its direction
    # moved by 1e-4 of itself under clipping by one factor, on 1-2 of 6 steps of a GPT), the factor read from the
    # one drawn farthest from 0
    spreads = getattr(before, "spreads", {})
    scales = {i: max(abs(a), spreads.get(i, 0.0)) for i, (a, _) in finite.items() if a}
    if not scales:
        return 1.0
    best = max(scales, key=lambda i: abs(finite[i][0]) / scales[i])
    ratio = finite[best][1] / finite[best][0]
    return ratio if all(abs(finite[i][1] - ratio * finite[i][0]) <= 1e-5 * abs(ratio) * scales[i] for i in scales) else None


def gradients_changed(params: list[torch.Tensor], step: int, before: dict[int, float | NonFinitePrint | None]) -> bool:
    """Whether the gradients differ from their projections ``before`` other than by one factor; gradients cleared
    since then count as unchanged (:func:`gradient_factor`)."""
    return gradient_factor(before, _fingerprint(params, step)) is None


def _stale_gradients(
    params: list[torch.Tensor], seed: int, indices: list[int] | None = None
) -> dict[int, float | NonFinitePrint]:
    """``{index: projection}`` of the parameters whose p.grad is not zero before the step's backward pass (the probe's
    directions; nothing to read after ``zero_grad()``, which sets it to None). ``indices``: the tracked indices of
    ``params`` where they are some of the tracked parameters. A non-finite p.grad gets its
    :class:`~cockpit_like.checks.prints.NonFinitePrint` (the same NaN later: untouched)."""
    stale = {}
    with torch.no_grad():
        for index, param in zip(range(len(params)) if indices is None else indices, params):
            grad = param.grad
            if grad is None or is_dtensor(grad):
                continue
            value = print_of(grad, probe_directions(seed, index, param.shape, param.device))
            if value != 0.0:
                stale[index] = value
    return stale


def _note_nonfinite_gradients(checks: StepChecks, step: int, params: list[torch.Tensor], names: list[str]) -> None:
    """A note of how many entries of the step's gradients are NaN or infinite, and where (nothing where none is)."""
    counts = nonfinite_counts([(names[i], p.grad) for i, p in enumerate(params)])
    if not counts:
        return
    nan, inf = sum(c[1] for c in counts), sum(c[2] for c in counts)
    total = sum(p.grad.numel() for p in params if p.grad is not None)
    shown = ", ".join(f"{name} {n + i} of {size}" for name, n, i, size in counts[:3]) + (" ..." if len(counts) > 3 else "")
    checks.note(
        f"the gradients of step {step} are not finite: {nan + inf} of their {total} entries ({nan} NaN, {inf} "
        f"infinite; {shown}). What is computed from them is NaN or infinite, or leaves those entries out where "
        "its note says so; NaN where NaN was counts as unchanged at the optimizer's step. cockpit.records names "
        "the operation that made the first non-finite value (docs/recorder.md)."
    )


def _record_coverage(checks: StepChecks, params: list[torch.Tensor], names: dict[int, str], untouched=()) -> None:
    """Which tracked parameters are frozen, and which got no gradient at this step (``untouched``: p.grad holds only
    earlier steps' gradients)."""
    def name(index: int, param: torch.Tensor) -> str:
        return names.get(id(param), f"param_{index}")

    checks.frozen = [name(i, p) for i, p in enumerate(params) if not p.requires_grad]
    checks.no_gradient = [
        name(i, p) for i, p in enumerate(params) if p.requires_grad and (p.grad is None or i in untouched)
    ]


def _last_items(output: dict, count: int) -> list[tuple[int, Any]]:
    """The ``count`` most recently inserted items (O(count), not O(len(output)))."""
    items = []
    for item in reversed(output.items()):
        items.append(item)
        if len(items) == count:
            break
    return items


def _check_batch_size(size: Any, step: int) -> None:
    """``info["batch_size"]`` must be a positive whole number (an int, a NumPy or 0-d tensor integer)."""
    try:
        whole = not isinstance(size, bool) and int(size) == size and int(size) >= 1
    except (TypeError, ValueError, RuntimeError):
        whole = False
    if not whole:
        raise ValueError(f"cockpit step {step}: info['batch_size'] must be a positive int (the number of samples "
                         f"of this backward pass, e.g. len(x)), got {size!r}")


def check_sample_ids(info: dict, step: int, micro_batches: int = 1, distributed: bool = False) -> None:
    """``info["sample_ids"]`` must name each row of this backward pass once: a 1-D integer tensor, or a list
    (tuple) of ints or strings, with as many entries as ``info["batch_size"]`` (else ``individual_losses``)."""
    ids = info["sample_ids"]
    how = ("pass one id per row of this backward pass, e.g. info['sample_ids'] = indices (the dataset indices "
           "of the batch, a 1-D int tensor) or a list of ints or strings")
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"cockpit step {step}: info['sample_ids'] is a {ids.dtype} tensor of shape "
                             f"{list(ids.shape)}; {how}")
        count = ids.shape[0]
    elif isinstance(ids, (list, tuple)):
        kinds = {type(item) for item in ids}
        if not all(isinstance(item, (int, str)) and not isinstance(item, bool) for item in ids):
            bad = next(item for item in ids if not isinstance(item, (int, str)) or isinstance(item, bool))
            raise ValueError(f"cockpit step {step}: info['sample_ids'] holds {bad!r} ({type(bad).__name__}); {how}")
        if len(kinds) > 1:
            raise ValueError(f"cockpit step {step}: info['sample_ids'] mixes ints and strings; use one kind ({how})")
        if distributed and str in kinds:
            raise ValueError(f"cockpit step {step}: string info['sample_ids'] cannot be gathered across ranks; pass "
                             "integer ids (e.g. the dataset indices, a 1-D int tensor) under torch.distributed")
        count = len(ids)
    else:
        raise ValueError(f"cockpit step {step}: info['sample_ids'] is a {type(ids).__name__}; {how}")
    losses = info.get("individual_losses")
    if "batch_size" in info:
        expected, what = int(info["batch_size"]), "info['batch_size']"
    elif isinstance(losses, torch.Tensor) and losses.dim() == 1:
        expected, what = losses.shape[0], "len(info['individual_losses'])"
    else:
        return
    if count != expected:
        hint = f" With gradient accumulation (info['micro_batches'] = {micro_batches}) both are the micro-batch's." \
            if micro_batches > 1 else ""
        raise ValueError(f"cockpit step {step}: info['sample_ids'] has {count} entries but {what} is {expected}; "
                         f"{how}.{hint}")


def _check_losses_match(info: dict, step: int, micro_batches: int) -> None:
    """``info["individual_losses"]`` (a 1-D tensor, one loss per sample) must have ``info["batch_size"]`` entries:
    both describe this backward pass's rows. Passing the optimizer step's batch instead of the micro-batch's
    would otherwise scale every per-sample quantity silently (TIC by the number of micro-batches)."""
    losses = info.get("individual_losses")
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        return
    size = int(info["batch_size"])
    if losses.shape[0] != size:
        hint = (
            f" With gradient accumulation (info['micro_batches'] = {micro_batches}) both are the micro-batch's."
            if micro_batches > 1
            else " Under DDP both are this rank's."
        )
        raise ValueError(
            f"cockpit step {step}: info['batch_size'] is {size} but info['individual_losses'] has "
            f"{losses.shape[0]} entries; both must count the samples of this backward pass (one loss per "
            f"sample, batch_size = len(individual_losses)).{hint}"
        )
