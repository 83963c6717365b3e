"""Linear operators for curvature you can compute with (KFAC, EK-FAC, block diagonals).

What lives here:

- :class:`LinearOperator`: the one interface (``op @ x`` on a vector ``[n]``
  or a batch of vectors ``[n, k]`` as columns, ``trace()``, ``det()``,
  ``logdet()``, ``slogdet()``, ``frobenius_norm()``, ``eigenvalues()``,
  ``inverse(damping, strategy)``, ``to_dense()``, ``state_dict()`` /
  ``from_state_dict()``, ``save()`` / :func:`load`);
- :class:`KroneckerProduct` (``A ⊗ B ⊗ ...``), :class:`Eigh`
  (``Q diag(λ) Qᵀ`` with ``Q`` a tensor or an orthogonal operator),
  :class:`BlockDiagonal` (named blocks), :class:`Permuted` (``P A Pᵀ``, a
  weight and bias joined in one block) and :class:`ScaledIdentity`;
- :mod:`cockpit_like.operators.kfac`: the one place that knows parameter
  order and the weight/bias grouping: :class:`LayerCurvature` records and
  :func:`kfac_operator` / :func:`ekfac_operator` (model-level operators).

Operators hold plain tensors only (never a model or a parameter), so
``torch.save(op, path)`` works, and ``op.save(path)`` stores a plain dict
that ``torch.load(path, weights_only=True)`` accepts. This package may import
``torch`` and :mod:`cockpit_like.functional` only. Docs: ``docs/operators.md``.
"""

from cockpit_like.operators.base import LinearOperator, load
from cockpit_like.operators.block_diagonal import BlockDiagonal, Permuted, ScaledIdentity
from cockpit_like.operators.eigh import Eigh
from cockpit_like.operators.kfac import LayerCurvature, ekfac_operator, kfac_operator
from cockpit_like.operators.kronecker import KroneckerProduct

__all__ = [
    "LinearOperator",
    "KroneckerProduct",
    "Eigh",
    "BlockDiagonal",
    "Permuted",
    "ScaledIdentity",
    "LayerCurvature",
    "kfac_operator",
    "ekfac_operator",
    "load",
]
