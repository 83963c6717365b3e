"""Loops whose optimizer step is not one plain backward pass before ``optimizer.step()`` (found outside the
repository's tests): a forgotten ``zero_grad`` and SAM with curvature quantities, LBFGS's closure, and parameters
or gradients changed between the tracked block and ``optimizer.step()``."""

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Alpha")
DT = torch.float64


def mlp(extended):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DT)
    return extend(model) if extended else model


def batch(seed=1, rows=8):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, dtype=DT, generator=generator), torch.randint(0, 4, (rows,), generator=generator)


def cockpit_for(model, extended, quantities):
    return Cockpit(model.parameters(), quantities=quantities, **({} if extended else {"model": model}))


def info_of(outputs, y, optimizer):
    """The step's info; ``info["loss"]`` from BackPACK's extended loss module (its second-order extensions
    start there), equal to the mean of the rows' losses."""
    losses = nn.functional.cross_entropy(outputs, y, reduction="none")
    loss = extend(nn.CrossEntropyLoss())(outputs, y)
    return {"batch_size": len(y), "individual_losses": losses, "loss": loss, "optimizer": optimizer}


@pytest.mark.parametrize("extended", [True, False])
def test_a_forgotten_zero_grad_with_curvature_fails_the_step_without_running_the_curvature(extended):
    """The full preset and no zero_grad(): steps 1 and 2 end like economy's (invalid, stale_gradient, one
    gradients-accumulate finding); the Hessian-vector products never run on the stale p.grad, whose graph the
    optimizer's in-place update has broken (before: a RuntimeError from the curvature engine)."""
    model = mlp(extended)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = cockpit_for(model, extended, configuration("full"))
    x, y = batch()
    for step in range(3):
        info = info_of(model(x), y, optimizer)  # forgot: optimizer.zero_grad()
        with cockpit(step, info=info):
            info["loss"].backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    output = cockpit.get_output()
    assert cockpit.checks[0]["valid"] and "HessMaxEV" in output[0]
    for step in (1, 2):
        assert [f["check"] for f in cockpit.invalid_steps[step]] == ["stale_gradient"]
        assert "zero_grad" in cockpit.invalid_steps[step][0]["reason"]
        assert set(output[step]) <= {"checks", "findings", "UpdateSize", "Alpha"}
    assert [(f.rule, f.step) for f in cockpit.findings] == [("gradients-accumulate", 1)]


@pytest.mark.parametrize("extended", [True, False])
def test_sam_with_both_passes_in_the_block_and_curvature_ends_invalid_without_a_crash(extended):
    """SAM, both backward passes inside ``with cockpit(step)``, the full preset: every step invalid with its
    reason (step 0 withdrawn as accumulating, then the gradient check), no curvature on the graph the perturbation
    invalidated, and (BackPACK) both passes leave the same curvature buffers (before: a RuntimeError from the
    curvature engine, then a PartitionError from the GGN diagonal added to the second pass only)."""
    model = mlp(extended)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    cockpit = cockpit_for(model, extended, configuration("full"))
    x, y = batch()
    for step in range(3):
        optimizer.zero_grad()
        info = info_of(model(x), y, optimizer)
        with cockpit(step, info=info):
            info["loss"].backward(create_graph=cockpit.create_graph(step))
        with torch.no_grad():
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            perturbation = [0.05 * p.grad / norm for p in params]
            for p, e in zip(params, perturbation):
                p.add_(e)
        optimizer.zero_grad()
        info = info_of(model(x), y, optimizer)
        with cockpit(step, info=info):
            info["loss"].backward(create_graph=cockpit.create_graph(step))
        with torch.no_grad():
            for p, e in zip(params, perturbation):
                p.sub_(e)
        optimizer.step()
    checks = cockpit.checks
    assert [f["check"] for f in checks[0]["failed"]] == ["backward_passes"]
    for step in (1, 2):
        assert [f["check"] for f in checks[step]["failed"]] == ["gradient"] and checks[step]["backward_passes"] == 2
        assert "HessMaxEV" not in cockpit.get_output().get(step, {})
