"""Sparse (ReLU) enumeration of linear-layer histogram counts against the dense path and the references.

The sparse path of ``Hist1dCounter.count_outer`` / ``Hist2dCounter.count_outer``
enumerates only products of nonzero factor entries and adds the rest to the
bin of zero analytically; its counts must be identical to the dense
enumeration, to ``torch.histc`` / ``hist2d_counts`` on the materialised
``grad_batch = delta_i x_i^T``, and to per-sample gradients from torch.func.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _small_layers_too(monkeypatch):
    monkeypatch.setattr(fast_histograms, "SPARSE_MIN_ENTRIES", 0)  # the test layers are small

from cockpit_like.backends import fast_histograms
from cockpit_like.backends.fast_histograms import Hist1dCounter, Hist2dCounter, _SparseFactors
from cockpit_like.functional.histograms import hist1d_counts, hist2d_counts
from tests.helpers import per_sample_grads

RANGES = [((-0.3, 0.5), (-1.0, 1.2)), ((0.05, 0.4), (-0.5, 0.5)), ((-0.4, 0.0), (-2.0, 2.0))]


def _factors(dtype, batch=16, out=7, width=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.relu(torch.randn(batch, width, generator=gen, dtype=torch.float64)).to(dtype)
    delta = (torch.randn(batch, out, generator=gen, dtype=torch.float64) * (torch.rand(batch, out, generator=gen) < 0.5) / batch).to(dtype)
    theta = torch.randn(out, width, generator=gen, dtype=torch.float64).to(dtype)
    return x, delta, theta


def _check(x, delta, theta, ranges, chunk, expect_sparse, monkeypatch, two_d=True):
    calls = []
    plan = _SparseFactors.plan
    monkeypatch.setattr(_SparseFactors, "plan", staticmethod(lambda *a: calls.append(plan(*a)) or calls[-1]))
    batch = delta.shape[0]
    grad_batch = torch.einsum("no,ni->noi", delta, x)
    c1 = Hist1dCounter(13, ranges[0], delta.dtype)
    sparse, dense = c1.new_counts("cpu"), c1.new_counts("cpu")
    c1.count_outer(sparse, x, delta, chunk=chunk)
    c1.count_outer_dense(dense, x, delta, chunk=chunk)
    assert torch.equal(sparse, dense)
    expected = hist1d_counts(batch * grad_batch, 13, ranges[0])
    assert torch.equal(Hist1dCounter.finish(sparse, 13, delta.dtype), expected)
    if not two_d:
        assert [c is not None for c in calls] == [expect_sparse]
        return
    c2 = Hist2dCounter((11, 5), ranges)
    sparse2, dense2 = c2.new_counts("cpu"), c2.new_counts("cpu")
    c2.count_outer(sparse2, x, delta, theta, chunk=chunk, sparse=fast_histograms.SPARSE_SHARE)
    c2.count_outer_dense(dense2, x, delta, theta, chunk=chunk)
    assert torch.equal(sparse2, dense2)
    assert torch.equal(c2.finish(sparse2), hist2d_counts(batch * grad_batch, theta, (11, 5), ranges))
    assert [c is not None for c in calls] == [expect_sparse, expect_sparse]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ranges", RANGES)
@pytest.mark.parametrize("chunk", [40, 1 << 16])
def test_sparse_equals_dense_and_reference(dtype, ranges, chunk, monkeypatch):
    x, delta, theta = _factors(dtype)
    delta[3] = 0.0  # all-zero rows
    x[5] = 0.0
    delta[6, :3] = -0.0  # signed zeros share the zero bin
    x[7, ::2] = -0.0
    x[8, 1::2] = -x[8, 1::2]
    _check(x, delta, theta, ranges, chunk, True, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_zero_factors(dtype, monkeypatch):
    x, delta, theta = _factors(dtype)
    _check(x, torch.zeros_like(delta), theta, RANGES[0], 1 << 16, True, monkeypatch)
    _check(-0.0 * x, delta, theta, RANGES[2], 50, True, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dense_factors_fall_back(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 13, generator=gen, dtype=dtype)
    delta = torch.randn(9, 6, generator=gen, dtype=dtype) / 9
    theta = torch.randn(6, 13, generator=gen, dtype=dtype)
    _check(x, delta, theta, RANGES[0], 50, False, monkeypatch)


def test_non_finite_factors_fall_back(monkeypatch):
    x, delta, theta = _factors(torch.float64)
    x[2, 4] = float("inf")
    delta[1, :] = 0.0  # inf * 0 = nan: must not be counted as a zero
    delta[5, 0] = float("nan")
    _check(x, delta, theta, RANGES[0], 1 << 16, False, monkeypatch, two_d=False)  # 2-D has no NaN rule


def test_share_threshold():
    x, delta, _ = _factors(torch.float64)
    assert _SparseFactors.plan(x, delta, fast_histograms.SPARSE_SHARE) is not None
    assert _SparseFactors.plan(x, delta, 0.0) is None
    c = Hist1dCounter(5, (-1.0, 1.0), x.dtype)
    counts, dense = c.new_counts("cpu"), c.new_counts("cpu")
    c.count_outer(counts, x, delta, sparse=None)
    c.count_outer(dense, x, delta, sparse=0.0)
    assert int(counts.sum()) == x.numel() * delta.shape[1] and torch.equal(counts, dense)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [3, 8])
def test_relu_mlp_per_sample_gradients(bias, batch, monkeypatch):
    """Counts from the layer factors of a ReLU MLP equal counts of torch.func per-sample gradients."""
    calls = []
    plan = _SparseFactors.plan
    monkeypatch.setattr(_SparseFactors, "plan", staticmethod(lambda *a: calls.append(plan(*a)) or calls[-1]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(10, 12, bias=bias), torch.nn.ReLU(), torch.nn.Linear(12, 9, bias=bias), torch.nn.ReLU(), torch.nn.Linear(9, 3, bias=bias)
    ).double()
    loss_fn = torch.nn.CrossEntropyLoss()
    inputs = torch.relu(torch.randn(batch, 10, dtype=torch.float64))
    labels = torch.randint(0, 3, (batch,))
    acts, pre = [], []
    h = inputs
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            acts.append(h)
            h = layer(h)
            h.retain_grad()
            pre.append(h)
        else:
            h = layer(h)
    loss_fn(h, labels).backward()
    grads = per_sample_grads(model, inputs, labels)  # g_i (not / B)
    params = [p for p in model.parameters()]
    ranges = ((-0.2, 0.3), (-0.5, 0.5))
    for k, (x, z) in enumerate(zip(acts, pre)):
        delta = z.grad.detach()  # grad_batch[i] = delta_i x_i^T (mean loss: / B included)
        weight = params[k * (2 if bias else 1)]
        c1 = Hist1dCounter(21, ranges[0], torch.float64)
        counts = c1.new_counts("cpu")
        c1.count_outer(counts, x.detach(), delta)
        g = grads[k * (2 if bias else 1)]
        assert torch.allclose(batch * torch.einsum("no,ni->noi", delta, x.detach()), g, rtol=1e-10, atol=1e-14)
        expected = hist1d_counts(g, 21, ranges[0])
        assert torch.equal(Hist1dCounter.finish(counts, 21, torch.float64), expected)
        c2 = Hist2dCounter((7, 4), ranges)
        counts2 = c2.new_counts("cpu")
        c2.count_outer(counts2, x.detach(), delta, weight, sparse=1.0)
        dense2 = c2.new_counts("cpu")
        c2.count_outer_dense(dense2, x.detach(), delta, weight)
        assert torch.equal(counts2, dense2)
        assert torch.equal(c2.finish(counts2), hist2d_counts(g, weight.detach(), (7, 4), ranges))
    assert any(c is not None for c in calls)  # the sparse path ran at least once
