"""BackPACK's curvature diagonals in blocks of columns under the memory budget (cockpit_like.backends.column_blocks).

float64. The replay in blocks (down to one column per pass) must give what
BackPACK's own one-pass extension gives, on models with residual terms
(Tanh, Sigmoid, ELU: ``DiagHessian`` backpropagates a factor per activation),
convolutions, pooling, cross-entropy and mean squared error; and, independent
of BackPACK, the diagonal of the dense Hessian (``torch.func.hessian``). Through
the cockpit, ``memory_budget`` must not change any number (also with
micro-batches and a GradScaler-style loss scale, whose correction reads
``DiagGGNExact`` next to ``DiagHessian``), and a small budget must lower the
peak of live tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import DiagGGNExact, DiagHessian
from torch import nn
from torch.func import functional_call, hessian

from cockpit_like import Cockpit
from cockpit_like.backends.column_blocks import ColumnReplay, column_blocks
from cockpit_like.backends.conv_diagonals import diag_ggn_exact, diag_hessian
from cockpit_like.quantities import HessTrace, TICDiag
from cockpit_like.utils import schedules

ROOT = Path(__file__).resolve().parents[1]
DTYPE = torch.float64


def _model(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    torch.manual_seed(11)
    models = {
        # two curved activations: residual factors of both signs, and one below the other
        "tanh_sigmoid_mlp": (lambda: nn.Sequential(
            nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Sigmoid(), nn.Linear(5, 4),
        ), (6,), 4),
        # convolutions with an ELU (curved), a ReLU and max pooling
        "conv_elu": (lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ELU(), nn.Conv2d(3, 4, 2), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 5),
        ), (2, 7, 7), 5),
        # piecewise linear only: the loss's factor alone (BackPACK's AvgPool2d cannot run in float64)
        "relu_cnn": (lambda: nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.LeakyReLU(0.1), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(36, 6),
        ), (1, 10, 10), 6),
    }
    factory, shape, classes = models[name]
    return factory().to(DTYPE), shape, classes


def _data(shape, classes, batch, loss, seed=5):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, *shape, generator=generator, dtype=DTYPE)
    if loss == "ce":
        return inputs, torch.randint(0, classes, (batch,), generator=generator)
    return inputs, torch.randn(batch, classes, generator=generator, dtype=DTYPE)


def _lossfunc(loss):
    return nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss()


def _backpack_pass(model, lossfunc, inputs, targets, extension, budget=None):
    """``[p.<savefield>]`` from one backward pass: the extension itself, or its replay under ``budget``."""
    model.zero_grad()
    run, replay = extension, None
    if budget is not None:
        run, replay = column_blocks(extension, budget)
    loss = lossfunc(model(inputs), targets)
    with backpack(run):
        loss.backward()
    if replay is not None:
        replay.run()
    values = [getattr(p, extension.savefield).clone() for p in model.parameters()]
    for p in model.parameters():
        delattr(p, extension.savefield)
    return values, replay


@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("name", ["tanh_sigmoid_mlp", "conv_elu", "relu_cnn"])
@pytest.mark.parametrize("kind", ["diag_h", "diag_ggn_exact"])
def test_blocks_of_columns_equal_backpacks_one_pass(kind, name, loss):
    model, shape, classes = _model(name)
    model, lossfunc = extend(model), extend(_lossfunc(loss))
    inputs, targets = _data(shape, classes, 5, loss)
    plain = {"diag_h": DiagHessian, "diag_ggn_exact": DiagGGNExact}[kind]
    fast = {"diag_h": diag_hessian, "diag_ggn_exact": diag_ggn_exact}[kind]
    expected, _ = _backpack_pass(model, lossfunc, inputs, targets, plain())
    for extension in (plain(), fast()):
        whole, replay = _backpack_pass(model, lossfunc, inputs, targets, extension, budget=2**40)
        assert len(replay.blocks) == 1  # everything fits: BackPACK's own pass
        single, replay = _backpack_pass(model, lossfunc, inputs, targets, extension, budget=1)
        columns = sum(b - a for pieces in replay.blocks for _, a, b in pieces)
        assert all(sum(b - a for _, a, b in pieces) == 1 for pieces in replay.blocks)
        assert len(replay.blocks) == columns > 1
        for got_whole, got_single, want in zip(whole, single, expected):
            torch.testing.assert_close(got_whole, want, rtol=1e-10, atol=1e-13)
            torch.testing.assert_close(got_single, want, rtol=1e-10, atol=1e-13)


def test_the_residuals_are_sources_of_their_own_columns():
    """Tanh and Sigmoid each add a positive and a negative factor; one column per pass lists them all."""
    model, shape, classes = _model("tanh_sigmoid_mlp")
    model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    inputs, targets = _data(shape, classes, 4, "ce")
    _, replay = _backpack_pass(model, lossfunc, inputs, targets, diag_hessian(), budget=1)
    per_source = {}
    for pieces in replay.blocks:
        for label, a, b in pieces:
            per_source[label] = per_source.get(label, 0) + b - a
    # the cross-entropy's factor has C - 1 columns; each activation at most 2 x its features (signs)
    assert per_source["loss"] == classes - 1
    assert 0 < per_source["Tanh"] <= 2 * 7 and 0 < per_source["Sigmoid"] <= 2 * 5
    # a budget of three columns' worth packs them into passes of at most three columns
    widest = max(ColumnReplay._column_bytes(call) for call in _recorded_calls(model, lossfunc, inputs, targets))
    _, packed = _backpack_pass(model, lossfunc, inputs, targets, diag_hessian(), budget=3 * widest)
    sizes = [sum(b - a for _, a, b in pieces) for pieces in packed.blocks]
    assert max(sizes) == 3 and sum(sizes) == sum(per_source.values())


def _recorded_calls(model, lossfunc, inputs, targets):
    twin, replay = column_blocks(diag_hessian(), 1)
    model.zero_grad()
    with backpack(twin):
        lossfunc(model(inputs), targets).backward()
    calls = list(replay._calls)
    replay.run()
    return calls


def test_one_column_per_pass_equals_the_dense_hessian_diagonal():
    """Independent of BackPACK: the diagonal of torch.func.hessian of the mean loss, per parameter."""
    model, shape, classes = _model("tanh_sigmoid_mlp")
    inputs, targets = _data(shape, classes, 6, "ce")
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss_of(name):
        def f(value):
            return nn.functional.cross_entropy(functional_call(model, {**params, name: value}, (inputs,)), targets)

        return f

    expected = [torch.diagonal(hessian(loss_of(n))(p).reshape(p.numel(), p.numel())).reshape(p.shape) for n, p in params.items()]
    model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    got, _ = _backpack_pass(model, lossfunc, inputs, targets, diag_hessian(), budget=1)
    for value, want in zip(got, expected):
        torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-12)


def _cockpit_run(budget, micro_batches=1, scale=1.0, steps=2):
    model, shape, classes = _model("conv_elu")
    model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    individual = nn.CrossEntropyLoss(reduction="none")
    schedule = schedules.linear(1)
    quantities = [HessTrace(schedule, curvature="diag_h"), TICDiag(schedule, curvature="diag_ggn_exact")]
    cockpit = Cockpit(model.parameters(), quantities=quantities, memory_budget=budget)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 / scale)  # the same steps as without the scale
    batch = 6
    for step in range(steps):
        inputs, targets = _data(shape, classes, batch, "ce", seed=20 + step)
        optimizer.zero_grad()
        for part in range(micro_batches):
            rows = slice(part * batch // micro_batches, (part + 1) * batch // micro_batches)
            outputs = model(inputs[rows])
            loss = lossfunc(outputs, targets[rows])
            size = len(targets[rows])  # the micro-batch's (docs/your_training_loop.md)
            info = {"batch_size": size, "individual_losses": individual(outputs, targets[rows]), "loss": loss}
            if micro_batches > 1:
                info["micro_batches"] = micro_batches
            if scale != 1.0:
                info["loss_scale"] = scale
            with cockpit(step, info=info):
                (loss / micro_batches * scale).backward()  # the step's mean loss, scaled
        optimizer.step()
    return cockpit.get_output()


def test_the_budget_does_not_change_the_cockpits_numbers():
    whole, tiny = _cockpit_run(None), _cockpit_run(1)
    assert sorted(whole) == sorted(tiny) == [0, 1]
    for step in whole:
        for name in ("HessTrace", "TICDiag"):
            assert tiny[step][name] == pytest.approx(whole[step][name], rel=1e-10, abs=1e-14)


def test_the_budget_with_micro_batches_and_a_loss_scale():
    """The scaled-loss correction reads DiagGGNExact next to DiagHessian, both replayed in blocks."""
    reference = _cockpit_run(None)
    for budget in (None, 1):
        got = _cockpit_run(budget, micro_batches=2, scale=64.0)
        for step in reference:
            for name in ("HessTrace", "TICDiag"):
                assert got[step][name] == pytest.approx(reference[step][name], rel=1e-9, abs=1e-13)


def test_a_small_budget_lowers_the_peak_of_live_tensors():
    """A conv net with 40 classes: the one-pass factor ``[39, 16, 8, 16, 16]`` is 4 MB in float64, and the
    transposed convolution that applies a Jacobian to it builds a columns buffer 9x that. With a budget
    the replay stays within the budget of what one column (the least possible) needs."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.overhead import profiled_live_peak

    torch.manual_seed(0)
    model = extend(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 16 * 16, 40),
    ).to(DTYPE))
    lossfunc = extend(nn.CrossEntropyLoss())
    inputs, targets = _data((3, 16, 16), 40, 16, "ce")

    def peak(budget):
        return profiled_live_peak(lambda: _backpack_pass(model, lossfunc, inputs, targets, diag_hessian(), budget=budget))

    budget = 8 * 2**20
    whole, bounded, least = peak(2**40), peak(budget), peak(1)
    assert whole > 5 * budget  # ~110 MB
    assert bounded <= least + budget
    assert least < bounded  # the budget is used, not one column per pass
