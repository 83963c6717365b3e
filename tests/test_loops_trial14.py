"""Outside trial 14's findings (a tester hunting false alarms on correct loops).

Two losses backpropagated one after the other in one block, declared as their sum: the first tracked step failed
``backward_passes`` and ``gradient`` and stored nothing (11 of 11 runs), with no way to declare the passes;
``info["backward_passes"]`` now declares them. Reentrant activation checkpointing with the full preset: after the
products were restricted to the parameters whose gradient has a graph (trial 13), its steps stored a wrong
HessMaxEV as valid (1.77 for 5.18); parameters with a gradient but no graph are differentiated again, and PyTorch's
refusal is turned into the error that names the fix.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

DT = torch.float64


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.cls, self.reg = nn.Linear(16, 5), nn.Linear(16, 1)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h), self.reg(h).squeeze(1)


def two_heads(declare: bool | None, steps: int = 3):
    """``declare``: True passes ``backward_passes=2`` with two backward calls, False two calls undeclared, None
    one call on the sum (the reference)."""
    torch.manual_seed(0)
    model = Heads().to(DT)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            opt.zero_grad()
            x, y = torch.randn(7, 8, generator=generator, dtype=DT), torch.randint(0, 5, (7,), generator=generator)
            r = torch.randn(7, generator=generator, dtype=DT)
            a, b = model(x)
            l1, l2 = F.cross_entropy(a, y), F.mse_loss(b, r)
            rows = F.cross_entropy(a, y, reduction="none") + (b - r) ** 2
            info = {"batch_size": 7, "individual_losses": rows, "loss": l1 + l2, "optimizer": opt}
            if declare:
                info["backward_passes"] = 2
            with cockpit(step, info=info):
                if declare is None:
                    (l1 + l2).backward()
                else:
                    l1.backward(retain_graph=True)
                    l2.backward()
            opt.step()
    return cockpit


def test_two_backward_calls_declared_are_summed_from_the_first_step():
    declared, undeclared, reference = two_heads(True), two_heads(False), two_heads(None)
    assert not undeclared.checks[0]["valid"]  # learned at the first such step, as before
    out, expected = declared.get_output(), reference.get_output()
    for step in range(3):
        assert declared.checks[step]["valid"], declared.checks[step]["failed"]
        for name in ("GradNorm", "NormTest", "InnerTest", "OrthoTest"):
            assert out[step][name] == pytest.approx(expected[step][name], rel=1e-9), (step, name)
    assert out[0]["Alpha"] == pytest.approx(expected[0]["Alpha"], rel=1e-9)
    # every pass counted where the rows summed them (before, merged steps said 1), against what was declared
    assert [(declared.checks[s]["backward_passes"], declared.checks[s]["declared_passes"]) for s in range(3)] == [(2, 2)] * 3
    assert [(undeclared.checks[s]["backward_passes"], undeclared.checks[s]["declared_passes"]) for s in range(3)] == [(2, 1)] * 3
    assert reference.checks[0]["backward_passes"] == 1 and "checks" not in expected[0]


def test_a_bad_number_of_backward_passes_is_refused():
    model = Heads().to(DT)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    a, _ = model(torch.randn(4, 8, dtype=DT))
    losses = F.cross_entropy(a, torch.randint(0, 5, (4,)), reduction="none")
    with pytest.raises(ValueError, match=r"info\['backward_passes'\] must be a positive int"):
        with cockpit(0, info={"batch_size": 4, "individual_losses": losses, "loss": losses.mean(), "backward_passes": 0}):
            losses.mean().backward()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(10), nn.Linear(10, 10)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Checkpointed(nn.Module):
    """The tester's set-up: the blocks (residual inside) checkpointed, so that only the head's gradient keeps a
    graph under a reentrant checkpoint."""

    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant
        self.first, self.blocks, self.head = nn.Linear(6, 10), nn.ModuleList([Block(), Block()]), nn.Linear(10, 4)

    def forward(self, x):
        h = self.first(x)
        for block in self.blocks:
            h = block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def test_reentrant_checkpointing_with_curvature_is_refused_not_wrong():
    """A reentrant checkpoint leaves the gradients of the parameters inside it without a graph (not without a
    gradient): the products must not hold them fixed. The non-reentrant one gives the uncheckpointed value."""
    values = {}
    for reentrant in (None, False, True):
        torch.manual_seed(0)
        model = Checkpointed(reentrant).to(DT)
        cockpit = Cockpit(list(model.parameters()), quantities=configuration("full"), model=model)
        x, y = torch.randn(7, 6, dtype=DT), torch.randint(0, 4, (7,))
        losses = F.cross_entropy(model(x), y, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if reentrant:
                with pytest.raises(RuntimeError, match="reentrant activation checkpoint"):
                    with cockpit(0, info={"batch_size": 7, "individual_losses": losses, "loss": losses.mean()}):
                        losses.mean().backward(create_graph=cockpit.create_graph(0))
            else:
                with cockpit(0, info={"batch_size": 7, "individual_losses": losses, "loss": losses.mean()}):
                    losses.mean().backward(create_graph=cockpit.create_graph(0))
                values[reentrant] = cockpit.get_output()[0]["HessMaxEV"]
    assert values[False] == pytest.approx(values[None], rel=1e-10)
