"""The inverse products (see the package docstring).

Per layer block, with ``V [out, in]`` the block of ``v`` reshaped as the
weight (``W.flatten()`` order):

- KFAC, ``strategy="exact"``: ``(G ⊗ A + λ I)^{-1} vec(V) =
  vec(Q_G [(Q_Gᵀ V Q_A) ⊘ (λ_G λ_Aᵀ + λ)] Q_Aᵀ)``;
- KFAC, ``strategy="heuristic"``: ``vec((G + π√λ I)^{-1} V (A + √λ/π I)^{-1})``
  (π-damping, :class:`~cockpit_like.operators.KroneckerProduct`);
- EK-FAC: ``vec(Q_G [(Q_Gᵀ V Q_A) ⊘ (Λ + λ)] Q_Aᵀ)`` with ``Λ [out, in]`` the
  corrected eigenvalues (written ``Q_Sᵀ[(Q_S V̄ Q_Aᵀ) ⊘ (Λ + λ)] Q_A`` with
  eigenvectors as rows in the issue);
- a bias block ``G``: ``Q_G [(Q_Gᵀ v_b) ⊘ (λ_G + λ)]`` (EK-FAC: its own
  corrected eigenvalues).

Each is the matrix-vector product of the operator returned by
``operator.inverse(damping, strategy)``, whose Kronecker matvec applies the
factors to the ``[out, in, k]`` reshaped batch one side at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cockpit_like.operators.base import LinearOperator
from cockpit_like.operators.block_diagonal import BlockDiagonal
from cockpit_like.operators.kfac import LayerCurvature, _resolve, ekfac_operator, kfac_operator

__all__ = ["ihvp_kfac", "ihvp_ekfac", "InverseProduct"]


class InverseProduct:
    """A callable ``v -> (F + λ I)^{-1} v`` on the parameters it was built for.

    Forms of ``v`` (the result has the same form and shapes):

    - a flat tensor ``[D]`` (the parameters' ``flatten()`` concatenated in
      order) or a batch ``[k, D]`` (one vector per row);
    - a list with one tensor per parameter, each of the parameter's shape
      (one vector) or ``[k, *shape]`` (a batch of ``k``).

    Attributes:
        operator: the inverse operator ``(F + λ I)^{-1}``.
        names: the parameters' names (``"<layer>.weight"`` ...), in order.
        sizes: their numbers of entries (``D = sum(sizes)``).
    """

    def __init__(self, operator: LinearOperator, names: list[str], sizes: list[int]):
        self.operator = operator
        self.names = names
        self.sizes = sizes
        self.dimension = sum(sizes)

    def __repr__(self) -> str:
        return f"InverseProduct(D={self.dimension}, parameters={self.names})"

    def __call__(self, v):
        if isinstance(v, torch.Tensor):
            return self._flat(v)
        if isinstance(v, (list, tuple)):
            return self._listed(list(v))
        raise TypeError(
            f"ihvp: v must be a tensor [D] / [k, D] or a list of per-parameter tensors, got {type(v).__name__}"
        )

    def _flat(self, v: torch.Tensor) -> torch.Tensor:
        if v.dim() not in (1, 2) or v.shape[-1] != self.dimension:
            raise ValueError(
                f"ihvp: expected a vector of size {self.dimension} (the parameters {self.names} flattened) or a "
                f"batch [k, {self.dimension}], got shape {list(v.shape)}"
            )
        if v.dim() == 1:
            return self.operator @ v
        return (self.operator @ v.T).T

    def _listed(self, v: list) -> list:
        if len(v) != len(self.sizes):
            raise ValueError(
                f"ihvp: got {len(v)} tensors for {len(self.sizes)} parameters {self.names}; give one per parameter"
            )
        batched = None
        columns = []
        for name, size, entry in zip(self.names, self.sizes, v):
            if not isinstance(entry, torch.Tensor):
                raise TypeError(f"ihvp: the entry for {name!r} is a {type(entry).__name__}, not a tensor")
            single = entry.numel() == size
            batch = entry.dim() >= 1 and entry.shape[0] > 0 and entry.numel() == entry.shape[0] * size
            if not single and not batch:
                raise ValueError(
                    f"ihvp: the entry for {name!r} has shape {list(entry.shape)}; expected {size} entries "
                    f"(the parameter's shape) or [k, *shape]"
                )
            kind = "single" if single else "batch"
            if batched is None:
                batched = kind
                k = 1 if single else entry.shape[0]
            elif kind != batched or (kind == "batch" and entry.shape[0] != k):
                raise ValueError("ihvp: mix of single vectors and batches (or batch sizes) in the list; use one form")
            columns.append(entry.reshape(size, 1) if single else entry.reshape(k, size).T)
        result = self.operator @ torch.cat(columns, dim=0)
        out, start = [], 0
        for size, entry in zip(self.sizes, v):
            part = result[start : start + size]
            start += size
            out.append(part.reshape(entry.shape) if batched == "single" else part.T.reshape(entry.shape))
        return out


def _build(layers_or_operator, damping: float, params, strategy: str, kind: str) -> InverseProduct:
    if isinstance(layers_or_operator, LinearOperator):
        operator = layers_or_operator
        if params is not None:
            if not isinstance(operator, BlockDiagonal) or operator.names is None:
                raise ValueError("ihvp: params with an operator must be block names, which needs a named BlockDiagonal")
            if any(not isinstance(name, str) for name in params):
                raise TypeError(
                    "ihvp: an operator holds no parameters; name its blocks in params "
                    f"(one of {operator.names}) or pass the LayerCurvature records instead"
                )
            operator = BlockDiagonal([operator.block(name) for name in params], list(params))
        names = operator.names if isinstance(operator, BlockDiagonal) and operator.names else ["all"]
        sizes = operator.sizes if isinstance(operator, BlockDiagonal) else [operator.shape[0]]
        return InverseProduct(operator.inverse(damping=damping, strategy=strategy), list(names), list(sizes))
    if isinstance(layers_or_operator, LayerCurvature):
        layers_or_operator = [layers_or_operator]
    if not isinstance(layers_or_operator, Sequence):
        raise TypeError(
            "ihvp: the first argument must be LayerCurvature records or a LinearOperator, got "
            f"{type(layers_or_operator).__name__}"
        )
    resolved = _resolve(layers_or_operator, params)
    names, sizes = [], []
    for position, (param, layer, role) in enumerate(resolved):
        if layer is None:
            raise ValueError(
                f"ihvp: parameter #{position} (shape {list(param.shape)}) is not covered by any logged layer; "
                f"logged: {[layer.name for layer in layers_or_operator]}"
            )
        names.append(f"{layer.name}.{role}")
        sizes.append((layer.weight if role == "weight" else layer.bias).numel())
    build = kfac_operator if kind == "kfac" else ekfac_operator
    operator = build(layers_or_operator, params)
    return InverseProduct(operator.inverse(damping=damping, strategy=strategy), names, sizes)


def ihvp_kfac(layers_or_operator, damping: float, params=None, strategy: str = "exact") -> InverseProduct:
    """``v -> (F_KFAC + damping I)^{-1} v``, layer-wise.

    Args:
        layers_or_operator: :class:`~cockpit_like.operators.LayerCurvature`
            records, or an operator (e.g. from
            :func:`~cockpit_like.operators.kfac_operator`).
        damping: ``λ >= 0`` (``0`` needs invertible factors).
        params: with records: the parameters (tensors or names like
            ``"fc1.weight"``) to act on, a subset in any order (default: all,
            in layer order); with a named block-diagonal operator: block names.
        strategy: ``"exact"`` (default) or ``"heuristic"`` (π-damping).

    Example:
        >>> W = torch.zeros(2, 2, dtype=torch.float64)
        >>> layer = LayerCurvature("fc", W, torch.eye(2, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
        >>> ihvp_kfac([layer], damping=1.0)(torch.ones(4, dtype=torch.float64)).tolist()
        [0.5, 0.5, 0.5, 0.5]
    """
    return _build(layers_or_operator, damping, params, strategy, "kfac")


def ihvp_ekfac(layers_or_operator, damping: float, params=None, strategy: str = "exact") -> InverseProduct:
    """``v -> (F_EKFAC + damping I)^{-1} v``, layer-wise (see :func:`ihvp_kfac`).

    The records need their corrected eigenvalues
    (:meth:`~cockpit_like.operators.LayerCurvature.correct_eigenvalues`); the
    damping of an eigen-decomposed block is exact, so ``strategy`` makes no
    difference.
    """
    return _build(layers_or_operator, damping, params, strategy, "ekfac")
