"""The per-sample-gradient statistics that the gradient quantities share.

Every class here is a frozen dataclass (:class:`PerSampleStat`), so equal
requests from different quantities are one statistic, reduced once per step
inside BackPACK's backward pass, parameter by parameter, while
``grad_batch`` of only one layer exists:

==========================  ==============================================  =====================================
statistic                   result                                          used by
==========================  ==============================================  =====================================
:class:`GramSummary`        ``(diag(G), G.sum(1))`` of the Gram matrix      NormTest, InnerTest, OrthoTest
                            ``G[i, k] = sum_p <gb_p[i], gb_p[k]>`` (2 x B)
:class:`SquaredNorms`       ``[||gb[i]||^2 for i]`` (B)                    per-sample gradient norms (benchmarks)
:class:`SumOfSquares`       ``[s_p = sum_i gb_p[i]**2 for p]`` (O(D))       MeanGSNR, CABS, EarlyStopping
:class:`AbsMax`             ``(max_{p,i,j} |gb_p[i, j]|, B)``               bin_adaptation.GradAbsMax
:class:`Histogram1dCounts`  counts of ``B * gb`` entries (NaN not counted)   (tests, benchmarks)
:class:`Histogram2dCounts`  counts of pairs ``(B * gb, theta)`` (NaN not        (tests, benchmarks)
                            counted)
:class:`Histogram1dTally`   ``HistogramTally(counts, not_counted)``         GradHist1d
:class:`Histogram2dTally`   ``HistogramTally(counts, not_counted)``         GradHist2d
:class:`DirectionalDots`    ``[sum_p <gb_p[i], d_p> for i]`` (B)            Alpha (end step)
:class:`RetainedGradBatch`  ``grad_batch`` of every parameter, kept until   Alpha (start step, within one step
                            the step's quantities ran                       only, see docs/gradient_statistics.md)
:class:`KeepGradBatch`      nothing (``param.grad_batch`` is left on the    a quantity asking ``BatchGrad()`` alone
                            parameters)
==========================  ==============================================  =====================================

Scaling: the loss is the *mean* over ``B`` samples, so BackPACK's
``gb_p[i] = grad_batch[i] = g_{i,p} / B`` with ``g_{i,p}`` the gradient of
sample ``i``'s loss. ``B`` here is always ``grad_batch``'s leading dimension.

Factor forms (``nn.Linear`` with 2-D input, ``gb[i] = delta_i x_i^T`` for the
weight, ``delta_i`` for the bias, see :mod:`cockpit_like.backends.per_sample`):

- GramSummary: diagonal and row sums of ``(Delta Delta^T) * (X X^T)`` (weight);
- SumOfSquares: ``(delta^2)^T (x^2)`` (weight), ``sum_i delta_i^2`` (bias);
- AbsMax: ``max_i max|delta_i| * max|x_i|`` (exact: rounding is monotone);
- DirectionalDots: ``sum_{a,b} delta_ia D_ab x_ib`` per sample;
- histograms: ``delta_i x_i^T`` for a few samples at a time, counted in
  chunks (:mod:`cockpit_like.backends.fast_histograms`), bin for bin as before;
- RetainedGradBatch keeps the factors.

Sequence factors (a linear layer applied to every position of a sequence, a
convolution on its unfolded input: ``gb[i] = sum_t a_it b_it^T``, ``a``
``[B, T, R]``, ``b`` ``[B, T, C]``, from the hook backend,
:mod:`cockpit_like.backends.hooks`):

- GramSummary: ``||gb_i||^2 = sum_{t,s} (a_it . a_is)(b_it . b_is)`` from two
  ``T x T`` Gram matrices when ``T (R + C) < R C``, else from ``gb``;
  row sums ``<gb_i, S>`` with ``S = sum_k gb_k`` as ``sum_t a_it^T S b_it``;
- DirectionalDots: ``sum_t a_it^T D b_it``;
- RetainedGradBatch keeps ``(a, b)``;
- the others materialise ``gb`` once per parameter (one layer at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from cockpit_like.backends.fast_histograms import Hist1dCounter, Hist2dCounter
from cockpit_like.backends.partitions import optimizer_gradients, step_grad, step_memo, whole
from cockpit_like.backends.per_sample import (
    GRAD_BATCH_TRANSFORMS,
    PerSampleStat,
    Rows,
    publish_transform_results,
    sequence_sum,
)

__all__ = [
    "GramSummary",
    "SquaredNorms",
    "SumOfSquares",
    "AbsMax",
    "Histogram1dCounts",
    "Histogram2dCounts",
    "Histogram1dTally",
    "Histogram2dTally",
    "HistogramTally",
    "DirectionalDots",
    "RetainedGradBatch",
    "PredictedSlopes",
]


def _flat(grad_batch: torch.Tensor) -> torch.Tensor:
    return grad_batch.reshape(grad_batch.shape[0], -1)


def _into_rows(state: torch.Tensor | None, values: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Add a block's per-row ``values`` at its rows of a ``[batch]`` accumulator (created on first use)."""
    if state is None:
        state = values.new_zeros(rows.batch)
    state[rows.start : rows.stop].add_(values)
    return state


@dataclass(frozen=True)
class GramSummary(PerSampleStat):
    """The diagonal and the row sums of the ``B x B`` Gram matrix of ``grad_batch``.

    With ``G[i, k] = sum_p <grad_batch_p[i], grad_batch_p[k]> = g_i^T g_k / B^2``
    the result is ``(diag, row_sums)``, two ``[B]`` tensors:
    ``diag[i] = G[i, i] = ||g_i||^2 / B^2`` and
    ``row_sums[i] = sum_k G[i, k] = g_i^T gbar / B`` (so ``pi_i = B * row_sums[i]``).
    This is all the gradient tests read, and it costs ``O(B D)`` instead of the
    ``O(B^2 D)`` of the whole matrix: per parameter, one squared norm per
    sample and one matrix-vector product with ``sum_k grad_batch_p[k]``.
    Linear layers given as factors build their (small) Gram matrix
    ``(Delta Delta^T) * (X X^T)`` in ``O(B^2 (in + out))`` when that is cheaper
    than forming ``Delta^T X``.

    Under DDP (``synced``, :meth:`for_ranks`) the row sums need the *global*
    mean gradient, which exists only once DDP has synchronised ``p.grad``:
    each layer's per-sample gradients are kept (as factors where possible,
    like :class:`RetainedGradBatch`) until ``finalize``, which takes
    ``row_sums[i] = sum_p <grad_batch_p[i], p.grad>``; across ranks the
    diagonals and row sums are concatenated (``diag * B_r^2 = ||g_i||^2``,
    ``row_sums * B_r = g_i^T gbar``, divided by the global ``B^2`` and ``B``).
    """

    synced: bool = field(default=False, compare=False, repr=False)

    def init(self, params):
        return {"gram": None, "kept": []} if self.synced else None

    factor_form = True

    def for_ranks(self):
        return GramSummary(synced=True)

    def _keep(self, state, param, kept, diag):
        """DDP form: keep the layer for the row sums at ``finalize``, fold in only the diagonal now."""
        state["kept"].append((param, kept))
        state["gram"] = self._fold(state["gram"], diag, None)
        return state

    def finalize(self, state):
        if not self.synced:
            return state
        if state["gram"] is None:
            return None
        row_sums = sum(kept.dots(step_grad(param).detach()) for param, kept in state["kept"])
        state["kept"].clear()
        return (state["gram"][0], row_sums)

    def across_ranks(self, result, reduction):
        diag = reduction.cat(result[0] * reduction.local_batch**2)
        projections = reduction.cat(result[1] * reduction.local_batch)
        return lambda: (diag.value / reduction.batch**2, projections.value / reduction.batch)

    def reads_batch_sum(self, state) -> bool:
        return not self.synced  # the row sums read the layer's sum of rows (synced: p.grad at finalize)

    def accumulate(self, state, index, param, grad_batch, batch_sum=None):
        if self.synced:
            diag = torch.linalg.vector_norm(_flat(grad_batch.detach()), dim=1).square_()
            return self._keep(state, param, RetainedDense(grad_batch.detach()), diag)
        flat = _flat(grad_batch.detach())
        diag = torch.linalg.vector_norm(flat, dim=1).square_()
        row_sums = flat @ (flat.sum(0) if batch_sum is None else batch_sum.reshape(-1).to(flat.dtype))
        return self._fold(state, diag, row_sums)

    def borrows(self, state, nbytes) -> bool:
        return not self.synced  # (synced: keeps each layer until finalize)

    row_form = True

    def keeps(self) -> bool:
        return self.synced

    def accumulate_kept(self, state, index, param, kept):
        state["kept"].append((param, kept))  # the row sums at finalize; the diagonal comes in blocks
        return state

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        flat = _flat(grad_batch.detach())
        diag = torch.linalg.vector_norm(flat, dim=1).square_()
        if self.synced:
            gram = state["gram"]
            state["gram"] = (_into_rows(None if gram is None else gram[0], diag, rows), None)
            return state
        row_sums = flat @ rows.total().reshape(-1).to(flat.dtype)
        if state is None:
            return (_into_rows(None, diag, rows), _into_rows(None, row_sums, rows))
        return (_into_rows(state[0], diag, rows), _into_rows(state[1], row_sums, rows))

    def accumulate_factors(self, state, index, param, kind, x, delta):
        if self.synced:
            delta = delta.detach()
            diag = (delta * delta).sum(1)
            if kind != "bias":
                x = x.detach()
                diag.mul_((x * x).sum(1))
            return self._keep(state, param, RetainedFactors(kind, x if kind != "bias" else None, delta), diag)
        batch, out = delta.shape
        if kind == "bias":
            return self.accumulate(state, index, param, delta)
        inp = x.shape[1]
        if batch * (inp + out) <= 2 * inp * out:
            gram = (delta @ delta.T).mul_(x @ x.T)
            return self._fold(state, torch.diagonal(gram).clone(), gram.sum(1))
        diag = (delta * delta).sum(1).mul_((x * x).sum(1))
        row_sums = ((delta @ (delta.T @ x)) * x).sum(1)  # delta_i^T (sum_k delta_k x_k^T) x_i
        return self._fold(state, diag, row_sums)

    sequence_form = True

    def accumulate_sequence(self, state, index, param, a, b, batch_sum=None):
        a, b = a.detach(), b.detach()
        if self.synced:
            return self._keep(state, param, RetainedSequence(a, b, param.shape), self._sequence_diag(a, b))
        # sum_k gb_k as an R x C matrix
        total = sequence_sum(a, b) if batch_sum is None else batch_sum.reshape(a.shape[2], b.shape[2]).to(a.dtype)
        row_sums = ((a @ total) * b).sum((1, 2))
        return self._fold(state, self._sequence_diag(a, b), row_sums)

    @staticmethod
    def _sequence_diag(a, b):
        """``||gb_i||^2`` of ``gb_i = sum_t a_it b_it^T``."""
        positions, rows, cols = a.shape[1], a.shape[2], b.shape[2]
        if positions * (rows + cols) < rows * cols:
            return ((a @ a.transpose(1, 2)) * (b @ b.transpose(1, 2))).sum((1, 2))
        return torch.bmm(a.transpose(1, 2), b).square().sum((1, 2))

    @staticmethod
    def _fold(state, diag, row_sums):
        if state is None:
            return (diag, row_sums)
        return (state[0].add_(diag), None if row_sums is None else state[1].add_(row_sums))


@dataclass(frozen=True)
class SquaredNorms(PerSampleStat):
    """``[||grad_batch[i]||^2 for i] = [||g_i||^2 / B^2]``: the diagonal of :class:`GramSummary` alone.

    Per-sample gradient norms (e.g. for clipping) at ``O(B (in + out))`` per
    linear layer from its factors, ``O(B T^2)`` from sequence factors when
    ``T (R + C) < R C`` (two ``T x T`` Gram matrices), else from ``grad_batch``.
    """

    factor_form = True
    sequence_form = True

    def init(self, params):
        return None

    def accumulate(self, state, index, param, grad_batch):
        return self._fold(state, torch.linalg.vector_norm(_flat(grad_batch.detach()), dim=1).square_())

    def accumulate_factors(self, state, index, param, kind, x, delta):
        delta = delta.detach()
        squares = (delta * delta).sum(1)
        if kind != "bias":
            x = x.detach()
            squares.mul_((x * x).sum(1))
        return self._fold(state, squares)

    def accumulate_sequence(self, state, index, param, a, b):
        return self._fold(state, GramSummary._sequence_diag(a.detach(), b.detach()))

    def borrows(self, state, nbytes) -> bool:
        return True  # reads grad_batch during accumulate only

    row_form = True

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        return _into_rows(state, torch.linalg.vector_norm(_flat(grad_batch.detach()), dim=1).square_(), rows)

    @staticmethod
    def _fold(state, squares):
        return squares if state is None else state.add_(squares)

    def across_ranks(self, result, reduction):
        part = reduction.cat(result * reduction.local_batch**2)  # ||g_i||^2 on every rank
        return lambda: part.value / reduction.batch**2


@dataclass(frozen=True)
class SumOfSquares(PerSampleStat):
    """Per parameter ``s_p = sum_i grad_batch_p[i]**2 = (1/B^2) sum_i g_{i,p}**2`` (shaped like ``p``).

    As Cockpit's ``BatchGradTransformsHook_SumGradSquared`` (which TIC, MeanGSNR,
    CABS and EarlyStopping ask for there), ``s_p`` is also put on the parameter
    as ``p.grad_batch_transforms["sum_grad_squared"]`` once its layer is
    reduced, and deleted with the other buffers after the step. That view is
    Cockpit's, of one backward pass on one process: with several backward
    passes per step (micro-batches) or ranks, the attribute holds this
    process's first pass, and the step record the merged value.
    """

    param_fields: ClassVar[tuple[str, ...]] = (GRAD_BATCH_TRANSFORMS,)

    def init(self, params):
        return [None] * len(params)

    factor_form = True

    @staticmethod
    def _publish(state, index, param):
        publish_transform_results(param, {"sum_grad_squared": state[index]}, overwrite=False)
        return state

    def accumulate(self, state, index, param, grad_batch):
        state[index] = (grad_batch.detach() ** 2).sum(0)
        return self._publish(state, index, param)

    def accumulate_factors(self, state, index, param, kind, x, delta):
        squared = delta * delta
        state[index] = squared.sum(0) if kind == "bias" else squared.T @ (x * x)
        return self._publish(state, index, param)

    def borrows(self, state, nbytes) -> bool:
        return True  # reads grad_batch during accumulate only

    row_form = True

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        part = (grad_batch.detach() ** 2).sum(0)
        state[index] = part if rows.start == 0 else state[index].add_(part)
        return self._publish(state, index, param)  # the same tensor, added to in place by later blocks

    def across_ranks(self, result, reduction):
        # s_p * B_r^2 = sum_i g_ip^2 adds up over ranks
        parts = [reduction.sum(s * reduction.local_batch**2) for s in result]
        return lambda: [part.value / reduction.batch**2 for part in parts]


@dataclass(frozen=True)
class AbsMax(PerSampleStat):
    """``(max over all entries of |grad_batch|, B)``; ``B * max`` is the largest ``|g_{i,p,j}|``."""

    def init(self, params):
        return None

    factor_form = True

    def accumulate(self, state, index, param, grad_batch):
        return self._fold(state, grad_batch.detach().abs().max(), grad_batch.shape[0])

    def accumulate_factors(self, state, index, param, kind, x, delta):
        largest = delta.abs().amax(1)
        if kind == "weight":
            largest = largest * x.abs().amax(1)  # max |delta_i x_i^T| = max|delta_i| max|x_i|
        return self._fold(state, largest.max(), delta.shape[0])

    def borrows(self, state, nbytes) -> bool:
        return True  # reads grad_batch during accumulate only

    row_form = True

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        return self._fold(state, grad_batch.detach().abs().max(), rows.batch)

    @staticmethod
    def _fold(state, current, batch):
        if state is None:
            return (current, batch)
        return (torch.maximum(state[0], current), state[1])

    def across_ranks(self, result, reduction):
        largest = reduction.max(result[0] * result[1])  # B_r max|grad_batch| = max |g_i|
        return lambda: (largest.value / reduction.batch, reduction.batch)


@dataclass(frozen=True)
class Histogram1dCounts(PerSampleStat):
    """Counts of the per-sample gradient entries ``x = B * grad_batch`` over all parameters.

    ``x`` is clamped to ``[lo, hi]`` and counted with ``torch.histc(x, bins, lo, hi)``
    (float counts in the gradients' dtype), summed over parameters.
    """

    bins: int
    range: tuple[float, float]

    factor_form = True
    reuses_grad_batch = True

    def init(self, params):
        return None  # (counter, int64 counts, dtype) once the first parameter arrives

    def _state(self, state, like):
        if state is None:
            counter = Hist1dCounter(self.bins, self.range, like.dtype)
            state = (counter, counter.new_counts(like.device), like.dtype)
        return state

    def accumulate(self, state, index, param, grad_batch):
        state = self._state(state, grad_batch)
        state[0].count_grad_batch(state[1], grad_batch)
        return state

    def accumulate_factors(self, state, index, param, kind, x, delta):
        state = self._state(state, delta)
        if kind == "bias":
            state[0].count_grad_batch(state[1], delta)
        else:
            state[0].count_outer(state[1], x, delta)
        return state

    def borrows(self, state, nbytes) -> bool:
        return True  # reads grad_batch during accumulate only

    row_form = True

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        state = self._state(state, grad_batch)
        state[0].count_grad_batch(state[1], grad_batch, scale=rows.batch)
        return state

    def finalize(self, state):
        if state is None:
            return None
        return Hist1dCounter.finish(state[1], self.bins, state[2])

    def across_ranks(self, result, reduction):
        counts = reduction.sum(result)  # entries B_r grad_batch = g_i on every rank: counts add up
        return lambda: counts.value


@dataclass(frozen=True)
class Histogram2dCounts(PerSampleStat):
    """Counts of pairs ``(B * grad_batch_p[i, j], theta_{p, j})`` per parameter.

    Result: a list with one int64 ``[xbins, ybins]`` tensor per parameter
    (``None`` for parameters BackPACK did not reach).
    """

    bins: tuple[int, int]
    range: tuple[tuple[float, float], tuple[float, float]]

    factor_form = True
    reuses_grad_batch = True

    def init(self, params):
        return [None] * len(params)

    def accumulate(self, state, index, param, grad_batch):
        # theta_p broadcasts over the batch dimension: binned once, not B times
        counter = Hist2dCounter(self.bins, self.range)
        counts = counter.new_counts(grad_batch.device)
        counter.count_grad_batch(counts, grad_batch, whole(param.detach()))
        state[index] = counts
        return state

    def accumulate_factors(self, state, index, param, kind, x, delta):
        if kind == "bias":
            return self.accumulate(state, index, param, delta)
        counter = Hist2dCounter(self.bins, self.range)
        counts = counter.new_counts(delta.device)
        counter.count_outer(counts, x, delta, whole(param.detach()))
        state[index] = counts
        return state

    def borrows(self, state, nbytes) -> bool:
        return True  # reads grad_batch during accumulate only

    row_form = True

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        counter = Hist2dCounter(self.bins, self.range)
        if rows.start == 0:
            state[index] = counter.new_counts(grad_batch.device)
        theta = rows.once("theta", lambda: whole(param.detach()))  # one gather per layer (FSDP), not per block
        counter.count_grad_batch(state[index], grad_batch, theta, scale=rows.batch)
        return state

    def finalize(self, state):
        counter = Hist2dCounter(self.bins, self.range)
        return [None if counts is None else counter.finish(counts).clone() for counts in state]

    def across_ranks(self, result, reduction):
        parts = [None if counts is None else reduction.sum(counts) for counts in result]
        return lambda: [None if part is None else part.value for part in parts]


class HistogramTally(NamedTuple):
    """A histogram's counts and how many per-sample gradient entries (1-D) or pairs (2-D) it did not count
    (a NaN: ``histc``'s rule), an int64 scalar tensor."""

    counts: Any
    not_counted: torch.Tensor


def _sum_tally(result: HistogramTally, reduction, counts_across) -> Callable[[], HistogramTally]:
    counts, dropped = counts_across(result.counts, reduction), reduction.sum(result.not_counted)
    return lambda: HistogramTally(counts(), dropped.value)


@dataclass(frozen=True)
class Histogram1dTally(Histogram1dCounts):
    """:class:`Histogram1dCounts` with the number of entries it did not count (NaN), as a :class:`HistogramTally`
    (what GradHist1d reads: a NaN step says how many entries its counts leave out)."""

    def finalize(self, state):
        if state is None:
            return None
        return HistogramTally(super().finalize(state), state[1][self.bins + 1].clone())

    def across_ranks(self, result, reduction):
        return _sum_tally(result, reduction, super().across_ranks)


@dataclass(frozen=True)
class Histogram2dTally(Histogram2dCounts):
    """:class:`Histogram2dCounts` with the number of pairs it did not count (a NaN gradient or parameter entry), as
    a :class:`HistogramTally` (what GradHist2d reads)."""

    def finalize(self, state):
        counter = Hist2dCounter(self.bins, self.range)
        reached = [counts for counts in state if counts is not None]
        dropped = sum((counter.dropped(counts) for counts in reached[1:]), counter.dropped(reached[0])) if reached else (
            torch.zeros((), dtype=torch.int64))
        return HistogramTally(super().finalize(state), dropped)

    def across_ranks(self, result, reduction):
        return _sum_tally(result, reduction, super().across_ranks)


@dataclass(frozen=True)
class DirectionalDots(PerSampleStat):
    """``dots[i] = sum_p <grad_batch_p[i], d_p> = g_i^T d / B`` for a fixed direction ``d``.

    Equality is by ``key`` only (the direction is a tensor and is not compared);
    the requester picks a key that is unique for the direction, e.g. its own
    id and the step.
    """

    key: str
    direction: tuple = field(compare=False, hash=False, repr=False, default=())

    def init(self, params):
        return None

    factor_form = True

    def accumulate(self, state, index, param, grad_batch):
        dots = _flat(grad_batch.detach()) @ self.direction[index].reshape(-1).to(grad_batch.dtype)
        return dots if state is None else state + dots

    def accumulate_factors(self, state, index, param, kind, x, delta):
        d = self.direction[index].to(delta.dtype)
        if kind == "bias":
            dots = delta @ d
        else:
            dots = ((delta @ d.reshape(delta.shape[1], x.shape[1])) * x).sum(1)
        return dots if state is None else state.add_(dots)

    sequence_form = True

    def accumulate_sequence(self, state, index, param, a, b):
        d = self.direction[index].to(a.dtype).reshape(a.shape[2], b.shape[2])
        dots = ((a.detach() @ d) * b.detach()).sum((1, 2))
        return dots if state is None else state.add_(dots)

    def borrows(self, state, nbytes) -> bool:
        return True  # reads grad_batch during accumulate only

    row_form = True

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        dots = _flat(grad_batch.detach()) @ self.direction[index].reshape(-1).to(grad_batch.dtype)
        return _into_rows(state, dots, rows)

    def across_ranks(self, result, reduction):
        return _concatenated_dots(result, reduction)


class RetainedDense:
    """A parameter's per-sample gradients kept as ``grad_batch`` ``[B, *param.shape]``."""

    __slots__ = ("grad_batch",)

    def __init__(self, grad_batch: torch.Tensor):
        self.grad_batch = grad_batch

    def batch_sum(self) -> torch.Tensor:
        """``sum_i grad_batch[i]``."""
        return self.grad_batch.sum(0)

    def dots(self, direction: torch.Tensor) -> torch.Tensor:
        """``[<grad_batch[i], direction> for i]``."""
        return _flat(self.grad_batch) @ direction.reshape(-1).to(self.grad_batch.dtype)


class RetainedFactors:
    """A linear layer's per-sample gradients kept as factors (``B x (in + out)`` numbers).

    ``kind == "weight"``: ``grad_batch[i] = delta[i] x[i]^T``; ``"bias"``: ``grad_batch[i] = delta[i]``.
    """

    __slots__ = ("kind", "x", "delta")

    def __init__(self, kind: str, x: torch.Tensor | None, delta: torch.Tensor):
        self.kind, self.x, self.delta = kind, x, delta

    def batch_sum(self) -> torch.Tensor:
        return self.delta.sum(0) if self.kind == "bias" else self.delta.T @ self.x

    def dots(self, direction: torch.Tensor) -> torch.Tensor:
        d = direction.to(self.delta.dtype)
        if self.kind == "bias":
            return self.delta @ d
        return ((self.delta @ d.reshape(self.delta.shape[1], self.x.shape[1])) * self.x).sum(1)


class RetainedSequence:
    """Per-sample gradients kept as sequence factors: ``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` (reshaped)."""

    __slots__ = ("a", "b", "shape")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, shape: torch.Size):
        self.a, self.b, self.shape = a, b, shape

    def batch_sum(self) -> torch.Tensor:
        return sequence_sum(self.a, self.b).reshape(self.shape)

    def dots(self, direction: torch.Tensor) -> torch.Tensor:
        d = direction.to(self.a.dtype).reshape(self.a.shape[2], self.b.shape[2])
        return ((self.a @ d) * self.b).sum((1, 2))


@dataclass(frozen=True)
class KeepGradBatch(PerSampleStat):
    """No reduction: the statistic of a step where a quantity (or the user) asked for BackPACK's ``BatchGrad``
    and for nothing per sample besides, so that the reducer runs and leaves ``param.grad_batch`` on the
    parameters on every backend (``keep_grad_batch``): on a model that is not extended, the hooks make it.
    Freed with BackPACK's buffers after the step's quantities ran."""

    def init(self, params):
        return None

    def accumulate(self, state, index, param, grad_batch):
        return state

    def across_ranks(self, result, reduction):
        return lambda: None


@dataclass(frozen=True)
class RetainedGradBatch(PerSampleStat):
    """Keeps every parameter's per-sample gradients until the step's quantities ran.

    Needed only where a per-sample reduction depends on something known after
    the backward pass (Alpha's look-ahead direction at its start step). Linear
    layers are kept as their factors (:class:`RetainedFactors`, no ``[B, out, in]``
    tensor), other layers as ``grad_batch`` (:class:`RetainedDense`); both offer
    ``batch_sum()`` and ``dots(direction)``. The reader must ``clear()`` the
    returned list when done, so that nothing per-sample survives the step.
    """

    factor_form = True
    #: when another statistic (a histogram) materialises ``grad_batch`` anyway, keep that tensor:
    #: dots and sums on it cost ``T`` times less than on sequence factors (gpt economy step
    #: 385 -> 345 ms in one process). Alpha with an element-wise optimizer keeps nothing per
    #: sample at all (:class:`PredictedSlopes`).
    reuses_grad_batch = True

    def init(self, params):
        return [None] * len(params)

    def accumulate(self, state, index, param, grad_batch):
        state[index] = RetainedDense(grad_batch.detach())
        return state

    def accumulate_factors(self, state, index, param, kind, x, delta):
        state[index] = RetainedFactors(kind, None if x is None else x.detach(), delta.detach())
        return state

    sequence_form = True

    def accumulate_sequence(self, state, index, param, a, b):
        state[index] = RetainedSequence(a.detach(), b.detach(), param.shape)
        return state

    def keeps(self) -> bool:
        return True

    def accumulate_kept(self, state, index, param, kept):
        state[index] = kept  # a layer over the memory budget: its rows are made again, a block at a time
        return state

    def across_ranks(self, result, reduction):
        raise NotImplementedError(
            f"RetainedGradBatch keeps per-sample gradients, which stay with their part of a step split into "
            f"{reduction.parts}; reduce them in a statistic with an across_ranks method instead"
        )


@dataclass(frozen=True)
class PredictedSlopes(PerSampleStat):
    """Alpha's start step: per-sample dot products with the optimizer's coming update, a few layers at a time.

    With an element-wise optimizer in ``info["optimizer"]``
    (:func:`cockpit_like.utils.optim.is_elementwise`: the update of a
    parameter reads only that parameter, its gradient and its state), the
    per-sample gradients of the layers that arrive are held (as
    :class:`RetainedDense` / :class:`RetainedFactors` / :class:`RetainedSequence`,
    usually a tensor that a histogram materialised anyway) only until they
    exceed :attr:`budget_bytes`; then one look-ahead predicts the updates
    ``d_p`` of those parameters from their summed per-sample gradients
    ``g_p = sum_i grad_batch_p[i]`` (the mini-batch gradient of a mean loss;
    :func:`~cockpit_like.utils.optim.lookahead_parameters`), their
    ``dots[i] += <grad_batch_p[i], d_p>`` are reduced and they are dropped.
    Memory: ``O(B + D)`` plus the budget, instead of every per-sample gradient
    until the backward pass ends; a few optimizer steps per backward pass.
    A layer over the reducer's memory budget (made a block of rows at a
    time) is predicted on its own from its batch sum and its dots are folded
    in with the blocks the other statistics read (:meth:`accumulate_rows`),
    so its rows are made once.

    Result: ``{"mode": "predicted", "dots": [B], "direction": [d_p], "grad_sum": [g_p]}``;
    with another optimizer (or none) ``{"mode": "retained", "retained": [...]}``
    with :class:`RetainedGradBatch`'s per-parameter entries (the reader must
    ``clear()`` that list). Equality is by ``key`` (one per requester and step).
    """

    key: str
    budget_bytes: int = field(default=8 << 20, compare=False)
    #: under DDP (:meth:`for_ranks`): keep every layer until ``finalize`` and predict the update
    #: from the synchronised ``p.grad`` with one full look-ahead (any optimizer)
    synced: bool = field(default=False, compare=False, repr=False)

    factor_form = True
    sequence_form = True
    reuses_grad_batch = True

    def for_ranks(self):
        return PredictedSlopes(self.key, self.budget_bytes, synced=True)

    def across_ranks(self, result, reduction):
        if result["mode"] != "predicted":
            raise NotImplementedError(
                f"Alpha on a step split into {reduction.parts} needs an element-wise optimizer (one of "
                "cockpit_like.utils.optim.ELEMENTWISE: SGD, Adam, AdamW, ..., given as info['optimizer']), whose "
                "update it predicts per row; without one it keeps per-sample gradients, which stay with their part. "
                "Track Alpha on steps of one backward pass, or pass an element-wise optimizer."
            )
        dots = _concatenated_dots(result["dots"], reduction)
        return lambda: {**result, "dots": dots()}

    def init(self, params):
        return self.init_for_step(params, {})

    def init_for_step(self, params, info):
        from cockpit_like.utils.optim import is_elementwise

        optimizer = info.get("optimizer")
        if self.synced:
            return {"mode": "synced", "optimizer": optimizer, "params": list(params), "pending": [], "bytes": 0}
        if optimizer is not None and is_elementwise(optimizer):
            return {"mode": "predicted", "optimizer": optimizer, "dots": None, "pending": [], "bytes": 0,
                    "direction": [None] * len(params), "grad_sum": [None] * len(params)}  # fmt: skip
        return {"mode": "retained", "retained": RetainedGradBatch().init(params)}

    def _hold(self, state, index, param, kept, size):
        state["pending"].append((index, param, kept))
        state["bytes"] += size
        if state["bytes"] > self.budget_bytes and state["mode"] == "predicted":
            self._flush(state)
        return state

    @staticmethod
    def _finish_synced(state):
        """The slopes along the update predicted from the synchronised gradients (DDP)."""
        from cockpit_like.utils.optim import LookaheadNotValid, lookahead_update

        params = state["params"]
        grads = [step_grad(p).detach() for p in params]
        optimizer = state["optimizer"]
        not_valid = None
        if optimizer is None:
            direction = [-g for g in grads]
        else:  # the same update for every partition of the step: one look-ahead, on the gradients it steps with
            try:
                direction = step_memo(
                    ("lookahead", id(optimizer), tuple(id(p) for p in params)),
                    lambda: [whole(d) for d in lookahead_update(optimizer, params, optimizer_gradients(params))],
                )
            except LookaheadNotValid as error:  # no prediction; zero dots keep the ranks' collectives in step
                direction, not_valid = [torch.zeros_like(g) for g in grads], str(error)
        dots = sum(kept.dots(direction[index]) for index, _, kept in state["pending"])
        state["pending"].clear()
        result = {"mode": "predicted", "dots": dots, "direction": direction, "grad_sum": grads}
        return result if not_valid is None else {**result, "not_valid": not_valid}

    @staticmethod
    def _flush(state):
        from cockpit_like.utils.optim import lookahead_parameters

        pending, state["pending"], state["bytes"] = state["pending"], [], 0
        if not pending:
            return
        sums = {param: kept.batch_sum().reshape(param.shape) for _, param, kept in pending}
        versions = {param: total._version for param, total in sums.items()}
        # the sums are fresh tensors of ours: lent to the look-ahead rather than copied (GPT-2 small: 0.5 GB
        # per tracked step); one the optimizer wrote into (foreach SGD with Nesterov momentum) is made again
        updates = lookahead_parameters(state["optimizer"], sums, lend=True)
        for index, param, kept in pending:
            direction, total = updates[param], sums[param]
            if total._version != versions[param]:
                total = kept.batch_sum().reshape(param.shape)
            state["direction"][index], state["grad_sum"][index] = direction, total
            dots = kept.dots(direction)
            state["dots"] = dots if state["dots"] is None else state["dots"].add_(dots)

    def accumulate(self, state, index, param, grad_batch):
        if state["mode"] == "retained":
            RetainedGradBatch().accumulate(state["retained"], index, param, grad_batch)
            return state
        grad_batch = grad_batch.detach()
        return self._hold(state, index, param, RetainedDense(grad_batch), grad_batch.numel() * grad_batch.element_size())

    def accumulate_factors(self, state, index, param, kind, x, delta):
        if state["mode"] == "retained":
            RetainedGradBatch().accumulate_factors(state["retained"], index, param, kind, x, delta)
            return state
        kept = RetainedFactors(kind, None if x is None else x.detach(), delta.detach())
        size = delta.numel() * delta.element_size() + (0 if x is None else x.numel() * x.element_size())
        return self._hold(state, index, param, kept, size)

    def accumulate_sequence(self, state, index, param, a, b):
        if state["mode"] == "retained":
            RetainedGradBatch().accumulate_sequence(state["retained"], index, param, a, b)
            return state
        kept = RetainedSequence(a.detach(), b.detach(), param.shape)
        return self._hold(state, index, param, kept, (a.numel() + b.numel()) * a.element_size())

    def keeps(self) -> bool:
        return True

    def accumulate_kept(self, state, index, param, kept):
        if state["mode"] == "retained":
            state["retained"][index] = kept
            return state
        if state["mode"] == "predicted":
            return state  # the dots come with the layer's blocks (accumulate_rows), not from a second pass
        return self._hold(state, index, param, kept, 0)  # synced: made again in blocks at finalize

    def borrows(self, state, nbytes) -> bool:
        # a layer held past the call (under the budget, or kept whole in the other modes) must be its own
        return state["mode"] == "predicted" and state["bytes"] + nbytes > self.budget_bytes

    row_form = True

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        """A layer over the memory budget, in the blocks every statistic shares (predicted mode only):
        its update is predicted from the batch sum (``rows.total()``, made once per layer and shared
        with the Gram row sums) before its first block, and each block adds its rows' dots."""
        if state["mode"] != "predicted":
            return state  # kept whole (accumulate_kept)
        from cockpit_like.utils.optim import lookahead_parameters

        if rows.start == 0:
            total = rows.total().reshape(param.shape)
            state["direction"][index] = lookahead_parameters(state["optimizer"], {param: total})[param]
            state["grad_sum"][index] = total
        direction = state["direction"][index]
        flat = grad_batch.detach().reshape(grad_batch.shape[0], -1)
        if state["dots"] is None:
            state["dots"] = flat.new_zeros(rows.batch)
        state["dots"][rows.start : rows.stop] += flat @ direction.reshape(-1).to(flat.dtype)
        return state

    def finalize(self, state):
        if state["mode"] == "synced":
            return self._finish_synced(state)
        if state["mode"] == "retained":
            return {"mode": "retained", "retained": state["retained"]}
        self._flush(state)
        return {"mode": "predicted", "dots": state["dots"], "direction": state["direction"], "grad_sum": state["grad_sum"]}



def _concatenated_dots(dots: torch.Tensor, reduction):
    """Per-sample ``dots[i] = <grad_batch_i, d>`` of every rank, concatenated, scaled to the global batch."""
    part = reduction.cat(dots * reduction.local_batch)  # = g_i^T d
    return lambda: part.value / reduction.batch
