"""HessTrace, TICDiag, TICTrace against dense float64 references; presets; schedules.

References are independent of BackPACK: the Hessian from ``torch.func.hessian``,
the GGN ``sum_n J_n^T H_n J_n`` from ``torch.func.jacrev`` and the analytic
cross-entropy Hessian of the mean loss, per-sample gradients from
``vmap(grad)``. The Monte-Carlo GGN is checked by replaying the torch RNG.
"""

import math

import pytest

from cockpit_like.backends.per_sample_stats import SumOfSquares
from cockpit_like.backends import randomness
import torch
from torch import nn
from torch.func import functional_call, jacrev

from cockpit_like import Cockpit, quantities
from cockpit_like.context import MissingInfoError
from cockpit_like.quantities import HessMaxEV, HessTrace, KFACTrace, TICDiag, TICTrace
from cockpit_like.quantities.curvature import UnknownCurvatureError
from cockpit_like.utils import schedules
from cockpit_like.utils.configuration import PRESETS, configuration
from tests.helpers import block_sizes, dense_hessian, make_batch, make_problem, mean_loss_fn, per_sample_grads, plain_copy, train

EPS = 1e-7
CASES = [("mlp", True, 5), ("mlp", False, 3), ("cnn", True, 4), ("cnn", False, 6)]


def dense_ggn(model, inputs, labels, output_sqrt=None):
    """``sum_n J_n^T H_n J_n`` (mean cross-entropy), or ``sum_n J_n^T s_n s_n^T J_n`` for given roots.

    ``output_sqrt``: ``[B, C]`` rows ``s_n`` (already scaled for the mean loss).
    """
    flat, unflatten, _ = mean_loss_fn(model, inputs, labels)
    model = plain_copy(model)

    def outputs(vector):
        return functional_call(model, unflatten(vector), (inputs,))

    jac = jacrev(outputs)(flat)  # [B, C, D]
    logits = outputs(flat).detach()
    batch = logits.shape[0]
    if output_sqrt is None:
        probs = logits.softmax(dim=1)
        hess_out = (torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]) / batch
        return torch.einsum("nci,ncd,ndj->ij", jac, hess_out, jac)
    proj = torch.einsum("nc,ncd->nd", output_sqrt, jac)
    return proj.T @ proj


def split(vector, model):
    return list(vector.split(block_sizes(model)))


def curvature_diag(curvature, model, inputs, labels):
    if curvature == "diag_h":
        return dense_hessian(model, inputs, labels).diagonal()
    return dense_ggn(model, inputs, labels).diagonal()


def tic_refs(diag, model, inputs, labels):
    grads = torch.cat([g.flatten(1) for g in per_sample_grads(model, inputs, labels)], dim=1)
    second_moment = (grads**2).mean(0)  # (1/B) sum_i g_ij^2
    tic_diag = (second_moment / (diag + EPS)).sum().item()
    tic_trace = (second_moment.sum() / (diag.sum() + EPS)).item()
    return tic_diag, tic_trace


def close(actual, expected, rtol=1e-9, atol=1e-12):
    assert actual == pytest.approx(expected, rel=rtol, abs=atol)


@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
@pytest.mark.parametrize("problem,bias,batch_size", CASES)
def test_against_dense_reference(problem, bias, batch_size, curvature):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    schedule = schedules.linear(1)
    qs = [
        HessTrace(schedule, curvature=curvature),
        TICDiag(schedule, curvature=curvature),
        TICTrace(schedule, curvature=curvature),
    ]
    cockpit = Cockpit(model.parameters(), quantities=qs)
    refs = {}

    def record(step, model, inputs, labels):
        diag = curvature_diag(curvature, model, inputs, labels)
        refs[step] = ([d.sum().item() for d in split(diag, model)], *tic_refs(diag, model, inputs, labels))

    train(model, lossfunc, individual, cockpit, problem, steps=3, batch_size=batch_size, record=record)
    output = cockpit.get_output()
    assert sorted(output) == [0, 1, 2]
    for step, (traces, tic_diag, tic_trace) in refs.items():
        values = output[step]
        assert isinstance(values["HessTrace"], list) and len(values["HessTrace"]) == len(traces)
        assert all(isinstance(v, float) for v in values["HessTrace"])
        for actual, expected in zip(values["HessTrace"], traces):
            close(actual, expected)
        assert isinstance(values["TICDiag"], float) and isinstance(values["TICTrace"], float)
        close(values["TICDiag"], tic_diag, rtol=1e-8)
        close(values["TICTrace"], tic_trace)


@pytest.mark.parametrize("problem,bias,batch_size", [("mlp", True, 6), ("cnn", False, 4)])
def test_diag_ggn_mc_by_replaying_the_rng(problem, bias, batch_size):
    """BackPACK draws one label per sample from Categorical(softmax(f_n)) during backward, in the loss
    module's hook (the extension's first hook call of the step), from the global generator that the cockpit
    seeds with ``derive_seed(step, "DiagGGNMC", 1, sum of the logits)`` for the call (and restores after it)."""
    model, lossfunc, individual = make_problem(problem, bias=bias)
    schedule = schedules.linear(1)
    qs = [HessTrace(schedule, curvature="diag_ggn_mc"), TICDiag(schedule, curvature="diag_ggn_mc")]
    cockpit = Cockpit(model.parameters(), quantities=qs)
    refs = {}

    def record(step, model, inputs, labels):
        with torch.no_grad():
            logits = model(inputs)
            probs = logits.softmax(dim=1)
        seed = randomness.derive_seed(step, "DiagGGNMC", 1, float(logits.sum()))
        torch.manual_seed(seed)
        sampled = torch.distributions.Categorical(probs).sample(torch.Size([1]))[0]
        roots = (probs - nn.functional.one_hot(sampled, probs.shape[1]).to(probs.dtype)) / math.sqrt(len(inputs))
        diag = dense_ggn(model, inputs, labels, output_sqrt=roots).diagonal()
        refs[step] = ([d.sum().item() for d in split(diag, model)], tic_refs(diag, model, inputs, labels)[0])

    train(model, lossfunc, individual, cockpit, problem, steps=3, batch_size=batch_size, record=record)
    output = cockpit.get_output()
    for step, (traces, tic_diag) in refs.items():
        for actual, expected in zip(output[step]["HessTrace"], traces):
            close(actual, expected)
        close(output[step]["TICDiag"], tic_diag, rtol=1e-8)


def test_diag_ggn_mc_differs_from_exact_but_agrees_in_expectation():
    """Averaged over many draws, the MC trace approaches the exact GGN trace."""
    model, lossfunc, _ = make_problem("mlp", bias=True)
    inputs, labels = make_batch("mlp", 8, seed=3)
    exact = dense_ggn(model, inputs, labels).diagonal().sum().item()
    mc = HessTrace(schedules.linear(1), curvature="diag_ggn_mc")
    cockpit = Cockpit(model.parameters(), quantities=[mc])
    torch.manual_seed(0)
    draws = 150
    for step in range(draws):
        model.zero_grad()
        loss = lossfunc(model(inputs), labels)
        with cockpit(step, info={"loss": loss}):
            loss.backward()
    totals = torch.tensor([sum(v) for v in mc.get_output().values()], dtype=torch.float64)
    assert totals.std() > 0  # it is random
    assert totals.mean().item() == pytest.approx(exact, rel=4 * totals.std().item() / math.sqrt(draws) / exact + 1e-3)


def test_tic_uses_info_batch_size():
    """B comes from info["batch_size"] (as in Cockpit): doubling it doubles TIC."""
    values = {}
    for factor in (1, 2):
        model, lossfunc, _ = make_problem("mlp")
        inputs, labels = make_batch("mlp", 4, seed=0)
        qs = [TICDiag(schedules.linear(1)), TICTrace(schedules.linear(1))]
        cockpit = Cockpit(model.parameters(), quantities=qs)
        loss = lossfunc(model(inputs), labels)
        with cockpit(0, info={"loss": loss, "batch_size": 4 * factor}):
            loss.backward()
        values[factor] = cockpit.get_output()[0]
    for key in ("TICDiag", "TICTrace"):
        close(values[2][key], 2 * values[1][key])


# ---- errors ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [HessTrace, TICDiag, TICTrace])
def test_unknown_curvature_is_a_clear_error(cls):
    with pytest.raises(UnknownCurvatureError) as info:
        cls(schedules.linear(1), curvature="diag_hessian")
    message = str(info.value)
    for name in ("diag_h", "diag_ggn_exact", "diag_ggn_mc", "diag_hessian", cls.__name__):
        assert name in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("cls", [TICDiag, TICTrace])
def test_tic_needs_batch_size(cls):
    model, lossfunc, _ = make_problem("mlp")
    inputs, labels = make_batch("mlp", 4, seed=0)
    cockpit = Cockpit(model.parameters(), quantities=[cls(schedules.linear(1))])
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(MissingInfoError) as info:
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    assert "batch_size" in str(info.value) and cls.__name__ in str(info.value)


def test_needs_declared_only_at_scheduled_steps():
    schedule = schedules.linear(3, offset=1)
    tic = TICDiag(schedule, curvature="diag_ggn_exact")
    assert tic.extensions(0) == [] and tic.required_info(0) == set()
    names = sorted(type(e).__name__ for e in tic.extensions(4))
    assert names == ["DiagGGNExact"]
    assert tic.per_sample_stats(0) == [] and tic.per_sample_stats(4) == [SumOfSquares()]
    assert tic.required_info(4) == {"batch_size"}
    assert [type(e).__name__ for e in HessTrace(schedule).extensions(1)] == ["DiagHessian"]
    assert HessTrace(schedule, curvature="diag_ggn_mc").extensions(1)[0].get_num_mc_samples() == 1
    assert TICTrace(schedule, epsilon=1e-3).settings() == {"curvature": "auto", "computed_with": "diag_h", "epsilon": 1e-3}
    assert TICTrace(schedule, curvature="diag_h", epsilon=1e-3).settings() == {"curvature": "diag_h", "epsilon": 1e-3}


# ---- alone vs together, under schedules ----------------------------------------
SCHEDULES = {
    "linear": lambda: schedules.linear(2, offset=1),
    "log": lambda: schedules.logarithmic(0, 1, steps=4),
}


def _make(name, schedule):
    return {
        "HessTrace": lambda: HessTrace(schedule),
        "HessTraceGGN": lambda: HessTrace(schedule, curvature="diag_ggn_exact"),
        "TICDiag": lambda: TICDiag(schedule),
        "TICTrace": lambda: TICTrace(schedule, curvature="diag_ggn_exact"),
        "HessMaxEV": lambda: HessMaxEV(schedule),
        "HessMaxEVLanczos": lambda: HessMaxEV(schedule, use_power=False, rtol=1e-9),
        "KFACTrace": lambda: KFACTrace(schedule, curvature="kflr", damping=1e-2),
    }[name]()


NAMES = ["HessTrace", "HessTraceGGN", "TICDiag", "TICTrace", "HessMaxEV", "HessMaxEVLanczos", "KFACTrace"]


def _run(problem, quantities_list, steps):
    torch.manual_seed(7)
    model, lossfunc, individual = make_problem(problem)
    cockpit = Cockpit(model.parameters(), quantities=quantities_list)
    train(model, lossfunc, individual, cockpit, problem, steps=steps, batch_size=5)
    return [q.get_output() for q in quantities_list]


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == pytest.approx(b, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_alone_equals_together(problem, schedule_name):
    steps = 5
    make_schedule = SCHEDULES[schedule_name]
    expected_steps = [s for s in range(steps) if make_schedule()(s)]
    together = _run(problem, [_make(name, make_schedule()) for name in NAMES], steps)
    for name, output in zip(NAMES, together):
        assert sorted(output) == expected_steps, name
        (alone,) = _run(problem, [_make(name, make_schedule())], steps)
        _assert_same(output, alone)


# ---- presets -------------------------------------------------------------------
def _missing(label):
    return [name for name in PRESETS[label] if not hasattr(quantities, name)]


@pytest.mark.parametrize("label", ["business", "full"])
def test_preset_short_training_run(label):
    missing = _missing(label)
    if missing:
        pytest.skip(f"configuration({label!r}) needs {missing}, not in cockpit_like.quantities yet")
    qs = configuration(label)
    assert [type(q).__name__ for q in qs] == PRESETS[label]
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=qs)
    steps = 3
    torch.manual_seed(11)
    assert all(cockpit.create_graph(s) == (label == "full") for s in range(steps))
    train(model, lossfunc, individual, cockpit, "mlp", steps=steps, batch_size=6)
    output = cockpit.get_output()
    for step in range(steps - 1):  # the last step has no UpdateSize / Alpha yet
        assert set(PRESETS[label]) <= set(output[step]), step
    # the curvature entries agree with a standalone run
    reference = {}
    model, lossfunc, individual = make_problem("mlp")
    alone = [HessTrace(schedules.linear(1)), TICDiag(schedules.linear(1))]
    if label == "full":
        alone.append(HessMaxEV(schedules.linear(1)))
    cockpit_alone = Cockpit(model.parameters(), quantities=alone)
    torch.manual_seed(11)
    train(model, lossfunc, individual, cockpit_alone, "mlp", steps=steps, batch_size=6)
    for step in range(steps):
        reference = cockpit_alone.get_output()[step]
        for name in reference:
            _assert_same(output[step][name], reference[name])
