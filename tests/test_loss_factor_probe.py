"""The factor probe at the model's output is the cockpit's own backward pass, never the user's.

Found outside the tests (a sixth round, F2): token losses ``tok`` [B, T], ``info["individual_losses"] =
tok.mean(1)``, ``info["loss"]`` their mean, the loop backpropagating ``tok.mean() / K`` (the same value as
``info["loss"] / K``, K micro-batches declared). ``info["loss"]`` is not on the backpropagated path, so the
cockpit probes the factor at the model's output with ``torch.autograd.grad`` from the rows; that pass fired the
hook the cockpit itself put on the rows, which got the probe's ``1/B`` per row and recorded the factor 1 "seen";
every step was stored invalid (``backpropagated_loss``: "the factor ... is 1"). The same with a declared
GradScaler (1 recorded against 1024). Float64, against per-sample gradients from a loop of autograd.grad.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import GradNorm, InnerTest, Loss, NormTest, OrthoTest
from cockpit_like.utils.schedules import linear
from tests.helpers import brute_force_step

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")
DT = torch.float64
B, T, V, STEPS = 4, 3, 7, 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 5), nn.Tanh(), nn.Linear(5, V)).to(DT)


def _tokens(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").reshape(x.shape)


def _reference(model, x, y):
    return brute_force_step(model, lambda m, i: _tokens(m, x[i : i + 1], y[i : i + 1]).mean(), len(x))


def _run(K: int, scale: float | None):
    """``K`` micro-batches of ``B`` rows; ``scale``: a declared GradScaler's scale (``None``: none)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale is not None else None
    quantities = [q(linear(1)) for q in (Loss, GradNorm, NormTest, InnerTest, OrthoTest)]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    references = []
    g = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        batches = [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(K)]
        references.append(_reference(copy.deepcopy(model), torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])))
        optimizer.zero_grad()
        for x, y in batches:
            tok = _tokens(model, x, y)
            losses = tok.mean(1)
            info = {"batch_size": B, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer, "micro_batches": K}
            if scaler is not None:
                info["grad_scaler"] = scaler
            backpropagated = tok.mean() / K  # equal to info["loss"] / K, but not computed from it
            with cockpit(step, info=info):
                (scaler.scale(backpropagated) if scaler is not None else backpropagated).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return cockpit, references


@pytest.mark.parametrize("scale", [None, 1024.0], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_token_means_backpropagated_apart_are_valid_and_exact(K, scale):
    cockpit, references = _run(K, scale)
    output = cockpit.get_output()
    for step, expected in enumerate(references):
        checks = cockpit.checks[step]
        assert checks["valid"] and checks["failed"] == [], checks
        # not seen (the probe's graph is gone by the time it runs), so the declaration is used: never the probe's 1
        assert checks.get("loss_factor") in (None, pytest.approx(1 / K * (scale or 1.0), rel=1e-9)), checks
        assert checks["assumed_factor"] == pytest.approx(1 / K * (scale or 1.0), rel=1e-12)
        if checks.get("loss_factor") is None:  # and says so
            assert any(note.startswith("loss factor not verified") for note in checks["notes"]), checks
        for name, value in expected.items():
            assert output[step][name] == pytest.approx(value, rel=1e-9, abs=1e-13), (step, name)
