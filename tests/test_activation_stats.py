"""ActivationStats and ParamNorm against hand-computed references (float64, CPU)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import ActivationStats, Loss, ParamNorm
from cockpit_like.quantities.activations import activation_kind
from cockpit_like.utils.schedules import linear

DTYPE = torch.float64


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 8), nn.ReLU(inplace=True),
        nn.Linear(8, 7), nn.Tanh(),
        nn.Linear(7, 5), nn.Sigmoid(),
        nn.Linear(5, 4), nn.GELU(),
        nn.Linear(4, 3),
    ).to(DTYPE)
    with torch.no_grad():  # large weights: some units saturate or switch off
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(4.0)
        model[0].bias.fill_(-1.0)
        model[4].weight.mul_(4.0)
        model[6].bias.fill_(-3.0)
    return model


def _reference(model: nn.Sequential, batches: list[torch.Tensor], saturation: float = 0.01) -> dict:
    """The statistics by a plain layer-by-layer forward pass over all batches at once."""
    x = torch.cat(batches)
    found = {}
    with torch.no_grad():
        for index, layer in enumerate(model):
            pre = x
            x = layer(x.clone())
            kind = activation_kind(layer)
            if kind is None:
                continue
            if kind == "relu":
                off = x == 0
            elif kind == "gelu":
                off = pre <= -3.0
            elif kind == "tanh":
                off = x.abs() >= 1 - saturation
            else:
                off = (x <= saturation) | (x >= 1 - saturation)
            per_unit = off.all(dim=0).double().mean().item()
            entry = {"kind": kind, "units": x.shape[1], "samples": x.shape[0], "rms": x.pow(2).mean().sqrt().item()}
            if kind in ("relu", "gelu"):
                entry.update(zero_fraction=off.double().mean().item(), dead_fraction=per_unit)
            else:
                entry.update(saturated_fraction=off.double().mean().item(), saturated_unit_fraction=per_unit)
            found[str(index)] = entry
    return found


def _train(model, steps, schedule, forwards_per_step=1, batch=16, extra=()):
    cockpit = Cockpit(list(model.parameters()), quantities=[ActivationStats(schedule), *extra], model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs_per_step = {}
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        batches = [torch.randn(batch, 6, generator=generator, dtype=DTYPE) for _ in range(forwards_per_step)]
        inputs_per_step[step] = (batches, [p.detach().clone() for p in model.parameters()])
        optimizer.zero_grad()
        loss = sum(model(b).pow(2).mean() for b in batches) / forwards_per_step
        with torch.no_grad():
            model(batches[0])  # an evaluation pass: not counted
        with cockpit(step, info={"loss": loss, "batch_size": batch * forwards_per_step}):
            loss.backward()
        optimizer.step()
    return cockpit, inputs_per_step


def _assert_close(stored: dict, reference: dict) -> None:
    assert set(stored) == set(reference)
    for layer, expected in reference.items():
        got = stored[layer]
        assert got["kind"] == expected["kind"]
        assert got["units"] == expected["units"] and got["samples"] == expected["samples"]
        for key, value in expected.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), (layer, key)


@pytest.mark.parametrize("forwards", [1, 2])
def test_matches_a_plain_forward_pass(forwards):
    model = _model()
    cockpit, inputs = _train(model, steps=3, schedule=linear(1), forwards_per_step=forwards)
    output = cockpit.get_output()
    for step in range(3):
        batches, params = inputs[step]
        twin = _model()
        with torch.no_grad():
            for target, source in zip(twin.parameters(), params):
                target.copy_(source)
        _assert_close(output[step]["ActivationStats"], _reference(twin, batches))
    first = output[0]["ActivationStats"]
    # the set-up reaches every branch: some ReLU entries are off, some tanh/sigmoid saturated
    assert 0 < first["1"]["zero_fraction"] < 1
    assert first["3"]["saturated_fraction"] > 0 and first["5"]["saturated_fraction"] > 0
    assert 0 < first["7"]["zero_fraction"] < 1


def test_hooks_exist_only_during_tracked_steps():
    model = _model()
    activations = [m for m in model if activation_kind(m) is not None]
    calls = []

    class Spy(ActivationStats):
        def prepare_forward(self, global_step):
            calls.append(global_step)
            super().prepare_forward(global_step)

    cockpit = Cockpit(list(model.parameters()), quantities=[Spy(linear(3))], model=model)
    hooked = []
    for step in range(7):
        x = torch.randn(4, 6, dtype=DTYPE)
        loss = model(x).pow(2).mean()
        hooked.append(sum(len(m._forward_hooks) for m in activations))
        with cockpit(step, info={"loss": loss}):
            loss.backward()
        assert all(not m._forward_hooks for m in activations)  # removed once the step is stored
    assert hooked == [4, 0, 0, 4, 0, 0, 4]
    assert sorted(set(calls)) == [0, 3, 6]
    assert sorted(cockpit.get_output()) == [0, 3, 6]
    # a resume carries the setting only (no hooks, model references or tallies)
    assert cockpit.quantities[0].state_dict() == {"attributes": {"saturation": 0.01}, "objects": {}}


def test_no_activation_modules_warns_and_stores_nothing():
    model = nn.Sequential(nn.Linear(3, 2)).to(DTYPE)
    cockpit = Cockpit(list(model.parameters()), quantities=[ActivationStats(linear(1))], model=model)
    with pytest.warns(RuntimeWarning, match="functional activations"):
        for step in range(2):
            model.zero_grad()
            loss = model(torch.randn(4, 3, dtype=DTYPE)).sum()
            with cockpit(step, info={"loss": loss}):
                loss.backward()
    assert cockpit.get_output() == {}


def test_bad_saturation():
    with pytest.raises(ValueError, match="saturation"):
        ActivationStats(linear(1), saturation=0.7)


def test_param_norm():
    model = _model()
    cockpit = Cockpit(list(model.parameters()), quantities=[ParamNorm(linear(2)), Loss(linear(1))], model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {}
    for step in range(4):
        x = torch.randn(5, 6, dtype=DTYPE)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        expected[step] = [math.sqrt(sum(v * v for v in p.detach().flatten().tolist())) for p in model.parameters()]
        with cockpit(step, info={"loss": loss}):
            loss.backward()
        optimizer.step()
    output = cockpit.get_output()
    assert [s for s in output if "ParamNorm" in output[s]] == [0, 2]
    for step in (0, 2):
        np.testing.assert_allclose(output[step]["ParamNorm"], expected[step], rtol=1e-13)


def test_conv_units_are_channel_pixels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 2)).to(DTYPE)
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([-50.0, 50.0], dtype=DTYPE))  # channel 0 dead, channel 1 alive
    cockpit = Cockpit(list(model.parameters()), quantities=[ActivationStats(linear(1))], model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(torch.randn(3, 1, 6, 6, dtype=DTYPE)).pow(2).mean()
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    stats = cockpit.get_output()[0]["ActivationStats"]["1"]
    assert stats["units"] == 2 * 4 * 4
    assert stats["dead_fraction"] == 0.5 and stats["zero_fraction"] == 0.5


def test_model_found_at_its_first_forward_pass():
    model = _model()
    cockpit = Cockpit(list(model.parameters()), quantities=[ActivationStats(linear(1))])  # no model=
    x = torch.randn(5, 6, dtype=DTYPE)
    loss = model(x).pow(2).mean()
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    _assert_close(cockpit.get_output()[0]["ActivationStats"], _reference(model, [x]))


def _swish_model(seed: int = 0) -> nn.Sequential:
    """SiLU, Mish and Hardswish, in place or not, and Hugging Face's GELU / SiLU modules (no transformers import:
    stand-ins named as its classes, from a module named as its own)."""
    torch.manual_seed(seed)
    fake = type("GELUActivation", (nn.GELU,), {"__module__": "transformers.activations"})
    fake_silu = type("SiLUActivation", (nn.Module,), {
        "__module__": "transformers.activations", "forward": lambda self, x: nn.functional.silu(x)})
    model = nn.Sequential(
        nn.Linear(6, 8), nn.SiLU(),
        nn.Linear(8, 8), nn.SiLU(inplace=True),
        nn.Linear(8, 7), nn.Mish(),
        nn.Linear(7, 7), nn.Hardswish(inplace=True),
        nn.Linear(7, 6), fake_silu(),
        nn.Linear(6, 5), fake(),
        nn.Linear(5, 3),
    ).to(DTYPE)
    with torch.no_grad():  # large weights and negative biases: some units beyond the bounds
        for layer in model:
            if isinstance(layer, nn.Linear):
                layer.weight.mul_(6.0)
                layer.bias.fill_(-4.0)
    return model


def _swish_reference(model: nn.Sequential, batches: list[torch.Tensor]) -> dict:
    """By the definitions: SiLU / Mish off where the input is at most -6, Hardswish and GELU where it is at most -3."""
    bounds = {nn.SiLU: -6.0, nn.Mish: -6.0, nn.Hardswish: -3.0}
    x, found = torch.cat(batches), {}
    with torch.no_grad():
        for index, layer in enumerate(model):
            pre = x.clone()
            x = layer(x.clone())
            name = type(layer).__name__
            if isinstance(layer, nn.Linear):
                continue
            bound = -3.0 if name == "GELUActivation" else -6.0 if name == "SiLUActivation" else bounds[type(layer)]
            kind = "gelu" if name == "GELUActivation" else "hardswish" if bound == -3.0 else "silu"
            off = pre <= bound
            found[str(index)] = {
                "kind": kind, "units": x.shape[1], "samples": x.shape[0], "rms": x.pow(2).mean().sqrt().item(),
                "zero_fraction": off.double().mean().item(), "dead_fraction": off.all(dim=0).double().mean().item(),
            }
    return found


def test_silu_mish_hardswish_and_hugging_face_modules_match_their_definitions():
    model = _swish_model()
    cockpit = Cockpit(list(model.parameters()), quantities=[ActivationStats(linear(1))], model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    for step in range(2):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step), dtype=DTYPE)
        twin = _swish_model()
        twin.load_state_dict(model.state_dict())
        expected = _swish_reference(twin, [x])
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        with cockpit(step, info={"loss": loss, "batch_size": 16}):
            loss.backward()
        optimizer.step()
        _assert_close(cockpit.get_output()[step]["ActivationStats"], expected)
    stored = cockpit.get_output()[0]["ActivationStats"]
    assert {v["kind"] for v in stored.values()} == {"silu", "hardswish", "gelu"}
    # the set-up reaches both sides of every bound (the in-place ones included)
    for layer in ("1", "3", "5", "7", "9"):
        assert 0 < stored[layer]["zero_fraction"] < 1, (layer, stored[layer])
