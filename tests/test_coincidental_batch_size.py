"""An argument whose leading dimension equals the batch size by coincidence.

A module that owns a parameter and is called with ``(x [B, T, D], bias [T, T])`` where ``T`` equals ``B``
(a causal attention bias, Hugging Face Funnel's relative position tensors at batch size 4): the re-run
that gets per-sample gradients split ``bias`` into rows too, did not reproduce the forward pass and raised
``UncoveredParameterError`` blaming a key/value cache or random numbers (outside trials, left open in the
sixth round). Where slicing does not reproduce the forward pass, the re-run now tries passing such
arguments whole, and uses the reading that does (checked against the forward pass, as every re-run is).

References never come from cockpit_like: per-sample gradients by a loop of ``torch.autograd.grad`` over the
rows, in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import NormTest

from .helpers import assert_rows_match, gram_probe

DTYPE = torch.float64
WIDTH = 5


class Attention(nn.Module):
    """Owns its parameter (no submodule with a rule): re-run row by row by torch.func."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=DTYPE) / 3)

    def forward(self, x, bias, scale):
        scores = (x @ self.weight) @ x.transpose(1, 2) + bias
        return torch.softmax(scores, -1) @ x * scale


class Model(nn.Module):
    def __init__(self, tokens: int, per_row_scale: bool):
        super().__init__()
        torch.manual_seed(0)
        self.attention = Attention()
        self.head = nn.Linear(WIDTH, 3).to(DTYPE)
        self.register_buffer("bias", torch.triu(torch.full((tokens, tokens), -1e4, dtype=DTYPE), 1))
        self.per_row_scale = per_row_scale

    def forward(self, x):
        # a per-row scale [B, 1, 1] (sliced) beside the coincidental [T, T] bias (whole)
        scale = 1 + x[:, :1, :1] ** 2 if self.per_row_scale else torch.ones(1, 1, 1, dtype=DTYPE)
        return self.head(self.attention(x, self.bias, scale).mean(1))


def _train(model, rows, tokens, steps=3, quantities=None):
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=quantities, model=model)
    optimizer = torch.optim.SGD(params, lr=0.3)
    generator = torch.Generator().manual_seed(1)
    lossfunc = nn.CrossEntropyLoss(reduction="none")
    references = []
    for step in range(steps):
        x = torch.randn(rows, tokens, WIDTH, dtype=DTYPE, generator=generator)
        y = torch.randint(0, 3, (rows,), generator=generator)
        losses = lossfunc(model(x), y)
        G = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], params, retain_graph=True)]) for i in range(rows)]
        references.append(torch.stack(G))
        losses = lossfunc(model(x), y)
        loss = losses.mean()
        with cockpit(step, info={"batch_size": rows, "individual_losses": losses, "loss": loss, "optimizer": optimizer}):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return cockpit, references


@pytest.mark.parametrize("per_row_scale", [False, True], ids=["bias_only", "with_a_per_row_argument"])
@pytest.mark.parametrize("rows", [4, 3], ids=["T_equals_B", "T_differs"])
def test_a_bias_whose_size_equals_the_batch_is_passed_whole(rows, per_row_scale):
    model = Model(tokens=4, per_row_scale=per_row_scale)
    probe, norm = gram_probe(lambda step: True), NormTest(lambda step: True)
    cockpit, references = _train(model, rows=rows, tokens=4, quantities=[probe, norm])
    for step, G in enumerate(references):
        assert_rows_match(cockpit, probe, step, G)


class Coupled(nn.Module):
    """Rows that really are coupled (a batch mean inside): no reading reproduces the forward pass."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(WIDTH, 3, dtype=DTYPE) / 3)
        self.register_buffer("bias", torch.zeros(4, 4, dtype=DTYPE))

    def forward(self, x):
        h = (x - x.mean(0, keepdim=True)) @ self.weight
        return (h + self.bias.sum()).mean(1)


def test_coupled_rows_are_named_and_left_out():
    """Rows coupled inside the model (a mean over the batch): the re-run does not reproduce the step, and the
    per-sample quantities are left out with that note (an error until 2026-11-29): never a number."""
    model = Coupled()
    cockpit, _ = _train(model, rows=4, tokens=4, steps=1, quantities=[NormTest(lambda step: True)])
    assert "NormTest" not in cockpit.get_output().get(0, {})
    assert any("did not reproduce" in note for note in cockpit.checks[0]["notes"])
