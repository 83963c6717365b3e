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

May import torch only.
"""

from __future__ import annotations

import math

import torch

__all__ = ["LOSSES", "loss_hessian_sqrt"]

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
