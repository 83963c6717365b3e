"""Alpha: float64 brute force for several optimizers, the 1-D quadratic, memory, look-ahead."""

import gc
import warnings

import numpy as np
import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.context import MissingInfoError
from cockpit_like.functional.alpha import alpha_from_observations
from cockpit_like.quantities import Alpha, UpdateSize
from cockpit_like.quantities.alpha import lookahead_update
from cockpit_like.utils.schedules import linear
from tests.helpers import make_batch, make_problem, per_sample_grads


class DecayingSignSGD(torch.optim.Optimizer):
    """A custom optimizer with non-tensor state: p -= lr / n * sign(grad)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                p.add_(torch.sign(p.grad), alpha=-group["lr"] / state["n"])


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.02),
    "custom": lambda ps: DecayingSignSGD(ps, lr=0.01),
}


def reference_alpha(start, end, batch_size):
    """Alpha from its definition; GLS solved by weighted lstsq (not the normal equations)."""
    d = torch.cat([(b - a).reshape(-1) for a, b in zip(start["params"], end["params"])])
    tau = d.norm().item()
    ys, variances = [], []
    for obs in (start, end):
        ys.append(obs["loss"])
        variances.append(obs["losses"].var().item())
    for obs in (start, end):
        g = torch.cat([x.reshape(batch_size, -1) for x in obs["grads"]], 1)
        u = g @ d / tau
        ys.append(u.mean().item())
        variances.append(u.var().item())
    phi = np.array([[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]], dtype=float)
    w = 1 / np.sqrt(np.array(variances))
    mu = np.linalg.lstsq(phi * w[:, None], np.array(ys) * w, rcond=None)[0]
    return -1 if mu[2] < 0 else 2 * tau / (-mu[1] / mu[2]) - 1


def run(problem, optimizer, schedule, steps, batch_size=6, bias=True, clip=None, quantities=(), after_step=None):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    opt = OPTIMIZERS[optimizer](model.parameters())
    alpha = Alpha(schedule)
    cockpit = Cockpit(model.parameters(), [alpha, *quantities])
    observed = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        for step in range(steps):
            inputs, labels = make_batch(problem, batch_size, seed=100 + step)
            grads = per_sample_grads(model, inputs, labels)
            opt.zero_grad()
            out = model(inputs)
            loss = lossfunc(out, labels)
            losses = individual(out, labels)
            observed[step] = {
                "params": [p.detach().clone() for p in model.parameters()],
                "grads": grads,
                "loss": loss.item(),
                "losses": losses.detach(),
            }
            info = {"batch_size": batch_size, "individual_losses": losses, "loss": loss, "optimizer": opt}
            with cockpit(step, info=info):
                loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if after_step is not None:
                after_step(step, model, alpha)
    run.cockpit = cockpit  # the last run's, for its checks
    return alpha, observed


def notes_of(cockpit):
    return {step: checks.get("notes", []) for step, checks in cockpit.checks.items() if checks.get("notes")}


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_matches_brute_force(problem, optimizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alpha, observed = run(problem, optimizer, linear(1), 4)
    assert not [w for w in caught if "Alpha" in str(w.message)]
    out = alpha.get_output()
    assert sorted(out) == [0, 1, 2]
    for step, value in out.items():
        expected = reference_alpha(observed[step], observed[step + 1], 6)
        assert float(value) == pytest.approx(expected, rel=1e-8, abs=1e-10)


@pytest.mark.parametrize("bias,batch_size", [(False, 3), (True, 9)])
def test_sparse_schedule_and_batch_sizes(bias, batch_size):
    alpha, observed = run("mlp", "adam", linear(2, offset=1), 5, batch_size=batch_size, bias=bias)
    out = alpha.get_output()
    assert sorted(out) == [1, 3]
    for step, value in out.items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], batch_size), rel=1e-8)


def test_clipping_with_sgd_is_exact_and_with_adam_learns_to_wait_for_the_step():
    # SGD: clipping rescales the update, the direction (all Alpha's slopes need) is unchanged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alpha, observed = run("mlp", "sgd", linear(1), 3, clip=1e-3)
    assert not [w for w in caught if "Alpha" in str(w.message)] and not notes_of(run.cockpit)
    for step, value in alpha.get_output().items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], 6), rel=1e-8)
    # Adam: clipping changes the direction of the update predicted from the unclipped gradient. Before, Alpha
    # stored an approximate value (its start slopes' variance along the predicted direction) with a warning;
    # now the first such step stores none and says why, and the later start steps wait for optimizer.step()
    # and predict the update from the clipped gradients: exact
    alpha, observed = run("mlp", "adam", linear(1), 6, clip=1e-3)
    notes = {s: [n for n in ns if "Alpha" in n] for s, ns in notes_of(run.cockpit).items()}
    notes = {s: ns for s, ns in notes.items() if ns}  # the waiting steps also say the gradients were scaled
    withdrawn = [step for step in range(5) if step not in alpha.get_output()]
    assert len(withdrawn) == 1 and list(notes) == [withdrawn[0] + 1]
    assert f"Alpha of step {withdrawn[0]} is not stored" in notes[withdrawn[0] + 1][0]
    assert "clipping" in notes[withdrawn[0] + 1][0] and "predicts the update when info['optimizer'] steps" in notes[withdrawn[0] + 1][0]
    assert sorted(alpha.get_output()) == [s for s in range(5) if s != withdrawn[0]]
    for step, value in alpha.get_output().items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], 6), rel=1e-8)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_a_loss_factor_is_learned_once_then_alpha_is_exact(optimizer):
    """``(3 * loss).backward()``: the optimizer steps on 3x the mean loss's gradient (found outside the tests:
    Alpha 1.9% off with momentum, 0.55% with Adam, on valid steps). At most the first step stores no Alpha."""
    model, lossfunc, individual = make_problem("mlp")
    opt = OPTIMIZERS[optimizer](model.parameters())
    alpha = Alpha(linear(1))
    cockpit = Cockpit(model.parameters(), [alpha])
    observed = {}
    for step in range(5):
        inputs, labels = make_batch("mlp", 6, seed=100 + step)
        observed[step] = {"params": [p.detach().clone() for p in model.parameters()], "grads": per_sample_grads(model, inputs, labels)}
        opt.zero_grad()
        out = model(inputs)
        loss, losses = lossfunc(out, labels), individual(out, labels)
        observed[step].update(loss=loss.item(), losses=losses.detach())
        with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": loss, "optimizer": opt}):
            (3.0 * loss).backward()
        opt.step()
    out = alpha.get_output()
    assert len(out) >= 3 and set(out) <= {0, 1, 2, 3}
    for step, value in out.items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], 6), rel=1e-8)
    notes = notes_of(cockpit)
    assert len([step for step, said in notes.items() if any("Alpha of step" in n for n in said)]) == 4 - len(out)
    # the undeclared factor is said at every step (GradNorm and the rows describe info["loss"], not p.grad)
    assert sorted(notes) == list(range(5)) and all(any("are 3 x those of the step's mean loss" in n for n in notes[s]) for s in notes)


def test_the_predicted_update_is_freed_at_the_optimizer_step():
    """Right after ``optimizer.step()`` Alpha keeps only the start parameters (one copy, shared with
    UpdateSize), its observations and the settled check: no predicted update or gradient sum through the
    next forward and backward pass. The update is made one parameter at a time; the values stay those
    of the brute-force twin."""
    from cockpit_like.quantities import alpha as alpha_module

    update_size = UpdateSize(linear(1))
    seen = []

    def after_step(step, model, alpha):
        keys = sorted(key for start, key in alpha.cached_keys() if start == step)
        kept = alpha.load_from_cache(step, "params")
        shared = update_size.load_from_cache(step, "params")
        seen.append((keys, all(a is b for a, b in zip(kept, shared))))

    alpha, observed = run("mlp", "adam", linear(1), 4, quantities=(update_size,), after_step=after_step)
    assert seen == [(["observations", "params", "prediction", "settled"], True)] * 4  # "prediction": a word
    steps = alpha_module._Steps([torch.ones(3), torch.zeros(2)], [torch.zeros(3), torch.ones(2)])
    assert steps._made is None  # one parameter at a time
    assert [s.tolist() for s in steps] == [[1.0, 1.0, 1.0], [-1.0, -1.0]] and len(steps) == 2
    for step, value in alpha.get_output().items():
        assert float(value) == pytest.approx(reference_alpha(observed[step], observed[step + 1], 6), rel=1e-8, abs=1e-10)


@pytest.mark.parametrize("optimizer,clip", [("adam", 1e-3), ("momentum", None)])
def test_settling_at_the_step_equals_checking_at_the_next_step(optimizer, clip, monkeypatch):
    """The check made right after ``optimizer.step()`` gives the numbers of the check made when the next
    step begins (an optimizer without a step post-hook: the predicted update and the gradient sum kept
    until then). With clipping and Adam both learn to wait for the optimizer's step; without the post-hook
    it is learned one step later (the next start step has begun), so one more value is not stored."""

    def outputs():
        alpha, _ = run("mlp", optimizer, linear(1), 5, clip=clip)
        return alpha.get_output()

    settled = outputs()
    monkeypatch.setattr(Alpha, "_watch_step", lambda self, start, optimizer: None)
    checked = outputs()
    assert set(checked) <= set(settled) and len(settled) - len(checked) == (clip is not None)
    assert {step: settled[step] for step in checked} == checked


@pytest.mark.parametrize("settled", [False, True])
def test_parameters_changed_after_the_step_store_no_alpha_and_say_why(settled, monkeypatch):
    """A change of the parameters after ``optimizer.step()`` (a projection) is not the predicted update
    (against the update settled at the optimizer's step, or checked at the next step where the optimizer
    has no step post-hook): Alpha stores no value there (before: an approximate one and a warning), and its
    note says why; waiting for the optimizer's step does not help, and the later notes say so."""
    if not settled:
        monkeypatch.setattr(Alpha, "_watch_step", lambda self, start, optimizer: None)

    def project(step, model, alpha):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)

    alpha, _ = run("mlp", "adam", linear(1), 4, after_step=project)
    assert alpha.get_output() == {}
    notes = notes_of(run.cockpit)
    assert sorted(notes) == [1, 2, 3] and all(len(n) == 1 and "Alpha of step" in n[0] for n in notes.values())
    if settled:  # the update was checked at the optimizer's step: the change came after it (named, in place)
        assert all("changed after optimizer.step()" in n[0] and "in place: all" in n[0] for n in notes.values())
    else:
        assert "changed outside optimizer.step()" in notes[3][0] and "although the look-ahead ran" in notes[3][0]


def test_missing_info_fails_before_backward():
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), [Alpha(linear(1))])
    inputs, labels = make_batch("mlp", 4, 0)
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(MissingInfoError, match=r"Alpha needs info\['individual_losses'\]"):
        with cockpit(0, info={"batch_size": 4, "loss": loss}):
            raise AssertionError("the body must not run")


def test_without_optimizer_warns_and_is_exact_for_sgd():
    model, lossfunc, individual = make_problem("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    alpha = Alpha(linear(1))
    cockpit = Cockpit(model.parameters(), [alpha])
    observed = {}
    with pytest.warns(UserWarning, match=r"no info\['optimizer'\]"):
        for step in range(2):
            inputs, labels = make_batch("mlp", 6, seed=step)
            observed[step] = {"params": [p.detach().clone() for p in model.parameters()], "grads": per_sample_grads(model, inputs, labels)}
            opt.zero_grad()
            out = model(inputs)
            loss = lossfunc(out, labels)
            losses = individual(out, labels)
            observed[step].update(loss=loss.item(), losses=losses.detach())
            with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": loss}):
                loss.backward()
            opt.step()
    assert float(alpha.get_output()[0]) == pytest.approx(reference_alpha(observed[0], observed[1], 6), rel=1e-8)


@pytest.mark.parametrize("how", ["skipped_step", "learning_rate_zero"])
def test_a_step_of_length_zero_stores_no_alpha_and_says_why(how):
    """A step whose update is 0 (the loop skipped ``optimizer.step()``, or a learning rate of 0 as in a warm-up's
    first step): Alpha = tau / x* - 1 is undefined there. It was stored as -1 (the concave value) with no note
    (outside trials, seventh round); now nothing, with a note, and the other steps' values are unchanged."""
    model, lossfunc, row_loss = make_problem("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model.parameters(), quantities=[Alpha(linear(1)), UpdateSize(linear(1))], model=model)
    for step in range(4):
        x, y = make_batch("mlp", 6, seed=step)
        for group in optimizer.param_groups:  # a schedule, set before the step's forward pass
            group["lr"] = 0.0 if (how == "learning_rate_zero" and step == 1) else 0.05
        optimizer.zero_grad()
        out = model(x)
        loss, losses = lossfunc(out, y), row_loss(out, y)
        with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": loss, "optimizer": optimizer}):
            loss.backward()
        if not (how == "skipped_step" and step == 1):
            optimizer.step()
    output = cockpit.get_output()
    assert all(u == 0.0 for u in output[1]["UpdateSize"])
    assert "Alpha" not in output[1]
    assert any("did not move from step 1 to 2" in note for note in cockpit.checks[2]["notes"]), cockpit.checks[2]
    assert all(isinstance(output[step]["Alpha"], float) and output[step]["Alpha"] != -1 for step in (0, 2))
