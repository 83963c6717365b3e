"""Quantities that need nothing but the step's loss, parameters and gradients."""

from __future__ import annotations

import time

import torch

from cockpit_like import context
from cockpit_like.functional.tensor_lists import norms
from cockpit_like.quantities.quantity import ByproductQuantity

__all__ = ["Loss", "Time", "Parameters", "GradNorm", "gradients_of"]


def gradients_of(params: list[torch.Tensor], owner: str) -> list[torch.Tensor]:
    """``p.grad`` of every parameter, or a clear error for one that has none."""
    grads = []
    for index, param in enumerate(params):
        if param.grad is None:
            raise RuntimeError(
                f"{owner}: parameter #{index} (shape {list(param.shape)}) has no gradient after "
                "backward. It is not used in the loss (or backward was not called inside the "
                "cockpit context); pass only parameters that get gradients to Cockpit(params)."
            )
        grads.append(param.grad)
    return grads


class Loss(ByproductQuantity):
    """The mini-batch loss ``info["loss"]`` (mean over the batch), as a float."""

    def required_info(self, global_step: int) -> set[str]:
        return {"loss"} if self.should_compute(global_step) else set()

    def _compute(self, global_step, params, batch_loss):
        loss = context.get_loss(global_step)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.reshape(())  # a loss of shape [1] (mean(0, keepdim=True)) is a float too, as Cockpit's .item()
        return loss


class Time(ByproductQuantity):
    """Wall-clock time ``time.time()`` when the step is tracked (context exit)."""

    def _compute(self, global_step, params, batch_loss):
        return time.time()


class Parameters(ByproductQuantity):
    """The parameter values, one nested list per tensor (shaped like it)."""

    def _compute(self, global_step, params, batch_loss):
        return [param.detach().tolist() for param in params]


class GradNorm(ByproductQuantity):
    """Per-parameter gradient norm ``[||p.grad||_2 for p]``.

    ``p.grad`` is read as it is after backward: the gradient of the mean
    loss, plus anything accumulated before (as Cockpit does).
    """

    def _compute(self, global_step, params, batch_loss):
        grads = gradients_of(params, "GradNorm")
        return norms(grads).tolist()
