"""Kronecker products ``F_1 ⊗ F_2 ⊗ ... ⊗ F_m`` of square factors, never formed.

Index convention: row-major, as :func:`torch.kron` and ``tensor.flatten()``:
entry ``(i_1, ..., i_m)`` of a vector reshaped to ``[n_1, ..., n_m]`` is
``x[i_1 n_2...n_m + ... + i_m]``. A weight ``W [out, in]`` flattened by
``W.flatten()`` therefore meets the KFAC block ``G ⊗ A`` (``G [out, out]``,
``A [in, in]``): ``(G ⊗ A) vec(W) = vec(G W Aᵀ)``.

Identities used (``N = prod n_i``):

- ``(⊗ F_i) x``: the factors applied one axis at a time, ``O(N sum n_i)``;
- ``tr = prod tr F_i``, ``||·||_F = prod ||F_i||_F``;
- ``det = prod det(F_i)^{N / n_i}`` (``log|det| = sum (N/n_i) log|det F_i|``);
- ``(⊗ F_i)^{-1} = ⊗ F_i^{-1}``; eigenvalues are all products of the
  factors' eigenvalues.

Damping (``inverse(damping > 0, strategy=...)``):

- ``"exact"`` (default): ``(⊗ F_i + λ I)^{-1} = (⊗ Q_i) (⊗ Λ_i + λ)^{-1}
  (⊗ Q_i)ᵀ`` from each (symmetric) factor's eigendecomposition
  ``F_i = Q_i Λ_i Q_iᵀ``; returned as an :class:`~cockpit_like.operators.Eigh`
  whose eigenvectors are a :class:`KroneckerProduct` of the ``Q_i``.
- ``"heuristic"``: the factored (π-)damping of Martens & Grosse (2015),
  ``⊗_i (F_i + π_i λ^{1/m} I)`` inverted factor by factor, with
  ``π_i = t_i / (prod_j t_j)^{1/m}`` and ``t_i = tr(F_i) / n_i`` (so
  ``prod π_i = 1``; for ``A ⊗ B``: ``(A + π√λ I) ⊗ (B + √λ/π I)`` with
  ``π = sqrt((tr A / n_A) / (tr B / n_B))``). Cheaper to apply and the usual
  KFAC choice, but not the inverse of ``F + λ I``: the damped product adds
  cross terms ``π√λ I ⊗ B + √λ/π A ⊗ I``. A factor with trace ``<= 0``
  makes every ``π_i = 1``.

The eigenvalues of a factor that is positive semi-definite up to round-off
(as KFAC factors are, also when they are rank-deficient: fewer samples than
inputs) are clamped at 0 for the exact damping, so ``F + λ I`` with
``λ > 0`` is always invertible; with indefinite factors an eigenvalue
``-λ`` (up to round-off) is an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cockpit_like.operators.base import LinearOperator, check_damping, check_square, is_symmetric

__all__ = ["KroneckerProduct"]


class KroneckerProduct(LinearOperator):
    """``F_1 ⊗ F_2 ⊗ ... ⊗ F_m`` (square factors, any number ``m >= 1``).

    The factors may be any square matrices (e.g. orthogonal eigenvector
    matrices, as the ``Q`` of an :class:`~cockpit_like.operators.Eigh`);
    ``eigenvalues()`` and a damped ``inverse`` need symmetric factors.

    Args:
        factors: list of square tensors of one dtype and device.

    Example:
        >>> K = KroneckerProduct([2 * torch.eye(2), torch.eye(3)])
        >>> float(K.trace()), float(K.logdet()), K.shape
        (12.0, 4.15888..., (6, 6))
    """

    def __init__(self, factors: Sequence[torch.Tensor]):
        if isinstance(factors, torch.Tensor) or not isinstance(factors, Sequence) or len(factors) == 0:
            raise ValueError("KroneckerProduct(factors) needs a non-empty list of square matrices")
        for index, factor in enumerate(factors):
            check_square(factor, f"KroneckerProduct factor {index}")
        first = factors[0]
        for index, factor in enumerate(factors):
            if factor.dtype != first.dtype or factor.device != first.device:
                raise ValueError(
                    f"KroneckerProduct factor {index} has dtype {factor.dtype} on {factor.device}, factor 0 "
                    f"{first.dtype} on {first.device}; all factors must share dtype and device"
                )
            if not factor.is_floating_point():
                raise ValueError(f"KroneckerProduct factor {index} must be floating point, got {factor.dtype}")
        self.factors = [factor.detach() for factor in factors]
        self.sizes = [int(f.shape[0]) for f in self.factors]
        self._size = math.prod(self.sizes)
        self._dtype = first.dtype
        self._device = first.device

    @property
    def symmetric(self) -> bool:
        return all(is_symmetric(f) for f in self.factors)

    def _matmat(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[1]
        y = x.reshape(*self.sizes, k)
        for axis, factor in enumerate(self.factors):
            y = torch.tensordot(factor, y, dims=([1], [axis])).movedim(0, axis)
        return y.reshape(self._size, k)

    def transpose(self) -> KroneckerProduct:
        return KroneckerProduct([f.T for f in self.factors])

    def trace(self) -> torch.Tensor:
        return torch.stack([f.diagonal().sum() for f in self.factors]).prod()

    def frobenius_norm(self) -> torch.Tensor:
        return torch.stack([torch.linalg.matrix_norm(f) for f in self.factors]).prod()

    def slogdet(self) -> tuple[torch.Tensor, torch.Tensor]:
        sign = torch.ones((), dtype=self._dtype, device=self._device)
        logabs = torch.zeros((), dtype=self._dtype, device=self._device)
        for factor, n in zip(self.factors, self.sizes):
            power = self._size // n
            s, la = torch.linalg.slogdet(factor)
            sign = sign * (s if power % 2 else s.abs())
            logabs = logabs + power * la
        return sign, torch.where(sign == 0, torch.full_like(logabs, -float("inf")), logabs)

    def eigenvalues(self) -> torch.Tensor:
        self._require_symmetric("eigenvalues()")
        values = None
        for factor in self.factors:
            ev = torch.linalg.eigvalsh(factor)
            values = ev if values is None else torch.outer(values, ev).reshape(-1)
        return values.sort().values

    def to_dense(self) -> torch.Tensor:
        dense = self.factors[0].contiguous()
        for factor in self.factors[1:]:
            dense = torch.kron(dense, factor.contiguous())  # torch.kron fails on some transposed views
        return dense.clone()

    def inverse(self, damping: float = 0.0, strategy: str = "exact") -> LinearOperator:
        """``(F + damping I)^{-1}``; ``strategy`` ``"exact"`` or ``"heuristic"`` (module docstring).

        Without damping (or ``"heuristic"`` with ``damping == 0``) this is the
        Kronecker product of the factors' inverses; a singular factor raises
        a ``ValueError`` naming it. ``"exact"`` with ``damping > 0`` returns an
        :class:`~cockpit_like.operators.Eigh`.
        """
        damping = check_damping(damping, strategy, "KroneckerProduct")
        if damping == 0:
            self._check_invertible()
            return KroneckerProduct([torch.linalg.inv(f) for f in self.factors])
        self._require_symmetric(f"inverse(damping={damping}, strategy={strategy!r})")
        if strategy == "heuristic":
            inverses = []
            for index, damped in enumerate(self.heuristic_damped_factors(damping)):
                inverse, info = torch.linalg.inv_ex(damped)
                if int(info) != 0:
                    raise ValueError(
                        f"KroneckerProduct.inverse(damping={damping}, strategy='heuristic'): damped factor {index} "
                        "is singular (an indefinite factor); choose another damping or strategy='exact'"
                    )
                inverses.append(inverse)
            return KroneckerProduct(inverses)
        from cockpit_like.operators.eigh import Eigh

        values, vectors = self.eigendecomposition(clamp_psd=True)
        shifted = values + damping
        if bool((values < 0).any()):  # an indefinite factor: F + damping I may be singular
            scale = max(float(values.abs().max()), damping)
            tol = sum(self.sizes) * torch.finfo(self._dtype).eps * scale
            if bool((shifted.abs() <= tol).any()):
                raise ValueError(
                    f"KroneckerProduct.inverse(damping={damping}): the operator has the eigenvalue {-damping} "
                    "(up to round-off), so F + damping I is singular; choose another damping"
                )
        return Eigh(1.0 / shifted, vectors)

    def heuristic_damped_factors(self, damping: float) -> list[torch.Tensor]:
        """The factors ``F_i + π_i damping^{1/m} I`` of the π-damping (module docstring)."""
        m = len(self.factors)
        means = [float(f.diagonal().sum()) / n for f, n in zip(self.factors, self.sizes)]
        if all(t > 0 for t in means):
            geometric = math.exp(sum(math.log(t) for t in means) / m)
            pis = [t / geometric for t in means]
        else:
            pis = [1.0] * m
        root = damping ** (1.0 / m)
        eye = [torch.eye(n, dtype=self._dtype, device=self._device) for n in self.sizes]
        return [f + pi * root * e for f, pi, e in zip(self.factors, pis, eye)]

    def eigendecomposition(self, clamp_psd: bool = False) -> tuple[torch.Tensor, KroneckerProduct]:
        """``(λ, Q)``: all eigenvalues (in Kronecker order, not sorted) and ``Q = ⊗ Q_i``.

        With ``clamp_psd``, the eigenvalues of a factor that is positive
        semi-definite up to round-off (smallest eigenvalue ``>= -n eps
        max|λ|``, as curvature factors are by construction) are clamped at 0,
        so that ``λ + damping >= damping``.
        """
        self._require_symmetric("eigendecomposition()")
        values, vectors = None, []
        for factor, n in zip(self.factors, self.sizes):
            ev, q = torch.linalg.eigh(factor)
            if clamp_psd and ev.numel():
                tol = n * torch.finfo(ev.dtype).eps * float(ev.abs().max())
                if float(ev.min()) >= -tol:
                    ev = ev.clamp(min=0)
            vectors.append(q)
            values = ev if values is None else torch.outer(values, ev).reshape(-1)
        return values, KroneckerProduct(vectors)

    def _check_invertible(self) -> None:
        for index, (factor, n) in enumerate(zip(self.factors, self.sizes)):
            singular = torch.linalg.svdvals(factor)
            largest, smallest = float(singular.max()), float(singular.min())
            if smallest <= n * torch.finfo(self._dtype).eps * largest or largest == 0:
                raise ValueError(
                    f"KroneckerProduct.inverse(damping=0): factor {index} (shape [{n}, {n}]) is singular "
                    f"(smallest singular value {smallest:.3g}, largest {largest:.3g}); pass damping > 0 "
                    "to invert F + damping I instead"
                )

    def _require_symmetric(self, what: str) -> None:
        for index, factor in enumerate(self.factors):
            if not is_symmetric(factor):
                raise ValueError(
                    f"KroneckerProduct.{what} needs symmetric factors; factor {index} is not symmetric"
                )

    def _state(self) -> dict:
        return {"factors": list(self.factors)}

    @classmethod
    def _from_state(cls, state: dict) -> KroneckerProduct:
        return cls(state["factors"])
