"""One tracked step's needs, met per module by BackPACK or by module hooks.

The cockpit collects what the scheduled quantities need (BackPACK
extensions, per-sample statistics, extension hooks, the graph) and hands it
to :class:`StepExecution`, which decides per module how to meet it:

- **BackPACK** for a module that was ``extend``-ed and whose class BackPACK's
  ``BatchGrad`` supports (per-sample statistics), and for every BackPACK
  extension a quantity or the user asked for (curvature diagonals, KFAC);
- **hooks** (:mod:`cockpit_like.backends.hooks`) for every other module that
  owns tracked parameters: per-layer rules, else ``torch.func``.

Both feed one :class:`~cockpit_like.backends.per_sample.PerSampleReducer`.
The cockpit calls :meth:`StepExecution.enter` before and
:meth:`StepExecution.exit` after ``loss.backward()`` and never names a backend.

May import torch, BackPACK and :mod:`cockpit_like.backends`.
"""

from __future__ import annotations

import functools
import math

import torch
from backpack import backpack, hook_store_io
from backpack.extensions import BatchGrad, DiagGGNExact, DiagHessian
from backpack.utils.module_classification import is_loss

from cockpit_like.backends.column_blocks import BLOCKED_TYPES, column_blocks
from cockpit_like.backends.extensions import describe, merge_extensions
from cockpit_like.backends.hooks import (
    BatchSizeMismatchError, HookBackend, RowsNotSamplesError, UncoveredParameterError, coupling_reason,
)
from cockpit_like.backends.rerun import NonFiniteOutputsError, RowsNotReproducedError
from cockpit_like.backends.module_rules import pruned
from cockpit_like.backends.lean_hooks import is_lean
from cockpit_like.backends.per_sample import DEFAULT_BUDGET_BYTES, PerSampleReducer
from cockpit_like.backends.randomness import seeded_sampling
from cockpit_like.backends.row_paths import rows_dim
from cockpit_like.backends.tracer import _graph_kernels, graph_kernels
from cockpit_like.backends.user_state import held_tensor_hooks

__all__ = [
    "StepExecution",
    "NotExtendedError",
    "UnsupportedLayerError",
    "is_extended",
    "backpack_computes_per_sample",
    "backpack_curvature_compatible",
]


class NotExtendedError(RuntimeError):
    """A backend computed nothing for some parameters (BackPACK: the model or loss was not ``extend``-ed)."""


class RowsNotSeenError(NotExtendedError):
    """A per-sample pass of a quantity's own (TIC's GGN diagonal) reached tracked parameters through no module call
    that computes their rows (the legacy ``torch.nn.utils.weight_norm`` / ``spectral_norm``, a parameter read outside
    its module's forward): their per-sample values are not defined at this step. As where the step's own pass meets
    them (zero rows, the gradient check fails, a note), the quantity is left out with a note and the run goes on
    (outside trial 32: training stopped with advice to pass ``model=``, which was passed)."""


class UnsupportedLayerError(NotImplementedError):
    """BackPACK cannot run a needed extension on a layer of the model."""


#: the quantities ``curvature='hutchinson'`` serves, for the messages that advise it: TICDiag refuses it
HUTCHINSON_SCOPE = (
    "; HessTrace and TICTrace take it, TICDiag cannot (it divides entry by entry by the diagonal): give TICDiag "
    "curvature='ggn' with info['outputs'] for a mean cross-entropy without class weights, or leave it out"
)


def is_extended(module: torch.nn.Module) -> bool:
    """Whether ``backpack.extend`` gave ``module`` its hooks."""
    return is_lean(module) or any(hook is hook_store_io for hook in module._forward_hooks.values())


_BATCH_GRAD_CLASSES: frozenset | None = None


def _batch_grad_classes() -> frozenset:
    global _BATCH_GRAD_CLASSES
    if _BATCH_GRAD_CLASSES is None:
        _BATCH_GRAD_CLASSES = frozenset(getattr(BatchGrad(), "_BackpropExtension__module_extensions"))
    return _BATCH_GRAD_CLASSES


def backpack_computes_per_sample(module: torch.nn.Module) -> bool:
    """Whether BackPACK computes ``module``'s per-sample gradients (extended, class supported, and not a
    configuration BackPACK gets wrong: :func:`_backpack_fails_on`)."""
    return type(module) in _batch_grad_classes() and is_extended(module) and not _backpack_fails_on(module)


def _backpack_fails_on(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a configuration of a supported class that BackPACK 1.7 gets wrong
    (:func:`backpack_gets_wrong`). The hooks take its rows; the curvature ``"auto"`` uses Hessian-vector products."""
    return backpack_gets_wrong(module) is not None


def backpack_gets_wrong(module: torch.nn.Module) -> str | None:
    """Why BackPACK 1.7 cannot compute ``module`` though it supports its class, or ``None``: a transposed
    convolution with ``output_padding`` (its weight's Jacobian is unfolded to the output size without the padding,
    a shape error); a convolution whose ``padding_mode`` is not ``"zeros"`` (its derivatives pad with zeros
    whatever the mode: outside trial 42, HessTrace and TIC of a reflect-padded convolution stored wrong with no
    note); a module pruned by ``torch.nn.utils.prune`` (BackPACK differentiates the computed ``weight``)."""
    padding = getattr(module, "output_padding", None)
    if isinstance(module, torch.nn.modules.conv._ConvTransposeNd) and any(int(p) != 0 for p in padding):
        return f"{type(module).__name__} with output_padding={tuple(padding)}: BackPACK unfolds its weight's Jacobian without it"
    if isinstance(module, torch.nn.modules.conv._ConvNd) and getattr(module, "padding_mode", "zeros") != "zeros":
        return (
            f"{type(module).__name__} with padding_mode={module.padding_mode!r}: BackPACK's convolution derivatives pad "
            "with zeros whatever the padding mode, so what it computes is another function's"
        )
    if bool(module._forward_pre_hooks) and pruned(module):  # its gradients are weight's, not weight_orig's
        return f"{type(module).__name__} pruned by torch.nn.utils.prune: BackPACK differentiates the computed weight"
    return None


def refuse_what_backpack_gets_wrong(extension):
    """``extension`` (one of the cockpit's own BackPACK extension objects), changed in place so that a module
    :func:`backpack_gets_wrong` names raises ``NotImplementedError`` with that reason where the extension would
    run on it (in the backward pass), instead of computing another function's numbers. Returned."""
    lookup = extension._BackpropExtension__get_module_extension
    if getattr(lookup, "_cockpit_refusing", False):
        return extension

    def refusing(module):
        found = lookup(module)
        reason = backpack_gets_wrong(module) if found is not None else None
        if reason is not None:
            raise NotImplementedError(reason)
        return found

    refusing._cockpit_refusing = True
    extension._BackpropExtension__get_module_extension = refusing
    return extension


def backpack_curvature_compatible(models: list[torch.nn.Module], extension) -> bool:
    """Whether BackPACK's second-order ``extension`` can run on every model of ``models``.

    Conservative: every container is an ``nn.Sequential`` (BackPACK backpropagates
    curvature through a chain of modules: no skip connections, no custom
    ``forward``), every other module is extended and has a module extension of
    ``extension``. The loss function must be extended too, which cannot be
    checked here (BackPACK then computes nothing, and the cockpit says so).
    """
    if not models:
        return False
    supported = frozenset(getattr(extension, "_BackpropExtension__module_extensions"))
    for root in models:
        if isinstance(root, torch.nn.parallel.DistributedDataParallel):
            root = root.module  # DDP's wrapper runs its module's forward (docs/distributed.md)
        for module in root.modules():
            if next(module.children(), None) is not None:
                if type(module) is not torch.nn.Sequential:
                    return False
            elif type(module) not in supported or not is_extended(module) or _backpack_fails_on(module):
                return False
    return True


class StepExecution:
    """The backends of one backward pass of a tracked step.

    Args:
        step: the global step (for messages).
        params: the tracked parameters.
        needs: the step's merged needs (:class:`~cockpit_like.quantities.needs.StepNeeds`).
        tracer: the cockpit's :class:`~cockpit_like.backends.tracer.ModelTracer` (or ``None``).
        collector: the lean-hooks collector (or ``None``).
        names: ``id(param) -> readable name``.
        info: the step's ``info`` dict (``batch_size`` if given).
        row_scale: see :class:`~cockpit_like.backends.per_sample.PerSampleReducer` (micro-batches,
            a ``GradScaler``'s scale; :mod:`cockpit_like.backends.partitions`).
    """

    def __init__(
        self, step, params, needs, tracer=None, collector=None, names=None, info=None, row_scale=1.0, memory_budget=None,
        scaled_losses=False, accumulate_passes=False, row_check=None,
    ):
        self.step = step
        self.info = info or {}
        self.stat_owners = list(needs.owners)
        #: the quantities that run without their per-sample statistics where those are left out
        self._partial_owners = set(needs.partial)
        #: step needs computed after each backward pass (they read this pass's graph, e.g. its outputs)
        self.needs = [need for need in needs.needs if not getattr(need, "whole_step", False)]
        #: step needs computed once, after the step's last backward pass (Hessian-vector products of p.grad)
        self.whole_step_needs = [need for need in needs.needs if getattr(need, "whole_step", False)]
        #: ``(asked, met_by)``: needs met by another need of the step (``StepNeeds.aliases``)
        self.aliases = tuple(needs.aliases)
        #: need -> the quantities that asked for it (named in errors)
        self._need_owners = dict(needs.need_owners)
        self.params = params
        self.names = names or {}
        self.reducer: PerSampleReducer | None = None
        self.hook_backend: HookBackend | None = None
        self._backpack = None
        self._user_types = needs.user_types
        stats, raw_batch_grad, batch_size = list(needs.stats), needs.raw_batch_grad, self.info.get("batch_size")
        calls = []
        #: the step's forward pass ran attention with PyTorch's math kernel (the graph steps' kernel)
        math_attention = tracer is not None and tracer.math_attention
        if tracer is not None:
            # (with BackPACK's extensions too: a module that ran twice, or whose buffers a backward pass outside
            # the block freed, is then named before the pass rather than failing inside it)
            if stats or needs.needs or needs.requests:
                calls = tracer.take_calls(self.info.get("loss"))
            else:  # nothing here reads the forward calls
                tracer.drop_calls()
        self._tracer, self._batch_size = tracer, batch_size
        #: the model's outputs with the batch's rows (recorded shapes and graph nodes): where the self-check reads
        #: the loss factor when ``info["loss"]`` is not backpropagated (:class:`~cockpit_like.checks.LossFactor`)
        self.root_outputs = _root_outputs(tracer, calls, batch_size)
        self.merges_passes = False
        #: what this pass left out and why (the step's ``checks["notes"]``)
        self.notes: list[str] = []
        if math_attention:
            self.notes.append(MATH_ATTENTION_NOTE)
        self._left_out: set[str] = set()
        #: why the per-sample statistics of this pass could not be had after its backward pass (:meth:`_without_rows`;
        #: None: they could), the note also told once per run as a warning
        self.rows_note: str | None = None
        coupling = sorted({reason for call in calls if (reason := coupling_reason(call.module)) is not None})
        #: where info['loss'] reaches tracked parameters around their modules' calls (:func:`_paths_around`): walked
        #: only where per-sample rows are wanted, or where BackPACK cannot run and the error should say why
        around = functools.cache(lambda: _paths_around(self.info.get("loss"), calls, params, self.names))
        why = None
        if stats and coupling and not raw_batch_grad:
            # BatchNorm in training mode, an embedding scaling by the batch's id counts: every row's gradient
            # depends on the other rows, so per-sample gradients are undefined; their quantities are left out
            why = f"{'; '.join(coupling)}, so a row's gradient depends on the other rows"
        elif stats and not raw_batch_grad and around():
            # the loss reaches parameters other than through their modules' calls: the hooks miss that part
            # (outside trial 25: a PINN's residual of d2u/dx2 failed the gradient check at every step, naming a
            # learnable loss weight first, and its HessMaxEV and HessTrace were withheld with the rows)
            reached = around()["parameters"]
            shown = ", ".join(reached[:4]) + (" ..." if len(reached) > 4 else "")
            derivative = (
                "a derivative of the model's outputs taken with create_graph (torch.autograd.grad or torch.func.grad "
                "in the loss: a physics-informed residual, a gradient penalty, Sobolev training), whose graph "
                "multiplies by the weights again"
            )
            read = (
                "the parameters read in the loss itself (a penalty on them: use the optimizer's weight_decay; a "
                "learnable loss weight or temperature: compute it in a module's forward, or leave it out of "
                "Cockpit(params))"
            )
            causes = f"{derivative}; or {read}" if around()["derivatives"] else f"{read}, or {derivative}"
            why = (
                f"info['loss'] reaches {shown} other than through the module calls that use them: {causes}. The "
                "module hooks take each row's gradient at those calls' outputs, so they would miss that part of it "
                "(docs/your_model.md#limits)"
            )
        elif not raw_batch_grad and row_check is not None:
            # a loss over the batch (contrastive, in-batch negatives): the rows are not the rows' gradients (at a
            # step without per-sample statistics the check only takes the declared loss's gradient at the outputs)
            coupled = row_check(self.root_outputs, *(_scalars_and_row_nodes(tracer, calls, batch_size) if stats else ()))
            if coupled is not None and "scalar" in coupled:
                why = (
                    "info['individual_losses'] read a number of the whole batch that the model returns (a scalar "
                    "output computed from every row, such as a router z-loss or a load-balancing loss added to each "
                    "row's loss), so a row's loss depends on the other rows and per-sample gradients are undefined "
                    "(log the auxiliary loss with cockpit.log and leave it out of info['individual_losses'] and "
                    "the loss at the tracked steps, or compute it per row; docs/your_training_loop.md#self-checks)"
                )
            elif coupled is not None:
                why = (
                    "info['individual_losses'] are not separable by rows: a row's loss depends on other rows of "
                    f"the model's output (output {coupled['output']}: the gradient of a sign-weighted sum of the "
                    f"losses is {coupled['error']:.3g} off the signed rows of the plain sum's, tolerance "
                    f"{coupled['tolerance']:.1g}; a loss over the batch such as InfoNCE / a contrastive loss, "
                    "in-batch negatives or a batch mean inside the loss), or they are not what each row "
                    "contributed (losses of some of the rows only, such as the labelled rows of a semi-supervised "
                    "batch: give every row of the model's output a loss, 0 for the others, scaled so that their mean "
                    "is the loss), so per-sample gradients are undefined (docs/your_training_loop.md#self-checks)"
                )
        if why is not None:
            left = sorted(set(needs.owners) - set(needs.partial))  # (the quantities left out of the step)
            partial = f"; {sorted(needs.partial)} computed without them" if needs.partial else ""
            self.notes.append(
                (f"per-sample quantities {left} left out" if left else "per-sample statistics left out")
                + f": {why}{partial}"
            )
            self._left_out = set(needs.owners) - set(needs.partial)  # the others run without them
            stats = []
        self._leave_out_row_needs(needs, coupling)
        #: extended modules that ran more than once in this pass: BackPACK keeps one call's input and output per
        #: module, so its extensions cannot run there (the hooks sum a parameter's calls, exactly)
        self._repeated_extended = _repeated_extended(calls)
        #: extended convolutions with ``padding="same"`` whose padding is symmetric: BackPACK's derivatives need
        #: numbers, so they see the same padding as numbers during the pass (:func:`_explicit_same_padding`)
        self._same_padding = _same_padding_convs(calls)
        self._padding_set: list = []
        #: extended modules whose buffers BackPACK's forward hook kept are another call's (or were freed): the module
        #: ran again after this pass's forward call (an evaluation batch with gradients on), or a backward pass
        #: outside the cockpit's block freed them; the hooks take these modules' rows too
        self._stale_extended = [m for m in _stale_extended(calls) if m not in self._repeated_extended]
        self._repeated_extended += self._stale_extended
        #: the extended modules' calls, to see at the first backward pass whether one ran again in the block
        self._extended_calls = [call for call in calls if is_extended(call.module)]
        # a fresh copy of the calls for needs that run a backward pass of their own
        self._calls = [call.fresh() for call in calls] if needs.needs else []
        requests, hooks = list(needs.requests), list(needs.hooks)
        #: quantities' extension hooks run in the pass and may read its BackPACK buffers there, as in Cockpit
        self._quantity_hooks = bool(hooks)
        self._memory_budget = memory_budget
        if stats:
            self.reducer = PerSampleReducer(
                stats, params, keep_grad_batch=raw_batch_grad, info=self.info, row_scale=row_scale,
                budget_bytes=memory_budget,
            )  # fmt: skip
            use_backpack = self._backpack_per_sample(tracer, calls, raw_batch_grad, stats, self._repeated_extended)
            if use_backpack:
                if raw_batch_grad:
                    extension = BatchGrad()
                else:
                    from cockpit_like.backends.per_sample_extension import PerSampleStatistics

                    extension = PerSampleStatistics(self.reducer)
                requests = list(requests) + [("per-sample statistics", extension)]
                hooks.insert(0, self.reducer)
            handled = backpack_computes_per_sample if use_backpack else (lambda module: False)
            if calls:
                try:
                    self.hook_backend = HookBackend(
                        calls, params, self.reducer, handled, tracer, batch_size=batch_size,
                        accumulate_passes=accumulate_passes and not use_backpack,
                        losses=(self.info.get("loss"), self.info.get("individual_losses")),
                    )  # fmt: skip
                except RowsNotSamplesError as error:  # rows coupled on the way to the outputs (F.batch_norm)
                    self._without_rows(str(error))
                    self._leave_out_row_needs(needs, ["a normalisation over the batch couples the rows"])
            #: the hook backend alone computes the per-sample rows (so it can sum several backward passes)
            self.merges_passes = self.hook_backend is not None and not use_backpack
        #: ``1 / row_scale``: the factor between the backpropagated loss and this pass's mean loss
        self._loss_scale = 1.0 / float(row_scale)
        requests = self._without_half_precision_curvature(requests, calls)
        self._added_ggn = False
        #: BackPACK's Hessian diagonal of a scaled loss could not be corrected (no GGN diagonal beside it)
        self.curvature_unscaled = False
        if (self._loss_scale != 1.0 or scaled_losses) and any(isinstance(ext, DiagHessian) for _, ext in requests):
            if not any(isinstance(ext, DiagGGNExact) for _, ext in requests):
                from cockpit_like.backends.conv_diagonals import use_functional_avgpool

                requests.append(("the Hessian diagonal of a scaled loss", use_functional_avgpool(DiagGGNExact())))
                self._added_ggn = True
        self.extensions = merge_extensions(requests)
        #: who asked for each extension type (named in BackPACK's errors)
        self._extension_owners: dict[type, list[str]] = {}
        for owner, ext in requests:
            owners = self._extension_owners.setdefault(type(ext), [])
            if owner not in owners:
                owners.append(owner)
        from cockpit_like.quantities.needs import USER_EXTENSIONS

        #: the quantities whose BackPACK extensions start at the loss module (second order), and the values of the
        #: extended loss modules this pass ran (:meth:`_loss_seen`, :meth:`_check_loss_module`)
        self._second_owners = sorted({o for o, ext in requests if o != USER_EXTENSIONS and _second_order(ext)})
        self._loss_values: list[torch.Tensor] = []
        #: ``(loss module, ignore_index, rows ignored, rows)`` of extended losses whose targets hold their ignore_index
        self._ignored_rows: list[tuple[str, int, int, int]] = []
        if self.extensions and self._stale_extended:
            named = sorted({type(module).__name__ for module in self._stale_extended})
            wanted = sorted({describe(extension) for extension in self.extensions})
            if around() and around()["derivatives"]:  # (outside trial 27: the message below blamed an evaluation batch)
                raise ValueError(
                    f"cockpit step {step}: info['loss'] holds a derivative of the model's outputs taken with "
                    "create_graph (a gradient penalty, an input-gradient or physics-informed term), and computing it "
                    f"ran the backward pass of the BackPACK-extended module(s) {named} before this step's: BackPACK "
                    f"keeps one call's input and output per module, so its extensions {wanted} cannot run here. Use "
                    "the model without backpack.extend (Cockpit(..., model=model): the curvature then comes from "
                    "Hessian-vector products, and the per-sample quantities are left out with a note), or "
                    "configuration('economy') on the extended model."
                )
            raise ValueError(
                f"cockpit step {step}: the BackPACK-extended module(s) {named} ran again after the forward pass "
                "of the loss this step backpropagates (a forward pass with gradients enabled, such as an evaluation "
                "batch or a probe), or a backward pass outside the cockpit's block freed what BackPACK kept of "
                f"them; BackPACK keeps one call's input and output per module, so its extensions {wanted} cannot "
                "run on this step. Run other forward passes under torch.no_grad() or before the training forward "
                "pass, or use the model without backpack.extend (Cockpit(..., model=model))."
            )
        if self.extensions and self._repeated_extended:
            named = sorted({type(module).__name__ for module in self._repeated_extended})
            wanted = sorted({describe(extension) for extension in self.extensions})
            raise ValueError(
                f"cockpit step {step}: the BackPACK-extended module(s) {named} ran more than once in this backward "
                f"pass (a siamese or two-view model, a shared block), and BackPACK's extensions {wanted} keep only "
                "one call's input and output per module, so they cannot run on this step. Use the model without "
                "backpack.extend (Cockpit(..., model=model): the hooks handle several calls, and curvature "
                "'auto' estimates with Hessian-vector products), or pass curvature='hutchinson' to the curvature "
                f"quantities (Hessian-vector products{HUTCHINSON_SCOPE}) and leave out those that need BackPACK's buffers."
            )
        if self.extensions or hooks:  # BackPACK's hooks on the outputs would run again at the check's capture
            self.root_outputs = []
        self._create_graph = needs.create_graph
        #: the graph kernels are held for the user's backward pass (:meth:`enter` to :meth:`exit`)
        self._kernels_held = False
        self._warnings = None
        self._hooks = hooks
        self._collector = collector
        #: BackPACK ran an extended loss module in this pass (its second-order extensions start there)
        self._loss_ran = False
        #: the curvature factors' replays of this pass (:mod:`cockpit_like.backends.column_blocks`)
        self._replays: list = []

    def _leave_out_row_needs(self, needs, coupling: list[str]) -> None:
        """The step needs that run a backward pass of their own for per-sample rows (``per_sample_rows``: TIC's
        GGN diagonal on any model, the sampled GGN) cannot where a module couples the rows (BatchNorm in
        training mode; ``coupling``: why, :func:`~cockpit_like.backends.hooks.coupling_reason`): they are not
        computed, and the quantities that asked for them are left out of the step with a note (the rest of the
        step runs). Where the per-sample quantities were left out already (a loss over the batch), the needs
        only they asked for are not computed."""
        rows = [need for need in self.needs if getattr(need, "per_sample_rows", False)]
        if not rows:
            return
        owners_of = dict(needs.need_owners)
        if coupling:
            owners = sorted({name for need in rows for name in owners_of.get(need, ())} - self._left_out)
            if owners:
                self.notes.append(
                    f"{owners} left out: their curvature comes from per-sample gradients of a second backward "
                    f"pass, and {'; '.join(coupling)}, so a row's gradient depends on the other rows"
                )
                self._left_out |= set(owners)
            dropped = rows
        else:
            dropped = [need for need in rows if owners_of.get(need) and set(owners_of[need]) <= self._left_out]
        self.needs = [need for need in self.needs if need not in dropped]

    def _without_half_precision_curvature(self, requests: list, calls: list) -> list:
        """BackPACK's second-order extensions multiply float32 weights with the outputs an autocast forward pass
        kept in float16 / bfloat16, which fails: the quantities that asked for them are left out of this step, with
        a note (the rest of the step runs)."""
        half = sorted({
            type(call.module).__name__ for call in calls
            if is_extended(call.module) and getattr(getattr(call.module, "output", None), "dtype", None) in HALF
        })  # fmt: skip
        from cockpit_like.quantities.needs import USER_EXTENSIONS

        second = [(owner, ext) for owner, ext in requests if owner != USER_EXTENSIONS and _second_order(ext)]
        if not (half and second):
            return requests
        owners = sorted({owner for owner, _ in second})
        self._left_out |= set(owners)
        self.notes.append(
            f"{', '.join(owners)} left out: BackPACK's second-order extensions "
            f"({', '.join(sorted({describe(ext) for _, ext in second}))}) cannot run on layers whose outputs an "
            f"autocast forward pass made in half precision ({', '.join(half)}); pass curvature='hutchinson' to "
            f"these quantities (Hessian-vector products{HUTCHINSON_SCOPE}), or run the forward pass of the steps they track without "
            "autocast"
        )
        return [(owner, ext) for owner, ext in requests if (owner, ext) not in second]

    @staticmethod
    def _backpack_per_sample(tracer, calls: list, raw_batch_grad: bool, stats=(), repeated=()) -> bool:
        """Whether BackPACK's per-sample extension runs: unless the step's calls (every module that owns
        tracked parameters and ran) show that BackPACK computes none of them, or a statistic reads the
        layers' inputs and output gradients (``module_form``: the curvature logs), which only the hooks see,
        or an extended module ran more than once (BackPACK keeps one call per module)."""
        if raw_batch_grad or tracer is None or not calls or not tracer.covers_all():
            return True
        if any(stat.module_form for stat in stats) or repeated:
            return False
        return any(backpack_computes_per_sample(call.module) for call in calls)

    def observe_loss_factor(self, factor: float) -> None:
        """The factor between the propagated root and ``info["loss"]``, seen by a hook on the loss before any
        layer's gradient (:class:`~cockpit_like.checks.LossFactor`): the per-sample rows are scaled by its
        inverse, whatever was declared."""
        if not (factor != 0.0 and math.isfinite(factor)):
            return
        self._loss_scale = float(factor)
        if self.reducer is not None:
            self.reducer.row_scale = 1.0 / float(factor)

    @property
    def repeated_passes(self) -> bool:
        """More than one backward pass ran inside the block and the per-sample rows saw only one of them
        (or saw them as separate rows)."""
        hooks = self.hook_backend is not None and self.hook_backend.repeated
        return hooks or (self.reducer is not None and self.reducer.repeated)

    @property
    def passes_in_block(self) -> int:
        """The backward passes seen inside the block (at least; more than one: :attr:`repeated_passes`)."""
        return 1 if self.hook_backend is None else self.hook_backend.passes

    def left_out_owners(self) -> set[str]:
        """The quantities whose per-sample statistics this pass left out (see :attr:`notes`)."""
        return set(self._left_out)

    def describe(self) -> str:
        shown = [describe(e) for e in self.extensions]
        calls = 0 if self.hook_backend is None else len(self.hook_backend.calls)
        return f"extensions: {shown}; module calls computed by hooks: {calls}"

    # ---- around backward ---------------------------------------------------------------------
    def enter(self) -> None:
        if self._create_graph and not self._kernels_held:
            # the forward pass ran with the graph kernels (math attention): a recomputation inside the backward
            # pass (non-reentrant checkpointing) must run with them too (:func:`~cockpit_like.backends.tracer.graph_kernels`)
            _graph_kernels.acquire()
            self._kernels_held = True
        if self._loss_scale != 1.0 and self.extensions:
            # the loss is divided by the micro-batches or multiplied by a GradScaler after the loss module;
            # BackPACK warns that its second-order information may then be wrong: the cockpit corrects it
            # (:meth:`_unscale_curvature`)
            import warnings

            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("ignore", message=r"The output of .* seems to have been modified")
        if self.hook_backend is not None:
            self.hook_backend.enter()
        if self.extensions or self._hooks:
            hooks = list(self._hooks)
            if self._collector is not None:
                hooks.append(self._collector)
            if any(_second_order(ext) for ext in self.extensions):
                hooks.append(self._loss_seen)
            exts, hook = self._blocked(self.extensions), _chain(hooks) if hooks else None
            if self._create_graph:
                # backward(create_graph=True) would record everything the hooks compute (Finding 9)
                from cockpit_like.backends.no_grad import hook_without_autograd, without_autograd

                exts = [without_autograd(ext) for ext in exts]
                hook = None if hook is None else hook_without_autograd(hook)
            # BackPACK's Monte-Carlo extensions draw in their hooks: from a per-step seed, the user's RNG restored
            exts = [seeded_sampling(ext, self.step) for ext in exts]
            self._padding_set = _explicit_same_padding(self._same_padding)  # put back by exit / close
            self._backpack = context = backpack(*exts, extension_hook=hook)
            context.__enter__()  # (held before it is entered: :meth:`close` leaves it whatever happens)

    def _asked_for(self, extension) -> str:
        """``"KFLR(...) for KFACTrace"``: the extension and the quantities that asked for it."""
        owners = self._extension_owners.get(type(extension))
        return f"{describe(extension)} for {', '.join(owners)}" if owners else describe(extension)

    def _blocked(self, extensions: list) -> list:
        """The extensions to run, the curvature diagonals as recording twins replayed in blocks of columns
        under the memory budget after the pass (:mod:`cockpit_like.backends.column_blocks`). A user's own
        extension object is left as it is (their hooks may read its buffers during the pass), and so is every
        extension at a step where a quantity's extension hook runs in the pass (it may read them too)."""
        budget = DEFAULT_BUDGET_BYTES if self._memory_budget is None else self._memory_budget
        self._replays = []
        for ext in extensions:
            if type(ext) not in self._user_types and type(ext).__module__.startswith("backpack.extensions.secondorder"):
                refuse_what_backpack_gets_wrong(ext)  # (first-order rows of such modules come from the hooks)
        if self._quantity_hooks:
            return list(extensions)
        exts = []
        for ext in extensions:
            if type(ext) in BLOCKED_TYPES and type(ext) not in self._user_types:
                ext, replay = column_blocks(ext, budget)
                self._replays.append(replay)
            exts.append(ext)
        return exts

    def exit(self, exc_type, exc, traceback) -> None:
        """Leave the backends; on an error in ``backward`` raise a clear one (BackPACK's explained)."""
        self._release_kernels()
        context = self._backpack
        if context is not None:
            context.__exit__(exc_type, exc, traceback)
            self._backpack = None
            if self._collector is not None:
                if exc_type is None:
                    self._collector.make_lean()
                else:
                    self._collector.forget()
        replays, self._replays = self._replays, []
        replay_error = None
        if exc_type is None and replays:
            try:
                for replay in replays:
                    replay.run()
            except Exception as error:  # noqa: BLE001 - explained as an error inside backward would be
                exc_type, exc = type(error), error
                replay_error = error
        self._restore_padding()
        self._leave_warnings()
        if exc_type is not None:
            if self.hook_backend is not None:
                self.hook_backend.remove_hooks()
            if self._create_graph and isinstance(exc, RuntimeError):
                from cockpit_like.backends.hvp import graph_limit

                limit = graph_limit(exc, {name for names in self._need_owners.values() for name in names})
                if limit is not None:
                    raise RuntimeError(
                        f"step {self.step} needs loss.backward(create_graph=True) for curvature quantities: {limit}"
                    ) from exc
            freed = _freed_buffer(exc) if self.extensions else None
            if freed is not None:
                raise ValueError(
                    f"cockpit step {self.step}: BackPACK's extensions {[describe(e) for e in self.extensions]} found "
                    f"nothing stored on the extended module {freed!r} in this backward pass ({exc}). BackPACK keeps "
                    "one forward call's input and output per extended module (the loss module too) and frees them "
                    "in the first backward pass through it: a backward pass outside the cockpit's block on the same "
                    "graph (torch.autograd.grad(loss, ...) or loss.backward(retain_graph=True) before the block) "
                    "freed them, or the module ran more than once in the forward pass (a shared layer). Run such "
                    "passes after the cockpit's block (or on a loss computed without the extended loss module), or "
                    "use the model and loss without backpack.extend (Cockpit(..., model=model): the hooks handle "
                    "both, and curvature 'auto' estimates with Hessian-vector products)."
                ) from exc
            if _from_backpack(exc) and not isinstance(exc, UnsupportedLayerError):
                raise UnsupportedLayerError(
                    f"BackPACK cannot run the extensions needed at step {self.step} "
                    f"({'; '.join(self._asked_for(e) for e in self.extensions)}) on this model "
                    f"({type(exc).__name__}: {exc or 'an internal assertion failed'}). BackPACK's curvature "
                    "extensions need a model built from supported layers in nn.Sequential containers (no "
                    "skip connections, no custom modules) and a supported loss function (a mean "
                    "cross-entropy without class weights or ignore_index, or MSE, over [B, C] outputs; or "
                    "BCEWithLogits over any outputs, its weights >= 0 (none for sampled curvature: DiagGGNMC, KFAC); "
                    "not KLDiv, NLLLoss or a hand-written loss), extended (`lossfunc = backpack.extend(lossfunc)`). Fixes: for an unsupported model, pass "
                    "curvature='auto' to HessTrace / TICDiag / TICTrace (Hessian-vector products where the model "
                    "is not an extended chain of supported layers; the presets' default; it reads the model from "
                    "Cockpit(..., model=model)); for an unsupported "
                    "loss, which 'auto' cannot check, pass curvature='hutchinson' (Hessian-vector products on any "
                    f"model and loss{HUTCHINSON_SCOPE}); KFACTrace(curvature='empirical') (per-sample gradients, any "
                    "model and loss; 'auto' takes it where the model is not an extended chain); "
                    "leave out the quantities that need these extensions; or replace the layer or loss with a "
                    "supported one."
                ) from exc
            if replay_error is not None:  # raised after backward returned: nothing else propagates it
                raise replay_error
            return
        if self.hook_backend is not None:
            try:
                self.hook_backend.finish()
            except (NonFiniteOutputsError, RowsNotSamplesError, RowsNotReproducedError) as error:  # a note: the run goes on
                self._without_rows(str(error))
            except BatchSizeMismatchError as error:
                raise BatchSizeMismatchError(
                    f"step {self.step}: {error} (Needed for the per-sample statistics of {self.stat_owners}.)"
                ) from error
            except UncoveredParameterError as error:
                raise UncoveredParameterError(
                    f"step {self.step}: {error} Needed for the per-sample statistics of "
                    f"{self.stat_owners}. Every module that owns tracked parameters must treat each row "
                    "of the batch on its own; leave these quantities out, or leave this module's "
                    "parameters out of Cockpit(params)."
                ) from error

    def need_owners_of_rows(self) -> set[str]:
        """The quantities that asked for needs with per-sample rows of a backward pass of their own."""
        return {name for need in self.needs if getattr(need, "per_sample_rows", False)
                for name in self._need_owners.get(need, ())}

    def _without_rows(self, why: str) -> None:
        """The per-sample statistics of this pass cannot be had (``why``): the quantities that need them are left
        out of the step with a note, the others run (the training run goes on)."""
        left = sorted(set(self.stat_owners) - self._partial_owners)
        partial = f"; {sorted(self._partial_owners)} computed without them" if self._partial_owners else ""
        self.notes.append(
            (f"per-sample quantities {left} left out" if left else "per-sample statistics left out")
            + f": {why}{partial}"
        )
        self.rows_note = self.notes[-1]
        self._left_out |= set(left)
        self.reducer = None

    def _leave_warnings(self) -> None:
        if self._warnings is not None:
            try:
                self._warnings.__exit__(None, None, None)
            except RuntimeError:  # never entered: an interrupt between making it and entering it
                pass
            self._warnings = None

    def close(self) -> None:
        """Leave everything :meth:`enter` set up and free the buffers, from whatever state a failure left the
        pass in (an exception, or a ``KeyboardInterrupt`` in the middle of :meth:`enter` or :meth:`exit`):
        BackPACK's context, the warning filter, the hook backend's hooks. Safe to call again."""
        self._release_kernels()
        context = self._backpack
        if context is not None:
            try:
                context.__exit__(None, None, None)
            except AttributeError:  # its __enter__ was interrupted before it changed BackPACK's context
                pass
            self._backpack = None
        if self._collector is not None:
            self._collector.settle()
        self._replays = []
        self._restore_padding()
        self._leave_warnings()
        if self.hook_backend is not None:
            self.hook_backend.remove_hooks()
        self.free()

    def _restore_padding(self) -> None:
        padding_set, self._padding_set = self._padding_set, []
        for module in padding_set:
            module.padding = "same"

    def _release_kernels(self) -> None:
        if self._kernels_held:
            self._kernels_held = False
            _graph_kernels.release()

    # ---- after backward ---------------------------------------------------------------------
    def partition(self, split: bool, rows: int | None = None):
        """What this backward pass leaves for the end of its step (:class:`~cockpit_like.backends.partitions.Partition`).

        Checks that every tracked parameter got what was asked for, computes the
        needs that read this pass's graph, and (``split``: the step has other
        backward passes) takes the BackPACK buffers that merge, so that the
        next pass cannot overwrite them. The per-sample statistics finish later,
        once the step's gradient is complete.
        """
        from cockpit_like.backends.partitions import Partition, take_mean_fields

        self.check()
        self._check_loss_module()
        self._unscale_curvature()
        computed = {}
        for need in self.needs:
            owners = set(self._need_owners.get(need, ()))
            rowed = getattr(need, "per_sample_rows", False)
            if rowed and owners and owners <= self._left_out:
                continue  # (its rows are known not to be the samples': the quantities are left out, with a note)
            try:
                computed[need] = need.compute(self)
            except (RowsNotSamplesError, RowsNotReproducedError, RowsNotSeenError) as error:  # its own per-sample pass: the rows are
                # not the samples' (outside trial 31: a LayerDrop drawing from Python's `random` stopped the run
                # with TICDiag's GGN pass, where the step's own pass left the per-sample quantities out with a note)
                if not rowed:
                    raise
                left = sorted(owners - self._left_out)
                if left:
                    self.notes.append(f"{left} left out: their curvature comes from per-sample gradients, and {error}")
                self._left_out |= owners
        fields = take_mean_fields(self.params, self.extensions) if split else {}
        reducer = [self.reducer]

        def finish() -> dict:
            results = {} if reducer[0] is None else reducer[0].results()
            results.update(computed)
            return results

        def drop_rows() -> None:
            reducer[0] = None

        if rows is None:
            rows = int(self.info.get("batch_size", 0))
        partition = Partition(rows, finish, fields, self.info)
        partition.left_out, partition.rows_lost, partition.drop_rows = self.left_out_owners(), self.rows_note is not None, drop_rows
        return partition

    def _unscale_curvature(self) -> None:
        """BackPACK's Hessian diagonal of the pass's mean loss when the backpropagated loss was scaled by ``s``.

        BackPACK starts its second-order backpropagation at the loss module, so
        the generalised Gauss-Newton part of ``diag_h`` (the loss Hessian's
        square root) ignores a factor applied after it, while the residual
        terms (second derivatives of the layers times the backpropagated
        gradient) carry it: ``diag_h = G + s R``. The GGN part is
        ``diag_ggn_exact = G``, so ``G + R = G + (diag_h - G) / s``. The other
        curvature buffers (GGN, KFAC) are GGN-type and need nothing.
        """
        correct = self._loss_scale != 1.0 and any(isinstance(ext, DiagHessian) for ext in self.extensions)
        inverse = 1.0 / self._loss_scale
        for param in self.params:
            diag_h, ggn = getattr(param, "diag_h", None), getattr(param, "diag_ggn_exact", None)
            if correct and diag_h is not None and ggn is not None:
                param.diag_h = ggn + (diag_h - ggn) * inverse
            elif correct and diag_h is not None:
                self.curvature_unscaled = True
            # the GGN diagonal added for the correction goes, also where the seen factor made it unneeded (a
            # second undeclared backward pass assumed to be a divided loss): every backward pass of a step
            # leaves the same buffers to merge
            if self._added_ggn and hasattr(param, "diag_ggn_exact"):
                delattr(param, "diag_ggn_exact")

    def whole_step_results(self, leave_out=frozenset()) -> dict:
        """The needs computed once per step, after its last backward pass.

        Each is computed once; a need that builds on another (a trace on the
        step's Lanczos decomposition) reads it with :meth:`whole_step_result`,
        and both are in the result. A need whose quantities are all in
        ``leave_out`` (names: they store nothing at the step) is not computed.
        """
        self._whole_results: dict = {}
        with graph_kernels(held=bool(self._create_graph and self.whole_step_needs)):
            for need in self.whole_step_needs:
                owners = set(self._need_owners.get(need, ()))
                if owners and owners <= set(leave_out):
                    continue
                self.whole_step_result(need)
        return dict(self._whole_results)

    def whole_step_result(self, need):
        """``need.compute(self)``, computed at most once per call of :meth:`whole_step_results`."""
        results = self.__dict__.setdefault("_whole_results", {})
        if need not in results:
            results[need] = need.compute(self)
        return results[need]

    def per_sample_pass(self, loss: torch.Tensor, stats: list) -> dict:
        """Per-sample statistics of the gradient of another ``loss`` on this step's graph (module hooks only).

        The graph of the step's forward pass must still exist (the backward
        pass kept it: ``create_graph=True``). ``p.grad`` is not touched.
        """
        if not self._calls:
            raise UncoveredParameterError(
                f"step {self.step}: a second backward pass needs the model's forward calls; pass "
                "Cockpit(..., model=model) and run the forward pass after creating the cockpit"
            )
        reducer = PerSampleReducer(stats, self.params, keep_grad_batch=False, budget_bytes=self._memory_budget)
        calls = [call.fresh() for call in self._calls]
        backend = HookBackend(calls, self.params, reducer, lambda module: False, self._tracer, self._batch_size, losses=(loss,))
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        backend.enter()
        try:
            # (the graph kernels as in the forward pass: a non-reentrant checkpoint recomputes it here; outside
            # trial 24 got CheckpointError "different metadata" from attention inside one)
            with held_tensor_hooks(self.params), graph_kernels(held=bool(self._create_graph)):
                grads = torch.autograd.grad(loss, [self.params[i] for i in trainable], retain_graph=True, allow_unused=True)
        except RuntimeError as error:
            from cockpit_like.backends.hvp import MissingGraphError, graph_limit

            owners = sorted(self.need_owners_of_rows())
            limit = graph_limit(error, owners, what="it differentiates the loss")
            if limit is not None:  # (a reentrant checkpoint: outside trial 9 got PyTorch's own words about .grad())
                raise RuntimeError(
                    f"step {self.step}: the quantities {owners} need a second backward pass through this step's "
                    f"graph (TIC's GGN diagonal from info['outputs'], or a sampled GGN): {limit}"
                ) from error
            if "backward through the graph a second time" not in str(error):
                raise

            raise MissingGraphError(
                f"step {self.step}: the quantities {sorted(self.need_owners_of_rows())} need a second backward pass "
                "through this step's graph (TIC's GGN diagonal from info['outputs'] on a model without "
                "backpack.extend, or a sampled GGN), but the step's backward pass freed the graph. Call "
                f"`loss.backward(create_graph=cockpit.create_graph({self.step}))` inside the cockpit's block "
                "(cockpit.create_graph(step) is True exactly at the steps that need the graph, so other steps "
                "cost nothing more); or give these quantities an explicit curvature that needs no graph on an "
                "extended model (curvature='diag_h' with backpack.extend), or leave them out."
            ) from error
        finally:
            backend.remove_hooks()
        backend.finish()
        reached = {i for i, grad in zip(trainable, grads) if grad is not None}
        del grads
        missing = [i for i in range(len(self.params)) if i not in reducer.seen]
        uncovered = [i for i in missing if i in reached]
        if uncovered:  # the loss reaches them, but no module call computed their rows
            raise RowsNotSeenError(self._uncovered_message(uncovered))
        for index in missing:
            # not in this loss's graph (a branch skipped at this step, an expert without tokens, a frozen
            # parameter): every row's gradient is zero, as in the step's own pass (:meth:`check`)
            reducer.reduce_lazy(self.params[index], _zero_rows(int(self._batch_size or 1), self.params[index]))
        return reducer.results()

    def _loss_seen(self, module: torch.nn.Module) -> None:
        """BackPACK's extension hook: note an extended loss module in the pass."""
        if is_loss(module):
            self._loss_ran = True
            output = getattr(module, "output", None)
            if isinstance(output, torch.Tensor) and output.numel() == 1:
                self._loss_values.append(output.detach().reshape(()))
            # rows a cross-entropy ignores (ignore_index): its mean skips them, BackPACK's curvature counts them
            # (each row's Hessian in the logits does not depend on the label) and divides by every row
            ignore, targets = getattr(module, "ignore_index", None), getattr(module, "input1", None)
            if ignore is not None and isinstance(targets, torch.Tensor) and not targets.is_floating_point():
                ignored = int((targets == ignore).sum())
                if ignored:
                    self._ignored_rows.append((type(module).__name__, ignore, ignored, targets.numel()))

    def _check_loss_module(self) -> None:
        """BackPACK's second-order extensions give the curvature of the extended loss module's output ``M``; the
        quantities describe ``info["loss"]``. Where the two differ (a term added beside the loss module, such as a
        distillation or auxiliary loss on the same outputs; a weight or a sum reduction: ``0.5 * lossfunc(...)``,
        ``reduction="sum"``), those curvatures differ too, so the quantities that asked for them are left out
        of the step with a note. A factor applied after ``info["loss"]`` (a GradScaler, ``loss / K``) is
        corrected elsewhere (:meth:`_unscale_curvature`)."""
        if self._ignored_rows and self._loss_ran and self._second_owners:
            owners = [owner for owner in self._second_owners if owner not in self._left_out]
            if owners:
                self._left_out |= set(owners)
                name, ignore, ignored, total = self._ignored_rows[0]
                self.notes.append(
                    f"{', '.join(owners)} left out: {ignored} of the {total} targets of the extended {name} are its "
                    f"ignore_index ({ignore}); its loss skips them, but BackPACK's second-order extensions count "
                    "their curvature and divide by every row, so what they give is not the loss's curvature. Pass "
                    "curvature='hutchinson' to these quantities (Hessian-vector products of info['loss'], exact in "
                    f"expectation{HUTCHINSON_SCOPE}), or use the model and loss without backpack.extend (Cockpit(..., model=model))"
                )
            return
        loss = self.info.get("loss")
        if not (self._loss_ran and self._second_owners and self._loss_values) or loss is None:
            return
        module = float(torch.stack([v.to(torch.float64) for v in self._loss_values]).sum())
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        dtype = self._loss_values[0].dtype
        rtol = 0.01 if dtype in HALF else 1e4 * torch.finfo(dtype).eps
        if not (math.isfinite(module) and math.isfinite(value)) or abs(module - value) <= rtol * max(abs(module), abs(value)):
            return
        owners = [owner for owner in self._second_owners if owner not in self._left_out]
        if not owners:
            return
        self._left_out |= set(owners)
        count = len(self._loss_values)
        shown = "the extended loss module's output" if count == 1 else f"the sum of the {count} extended loss modules' outputs"
        self.notes.append(
            f"{', '.join(owners)} left out: BackPACK's second-order extensions give the curvature of {shown} "
            f"({module:.6g}), and info['loss'] is {value:.6g}: the loss has terms beside the extended loss module "
            "(a distillation or auxiliary term on the same outputs), a weight on it, or a sum reduction, so their "
            "curvature is not info['loss']'s. Pass curvature='hutchinson' to these quantities (Hessian-vector "
            f"products of info['loss'], any loss{HUTCHINSON_SCOPE}), or make info['loss'] the output of one extended mean-reduced loss "
            "module"
        )

    def check(self) -> None:
        """Every tracked parameter got what was asked for, or a clear error."""
        params = self.params
        started = [ext for ext in self.extensions if _second_order(ext)]
        if started and not self._loss_ran:
            # the curvature's matrices start at the loss module; without it, what the activations add on their
            # own (the residual terms of a Hessian diagonal) would be taken for the whole curvature
            raise NotExtendedError(
                f"step {self.step}: BackPACK's {', '.join(sorted({describe(ext) for ext in started}))} start at the "
                "loss module, and no extended loss module ran in this backward pass: info['loss'] was not computed "
                "by a loss function wrapped in backpack.extend (F.cross_entropy, or an nn.CrossEntropyLoss that is "
                "not extended). Compute the loss with `lossfunc = backpack.extend(nn.CrossEntropyLoss())` (or "
                "MSELoss, BCEWithLogitsLoss), or pass curvature='hutchinson' to the curvature quantities "
                f"(Hessian-vector products: any loss{HUTCHINSON_SCOPE}); the presets' curvature 'auto' picks BackPACK on an extended "
                "model."
            )
        if self.reducer is not None:
            missing = [i for i in range(len(params)) if i not in self.reducer.seen]
            if missing and len(missing) == len(params) and all(p.grad is None for p in params):
                raise NotExtendedError(self._uncovered_message(missing))
            for index in missing:
                # no per-sample rows: the parameter is not in this pass's graph (an unused branch, an expert
                # without tokens, a frozen parameter), so each row's gradient is zero. Where that is wrong (a
                # parameter used outside its module's forward), the step's gradient check fails.
                self.reducer.reduce_lazy(params[index], _zero_rows(int(self._batch_size or 1), params[index]))
        for ext in self.extensions:
            field = getattr(ext, "savefield", None)
            if field is None or (field == "grad_batch" and self.reducer is not None):
                continue
            missing = [i for i, p in enumerate(params) if not hasattr(p, field)]
            if missing and len(missing) < len(params) and field in _ZERO_FIELDS:
                for index in [i for i in missing if not params[i].requires_grad or params[i].grad is None]:
                    setattr(params[index], field, torch.zeros_like(params[index]))  # not in the graph: zero
                missing = [i for i, p in enumerate(params) if not hasattr(p, field)]
            if len(missing) == len(params):
                raise NotExtendedError(
                    f"step {self.step}: BackPACK computed no {describe(ext)} ('{field}') for any "
                    "parameter. The model (and, for curvature, the loss function) must be "
                    "extended: `model = backpack.extend(model)`, `lossfunc = "
                    "backpack.extend(lossfunc)`, and the forward pass must run after that. Or pass "
                    "curvature='hutchinson' (Hessian-vector products: no extend, any loss; 'auto' picks BackPACK "
                    f"on an extended model and cannot check the loss function{HUTCHINSON_SCOPE})."
                )
            if missing:
                shown = ", ".join(self._name(i) for i in missing[:5])
                raise NotExtendedError(
                    f"step {self.step}: BackPACK computed no {describe(ext)} for parameters "
                    f"{shown}{' ...' if len(missing) > 5 else ''}. Their module is not extended "
                    "with backpack.extend, BackPACK does not support it, or they are not used in the "
                    "loss; extend every module that holds tracked parameters, pass curvature='hutchinson' "
                    f"(Hessian-vector products on any model{HUTCHINSON_SCOPE}), or pass only those parameters to Cockpit(params)."
                )

    def _name(self, index: int) -> str:
        param = self.params[index]
        name = self.names.get(id(param))
        return f"#{index} {name} {list(param.shape)}" if name else f"#{index} {list(param.shape)}"

    def _uncovered_message(self, missing: list[int]) -> str:
        shown = ", ".join(self._name(i) for i in missing[:5])
        more = " ..." if len(missing) > 5 else ""
        unused = [i for i in missing if self.params[i].grad is None]
        if len(unused) == len(missing):
            return (
                f"step {self.step}: parameters {shown}{more} got no gradient in this backward pass, so "
                "they have no per-sample gradients. Pass only parameters the loss depends on to "
                "Cockpit(params), e.g. the trainable parameters of the model you train."
            )
        legacy = [self._name(i) for i in missing if (self.names.get(id(self.params[i])) or "").rsplit(".", 1)[-1]
                  in ("weight_g", "weight_v", "weight_orig")]  # fmt: skip
        if legacy:
            return (
                f"step {self.step}: no per-sample gradients were computed for parameters {shown}{more}: "
                f"{', '.join(legacy[:3])} {'is' if len(legacy) == 1 else 'are'} the parameters of the legacy "
                "torch.nn.utils.weight_norm or spectral_norm, which compute the weight in a forward pre-hook that "
                "the cockpit's re-runs of the layer do not run: use torch.nn.utils.parametrizations.weight_norm or "
                "spectral_norm (the cockpit re-runs parametrized layers)."
            )
        return (
            f"step {self.step}: no per-sample gradients were computed for parameters {shown}{more}. The "
            "cockpit sees a parameter through the forward call of its module: pass the model, "
            "Cockpit(params, quantities, model=model), and run its forward pass (with gradients "
            "enabled) after creating the cockpit; a parameter used outside its module's forward "
            "(e.g. F.linear(x, self.layer.weight) in a parent that owns no parameters) cannot be "
            "seen. Alternatively extend the model with backpack.extend."
        )

    def ran_again(self) -> list[str]:
        """The BackPACK-extended modules (class names) whose kept input and output are no longer this pass's
        call's, asked as the block's first backward pass begins: the model ran again inside the block (an
        evaluation batch with gradients on), and BackPACK's extensions would read that call's inputs."""
        calls, self._extended_calls = self._extended_calls, []
        if not self.extensions or not calls:
            return []
        return sorted({type(module).__name__ for module in _stale_extended(calls)} - {
            type(module).__name__ for module in self._repeated_extended})

    def free(self) -> None:
        """Delete the BackPACK buffers nobody asked to keep (the user's ``*exts`` keep theirs)."""
        self._extended_calls = []
        user_types = self._user_types
        fields = {ext.savefield for ext in self.extensions if type(ext) not in user_types and hasattr(ext, "savefield")}
        if self.reducer is not None:
            fields.update(field for stat in self.reducer.stats for field in stat.param_fields)
        for param in self.params:
            for field in fields:
                if hasattr(param, field):
                    delattr(param, field)


#: the note of a step whose forward pass ran attention with the math kernel (``checks["notes"]``)
MATH_ATTENTION_NOTE = (
    "attention ran with PyTorch's math kernel: this step needs the graph of p.grad (create_graph, for "
    "Hessian-vector products), so the cockpit ran its forward pass under torch.nn.attention.sdpa_kernel("
    "SDPBackend.MATH) (and cuDNN off), whose attention has a second derivative; the fused kernels (flash, "
    "memory-efficient) have none. Same values to rounding; this forward pass was slower and held more memory "
    "than the others"
)


def _freed_buffer(exc: BaseException) -> str | None:
    """The class name of the module whose BackPACK buffers (``output``, ``input0``, ...) were missing in the
    backward pass, where ``exc`` says so (an ``AttributeError`` raised by ``nn.Module.__getattr__``)."""
    if not isinstance(exc, AttributeError):
        return None
    import re

    match = re.fullmatch(r"'(\w+)' object has no attribute '(output|input\d+)'", str(exc))
    return None if match is None else match.group(1)


def _repeated_extended(calls: list) -> list:
    """The BackPACK-extended modules that more than one of ``calls`` ran."""
    seen: dict[int, int] = {}
    repeated = []
    for call in calls:
        module = call.module
        if not is_extended(module):
            continue
        seen[id(module)] = seen.get(id(module), 0) + 1
        if seen[id(module)] == 2:
            repeated.append(module)
    return repeated


HALF = (torch.float16, torch.bfloat16)


def _second_order(extension) -> bool:
    """Whether ``extension`` is one of BackPACK's second-order extensions (they backpropagate matrices)."""
    return type(extension).__module__.startswith("backpack.extensions.secondorder")


def _stale_extended(calls: list) -> list:
    """The BackPACK-extended modules of ``calls`` whose output kept by BackPACK (``module.output``) is not the
    call's: another call of the module came after it, or BackPACK freed its buffers."""
    from cockpit_like.backends.tracer import Shell, _flat_outputs

    stale = []
    for call in calls:
        module = call.module
        outputs = _flat_outputs(call.output) if is_extended(module) else []
        if not outputs or module in stale:
            continue
        kept, first = getattr(module, "output", None), outputs[0]  # BackPACK keeps a call's first output
        same = first.is_tensor(kept) if isinstance(first, Shell) and first.ref is not None else kept is first
        if not same and (isinstance(first, torch.Tensor) or first.ref is not None):
            stale.append(module)
    return stale


def _paths_around(loss, calls: list, params: list, names: dict) -> dict | None:
    """:func:`~cockpit_like.checks.rows.paths_around_the_calls` for this step's calls: the tracked parameters of
    modules whose calls were recorded, the calls' outputs as the stops."""
    if not calls or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return None
    from cockpit_like.backends.tracer import _call_nodes, _flat_outputs
    from cockpit_like.checks.rows import paths_around_the_calls

    tracked = {id(p): index for index, p in enumerate(params)}
    covered, stops = {}, []
    for call in calls:
        # (not a call's outputs without rows: a penalty ||W||^2 that the model's forward returns beside its logits
        # reads W around W's own call, as the same penalty written in the loss does; outside trial 27)
        outputs = [t for t in _flat_outputs(call.output) if getattr(t, "grad_fn", None) is not None]
        if outputs and all(len(t.shape) == 0 for t in outputs):
            continue
        stops.extend(node for node in _call_nodes(call)
                     if not any(len(t.shape) == 0 and t.grad_fn is node for t in outputs))
        for name, param in call.module.named_parameters(recurse=False):
            if id(param) in tracked and name not in call.swapped:
                covered[id(param)] = names.get(id(param)) or f"#{tracked[id(param)]} {list(param.shape)}"
    return paths_around_the_calls(loss, stops, covered)


def _scalars_and_row_nodes(tracer, calls: list, batch_size) -> tuple[list, frozenset]:
    """``(the 0-dim floating outputs of the models' outermost calls, the ids of the graph nodes of every call's
    outputs with the batch's rows)``: what :func:`~cockpit_like.checks.rows.coupled_rows` needs to see a number of
    the whole batch that the losses read (nothing where no call returns a scalar)."""
    if tracer is None or not calls or not batch_size:
        return [], frozenset()
    from cockpit_like.backends.tracer import _flat_outputs

    roots, batch = {id(ref()) for ref in tracer.roots}, int(batch_size)
    scalars = [output for call in calls if id(call.module) in roots for output in _flat_outputs(call.output)
               if getattr(output, "grad_fn", None) is not None and output.dim() == 0 and output.dtype.is_floating_point]  # fmt: skip
    if not scalars:
        return [], frozenset()
    nodes = frozenset(
        id(output.grad_fn) for call in calls for output in _flat_outputs(call.output)
        if getattr(output, "grad_fn", None) is not None and output.dim() > 0 and rows_dim(output.shape, batch) is not None
    )  # fmt: skip
    return scalars, nodes


def _root_outputs(tracer, calls: list, batch_size) -> list:
    """The floating outputs of the models' own calls this step with one row per sample along their batch
    dimension (:func:`~cockpit_like.backends.row_paths.rows_dim`): those with leading dimension ``B`` first, then
    the others (an RNN's ``h_n`` ``[layers, B, H]``). Every call of a model, not only its last: a loss over two
    calls (InfoNCE's keys computed before the anchors, prototypes from a support set of ``B`` rows) couples the rows
    through the earlier one (outside trial 15: stored as valid with NormTest 0.84 for 0.36)."""
    if tracer is None or not calls or not batch_size:
        return []
    from cockpit_like.backends.tracer import _flat_outputs

    roots, batch = {id(ref()) for ref in tracer.roots}, int(batch_size)
    # and every outermost call (one no other call encloses: `model.encoder(x)` called from the training loop, whose
    # output an InfoNCE loss reads; outside trial 16: stored as valid with NormTest 1.39 for 1.26)
    leading, later, seen = [], [], set()
    first = math.inf  # the earliest position a later call encloses (calls start.. before it are its descendants)
    for call in reversed(calls):  # the outermost call is noted last
        enclosed, first = call.position >= first, min(first, call.start)
        if enclosed and id(call.module) not in roots:
            continue
        for output in _flat_outputs(call.output):
            if getattr(output, "grad_fn", None) is None or not output.dtype.is_floating_point or output.dim() == 0:
                continue
            if id(output) in seen:
                continue
            seen.add(id(output))
            dim = rows_dim(output.shape, batch)
            if dim is not None and output.shape[dim] == batch:
                (leading if dim == 0 else later).append(output)
    return leading + later


#: BackPACK savefields shaped like the parameter, zero for a parameter outside the pass's graph
_ZERO_FIELDS = frozenset({"diag_h", "diag_ggn_exact", "diag_ggn_mc", "sum_grad_squared", "variance", "batch_l2", "batch_dot"})


def _zero_rows(batch: int, param: torch.Tensor):
    """The per-sample gradients of a parameter outside the pass's graph: ``batch`` zero rows, made lazily."""
    from cockpit_like.backends.per_sample import LazyRows

    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    return LazyRows(
        batch, param.shape,
        lambda start, stop: torch.zeros(stop - start, *param.shape, dtype=dtype, device=param.device),
        torch.finfo(dtype).bits // 8, lambda: torch.zeros(param.shape, dtype=dtype, device=param.device),
    )  # fmt: skip


def _same_padding_convs(calls: list) -> list:
    """The extended convolutions of ``calls`` with ``padding="same"`` and a symmetric padding (an odd
    ``dilation * (kernel - 1)`` pads one more at the end: those stay, and BackPACK's error is explained)."""
    from torch.nn.modules.conv import _ConvNd

    found = []
    for call in calls:
        module = call.module
        if isinstance(module, _ConvNd) and is_extended(module) and module.padding == "same" and module not in found:
            if all(d * (k - 1) % 2 == 0 for d, k in zip(module.dilation, module.kernel_size)):
                found.append(module)
    return found


def _explicit_same_padding(modules: list) -> list:
    """Give each convolution its ``"same"`` padding as numbers (``dilation * (kernel - 1) / 2`` per side,
    symmetric: the same output as ``"same"`` at stride 1, which ``"same"`` requires) for BackPACK's derivatives,
    which subtract the padding from sizes; returns the modules changed (``module.padding = "same"`` puts it back)."""
    changed = []
    for module in modules:
        module.padding = tuple(d * (k - 1) // 2 for d, k in zip(module.dilation, module.kernel_size))
        changed.append(module)
    return changed


def _from_backpack(exc: BaseException) -> bool:
    """Whether ``exc`` is BackPACK failing on the model (then the cockpit's :class:`UnsupportedLayerError` with its
    fixes): a ``NotImplementedError``; an ``AssertionError`` or ``TypeError`` raised through BackPACK's code; a
    ``ValueError``, ``RuntimeError`` or ``IndexError`` raised in BackPACK's code or in torch called from it (its
    traceback's last BackPACK frame after its last frame of the cockpit: outside trials 39 and 42, "Only 2D inputs
    are currently supported", a shape error of its KFLR on a reshaped output), not one of the cockpit's own
    errors passing through BackPACK's hooks."""
    if isinstance(exc, NotImplementedError):
        return True
    if not isinstance(exc, (AssertionError, TypeError, ValueError, RuntimeError, IndexError)):
        return False
    origins = []
    tb = exc.__traceback__
    while tb is not None:
        origins.append(_origin(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    if isinstance(exc, (AssertionError, TypeError)):
        return "backpack" in origins
    last_backpack = max((i for i, o in enumerate(origins) if o == "backpack"), default=-1)
    last_cockpit = max((i for i, o in enumerate(origins) if o == "cockpit"), default=-1)
    return last_backpack > last_cockpit


def _origin(filename: str) -> str:
    """``"backpack"``, ``"cockpit"`` or ``""``: whose code a traceback frame's file is."""
    path = filename.replace("\\", "/")
    if "backpack" in path.split("/site-packages/")[-1].split("/")[0]:
        return "backpack"
    return "cockpit" if "/cockpit_like/" in path else ""


def _chain(hooks: list):
    if len(hooks) == 1:
        return hooks[0]

    def run_all(module: torch.nn.Module) -> None:
        for hook in hooks:
            hook(module)

    return run_all

