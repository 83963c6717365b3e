"""Histograms of per-sample gradient entries: GradHist1d and GradHist2d.

Counting happens inside the backward pass, parameter by parameter
(:class:`~cockpit_like.backends.per_sample_stats.Histogram1dCounts` /
``Histogram2dCounts``), so the per-sample gradients of the whole network are
never materialised at once. The entries counted are the per-sample gradients
``g_{i,p,j} = B * grad_batch_{i,p,j}`` (mean loss; ``B`` = ``grad_batch``'s
leading dimension). Binning rules: :mod:`cockpit_like.functional.histograms`.

Ranges can follow the data with :mod:`cockpit_like.quantities.bin_adaptation`.

Names that subclasses use, as in Cockpit: ``self._bins``, ``self._range``
(GradHist2d: a list ``[x range, y range]``) and ``self._adapt``, the bin
adaptation (GradHist1d) or the list of the two (GradHist2d); where none was
given it is a :class:`~cockpit_like.quantities.bin_adaptation.NoAdaptation`,
whose ``should_compute`` is always False.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from cockpit_like import context
from cockpit_like.backends.per_sample_stats import Histogram1dTally, Histogram2dTally, HistogramTally
from cockpit_like.quantities.bin_adaptation import NoAdaptation
from cockpit_like.functional.histograms import hist_edges
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["GradHist1d", "GradHist2d"]


def _check_range(range_: tuple, owner: str, axis: str = "") -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in range_)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: range{axis} must be a pair (lo, hi) of numbers, got {range_!r}") from None
    if not lo < hi:
        raise ValueError(f"{owner}: range{axis} needs lo < hi, got {range_!r}")
    return (lo, hi)


def _check_bins(bins, owner: str, axis: str = "") -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{owner}: bins{axis} must be a positive int, got {bins!r}")
    return bins


class _AdaptiveHistogram(SingleStepQuantity):
    """Shared logic: active at histogram steps and at the adapters' steps."""

    #: the numpy dtype of the stored counts, given the gradients' (None: theirs)
    _counts_dtype = None

    def from_log(self, value, params):
        """The stream's lists as the arrays of :meth:`_compute` (counts, float32 edges)."""
        if not isinstance(value, dict) or "hist" not in value:
            return value
        counts = self._counts_dtype
        if counts is None:
            counts = np.float64 if params and params[0].dtype == torch.float64 else np.float32
        restored = dict(value)
        for key, part in value.items():
            if isinstance(part, dict) and "hist" in part:  # GradHist2d's per-parameter histograms
                restored[key] = self.from_log(part, params)
        restored["hist"] = np.asarray(value["hist"], dtype=counts)
        edges = value.get("edges")
        if edges is not None and len(edges) and isinstance(edges[0], list):
            restored["edges"] = tuple(np.asarray(e, dtype=np.float32) for e in edges)
        elif edges is not None:
            restored["edges"] = np.asarray(edges, dtype=np.float32)
        return restored

    def _adapters(self) -> list:
        """The bin adaptations in ``self._adapt`` (without ``None``)."""
        adapt = self._adapt
        adapt = list(adapt) if isinstance(adapt, (list, tuple)) else [adapt]
        return [a for a in adapt if a is not None]

    def is_active(self, global_step: int) -> bool:
        return self.should_compute(global_step) or any(a.should_compute(global_step) for a in self._adapters())

    def per_sample_stats(self, global_step: int) -> list:
        stats = [self._counts_stat()] if self.should_compute(global_step) else []
        for adapter in self._adapters():
            if adapter.should_compute(global_step):
                stats.extend(adapter.per_sample_stats(global_step))
        return stats

    def track(self, global_step, params, batch_loss):
        super().track(global_step, params, batch_loss)  # this step's histogram first
        self._update_range(global_step, context.get_record(global_step), params)

    def _update_range(self, global_step, record, params) -> None:
        """Set the range from the adaptations scheduled at ``global_step``."""
        raise NotImplementedError

    #: what the note of a step with NaN entries says of ``{n}`` of them
    _not_counted = "{n} per-sample gradient entries are NaN and not counted"

    def _counts(self, global_step):
        """The step's counts; where some entries are NaN (not counted, as ``torch.histc`` does), a note of the
        step says how many, so that the histogram's smaller total is not read as fewer samples."""
        record = context.get_record(global_step)
        tally: HistogramTally = record.stat(self._counts_stat())
        missing = int(tally.not_counted)
        if missing:
            name = record.quantity or type(self).__name__
            record.note(f"{name} at step {global_step}: {self._not_counted.format(n=missing)} (the histogram's "
                        "total is short by as many; infinite entries are counted in the end bins, with the other "
                        "outliers)")
        return tally.counts


class GradHist1d(_AdaptiveHistogram):
    """Histogram of all per-sample gradient entries ``g_{i,p,j} = B * grad_batch_{i,p,j}``.

    Values are clamped to ``range`` (outliers land in the end bins) and counted
    with ``torch.histc``; counts are summed over parameters (total ``B * D``; NaN entries are not counted,
    and a note of the step says how many).
    Stored: ``{"hist": float ndarray[bins] (gradient dtype), "edges":
    float32 ndarray[bins + 1]}``.

    Args:
        bins: number of bins.
        range: ``(lo, hi)``.
        adapt: a :mod:`~cockpit_like.quantities.bin_adaptation` instance that
            updates ``range`` on its own schedule (after the step's histogram).
            Kept as ``self._adapt`` (a ``NoAdaptation`` when ``None``).
    """

    def __init__(self, track_schedule, verbose: bool = False, bins: int = 100, range=(-2, 2), adapt=None):
        super().__init__(track_schedule, verbose=verbose)
        self._bins = _check_bins(bins, "GradHist1d")
        self._range = _check_range(range, "GradHist1d")
        self._adapt = NoAdaptation(verbose=verbose) if adapt is None else adapt

    def _counts_stat(self):
        return Histogram1dTally(self._bins, tuple(float(v) for v in self._range))

    def settings(self):
        adapt = self._adapt
        adapt = None if adapt is None or isinstance(adapt, NoAdaptation) else adapt.settings()
        return {"bins": self._bins, "range": list(self._range), "adapt": adapt}

    def _compute(self, global_step, params, batch_loss):
        return {"hist": self._counts(global_step), "edges": hist_edges(self._bins, self._range)}

    def _update_range(self, global_step, record, params):
        if self._adapt is not None and self._adapt.should_compute(global_step):
            self._range = self._adapt.new_range(global_step, record, params)


class GradHist2d(_AdaptiveHistogram):
    """2-D histogram of pairs (per-sample gradient entry, parameter value).

    Entry ``j`` of block ``p`` contributes the ``B`` pairs
    ``(g_{i,p,j} = B * grad_batch_{i,p,j}, theta_{p,j})``. Per axis, with bin
    width ``w = (hi - lo) / bins``, values are clamped to ``[lo + w/2, hi - w/2]``
    (outliers sit in the end bins' centres) and binned by ``trunc((v - lo) / w)``;
    a pair with a NaN is not counted, and a note of the step says how many.
    Stored: ``{"hist": int64 ndarray[xbins, ybins], "edges": (x edges, y edges)}``
    (float32), and with ``keep_individual`` also ``"param_groups"`` (the number
    of parameter tensors) and ``"param_{i}"`` (each tensor's own hist/edges).

    Args:
        bins: ``(xbins, ybins)``.
        range: ``((xlo, xhi), (ylo, yhi))``; x = gradient, y = parameter.
        adapt: ``(x adapter or None, y adapter or None)``; kept as the list
            ``self._adapt`` (``NoAdaptation`` for ``None``).
        keep_individual: also store one histogram per parameter tensor.
    """

    def __init__(
        self,
        track_schedule,
        verbose: bool = False,
        bins=(40, 50),
        range=((-1, 1), (-2, 2)),
        adapt=(None, None),
        keep_individual: bool = False,
    ):
        super().__init__(track_schedule, verbose=verbose)
        if not isinstance(bins, (tuple, list)) or len(bins) != 2:
            raise ValueError(f"GradHist2d: bins must be a pair (xbins, ybins), got {bins!r}")
        self._bins = (_check_bins(bins[0], "GradHist2d", "[0]"), _check_bins(bins[1], "GradHist2d", "[1]"))
        if not isinstance(range, (tuple, list)) or len(range) != 2:
            raise ValueError(f"GradHist2d: range must be ((xlo, xhi), (ylo, yhi)), got {range!r}")
        self._range = [_check_range(range[0], "GradHist2d", "[0]"), _check_range(range[1], "GradHist2d", "[1]")]
        if adapt is None:
            adapt = (None, None)
        if not isinstance(adapt, (tuple, list)) or len(adapt) != 2:
            raise ValueError(f"GradHist2d: adapt must be a pair (x adapter, y adapter), got {adapt!r}")
        self._adapt = [NoAdaptation(verbose=verbose) if a is None else a for a in adapt]
        self._keep_individual = bool(keep_individual)

    _counts_dtype = np.int64

    _not_counted = "{n} pairs (per-sample gradient entry, parameter entry) hold a NaN and are not counted"

    def _counts_stat(self):
        return Histogram2dTally(self._bins, tuple(tuple(float(v) for v in r) for r in self._range))

    def settings(self):
        return {
            "bins": list(self._bins),
            "range": [list(r) for r in self._range],
            "adapt": [None if a is None or isinstance(a, NoAdaptation) else a.settings() for a in self._adapt],
            "keep_individual": self._keep_individual,
        }

    def _compute(self, global_step, params, batch_loss):
        per_param = self._counts(global_step)
        edges = (hist_edges(self._bins[0], self._range[0]), hist_edges(self._bins[1], self._range[1]))
        reached = [h for h in per_param if h is not None]
        result = {"hist": sum(reached[1:], reached[0].clone()), "edges": edges}
        if self._keep_individual:
            result["param_groups"] = len(params)
            for index, hist in enumerate(per_param):
                result[f"param_{index}"] = {"hist": hist, "edges": edges}
        return result

    def _update_range(self, global_step, record, params):
        new = list(self._range)
        for axis, rule in enumerate(self._adapt):
            if rule is not None and rule.should_compute(global_step):
                new[axis] = rule.new_range(global_step, record, params)
        self._range = new
