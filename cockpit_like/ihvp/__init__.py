"""Inverse-Hessian-vector products with KFAC and EK-FAC: ``v -> (F + λ I)^{-1} v``.

What lives here: :func:`ihvp_kfac` and :func:`ihvp_ekfac`, which build the
damped inverse of a model-level operator once (eigendecompositions of the
Kronecker factors) and return an :class:`InverseProduct`, a callable applied
layer by layer on ``[out, in]`` matrices (never a dense ``D x D`` matrix),
to one vector or a batch, flat or as a list of per-parameter tensors. May
import ``torch``, :mod:`cockpit_like.operators` and
:mod:`cockpit_like.functional`. Docs: ``docs/operators.md``.
"""

from cockpit_like.ihvp.products import InverseProduct, ihvp_ekfac, ihvp_kfac

__all__ = ["ihvp_kfac", "ihvp_ekfac", "InverseProduct"]
