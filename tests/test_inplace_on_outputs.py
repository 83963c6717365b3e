"""An in-place operation on a layer's output after the call: ``x += self.pos``, ``nn.ReLU(inplace=True)``.

``nn.Linear`` on ``[B, T, D]`` returns a view of its ``[B*T, D]`` product. An in-place operation on that
view after the call (a hand-written ViT's ``x = self.proj(patches); x += self.pos``, an MLP with
``nn.ReLU(inplace=True)`` on tokens) takes the view's graph node out of the graph, so the hook on it never
ran: the layer's rows were zero and every tracked step failed the gradient check, with a message listing
other causes (found while going through the sixth round's leftovers). The gradient is now taken at the
product's node where the view's did not run: the gradient of the output as the layer made it.

References never come from cockpit_like: per-sample gradients by a loop of ``torch.autograd.grad`` over the
rows, in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import GradNorm, NormTest

from .helpers import assert_rows_match, gram_probe

DTYPE = torch.float64
B, T, D = 5, 4, 6


class Model(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.proj = nn.Linear(D, D).to(DTYPE)
        self.pos = nn.Parameter(torch.randn(1, T, D, dtype=DTYPE) / 2)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(D, 3).to(DTYPE)

    def forward(self, x):
        h = self.proj(x)
        if self.how == "add_position":
            h += self.pos
        elif self.how == "relu_inplace":
            h = self.act(h) + self.pos
        elif self.how == "tanh_then_scale":  # the gradient before the in-place ops is not the one after
            h.mul_(3.0).tanh_()
            h = h + self.pos
        return self.head(h.mean(1))


def _rows(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="none")


@pytest.mark.parametrize("how", ["add_position", "relu_inplace", "tanh_then_scale"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_an_in_place_operation_on_a_linear_layers_view_output(how, micro_batches):
    model = Model(how)
    params = list(model.parameters())
    probe, norm, gnorm = gram_probe(lambda s: True), NormTest(lambda s: True), GradNorm(lambda s: True)
    cockpit = Cockpit(params, quantities=[probe, norm, gnorm], model=model)
    optimizer = torch.optim.SGD(params, lr=0.2)
    generator = torch.Generator().manual_seed(2)
    rows = B * micro_batches
    for step in range(3):
        x = torch.randn(rows, T, D, dtype=DTYPE, generator=generator)
        y = torch.randint(0, 3, (rows,), generator=generator)
        twin = Model(how)  # the brute force on a copy the cockpit does not watch
        twin.load_state_dict(model.state_dict())
        twin_params = list(twin.parameters())
        losses = _rows(twin, x, y)
        G = torch.stack([
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], twin_params, retain_graph=True)])
            for i in range(rows)
        ])
        optimizer.zero_grad()
        for part in range(micro_batches):
            xs, ys = x[part * B : (part + 1) * B], y[part * B : (part + 1) * B]
            losses = _rows(model, xs, ys)
            loss = losses.mean()
            info = {"batch_size": B, "individual_losses": losses, "loss": loss, "optimizer": optimizer}
            if micro_batches > 1:
                info["micro_batches"] = micro_batches
            with cockpit(step, info=info):
                (loss / micro_batches).backward()
        optimizer.step()
        assert_rows_match(cockpit, probe, step, G)
        gbar = G.mean(0)
        layers = torch.as_tensor(cockpit.get_output()[step]["GradNorm"])  # one norm per parameter
        assert float(layers.pow(2).sum().sqrt()) == pytest.approx(float(gbar.norm()), rel=1e-6)  # stored in float32


def test_the_run_is_the_same_with_and_without_the_cockpit():
    """The in-place operations themselves are the user's: outputs and gradients unchanged."""
    results = []
    for tracked in (False, True):
        model = Model("tanh_then_scale")
        params = list(model.parameters())
        cockpit = Cockpit(params, quantities=[NormTest(lambda s: True)], model=model) if tracked else None
        optimizer = torch.optim.SGD(params, lr=0.2)
        generator = torch.Generator().manual_seed(3)
        for step in range(2):
            x = torch.randn(B, T, D, dtype=DTYPE, generator=generator)
            y = torch.randint(0, 3, (B,), generator=generator)
            optimizer.zero_grad()
            losses = _rows(model, x, y)
            loss = losses.mean()
            if tracked:
                with cockpit(step, info={"batch_size": B, "individual_losses": losses, "loss": loss, "optimizer": optimizer}):
                    loss.backward()
            else:
                loss.backward()
            optimizer.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in params]))
    assert torch.equal(results[0], results[1])
