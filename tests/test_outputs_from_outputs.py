"""A model that owns a parameter and returns ``(features, head(features))``: its call cannot be re-run row by row
(the inner use of ``features`` would count twice). The error said its outputs [[6, 5], [6, 3]] had "no batch
dimension of size 6" (an outside tester, sixth round); it now names the cause and the fixes, and the fix it
names (the parameter in a submodule of its own) gives the exact numbers."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.rerun import UncoveredParameterError
from cockpit_like.quantities import GradNorm, NormTest
from cockpit_like.utils.schedules import linear


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return x * self.weight


class _Net(nn.Module):
    def __init__(self, own_module):
        super().__init__()
        self.body, self.head = nn.Linear(4, 5), nn.Linear(5, 3)
        if own_module:
            self.scale = _Scale()
        else:
            self.scale_weight = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.own_module = own_module

    def forward(self, x):
        h = torch.tanh(self.body(x))
        h = self.scale(h) if self.own_module else h * self.scale_weight
        return h, self.head(h)


def _step(model, x, y):
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))], model=model)
    losses = F.cross_entropy(model(x)[1], y, reduction="none")
    with cockpit(0, info={"batch_size": len(y), "loss": losses.mean(), "individual_losses": losses}):
        losses.mean().backward()
    return cockpit


def test_the_error_names_an_output_computed_from_another():
    torch.manual_seed(0)
    with pytest.raises(UncoveredParameterError, match="computed from another of them") as raised:
        _step(_Net(own_module=False).double(), torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)))
    assert "no batch dimension" not in str(raised.value) and "submodule" in str(raised.value)


def test_the_named_fix_is_exact():
    torch.manual_seed(0)
    model = _Net(own_module=True).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    params = list(model.parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1])[1], y[i:i + 1]), params) for i in range(6)]
    mean = [torch.stack(g).mean(0) for g in zip(*rows)]
    norm2 = sum((g ** 2).sum() for g in mean)
    spread = sum(((torch.stack(g) - m) ** 2).sum() for g, m in zip(zip(*rows), mean))
    cockpit = _step(model, x, y)
    assert cockpit.checks[0]["valid"]
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(torch.sqrt(spread / (5 * 6 * norm2)).item(), rel=1e-9)
