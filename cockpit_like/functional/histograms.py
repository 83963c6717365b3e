"""Histogram counting of per-sample gradients (Cockpit's binning rules, exactly).

- 1-D: values are clamped to ``[lo, hi]`` (outliers land in the end bins) and
  counted with ``torch.histc`` (bin ``floor((x - lo) * bins / (hi - lo))``,
  ``x = hi`` in the last bin). Counts are floats in the data dtype. NaN is
  not counted (``histc``'s rule; ``+-inf`` are outliers, in the end bins).
- 2-D: with bin width ``w = (hi - lo) / bins`` per axis, values are clamped
  to ``[lo + w/2, hi - w/2]`` (outliers sit in the centre of the end bins) and
  binned by ``trunc((x - lo) / w)``. Counts are int64. A pair with a NaN
  (either value) is not counted, as in 1-D.

Example:
    >>> hist1d_counts(torch.tensor([-5.0, 0.1, 5.0]), 4, (-1.0, 1.0))
    tensor([1., 0., 1., 1.])
"""

from __future__ import annotations

import torch

__all__ = ["hist1d_counts", "hist2d_counts", "hist_edges"]


def hist1d_counts(values: torch.Tensor, bins: int, range: tuple[float, float]) -> torch.Tensor:
    """Counts of ``values`` (any shape) in ``bins`` equal bins over ``range``, outliers clamped."""
    lo, hi = float(range[0]), float(range[1])
    return torch.histc(values.clamp(lo, hi), bins=bins, min=lo, max=hi)


def hist2d_counts(
    x: torch.Tensor,
    y: torch.Tensor,
    bins: tuple[int, int],
    range: tuple[tuple[float, float], tuple[float, float]],
) -> torch.Tensor:
    """int64 ``[xbins, ybins]`` counts of the pairs ``(x[k], y[k])``.

    ``y`` may have fewer dimensions than ``x`` if it broadcasts against it
    (e.g. parameter values ``theta_p`` against per-sample gradients
    ``[B, *theta_p.shape]``); it is then binned once, not ``B`` times.
    """
    xbins, ybins = int(bins[0]), int(bins[1])
    (xlo, xhi), (ylo, yhi) = (float(r) for r in range[0]), (float(r) for r in range[1])
    xw, yw = (xhi - xlo) / xbins, (yhi - ylo) / ybins
    a = x.clamp(xlo + xw / 2, xhi - xw / 2).sub_(xlo).div_(xw)  # clamp copies; in place after
    b = (y.clamp(ylo + yw / 2, yhi - yw / 2) - ylo) / yw
    counted = ~(torch.isnan(a) | torch.isnan(b))  # NaN pairs are not counted
    a = a.nan_to_num(0.0).long().mul_(ybins).add_(b.nan_to_num(0.0).long())
    return torch.bincount(a[counted].reshape(-1), minlength=xbins * ybins).reshape(xbins, ybins)


def hist_edges(bins: int, range: tuple[float, float]) -> torch.Tensor:
    """``bins + 1`` bin edges, ``torch.linspace(lo, hi, bins + 1)`` in float32 (as Cockpit stores them)."""
    return torch.linspace(float(range[0]), float(range[1]), int(bins) + 1, dtype=torch.float32)
