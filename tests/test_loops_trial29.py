"""Outside trial 29 (31 loops x 10 cockpit set-ups, bitwise against the loop without a cockpit): what it found, fixed.

- A hook on an activation (``o.register_hook(fn)`` from a forward hook: Grad-CAM) ran in the cockpit's own backward
  passes: 4 calls became 20-141 over 4 steps, and one adding gradient noise from torch's generator moved the
  parameters by 0.04-0.08. Tensor hooks the user registers now sit those passes out (``guard_tensor_hooks``), and
  torch's generators are put back after the cockpit's work whatever ran in it (``user_state_kept``).
- A loop that calls the model's parts (``model[2](model[1](model[0](x)))``): the rows check's two backward passes
  at the step's beginning ran the user's full backward hook (1 call became 3 per step).
- A GradScaler's power-of-two scale, which the docs say needs no declaring, got a note asking to declare it at
  every step; LBFGS's required closure showed as a raw ``TypeError`` in Alpha's warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cockpit_like import Cockpit
from cockpit_like import quantities as Q
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

SETUPS = {
    "economy": lambda: configuration("economy"),
    "business": lambda: configuration("business"),
    "full": lambda: configuration("full"),
    "HessMaxEV": lambda: [Q.HessMaxEV(linear(1))],
    "HessTrace": lambda: [Q.HessTrace(linear(1))],
    "TICDiag": lambda: [Q.TICDiag(linear(1))],
}


def _train(setup, hook: str, noise: bool, split: bool = False, steps: int = 4):
    """``(hook calls, parameters after the steps, the next torch.rand)`` of a small seeded loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    calls = [0]

    def on_gradient(grad):
        calls[0] += 1
        return grad + 1e-3 * torch.randn_like(grad) if noise else None

    if hook == "activation":  # Grad-CAM: keep (and here noise) the activation's gradient
        model[1].register_forward_hook(lambda module, inputs, output: output.register_hook(on_gradient) and None)
    else:  # a full backward hook on the head, noising its input gradient

        def on_backward(module, grad_input, grad_output):
            result = on_gradient(grad_input[0])
            return None if result is None else (result,)

        model[2].register_full_backward_hook(on_backward)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = None if setup is None else Cockpit(model.parameters(), quantities=SETUPS[setup](), model=model)
    for step in range(steps):
        x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
        optimizer.zero_grad()
        out = model[2](model[1](model[0](x))) if split else model(x)
        losses = F.cross_entropy(out, y, reduction="none")
        loss = losses.mean()
        if cockpit is None:
            loss.backward()
        else:
            info = {"batch_size": 8, "individual_losses": losses, "loss": loss, "optimizer": optimizer, "outputs": out}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return calls[0], torch.cat([p.detach().reshape(-1) for p in model.parameters()]), torch.rand(1)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_an_activation_hook_runs_once_per_backward_and_its_noise_leaves_the_run_alone(setup):
    for noise in (False, True):
        calls, params, after = _train(None, "activation", noise)
        tracked_calls, tracked_params, tracked_after = _train(setup, "activation", noise)
        assert tracked_calls == calls == 4  # before: 20 (HessTrace, TICDiag), 36 (business), 109-141 (full, HessMaxEV)
        assert torch.equal(tracked_params, params) and torch.equal(tracked_after, after)


@pytest.mark.parametrize("setup", ["economy", "full"])
def test_a_loop_that_calls_the_models_parts_runs_its_backward_hook_once(setup):
    """Before: 3 calls per step (the rows check's two passes), and with noise the parameters 0.0945 apart."""
    for noise in (False, True):
        calls, params, after = _train(None, "module", noise, split=True)
        tracked_calls, tracked_params, tracked_after = _train(setup, "module", noise, split=True)
        assert tracked_calls == calls == 4
        assert torch.equal(tracked_params, params) and torch.equal(tracked_after, after)


def test_a_guarded_tensor_hook_is_still_removed_by_its_handle_and_runs_outside_the_cockpit():
    Cockpit([nn.Parameter(torch.zeros(1))], quantities=[])  # (the guard is installed by the first cockpit)
    x = torch.ones(3, requires_grad=True)
    seen = []
    y = x * 2
    handle = y.register_hook(lambda grad: seen.append(grad.clone()))
    y.sum().backward(retain_graph=True)
    handle.remove()
    y.sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.ones(3))
    doubled = x * 1
    doubled.register_hook(lambda grad: grad * 2)  # a hook that changes the gradient still does, outside the cockpit
    x.grad = None
    doubled.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def _scaled_step(factor: float) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    cockpit = Cockpit(model.parameters(), quantities=[Q.GradNorm(linear(1))], model=model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    out = model(x)
    losses = F.cross_entropy(out, y, reduction="none")
    with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
        (losses.mean() * factor).backward()
    return cockpit.checks[0].get("notes", [])


def test_a_power_of_two_factor_is_named_as_a_grad_scalers_with_nothing_to_declare():
    (note,) = [n for n in _scaled_step(256.0) if "x those of the step's mean loss" in n]
    assert "power of two, as a GradScaler's scale is (nothing needs declaring" in note
    (note,) = [n for n in _scaled_step(3.0) if "x those of the step's mean loss" in n]
    assert "declare the factor" in note and "power of two" not in note


def test_lbfgs_says_it_needs_a_closure_rather_than_a_type_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))

            def closure():
                optimizer.zero_grad()
                losses = F.cross_entropy(model(x), y, reduction="none")
                info = {"batch_size": 10, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
                with cockpit(step, info=info):
                    losses.mean().backward()
                return losses.mean()

            optimizer.step(closure)
    told = [str(w.message) for w in caught if "LBFGS" in str(w.message)]
    assert len(told) == 1 and "LBFGS.step() needs a closure" in told[0] and "TypeError" not in told[0]
