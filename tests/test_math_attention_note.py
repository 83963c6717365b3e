"""Graph steps that switch the attention kernel say so in the record (issue 37, item 2).

A step that needs the graph of ``p.grad`` (HessMaxEV, ``create_graph``) runs
its forward pass with PyTorch's math attention kernel; where the model called
``scaled_dot_product_attention`` in that pass, the step's
``checks["notes"]`` say so. Steps without the graph, and graph steps of
models without attention, say nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.step import MATH_ATTENTION_NOTE
from cockpit_like.quantities import GradNorm, HessMaxEV
from cockpit_like.utils.schedules import linear

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")


class TinyAttention(nn.Module):
    def __init__(self, width=4, classes=3):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):  # x [B, T, width]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.head(F.scaled_dot_product_attention(q, k, v).mean(1))


def _run(model, steps, graph_steps):
    torch.manual_seed(0)
    inputs, labels = torch.randn(4, 3, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    quantities = [HessMaxEV(lambda s: s in graph_steps), GradNorm(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    seen = {}
    for step in range(steps):
        outputs = model(inputs)
        seen[step] = F.scaled_dot_product_attention  # what the model's call saw after the pass
        loss = F.cross_entropy(outputs, labels)
        with cockpit(step, info={"loss": loss, "batch_size": 4}):
            loss.backward(create_graph=cockpit.create_graph(step))
        for p in model.parameters():
            p.grad = None
    return cockpit.get_output()


def test_a_graph_step_with_attention_says_so():
    torch.manual_seed(0)
    original = F.scaled_dot_product_attention
    output = _run(TinyAttention().double(), 3, {1})
    assert MATH_ATTENTION_NOTE in output[1]["checks"]["notes"]
    for step in (0, 2):  # no graph: the fused kernels were free to run, nothing to say
        assert MATH_ATTENTION_NOTE not in output[step].get("checks", {}).get("notes", [])
    assert F.scaled_dot_product_attention is original  # put back after the pass
    assert output[1]["HessMaxEV"] is not None


def test_a_graph_step_without_attention_says_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4 * 3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    flat = nn.Sequential(nn.Flatten(), model)
    output = _run(flat, 2, {0, 1})
    for step in (0, 1):
        assert MATH_ATTENTION_NOTE not in output[step].get("checks", {}).get("notes", [])


def test_the_math_kernel_gives_the_same_values():
    """The counting wrapper returns the function's own values (float64, against a direct call)."""
    torch.manual_seed(1)
    model = TinyAttention().double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    expected = model(x).detach()
    cockpit = Cockpit(model.parameters(), quantities=[HessMaxEV(linear(1))], model=model)
    outputs = model(x)
    torch.testing.assert_close(outputs.detach(), expected, rtol=1e-12, atol=1e-12)
    loss = F.cross_entropy(outputs, torch.tensor([0, 2]))
    with cockpit(0, info={"loss": loss, "batch_size": 2}):
        loss.backward(create_graph=cockpit.create_graph(0))
    assert MATH_ATTENTION_NOTE in cockpit.get_output()[0]["checks"]["notes"]


def test_under_torch_compile_the_note_is_there_too():
    torch.manual_seed(0)
    model = TinyAttention().double()
    try:
        net = torch.compile(model, backend="eager")
        net(torch.randn(1, 3, 4, dtype=torch.float64))
    except Exception:  # noqa: BLE001 - a build without dynamo
        pytest.skip("torch.compile(backend='eager') does not work on this build")
    output = _run(net, 3, {1})
    assert MATH_ATTENTION_NOTE in output[1]["checks"]["notes"]
    assert MATH_ATTENTION_NOTE not in output[2].get("checks", {}).get("notes", [])
