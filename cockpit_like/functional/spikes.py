"""Robust spike scores of a series against its own recent noise (pure numbers, no training loop).

A value ``x_t`` is compared with the trailing window ``w`` of the values
before it (in log space for positive series such as the loss and the
gradient norm: a spike is a ratio, not a difference):

``z_t = (log x_t - median(log w)) / max(1.4826 MAD(log w), floor)``

``1.4826 MAD`` estimates the standard deviation of Gaussian noise and is not
moved by a few outliers in the window; ``floor`` keeps a very quiet run from
calling a tiny wobble a spike. A score needs ``min_window`` values before it.

Example:
    >>> robust_score([1.0, 1.1, 0.9, 1.0, 1.05], 3.0, min_window=5)  # doctest: +ELLIPSIS
    15.18...
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
                 floor: float = 0.02) -> float:
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
    center, scale = robust_center_scale(window, floor)
    return (value - center) / scale
