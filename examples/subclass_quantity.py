"""Subclassing a built-in quantity: CABS computed by a loop of ``torch.autograd.grad``.

``AutogradCABS`` keeps what CABS *is* (its schedule, its checks of the
optimizer, ``get_lr``, where its value is stored) and replaces *how* it is
computed: no BackPACK, no per-sample statistics; instead the backward pass
keeps the graph (``create_graph``) and ``_compute`` differentiates every
per-sample loss on its own. It is written against Cockpit's names only
(``extensions``, ``extension_hooks``, ``create_graph``, ``_compute``,
``get_lr``, ``ComputeStep``, the context getters), plus ``per_sample_stats``
and ``required_info``, which tell cockpit_like that this subclass needs no
per-sample statistics but needs ``info["individual_losses"]``.

Run it: ``python examples/subclass_quantity.py`` (prints both CABS values per step).
"""

from __future__ import annotations

import torch
from backpack import extend

from cockpit_like import Cockpit
from cockpit_like.context import get_individual_losses, get_optimizer
from cockpit_like.quantities import CABS
from cockpit_like.utils.optim import ComputeStep
from cockpit_like.utils.schedules import linear


class AutogradCABS(CABS):
    """CABS, ``lr * sum_j Var_i(g_ij) / L`` (biased variance), from a loop over the per-sample losses."""

    def extensions(self, global_step):
        return []  # nothing from BackPACK

    def extension_hooks(self, global_step):
        return []

    def per_sample_stats(self, global_step):
        return []  # the built-in CABS would reduce per-sample gradients in the backward pass

    def required_info(self, global_step):
        needed = super().required_info(global_step)
        return needed | {"individual_losses"} if self.should_compute(global_step) else needed

    def create_graph(self, global_step):
        return self.should_compute(global_step)  # keep the graph for the loop below

    def _compute(self, global_step, params, batch_loss):
        optimizer = get_optimizer(global_step)
        if not ComputeStep.is_sgd_default_kwargs(optimizer):
            raise ValueError("CABS is only defined for SGD without momentum or weight decay")
        losses = get_individual_losses(global_step)
        grads = []
        for loss in losses:  # g_i, the gradient of sample i's loss (not divided by B)
            sample = torch.autograd.grad(loss, params, retain_graph=True)
            grads.append(torch.cat([g.reshape(-1) for g in sample]))
        grads = torch.stack(grads)  # [B, D]
        variance = grads.var(dim=0, unbiased=False).sum()
        return (self.get_lr(optimizer) * variance / batch_loss).item()


def main(steps: int = 3) -> dict:
    """Train a small model with the built-in CABS and the subclass side by side; return the output."""
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    individual = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    cockpit = Cockpit(model.parameters(), quantities=[CABS(linear(1)), AutogradCABS(linear(1))])
    for step in range(steps):
        inputs, labels = torch.randn(16, 4), torch.randint(0, 3, (16,))
        optimizer.zero_grad()
        outputs = model(inputs)
        loss, losses = lossfunc(outputs, labels), individual(outputs, labels)
        info = {"batch_size": 16, "loss": loss, "individual_losses": losses, "optimizer": optimizer}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit.get_output()


if __name__ == "__main__":
    for step, values in main().items():
        print(step, values)
