"""Square roots of a loss's Hessian w.r.t. the model outputs, per row (the type-2 Fisher / GGN).

For one row ``f`` (``C`` outputs) of a loss ``ℓ(f, y)`` the generalized
Gauss-Newton matrix needs ``H = ∇²_f ℓ``; a square root ``S`` with
``S Sᵀ = H`` lets it be backpropagated column by column,
``Jᵀ H J = Σ_c (Jᵀ S[:, c]) (Jᵀ S[:, c])ᵀ``. Per row:

- ``"cross_entropy"``, ``ℓ = -log softmax(f)[y]``: ``H = diag(p) - p pᵀ``
  (``p = softmax(f)``, independent of ``y``) and
  ``S = diag(√p) - p √pᵀ`` (``S Sᵀ = H`` because ``Σ p = 1``; not symmetric);
- ``"mse"``, ``ℓ = (1/C) ||f - y||²`` (one row of ``MSELoss(reduction="mean")``,
  which averages over the ``C`` entries too): ``H = (2/C) I``, ``S = √(2/C) I``.

The same roots as curvlinops' type-2 Fisher (so its EK-FAC, which depends on
the root through cross-position terms, is matched as well).

:func:`cross_entropy_hessian_product` multiplies the Hessian of a *mean*
cross-entropy in its logits with vectors, ``(1/N) (p ⊙ u - p <p, u>)`` per
counted row (``O(N C)``, no ``C x C`` matrix), and
:func:`hessian_product_mismatch` compares it with the product autograd finds
(the loss's double backward) to a rounding tolerance of the dtype: the
cockpit's check that the loss's second derivative is the cross-entropy's
(:mod:`cockpit_like.backends.loss_curvature`).

May import torch only.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LOSSES", "loss_hessian_sqrt", "cross_entropy_hessian_product", "hessian_product_mismatch"]

#: the losses whose Hessian root is known here
LOSSES = ("cross_entropy", "mse")


def loss_hessian_sqrt(outputs: torch.Tensor, loss: str) -> torch.Tensor:
    """``[N, C, C]``: per row ``n`` of ``outputs`` ``[N, C]`` a root ``S_n`` with ``S_n S_nᵀ = ∇²_f ℓ(f_n)``.

    ``ℓ`` is one row's loss (see the module docstring); the reduction over
    rows (``1/N`` for a mean) is left to the caller. Computed without graph.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: the Hessian square root is known for {list(LOSSES)}")
    if outputs.dim() != 2:
        raise ValueError(f"loss_hessian_sqrt: need outputs of shape [N, C], got {list(outputs.shape)}")
    rows, classes = outputs.shape
    outputs = outputs.detach()
    if loss == "mse":
        eye = torch.eye(classes, dtype=outputs.dtype, device=outputs.device)
        return (eye * math.sqrt(2.0 / classes)).expand(rows, classes, classes).clone()
    p = torch.softmax(outputs, dim=1)
    root = p.sqrt()
    return torch.diag_embed(root) - p.unsqueeze(2) * root.unsqueeze(1)


def cross_entropy_hessian_product(
    logits: torch.Tensor, vectors: torch.Tensor, counted: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H u, rounding)`` for the mean cross-entropy ``L = (1/N) sum_n CE(f_n, y_n)`` of ``logits`` ``[N_all, C]``.

    ``H = ∇²_f L`` is block diagonal with the blocks ``(diag(p_n) - p_n p_nᵀ) / N``
    (``p_n = softmax(f_n)``; the labels, hard or soft, do not enter) over the
    ``N`` positions ``counted`` (``[N_all]`` bool; ``None``: all), zero at the
    others (an ignored position has no gradient). ``vectors`` ``[N_all, C]`` is
    ``u``; ``H u`` is ``(p ⊙ u - p <p, u>) / N`` per row, no ``C x C`` matrix.

    ``rounding`` (same shape, ``>= |H u|``) is ``(p ⊙ |u| + p |<p, u>|) (1 + |log p|) / N``:
    a computation of ``H u`` in a precision of unit roundoff ``eps`` is off by
    about ``eps`` times it per entry, as each entry is the difference of the
    two terms (a confident row's cancel to far below their size) and ``p``
    comes from a rounded ``log p`` (relative error ``eps |log p|``: the main
    one in half precision).

    Both in the wider of the logits' dtype and float32 (the computation's own rounding is then within what
    :func:`hessian_product_mismatch` allows for rounding), without graph.
    """
    if logits.dim() != 2 or vectors.shape != logits.shape:
        raise ValueError(
            f"cross_entropy_hessian_product: need logits [N, C] and vectors of the same shape, got "
            f"{list(logits.shape)} and {list(vectors.shape)}"
        )
    wide = torch.promote_types(logits.dtype, torch.float32)
    with torch.no_grad():
        log_p = torch.log_softmax(logits.detach().to(wide), dim=1)
        p = log_p.exp()
        u = vectors.detach().to(device=p.device, dtype=wide)
        inner = (p * u).sum(1, keepdim=True)
        product = p * u - p * inner
        # (1 + |log p| = 1 - log p; where p underflowed to 0, log p = -inf is clamped, and the entry is 0)
        rounding = p * (u.abs() + inner.abs()) * (1 - log_p.clamp(min=-torch.finfo(wide).max))
        positions = logits.shape[0]
        if counted is not None:
            keep = counted.to(device=p.device, dtype=torch.bool).unsqueeze(1)
            positions = int(keep.sum())
            product, rounding = product * keep, rounding * keep
        scale = 1.0 / max(positions, 1)
        return product.mul_(scale), rounding.mul_(scale)


def hessian_product_mismatch(
    found: torch.Tensor, expected: torch.Tensor, rounding: torch.Tensor, dtype: torch.dtype,
    factors: tuple[float, float] = (1.0, 1.0),
) -> tuple[float, float, float]:
    """``(error, tolerance, factor)``: how far a Hessian-vector product ``found`` is from ``expected``.

    ``expected`` is known up to a factor in ``factors`` (``(low, high)``; ``(1, 1)``: exactly): the
    factor in that range closest to ``found`` (least squares, clamped) is ``factor``, and ``error =
    ||found - factor * expected||``. ``tolerance = eps^(1/3) ||factor * expected|| + 4 eps ||rounding|| +
    4 sqrt(n) s`` with ``eps`` of ``dtype`` (the dtype ``found`` was computed in), ``rounding`` the rounding
    scale of each entry (:func:`cross_entropy_hessian_product`), ``n`` the entries and ``s`` the spacing of
    the dtype's subnormal numbers (entries below its normal range). ``eps^(1/3)`` (6e-6 in float64, 4.9e-3
    in float32, 0.099 in float16, 0.2 in bfloat16) is the rounding level of the curvature engine's symmetry
    checks: far above rounding (a plain cross-entropy is a few ``eps`` off) and above what soft labels
    rounded in a narrower dtype do (their sums off 1 by its ``eps`` scale each row's curvature so), far
    below what a wrong second derivative is off (all of ``||expected||`` where the double backward misses
    the curvature). The products agree where ``error <= tolerance``.
    """
    wide = torch.float64
    found = found.detach().to(device=expected.device, dtype=wide)
    expected, rounding = expected.detach().to(wide), rounding.detach().to(wide)
    low, high = factors
    energy = float((expected * expected).sum())
    factor = float((found * expected).sum()) / energy if energy > 0 else high
    factor = min(max(factor, low), high)
    expected = expected * factor
    error = float(torch.linalg.vector_norm(found - expected))
    finfo = torch.finfo(dtype)
    tolerance = (
        finfo.eps ** (1 / 3) * float(torch.linalg.vector_norm(expected))
        + 4 * finfo.eps * float(torch.linalg.vector_norm(rounding))
        + 4 * math.sqrt(expected.numel()) * finfo.smallest_normal * finfo.eps
    )
    return error, tolerance, factor
