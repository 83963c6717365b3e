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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = ["PerSampleStat", "PerSampleReducer", "materialize_linear", "materialize_sequence"]


def materialize_linear(kind: str, x: torch.Tensor | None, delta: torch.Tensor) -> torch.Tensor:
    """``grad_batch`` of a linear layer's ``"weight"`` (``delta_i x_i^T``) or ``"bias"`` (``delta_i``).

    Every entry is one product, so this is bitwise what BackPACK's ``BatchGrad`` computes.
    """
    if kind == "bias":
        return delta
    return delta.unsqueeze(2) * x.unsqueeze(1)


def materialize_sequence(a: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` (``a`` ``[B, T, R]``, ``b`` ``[B, T, C]``), reshaped to ``[B, *shape]``."""
    return torch.bmm(a.transpose(1, 2), b).reshape(a.shape[0], *shape)


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
    ):
        self.stats = stats
        self.keep_grad_batch = keep_grad_batch
        self.row_scale = float(row_scale)
        self._index = {id(p): i for i, p in enumerate(params)}
        # a statistic with ``init_for_step(params, info)`` reads the step's info (e.g. the optimizer)
        self._states = [
            stat.init_for_step(params, info or {}) if hasattr(stat, "init_for_step") else stat.init(params)
            for stat in stats
        ]
        self._pending: dict[int, tuple] = {}
        self.seen: set[int] = set()
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

    # ---- the extension hook ------------------------------------------------------
    def __call__(self, module: torch.nn.Module) -> None:
        for param in module.parameters(recurse=False):
            index = self._index.get(id(param))
            if index is None:
                continue
            pending = self._pending.pop(id(param), None)
            if pending is not None:
                kind, x, delta, grad_batch = pending
                self.seen.add(index)
                if kind is None:
                    self._reduce(index, param, self._scaled(grad_batch))
                else:
                    self._reduce_factors(index, param, kind, _upcast(x), self._scaled(delta))
                continue
            grad_batch = getattr(param, "grad_batch", None)
            if grad_batch is None:
                continue
            self.seen.add(index)
            self._reduce(index, param, self._scaled(grad_batch))
            if not self.keep_grad_batch:
                del param.grad_batch

    def _reduce(self, index: int, param: torch.Tensor, grad_batch: torch.Tensor) -> None:
        for k, stat in enumerate(self.stats):
            self._states[k] = stat.accumulate(self._states[k], index, param, grad_batch)

    def _reduce_factors(self, index, param, kind, x, delta) -> None:
        # materialised at most once, and only if a statistic has no factor form
        grad_batch = None
        if not all(stat.factor_form for stat in self.stats):
            grad_batch = materialize_linear(kind, x, delta)
        for k, stat in enumerate(self.stats):
            if stat.factor_form and (grad_batch is None or not stat.reuses_grad_batch):
                self._states[k] = stat.accumulate_factors(self._states[k], index, param, kind, x, delta)
            else:
                self._states[k] = stat.accumulate(self._states[k], index, param, grad_batch)

    # ---- offered by the hook backend: reduced at once ------------------------------
    def observe_module(self, module: torch.nn.Module, x: torch.Tensor, delta: torch.Tensor) -> None:
        """A layer call's input and output gradient for the statistics with a module form."""
        x, delta = _upcast(x), self._scaled(delta)
        for k in self.module_stats:
            self._states[k] = self.stats[k].accumulate_module(self._states[k], module, x, delta)

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        """A row contribution in float32 or better, times :attr:`row_scale` (a new tensor only if needed)."""
        tensor = _upcast(tensor)
        return tensor if self.row_scale == 1.0 else tensor * self.row_scale

    def reduce_factors(self, param: torch.Tensor, kind: str, x: torch.Tensor | None, delta: torch.Tensor) -> None:
        """Reduce a parameter given as 2-D factors now (see :meth:`offer_factors`)."""
        x, delta = _upcast(x), self._scaled(delta)
        index = self._index[id(param)]
        self.seen.add(index)
        if self.keep_grad_batch:
            param.grad_batch = materialize_linear(kind, x, delta)
        self._reduce_factors(index, param, kind, x, delta)

    def reduce_grad_batch(self, param: torch.Tensor, grad_batch: torch.Tensor) -> None:
        """Reduce a parameter's ``grad_batch`` ``[B, *param.shape]`` now."""
        grad_batch = self._scaled(grad_batch)
        index = self._index[id(param)]
        self.seen.add(index)
        if self.keep_grad_batch:
            param.grad_batch = grad_batch
        self._reduce(index, param, grad_batch)

    def reduce_sequence(self, param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Reduce ``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` now (see :meth:`PerSampleStat.accumulate_sequence`)."""
        if a.shape[1] == 1 and param.dim() == 2 and not self.keep_grad_batch:
            self.reduce_factors(param, "weight", b[:, 0], a[:, 0])  # one position: the 2-D factor form
            return
        a, b = self._scaled(a), _upcast(b)
        index = self._index[id(param)]
        self.seen.add(index)
        # materialised at most once, and only if a statistic has no sequence form (or grad_batch is kept);
        # then every statistic reads it: on grad_batch, sums and dots cost T times less than on the
        # factors (gpt economy: GramSummary's row sums on the factors cost ~35 ms more per step)
        grad_batch = None
        if self.keep_grad_batch or not all(stat.sequence_form for stat in self.stats):
            grad_batch = materialize_sequence(a, b, param.shape)
            if self.keep_grad_batch:
                param.grad_batch = grad_batch
        for k, stat in enumerate(self.stats):
            if stat.sequence_form and grad_batch is None:
                self._states[k] = stat.accumulate_sequence(self._states[k], index, param, a, b)
            else:
                self._states[k] = stat.accumulate(self._states[k], index, param, grad_batch)

    def results(self) -> dict[PerSampleStat, Any]:
        return {stat: stat.finalize(state) for stat, state in zip(self.stats, self._states)}


_HALF = (torch.float16, torch.bfloat16)


def _upcast(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` in float32 if it is in half precision (statistics accumulate in float32 or better)."""
    if tensor is not None and tensor.dtype in _HALF:
        return tensor.float()
    return tensor
