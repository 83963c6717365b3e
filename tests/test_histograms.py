"""GradHist1d / GradHist2d / bin adaptation against float64 brute force (numpy counting)."""

import warnings

import numpy as np
import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.functional.histograms import hist1d_counts, hist2d_counts
from cockpit_like.quantities import GradHist1d, GradHist2d
from cockpit_like.quantities.bin_adaptation import GradAbsMax, ParamAbsMax
from cockpit_like.utils.schedules import linear
from tests.helpers import make_problem, per_sample_grads, train


def ref_hist1d(values, bins, lo, hi):
    """Clamp to [lo, hi]; bin floor((x - lo) bins / (hi - lo)), x = hi in the last bin."""
    x = np.clip(values, lo, hi)
    index = np.minimum(np.floor((x - lo) * bins / (hi - lo)).astype(int), bins - 1)
    return np.bincount(index, minlength=bins)


def ref_hist2d(x, y, bins, ranges):
    """Clamp to the end-bin centres, then numpy's histogram2d."""
    clipped = []
    for values, n, (lo, hi) in zip((x, y), bins, ranges):
        w = (hi - lo) / n
        clipped.append(np.clip(values, lo + w / 2, hi - w / 2))
    return np.histogram2d(clipped[0], clipped[1], bins=bins, range=ranges)[0].astype(np.int64)


def run(problem, quantities, steps=3, batch_size=5, bias=True, optimizer="sgd"):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    refs = {}

    def record(step, model, inputs, labels):
        refs[step] = (per_sample_grads(model, inputs, labels), [p.detach().clone() for p in model.parameters()])

    opt = torch.optim.SGD(model.parameters(), lr=0.5) if optimizer == "sgd" else torch.optim.Adam(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        train(model, lossfunc, individual, cockpit, problem, steps, batch_size, opt, record)
    return refs


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("bias,optimizer", [(True, "sgd"), (False, "adam")])
@pytest.mark.parametrize("bins,range_", [(100, (-2, 2)), (7, (-0.05, 0.1))])
def test_hist1d_matches_brute_force(problem, bias, optimizer, bins, range_):
    q = GradHist1d(linear(1), bins=bins, range=range_)
    refs = run(problem, [q], bias=bias, optimizer=optimizer)
    for step, value in q.get_output().items():
        grads = np.concatenate([g.reshape(-1).numpy() for g in refs[step][0]])
        np.testing.assert_array_equal(value["hist"], ref_hist1d(grads, bins, *range_))
        assert value["hist"].dtype == np.float64  # the gradients' dtype, as Cockpit
        assert value["hist"].sum() == grads.size
        np.testing.assert_allclose(value["edges"], np.linspace(*range_, bins + 1), rtol=1e-6, atol=1e-7)
        assert value["edges"].dtype == np.float32


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("keep_individual", [False, True])
def test_hist2d_matches_brute_force(problem, keep_individual):
    bins, ranges = (6, 9), ((-0.3, 0.2), (-0.5, 0.6))
    q = GradHist2d(linear(1), bins=bins, range=ranges, keep_individual=keep_individual)
    refs = run(problem, [q], batch_size=4)
    for step, value in q.get_output().items():
        grads, params = refs[step]
        per_block = []
        for g, p in zip(grads, params):
            x = g.reshape(-1).numpy()
            y = p.unsqueeze(0).expand_as(g).reshape(-1).numpy()
            per_block.append(ref_hist2d(x, y, bins, ranges))
        np.testing.assert_array_equal(value["hist"], sum(per_block))
        assert value["hist"].dtype == np.int64 and value["hist"].shape == bins
        assert isinstance(value["edges"], tuple) and value["edges"][1].dtype == np.float32
        if keep_individual:
            assert value["param_groups"] == len(params)
            for i, expected in enumerate(per_block):
                np.testing.assert_array_equal(value[f"param_{i}"]["hist"], expected)
        else:
            assert "param_groups" not in value


def test_grad_abs_max_adapts_from_next_histogram():
    padding = 0.1
    q = GradHist1d(linear(1), bins=10, adapt=GradAbsMax(linear(2), padding=padding))
    refs = run("mlp", [q], steps=4)
    out = q.get_output()
    np.testing.assert_allclose(out[0]["edges"][[0, -1]], [-2, 2])  # adaptation applies afterwards
    for step in (1, 2, 3):
        source = 2 * ((step - 1) // 2)  # last adaptation step before `step`
        extent = (1 + padding) * max(abs(g).max().item() for g in refs[source][0])
        np.testing.assert_allclose(out[step]["edges"][[0, -1]], [-extent, extent], rtol=1e-6)
        grads = np.concatenate([g.reshape(-1).numpy() for g in refs[step][0]])
        np.testing.assert_array_equal(out[step]["hist"], ref_hist1d(grads, 10, -extent, extent))


def test_hist2d_adaptation_both_axes_and_min_size():
    q = GradHist2d(linear(3), bins=(5, 5), adapt=(GradAbsMax(linear(1)), ParamAbsMax(linear(1), min_size=100.0)))
    refs = run("mlp", [q], steps=4)
    out = q.get_output()
    assert sorted(out) == [0, 3]  # adapters run at steps 1, 2 without storing a histogram
    grad_extent = max(abs(g).max().item() for g in refs[2][0])
    np.testing.assert_allclose(out[3]["edges"][0][[0, -1]], [-grad_extent, grad_extent], rtol=1e-6)
    np.testing.assert_allclose(out[3]["edges"][1][[0, -1]], [-50.0, 50.0])  # min_size / 2 wins


def test_invalid_arguments():
    with pytest.raises(ValueError, match="lo < hi"):
        GradHist1d(linear(1), range=(1, -1))
    with pytest.raises(ValueError, match="positive int"):
        GradHist1d(linear(1), bins=0)
    with pytest.raises(ValueError, match="pair"):
        GradHist2d(linear(1), bins=10)
    with pytest.raises(ValueError, match="padding"):
        GradAbsMax(linear(1), padding=-1)


def test_functional_clamping_rules():
    x = torch.tensor([-9.0, -1.0, 0.0, 0.99, 1.0, 9.0], dtype=torch.float64)
    assert hist1d_counts(x, 2, (-1, 1)).tolist() == [2, 4]
    counts = hist2d_counts(x, torch.zeros_like(x), (2, 1), ((-1, 1), (-1, 1)))
    assert counts.tolist() == [[2], [4]]
