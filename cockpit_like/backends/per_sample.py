"""Statistics of per-sample gradients, reduced layer by layer during backward.

A :class:`PerSampleStat` is a frozen dataclass: equal statistics (same type,
same fields) are one need, computed once per step however many quantities
ask for it. During BackPACK's backward pass, after a module's per-sample
information is computed, :class:`PerSampleReducer` (BackPACK's extension
hook) hands it to every requested statistic and then frees it, so the
``N x D`` per-sample gradient of the whole network never exists at once.

A module's per-sample information comes in one of two forms:

- **factors** (``nn.Linear`` with 2-D input, offered by
  :class:`~cockpit_like.backends.per_sample_extension.PerSampleStatistics`):
  the per-sample gradient of the weight is the outer product
  ``grad_batch[i] = delta_i x_i^T`` (``x = module.input0`` ``[B, in]``,
  ``delta`` the output gradient ``[B, out]``), that of the bias is
  ``delta_i``. Statistics with a factor form
  (:attr:`PerSampleStat.factor_form`) reduce ``(x, delta)`` directly,
  without any ``[B, out, in]`` tensor; the others get ``grad_batch``
  materialised once per parameter and shared between them.
- **grad_batch** (every other layer, or BackPACK's ``BatchGrad`` when a
  quantity or the user asked for the raw ``grad_batch``): ``[B, *param.shape]``.

Scaling: the loss is the *mean* over the batch of ``B`` samples, so
BackPACK's ``grad_batch[i] = g_i / B`` where ``g_i`` is the gradient of the
``i``-th sample's loss (``delta`` already carries the ``1/B``).

Bounded memory: where a statistic needs ``grad_batch`` itself (histograms,
sums of squares, ... of a layer given as factors, sequence factors or
:class:`LazyRows`), the reducer materialises it a block of rows at a time,
each block at most ``budget_bytes`` (default :data:`DEFAULT_BUDGET_BYTES`,
``Cockpit(..., memory_budget=...)``), and statistics with a row form
(:attr:`PerSampleStat.row_form`) fold each block in with its :class:`Rows`
(where the block lies in the batch, and the batch's sum for row sums). A
layer that fits the budget is materialised once, as before. Layers whose
per-sample gradients are made by a module rule from its input
(convolutions, embeddings, a tied weight's several uses) come as
:class:`LazyRows`, so not even the producer builds the whole ``[B, *shape]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = [
    "PerSampleStat",
    "PerSampleReducer",
    "Rows",
    "LazyRows",
    "DEFAULT_BUDGET_BYTES",
    "materialize_linear",
    "materialize_sequence",
    "GRAD_BATCH_TRANSFORMS",
    "publish_transform_results",
]

#: default bound on the per-sample gradients materialised at once (one block of one layer's rows)
DEFAULT_BUDGET_BYTES = 256 << 20

#: the attribute where Cockpit's ``BatchGradTransformsHook`` leaves its results on a parameter
GRAD_BATCH_TRANSFORMS = "grad_batch_transforms"


def publish_transform_results(param: torch.Tensor, results: dict[str, Any], overwrite: bool = True) -> None:
    """Add ``results`` to ``param.grad_batch_transforms`` (a dict, created on first use), as Cockpit's hooks do.

    Statistics that stand in for one of Cockpit's transforms publish their
    result under Cockpit's name with ``overwrite=False``, so that a transform
    a quantity asked for under the same name keeps its own value. The
    attribute is one of the statistic's ``param_fields``: the cockpit deletes
    it when the step's quantities have run.
    """
    current = getattr(param, GRAD_BATCH_TRANSFORMS, None)
    merged = dict(current) if isinstance(current, dict) else {}
    for name, value in results.items():
        if overwrite or name not in merged:
            merged[name] = value
    setattr(param, GRAD_BATCH_TRANSFORMS, merged)

#: a layer's ``grad_batch`` of at least this many bytes is made in a buffer the reducer reuses for the next
#: such layers of the step, where every statistic only reads it (:meth:`PerSampleStat.borrows`): glibc
#: maps blocks this large fresh from the system at each allocation, and the first touch of their pages
#: cost GPT-2 small's ``bmm`` of its per-sample gradients ~20% more time
BORROW_BYTES = 32 << 20


def materialize_linear(kind: str, x: torch.Tensor | None, delta: torch.Tensor) -> torch.Tensor:
    """``grad_batch`` of a linear layer's ``"weight"`` (``delta_i x_i^T``) or ``"bias"`` (``delta_i``).

    Every entry is one product, so this is bitwise what BackPACK's ``BatchGrad`` computes.
    """
    if kind == "bias":
        return delta
    return delta.unsqueeze(2) * x.unsqueeze(1)


def linear_sum(kind: str, x: torch.Tensor | None, delta: torch.Tensor) -> torch.Tensor:
    """``sum_i grad_batch[i]`` of a linear layer's factors (``[out]`` bias, ``[out, in]`` weight)."""
    return delta.sum(0) if kind == "bias" else delta.T @ x


def _common(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` in one dtype, the wider one (under autocast a layer's input and its output gradient can
    differ: a float32 input, a bfloat16 gradient)."""
    if a.dtype == b.dtype:
        return a, b
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def sequence_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_i sum_t a[i, t] b[i, t]^T`` (``R x C``) as one matrix product of transposed views (no copy of ``a``)."""
    a, b = _common(a, b)
    return a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])


def materialize_sequence(a: torch.Tensor, b: torch.Tensor, shape: torch.Size, out: torch.Tensor | None = None) -> torch.Tensor:
    """``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` (``a`` ``[B, T, R]``, ``b`` ``[B, T, C]``), reshaped to ``[B, *shape]``
    (written into ``out``, ``B R C`` contiguous entries, if given)."""
    a, b = _common(a, b)
    if out is None:
        return torch.bmm(a.transpose(1, 2), b).reshape(a.shape[0], *shape)
    result = out.view(a.shape[0], a.shape[2], b.shape[2])
    torch.bmm(a.transpose(1, 2), b, out=result)
    return result.reshape(a.shape[0], *shape)


class Rows:
    """Where a block of rows ``start:stop`` lies in a layer's batch of ``batch`` rows.

    :meth:`once` computes something once per layer for all its blocks (the
    layer's parameter gathered whole, ...); :meth:`total` is the batch's sum
    ``sum_k grad_batch[k]`` (shaped like the parameter), made on first use
    (the row sums of :class:`~cockpit_like.backends.per_sample_stats.GramSummary` need it).
    """

    __slots__ = ("start", "stop", "batch", "_lazy", "_memo")

    def __init__(self, start: int, stop: int, lazy: "LazyRows", memo: dict):
        self.start, self.stop, self.batch, self._lazy, self._memo = start, stop, lazy.batch, lazy, memo

    def once(self, key, make):
        """``make()`` the first time a block of this layer asks for ``key``; the same value afterwards."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def total(self) -> torch.Tensor:
        return self.once("total", self._lazy.batch_sum)


class LazyRows:
    """Per-sample gradients ``[B, *shape]`` made a block of rows at a time: ``make(start, stop)``.

    Also what statistics that keep a layer until the end of the step hold
    (like ``RetainedDense``): ``batch_sum()`` and ``dots(direction)`` walk
    the rows in blocks of ``block`` rows.
    """

    __slots__ = ("batch", "shape", "make", "itemsize", "block", "_batch_sum", "add_into", "add_sum_into")

    def __init__(self, batch: int, shape, make, itemsize: int = 4, batch_sum=None, add_into=None, add_sum_into=None):
        self.batch, self.shape, self.make, self.itemsize = int(batch), torch.Size(shape), make, itemsize
        self.block = self.batch
        self._batch_sum = batch_sum
        #: ``add_into(out, start, stop)``: add rows ``start:stop`` to ``out`` in place (without building them)
        self.add_into = add_into
        #: ``add_sum_into(out)``: add the batch sum to ``out`` (shaped like the parameter) in place
        self.add_sum_into = add_sum_into

    @property
    def row_bytes(self) -> int:
        return max(1, self.shape.numel() * self.itemsize)

    def blocks(self, block: int | None = None):
        block = max(1, block or self.block)
        for start in range(0, self.batch, block):
            stop = min(self.batch, start + block)
            yield start, stop, self.make(start, stop)

    def batch_sum(self) -> torch.Tensor:
        if self._batch_sum is not None:
            return self._batch_sum().reshape(self.shape)
        total = None
        for _, _, rows in self.blocks():
            part = rows.sum(0)
            total = part if total is None else total.add_(part)
        return total.reshape(self.shape)

    def dots(self, direction: torch.Tensor) -> torch.Tensor:
        parts = []
        for _, _, rows in self.blocks():
            flat = rows.reshape(rows.shape[0], -1)
            parts.append(flat @ direction.reshape(-1).to(flat.dtype))
        return torch.cat(parts)


@dataclass(frozen=True)
class PerSampleStat:
    """Base class: a reduction of per-sample gradients to a small result.

    Subclasses implement :meth:`init`, :meth:`accumulate` and :meth:`finalize`,
    and, where the statistic has a closed form for outer-product per-sample
    gradients, :meth:`accumulate_factors` with ``factor_form = True``.
    """

    #: whether :meth:`accumulate_factors` works on the factors without materialising ``grad_batch``
    factor_form: ClassVar[bool] = False
    #: with a factor form that still visits every entry (histograms): use ``grad_batch``
    #: instead when another statistic materialises it anyway
    reuses_grad_batch: ClassVar[bool] = False
    #: attributes the statistic sets on the parameters (e.g. ``grad_batch_transforms``);
    #: the cockpit deletes them once the step's quantities have run
    param_fields: ClassVar[tuple[str, ...]] = ()

    def init(self, params: list[torch.Tensor]) -> Any:
        """Fresh accumulator state for one step."""
        raise NotImplementedError

    def accumulate(self, state: Any, index: int, param: torch.Tensor, grad_batch: torch.Tensor) -> Any:
        """Fold in parameter ``index``'s ``grad_batch`` ``[B, *param.shape]``; return the state."""
        raise NotImplementedError

    def accumulate_factors(
        self, state: Any, index: int, param: torch.Tensor, kind: str, x: torch.Tensor | None, delta: torch.Tensor
    ) -> Any:
        """Fold in a linear layer's parameter given as factors; return the state.

        ``kind == "weight"``: ``grad_batch[i] = delta[i] x[i]^T`` (``delta`` ``[B, out]``,
        ``x`` ``[B, in]``); ``kind == "bias"``: ``grad_batch[i] = delta[i]`` (``x`` is None).
        The default materialises ``grad_batch`` and calls :meth:`accumulate`.
        """
        return self.accumulate(state, index, param, materialize_linear(kind, x, delta))

    #: whether :meth:`accumulate_sequence` works on sequence factors without materialising ``grad_batch``
    sequence_form: ClassVar[bool] = False
    #: with a sequence form: read the factors even when ``grad_batch`` is materialised for other statistics
    prefers_factors: ClassVar[bool] = False

    def accumulate_sequence(
        self, state: Any, index: int, param: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> Any:
        """Fold in a parameter whose per-sample gradient is a sum of outer products over positions.

        ``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` reshaped to ``param.shape``
        (``a`` ``[B, T, R]``, ``b`` ``[B, T, C]``, ``R * C = param.numel()``):
        a linear layer applied to every token of a sequence, a convolution on
        its unfolded input. The default materialises ``grad_batch``.
        """
        return self.accumulate(state, index, param, materialize_sequence(a, b, param.shape))

    #: whether :meth:`accumulate_rows` folds in a block of a layer's rows (see :class:`Rows`); without it the
    #: reducer gives the statistic the whole ``grad_batch`` even when that exceeds the memory budget
    row_form: ClassVar[bool] = False

    def accumulate_rows(
        self, state: Any, index: int, param: torch.Tensor, grad_batch: torch.Tensor, rows: Rows
    ) -> Any:
        """Fold in rows ``rows.start:rows.stop`` (``grad_batch`` ``[stop - start, *param.shape]``) of a
        batch of ``rows.batch``; called for every block of the layer in order."""
        raise NotImplementedError

    def keeps(self) -> bool:
        """Whether the statistic keeps each layer until ``finalize`` (then the reducer hands it a
        layer it blocks as a whole, through :meth:`accumulate_kept`)."""
        return False

    def borrows(self, state: Any, nbytes: int) -> bool:
        """Whether :meth:`accumulate` with this ``state`` only reads a ``grad_batch`` of ``nbytes``
        during the call and keeps no reference to it: the reducer may then make it in a buffer that it
        overwrites with the next layer's (:data:`BORROW_BYTES`). ``False`` unless a statistic says so."""
        return False

    def accumulate_kept(self, state: Any, index: int, param: torch.Tensor, kept: LazyRows) -> Any:
        """Keep a layer given in blocks (``kept.batch_sum()``, ``kept.dots(direction)``)."""
        raise NotImplementedError

    #: whether :meth:`accumulate_sum` folds in a layer from its batch sum alone: where the layer comes in blocks
    #: of rows (``LazyRows.batch_sum``: no rows are made for the statistic), and where another statistic reads
    #: the batch sum anyway (:meth:`reads_batch_sum`: the reducer makes it once, the statistic reads it instead
    #: of the rows)
    sum_form: ClassVar[bool] = False

    def reads_batch_sum(self, state: Any) -> bool:
        """Whether :meth:`accumulate` and :meth:`accumulate_sequence` take ``batch_sum=`` (the layer's
        ``sum_i grad_batch[i]``, shaped like the parameter): the reducer then makes it once per layer for
        every statistic that reads it. ``False`` unless a statistic says so."""
        return False

    def accumulate_sum(self, state: Any, index: int, param: torch.Tensor, batch_sum: torch.Tensor) -> Any:
        """Fold in a layer from ``sum_i grad_batch[i]`` (shaped like the parameter); see :attr:`sum_form`."""
        raise NotImplementedError

    def note_half_precision(self, state: Any, index: int) -> None:
        """The rows of parameter ``index`` were made in half precision (autocast, half parameters), before the
        reducer handed them on in float32. Nothing by default (the self-check's probe loosens its tolerance)."""

    def note_half_sum(self, state: Any, index: int) -> None:
        """Autograd sums parameter ``index``'s gradient over every position in half precision (a norm layer, an
        embedding over more positions than rows, with half-precision parameters). Nothing by default (the
        self-check's probe does not compare it)."""

    #: whether :meth:`accumulate_module` wants each layer call's input and output gradient (hook backend)
    module_form: ClassVar[bool] = False

    def accumulate_module(self, state: Any, module: torch.nn.Module, x: torch.Tensor, delta: torch.Tensor) -> Any:
        """Fold in one call of ``module`` that a per-layer rule handled: its first input ``x`` and the
        gradient ``delta`` of the mean loss w.r.t. its output (before the call's parameters arrive).
        Only statistics with ``module_form = True`` are asked (the curvature logs of
        :mod:`cockpit_like.statistics`)."""
        return state

    def finalize(self, state: Any) -> Any:
        """The result quantities read with ``record.stat(self)``."""
        return state

    # ---- under DistributedDataParallel (cockpit_like.backends.distributed) -------------
    def for_ranks(self) -> "PerSampleStat":
        """The statistic each rank computes under DDP (equal to ``self``; default: ``self``).

        A statistic whose reduction needs the *global* mean gradient returns a
        form that keeps what it needs until ``finalize``, when ``p.grad`` is
        synchronised (fields with ``compare=False``, so it is still found
        under the requested statistic).
        """
        return self

    # A statistic used under DDP also defines ``across_ranks(result, reduction) -> () -> result``:
    # it registers its local result's parts with ``reduction`` (``sum``, ``cat``, ``max``, ``mean``;
    # :class:`cockpit_like.backends.distributed.RankReduction`) and returns the function that builds
    # the global batch's result after the step's one all-reduce.


class PerSampleReducer:
    """The BackPACK extension hook that feeds per-sample gradients to statistics.

    Per-sample information reaches it either from
    :class:`~cockpit_like.backends.per_sample_extension.PerSampleStatistics`
    (``offer_factors`` / ``offer_grad_batch``, nothing stored on the
    parameters) or, with BackPACK's ``BatchGrad``, as ``param.grad_batch``.

    Args:
        stats: distinct statistics to compute.
        params: the tracked parameters (others are ignored).
        keep_grad_batch: leave ``grad_batch`` on the parameters (someone asked for it).
        info: the step's ``info`` dict, for statistics that define ``init_for_step``.
        row_scale: factor that makes each row's contribution that of a plain mean-loss backward pass over
            this pass's rows (:mod:`cockpit_like.backends.partitions`): ``K`` when the loss of each of
            ``K`` micro-batches is divided by ``K``, times ``1 / S`` under a ``GradScaler`` of scale ``S``.

    Per-sample information in half precision (``float16``, ``bfloat16``:
    autocast, low-precision parameters) reaches the statistics in
    ``float32``, so that they accumulate in single precision or better.
    """

    def __init__(
        self,
        stats: list[PerSampleStat],
        params: list[torch.Tensor],
        keep_grad_batch: bool,
        info: dict | None = None,
        row_scale: float = 1.0,
        budget_bytes: int | None = None,
    ):
        self.stats = stats
        self.budget_bytes = DEFAULT_BUDGET_BYTES if budget_bytes is None else max(1, int(budget_bytes))
        #: blocks of rows materialised for statistics without a factor form (tests read it)
        self.blocks = 0
        self.keep_grad_batch = keep_grad_batch
        self.row_scale = float(row_scale)
        self._index = {id(p): i for i, p in enumerate(params)}
        # a statistic with ``init_for_step(params, info)`` reads the step's info (e.g. the optimizer)
        self._states = [
            stat.init_for_step(params, info or {}) if hasattr(stat, "init_for_step") else stat.init(params)
            for stat in stats
        ]
        self._pending: dict[int, tuple] = {}
        #: the rows every layer's per-sample information must have: one per entry of ``info["individual_losses"]``
        #: (``None``: not given; ``info["batch_size"]`` alone may be a scale, as in Cockpit's TIC)
        losses = (info or {}).get("individual_losses")
        self.rows = losses.numel() if isinstance(losses, torch.Tensor) and losses.dim() == 1 else None
        self._buffer: torch.Tensor | None = None  # see _borrowed
        self.seen: set[int] = set()
        #: a parameter's rows were offered twice by BackPACK's hooks (two backward passes in one block)
        self.repeated = False
        #: indices of the statistics that read layer inputs and output gradients (:meth:`observe_module`)
        self.module_stats = [k for k, stat in enumerate(stats) if stat.module_form]

    def __repr__(self) -> str:
        return f"PerSampleReducer({len(self.stats)} statistics)"

    # ---- offered by the extension during a module's backward ---------------------
    def tracks(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the tracked parameters."""
        return id(param) in self._index

    def offer_factors(self, param: torch.Tensor, kind: str, x: torch.Tensor | None, delta: torch.Tensor) -> None:
        """A linear layer's parameter as factors (see :meth:`PerSampleStat.accumulate_factors`)."""
        self._pending[id(param)] = (kind, x, delta, None)

    def offer_grad_batch(self, param: torch.Tensor, grad_batch: torch.Tensor) -> None:
        """A parameter's ``grad_batch`` ``[B, *param.shape]``."""
        self._pending[id(param)] = (None, None, None, grad_batch)

    def offer_lazy(self, param: torch.Tensor, lazy: "LazyRows") -> None:
        """A parameter's ``grad_batch`` made a block of rows at a time."""
        self._pending[id(param)] = ("lazy", None, None, lazy)

    # ---- the extension hook ------------------------------------------------------
    def __call__(self, module: torch.nn.Module) -> None:
        for param in module.parameters(recurse=False):
            index = self._index.get(id(param))
            if index is None:
                continue
            pending = self._pending.pop(id(param), None)
            if pending is not None:
                kind, x, delta, grad_batch = pending
                self._check_rows(module, param, grad_batch.batch if kind == "lazy" else (
                    grad_batch.shape[0] if kind is None else delta.shape[0]))
                self.repeated |= index in self.seen  # a second backward pass through BackPACK's hooks
                self.seen.add(index)
                if kind == "lazy":
                    self.reduce_lazy(param, grad_batch)
                elif kind is None:
                    self._note_precision(index, grad_batch)
                    self._reduce(index, param, self._scaled(grad_batch))
                else:
                    self._note_precision(index, x, delta)
                    self._reduce_factors(index, param, kind, _upcast(x), self._scaled(delta))
                continue
            grad_batch = getattr(param, "grad_batch", None)
            if grad_batch is None:
                continue
            self._check_rows(module, param, grad_batch.shape[0])
            self.repeated |= index in self.seen
            self.seen.add(index)
            self._note_precision(index, grad_batch)
            self._reduce(index, param, self._scaled(grad_batch))
            if not self.keep_grad_batch:
                del param.grad_batch

    def _check_rows(self, module: torch.nn.Module, param: torch.Tensor, rows: int) -> None:
        """BackPACK's rows of a layer are the step's rows, one per row loss, or a clear error (never rows of
        another batch reduced as if they were the step's)."""
        if self.rows is None or int(rows) == self.rows:
            return
        raise ValueError(
            f"BackPACK computed {int(rows)} per-sample rows for a parameter of shape {list(param.shape)} of a "
            f"{type(module).__name__} layer, but info['individual_losses'] has {self.rows} rows. The model ran on other rows than the losses describe: a pair or "
            "triplet loss over one call on torch.cat([x1, x2]) gives each loss two rows of the batch. Per-sample "
            "quantities need each loss to have one row of every layer: for such losses, call the un-extended "
            "model once per part (model(x1), model(x2): Cockpit(..., model=model) sums a row's gradient over the "
            "calls, exactly), or leave the per-sample quantities out (Loss, GradNorm, Distance, UpdateSize, "
            "HessMaxEV need no rows)."
        )

    def _reduce(self, index: int, param: torch.Tensor, grad_batch: torch.Tensor) -> None:
        shared = self._shared_sum(lambda: grad_batch.sum(0))
        for k, stat in enumerate(self.stats):
            self._states[k] = self._accumulate_dense(k, stat, index, param, grad_batch, shared)

    def _shared_sum(self, make) -> torch.Tensor | None:
        """The layer's batch sum of rows, made once (``make()``) if a statistic reads it (:meth:`PerSampleStat.reads_batch_sum`)."""
        if any(stat.reads_batch_sum(state) for stat, state in zip(self.stats, self._states)):
            return make()
        return None

    def _accumulate_dense(self, k: int, stat: PerSampleStat, index: int, param, grad_batch, shared) -> Any:
        """``stat`` folds in a layer's ``grad_batch``, or the batch sum ``shared`` where it reads that."""
        state = self._states[k]
        if shared is not None and stat.sum_form:
            return stat.accumulate_sum(state, index, param, shared.reshape(param.shape))
        if shared is not None and stat.reads_batch_sum(state):
            return stat.accumulate(state, index, param, grad_batch, batch_sum=shared)
        return stat.accumulate(state, index, param, grad_batch)

    def _fits(self, batch: int, param: torch.Tensor, itemsize: int) -> bool:
        return self.keep_grad_batch or batch * param.numel() * itemsize <= self.budget_bytes

    def _reduce_factors(self, index, param, kind, x, delta, batch_sum=None) -> None:
        # materialised at most once, and only if a statistic has no factor form
        materialize = not all(stat.factor_form for stat in self.stats)
        if materialize and not self._fits(delta.shape[0], param, delta.element_size()):
            lazy = LazyRows(
                delta.shape[0], param.shape,
                lambda start, stop: materialize_linear(kind, None if x is None else x[start:stop], delta[start:stop]),
                delta.element_size(), self._sum_maker(batch_sum, lambda: linear_sum(kind, x, delta)),
            )  # fmt: skip
            self._compact_then_blocks(
                index, param, lazy, "factor_form", lambda stat, state: stat.accumulate_factors(state, index, param, kind, x, delta)
            )
            return
        grad_batch = materialize_linear(kind, x, delta) if materialize else None
        for k, stat in enumerate(self.stats):
            if stat.factor_form and (grad_batch is None or not stat.reuses_grad_batch):
                self._states[k] = stat.accumulate_factors(self._states[k], index, param, kind, x, delta)
            else:
                self._states[k] = stat.accumulate(self._states[k], index, param, grad_batch)

    def _compact_then_blocks(self, index: int, param: torch.Tensor, lazy: LazyRows, form: str, accumulate) -> None:
        """A layer over the budget given in a compact form: the statistics with that ``form`` (a class
        attribute such as ``"factor_form"``) read it (``accumulate(stat, state) -> state``), the others
        get ``lazy``'s rows (:meth:`_reduce_blocks`)."""
        compact = [k for k, stat in enumerate(self.stats) if getattr(stat, form)]
        for k in compact:
            self._states[k] = accumulate(self.stats[k], self._states[k])
        self._reduce_blocks(index, param, lazy, compact)

    def _reduce_blocks(self, index: int, param: torch.Tensor, lazy: LazyRows, compact=()) -> None:
        """Every statistic not in ``compact`` gets ``lazy``'s rows: whole if they fit the budget, else in
        blocks (row forms), kept whole as ``lazy`` (statistics that keep), or, for a statistic with neither,
        materialised whole (over budget)."""
        others = [k for k in range(len(self.stats)) if k not in compact]
        if not others:
            return
        lazy.block = max(1, self.budget_bytes // lazy.row_bytes)  # a batch sum made from rows: blocks too
        if not self.keep_grad_batch and all(self.stats[k].sum_form for k in others):
            # only statistics that read the batch sum (the self-check's probe): no rows are made for them; where
            # other statistics read the rows, these read the same rows (their sum is what the others use)
            total = lazy.batch_sum()
            for k in others:
                self._states[k] = self.stats[k].accumulate_sum(self._states[k], index, param, total)
            return
        if self.keep_grad_batch or lazy.block >= lazy.batch:
            grad_batch = lazy.make(0, lazy.batch)
            if self.keep_grad_batch:
                param.grad_batch = grad_batch
            shared = self._shared_sum(lambda: grad_batch.sum(0))
            for k in others:
                self._states[k] = self._accumulate_dense(k, self.stats[k], index, param, grad_batch, shared)
            return
        rowed, whole = [], []
        for k in others:
            stat = self.stats[k]
            if stat.keeps():
                self._states[k] = stat.accumulate_kept(self._states[k], index, param, lazy)
            if stat.row_form:
                rowed.append(k)
            elif not stat.keeps():
                whole.append(k)
        if rowed:
            memo: dict = {}  # what the blocks of this layer share
            for start, stop, rows in lazy.blocks():
                self.blocks += 1
                span = Rows(start, stop, lazy, memo)
                for k in rowed:
                    self._states[k] = self.stats[k].accumulate_rows(self._states[k], index, param, rows, span)
                del rows
        if whole:
            grad_batch = lazy.make(0, lazy.batch)
            for k in whole:
                self._states[k] = self.stats[k].accumulate(self._states[k], index, param, grad_batch)

    # ---- offered by the hook backend: reduced at once ------------------------------
    def observe_module(self, module: torch.nn.Module, x: torch.Tensor, delta: torch.Tensor) -> None:
        """A layer call's input and output gradient for the statistics with a module form."""
        x, delta = _upcast(x), self._scaled(delta)
        for k in self.module_stats:
            self._states[k] = self.stats[k].accumulate_module(self._states[k], module, x, delta)

    def _note_precision(self, index: int, *tensors, half: bool = False) -> None:
        """Tell the statistics that a layer's rows were made in half precision (``half``, or one of ``tensors`` is):
        they see them in float32."""
        if half or any(t is not None and t.dtype in _HALF for t in tensors):
            for stat, state in zip(self.stats, self._states):
                stat.note_half_precision(state, index)

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        """A row contribution in float32 or better, times :attr:`row_scale` (a new tensor only if needed)."""
        tensor = _upcast(tensor)
        return tensor if self.row_scale == 1.0 else tensor * self.row_scale

    def _sum_maker(self, known: torch.Tensor | None, make):
        """What makes a layer's batch sum of rows: ``make`` (from the scaled factors), or the sum the
        backward pass computed anyway (``known``, of the unscaled rows: scaled here, never written)."""
        if known is None:
            return make

        def owned() -> torch.Tensor:  # a tensor of the statistics' own: autograd may make ``known`` p.grad
            total = self._scaled(known)
            if total is known or not total.is_contiguous():  # (a Linear's weight gradient is a transposed view)
                total = total.clone(memory_format=torch.contiguous_format)
            return total

        return owned

    def reduce_factors(
        self, param: torch.Tensor, kind: str, x: torch.Tensor | None, delta: torch.Tensor, batch_sum: torch.Tensor | None = None
    ) -> None:
        """Reduce a parameter given as 2-D factors now (see :meth:`offer_factors`). ``batch_sum``: the
        sum of its rows, if known (autograd's gradient of this use), read if a block of rows needs it."""
        index = self._index[id(param)]
        self._note_precision(index, x, delta)
        x, delta = _upcast(x), self._scaled(delta)
        self.seen.add(index)
        if self.keep_grad_batch:
            param.grad_batch = materialize_linear(kind, x, delta)
        self._reduce_factors(index, param, kind, x, delta, batch_sum)

    def note_half_sum(self, param: torch.Tensor) -> None:
        """Tell the statistics that autograd sums ``param``'s gradient over every position in half precision
        (:meth:`PerSampleStat.note_half_sum`)."""
        index = self._index.get(id(param))
        if index is not None:
            for stat, state in zip(self.stats, self._states):
                stat.note_half_sum(state, index)

    def reduce_grad_batch(self, param: torch.Tensor, grad_batch: torch.Tensor) -> None:
        """Reduce a parameter's ``grad_batch`` ``[B, *param.shape]`` now."""
        index = self._index[id(param)]
        self._note_precision(index, grad_batch)
        grad_batch = self._scaled(grad_batch)
        self.seen.add(index)
        if self.keep_grad_batch:
            param.grad_batch = grad_batch
        self._reduce(index, param, grad_batch)

    def reduce_sequence(
        self, param: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch_sum: torch.Tensor | None = None
    ) -> None:
        """Reduce ``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` now (see :meth:`PerSampleStat.accumulate_sequence`;
        ``batch_sum`` as in :meth:`reduce_factors`)."""
        if a.shape[1] == 1 and param.dim() == 2 and not self.keep_grad_batch:
            self.reduce_factors(param, "weight", b[:, 0], a[:, 0], batch_sum)  # one position: the 2-D factor form
            return
        index = self._index[id(param)]
        self._note_precision(index, a, b)
        a, b = self._scaled(a), _upcast(b)
        self.seen.add(index)
        materialize = not all(stat.sequence_form for stat in self.stats)
        if materialize and not self._fits(a.shape[0], param, a.element_size()):
            lazy = LazyRows(
                a.shape[0], param.shape, lambda start, stop: materialize_sequence(a[start:stop], b[start:stop], param.shape),
                a.element_size(), self._sum_maker(batch_sum, lambda: sequence_sum(a, b)),
            )  # fmt: skip
            self._compact_then_blocks(
                index, param, lazy, "sequence_form", lambda stat, state: stat.accumulate_sequence(state, index, param, a, b)
            )
            return
        # materialised at most once, and only if a statistic has no sequence form (or grad_batch is kept);
        # then every statistic reads it: on grad_batch, sums and dots cost T times less than on the
        # factors (gpt economy: GramSummary's row sums on the factors cost ~35 ms more per step)
        grad_batch = None
        if self.keep_grad_batch or materialize:
            grad_batch = materialize_sequence(a, b, param.shape, self._borrowed(a.shape[0] * param.numel(), a))
            if self.keep_grad_batch:
                param.grad_batch = grad_batch
        # a batch sum that a statistic reads anyway (the gradient tests' GramSummary) is made once; statistics
        # with a sum form (the self-check's probe) then read it instead of the rows
        shared = self._shared_sum(
            (lambda: sequence_sum(a, b).reshape(param.shape)) if grad_batch is None else (lambda: grad_batch.sum(0))
        )
        for k, stat in enumerate(self.stats):
            state = self._states[k]
            if shared is not None and stat.sum_form:
                self._states[k] = stat.accumulate_sum(state, index, param, shared)
            elif stat.sequence_form and (grad_batch is None or stat.prefers_factors):
                given = {"batch_sum": shared} if shared is not None and stat.reads_batch_sum(state) else {}
                self._states[k] = stat.accumulate_sequence(state, index, param, a, b, **given)
            else:
                self._states[k] = self._accumulate_dense(k, stat, index, param, grad_batch, shared)

    def reduce_lazy(self, param: torch.Tensor, lazy: LazyRows, batch_sum: torch.Tensor | None = None) -> None:
        """Reduce per-sample gradients that ``lazy`` makes a block of rows at a time (module rules;
        ``batch_sum`` as in :meth:`reduce_factors`)."""
        index = self._index[id(param)]
        self.seen.add(index)
        self._note_precision(index, half=lazy.itemsize < 4)
        if lazy.itemsize < 4 or self.row_scale != 1.0:
            make, sum_of = lazy.make, lazy._batch_sum
            lazy = LazyRows(
                lazy.batch, lazy.shape, lambda start, stop: self._scaled(make(start, stop)), max(4, lazy.itemsize),
                None if sum_of is None else (lambda: self._scaled(sum_of())),
            )  # fmt: skip
        if batch_sum is not None:
            lazy = LazyRows(lazy.batch, lazy.shape, lazy.make, lazy.itemsize, self._sum_maker(batch_sum, None), lazy.add_into)
        self._reduce_blocks(index, param, lazy)

    def _borrowed(self, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        """``numel`` entries of the reducer's reused buffer for a ``grad_batch`` (dtype and device of
        ``like``), or ``None`` (make a new tensor): below :data:`BORROW_BYTES`, when ``grad_batch`` is
        kept, or when a statistic may keep it (:meth:`PerSampleStat.borrows`)."""
        nbytes = numel * like.element_size()
        if self.keep_grad_batch or nbytes < BORROW_BYTES:
            return None
        if not all(stat.borrows(state, nbytes) for stat, state in zip(self.stats, self._states)):
            return None
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            self._buffer = buffer = None  # the old one goes first
            self._buffer = buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]

    def results(self) -> dict[PerSampleStat, Any]:
        self._buffer = None
        return {stat: stat.finalize(state) for stat, state in zip(self.stats, self._states)}


_HALF = (torch.float16, torch.bfloat16)


def _upcast(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` in float32 if it is in half precision (statistics accumulate in float32 or better)."""
    if tensor is not None and tensor.dtype in _HALF:
        return tensor.float()
    return tensor
