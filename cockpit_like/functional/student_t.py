"""Student-t quantiles for error bars estimated from a few draws (pure math, no scipy).

A standard error estimated from the spread of ``K`` i.i.d. draws is itself
random: ``(mean - truth) / error`` is Student-t with ``K - 1`` degrees of
freedom (for Gaussian draws), not normal, so ``mean +- 2 errors`` holds the
truth far less often than 95.45% for small ``K`` (about 86% for ``K = 4``).
:func:`student_t_factor` is the factor by which such an error is widened so
that ``+- 2`` widened errors is the Student-t interval of the normal 2-sigma
level (``Phi(2) = 0.97725``).

Example:
    >>> round(student_t_factor(4), 3)  # t_3(0.97725) / 2
    1.653
"""

from __future__ import annotations

import math
from functools import lru_cache

__all__ = ["student_t_factor", "student_t_quantile"]

#: the normal distribution's probability below 2 standard deviations
TWO_SIGMA = 0.5 * (1 + math.erf(2 / math.sqrt(2)))


def _cdf(x: float, dof: int) -> float:
    """``P(T <= x)``, ``x >= 0``, for Student-t with ``dof`` degrees of freedom (the regularized incomplete
    beta function of ``dof / (dof + x^2)`` by its continued fraction, Numerical Recipes' ``betacf``)."""
    z = dof / (dof + x * x)
    a, b = dof / 2, 0.5
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(z) + b * math.log1p(-z)) / a
    # continued fraction of I_z(a, b) (converges fast for z < (a + 1) / (a + b + 2); else use the symmetry)
    if z > (a + 1) / (a + b + 2):
        return 1 - 0.5 * (1 - _beta_tail(1 - z, b, a))
    return 1 - 0.5 * front * _continued_fraction(z, a, b)


def _beta_tail(z: float, a: float, b: float) -> float:
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(z) + b * math.log1p(-z)) / a
    return front * _continued_fraction(z, a, b)


def _continued_fraction(z: float, a: float, b: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * z / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * z / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * z / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


@lru_cache(maxsize=64)
def student_t_quantile(probability: float, dof: int) -> float:
    """``x`` with ``P(T <= x) = probability`` (``probability > 0.5``) for Student-t with ``dof`` degrees of freedom."""
    if not 0.5 < probability < 1 or dof < 1:
        raise ValueError(f"student_t_quantile needs 0.5 < probability < 1 and dof >= 1, got {probability}, {dof}")
    low, high = 0.0, 1.0
    while _cdf(high, dof) < probability:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if _cdf(middle, dof) < probability else (low, middle)
        if high - low < 1e-12 * high:
            break
    return (low + high) / 2


def student_t_factor(draws: int) -> float:
    """``t_{draws-1}(Phi(2)) / 2``: widen a standard error from ``draws`` draws' spread by this factor and
    ``+- 2`` errors is the Student-t 95.45% interval (1.653 for 4 draws, 1.091 for 16; NaN below 2 draws)."""
    if draws < 2:
        return math.nan
    return student_t_quantile(TWO_SIGMA, draws - 1) / 2
