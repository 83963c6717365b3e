"""One tracked step, between :meth:`Cockpit.begin` and :meth:`Cockpit.end`.

:class:`TrackedStep` is one backward pass of a step: it collects the needs of
the quantities active at the step (:class:`~cockpit_like.quantities.needs.StepNeeds`),
meets them through :class:`~cockpit_like.backends.step.StepExecution`, and
after the step's last backward pass (``info["micro_batches"]``) merges the
partitions (:mod:`cockpit_like.backends.partitions`), tracks the quantities
and hands what they stored to the cockpit (stream, listeners, diagnosis).
:class:`StepContext` is what ``with cockpit(step, info=...)`` returns.

May import torch, :mod:`cockpit_like.backends`, the quantity base modules and
:mod:`cockpit_like.context`; the cockpit passes itself in.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import torch

from cockpit_like import context
from cockpit_like.backends.partitions import StepGradients, StepPartitions, grad_scale, loss_scale
from cockpit_like.backends.step import StepExecution
from cockpit_like.diagnosis.recorder.control import gradients_finite, loss_finite
from cockpit_like.quantities.needs import StepNeeds
from cockpit_like.quantities.quantity import Quantity

if TYPE_CHECKING:
    from cockpit_like.cockpit import Cockpit

__all__ = ["TrackedStep", "StepContext"]


class StepContext:
    """What ``cockpit(step, ...)`` returns: ``with`` calls ``begin`` and ``end``."""

    def __init__(self, cockpit: Cockpit, global_step: int, exts: tuple, info: dict, debug: bool):
        self.cockpit = cockpit
        self.step = global_step
        self.exts = exts
        self.info = info
        self.debug = debug

    def __enter__(self) -> StepContext:
        self.cockpit.begin(self.step, *self.exts, info=self.info, debug=self.debug)
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self.cockpit.end(exc)
        return False


class TrackedStep:
    """One backward pass of a step, from :meth:`Cockpit.begin` to :meth:`Cockpit.end`.

    A step is one optimizer step: with ``info["micro_batches"] = K`` its ``K``
    backward passes are partitions of its rows
    (:mod:`cockpit_like.backends.partitions`), merged after the last one, when
    the quantities are tracked.
    """

    def __init__(self, cockpit: Cockpit, global_step: int, exts: tuple, info: dict, debug: bool, micro: int, micro_batches: int):
        self.cockpit = cockpit
        self.step = global_step
        self.user_exts = exts
        self.info = info
        self.debug = debug
        self.micro, self.micro_batches = micro, micro_batches
        self.last = micro == micro_batches - 1
        self.active: list[Quantity] = []
        #: the step's quantities were tracked (its last backward pass, not skipped)
        self.completed = False
        self._execution: StepExecution | None = None
        self._loss_is_finite = True
        self._loss_finite: bool | None | object = _UNCHECKED
        self._split = micro_batches > 1 or cockpit._ranks is not None

    # ---- enter: collect the needs -----------------------------------------------
    def __enter__(self) -> TrackedStep:
        cockpit, step = self.cockpit, self.step
        cockpit._next_step = step + 1 if self.last else step  # the next forward pass belongs to this step
        self.active = list(cockpit._active_at(step))
        if not self.active and not self.user_exts:
            cockpit._tracer.drop_calls()  # nothing tracked: drop what the forward pass noted
            if self.debug:
                print(f"[cockpit_like|step {step}] nothing scheduled")
            return self

        for quantity in self.active:
            for key in sorted(quantity.required_info(step)):
                if key not in self.info:
                    raise context.MissingInfoError(key, cockpit.name_of(quantity), step)
        if self.micro_batches > 1 and self.active and "batch_size" not in self.info:
            raise context.MissingInfoError("batch_size", f"gradient accumulation (info['micro_batches'] = {self.micro_batches})", step)
        if "batch_size" in self.info:
            _check_batch_size(self.info["batch_size"], step)
            _check_losses_match(self.info, step, self.micro_batches)
        self._check_loss()
        create_graph = cockpit.create_graph(step)
        if cockpit._ranks is not None and self.active:
            owners = tuple(cockpit.name_of(q) for q in self.active if q.create_graph(step))
            cockpit._ranks.check_step(step, cockpit.models(), self.info, create_graph, self.last, owners)
        needs = StepNeeds.collect(self.active, step, cockpit.name_of, self.user_exts, create_graph)
        if self._split:  # the form each backward pass computes when the step has several (equal results)
            needs = needs.partitioned()
        if self.active and (cockpit._partitions is None or cockpit._partitions.step != step):
            scaler = grad_scale(self.info, step)
            factor = scaler * loss_scale(self.info, step)
            cockpit._partitions = StepPartitions(step, factor, skippable=scaler != 1.0)
        scale = cockpit._partitions.scale if self.active else 1.0
        try:
            self._execution = StepExecution(
                step,
                cockpit.params,
                needs,
                tracer=cockpit._tracer,
                collector=cockpit._module_collector,
                names=cockpit._names_of_params(),
                info=self.info,
                row_scale=self.micro_batches / scale,
                memory_budget=cockpit.memory_budget,
            )
        except BaseException:
            cockpit._tracer.drop_calls()
            raise
        if self.debug:
            print(
                f"[cockpit_like|step {step}] quantities: {[cockpit.name_of(q) for q in self.active]}; "
                f"{self._execution.describe()}; per-sample statistics: {list(needs.stats)}; "
                f"create_graph: {create_graph}; backward pass {self.micro + 1} of {self.micro_batches}"
            )
        self._execution.enter()
        return self

    def loss_finite(self) -> bool | None:
        """Whether ``info["loss"]`` is finite (``None``: no loss given), computed once per step."""
        if self._loss_finite is _UNCHECKED:
            self._loss_finite = loss_finite(self.info.get("loss"))
        return self._loss_finite

    def _check_loss(self) -> None:
        if self.loss_finite() is False:
            self._loss_is_finite = False
            loss = self.info["loss"]
            warnings.warn(
                f"[cockpit_like] step {self.step}: the loss is {float(loss.detach() if isinstance(loss, torch.Tensor) else loss):g}; quantities "
                "that cannot be computed store NaN for this step",
                RuntimeWarning,
                stacklevel=3,
            )

    # ---- exit: compute, store, free ---------------------------------------------
    def __exit__(self, exc_type, exc, traceback) -> bool:
        execution = self._execution
        if execution is None:
            return False
        cockpit = self.cockpit
        ranks = cockpit._ranks if self.active else None
        partitions = cockpit._partitions
        try:
            execution.exit(exc_type, exc, traceback)
            if exc_type is None and self.active:
                partitions.add(execution.partition(self._split))
        except BaseException:
            self._abandon(ranks, execution)
            raise
        if exc_type is not None:
            self._abandon(ranks, execution)
            return False
        if not self.active or not self.last:  # untracked, or more micro-batches to come
            execution.free()
            return False
        cockpit._partitions = None
        new_values: dict[int, dict[str, Any]] = {}
        params = cockpit.params
        view = StepGradients(params, partitions.scale)
        try:
            reduction = None if ranks is None else ranks.synchronise(self.step, params, partitions)
            if partitions.skippable and not gradients_finite(params):
                cockpit._store_skipped(self.step, {"reason": "grad_scaler", "scale": partitions.scale})
                return False
            view.apply()  # unscaled, whole gradients (GradScaler, FSDP2)
            if ranks is not None:
                ranks.unscale_graph_grads(view)
            stats, info = partitions.merge(params, execution.whole_step_results(), reduction)
            record = context.StepRecord(
                global_step=self.step, info=info, params=view.params, stats=stats,
                loss_is_finite=self._loss_is_finite, live_params=params,
            )
            context._activate(record)
            try:
                for quantity in self.active:
                    self._track(quantity, new_values, view.params)
            except BaseException:  # a quantity failed: the step stores nothing, so memory agrees with the stream
                names = {cockpit.name_of(quantity): quantity for quantity in self.active}
                for step, values in new_values.items():
                    for name in values:
                        names[name].output.pop(step, None)
                raise
            self.completed = True
            if not cockpit.keeps_output:  # DDP: computed on every rank, kept on the log rank only
                for quantity in self.active:
                    for step in new_values:
                        quantity.output.pop(step, None)
                new_values = {}
        finally:
            view.restore()
            context._activate(None)
            if ranks is not None:
                ranks.end_step()
            execution.free()
        for step, values in sorted(new_values.items()):
            cockpit._output.publish(step, values)
        cockpit._diagnose(new_values)
        return False

    def _abandon(self, ranks, execution: StepExecution) -> None:
        """The backward pass failed: the step is dropped (other ranks are told), buffers freed."""
        self.cockpit._partitions = None
        if ranks is not None:  # tell the other ranks (backends/distributed.py)
            ranks.abandon_step(self.step, self.cockpit.params, int(self.info.get("batch_size", 0)))
        execution.free()

    def _track(self, quantity: Quantity, new_values: dict[int, dict[str, Any]], params: list[torch.Tensor]) -> None:
        name = self.cockpit.name_of(quantity)
        before = dict(_last_items(quantity.output, 2))
        try:
            quantity.track(self.step, params, self.info.get("loss"))
        except Exception as error:
            if self._loss_is_finite:
                raise
            warnings.warn(
                f"[cockpit_like] step {self.step}: {name} failed on the non-finite loss "
                f"({type(error).__name__}: {error}); storing NaN",
                RuntimeWarning,
                stacklevel=4,
            )
            quantity.output[self.step] = math.nan
        for step, value in _last_items(quantity.output, 2):
            if before.get(step, _MISSING) is not value:
                new_values.setdefault(step, {})[name] = value


_MISSING = object()
_UNCHECKED = object()


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
