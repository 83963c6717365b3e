"""Loops whose optimizer step is not one plain backward pass before ``optimizer.step()`` (found outside the
repository's tests): a forgotten ``zero_grad`` and SAM with curvature quantities, LBFGS's closure, and parameters
or gradients changed between the tracked block and ``optimizer.step()``."""

import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Alpha")
DT = torch.float64


def mlp(extended):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DT)
    return extend(model) if extended else model


def batch(seed=1, rows=8):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, dtype=DT, generator=generator), torch.randint(0, 4, (rows,), generator=generator)


def cockpit_for(model, extended, quantities):
    return Cockpit(model.parameters(), quantities=quantities, **({} if extended else {"model": model}))


def info_of(outputs, y, optimizer):
    """The step's info; ``info["loss"]`` from BackPACK's extended loss module (its second-order extensions
    start there), equal to the mean of the rows' losses."""
    losses = nn.functional.cross_entropy(outputs, y, reduction="none")
    loss = extend(nn.CrossEntropyLoss())(outputs, y)
    return {"batch_size": len(y), "individual_losses": losses, "loss": loss, "optimizer": optimizer}


@pytest.mark.parametrize("extended", [True, False])
def test_a_forgotten_zero_grad_with_curvature_fails_the_step_without_running_the_curvature(extended):
    """The full preset and no zero_grad(): steps 1 and 2 end like economy's (invalid, stale_gradient, one
    gradients-accumulate finding); the Hessian-vector products never run on the stale p.grad, whose graph the
    optimizer's in-place update has broken (before: a RuntimeError from the curvature engine)."""
    model = mlp(extended)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = cockpit_for(model, extended, configuration("full"))
    x, y = batch()
    for step in range(3):
        info = info_of(model(x), y, optimizer)  # forgot: optimizer.zero_grad()
        with cockpit(step, info=info):
            info["loss"].backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    output = cockpit.get_output()
    assert cockpit.checks[0]["valid"] and "HessMaxEV" in output[0]
    for step in (1, 2):
        assert [f["check"] for f in cockpit.invalid_steps[step]] == ["stale_gradient"]
        assert "zero_grad" in cockpit.invalid_steps[step][0]["reason"]
        assert set(output[step]) <= {"checks", "findings", "UpdateSize", "Alpha"}
    assert [(f.rule, f.step) for f in cockpit.findings] == [("gradients-accumulate", 1)]


@pytest.mark.parametrize("extended", [True, False])
def test_sam_with_both_passes_in_the_block_and_curvature_ends_invalid_without_a_crash(extended):
    """SAM, both backward passes inside ``with cockpit(step)``, the full preset: every step invalid with its
    reason (step 0 withdrawn as accumulating, then the gradient check), no curvature on the graph the perturbation
    invalidated, and (BackPACK) both passes leave the same curvature buffers (before: a RuntimeError from the
    curvature engine, then a PartitionError from the GGN diagonal added to the second pass only)."""
    model = mlp(extended)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    cockpit = cockpit_for(model, extended, configuration("full"))
    x, y = batch()
    for step in range(3):
        optimizer.zero_grad()
        info = info_of(model(x), y, optimizer)
        with cockpit(step, info=info):
            info["loss"].backward(create_graph=cockpit.create_graph(step))
        with torch.no_grad():
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            perturbation = [0.05 * p.grad / norm for p in params]
            for p, e in zip(params, perturbation):
                p.add_(e)
        optimizer.zero_grad()
        info = info_of(model(x), y, optimizer)
        with cockpit(step, info=info):
            info["loss"].backward(create_graph=cockpit.create_graph(step))
        with torch.no_grad():
            for p, e in zip(params, perturbation):
                p.sub_(e)
        optimizer.step()
    checks = cockpit.checks
    assert [f["check"] for f in checks[0]["failed"]] == ["backward_passes"]
    for step in (1, 2):
        assert [f["check"] for f in checks[step]["failed"]] == ["gradient"] and checks[step]["backward_passes"] == 2
        assert "HessMaxEV" not in cockpit.get_output().get(step, {})


# ---- LBFGS: an optimizer that evaluates its closure several times per step -----------------------------------
def _lbfgs(max_iter, with_optimizer, tracked=True):
    model = mlp(True)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=max_iter)
    cockpit = cockpit_for(model, True, configuration("economy")) if tracked else None
    x, y = batch()
    calls = {}
    for step in range(3):
        def closure():
            calls[step] = calls.get(step, 0) + 1
            optimizer.zero_grad()
            info = info_of(model(x), y, optimizer)
            if not with_optimizer:
                del info["optimizer"]
            if cockpit is None:
                info["loss"].backward()
            else:
                with cockpit(step, info=info):
                    info["loss"].backward(create_graph=cockpit.create_graph(step))
            return info["loss"]

        optimizer.step(closure)
    return cockpit, calls, [p.detach().clone() for p in model.parameters()]


def _steps_in_closures(model, optimizer, cockpit, x, y, steps=3, before=None):
    """``steps`` optimizer steps, each ``optimizer.step(closure)`` with the cockpit's block in the closure (as
    Lightning's automatic optimization); ``before(step)`` runs in the closure before its forward pass."""
    for step in range(steps):
        def closure():
            optimizer.zero_grad()
            if before is not None:
                before(step)
            info = info_of(model(x), y, optimizer)
            with cockpit(step, info=info):
                info["loss"].backward()
            return info["loss"]

        optimizer.step(closure)


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_lbfgs_with_several_evaluations_per_step_is_invalid_and_says_why(with_optimizer):
    """LBFGS(max_iter=3), the closure's backward pass in the cockpit's block: no crash (before: TypeError from the
    look-ahead calling LBFGS.step() without a closure), every step invalid with one failed entry that names the
    cause (with info['optimizer']) or mentions it, the closure's evaluations counted, and the run unchanged."""
    cockpit, calls, params = _lbfgs(3, with_optimizer)
    _, plain_calls, plain = _lbfgs(3, with_optimizer, tracked=False)
    assert calls == plain_calls and all(torch.equal(a, b) for a, b in zip(params, plain))
    output = cockpit.get_output()
    for step in range(3):
        checks = cockpit.checks[step]
        assert not checks["valid"] and len(checks["failed"]) == 1, checks["failed"]
        assert checks["backward_passes"] == calls[step] == 3
        reason = checks["failed"][0]["reason"]
        if with_optimizer:
            assert checks["failed"][0]["check"] == "closure_evaluations"
            assert "LBFGS" in reason and "max_iter=1" in reason
        else:
            assert checks["failed"][0]["check"] == "backward_passes" and "LBFGS" in reason
        assert set(output[step]) == {"checks"}


def test_lbfgs_with_one_evaluation_per_step_is_tracked_exactly():
    """LBFGS(max_iter=1): one evaluation per step, valid steps whose gradient norms are the brute-force ones at the
    parameters of the evaluation (float64), and no parameter note (the block runs inside the optimizer's step)."""
    model = mlp(True)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=1)
    cockpit = cockpit_for(model, True, configuration("economy"))
    x, y = batch()
    expected = {}

    def reference(step):
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
        expected[step] = [float(g.norm()) for g in grads]

    _steps_in_closures(model, optimizer, cockpit, x, y, before=reference)
    output = cockpit.get_output()
    for step in range(3):
        notes = cockpit.checks[step]["notes"]
        assert cockpit.checks[step]["valid"] and all(n.startswith(f"Alpha of step {step - 1} is not stored") for n in notes)
        assert output[step]["GradNorm"] == pytest.approx(expected[step], rel=1e-12)
    assert "UpdateSize" in output[0] and "Distance" in output[2]
    # Alpha cannot look ahead with LBFGS (its step needs a closure): the update it assumed along the negative
    # gradient is not LBFGS's, so it stores no value and says so (before: an approximate one and a warning)
    assert "Alpha" not in output[1] and "LBFGS.step() needs a closure" in cockpit.checks[2]["notes"][0]


# ---- parameters or gradients changed between the tracked block and optimizer.step() -------------------------
def _sam(tracked_pass):
    """SAM with the cockpit around the first backward pass (at theta) or the second (at theta + e); the
    perturbation is removed after the block, before optimizer.step(). The parameters before each step."""
    model = mlp(True)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    cockpit = cockpit_for(model, True, configuration("economy"))
    x, y = batch()
    thetas = []

    def one_pass(step, tracked):
        info = info_of(model(x), y, optimizer)
        if tracked:
            with cockpit(step, info=info):
                info["loss"].backward()
        else:
            info["loss"].backward()

    for step in range(3):
        thetas.append([p.detach().clone() for p in params])
        optimizer.zero_grad()
        one_pass(step, tracked_pass == "first")
        with torch.no_grad():
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            perturbation = [0.05 * p.grad / norm for p in params]
            for p, e in zip(params, perturbation):
                p.add_(e)
        optimizer.zero_grad()
        one_pass(step, tracked_pass == "second")
        with torch.no_grad():
            for p, e in zip(params, perturbation):
                p.sub_(e)
        optimizer.step()
    thetas.append([p.detach().clone() for p in params])
    return cockpit, thetas


def test_parameters_changed_before_the_optimizer_step_withdraw_what_measures_them():
    """SAM tracking the perturbed pass: the optimizer steps from other parameters than the block saw. Before,
    UpdateSize (1-6% off ||theta_{t+1} - theta_t||) and Distance were stored as valid; now they and Alpha are
    withdrawn at every step with a note naming the cause, and the gradient quantities stay."""
    cockpit, _ = _sam("second")
    output = cockpit.get_output()
    for step in range(3):
        checks = cockpit.checks[step]
        assert checks["valid"] and len(checks["notes"]) == 1
        assert "parameters" in checks["notes"][0] and "SAM" in checks["notes"][0] and "UpdateSize" in checks["notes"][0]
        assert not {"Distance", "UpdateSize", "Alpha"} & set(output[step])
        assert {"GradNorm", "Loss", "NormTest"} <= set(output[step])


def _observation(model, theta, x, y):
    """What Alpha's definition reads at parameters ``theta``: the rows' losses and per-sample gradients (torch.func)."""
    from torch.func import functional_call, grad, vmap

    names = [name for name, _ in model.named_parameters()]
    params = dict(zip(names, theta))

    def row_loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    losses = nn.functional.cross_entropy(functional_call(model, params, (x,)), y, reduction="none").detach()
    grads = vmap(grad(row_loss), (None, 0, 0))(params, x, y)
    return {"params": theta, "grads": [grads[n] for n in names], "loss": losses.mean().item(), "losses": losses}


def test_gradients_changed_before_the_optimizer_step_are_noted_and_alpha_waits_for_the_step():
    """SAM tracking the first pass: the parameters are restored to the last bits (p.add_(e); p.sub_(e) counts as
    unchanged: UpdateSize equals the brute-force update to 1e-12), but the optimizer steps with the gradient of the
    second pass: a note says so (before: nothing, the check only ran for deferred steps) and Alpha, which predicted
    the update from the tracked gradient, is withdrawn at step 0. Before the fourth round it was withdrawn at every
    step; now it learns to wait for the optimizer's step and predicts from the gradient the optimizer gets (the
    quantities still describe the tracked pass's gradient, kept until then): Alpha of step 1 from its definition."""
    from tests.test_alpha import reference_alpha

    cockpit, thetas = _sam("first")
    output = cockpit.get_output()
    for step in range(3):
        checks = cockpit.checks[step]
        assert checks["valid"] and len(checks["notes"]) == 1 and "gradients changed" in checks["notes"][0]
        assert "Distance" in output[step]
    assert "Alpha" not in output[0] and "from the next tracked step on, Alpha waits" in cockpit.checks[0]["notes"][0]
    assert "kept until the optimizer's step" in cockpit.checks[1]["notes"][0]
    model, (x, y) = mlp(False), batch()  # not extended: torch.func runs it
    observed = [_observation(model, theta, x, y) for theta in thetas]
    assert output[1]["Alpha"] == pytest.approx(reference_alpha(observed[1], observed[2], len(y)), rel=1e-8)
    for step in range(2):
        true = [float((a - b).norm()) for a, b in zip(thetas[step + 1], thetas[step])]
        assert output[step]["UpdateSize"] == pytest.approx(true, rel=1e-12)
        distance = [float((a - b).norm()) for a, b in zip(thetas[step], thetas[0])]
        assert output[step]["Distance"] == pytest.approx(distance, rel=1e-12, abs=1e-15)
        gradient = [float(g.mean(0).norm()) for g in observed[step]["grads"]]  # the tracked (first) pass's
        assert output[step]["GradNorm"] == pytest.approx(gradient, rel=1e-10)


@pytest.mark.parametrize("clip", [False, True])
def test_a_plain_loop_and_clipping_by_the_norm_get_no_change_note(clip):
    """The checks at the optimizer step say nothing where nothing changed, or the gradients by one factor. With
    momentum, clipping changes the update's direction: Alpha's first start step stores no value (its note says
    why) and the next ones wait for the optimizer's step (their notes say the gradients were scaled)."""
    model = mlp(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    cockpit = cockpit_for(model, True, configuration("economy"))
    x, y = batch()
    for step in range(4):
        optimizer.zero_grad()
        info = info_of(model(x), y, optimizer)
        with cockpit(step, info=info):
            info["loss"].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
    output = cockpit.get_output()
    notes = [note for s in range(4) for note in cockpit.checks[s]["notes"]]
    assert all(cockpit.checks[s]["valid"] for s in range(4)) and not [n for n in notes if "changed between" in n]
    assert {"Alpha", "UpdateSize", "Distance"} <= set(output[0])
    if not clip:
        assert not notes
    else:  # momentum's first step has no buffer yet: the first update off the prediction is step 1's
        assert "Alpha" not in output[1] and "Alpha of step 1 is not stored" in cockpit.checks[2]["notes"][-1]
        assert "Alpha" in output[2] and "the gradients were scaled by" in cockpit.checks[2]["notes"][0]


def test_a_block_inside_the_optimizers_step_closure_gets_no_parameter_note():
    """SGD.step(closure) with the backward pass in the closure (Lightning's automatic optimization): the block runs
    inside the optimizer's step, also at the first step, whose hooks the block itself sets up; the update that
    follows is the optimizer's, not a change of the parameters behind its back."""
    model = mlp(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = cockpit_for(model, True, configuration("economy"))
    _steps_in_closures(model, optimizer, cockpit, *batch())
    output = cockpit.get_output()
    assert all(cockpit.checks[s]["valid"] and not cockpit.checks[s]["notes"] for s in range(3))
    assert {"Alpha", "UpdateSize", "Distance"} <= set(output[0])


@pytest.mark.parametrize("extended", [True, False])
def test_a_replaced_layer_counts_as_no_gradient_with_a_note(extended):
    """The head replaced by a new layer and the optimizer rebuilt at step 2 (found outside the tests): the cockpit
    still tracks the old head, whose p.grad holds step 1's gradient. Before: GradNorm stored that leftover at
    every later step and NormTest mixed it with the step's rows, on valid steps. Now the old head counts as zero
    (no_gradient), a note says why, and the rest is exact."""
    model = mlp(extended)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = cockpit_for(model, extended, configuration("economy"))
    for step in range(4):
        if step == 2:
            torch.manual_seed(3)
            model[2] = nn.Linear(8, 4).to(DT)
            if extended:
                model[2] = extend(model[2])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        x, y = batch(seed=10 + step)
        expected = [float(g.norm()) for g in torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model[0].parameters()))]
        optimizer.zero_grad()
        info = info_of(model(x), y, optimizer)
        with cockpit(step, info=info):
            info["loss"].backward()
        optimizer.step()
        checks = cockpit.checks.get(step, {"valid": True, "notes": [], "no_gradient": []})
        assert checks["valid"]
        norms = cockpit.get_output()[step]["GradNorm"]
        assert norms[:2] == pytest.approx(expected, rel=1e-10)
        if step >= 2:
            assert norms[2:] == [0.0, 0.0] and checks["no_gradient"] == ["2.weight", "2.bias"]
            assert "got nothing from this step's backward pass" in checks["notes"][0]


# ---- a step that goes non-finite: NaN compares as unchanged where it is the same -------------------------
@pytest.mark.parametrize("clip", [False, True])
def test_a_nan_step_gets_a_note_that_says_so_and_no_false_change_note(clip):
    """One NaN input at step 1 makes every gradient NaN, and the parameters NaN from step 2 on. Before, NaN compared
    unequal to itself: the notes said the gradients (step 1) and the parameters (step 2) changed between the backward
    pass and SGD.step() (SAM, clipping by value) and withdrew Alpha, Distance and UpdateSize. Now the NaN steps say
    their gradients are not finite, and how many entries; clipping by the norm (every entry NaN already: nothing
    changes where NaN is) adds nothing."""
    model = mlp(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = cockpit_for(model, True, configuration("economy"))
    for step in range(4):
        x, y = batch(step)
        if step == 1:
            x[2, 0] = float("nan")
        optimizer.zero_grad()
        info = info_of(model(x), y, optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the loss is NaN (said once per step)
            with cockpit(step, info=info):
                info["loss"].backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()
    notes = {s: cockpit.checks[s]["notes"] for s in range(4)}
    assert not [n for s in notes for n in notes[s] if "changed between" in n], notes
    assert not [n for n in notes[0] if "not finite" in n]
    entries = sum(p.numel() for p in model.parameters())
    for step in (1, 2, 3):
        assert f"the gradients of step {step} are not finite: {entries} of their {entries} entries" in notes[step][0]
    assert "Alpha of step 1 is not stored: the update from step 1 to 2 is not finite" in " ".join(notes[2])
    output = cockpit.get_output()
    assert {"Distance", "UpdateSize"} <= set(output[1]) and "Distance" in output[2]


def test_one_factor_is_read_at_the_scale_of_each_projections_rounding():
    """Clipping by the norm of float32 gradients whose projection the probe drew near 0: the projection holds the
    rounding of terms of the gradient's size, so it moved by 1e-4 of itself under one factor, and outside
    trial 14 saw "not by one factor" on 11 of 36 GPT runs that only called ``clip_grad_norm_``. The factor is read
    where it is precise and each projection compared at the scale of its rounding; a change of 1e-4 of the
    gradient's size is still a change."""
    from cockpit_like.checks.probe import probe_directions
    from cockpit_like.tracked_step import _fingerprint, _probe_seed, gradient_factor

    torch.manual_seed(0)
    params = [torch.randn(64, 256), torch.randn(64, 64), torch.randn(256)]
    for index, p in enumerate(params):
        grad = torch.randn(p.shape, dtype=torch.float64)
        directions = probe_directions(_probe_seed(0) + 1, index, p.shape, p.device)
        if index == 0:  # drawn (almost) at right angles to its direction: its projection is rounding
            u, v = directions
            grad -= (u @ grad @ v) / (u @ u * (v @ v)) * torch.outer(u, v)
        p.grad = grad.float()
    before = _fingerprint(params, 0)
    assert abs(before[0]) < 1e-4 * before.spreads[0]  # the case: a projection far below its spread
    for factor in (0.16208479, 0.0017491, 3.0):
        for p in params:
            p.grad.mul_(factor)
        found = gradient_factor(before, _fingerprint(params, 0))
        assert found == pytest.approx(factor, rel=1e-6)
        for p in params:
            p.grad.div_(factor)
        before = _fingerprint(params, 0)
    for index in range(3):  # a change of 1e-4 of one gradient's size, in any of them, is no factor
        saved = params[index].grad
        params[index].grad = saved + 1e-4 * saved.norm() / saved.numel() ** 0.5 * torch.randn(saved.shape)
        assert gradient_factor(before, _fingerprint(params, 0)) is None
        params[index].grad = saved


def test_prints_take_nan_at_the_same_places_as_unchanged_and_see_real_changes():
    """The comparisons behind the notes, on tensors with NaN and infinite entries: the same ones are unchanged (a
    factor scales the finite entries only); a NaN that moved, appeared or went, or a changed finite entry, is a
    change."""
    from cockpit_like.tracked_step import _fingerprint, gradient_factor, parameter_prints, parameters_moved

    torch.manual_seed(0)
    params = [torch.randn(5, 4, dtype=DT), torch.randn(5, dtype=DT)]
    for p in params:
        p.grad = torch.randn_like(p)
    params[0].grad[1, 2] = float("nan")
    params[1].grad[3] = float("inf")
    before = _fingerprint(params, 0)
    assert gradient_factor(before, _fingerprint(params, 0)) == 1.0
    for p in params:
        p.grad.mul_(0.5)  # clipping by the norm, GradScaler.unscale_
    assert gradient_factor(before, _fingerprint(params, 0)) == pytest.approx(0.5)
    moved = params[0].grad.clone()
    moved[1, 2], moved[0, 0] = 1.0, float("nan")
    for change in (moved, params[0].grad.nan_to_num(), params[0].grad.clamp(-0.1, 0.1)):
        saved, params[0].grad = params[0].grad, change
        assert gradient_factor(before, _fingerprint(params, 0)) is None
        params[0].grad = saved
    params[0].detach().fill_(float("nan"))
    prints = parameter_prints(params, 3)
    assert parameters_moved(params, 3, prints) == []
    with torch.no_grad():
        params[1][0] += 1.0
    assert parameters_moved(params, 3, prints) == [1]
    with torch.no_grad():
        params[0][0, 0] = 0.0  # a NaN went
    assert parameters_moved(params, 3, prints) == [0, 1]
