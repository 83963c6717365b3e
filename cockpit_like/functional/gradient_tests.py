"""Gradient tests and gradient-noise statistics from reduced per-sample gradients.

Notation (mean loss over ``B`` samples): ``g_i`` is sample ``i``'s gradient,
``gbar = (1/B) sum_i g_i``, BackPACK's ``grad_batch[i] = g_i / B``.
Inputs are the reductions of :mod:`cockpit_like.backends.per_sample_stats`:

- ``diag``, ``row_sums``: the diagonal and the row sums of the ``B x B`` Gram
  matrix ``gram[i, k] = <grad_batch[i], grad_batch[k]> = g_i^T g_k / B^2``
  (``diag[i] = ||g_i||^2 / B^2``, ``row_sums[i] = g_i^T gbar / B``), which is all
  the gradient tests need (:func:`gram_summary` gives both from a whole matrix);
- ``sum_sq``: per entry ``s_j = sum_i grad_batch[i, j]^2 = (1/B^2) sum_i g_ij^2``;
- ``grad_sq_norm``: ``||gbar||^2`` (from ``p.grad``), ``grad``: ``gbar`` flattened.

All functions return 0-d tensors in the input dtype (EarlyStopping: a float),
evaluated in the same order as Cockpit so that float32 results agree.

Example (two samples with gradients (1, 0) and (0, 1), so gbar = (.5, .5)):
    >>> gram = torch.tensor([[1.0, 0.0], [0.0, 1.0]]) / 4
    >>> norm_test(*gram_summary(gram), torch.tensor(0.5))  # sqrt(sum_i ||g_i - gbar||^2 / (1 * 2 * .5))
    tensor(1.)
"""

from __future__ import annotations

import torch

__all__ = ["gram_summary", "cancels_to_rounding", "norm_test", "inner_test", "ortho_test", "mean_gsnr", "cabs", "early_stopping"]


def gram_summary(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(diag, row_sums)`` of a ``B x B`` Gram matrix, the inputs of the gradient tests."""
    return torch.diagonal(gram), gram.sum(1)


def cancels_to_rounding(diag: torch.Tensor, grad_sq_norm: torch.Tensor, slack: float = 1000.0) -> bool:
    """Whether ``||gbar||`` is within rounding of 0 next to the per-sample gradients: at most ``slack`` machine
    epsilons of the dtype times their root mean square norm ``sqrt(B tr(gram))``. The tests divide by
    ``||gbar||^2``; where the rows cancel (a symmetric batch) the quotient is rounding noise, not a test value.

    >>> cancels_to_rounding(torch.tensor([0.25, 0.25]), torch.tensor(0.0))
    True
    >>> cancels_to_rounding(torch.tensor([0.25, 0.25]), torch.tensor(1e-3))
    False
    """
    eps = torch.finfo(diag.dtype).eps
    mean_sq_norm = diag.shape[0] * diag.sum()
    return bool(grad_sq_norm <= (slack * eps) ** 2 * mean_sq_norm)


def norm_test(diag: torch.Tensor, row_sums: torch.Tensor, grad_sq_norm: torch.Tensor) -> torch.Tensor:
    """Norm test (Byrd et al. 2012): the largest test constant that passes,

    ``sqrt( sum_i ||g_i - gbar||^2 / ((B-1) B ||gbar||^2) )``, evaluated as
    ``(B^2 tr(gram) - B ||gbar||^2) / (B-1) / B / ||gbar||^2``.
    """
    B = diag.shape[0]
    sum_sq_norms = B**2 * diag.sum()
    variance = (sum_sq_norms - B * grad_sq_norm) / (B - 1)
    return (variance / B / grad_sq_norm).sqrt()


def inner_test(diag: torch.Tensor, row_sums: torch.Tensor, grad_sq_norm: torch.Tensor) -> torch.Tensor:
    """Inner product test (Bollapragada et al. 2017),

    ``sqrt( sum_i (pi_i - ||gbar||^2)^2 / ((B-1) B ||gbar||^4) )`` with
    ``pi_i = g_i^T gbar = B sum_k gram[i, k]``; the variance is evaluated as
    ``(sum_i pi_i^2 - B ||gbar||^4) / (B - 1)`` (Cockpit's order, so that float32 results agree), and in float64
    as ``sum_i (pi_i - ||gbar||^2)^2 / (B - 1)``: where the per-sample gradients nearly agree, the difference of
    two nearly equal sums lost 4 digits (9e-5 relative off an autograd loop, outside trial 8).
    """
    B = row_sums.shape[0]
    projections = B * row_sums
    if projections.dtype == torch.float64:
        variance = ((projections - grad_sq_norm) ** 2).sum() / (B - 1)
    else:
        variance = ((projections**2).sum() - B * grad_sq_norm**2) / (B - 1)
    return (variance / B / grad_sq_norm**2).sqrt()


def ortho_test(diag: torch.Tensor, row_sums: torch.Tensor, grad_sq_norm: torch.Tensor) -> torch.Tensor:
    """Orthogonality test (Bollapragada et al. 2017),

    ``sqrt( sum_i ||g_i - (pi_i/||gbar||^2) gbar||^2 / ((B-1) B ||gbar||^2) )``, the
    numerator evaluated as ``B^2 tr(gram) - sum_i pi_i^2 / ||gbar||^2``.
    """
    B = diag.shape[0]
    projections = B * row_sums
    sum_sq_norms = B**2 * diag.sum()
    variance = (sum_sq_norms - (projections**2).sum() / grad_sq_norm) / (B - 1)
    return (variance / B / grad_sq_norm).sqrt()


def mean_gsnr(sum_sq: torch.Tensor, grad: torch.Tensor, batch_size: int, epsilon: float = 1e-5) -> torch.Tensor:
    """Mean gradient signal-to-noise ratio (Liu et al. 2020),

    ``mean_j gbar_j^2 / (B s_j - gbar_j^2 + eps)``, where ``B s_j - gbar_j^2 =
    (1/B) sum_i g_ij^2 - gbar_j^2`` is the *biased* per-entry variance.
    """
    return (grad**2 / (batch_size * sum_sq - grad**2 + epsilon)).mean()


def cabs(sum_sq: torch.Tensor, grad: torch.Tensor, batch_size: int, lr: float, loss: torch.Tensor) -> torch.Tensor:
    """CABS suggested batch size (Balles et al. 2017),

    ``lr * sum_j sum_i (g_ij - gbar_j)^2 / (B L)``, i.e. ``lr`` times the biased
    trace of the gradient covariance over the loss ``L``, evaluated as
    ``lr * sum_j (B^2 s_j - B gbar_j^2) / (B L)``.
    """
    B = batch_size
    trace = (B**2 * sum_sq - B * grad**2).sum()
    return lr * trace / (B * loss)


def early_stopping(sum_sq: torch.Tensor, grad: torch.Tensor, batch_size: int, epsilon: float = 1e-5) -> float:
    """Evidence-based early-stopping criterion (Mahsereci et al. 2017); stop once > 0,

    ``1 - B mean_j gbar_j^2 / (v_j + eps)`` with the *unbiased* per-entry
    variance ``v_j = (B^2 s_j - B gbar_j^2) / (B - 1)``. ``1 - B x`` runs in
    Python double, as in Cockpit.
    """
    B = batch_size
    variance = (B**2 * sum_sq - B * grad**2) / (B - 1)
    ratio = (grad**2 / (variance + epsilon)).mean().item()
    return 1.0 - B * ratio
