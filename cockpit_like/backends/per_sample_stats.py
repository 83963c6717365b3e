"""The per-sample-gradient statistics that the gradient quantities share.

Every class here is a frozen dataclass (:class:`PerSampleStat`), so equal
requests from different quantities are one statistic, reduced once per step
inside BackPACK's backward pass, parameter by parameter, while
``grad_batch`` of only one layer exists:

==========================  ==============================================  =====================================
statistic                   result                                          used by
==========================  ==============================================  =====================================
:class:`BatchGram`          ``G[i, k] = sum_p <gb_p[i], gb_p[k]>``  (B x B)  NormTest, InnerTest, OrthoTest
:class:`SumOfSquares`       ``[s_p = sum_i gb_p[i]**2 for p]`` (O(D))       MeanGSNR, CABS, EarlyStopping
:class:`AbsMax`             ``(max_{p,i,j} |gb_p[i, j]|, B)``               bin_adaptation.GradAbsMax
:class:`Histogram1dCounts`  counts of ``B * gb`` entries                    GradHist1d
:class:`Histogram2dCounts`  counts of pairs ``(B * gb, theta)``             GradHist2d
:class:`DirectionalDots`    ``[sum_p <gb_p[i], d_p> for i]`` (B)            Alpha (end step)
:class:`RetainedGradBatch`  ``grad_batch`` of every parameter, kept until   Alpha (start step, within one step
                            the step's quantities ran                       only, see docs/gradient_statistics.md)
==========================  ==============================================  =====================================

Scaling: the loss is the *mean* over ``B`` samples, so BackPACK's
``gb_p[i] = grad_batch[i] = g_{i,p} / B`` with ``g_{i,p}`` the gradient of
sample ``i``'s loss. ``B`` here is always ``grad_batch``'s leading dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cockpit_like.backends.per_sample import PerSampleStat
from cockpit_like.functional.histograms import hist1d_counts, hist2d_counts

__all__ = [
    "BatchGram",
    "SumOfSquares",
    "AbsMax",
    "Histogram1dCounts",
    "Histogram2dCounts",
    "DirectionalDots",
    "RetainedGradBatch",
]


def _flat(grad_batch: torch.Tensor) -> torch.Tensor:
    return grad_batch.reshape(grad_batch.shape[0], -1)


@dataclass(frozen=True)
class BatchGram(PerSampleStat):
    """The ``B x B`` Gram matrix ``G[i, k] = sum_p <grad_batch_p[i], grad_batch_p[k]>``.

    ``G = (1/B^2) [g_i^T g_k]``; its trace is ``(1/B^2) sum_i ||g_i||^2`` and
    ``B * G.sum(1)`` are the projections ``pi_i = g_i^T gbar``.
    """

    def init(self, params):
        return None

    def accumulate(self, state, index, param, grad_batch):
        flat = _flat(grad_batch)
        gram = flat @ flat.T
        return gram if state is None else state + gram


@dataclass(frozen=True)
class SumOfSquares(PerSampleStat):
    """Per parameter ``s_p = sum_i grad_batch_p[i]**2 = (1/B^2) sum_i g_{i,p}**2`` (shaped like ``p``)."""

    def init(self, params):
        return [None] * len(params)

    def accumulate(self, state, index, param, grad_batch):
        state[index] = (grad_batch**2).sum(0)
        return state


@dataclass(frozen=True)
class AbsMax(PerSampleStat):
    """``(max over all entries of |grad_batch|, B)``; ``B * max`` is the largest ``|g_{i,p,j}|``."""

    def init(self, params):
        return None

    def accumulate(self, state, index, param, grad_batch):
        current = grad_batch.detach().abs().max()
        if state is None:
            return (current, grad_batch.shape[0])
        return (torch.maximum(state[0], current), state[1])


@dataclass(frozen=True)
class Histogram1dCounts(PerSampleStat):
    """Counts of the per-sample gradient entries ``x = B * grad_batch`` over all parameters.

    ``x`` is clamped to ``[lo, hi]`` and counted with ``torch.histc(x, bins, lo, hi)``
    (float counts in the gradients' dtype), summed over parameters.
    """

    bins: int
    range: tuple[float, float]

    def init(self, params):
        return None

    def accumulate(self, state, index, param, grad_batch):
        counts = hist1d_counts(grad_batch.shape[0] * grad_batch.detach(), self.bins, self.range)
        return counts if state is None else state + counts


@dataclass(frozen=True)
class Histogram2dCounts(PerSampleStat):
    """Counts of pairs ``(B * grad_batch_p[i, j], theta_{p, j})`` per parameter.

    Result: a list with one int64 ``[xbins, ybins]`` tensor per parameter
    (``None`` for parameters BackPACK did not reach).
    """

    bins: tuple[int, int]
    range: tuple[tuple[float, float], tuple[float, float]]

    def init(self, params):
        return [None] * len(params)

    def accumulate(self, state, index, param, grad_batch):
        # theta_p broadcasts over the batch dimension: binned once, not B times
        state[index] = hist2d_counts(grad_batch.shape[0] * grad_batch.detach(), param.detach(), self.bins, self.range)
        return state


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

    def accumulate(self, state, index, param, grad_batch):
        dots = _flat(grad_batch) @ self.direction[index].reshape(-1).to(grad_batch.dtype)
        return dots if state is None else state + dots


@dataclass(frozen=True)
class RetainedGradBatch(PerSampleStat):
    """Keeps ``grad_batch`` of every parameter until the step's quantities ran.

    Needed only where a per-sample reduction depends on something known after
    the backward pass (Alpha's look-ahead direction at its start step). The
    reader must ``clear()`` the returned list when done, so that nothing
    per-sample survives the step.
    """

    def init(self, params):
        return [None] * len(params)

    def accumulate(self, state, index, param, grad_batch):
        state[index] = grad_batch.detach()
        return state
