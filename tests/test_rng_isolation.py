"""The cockpit leaves the run alone: its random draws never touch torch's generators (issue 37, item 2).

A training loop with dropout and random data (``torch.rand`` / ``torch.randint``
in the loop) must give bitwise the same parameters, and the same next
``torch.rand``, with and without the cockpit, for every preset, on a model
BackPACK extends and on one it does not (hooks, Hutchinson's products). And a
quantity's value must not depend on which other quantities are tracked.
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends import randomness
from cockpit_like.quantities import HessMaxEV, HessTrace, KFACTrace, TICDiag, TICTrace
from cockpit_like.utils import schedules
from cockpit_like.utils.configuration import PRESETS, configuration
from tests.helpers import backward_in


class Residual(nn.Module):
    """Not a Sequential of supported layers: BackPACK's curvature cannot run, the hooks and products do."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(x + self.inner(x))))


def _model(kind: str):
    if kind == "extended":
        return extend(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3)))
    if kind == "extended, average pooling":
        # BackPACK's average-pooling derivatives built a convolution module (a random initial weight) per call
        return extend(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.AvgPool2d(3, stride=2, padding=1),
                                    nn.Flatten(), nn.Dropout(0.3), nn.Linear(18, 3)))  # fmt: skip
    return Residual()


def _run(kind: str, quantities_factory=None, steps: int = 3, calls: list | None = None):
    """Parameters after ``steps`` SGD steps, the next ``torch.rand``, and the cockpit (or None). ``calls``: a gradient
    hook on every parameter adds noise from the global generator and appends to it."""
    torch.manual_seed(0)
    model = _model(kind)
    if calls is not None:
        for p in model.parameters():
            p.register_hook(lambda g: calls.append(1) or g + 1e-9 * torch.randn_like(g))
    lossfunc = extend(nn.CrossEntropyLoss()) if kind.startswith("extended") else nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = None
    if quantities_factory is not None:
        cockpit = Cockpit(model.parameters(), quantities=quantities_factory(), model=model)
    for step in range(steps):
        inputs, labels = torch.rand(5, *((1, 5, 5) if "pooling" in kind else (6,))), torch.randint(0, 3, (5,))
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        if cockpit is None:
            loss.backward()
        else:
            info = {
                "loss": loss,
                "individual_losses": nn.functional.cross_entropy(outputs, labels, reduction="none"),
                "batch_size": 5,
                "optimizer": optimizer,
                "outputs": outputs,
            }
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], torch.rand(4), cockpit


def _assert_same_run(reference, run):
    for expected, actual in zip(reference[0], run[0]):
        assert torch.equal(expected, actual), (expected - actual).abs().max()
    assert torch.equal(reference[1], run[1])


@pytest.mark.parametrize("kind", ["extended", "not extended", "extended, average pooling"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_leaves_a_run_with_dropout_bitwise_alone(kind, preset):
    reference = _run(kind)
    tracked = _run(kind, lambda: configuration(preset))
    assert tracked[2].get_output()  # the cockpit did track something
    _assert_same_run(reference, tracked)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_users_gradient_hooks_run_only_in_the_users_backward_passes(preset):
    """``p.register_hook`` adding noise from the global generator: under business and full the hooks also ran in
    the cockpit's own backward passes (96 and 340 calls instead of 12), and the run changed (seventh round of
    outside trials). They now run once per parameter and backward pass, and the run is bitwise the same."""
    plain, tracked = [], []
    reference = _run("not extended", calls=plain)
    run = _run("not extended", lambda: configuration(preset), calls=tracked)
    assert len(tracked) == len(plain) == 3 * 4
    _assert_same_run(reference, run)


@pytest.mark.parametrize("graph", [False, True])
def test_backpack_monte_carlo_extensions_leave_the_run_alone_and_draw_per_step(graph):
    """DiagGGNMC and KFAC sample labels inside BackPACK from the global generator: seeded per step, restored
    (also at steps that keep the graph, where the extensions run as twins without autograd)."""
    schedule = schedules.linear(1)

    def quantities():
        extra = [HessMaxEV(schedule)] if graph else []
        return [HessTrace(schedule, curvature="diag_ggn_mc"), KFACTrace(schedule, curvature="kfac")] + extra

    reference = _run("extended")
    first, second = _run("extended", quantities), _run("extended", quantities)
    _assert_same_run(reference, first)
    # the draws are the cockpit's: the same run gives the same Monte-Carlo values
    assert first[2].get_output() == second[2].get_output()
    traces = [first[2].get_output()[step]["HessTrace"] for step in range(3)]
    assert traces[0] != traces[1]  # and not one fixed draw (different parameters, different labels)


def test_curvature_values_do_not_depend_on_the_other_quantities():
    """HessMaxEV (Lanczos probe) and Hutchinson's HessTrace give the same numbers alone and in the full preset."""
    schedule = schedules.linear(1)
    for kind in ("extended", "not extended"):
        alone = _run(kind, lambda: [HessMaxEV(schedule)])[2].get_output()
        full = _run(kind, lambda: configuration("full", schedule))[2].get_output()
        for step in range(3):
            assert alone[step]["HessMaxEV"] == full[step]["HessMaxEV"]
    hutchinson = _run("not extended", lambda: [HessTrace(schedule, curvature="hutchinson")])[2].get_output()
    with_others = _run(
        "not extended",
        lambda: [HessMaxEV(schedule), TICTrace(schedule, curvature="hutchinson"), HessTrace(schedule, curvature="hutchinson")],
    )[2].get_output()
    for step in range(3):
        assert hutchinson[step]["HessTrace"] == with_others[step]["HessTrace"]


def test_plain_power_iteration_leaves_the_run_alone():
    reference = _run("extended")
    _assert_same_run(reference, _run("extended", lambda: [HessMaxEV(schedules.linear(1), accelerate=False)]))


def test_the_cockpit_seed_changes_the_draws_and_nothing_else():
    schedule = schedules.linear(1)
    before = _run("not extended", lambda: [HessTrace(schedule, curvature="hutchinson")])
    try:
        randomness.set_seed(12345)
        after = _run("not extended", lambda: [HessTrace(schedule, curvature="hutchinson")])
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    _assert_same_run(before, after)
    assert before[2].get_output()[0]["HessTrace"] != after[2].get_output()[0]["HessTrace"]


def test_seeded_global_rng_restores_the_state_also_on_an_error():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    with pytest.raises(KeyError):
        with randomness.seeded_global_rng(randomness.derive_seed(0, "x")):
            inside = torch.rand(3)
            raise KeyError("inside")
    assert torch.equal(torch.rand(3), expected)
    with randomness.seeded_global_rng(randomness.derive_seed(0, "x")):
        assert torch.equal(torch.rand(3), inside)  # the same seed, the same draw
    with pytest.raises(ValueError, match="int"):
        randomness.set_seed("7")


def test_derived_seeds_differ_by_step_and_purpose():
    seeds = {randomness.derive_seed(step, purpose) for step in range(4) for purpose in ("a", "b")}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)


def test_sampling_hooks_draw_independently_per_backward_pass_and_reproducibly():
    """The seed of a sampling hook call: step, extension, call count and the module's input (micro-batches differ)."""
    from types import SimpleNamespace

    call = randomness._seeded_call(lambda self, module, g_inp, g_out: torch.rand(4))

    def hook_draw(inputs):
        twin = SimpleNamespace(_cockpit_step=3, _cockpit_calls=0)
        return call(twin, SimpleNamespace(input0=inputs), (), (torch.zeros(1),))

    torch.manual_seed(5)
    expected_next = torch.rand(2)
    torch.manual_seed(5)
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])
    assert torch.equal(hook_draw(first), hook_draw(first.clone()))
    assert not torch.equal(hook_draw(first), hook_draw(second))
    assert torch.equal(torch.rand(2), expected_next)  # the caller's stream untouched


class _Counting(nn.Module):
    """A module the cockpit re-runs row by row (its own parameter, no fast rule), whose forward pass keeps Python
    state: a call counter and a log on the module."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.calls, self.log, self.seen = 0, [], {}

    def forward(self, x):
        self.calls += 1
        self.log.append(x.shape[0])
        self.seen[self.calls] = True
        return x * self.scale


@pytest.mark.parametrize("preset", ["economy", "full"])
def test_the_users_module_hooks_and_forward_state_see_only_the_users_passes(preset):
    """Outside trial 8: a forward hook and a forward pass's counter saw 33 (economy) / 145 (full) calls in 4 steps
    (the cockpit's per-row re-runs), a full backward hook on a Linear 117 (the Hessian-vector products of the
    full preset). Now every count and log is the run's without the cockpit, and so are the parameters."""

    def run(with_cockpit):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), _Counting(6), nn.Tanh(), nn.Linear(6, 4)).double()
        log = {"forward": [], "backward": []}
        model[1].register_forward_hook(lambda m, i, o: log["forward"].append(float(o.detach().abs().sum())))
        model[0].register_full_backward_hook(lambda m, gi, go: log["backward"].append(float(go[0].abs().sum())))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model) if with_cockpit else None
        generator = torch.Generator().manual_seed(1)
        for step in range(4):
            x = torch.randn(6, 8, generator=generator, dtype=torch.float64)
            y = torch.randint(0, 4, (6,), generator=generator)
            optimizer.zero_grad()
            out = model(x)
            backward_in(cockpit, step, nn.functional.cross_entropy(out, y, reduction="none"), optimizer, out)
            optimizer.step()
        state = (model[1].calls, list(model[1].log), dict(model[1].seen))
        return [p.detach().clone() for p in model.parameters()], log, state, cockpit

    plain, tracked = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], tracked[0]))
    assert tracked[1] == plain[1] and tracked[2] == plain[2] == (4, [6, 6, 6, 6], {1: True, 2: True, 3: True, 4: True})
    assert all("NormTest" in values for values in tracked[3].get_output().values())  # the re-runs did run


def test_a_hook_that_changes_the_output_still_runs_in_the_reruns_and_observers_do_not():
    """A forward hook that returns a new output (and a pre-hook that returns new inputs) is part of the call: the
    re-runs call it (per-sample gradients exact against an autograd loop); an observing pre-hook does not see them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), _Counting(6), nn.Tanh(), nn.Linear(6, 4)).double()
    seen = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    model[1].register_forward_pre_hook(lambda m, args: (args[0] + 0.5,))
    model[1].register_forward_hook(lambda m, args, out: out * 2)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=generator, dtype=torch.float64), torch.randint(0, 4, (6,), generator=generator)
    for step in range(2):  # the hooks are guarded from the step after the cockpit learnt the model
        model.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    assert seen == [6, 6]  # the user's two calls; none of the re-runs'
    rows = []
    for i in range(6):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    rows = torch.stack(rows)
    mean = rows.mean(0)
    norm_test = float((((rows - mean) ** 2).sum() / (5 * 6 * (mean @ mean))).sqrt())
    assert cockpit.get_output()[1]["NormTest"] == pytest.approx(norm_test, rel=1e-10)
