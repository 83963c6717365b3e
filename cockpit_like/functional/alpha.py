"""Alpha: the normalized step length from a noise-aware quadratic fit.

Along the update ``d = theta_{t+1} - theta_t`` with ``tau = ||d||``, the loss
is observed at both ends ``x = 0`` (step t) and ``x = tau`` (step t+1):
values ``f_k`` (mini-batch mean loss) and slopes ``f'_k = mean_i u_{k,i}`` with
``u_{k,i} = g_{k,i}^T d / tau``, plus the *single-sample* (unbiased, divisor
``B - 1``) variances of ``l_{k,i}`` and ``u_{k,i}``. The quadratic
``q(x) = mu0 + mu1 x + mu2 x^2`` is fitted by generalized least squares

``mu = (Phi^T L^-1 Phi)^-1 Phi^T L^-1 y``, ``y = (f0, f1, f'0, f'1)``,
``Phi = [[1, 0, 0], [1, tau, tau^2], [0, 1, 0], [0, 1, 2 tau]]``,
``L = diag(var f0, var f1, var f'0, var f'1)`` (a variance of exactly 0 becomes 1e-10),

and ``alpha = tau / x* - 1 = 2 tau / abar - 1`` with the fitted minimum
``x* = -mu1 / (2 mu2)``, ``abar = -mu1 / mu2``: 0 means the step landed on the
minimum, 1 on the mirrored point, < 0 undershoot, > 0 overshoot. A concave
fit (``mu2 < 0``) gives -1.

Example (noise-free quadratic ``f(x) = (x - 1)^2`` from 0, step of 2 = mirror point):
    >>> float(alpha_from_observations(2.0, (1.0, 1.0), (-2.0, 2.0), (1e-3, 1e-3), (1e-3, 1e-3)))
    1.0
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["sample_mean_and_variance", "fit_quadratic", "alpha_from_observations"]

ZERO_VARIANCE = 1e-10


def sample_mean_and_variance(values: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased (divisor ``B - 1``) variance of a 1-D tensor, as floats."""
    values = values.detach().reshape(-1)
    return values.mean().item(), values.var(unbiased=True).item()


def fit_quadratic(
    tau: float,
    values: tuple[float, float],
    slopes: tuple[float, float],
    value_vars: tuple[float, float],
    slope_vars: tuple[float, float],
) -> np.ndarray:
    """``mu = (mu0, mu1, mu2)`` of the generalized least-squares fit (float64).

    Raises:
        numpy.linalg.LinAlgError: the normal equations are singular.
    """
    phi = np.array([[1.0, 0.0, 0.0], [1.0, tau, tau**2], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0 * tau]])
    y = np.array([values[0], values[1], slopes[0], slopes[1]], dtype=np.float64)
    variances = np.array([value_vars[0], value_vars[1], slope_vars[0], slope_vars[1]], dtype=np.float64)
    if np.any(variances == 0):
        warnings.warn(
            f"Alpha: a variance of the fit is exactly zero {variances.tolist()} (values, slopes); "
            f"using {ZERO_VARIANCE} instead. This happens with one sample per batch or identical samples; track "
            "Alpha with batches of several different samples for a meaningful fit",
            RuntimeWarning,
            stacklevel=2,
        )
        variances = np.where(variances == 0, ZERO_VARIANCE, variances)
    weights = np.diag(1.0 / variances)
    normal = phi.T @ weights @ phi
    return np.linalg.inv(normal) @ phi.T @ weights @ y


def alpha_from_observations(
    tau: float,
    values: tuple[float, float],
    slopes: tuple[float, float],
    value_vars: tuple[float, float],
    slope_vars: tuple[float, float],
) -> float | int | None:
    """Alpha from the observations at both ends of a step of length ``tau``.

    Returns ``-1`` (int, as Cockpit) for a concave fit, ``None`` for ``tau == 0``
    (no step: undefined; Cockpit divides by zero there) or if the fit is
    singular, else ``2 tau / abar - 1`` as a numpy float64.
    """
    if tau == 0:
        return None
    try:
        mu = fit_quadratic(tau, values, slopes, value_vars, slope_vars)
    except np.linalg.LinAlgError:
        return None
    if mu[2] < 0:
        return -1
    abar = -mu[1] / mu[2]
    return 2 * tau / abar - 1
