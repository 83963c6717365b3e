"""Per-sample quadratic forms ``g_nᵀ M g_n`` with ``M = (Q_L ⊗ Q_R) diag(w) (Q_L ⊗ Q_R)ᵀ``.

``g_n`` is sample ``n``'s gradient of a weight, an ``[R, C]`` matrix
flattened row-major (``vec`` index ``r * C + c``), and ``M`` an operator in
a Kronecker eigenbasis: with ``w = 1 / (λ + damping)`` it is the damped
inverse of KFAC (``λ = λ_G ⊗ λ_A``) or EK-FAC (``λ`` the corrected
eigenvalues). Then

    g_nᵀ M g_n = sum_{r,c} w[r, c] (Q_Lᵀ g_n Q_R)[r, c]²,

one rotation of each per-sample gradient (not the rotation, scaling and
rotation back of an inverse-Hessian-vector product), and for a gradient
given as factors no ``[R, C]`` matrix per sample at all:

- factors (``g_n = u_n v_nᵀ``, ``u [N, R]``, ``v [N, C]``):
  ``sum_{r,c} (Q_Lᵀ u_n)_r² w[r, c] (Q_Rᵀ v_n)_c²``, ``O(N (R² + C² + R C))``;
- sequence factors (``g_n = sum_t u_nt v_ntᵀ``, ``u [N, T, R]``, ``v [N, T, C]``):
  ``Q_Lᵀ g_n Q_R = (u_n Q_L)ᵀ (v_n Q_R)``;
- dense (``g [N, R, C]``): ``Q_Lᵀ g_n Q_R``.

A vector (a bias) is the case ``C = 1`` with ``Q_R = [[1]]``.

Example:
    >>> g = torch.randn(4, 2, 3, dtype=torch.float64)
    >>> w = torch.rand(2, 3, dtype=torch.float64)
    >>> eye2, eye3 = torch.eye(2, dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    >>> torch.allclose(quadratic_forms_dense(g, eye2, eye3, w), (g * g * w).sum((1, 2)))
    True
"""

from __future__ import annotations

import torch

__all__ = ["quadratic_forms_factors", "quadratic_forms_sequence", "quadratic_forms_dense"]


def _check(left: torch.Tensor, right: torch.Tensor, weights: torch.Tensor, rows: int, cols: int, what: str) -> None:
    if left.shape != (rows, rows) or right.shape != (cols, cols) or weights.shape != (rows, cols):
        raise ValueError(
            f"{what}: need Q_L [{rows}, {rows}], Q_R [{cols}, {cols}] and weights [{rows}, {cols}] for gradients "
            f"of shape [{rows}, {cols}], got {list(left.shape)}, {list(right.shape)}, {list(weights.shape)}"
        )


def quadratic_forms_factors(u: torch.Tensor, v: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                            weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``[N]``: ``g_nᵀ M g_n`` for ``g_n = u_n v_nᵀ`` (``u [N, R]``, ``v [N, C]``)."""
    _check(left, right, weights, u.shape[1], v.shape[1], "quadratic_forms_factors")
    return (((u @ left).square() @ weights) * (v @ right).square()).sum(1)


def quadratic_forms_sequence(u: torch.Tensor, v: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``[N]``: ``g_nᵀ M g_n`` for ``g_n = sum_t u_nt v_ntᵀ`` (``u [N, T, R]``, ``v [N, T, C]``)."""
    _check(left, right, weights, u.shape[2], v.shape[2], "quadratic_forms_sequence")
    rotated = torch.bmm((u @ left).transpose(1, 2), v @ right)
    return (rotated.square_() * weights).sum((1, 2))


def quadratic_forms_dense(g: torch.Tensor, left: torch.Tensor, right: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[N]``: ``g_nᵀ M g_n`` for ``g [N, R, C]``."""
    _check(left, right, weights, g.shape[1], g.shape[2], "quadratic_forms_dense")
    rotated = left.T @ g @ right
    return (rotated.square_() * weights).sum((1, 2))
