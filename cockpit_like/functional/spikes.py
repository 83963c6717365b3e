"""Robust spike scores of a series against its own recent noise (pure numbers, no training loop).

A value ``x_t`` is compared with the trailing window ``w`` of the values
before it, in log space for positive series such as the loss and the
gradient norm (a spike is a ratio, not a difference):

``z_t = (log x_t - median(last recent of log w)) / max(1.4826 MAD(diff(log w)) / sqrt(2), floor)``

- the level is the median of the window's last ``recent`` values, so a loss
  that is still falling is compared with where it is now, not with the
  window's middle;
- the noise is the spread of the step-to-step differences (their median
  absolute deviation around the median difference, divided by ``sqrt(2)``),
  which a trend does not inflate; ``1.4826 MAD`` estimates the standard
  deviation of Gaussian noise and is not moved by a few outliers;
- ``floor`` keeps a very quiet run from calling a tiny wobble a spike.

``detrend=False`` gives the plain form: the median and ``1.4826 MAD`` of the
whole window. A score needs ``min_window`` values before it.

Example:
    >>> round(robust_score([1.0, 1.1, 0.9, 1.0, 1.05], 3.0, min_window=5), 2)
    37.05
    >>> round(robust_score([1.0, 1.1, 0.9, 1.0, 1.05], 3.0, min_window=5, detrend=False), 2)
    15.19
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["MAD_TO_STD", "robust_score", "robust_center_scale"]

#: ``1.4826 MAD`` is the standard deviation of Gaussian noise
MAD_TO_STD = 1.4826


def robust_center_scale(values: Sequence[float], floor: float = 0.0) -> tuple[float, float]:
    """``(median, max(1.4826 MAD, floor))`` of the finite ``values`` (NaN, NaN when none)."""
    array = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if array.size == 0:
        return math.nan, math.nan
    center = float(np.median(array))
    return center, max(MAD_TO_STD * float(np.median(np.abs(array - center))), floor)


def robust_score(window: Sequence[float], value: float, min_window: int = 5, log: bool = True,
                 floor: float = 0.02, detrend: bool = True, recent: int = 5) -> float:
    """The robust z-score of ``value`` against ``window`` (NaN with fewer than ``min_window`` finite values;
    ``+inf`` for a non-finite ``value``). ``log``: compare logarithms (positive series; others are skipped)."""
    if not math.isfinite(value):
        return math.inf
    if log:
        if value <= 0:
            return math.nan
        window = [math.log(v) for v in window if math.isfinite(v) and v > 0]
        value = math.log(value)
    else:
        window = [v for v in window if math.isfinite(v)]
    if len(window) < min_window:
        return math.nan
    if not detrend:
        center, scale = robust_center_scale(window, floor)
        return (value - center) / scale
    center = float(np.median(window[-recent:]))
    scale = max(robust_center_scale(np.diff(window))[1] / math.sqrt(2.0), floor)
    return (value - center) / scale
