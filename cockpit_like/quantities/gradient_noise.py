"""Gradient-noise quantities from per-entry second moments: MeanGSNR, CABS, EarlyStopping.

They share one statistic, ``s_j = sum_i grad_batch_ij^2 = (1/B^2) sum_i g_ij^2``
(:class:`~cockpit_like.backends.per_sample_stats.SumOfSquares`), reduced in
the backward pass. ``gbar`` is read from ``p.grad``, ``B`` from
``info["batch_size"]``. Scaling: mean loss, ``grad_batch[i] = g_i / B``.
The math lives in :mod:`cockpit_like.functional.gradient_tests`.
"""

from __future__ import annotations

import numpy as np
import torch

from cockpit_like import context
from cockpit_like.backends.per_sample_stats import SumOfSquares
from cockpit_like.functional import gradient_tests as F
from cockpit_like.quantities.byproducts import gradients_of
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["MeanGSNR", "CABS", "EarlyStopping", "plain_sgd_learning_rate", "unique_learning_rate"]


def plain_sgd_learning_rate(optimizer, owner: str) -> float:
    """The learning rate of a plain (momentum-free, decay-free) SGD optimizer.

    Plain means ``isinstance(optimizer, torch.optim.SGD)`` and, in every
    group, ``momentum`` and ``weight_decay`` are 0 (``|x| <= 1e-8``),
    ``nesterov`` is False, and ``dampening`` is 0 unless momentum is 0 (it
    has no effect then; Cockpit rejects it anyway). ``maximize`` is accepted.

    Raises:
        ValueError: not plain SGD, or the groups use different learning rates.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            f"{owner} is only defined for plain SGD (torch.optim.SGD without momentum or weight "
            f"decay), got {type(optimizer).__name__}. Leave {owner} out for this optimizer."
        )
    for index, group in enumerate(optimizer.param_groups):
        momentum = group.get("momentum", 0.0)
        bad = []
        if not np.isclose(momentum, 0, rtol=0, atol=1e-8):
            bad.append(f"momentum={momentum}")
        if not np.isclose(group.get("weight_decay", 0.0), 0, rtol=0, atol=1e-8):
            bad.append(f"weight_decay={group['weight_decay']}")
        if group.get("nesterov", False):
            bad.append("nesterov=True")
        if bad:
            raise ValueError(
                f"{owner} only supports SGD with zero momentum and no weight decay; param group "
                f"{index} has {', '.join(bad)}"
            )
    return unique_learning_rate(optimizer, owner)


def unique_learning_rate(optimizer, owner: str) -> float:
    """The learning rate shared by all param groups of ``optimizer``.

    Raises:
        ValueError: the groups use different learning rates.
    """
    rates = {group["lr"] for group in optimizer.param_groups}
    if len(rates) != 1:
        raise ValueError(
            f"{owner} needs one learning rate for all param groups, got non-unique learning rates "
            f"{sorted(rates)}"
        )
    return float(rates.pop())


class _SumOfSquaresQuantity(SingleStepQuantity):
    _info: set[str] = {"batch_size"}
    needs_two_samples = True  # a variance over the samples (divisor B - 1)

    def per_sample_stats(self, global_step: int) -> list:
        return [SumOfSquares()] if self.should_compute(global_step) else []

    def required_info(self, global_step: int) -> set[str]:
        return set(self._info) if self.should_compute(global_step) else set()

    def _flat_moments(self, global_step, params):
        record = context.get_record(global_step)
        name = type(self).__name__
        sum_sq = record.stat(SumOfSquares())
        grads = gradients_of(params, name)
        batch_size = record.require("batch_size", name)
        flat_sq = torch.cat([s.reshape(-1) for s in sum_sq])
        flat_grad = torch.cat([g.detach().reshape(-1) for g in grads])
        return record, flat_sq, flat_grad, batch_size


class _WithEpsilon(_SumOfSquaresQuantity):
    """A sum-of-squares quantity with an ``epsilon`` added to its variance denominator."""

    def __init__(self, track_schedule, verbose: bool = False, epsilon: float = 1e-5):
        super().__init__(track_schedule, verbose=verbose)
        self._epsilon = epsilon

    def settings(self):
        return {"epsilon": self._epsilon}


class MeanGSNR(_WithEpsilon):
    """Mean gradient signal-to-noise ratio (Liu et al. 2020),

    ``mean_j gbar_j^2 / (B s_j - gbar_j^2 + epsilon)`` over all D entries, with
    the biased variance ``B s_j - gbar_j^2 = (1/B) sum_i g_ij^2 - gbar_j^2``.
    Needs ``info["batch_size"]``. Stored as a float.
    """

    def _compute(self, global_step, params, batch_loss):
        _, flat_sq, flat_grad, batch_size = self._flat_moments(global_step, params)
        return F.mean_gsnr(flat_sq, flat_grad, batch_size, self._epsilon)


class CABS(_SumOfSquaresQuantity):
    """Coupled adaptive batch size (Balles et al. 2017), the suggested batch size

    ``lr * sum_j sum_i (g_ij - gbar_j)^2 / (B L)`` = ``lr * sum_j (B^2 s_j - B gbar_j^2) / (B L)``
    with ``L`` the mini-batch loss. Needs ``info["batch_size"]``, ``info["loss"]`` and
    ``info["optimizer"]``, a plain SGD with one learning rate (else ValueError).
    Stored as a float.
    """

    _info = {"batch_size", "loss", "optimizer"}

    def get_lr(self, optimizer) -> float:
        """The learning rate of ``optimizer`` (one for all param groups, else ValueError), as in Cockpit."""
        return unique_learning_rate(optimizer, type(self).__name__)

    def _compute(self, global_step, params, batch_loss):
        record, flat_sq, flat_grad, batch_size = self._flat_moments(global_step, params)
        optimizer = record.require("optimizer", "CABS")
        plain_sgd_learning_rate(optimizer, "CABS")
        lr = self.get_lr(optimizer)
        loss = record.require("loss", "CABS")
        loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        return F.cabs(flat_sq, flat_grad, batch_size, lr, loss)


class EarlyStopping(_WithEpsilon):
    """Evidence-based early-stopping criterion (Mahsereci et al. 2017); stop once > 0,

    ``1 - B mean_j gbar_j^2 / (v_j + epsilon)``, ``v_j = (B^2 s_j - B gbar_j^2) / (B - 1)``
    (unbiased per-entry variance). Needs ``info["batch_size"]`` and a plain SGD
    ``info["optimizer"]`` (else ValueError). Stored as a float.
    """

    _info = {"batch_size", "optimizer"}

    def _compute(self, global_step, params, batch_loss):
        record, flat_sq, flat_grad, batch_size = self._flat_moments(global_step, params)
        plain_sgd_learning_rate(record.require("optimizer", "EarlyStopping"), "EarlyStopping")
        return F.early_stopping(flat_sq, flat_grad, batch_size, self._epsilon)
