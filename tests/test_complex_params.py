"""Complex-valued parameters are refused at construction (docs/your_model.md#limits), with the parameter named.

Before: InnerTest and OrthoTest were stored (complex / wrong) on a step marked valid, Alpha raised TypeError,
GradHist1d a raw NotImplementedError, nn.Linear(dtype=complex128) an UnsupportedLayerError about BackPACK.
The recipe the error gives (two real parameters) is checked against a float64 brute force that counts each
complex entry as two real coordinates; leaving the complex parameters out keeps the real rest right.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cockpit_like import Cockpit
from cockpit_like import quantities as Q
from cockpit_like.cockpit import ComplexParameterError
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

B = 6


class ComplexParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, dtype=torch.complex128) * 0.4)

    def forward(self, x):
        return (torch.complex(x, torch.roll(x, 1, 1)) @ self.w.T).abs()


class ComplexLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 5, dtype=torch.complex128)
        self.l2 = nn.Linear(5, 3, dtype=torch.float64)

    def forward(self, x):
        return self.l2(self.l1(torch.complex(x, torch.roll(x, 1, 1))).abs())


class TwoReal(nn.Module):
    """The recipe: the complex weight as two real parameters."""

    def __init__(self):
        super().__init__()
        w = torch.randn(3, 4, dtype=torch.complex128) * 0.4
        self.w_re = nn.Parameter(w.real.clone())
        self.w_im = nn.Parameter(w.imag.clone())

    def forward(self, x):
        return (torch.complex(x, torch.roll(x, 1, 1)) @ torch.complex(self.w_re, self.w_im).T).abs()


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(B, 4, dtype=torch.float64, generator=gen), torch.randint(0, 3, (B,), generator=gen)


@pytest.mark.parametrize("make, name", [(ComplexParam, "w"), (ComplexLinear, "l1.weight")])
@pytest.mark.parametrize("quantities", ["economy", "alpha"])
def test_complex_parameters_refused_at_construction(make, name, quantities):
    torch.manual_seed(0)
    model = make()
    qs = configuration("economy") if quantities == "economy" else [Q.Alpha(linear(1))]
    with pytest.raises(ComplexParameterError) as info:
        Cockpit(model.parameters(), quantities=qs, model=model)
    message = str(info.value)
    assert "complex-valued parameters are not supported" in message
    assert name in message and "complex128" in message
    assert "two real parameters" in message
    if make is ComplexLinear:  # the real layer is not named, the complex bias is
        assert "l1.bias" in message and "l2" not in message


def test_complex_parameter_named_by_index_without_model():
    model = ComplexParam()
    with pytest.raises(ComplexParameterError, match=r"parameter #0 \(torch.complex128, shape \[3, 4\]\)"):
        Cockpit(model.parameters(), quantities=configuration("economy"))


def _brute(losses, params):
    """Per-sample gradients by a loop of autograd.grad, complex entries as two real coordinates."""
    rows = []
    for i in range(len(losses)):
        grads = torch.autograd.grad(losses[i], params, retain_graph=True)
        rows.append(torch.cat([(torch.view_as_real(g) if g.is_complex() else g).reshape(-1) for g in grads]))
    G = torch.stack(rows)
    gb = G.mean(0)
    n2 = gb @ gb
    pi = G @ gb
    norm = math.sqrt(((G - gb) ** 2).sum() / ((B - 1) * B * n2))
    inner = math.sqrt(((pi - n2) ** 2).sum() / ((B - 1) * B * n2**2))
    ortho = math.sqrt(((G - (pi / n2)[:, None] * gb) ** 2).sum() / ((B - 1) * B * n2))
    return {"NormTest": norm, "InnerTest": inner, "OrthoTest": ortho}


def _tests_step(model, params):
    x, y = _data()
    opt = torch.optim.SGD(params, lr=0.1)
    qs = [Q.NormTest(linear(1)), Q.InnerTest(linear(1)), Q.OrthoTest(linear(1))]
    cockpit = Cockpit(params, quantities=qs, model=model)
    losses = F.cross_entropy(model(x), y, reduction="none")
    loss = losses.mean()
    ref = _brute(losses, params)
    with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": loss, "optimizer": opt}):
        loss.backward()
    assert 0 not in cockpit.invalid_steps
    out = cockpit.get_output()[0]
    for key, value in ref.items():
        assert isinstance(out[key], float)
        assert out[key] == pytest.approx(value, rel=1e-9), key


def test_two_real_parameters_match_the_complex_brute_force():
    """The recipe the error names gives the numbers of the complex model, each entry two real coordinates."""
    torch.manual_seed(0)
    twin = TwoReal()
    torch.manual_seed(0)
    original = ComplexParam()
    assert torch.equal(torch.complex(twin.w_re, twin.w_im), original.w)
    x, y = _data()
    losses_c = F.cross_entropy(original(x), y, reduction="none")
    ref_complex = _brute(losses_c, [original.w])
    losses_r = F.cross_entropy(twin(x), y, reduction="none")
    ref_real = _brute(losses_r, [twin.w_re, twin.w_im])
    for key in ref_complex:  # two real parameters ARE the complex entries as two real coordinates
        assert ref_real[key] == pytest.approx(ref_complex[key], rel=1e-9)
    _tests_step(twin, list(twin.parameters()))


def test_real_parameters_alongside_a_left_out_complex_layer():
    """Leaving the complex layer out of Cockpit(params): the real rest is tracked and right."""
    torch.manual_seed(0)
    model = ComplexLinear()
    _tests_step(model, list(model.l2.parameters()))


def test_real_parameters_alongside_a_left_out_complex_layer_economy():
    torch.manual_seed(0)
    model = ComplexLinear()
    params = list(model.l2.parameters())
    x, y = _data()
    opt = torch.optim.SGD(params, lr=0.1)
    cockpit = Cockpit(params, quantities=configuration("economy"), model=model)
    for step in range(2):
        opt.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean()
        with cockpit(step, info={"batch_size": B, "individual_losses": losses, "loss": loss, "optimizer": opt}):
            loss.backward()
        opt.step()
    assert not cockpit.invalid_steps
    for values in cockpit.get_output().values():
        for value in values.values():
            assert not isinstance(value, complex)
