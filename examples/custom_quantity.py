"""Writing your own quantities against the documented base classes.

Two examples, written only against the public plugin contract (they would run
unchanged on Cockpit after swapping the import):

- ``LargestSampleGradNorm``: a single-step quantity that asks BackPACK for
  per-sample gradients and reads the batch size through the context getters.
- ``LossChange``: a two-step quantity that caches the loss at a start step and
  reports the change one step later, stored under the start step.

Run it: ``python examples/custom_quantity.py``.
"""

from __future__ import annotations

import torch
from backpack import extend
from backpack.extensions import BatchGrad

from cockpit_like import Cockpit
from cockpit_like.context import get_batch_size, get_loss
from cockpit_like.quantities.quantity import SingleStepQuantity, TwoStepQuantity
from cockpit_like.utils.schedules import linear


class LargestSampleGradNorm(SingleStepQuantity):
    """``max_i ||g_i||_2``, the largest per-sample gradient norm.

    The loss is a mean over ``B`` samples, so BackPACK's ``grad_batch[i]`` is
    ``g_i / B`` and ``g_i = B * grad_batch[i]``.
    """

    def extensions(self, global_step):
        return [BatchGrad()] if self.should_compute(global_step) else []

    def required_info(self, global_step):
        return {"batch_size"} if self.should_compute(global_step) else set()

    def _compute(self, global_step, params, batch_loss):
        batch_size = get_batch_size(global_step)
        squared = sum((p.grad_batch * batch_size).flatten(start_dim=1).pow(2).sum(1) for p in params)
        return squared.sqrt().max()


class LossChange(TwoStepQuantity):
    """``L_{t+1} - L_t`` (each on its own mini-batch), stored under ``t``."""

    SAVE_SHIFT = 1

    def required_info(self, global_step):
        return {"loss"} if self.is_active(global_step) else set()

    def _compute_start(self, global_step, params, batch_loss):
        # Keep the start loss until the end step has been tracked.
        self.save_to_cache(
            global_step, "loss", get_loss(global_step).item(), block_fn=lambda step, t=global_step: step <= t
        )

    def _compute_end(self, global_step, params, batch_loss):
        start = global_step - self.SAVE_SHIFT
        return get_loss(global_step).item() - self.load_from_cache(start, "loss")


def main(steps: int = 5) -> dict:
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = Cockpit(model.parameters(), quantities=[LargestSampleGradNorm(linear(1)), LossChange(linear(2))])
    for step in range(steps):
        inputs, labels = torch.randn(16, 4), torch.randint(0, 3, (16,))
        optimizer.zero_grad()
        loss = lossfunc(model(inputs), labels)
        with cockpit(step, info={"batch_size": 16, "loss": loss}):
            loss.backward()
        optimizer.step()
    return cockpit.get_output()


if __name__ == "__main__":
    for step, values in main().items():
        print(step, values)
