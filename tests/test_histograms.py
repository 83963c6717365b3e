"""GradHist1d / GradHist2d / bin adaptation against float64 brute force (numpy counting)."""

import warnings

import numpy as np
import pytest
import torch
from backpack import extend
from torch import nn

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


# ---- a step with NaN entries: not counted, and said so --------------------------------------------------
def _nan_factors(batch=6, out=5, width=9, ybins=7):
    """Linear-layer factors (ReLU-sparse: the sparse path applies) and a parameter with two NaN entries; the
    reference counts of the pairs that hold no NaN, and how many do."""
    gen = torch.Generator().manual_seed(3)
    x = torch.relu(torch.randn(batch, width, generator=gen, dtype=torch.float64))
    delta = torch.randn(batch, out, generator=gen, dtype=torch.float64) * (torch.rand(batch, out, generator=gen) < 0.6)
    theta = torch.randn(out, width, generator=gen, dtype=torch.float64)
    theta[1, 2] = theta[4, 0] = float("nan")
    return x, delta / batch, theta


@pytest.mark.parametrize("ybins", [7, 8])  # odd: a NaN's garbage bin index was out of range (an IndexError)
def test_hist2d_counter_leaves_out_pairs_with_a_nan_on_every_path(ybins, monkeypatch):
    """Before, a NaN gradient entry went to a garbage bin (x-bin 0 with an even ybins, an out-of-range index with
    an odd one) and a NaN parameter to y-bin 0. Now such pairs are not counted, on every path (dense, sparse,
    grad_batch; the listing path refuses a NaN parameter), and :meth:`dropped` says how many."""
    from cockpit_like.backends import fast_histograms
    from cockpit_like.backends.fast_histograms import Hist2dCounter, _Dominant2d

    monkeypatch.setattr(fast_histograms, "SPARSE_MIN_ENTRIES", 0)
    x, delta, theta = _nan_factors(ybins=ybins)
    batch = delta.shape[0]
    ranges = ((-0.3, 0.4), (-1.5, 1.5))
    counter = Hist2dCounter((5, ybins), ranges)
    assert _Dominant2d.plan(counter, x, delta, theta, force=True) is None
    for bad in (False, True):
        d = delta.clone()
        if bad:
            d[3, 1] = float("nan")  # sample 3's row 1 (its whole row of products)
        grad_batch = torch.einsum("no,ni->noi", d, x)
        values = grad_batch * batch
        nan_pairs = int((torch.isnan(values) | torch.isnan(theta).expand_as(values)).sum())
        expected = hist2d_counts(values, theta, (5, ybins), ranges)
        assert int(expected.sum()) == values.numel() - nan_pairs
        for count in (lambda c: counter.count_grad_batch(c, grad_batch, theta),
                      lambda c: counter.count_outer_dense(c, x, d, theta),
                      lambda c: counter.count_outer(c, x, d, theta, sparse=fast_histograms.SPARSE_SHARE),
                      lambda c: counter.count_outer(c, x, d, theta, dominant=True)):  # fmt: skip
            counts = counter.new_counts("cpu")
            count(counts)
            assert torch.equal(counter.finish(counts), expected)
            assert int(counter.dropped(counts)) == nan_pairs


def test_a_nan_step_leaves_nan_entries_out_of_both_histograms_and_a_note_says_how_many():
    """One NaN input row at step 1 (its per-sample gradients NaN), NaN parameters from step 2 on. Before, GradHist1d
    held 3 of 4 rows' counts silently and GradHist2d counted the NaN in a garbage bin (or raised with an odd number
    of y-bins). Now both hold the counts of the finite entries (torch.func's per-sample gradients, brute force) and
    a note says how many entries were not counted."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()  # torch.func's twin
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double())
    bins2d, ranges2d = (6, 7), ((-0.5, 0.5), (-1.0, 1.0))
    hist1d = GradHist1d(linear(1), bins=9, range=(-0.4, 0.4))
    hist2d = GradHist2d(linear(1), bins=bins2d, range=ranges2d)
    cockpit = Cockpit(model.parameters(), quantities=[hist1d, hist2d])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lossfunc, batch = extend(nn.CrossEntropyLoss()), 4
    refs = {}
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(batch, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=gen)
        if step == 1:
            x[2, 0] = float("nan")
        plain.load_state_dict(model.state_dict())
        refs[step] = (per_sample_grads(plain, x, y), [p.detach().clone() for p in model.parameters()])
        optimizer.zero_grad()
        out = model(x)
        info = {"batch_size": batch, "individual_losses": nn.functional.cross_entropy(out, y, reduction="none"),
                "loss": lossfunc(out, y)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info=info):
                info["loss"].backward()
        optimizer.step()
    entries = batch * sum(p.numel() for p in model.parameters())
    output = cockpit.get_output()
    for step, (grads, params) in refs.items():
        flat = np.concatenate([g.reshape(-1).numpy() for g in grads])
        pairs = [(g.reshape(-1).numpy(), p.unsqueeze(0).expand_as(g).reshape(-1).numpy()) for g, p in zip(grads, params)]
        nan_1d = int(np.isnan(flat).sum())
        nan_2d = sum(int((np.isnan(a) | np.isnan(b)).sum()) for a, b in pairs)
        assert (nan_1d, nan_2d) == {0: (0, 0), 1: (entries // batch,) * 2, 2: (entries, entries)}[step]
        np.testing.assert_array_equal(output[step]["GradHist1d"]["hist"], ref_hist1d(flat[~np.isnan(flat)], 9, -0.4, 0.4))
        expected = sum(ref_hist2d(a[~(np.isnan(a) | np.isnan(b))], b[~(np.isnan(a) | np.isnan(b))], bins2d, ranges2d)
                       for a, b in pairs)
        np.testing.assert_array_equal(output[step]["GradHist2d"]["hist"], expected)
        notes = cockpit.checks[step]["notes"]
        said = [n for n in notes if "not counted" in n]
        if step == 0:
            assert not said
        else:
            assert f"GradHist1d at step {step}: {nan_1d} per-sample gradient entries are NaN and not counted" in said[0]
            assert f"GradHist2d at step {step}: {nan_2d} pairs" in said[1]
