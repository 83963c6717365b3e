"""Gradient accumulation: the optimizer step is the unit of a tracked step.

A step of ``K`` micro-batches (each loss divided by ``K``, the cockpit entered
around each backward pass with the same step and ``info["micro_batches"] = K``)
must give every quantity of every preset exactly what one backward pass over
the concatenated batch gives (float64). The reference is an independent run:
a copy of the model, one pass over the same rows.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from cockpit_like import Cockpit
from cockpit_like.quantities import GradNorm, NormTest
from cockpit_like.utils.schedules import linear
from cockpit_like.utils.configuration import configuration
from tests.helpers import accumulated_steps, brute_force_step, assert_nested_close, make_batch, make_problem, zoo_or_helper_problem

STEPS, ROWS = 3, 8


_problem = zoo_or_helper_problem


def _run(name: str, preset: str, micro_batches: int, steps: int = STEPS, rows: int = ROWS, **cockpit_args):
    problem = _problem(name)
    model = problem[0]
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model, **cockpit_args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    # the same random vectors (HessMaxEV, Hutchinson) as the reference
    return accumulated_steps(cockpit, problem, optimizer, steps, rows, micro_batches, before_last=torch.manual_seed)


def _assert_close(actual, expected, where: str, rtol: float = 1e-8, atol: float = 1e-12):
    assert_nested_close(actual, expected, where, rtol, atol)


def _without_time(output):
    return {step: {k: v for k, v in values.items() if k != "Time"} for step, values in output.items()}


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("preset", ["economy", "business", "full"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder"])
def test_micro_batches_equal_one_pass(name, preset, micro_batches):
    """Every quantity of the preset over K micro-batches equals one pass over the concatenated rows."""
    if name == "encoder" and preset == "business" and micro_batches == 4:
        pytest.skip("covered by the other encoder cases (keeps the suite short)")
    reference = _without_time(_run(name, preset, 1))
    accumulated = _without_time(_run(name, preset, micro_batches))
    assert len(reference) == STEPS
    names = {key for values in reference.values() for key in values}
    expected = {"Alpha", "GradNorm", "NormTest", "InnerTest", "OrthoTest", "GradHist1d", "Loss"}
    assert expected <= names, names
    _assert_close(accumulated, reference, f"{name}/{preset}/K={micro_batches}")


def test_last_micro_batch_alone_differs():
    """The check above can fail: quantities of the last micro-batch alone differ from the step's."""
    one = _without_time(_run("mlp", "economy", 1))
    model, lossfunc, individual, batch = _problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    inputs, targets = batch(ROWS, 100)
    half = ROWS // 2
    loss = lossfunc(model(inputs[:half]), targets[:half]) / 2
    loss.backward()  # the first micro-batch outside the cockpit: the old way
    outputs = model(inputs[half:])
    loss = lossfunc(outputs, targets[half:])
    info = {"batch_size": half, "individual_losses": individual(outputs, targets[half:]), "loss": loss, "optimizer": optimizer}
    with cockpit(0, info=info):
        (loss / 2).backward()
    last_only = _without_time(cockpit.get_output())
    # issue 34: p.grad was not zero when the cockpit's backward pass began (it holds the first micro-batch): the
    # step fails its check, and no number is stored for it rather than a wrong one
    checks = last_only[0]["checks"]
    assert not checks["valid"] and checks["failed"][0]["check"] == "stale_gradient"
    assert "NormTest" not in last_only[0] and "GradNorm" not in last_only[0]
    assert one[0]["NormTest"] > 0


def test_nothing_tracked_before_the_last_micro_batch():
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = make_batch("mlp", 8, 0)
    for micro in range(3):
        outputs = model(inputs[micro * 2 : micro * 2 + 2])
        loss = lossfunc(outputs, labels[micro * 2 : micro * 2 + 2])
        info = {"batch_size": 2, "loss": loss, "individual_losses": individual(outputs, labels[micro * 2 : micro * 2 + 2]),
                "optimizer": optimizer, "micro_batches": 3}  # fmt: skip
        with cockpit(0, info=info):
            (loss / 3).backward()
        assert (0 in cockpit.get_output()) == (micro == 2)
    with torch.no_grad():
        expected = float(lossfunc(model(inputs[:6]), labels[:6]))
    assert cockpit.get_output()[0]["Loss"] == pytest.approx(expected, rel=1e-10)


def _step(cockpit, model, lossfunc, step, micro_batches, rows=2, **extra):
    inputs, labels = make_batch("mlp", rows, step)
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    losses = torch.nn.functional.cross_entropy(outputs, labels, reduction="none")
    info = {"batch_size": rows, "loss": loss, "individual_losses": losses, "micro_batches": micro_batches, **extra}
    with cockpit(step, info=info):
        (loss / micro_batches).backward()


def test_incomplete_step_is_a_clear_error():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))])
    _step(cockpit, model, lossfunc, 0, 3)
    with pytest.raises(RuntimeError, match=r"step 0 saw only 1 of its info\['micro_batches'\] = 3"):
        _step(cockpit, model, lossfunc, 1, 3)
    _step(cockpit, model, lossfunc, 2, 1)  # the cockpit goes on with the next step


def test_micro_batches_must_agree_and_be_positive():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))])
    with pytest.raises(ValueError, match="must be a positive int"):
        _step(cockpit, model, lossfunc, 0, 0)
    _step(cockpit, model, lossfunc, 0, 2)
    with pytest.raises(ValueError, match="pass the same number on every micro-batch"):
        _step(cockpit, model, lossfunc, 0, 3)


def test_unequal_micro_batches_are_refused():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))])
    _step(cockpit, model, lossfunc, 0, 2, rows=2)
    with pytest.raises(RuntimeError, match="has 3 rows, micro-batch 0 had 2"):
        _step(cockpit, model, lossfunc, 0, 2, rows=3)


def test_untracked_micro_batches_cost_nothing_and_keep_counting():
    """Steps no quantity is scheduled for: no statistics, and the step counter still follows micro-batches."""
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(2))])
    for step in range(4):
        for _ in range(2):
            _step(cockpit, model, lossfunc, step, 2)
    assert sorted(cockpit.get_output()) == [0, 2]


def test_a_micro_batch_that_fails_to_begin_abandons_the_step():
    """An error at begin (here a missing info key on the second micro-batch) drops the step's earlier
    micro-batches: the next step starts afresh instead of reporting an incomplete step."""
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))])
    _step(cockpit, model, lossfunc, 0, 2)
    inputs, labels = make_batch("mlp", 2, 9)
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(Exception, match="batch_size"):
        with cockpit(0, info={"loss": loss, "micro_batches": 2}):
            loss.backward()
    for micro in range(2):
        _step(cockpit, model, lossfunc, 1, 2)
    assert 1 in cockpit.get_output() and 0 not in cockpit.get_output()


def _extras():
    from cockpit_like.quantities import (
        ActivationStats,
        CurvatureStatistics,
        KFACTrace,
        MeanGSNR,
        ParamNorm,
        PreconditionedGradNorm,
        TICTrace,
    )

    every = linear(1)
    return [
        CurvatureStatistics(every), KFACTrace(every, curvature="empirical"), PreconditionedGradNorm(every, damping=1e-3),
        MeanGSNR(every), TICTrace(every), ParamNorm(every), ActivationStats(every),
    ]  # fmt: skip


@pytest.mark.parametrize("name, micro_batches", [("encoder", 2), ("layernorm_mlp", 4)])
def test_curvature_statistics_and_diagnosis_on_the_accumulated_step(name, micro_batches, monkeypatch):
    """KFAC statistics, the preconditioned gradient norm, GSNR, TIC and activation statistics over K micro-batches
    equal one pass, and the diagnosis (with its feeds, LearningRate, Momentum) reads the accumulated step: the
    same stored values, findings included, as one pass."""
    import tests.test_accumulation as this

    monkeypatch.setattr(this, "configuration", lambda preset: _extras())
    outputs = {}
    for k in (1, micro_batches):
        outputs[k] = _without_time(_run(name, "extras", k, steps=4, diagnose=True))
    names = {key for values in outputs[1].values() for key in values}
    assert {"CurvatureStatistics", "KFACTrace", "PreconditionedGradNorm", "MeanGSNR", "LearningRate"} <= names
    if name == "layernorm_mlp":  # GELU modules (the encoder's ReLU is functional, which ActivationStats cannot see)
        assert "ActivationStats" in names
    _assert_close(outputs[micro_batches], outputs[1], f"extras {name} K={micro_batches}")


def test_batch_size_must_count_the_individual_losses():
    """Passing the optimizer step's batch size with the micro-batch's losses (or any other mismatch) would
    scale the per-sample quantities silently (TIC by K): a clear error instead, naming both numbers."""
    from cockpit_like.quantities import TICTrace

    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[TICTrace(linear(1), curvature="diag_ggn_exact")])
    inputs, labels = make_batch("mlp", 4, 9)
    outputs = model(inputs[:2])
    loss = lossfunc(outputs, labels[:2])
    info = {"batch_size": 4, "individual_losses": individual(outputs, labels[:2]), "loss": loss, "micro_batches": 2}
    with pytest.raises(ValueError, match=r"batch_size'\] is 4 but info\['individual_losses'\] has 2 entries.*micro-batch"):
        with cockpit(0, info=info):
            (loss / 2).backward()
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": 3, "individual_losses": individual(outputs, labels), "loss": loss}
    with pytest.raises(ValueError, match="is 3 but .* has 4 entries"):
        with cockpit(1, info=info):
            loss.backward()


def _unequal_steps(cockpit, problem, optimizer, sizes, steps=STEPS, weighting="share", scaler=None, references=None):
    """Steps of ``sum(sizes)`` rows (the same batches as :func:`_run`'s) in micro-batches of ``sizes`` rows, each
    backpropagating its mean loss times ``weighting``: ``"share"`` (``B_k / B_step``, the step's mean loss) or
    ``"count"`` (``1 / K``: a mean of unequal micro-batches' means, not the step's mean loss). ``references``: a list
    that gets each step's :func:`~tests.helpers.brute_force_step` over its rows taken as one batch."""
    model, lossfunc, individual, batch = problem
    rows = sum(sizes)
    for step in range(steps):
        inputs, targets = batch(rows, 100 + step)
        if references is not None:
            references.append(brute_force_step(
                copy.deepcopy(model), lambda m, i: individual(m(inputs[i : i + 1]), targets[i : i + 1])[0], rows))
        optimizer.zero_grad()
        start = 0
        for micro, size in enumerate(sizes):
            part = slice(start, start + size)
            start += size
            outputs = model(inputs[part])
            loss = lossfunc(outputs, targets[part])
            info = {"batch_size": size, "individual_losses": individual(outputs, targets[part]), "loss": loss,
                    "optimizer": optimizer, "micro_batches": len(sizes)}  # fmt: skip
            if scaler is not None:
                info["grad_scaler"] = scaler
            weighted = loss * size / rows if weighting == "share" else loss / len(sizes)
            if micro == len(sizes) - 1:
                torch.manual_seed(step)  # the same random vectors (HessMaxEV, Hutchinson) as _run's
            with cockpit(step, info=info):
                (weighted if scaler is None else scaler.scale(weighted)).backward(create_graph=cockpit.create_graph(step))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return cockpit.get_output()


@pytest.mark.parametrize("preset", ["economy", "business", "full"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_unequal_micro_batches_weighted_by_their_rows_equal_one_pass(name, preset):
    """Found outside the tests (a sixth round, F5): micro-batches of 5, 4 and 3 rows, each backpropagating
    ``loss * B_k / B_step`` (the step's mean loss, as the Hugging Face Trainer's ``num_items_in_batch``), were
    refused with a PartitionError that asked for losses divided by the number of micro-batches. The seen factors
    are the micro-batches' shares of the rows: every quantity equals one pass over the 12 rows (float64)."""
    reference = _without_time(_run(name, preset, 1, rows=12))
    problem = _problem(name)
    model = problem[0]
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    brute = []
    accumulated = _without_time(_unequal_steps(cockpit, problem, optimizer, (5, 4, 3), references=brute))
    for step in range(STEPS):
        assert cockpit.checks[step]["valid"], cockpit.checks[step]
        # stored with the step (each micro-batch's factor, not the declared 1/3): its share of the 12 rows
        checks = accumulated[step].pop("checks")
        assert checks["loss_factor"] == pytest.approx([5 / 12, 4 / 12, 3 / 12], rel=1e-12)
    assert {"Alpha", "GradNorm", "NormTest", "InnerTest", "OrthoTest", "GradHist1d", "Loss"} <= set(accumulated[1])
    _assert_close(accumulated, reference, f"{name}/{preset}/unequal")
    for step, expected in enumerate(brute):  # and against per-sample gradients from a loop of autograd.grad
        _assert_close({k: accumulated[step][k] for k in expected}, expected, f"{name}/{preset}/unequal/brute {step}")


def test_unequal_micro_batches_under_a_grad_scaler_equal_one_pass():
    reference = _without_time(_run("mlp", "economy", 1, rows=12))
    problem = _problem("mlp")
    cockpit = Cockpit(problem[0].parameters(), quantities=configuration("economy"), model=problem[0])
    optimizer = torch.optim.SGD(problem[0].parameters(), lr=0.05, momentum=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    brute = []
    accumulated = _without_time(_unequal_steps(cockpit, problem, optimizer, (5, 4, 3), scaler=scaler, references=brute))
    for step in range(STEPS):
        assert cockpit.checks[step]["valid"], cockpit.checks[step]
        checks = accumulated[step].pop("checks")
        assert checks["loss_factor"] == pytest.approx([1024 * 5 / 12, 1024 * 4 / 12, 1024 * 3 / 12], rel=1e-12)
    _assert_close(accumulated, reference, "mlp/economy/unequal/GradScaler")
    for step, expected in enumerate(brute):
        _assert_close({k: accumulated[step][k] for k in expected}, expected, f"unequal/GradScaler/brute {step}")


def test_unequal_micro_batches_divided_by_their_count_are_refused_with_what_to_do():
    """``loss_k / K`` with unequal ``B_k`` is not the step's mean loss: refused, naming the weighting that is."""
    problem = _problem("mlp")
    cockpit = Cockpit(problem[0].parameters(), quantities=configuration("economy"), model=problem[0])
    optimizer = torch.optim.SGD(problem[0].parameters(), lr=0.05)
    with pytest.raises(RuntimeError, match=r"(?s)micro-batch 1 has 4 rows, micro-batch 0 had 5.*0\.333333 and "
                       r"0\.333333.*unequal micro-batches.*loss \* B_k / B_step"):  # fmt: skip
        _unequal_steps(cockpit, problem, optimizer, (5, 4, 3), steps=1, weighting="count")


@pytest.mark.parametrize("preset", ["business", "full"])
def test_unequal_micro_batches_on_an_extended_model_equal_one_pass(preset):
    """The same on a ``backpack.extend``ed model and loss module (BackPACK's buffers, linear in the mean loss, are
    the micro-batches' row-weighted means): the numbers of the 12 rows as one batch."""
    from backpack import extend

    def train(sizes):
        torch.manual_seed(0)
        model = extend(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double())
        lossfunc = extend(torch.nn.CrossEntropyLoss())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(50 + step)
            x, y = torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)
            optimizer.zero_grad()
            start = 0
            for micro, size in enumerate(sizes):
                part = slice(start, start + size)
                start += size
                outputs = model(x[part])
                loss = lossfunc(outputs, y[part])
                info = {"batch_size": size, "loss": loss, "optimizer": optimizer, "micro_batches": len(sizes),
                        "individual_losses": torch.nn.functional.cross_entropy(outputs, y[part], reduction="none")}
                if micro == len(sizes) - 1:
                    torch.manual_seed(step)
                with cockpit(step, info=info):
                    (loss * size / 12).backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
        assert all(cockpit.checks[step]["valid"] for step in range(STEPS)), cockpit.checks
        return {s: {k: v for k, v in values.items() if k != "checks"} for s, values in _without_time(cockpit.get_output()).items()}

    one, unequal = train((12,)), train((5, 4, 3))
    assert {"HessTrace", "TICDiag", "NormTest", "Alpha"} <= set(one[1])
    _assert_close(unequal, one, f"extended/{preset}/unequal")


def test_unequal_micro_batches_whose_factor_cannot_be_seen_are_refused():
    """Detached declarations: the weighting ``B_k / B_step`` cannot be seen, so unequal micro-batches are refused
    (the cockpit cannot tell ``loss * B_k / B_step`` from ``loss / K``), naming what to do."""
    model, lossfunc, individual, batch = _problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs, targets = batch(9, 100)
    with pytest.raises(RuntimeError, match=r"(?s)micro-batch 1 has 4 rows, micro-batch 0 had 5.*could not be "
                       r"seen.*loss \* B_k / B_step\) computed from info\['loss'\]"):  # fmt: skip
        for part in (slice(0, 5), slice(5, 9)):
            outputs = model(inputs[part])
            loss = lossfunc(outputs, targets[part])
            info = {"batch_size": len(targets[part]), "loss": float(loss.detach()), "optimizer": optimizer, "micro_batches": 2,
                    "individual_losses": individual(outputs, targets[part]).detach()}  # fmt: skip
            with cockpit(0, info=info):
                (loss * len(targets[part]) / 9).backward()


def test_zero_grad_inside_the_block_before_backward_is_not_stale():
    """``optimizer.zero_grad()`` called inside the block, before ``backward()``: p.grad was not zero when the block
    was entered but is when the backward pass begins (what the check is about). Every later step failed
    ``stale_gradient`` ("a forgotten optimizer.zero_grad()", seventh round of outside trials); it is read again when
    the backward pass begins, and the numbers are brute force's. A gradient still left at that point stays stale."""
    model, lossfunc, individual, batch = _problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))], model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        inputs, targets = batch(ROWS, step)
        twin = copy.deepcopy(model)
        expected = brute_force_step(twin, lambda m, i: individual(m(inputs[i : i + 1]), targets[i : i + 1]).sum(), ROWS)
        outputs = model(inputs)
        loss = lossfunc(outputs, targets)
        info = {"batch_size": ROWS, "individual_losses": individual(outputs, targets), "loss": loss}
        with cockpit(step, info=info):
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        assert cockpit.checks[step]["valid"], cockpit.checks[step]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected["NormTest"], rel=1e-6)
    # not zeroed at all: stale as before
    outputs = model(inputs)
    loss = lossfunc(outputs, targets)
    with cockpit(3, info={"batch_size": ROWS, "individual_losses": individual(outputs, targets), "loss": loss}):
        loss.backward()
    assert cockpit.checks[3]["failed"][0]["check"] == "stale_gradient"
