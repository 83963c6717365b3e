"""Each row's part of a step: its gradient norm and its share of the step's gradient.

Notation (mean loss over ``B`` rows): ``g_i`` is row ``i``'s gradient,
``G = gbar = (1/B) sum_i g_i`` the step's gradient. The inputs are
:class:`~cockpit_like.backends.per_sample_stats.GramSummary`'s
``diag[i] = ||g_i||^2 / B^2`` and ``row_sums[i] = g_i^T G / B``, reduced from
the per-sample factors during the backward pass (no per-sample gradient kept).

- gradient norm: ``||g_i|| = B sqrt(diag[i])``;
- share: ``s_i = <g_i / B, G> / ||G||^2 = row_sums[i] / sum_k row_sums[k]``
  (``sum_k row_sums[k] = ||G||^2``), so the shares sum to 1; a share above
  ``1 / B`` means the row pulls the step more than an average row, a
  negative share that it pulls against the step.

Example (two rows with gradients (2, 0) and (0, 1), so G = (1, .5)):
    >>> diag, row_sums = torch.tensor([4.0, 1.0]) / 4, torch.tensor([2.0, 0.5]) / 2
    >>> row_norms(diag), row_shares(row_sums)
    (tensor([2., 1.]), tensor([0.8000, 0.2000]))
"""

from __future__ import annotations

import torch

__all__ = ["row_norms", "row_shares", "top_rows"]


def row_norms(diag: torch.Tensor) -> torch.Tensor:
    """``||g_i|| = B sqrt(diag[i])`` with ``B = len(diag)``."""
    return diag.clamp(min=0).sqrt() * diag.shape[0]


def row_shares(row_sums: torch.Tensor) -> torch.Tensor:
    """``s_i = row_sums[i] / sum_k row_sums[k] = <g_i / B, G> / ||G||^2`` (NaN where ``G = 0``)."""
    total = row_sums.sum()
    if not bool(total > 0):
        return torch.full_like(row_sums, float("nan"))
    return row_sums / total


def top_rows(values: torch.Tensor, k: int) -> list[int]:
    """The indices of the ``k`` largest finite ``values`` (NaN and -inf last), largest first."""
    k = min(int(k), values.shape[0])
    cleaned = torch.where(torch.isnan(values), torch.full_like(values, -float("inf")), values)
    return torch.topk(cleaned, k).indices.tolist()
