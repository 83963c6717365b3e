"""The user's training loop: torch.compile, activation checkpointing, clipping, frozen layers, LR schedules.

Each setup against the same run without it (or against the update it really
makes), float64; what PyTorch itself cannot do gets a clear error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cockpit_like import Cockpit
from cockpit_like.quantities import GradNorm, UpdateSize
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests import zoo
from tests.test_accumulation import _assert_close, _without_time


class Blocks(nn.Module):
    """Linear-LayerNorm-GELU, a Tanh block (optionally checkpointed), a linear head."""

    def __init__(self, reentrant: bool | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(6, 12), nn.LayerNorm(12), nn.GELU())
        self.b = nn.Sequential(nn.Linear(12, 8), nn.Tanh())
        self.head = nn.Linear(8, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.a(x)
        h = self.b(h) if self.reentrant is None else checkpoint(self.b, h, use_reentrant=self.reentrant)
        return self.head(h)


def _run(preset="economy", reentrant=None, backend=None, steps=3, clip=None, freeze=False, schedule=False):
    model = Blocks(reentrant).double()
    if freeze:
        model.a.requires_grad_(False)
    net = torch.compile(model, backend=backend) if backend else model
    params = [p for p in model.parameters() if p.requires_grad]
    quantities = configuration(preset) if isinstance(preset, str) else preset
    cockpit = Cockpit(params, quantities=quantities, model=net)
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if schedule else None
    batch = zoo._classification((6,), 4)
    updates = []
    for step in range(steps):
        x, y = batch(8, step)
        optimizer.zero_grad()
        outputs = net(x)
        losses = nn.functional.cross_entropy(outputs, y, reduction="none")
        loss = losses.mean()
        torch.manual_seed(step)
        with cockpit(step, info={"batch_size": 8, "loss": loss, "individual_losses": losses, "optimizer": optimizer}):
            loss.backward(create_graph=cockpit.create_graph(step))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        before = [p.detach().clone() for p in params]
        optimizer.step()
        updates.append([float((p.detach() - b).norm()) for p, b in zip(params, before)])
        if scheduler is not None:
            scheduler.step()
    return _without_time(cockpit.get_output()), updates


@pytest.mark.parametrize("preset", ["economy", "full"])
def test_compiled_model_equals_the_plain_one(preset):
    # the default backend cannot backpropagate twice: only the economy preset, see the next test
    backend = "aot_eager" if preset == "economy" else "eager"
    _assert_close(_run(preset, backend=backend)[0], _run(preset)[0], f"compile {preset}")


def test_compiled_model_with_curvature_names_the_limit_and_the_fix():
    with pytest.raises(RuntimeError, match="backend='eager'") as error:
        _run("full", backend="aot_eager", steps=1)
    assert "'aot_eager'" in str(error.value) and "HessMaxEV" in str(error.value)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_equals_the_plain_model(reentrant):
    _assert_close(_run("economy", reentrant=reentrant)[0], _run("economy")[0], f"checkpoint reentrant={reentrant}")


def test_non_reentrant_checkpointing_with_curvature():
    _assert_close(_run("full", reentrant=False)[0], _run("full")[0], "checkpoint full")


def test_reentrant_checkpointing_with_curvature_names_the_limit_and_the_fix():
    with pytest.raises(RuntimeError, match="use_reentrant=False") as error:
        _run("full", reentrant=True, steps=1)
    assert "gradient_checkpointing_kwargs" in str(error.value) and "HessMaxEV" in str(error.value)


def test_clipping_after_backward():
    """The quantities describe the gradient of the backward pass (before clipping); the update the
    optimizer makes with the clipped gradient is what UpdateSize measures."""
    every = linear(1)
    clipped, updates = _run([GradNorm(every), UpdateSize(every)], clip=0.05)
    plain, _ = _run([GradNorm(every)], steps=1)
    assert clipped[0]["GradNorm"] == pytest.approx(plain[0]["GradNorm"], rel=1e-12)
    assert sum(v**2 for v in clipped[0]["GradNorm"]) ** 0.5 > 0.05  # clipping changed this step
    for step in range(2):
        assert clipped[step]["UpdateSize"] == pytest.approx(updates[step], rel=1e-10)


def test_frozen_layers():
    """Only trainable parameters are passed; their quantities equal brute-force gradients of them alone."""
    output, _ = _run("economy", freeze=True, steps=2)
    model = Blocks().double()
    model.a.requires_grad_(False)
    x, y = zoo._classification((6,), 4)(8, 0)
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    assert output[0]["GradNorm"] == pytest.approx([float(g.norm()) for g in grads], rel=1e-10)
    assert len(output[0]["GradNorm"]) == 4  # b and head only


def test_learning_rate_schedule():
    """UpdateSize is the update the optimizer makes under a StepLR schedule; Alpha stays defined."""
    output, updates = _run("economy", schedule=True, steps=4)
    for step in range(3):
        assert output[step]["UpdateSize"] == pytest.approx(updates[step], rel=1e-10)
        assert isinstance(output[step]["Alpha"], float)


def test_the_hooks_registry_holds_weak_references_without_callbacks():
    """The hooks read the tracers' registry inside a compiled forward pass, where dynamo iterates it: entries that
    the garbage collector removed in the middle (a WeakValueDictionary's callbacks) raised "dictionary changed size
    during iteration" in a fresh-clone CI run. The registry is a plain dict of weak references now, changed only when
    a tracer is made (dead entries swept then): a dead cockpit is collected, and a new one sweeps its entry."""
    import gc
    import weakref

    from cockpit_like.backends import tracer as tracer_module

    model = torch.nn.Linear(3, 2)
    cockpit = Cockpit(model.parameters(), quantities=[], model=model)
    registry = tracer_module._TRACERS
    assert type(registry) is dict and all(type(ref) is weakref.ref for ref in registry.values())
    before = len(registry)
    del cockpit
    gc.collect()
    assert len(registry) == before  # nothing removed behind the hooks' back
    other = torch.nn.Linear(3, 2)
    kept = Cockpit(other.parameters(), quantities=[], model=other)
    assert kept is not None and all(ref() is not None for ref in registry.values())  # the dead entry swept
