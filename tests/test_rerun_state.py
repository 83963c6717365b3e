"""Re-running a module row by row (the torch.func fallback) leaves the user's run alone and computes the forward
pass's tensors: parametrizations with state (spectral_norm's power iteration), buffers a forward pass updates,
random draws inside a module.

Per-sample numbers against a loop of torch.autograd.grad over the rows of the step's own graph (float64)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from cockpit_like import Cockpit
from cockpit_like.backends.hooks import UncoveredParameterError
from cockpit_like.utils.configuration import configuration
from tests.helpers import row_stats_probe



class Counting(nn.Module):
    """No per-layer rule (re-run); counts its calls in a buffer and draws (unused) random numbers."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 6)
        self.scale = nn.Parameter(torch.ones(6))  # its own parameter: the module itself is re-run
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x)) * self.scale + 0.0 * torch.rand_like(x[:, :1])


def _spectral(iterations: int = 1, warm: int = 0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        parametrizations.spectral_norm(nn.Linear(5, 6), n_power_iterations=iterations), nn.Tanh(), nn.Linear(6, 3)
    ).double()
    with torch.no_grad():
        for _ in range(warm):
            model(torch.zeros(1, 5, dtype=torch.float64))
    return model


def _counting() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Counting(), nn.Linear(6, 3)).double()


def _batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, generator=generator, dtype=torch.float64), torch.randint(0, 3, (8,), generator=generator)


@pytest.mark.parametrize("iterations,warm", [(1, 0), (2, 0), (1, 30)])
def test_spectral_norm_per_sample_gradients_match_the_loop(iterations, warm):
    """The re-run computes the weight of the forward pass (power iteration from the vectors the call began
    with), so the per-sample gradients are the step's; cold vectors made the re-run differ before."""
    assert_rows_match_the_loop(_spectral(iterations, warm))


@pytest.mark.parametrize("parametrization", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("out_features", [8, 6], ids=["out_features_equal_rows", "other"])
def test_a_parametrized_weight_with_as_many_rows_as_the_batch(parametrization, out_features):
    """A parametrization computes the ``[out, in]`` weight from its own parameters, with no argument: at
    ``out == B`` its output's leading dimension is the batch size, yet no row reaches it. Its parameters climb
    to the parametrized Linear, whose re-run computes them row by row; the same numbers as the loop (before: at
    ``out == B`` the parametrization itself was re-run row by row, RuntimeError: Mismatch in shape)."""
    torch.manual_seed(0)
    layer = getattr(parametrizations, parametrization)(nn.Linear(5, out_features))
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(out_features, 3)).double()
    assert_rows_match_the_loop(model)


def assert_rows_match_the_loop(model: nn.Module) -> None:
    """The per-sample squared gradients and norms of one step (8 rows) are those of a loop of autograd.grad."""
    inputs, labels = _batch(0)
    params = list(model.parameters())
    probe = row_stats_probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe], model=model)
    losses = F.cross_entropy(model(inputs), labels, reduction="none")
    rows = [torch.autograd.grad(losses[i] / 8, params, retain_graph=True) for i in range(8)]
    loss = losses.mean()
    with cockpit(0, info={"loss": loss, "batch_size": 8}):
        loss.backward()
    squares, norms = probe.output[0]
    for k, got in enumerate(squares):
        torch.testing.assert_close(torch.as_tensor(got), sum(r[k] ** 2 for r in rows), rtol=1e-9, atol=1e-15)
    expected = torch.stack([sum(g.square().sum() for g in r) for r in rows])  # ||g_i / B||^2 over all parameters
    torch.testing.assert_close(torch.as_tensor(norms), expected, rtol=1e-9, atol=1e-15)


def _run(make, track: bool, steps: int = 3):
    """Parameters, buffers and the next torch.rand after ``steps`` SGD steps (economy preset if ``track``)."""
    model = make()
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model) if track else None
    for step in range(steps):
        inputs, labels = _batch(step)
        inputs = inputs + 0.01 * torch.rand(inputs.shape, dtype=torch.float64)  # the user's own draws
        optimizer.zero_grad()
        losses = F.cross_entropy(model(inputs), labels, reduction="none")
        loss = losses.mean()
        if cockpit is None:
            loss.backward()
        else:
            info = {"loss": loss, "individual_losses": losses, "batch_size": 8, "optimizer": optimizer}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            assert cockpit.get_output()[step]
        optimizer.step()
    state = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    return state, torch.rand(4)


@pytest.mark.parametrize("make", [_spectral, lambda: _spectral(1, 30), _counting], ids=["cold", "warm", "counting"])
def test_the_rerun_leaves_parameters_buffers_and_random_numbers_bitwise_alone(make):
    reference, tracked = _run(make, False), _run(make, True)
    assert len(reference[0]) == len(tracked[0])
    for expected, actual in zip(reference[0], tracked[0]):
        assert torch.equal(expected, actual), (expected - actual).abs().max()
    assert torch.equal(reference[1], tracked[1])


class _Jitter(nn.Module):
    """A parametrization that draws random numbers: no re-run can compute the forward pass's weight."""

    def forward(self, weight):
        return weight + 0.1 * torch.randn_like(weight)


def test_a_parametrization_the_rerun_cannot_reproduce_is_named():
    torch.manual_seed(0)
    layer = nn.Linear(5, 6).double()
    parametrize.register_parametrization(layer, "weight", _Jitter())
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(6, 3)).double()
    inputs, labels = _batch(0)
    cockpit = Cockpit(model.parameters(), quantities=[row_stats_probe(lambda step: True)], model=model)
    loss = F.cross_entropy(model(inputs), labels)
    with cockpit(0, info={"loss": loss, "batch_size": 8}):
        loss.backward()
    assert any(re.search(r"parametrizations .*parametrizations\.weight \(_Jitter\)", note)
               for note in cockpit.checks[0]["notes"])


@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_a_state_kept_by_the_forward_pass_is_the_users_after_a_re_run(as_buffer):
    """A module that keeps its last state (``self.state = h``) and reads it when set (RecurrentGemma's pattern):
    its re-run row by row was refused (the state holds the batch's rows), and the refused re-run left an escaped
    vmap tensor in the attribute, and the user's next read failed (seventh round of outside trials). The
    attribute (or buffer) is the forward pass's tensor afterwards, usable; and since outside trial 10 each re-run
    starts from the attribute as the call began (None here: the parent resets it), so the rows are exact."""
    from torch import nn

    from cockpit_like.backends.rerun import UncoveredParameterError
    from cockpit_like.quantities import NormTest

    class Scan(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.rand(5))
            if as_buffer:
                self.register_buffer("state", None)
            else:
                self.state = None

        def forward(self, x):
            h = self.state if self.state is not None else torch.zeros(x.shape[0], 5)
            for t in range(x.shape[1]):
                h = torch.sigmoid(self.a) * h + x[:, t]
            self.state = h
            return h

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.scan, self.head = Scan(), nn.Linear(5, 2)

        def forward(self, x):
            self.scan.state = None
            return self.head(self.scan(x))

    torch.manual_seed(0)
    model = Model().double()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(lambda s: True)], model=model)
    x, y = torch.randn(3, 4, 5, dtype=torch.float64), torch.randint(0, 2, (3,))
    params = list(model.parameters())
    rows = []
    for i in range(3):  # brute force: one row at a time (the parent resets the state before each)
        loss_i = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss_i, params)]))
    rows = torch.stack(rows)
    mean = rows.mean(0)
    expected = float(((rows - mean) ** 2).sum() / (2 * 3 * (mean @ mean))) ** 0.5
    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
    state = model.scan.state
    with cockpit(0, info={"batch_size": 3, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(expected, rel=1e-10)
    assert UncoveredParameterError is not None
    assert model.scan.state is state and float((model.scan.state + 1).sum()) == float((state + 1).sum())


class RunningScale(nn.Module):
    """A module of the user's own with a parameter and a floating buffer that ``forward`` reads, then updates
    (a running normaliser): its rows are independent, and its re-runs must start from the value the call began
    with (outside trial 8: refused at step 0, UncoveredParameterError, training stopped)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 3) * 0.3)
        self.register_buffer("running", torch.zeros(6))

    def forward(self, h):
        out = (h - self.running) @ self.weight  # a running mean taken off the inputs
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * h.mean(0))
        return out


def test_a_buffer_updated_after_use_in_forward_gives_the_loops_per_sample_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), RunningScale()).double()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        before = model[2].running.clone()
        optimizer.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        after = model[2].running.clone()
        info = {"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
        with cockpit(step, info=info):
            losses.mean().backward()
        assert torch.equal(model[2].running, after)  # the re-runs left the user's buffer as forward made it
        # the loop: each row's gradient with the buffer as the call began
        model.eval()
        model[2].running.copy_(before)
        rows = []
        for i in range(8):
            grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
        model.train()
        model[2].running.copy_(after)
        rows = torch.stack(rows)
        mean = rows.mean(0)
        expected = float((((rows - mean) ** 2).sum() / (7 * 8 * (mean @ mean))).sqrt())
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-10)
        optimizer.step()
