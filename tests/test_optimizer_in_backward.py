"""An optimizer stepped inside the backward pass (``p.register_post_accumulate_grad_hook``).

Each parameter's hook steps its own optimizer and zeroes the gradient as it arrives, so no gradient is left
when the backward pass returns. The cockpit said "no tracked parameter got a gradient. Call loss.backward()
inside the cockpit's block ..." (the loop did): it now names the hooks and the way out, and the way out
(the hooks do nothing at tracked steps, the optimizers step after the block) gives the per-sample values of
brute force (float64, a loop of ``torch.autograd.grad``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import GradNorm, NormTest
from cockpit_like.utils.schedules import linear


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    return model, optimizers


def test_the_error_names_the_post_accumulate_grad_hooks():
    model, optimizers = _setup()

    def step_in_backward(p):
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(RuntimeError, match="post-accumulate-grad hooks .*0.weight.*step the optimizer after"):
        with cockpit(0, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()


def test_hooks_that_wait_at_tracked_steps_give_the_brute_force_values():
    model, optimizers = _setup()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=[NormTest(linear(2)), GradNorm(linear(2))], model=model)
    tracked = {"now": False}

    def step_in_backward(p):
        if tracked["now"]:
            return  # the optimizers step after the cockpit's block
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(step_in_backward)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(6, 5, dtype=torch.float64, generator=generator)
        y = torch.randint(0, 3, (6,), generator=generator)
        tracked["now"] = any(q.is_active(step) for q in cockpit.quantities)
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        G = torch.stack([
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], params, retain_graph=True)])
            for i in range(6)
        ])
        with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        if tracked["now"]:
            for optimizer in optimizers.values():
                optimizer.step()
                optimizer.zero_grad()
            assert cockpit.checks[step]["valid"], cockpit.checks[step]
            gbar = G.mean(0)
            expected = (((G - gbar) ** 2).sum() / (6 * 5 * (gbar @ gbar))).sqrt()
            assert cockpit.get_output()[step]["NormTest"] == pytest.approx(float(expected), rel=1e-9)
        assert all(p.grad is None or not p.grad.any() for p in params)  # the loop's own zeroing
    assert sorted(cockpit.get_output()) == [0, 2]
