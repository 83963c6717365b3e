"""Shared per-sample statistics, and every gradient quantity alone vs. together with all others."""

import math
import warnings

import numpy as np
import pytest
import torch
from backpack import backpack
from backpack.extensions import BatchGrad

from cockpit_like import Cockpit, quantities
from cockpit_like.backends.per_sample import PerSampleReducer
from cockpit_like.backends.per_sample_stats import AbsMax, GramSummary, DirectionalDots, SumOfSquares
from cockpit_like.quantities.bin_adaptation import GradAbsMax, ParamAbsMax
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear, logarithmic
from tests.helpers import make_batch, make_problem, per_sample_grads, train

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def _assert_summary(summary, gram, **tol):
    """``GramSummary``'s ``(diag, row_sums)`` against a brute-force Gram matrix."""
    torch.testing.assert_close(summary[0], torch.diagonal(gram), **tol)
    torch.testing.assert_close(summary[1], gram.sum(1), **tol)


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("bias", [True, False])
def test_reductions_match_brute_force(problem, bias):
    model, lossfunc, _ = make_problem(problem, bias=bias)
    params = list(model.parameters())
    inputs, labels = make_batch(problem, 6, 3)
    grads = per_sample_grads(model, inputs, labels)
    direction = tuple(torch.randn_like(p) for p in params)
    stats = [GramSummary(), SumOfSquares(), AbsMax(), DirectionalDots("d", direction)]
    reducer = PerSampleReducer(stats, params, keep_grad_batch=False)
    with backpack(BatchGrad(), extension_hook=reducer):
        lossfunc(model(inputs), labels).backward()
    assert not any(hasattr(p, "grad_batch") for p in params)  # freed layer by layer
    result = reducer.results()
    flat = torch.cat([g.reshape(6, -1) for g in grads], 1) / 6  # grad_batch = g_i / B
    _assert_summary(result[GramSummary()], flat @ flat.T, rtol=1e-12, atol=1e-15)
    for s, g in zip(result[SumOfSquares()], grads):
        torch.testing.assert_close(s, (g / 6).pow(2).sum(0), rtol=1e-12, atol=1e-15)
    value, batch = result[AbsMax()]
    assert batch == 6 and batch * value.item() == pytest.approx(flat.abs().max().item() * 6, rel=1e-12)
    flat_d = torch.cat([d.reshape(-1) for d in direction])
    torch.testing.assert_close(result[DirectionalDots("d")], flat @ flat_d, rtol=1e-12, atol=1e-14)


def test_stats_merge_by_value():
    assert GramSummary() == GramSummary() and len({SumOfSquares(), SumOfSquares()}) == 1
    assert DirectionalDots("a", (torch.ones(1),)) == DirectionalDots("a", (torch.zeros(1),))
    assert DirectionalDots("a") != DirectionalDots("b")
    # MeanGSNR, CABS and EarlyStopping need one statistic between them
    schedule = linear(1)
    needs = {s for cls in (quantities.MeanGSNR, quantities.CABS, quantities.EarlyStopping) for s in cls(schedule).per_sample_stats(0)}
    assert needs == {SumOfSquares()}


OURS = {
    "Alpha": lambda s: quantities.Alpha(s),
    "NormTest": lambda s: quantities.NormTest(s),
    "InnerTest": lambda s: quantities.InnerTest(s),
    "OrthoTest": lambda s: quantities.OrthoTest(s),
    "MeanGSNR": lambda s: quantities.MeanGSNR(s),
    "CABS": lambda s: quantities.CABS(s),
    "EarlyStopping": lambda s: quantities.EarlyStopping(s),
    "GradHist1d": lambda s: quantities.GradHist1d(s, adapt=GradAbsMax(linear(2))),
    "GradHist2d": lambda s: quantities.GradHist2d(s, keep_individual=True, adapt=(GradAbsMax(linear(3)), ParamAbsMax(linear(2)))),
}


def _all_others(schedule):
    """Every other exported quantity with default arguments."""
    skip = {"Quantity", "SingleStepQuantity", "TwoStepQuantity", "ByproductQuantity", "Time", *OURS}
    return [getattr(quantities, name)(schedule) for name in quantities.__all__ if name not in skip]


def _run(problem, qs, steps=4):
    model, lossfunc, individual = make_problem(problem)
    cockpit = Cockpit(model.parameters(), quantities=qs)
    train(model, lossfunc, individual, cockpit, problem, steps, 5, torch.optim.SGD(model.parameters(), lr=0.2))
    return cockpit


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    else:
        assert float(a) == pytest.approx(float(b), rel=1e-10, abs=1e-13)


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("schedule", [linear(1), logarithmic(0, 1, 3)])
def test_alone_equals_together_with_all_others(problem, schedule):
    together = [make(schedule) for make in OURS.values()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. HessMaxEV convergence notes
        _run(problem, together + _all_others(schedule))
    for (name, make), joint in zip(OURS.items(), together):
        alone = make(schedule)
        _run(problem, [alone])
        assert alone.get_output(), name
        assert alone.get_output().keys() == joint.get_output().keys(), name
        for step in alone.get_output():
            _assert_same(alone.get_output()[step], joint.get_output()[step])


def test_economy_configuration_short_run(tmp_path):
    qs = configuration("economy")
    names = sorted(type(q).__name__ for q in qs)
    assert names == sorted(["Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest", "OrthoTest", "UpdateSize"])
    cockpit = _run("cnn", qs, steps=5)
    out = cockpit.get_output()
    assert sorted(out) == [0, 1, 2, 3, 4]
    for step in range(5):
        expected = set(names) - ({"Alpha", "UpdateSize"} if step == 4 else set())
        assert set(out[step]) - {"checks"} == expected
        for name in ("NormTest", "InnerTest", "OrthoTest"):
            assert math.isfinite(out[step][name])
    assert all(isinstance(out[s]["Alpha"], float) for s in range(4))
    path = cockpit.write(tmp_path / "economy")
    assert path.endswith(".json")


@pytest.mark.parametrize("batch,inp,out", [(4, 30, 20), (64, 3, 2), (7, 1, 1)])
def test_gram_summary_factor_routes_match_dense(batch, inp, out):
    """Both factor routes (the small Gram matrix when ``B (in + out) <= 2 in out``, else
    ``Delta^T X``) give the diagonal and row sums of the dense per-sample Gram matrix."""
    generator = torch.Generator().manual_seed(batch + inp)
    x = torch.randn(batch, inp, generator=generator, dtype=torch.float64)
    delta = torch.randn(batch, out, generator=generator, dtype=torch.float64)
    param = torch.zeros(out, inp, dtype=torch.float64)
    stat = GramSummary()
    dense = (delta.unsqueeze(2) * x.unsqueeze(1)).reshape(batch, -1)
    summary = stat.accumulate_factors(None, 0, param, "weight", x, delta)
    _assert_summary(summary, dense @ dense.T, rtol=1e-12, atol=1e-14)
    # accumulating a bias on top adds its Gram matrix
    summary = stat.accumulate_factors(summary, 1, param[:, 0], "bias", None, delta)
    _assert_summary(summary, dense @ dense.T + delta @ delta.T, rtol=1e-12, atol=1e-14)
