"""Eigen-decomposed symmetric operators ``Q diag(λ) Qᵀ`` (EK-FAC blocks, damped KFAC inverses).

``Q`` is an orthogonal matrix given as a tensor ``[n, n]`` or as an
orthogonal :class:`~cockpit_like.operators.LinearOperator` (e.g. a
:class:`~cockpit_like.operators.KroneckerProduct` of eigenvector matrices,
``Q_G ⊗ Q_A``), and ``λ`` a full vector ``[n]``: for EK-FAC the corrected
eigenvalues, one per entry of the ``[out, in]`` layer block, not a Kronecker
product of eigenvalues. With ``Q`` orthogonal:

- ``x -> Q (λ ⊙ (Qᵀ x))`` (with ``Q = Q_G ⊗ Q_A`` and ``x = vec(V)`` this is
  ``Q_G [(Q_Gᵀ V Q_A) ⊙ Λ] Q_Aᵀ`` on the ``[out, in]`` matrix, never dense);
- ``tr = sum λ``, ``||·||_F = ||λ||_2``, ``det = prod λ``, the eigenvalues
  are ``λ``;
- ``(Q diag(λ) Qᵀ + δ I)^{-1} = Q diag(1 / (λ + δ)) Qᵀ``: the damping is
  exact, so the ``strategy`` argument of :meth:`Eigh.inverse` makes no
  difference here.

Orthogonality of ``Q`` is the caller's promise (it is not checked, as that
would need the dense matrix); ``Q`` from :func:`torch.linalg.eigh` has it.
"""

from __future__ import annotations

import torch

from cockpit_like.operators.base import LinearOperator, check_damping, check_square

__all__ = ["Eigh"]


class Eigh(LinearOperator):
    """``Q diag(λ) Qᵀ`` for an orthogonal ``Q`` (tensor or operator) and eigenvalues ``λ [n]``.

    Args:
        eigenvalues: ``λ``, a 1-D tensor ``[n]`` (any order; need not be sorted).
        eigenvectors: ``Q``, a tensor ``[n, n]`` whose columns are the
            eigenvectors, or an orthogonal operator of shape ``(n, n)`` with
            ``Q.T`` available.

    Example:
        >>> A = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> lam, Q = torch.linalg.eigh(A)
        >>> E = Eigh(lam, Q)
        >>> torch.allclose(E.to_dense(), A), float(E.inverse(damping=1.0).trace())
        (True, 0.75)
    """

    def __init__(self, eigenvalues: torch.Tensor, eigenvectors: torch.Tensor | LinearOperator):
        if not isinstance(eigenvalues, torch.Tensor) or eigenvalues.dim() != 1:
            shape = list(eigenvalues.shape) if isinstance(eigenvalues, torch.Tensor) else type(eigenvalues).__name__
            raise ValueError(f"Eigh(eigenvalues, eigenvectors): eigenvalues must be a 1-D tensor [n], got {shape}")
        n = int(eigenvalues.shape[0])
        if isinstance(eigenvectors, LinearOperator):
            size, dtype, device = eigenvectors.shape[0], eigenvectors.dtype, eigenvectors.device
        else:
            check_square(eigenvectors, "Eigh eigenvectors")
            eigenvectors = eigenvectors.detach()
            size, dtype, device = int(eigenvectors.shape[0]), eigenvectors.dtype, eigenvectors.device
        if size != n:
            raise ValueError(f"Eigh: {n} eigenvalues but eigenvectors of shape ({size}, {size}); they must match")
        if eigenvalues.dtype != dtype or eigenvalues.device != device:
            raise ValueError(
                f"Eigh: eigenvalues are {eigenvalues.dtype} on {eigenvalues.device}, eigenvectors {dtype} on "
                f"{device}; use one dtype and device"
            )
        self.values = eigenvalues.detach()
        self.vectors = eigenvectors
        self._vectors_t = None
        self._size, self._dtype, self._device = n, dtype, device

    def _apply_q(self, x: torch.Tensor, transposed: bool) -> torch.Tensor:
        if not transposed:
            return self.vectors @ x
        if self._vectors_t is None:  # an operator's transpose is built once
            self._vectors_t = self.vectors.T
        return self._vectors_t @ x

    def _matmat(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_q(self.values.unsqueeze(1) * self._apply_q(x, transposed=True), transposed=False)

    def transpose(self) -> Eigh:
        return self

    def trace(self) -> torch.Tensor:
        return self.values.sum()

    def frobenius_norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self.values)

    def slogdet(self) -> tuple[torch.Tensor, torch.Tensor]:
        sign = torch.sign(self.values).prod()
        return sign, torch.log(self.values.abs()).sum()

    def eigenvalues(self) -> torch.Tensor:
        return self.values.sort().values

    def dense_eigenvectors(self) -> torch.Tensor:
        return self.vectors.to_dense() if isinstance(self.vectors, LinearOperator) else self.vectors

    def to_dense(self) -> torch.Tensor:
        q = self.dense_eigenvectors()
        return (q * self.values) @ q.T

    def inverse(self, damping: float = 0.0, strategy: str = "exact") -> Eigh:
        """``Q diag(1 / (λ + damping)) Qᵀ`` (exact for either strategy); a zero ``λ + damping`` raises."""
        damping = check_damping(damping, strategy, "Eigh")
        shifted = self.values + damping
        if damping > 0 and bool((self.values >= 0).all()):  # PSD plus damping: invertible
            return Eigh(1.0 / shifted, self.vectors)
        scale = max(float(self.values.abs().max()), damping) if self._size else 0.0
        tiny = shifted.abs() <= 10 * torch.finfo(self._dtype).eps * scale
        if self._size and (bool(tiny.any()) or scale == 0):
            index = int(torch.nonzero(tiny | (shifted == 0))[0])
            raise ValueError(
                f"Eigh.inverse(damping={damping}): eigenvalue {index} plus damping is "
                f"{float(shifted[index]):.3g}, so the operator is singular; pass damping > 0 "
                "(larger than minus the smallest eigenvalue)"
            )
        return Eigh(1.0 / shifted, self.vectors)

    def _state(self) -> dict:
        vectors = self.vectors.state_dict() if isinstance(self.vectors, LinearOperator) else self.vectors
        return {"eigenvalues": self.values, "eigenvectors": vectors}

    @classmethod
    def _from_state(cls, state: dict) -> Eigh:
        vectors = state["eigenvectors"]
        if isinstance(vectors, dict):
            vectors = LinearOperator.from_state_dict(vectors)
        return cls(state["eigenvalues"], vectors)
