"""Histogram shortcuts for linear layers against enumeration and the references.

- 1-D, sorted blocks: ``Hist1dCounter.count_outer`` may sort each ``x_i``,
  cut it into blocks and count a block whose two ends share a bin in one go.
- 2-D, listing: ``Hist2dCounter.count_outer`` may enumerate only the products
  outside a band around zero and fill the bins next to zero from per-position
  sign counts (:class:`~cockpit_like.backends.fast_histograms._Dominant2d`).

Both must give counts identical to enumerating every product, to
``torch.histc`` / ``hist2d_counts`` on the materialised
``grad_batch = delta_i x_i^T`` and to per-sample gradients from
``torch.func``, on data that sits exactly on, just beside and far outside the
bin edges and the band's ends.
"""

import warnings

import numpy as np
import pytest
import torch

from backpack import extend

from cockpit_like import Cockpit
from cockpit_like.backends import fast_histograms
from cockpit_like.backends.fast_histograms import Hist1dCounter, Hist2dCounter, _Dominant2d, _SortedBlocks
from cockpit_like.functional.histograms import hist1d_counts, hist2d_counts
from cockpit_like.quantities import GradHist1d, GradHist2d
from cockpit_like.utils.schedules import linear
from tests.helpers import per_sample_grads, train

RANGES = [(100, (-2.0, 2.0)), (13, (-0.3, 0.5)), (7, (0.05, 0.4)), (9, (-0.4, 0.0))]


def _counts(x, delta, bins, range_, **kwargs):
    counter = Hist1dCounter(bins, range_, delta.dtype)
    counts = counter.new_counts("cpu")
    counter.count_outer(counts, x, delta, **kwargs)
    return Hist1dCounter.finish(counts, bins, delta.dtype)


def _reference(x, delta, bins, range_):
    return hist1d_counts(delta.shape[0] * torch.einsum("no,ni->noi", delta, x), bins, range_)


def _check(x, delta, bins, range_, blocks=(1, 2, 3, 5, 16, 64), chunks=(37, 1 << 16)):
    expected = _reference(x, delta, bins, range_)
    enumerated = _counts(x, delta, bins, range_, block=0, sparse=None)
    assert torch.equal(enumerated, expected)
    for block in blocks:
        for chunk in chunks:
            result = _counts(x, delta, bins, range_, block=block, chunk=chunk)
            assert torch.equal(result, expected), (block, chunk, (result - expected).nonzero().flatten().tolist())


def _factors(dtype, batch=12, out=9, width=35, seed=0, relu=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    x = torch.relu(x) if relu else x
    delta = torch.randn(batch, out, generator=gen, dtype=torch.float64) * (torch.rand(batch, out, generator=gen) < 0.6) / batch
    return x.to(dtype), delta.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins,range_", RANGES)
@pytest.mark.parametrize("relu", [False, True])
def test_blocks_equal_enumeration_and_reference(dtype, bins, range_, relu):
    x, delta = _factors(dtype, relu=relu)
    x = x * 3  # rows that cross many bins as well as rows that stay in one
    delta[2] = 0.0  # a sample without nonzero delta entries
    delta[4, :5] = -0.0
    x[5] = 0.0  # a sample whose products are all zeros
    x[6, ::2] = -0.0
    x[7, :10] = x[7, 0]  # ties inside and across blocks
    _check(x, delta, bins, range_)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins,range_", RANGES)
@pytest.mark.parametrize("sign", [1.0, -1.0, 3.0, -0.7])
def test_products_on_and_beside_the_edges(dtype, bins, range_, sign):
    """``B * delta * x`` equal to every bin edge, its neighbouring floats and values far outside."""
    lo, hi = range_
    edges = torch.linspace(lo, hi, bins + 1, dtype=dtype)
    values = torch.cat(
        [
            edges,
            torch.nextafter(edges, edges + 1),
            torch.nextafter(edges, edges - 1),
            torch.tensor([lo - 1, hi + 1, -1e30, 1e30, 0.0, -0.0], dtype=dtype),
        ]
    )
    batch = 4
    gen = torch.Generator().manual_seed(1)
    x = torch.stack([values[torch.randperm(values.numel(), generator=gen)] / sign for _ in range(batch)])
    delta = torch.full((batch, 3), sign / batch, dtype=dtype)  # B * delta * x = value (up to rounding if |sign| != 1)
    delta[1, 2] = 0.0
    delta[3, 0] = 2 * sign / batch
    _check(x, delta, bins, range_)


def test_products_that_overflow_are_clamped():
    x = torch.tensor([[1e30, -1e30, 0.5, 3e38], [2.0, -2.0, 1e-40, 0.0]], dtype=torch.float32)
    delta = torch.tensor([[1e20, -1e20], [1e10, 0.1]], dtype=torch.float32)
    assert torch.isinf(torch.einsum("no,ni->noi", delta, x)).any()
    _check(x, delta, 11, (-1.0, 1.0))


def test_non_finite_or_zero_factors_take_another_path():
    x, delta = _factors(torch.float64)
    counter = Hist1dCounter(13, (-0.3, 0.5), torch.float64)
    assert _SortedBlocks.plan(counter, x, delta, 4) is not None
    bad = x.clone()
    bad[2, 3] = float("inf")
    assert _SortedBlocks.plan(counter, bad, delta, 4) is None
    assert torch.equal(_counts(bad, delta, 13, (-0.3, 0.5), block=4), _reference(bad, delta, 13, (-0.3, 0.5)))
    nan = delta.clone()
    nan[1, 1] = float("nan")
    assert _SortedBlocks.plan(counter, x, nan, 4) is None
    assert torch.equal(_counts(x, nan, 13, (-0.3, 0.5), block=4), _reference(x, nan, 13, (-0.3, 0.5)))
    zeros = torch.zeros_like(delta)
    assert _SortedBlocks.plan(counter, x, zeros, 4) is None
    assert torch.equal(_counts(x, zeros, 13, (-0.3, 0.5), block=4), _reference(x, zeros, 13, (-0.3, 0.5)))


def test_automatic_choice():
    """Large layers with small gradients take the blocks; wide spans and small layers do not."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 400, generator=gen)
    delta = torch.randn(64, 32, generator=gen) * 1e-3
    assert delta.numel() * x.shape[1] >= fast_histograms.SORTED_MIN_ENTRIES
    counter = Hist1dCounter(100, (-2.0, 2.0), torch.float32)
    plan = _SortedBlocks.plan(counter, x, delta, None)
    assert plan is not None and fast_histograms.BLOCK_RANGE[0] <= plan.block <= fast_histograms.BLOCK_RANGE[1]
    assert torch.equal(_counts(x, delta, 100, (-2.0, 2.0)), _reference(x, delta, 100, (-2.0, 2.0)))
    fine = Hist1dCounter(10000, (-1e-3, 1e-3), torch.float32)  # every row crosses hundreds of edges
    assert _SortedBlocks.choose_block(fine, x, delta, int((delta != 0).sum(1).max())) is None
    assert _SortedBlocks.plan(fine, x, delta, None) is None
    assert torch.equal(_counts(x, delta, 10000, (-1e-3, 1e-3)), _reference(x, delta, 10000, (-1e-3, 1e-3)))
    assert _SortedBlocks.plan(counter, x[:4, :10], delta[:4], None) is None  # below SORTED_MIN_ENTRIES
    # sparse x: enumerating the few nonzero entries beats sorting
    sparse_x = x * (torch.rand(x.shape, generator=gen) < 0.01)
    assert _SortedBlocks.choose_block(counter, sparse_x, delta, int((delta != 0).sum(1).max())) is None


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("block,bins,range_", [(None, 100, (-2.0, 2.0)), (1, 30, (-0.3, 0.3)), (4, 30, (-0.3, 0.3))])
def test_relu_mlp_per_sample_gradients(bias, block, bins, range_, monkeypatch):
    """GradHist1d on a ReLU MLP, with the blocks forced on, equals counts of torch.func per-sample gradients."""
    monkeypatch.setattr(fast_histograms, "SORTED_MIN_ENTRIES", 0)
    chosen = []
    choose = _SortedBlocks.choose_block
    if block is None:
        monkeypatch.setattr(_SortedBlocks, "choose_block", staticmethod(lambda *a: chosen.append(choose(*a)) or chosen[-1]))
    else:
        monkeypatch.setattr(_SortedBlocks, "choose_block", staticmethod(lambda *a: chosen.append(block) or block))
    torch.manual_seed(0)
    nn = torch.nn
    model = extend(  # ReLU: sparse x, zero rows in delta; wide enough for the automatic choice
        nn.Sequential(nn.Flatten(), nn.Linear(12, 60, bias=bias), nn.ReLU(), nn.Linear(60, 40, bias=bias), nn.ReLU(), nn.Linear(40, 4, bias=bias))
    ).double()
    lossfunc, individual = extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none")

    q = GradHist1d(linear(1), bins=bins, range=range_)
    cockpit = Cockpit(model.parameters(), quantities=[q])
    refs = {}

    def record(step, model, inputs, labels):
        refs[step] = per_sample_grads(model, inputs, labels)

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        train(model, lossfunc, individual, cockpit, "mlp", 3, 8, opt, record)
    assert any(c is not None for c in chosen)
    for step, value in q.get_output().items():
        grads = torch.cat([g.reshape(-1) for g in refs[step]])
        np.testing.assert_array_equal(value["hist"], hist1d_counts(grads, bins, range_).numpy())


# ---- 2-D: listing the products outside the band around zero --------------------------------
RANGES_2D = [
    ((40, 50), ((-1.0, 1.0), (-2.0, 2.0))),  # zero on an x-edge
    ((41, 7), ((-0.3, 0.5), (-0.2, 0.2))),  # zero inside an x-bin
    ((9, 5), ((0.05, 0.4), (-1.0, 1.0))),  # zero below the x-range
    ((6, 3), ((-0.4, -0.1), (-1.0, 1.0))),  # zero above the x-range
    ((1, 4), ((-1.0, 1.0), (-1.0, 1.0))),  # one x-bin
]


def _check_2d(x, delta, theta, bins, ranges, chunks=(29, 1 << 16)):
    counter = Hist2dCounter(bins, ranges)
    assert _Dominant2d.plan(counter, x, delta, theta, force=True) is not None
    expected = hist2d_counts(delta.shape[0] * torch.einsum("no,ni->noi", delta, x), theta, bins, ranges)
    dense = counter.new_counts("cpu")
    counter.count_outer(dense, x, delta, theta, dominant=False)
    assert torch.equal(counter.finish(dense), expected)
    for chunk in chunks:
        counts = counter.new_counts("cpu")
        counter.count_outer(counts, x, delta, theta, chunk=chunk, dominant=True)
        result = counter.finish(counts)
        assert torch.equal(result, expected), (chunk, (result - expected).nonzero().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins,ranges", RANGES_2D)
@pytest.mark.parametrize("relu", [False, True])
def test_2d_listing_equals_enumeration_and_reference(dtype, bins, ranges, relu):
    x, delta = _factors(dtype, relu=relu)
    x = x * 3
    delta[2] = 0.0
    delta[4, :5] = -0.0
    x[5] = 0.0
    x[6, ::2] = -0.0
    x[7, :10] = x[7, 0]
    x[8, :4] = torch.tensor([1e-9, -3e-10, 2e-12, -1e-11], dtype=dtype)  # products closer to zero than the band
    gen = torch.Generator().manual_seed(4)
    theta = (torch.randn(delta.shape[1], x.shape[1], generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    _check_2d(x, delta, theta, bins, ranges)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins,ranges", RANGES_2D)
@pytest.mark.parametrize("sign", [1.0, -1.0, 3.0])
def test_2d_products_on_and_beside_the_edges_and_band_ends(dtype, bins, ranges, sign):
    """``B * delta * x`` equal to every x-edge, the band's ends, their neighbouring floats and far values."""
    counter = Hist2dCounter(bins, ranges)
    batch = 4
    (_, _, _), (low, high) = counter.zero_band(batch, dtype, "cpu")
    lo, hi = ranges[0]
    points = torch.cat([torch.linspace(lo, hi, bins[0] + 1, dtype=dtype), torch.tensor([low, high, -low, -high], dtype=dtype)])
    values = torch.cat(
        [
            points,
            torch.nextafter(points, points + 1),
            torch.nextafter(points, points - 1),
            torch.tensor([lo - 1, hi + 1, -1e30, 1e30, 0.0, -0.0, 1e-30, -1e-30], dtype=dtype),
        ]
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.stack([values[torch.randperm(values.numel(), generator=gen)] / sign for _ in range(batch)])
    delta = torch.full((batch, 3), sign / batch, dtype=dtype)
    delta[1, 2] = 0.0
    delta[3, 0] = -2 * sign / batch
    theta = torch.linspace(-1.5, 1.5, 3 * x.shape[1], dtype=dtype).reshape(3, -1)
    _check_2d(x, delta, theta, bins, ranges)


def test_2d_listing_falls_back_where_it_would_not_be_exact():
    x, delta = _factors(torch.float32)
    theta = torch.zeros(delta.shape[1], x.shape[1])
    counter = Hist2dCounter((40, 50), ((-1.0, 1.0), (-2.0, 2.0)))
    assert _Dominant2d.plan(counter, x, delta, theta, force=True) is not None
    for bad_x, bad_delta in [
        (x.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("inf"))), delta),
        (x.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan"))), delta),
        (x, delta.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("inf")))),
        (x.index_put((torch.tensor([3]), torch.tensor([0])), torch.tensor(1e-30)), delta * 1e-10),  # underflow possible
    ]:
        assert _Dominant2d.plan(counter, bad_x, bad_delta, theta, force=True) is None
        counts = counter.new_counts("cpu")
        counter.count_outer(counts, bad_x, bad_delta, theta, dominant=True)
        expected = hist2d_counts(x.shape[0] * torch.einsum("no,ni->noi", bad_delta, bad_x), theta, (40, 50), ((-1.0, 1.0), (-2.0, 2.0)))
        assert torch.equal(counter.finish(counts), expected)  # a pair with a NaN: not counted by either


def test_2d_automatic_choice():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 400, generator=gen)
    delta = torch.randn(64, 200, generator=gen) * 1e-4
    theta = torch.randn(200, 400, generator=gen)
    assert delta.numel() * x.shape[1] >= fast_histograms.DOMINANT_MIN_ENTRIES
    counter = Hist2dCounter((40, 50), ((-1.0, 1.0), (-2.0, 2.0)))
    assert _Dominant2d.plan(counter, x, delta, theta, force=False) is not None
    wide = Hist2dCounter((40, 50), ((-1e-4, 1e-4), (-2.0, 2.0)))  # most products lie outside the band
    assert _Dominant2d.plan(wide, x, delta, theta, force=False) is None
    assert _Dominant2d.plan(counter, x[:, :10], delta[:, :10], theta[:10, :10], force=False) is None  # small layer
    for c in (counter, wide):
        counts = c.new_counts("cpu")
        c.count_outer(counts, x, delta, theta)
        expected = hist2d_counts(64 * torch.einsum("no,ni->noi", delta, x), theta, (c.xbins, c.ybins), ((c.xlo, c.xlo + c.xbins * c.xw), (c.ylo, c.ylo + c.ybins * c.yw)))
        assert torch.equal(c.finish(counts), expected)


@pytest.mark.parametrize("bias", [True, False])
def test_2d_relu_mlp_per_sample_gradients(bias, monkeypatch):
    """GradHist2d on a ReLU MLP, with the listing forced on, equals counts of torch.func per-sample gradients."""
    monkeypatch.setattr(fast_histograms, "DOMINANT_MIN_ENTRIES", 0)
    monkeypatch.setattr(fast_histograms, "DOMINANT_SHARE", 1.0)
    planned = []
    plan = _Dominant2d.plan
    monkeypatch.setattr(_Dominant2d, "plan", staticmethod(lambda *a, **k: planned.append(plan(*a, **k)) or planned[-1]))
    torch.manual_seed(0)
    nn = torch.nn
    model = extend(
        nn.Sequential(nn.Flatten(), nn.Linear(12, 60, bias=bias), nn.ReLU(), nn.Linear(60, 40, bias=bias), nn.ReLU(), nn.Linear(40, 4, bias=bias))
    ).double()
    lossfunc, individual = extend(nn.CrossEntropyLoss()), nn.CrossEntropyLoss(reduction="none")
    bins, ranges = (12, 9), ((-0.3, 0.2), (-0.5, 0.6))
    q = GradHist2d(linear(1), bins=bins, range=ranges)
    cockpit = Cockpit(model.parameters(), quantities=[q])
    refs = {}

    def record(step, model, inputs, labels):
        refs[step] = (per_sample_grads(model, inputs, labels), [p.detach().clone() for p in model.parameters()])

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        train(model, lossfunc, individual, cockpit, "mlp", 3, 8, torch.optim.SGD(model.parameters(), lr=0.5), record)
    assert sum(p is not None for p in planned) >= 3  # the weights of every step
    for step, value in q.get_output().items():
        grads, params = refs[step]
        expected = sum(hist2d_counts(g, p.unsqueeze(0).expand_as(g), bins, ranges) for g, p in zip(grads, params))
        np.testing.assert_array_equal(value["hist"], expected.numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_shortcuts_equal_enumeration(dtype):
    """Half-precision factors take torch's sorts instead of NumPy's; counts still equal enumeration."""
    gen = torch.Generator().manual_seed(0)
    # factors away from zero: float16 products of small nonzero factors could underflow (the 2-D path refuses those)
    x = (torch.randn(16, 50, generator=gen).sign() * (0.5 + 2.5 * torch.rand(16, 50, generator=gen))).to(dtype)
    delta = (torch.randn(16, 9, generator=gen).sign() * (0.01 + 0.09 * torch.rand(16, 9, generator=gen))).to(dtype)
    theta = torch.randn(9, 50, generator=gen).to(dtype)
    c1 = Hist1dCounter(13, (-0.3, 0.5), dtype)
    expected = c1.new_counts("cpu")
    c1.count_outer(expected, x, delta, block=0, sparse=None)
    for block in (1, 3, 16):
        counts = c1.new_counts("cpu")
        c1.count_outer(counts, x, delta, block=block)
        assert torch.equal(counts, expected)
    c2 = Hist2dCounter((11, 5), ((-0.3, 0.5), (-1.0, 1.0)))
    assert _Dominant2d.plan(c2, x, delta, theta, force=True) is not None
    expected2, counts2 = c2.new_counts("cpu"), c2.new_counts("cpu")
    c2.count_outer(expected2, x, delta, theta, dominant=False)
    c2.count_outer(counts2, x, delta, theta, dominant=True)
    assert torch.equal(counts2, expected2)


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_rows_longer_than_a_chunk_are_counted_in_slices(chunk, monkeypatch):
    """One sample with more entries than ``chunk`` (a large embedding's row): counted in column slices, with
    buffers of at most ``chunk`` entries (not one sample's size), the same counts as the reference."""
    torch.manual_seed(3)
    batch, out, width = 3, 40, 25  # 1000 entries per sample
    x, delta = torch.randn(batch, width, dtype=torch.float64), torch.randn(batch, out, dtype=torch.float64)
    theta = torch.randn(out, width, dtype=torch.float64)
    grad_batch = delta.unsqueeze(2) * x.unsqueeze(1)
    sizes = []
    made = fast_histograms._Buffers.__init__

    def record(self, size, dtype, device):
        sizes.append(size)
        made(self, size, dtype, device)

    monkeypatch.setattr(fast_histograms._Buffers, "__init__", record)
    monkeypatch.setattr(fast_histograms, "SLICE", chunk)
    bins, range_ = 17, (-1.5, 1.5)
    expected = hist1d_counts(batch * grad_batch, bins, range_)
    counter = Hist1dCounter(bins, range_, torch.float64)
    for count in (lambda c: counter.count_grad_batch(c, grad_batch, chunk=chunk),
                  lambda c: counter.count_outer_dense(c, x, delta, chunk=chunk)):  # fmt: skip
        counts = counter.new_counts("cpu")
        count(counts)
        assert torch.equal(Hist1dCounter.finish(counts, bins, torch.float64), expected)
    ranges = ((-1.5, 1.5), (-2.0, 2.0))
    expected_2d = hist2d_counts(batch * grad_batch, theta, (9, 11), ranges)
    counter_2d = Hist2dCounter((9, 11), ranges)
    for count in (lambda c: counter_2d.count_grad_batch(c, grad_batch, theta, chunk=chunk),
                  lambda c: counter_2d.count_outer_dense(c, x, delta, theta, chunk=chunk)):  # fmt: skip
        counts = counter_2d.new_counts("cpu")
        count(counts)
        assert torch.equal(counter_2d.finish(counts), expected_2d)
    assert sizes and max(sizes) <= max(chunk, width), sizes
