"""Trace, Frobenius norm and damped log-determinant of Kronecker products.

A Kronecker-factored curvature block is ``F = F_1 ⊗ F_2 ⊗ ... ⊗ F_k`` (BackPACK's
KFAC/KFLR store the factor list; a bias has a single factor). Without forming
``F`` (size ``prod(n_i)`` squared):

- ``tr(F) = prod_i tr(F_i)``,
- ``||F||_F = prod_i ||F_i||_F``,
- ``log det(F + damping I) = sum over all index tuples of
  log(prod_i lambda_{i, j_i} + damping)``, from the eigenvalues
  ``lambda_i`` of each symmetric factor (the eigenvalues of a Kronecker
  product are all products of the factors' eigenvalues).

Example:
    >>> A, G = torch.eye(2), 2 * torch.eye(3)
    >>> kron_trace([A, G]), kron_frobenius([A, G])  # doctest: +ELLIPSIS
    (12.0, 4.898979...)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["kron_trace", "kron_frobenius", "kron_eigenvalues", "kron_logdet"]


def _check(factors: Sequence[torch.Tensor]) -> None:
    if len(factors) == 0:
        raise ValueError("need at least one Kronecker factor")
    for factor in factors:
        if factor.dim() != 2 or factor.shape[0] != factor.shape[1]:
            raise ValueError(f"Kronecker factors must be square matrices, got shape {list(factor.shape)}")


def kron_trace(factors: Sequence[torch.Tensor]) -> float:
    """``tr(F_1 ⊗ ... ⊗ F_k) = prod_i tr(F_i)``."""
    _check(factors)
    return math.prod(float(f.diagonal().sum()) for f in factors)


def kron_frobenius(factors: Sequence[torch.Tensor]) -> float:
    """``||F_1 ⊗ ... ⊗ F_k||_F = prod_i ||F_i||_F``."""
    _check(factors)
    return math.prod(float(torch.linalg.matrix_norm(f)) for f in factors)


def kron_eigenvalues(factors: Sequence[torch.Tensor], clamp_psd: bool = True) -> torch.Tensor:
    """All eigenvalues of ``F_1 ⊗ ... ⊗ F_k`` for symmetric factors (flat tensor).

    With ``clamp_psd`` the factors' eigenvalues are clamped at 0 first: the
    curvature factors are positive semi-definite by construction, and
    round-off can make tiny eigenvalues slightly negative.
    """
    _check(factors)
    values = None
    for factor in factors:
        ev = torch.linalg.eigvalsh(factor)
        if clamp_psd:
            ev = ev.clamp(min=0)
        values = ev if values is None else torch.outer(values, ev).reshape(-1)
    return values


def kron_logdet(factors: Sequence[torch.Tensor], damping: float) -> float:
    """``log det(F_1 ⊗ ... ⊗ F_k + damping I)`` for PSD factors and ``damping > 0``.

    Computed as ``sum log(lambda + damping)`` over :func:`kron_eigenvalues`
    (factor eigenvalues clamped at 0), in the factors' dtype.
    """
    if not damping > 0:
        raise ValueError(f"damping must be > 0 for the log-determinant, got {damping!r}")
    return float(torch.log(kron_eigenvalues(factors) + damping).sum())
