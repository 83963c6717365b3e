"""The nn.Linear outer-product fast path and the chunked histograms against the generic paths.

- Every statistic computed from the factors ``(x, delta)`` equals the one
  computed from BackPACK's ``grad_batch`` (float64, rtol 1e-10; histogram
  counts exactly), on MLPs with/without bias and on a CNN (Conv2d generic +
  Linear fast), and the per-sample gradients of torch.func.
- On an MLP the fast path never creates ``grad_batch`` (no attribute, no
  BackPACK weight Jacobian, no materialisation) unless a statistic needs it.
- The chunked counters reproduce ``torch.histc`` / ``hist2d_counts`` bin for
  bin on values at and around the bin edges, in float32 and float64.
"""

import math

import numpy as np
import pytest
import torch
from backpack import backpack
from backpack.core.derivatives.linear import LinearDerivatives
from backpack.extensions import BatchGrad

from cockpit_like import Cockpit
from cockpit_like.backends import per_sample
from cockpit_like.backends.fast_histograms import Hist1dCounter, Hist2dCounter
from cockpit_like.backends.per_sample import PerSampleReducer
from cockpit_like.backends.per_sample_extension import PerSampleStatistics, statistics_backend
from cockpit_like.backends.per_sample_stats import (
    AbsMax,
    GramSummary,
    DirectionalDots,
    Histogram1dCounts,
    Histogram2dCounts,
    RetainedDense,
    RetainedFactors,
    RetainedGradBatch,
    SumOfSquares,
)
from cockpit_like.functional.histograms import hist1d_counts, hist2d_counts
from cockpit_like.utils.configuration import configuration
from tests.helpers import make_batch, make_problem, per_sample_grads, train

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def _assert_summary(summary, gram, **tol):
    """``GramSummary``'s ``(diag, row_sums)`` against a brute-force Gram matrix."""
    torch.testing.assert_close(summary[0], torch.diagonal(gram), **tol)
    torch.testing.assert_close(summary[1], gram.sum(1), **tol)


def _stats(params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    direction = tuple(torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params)
    return [
        GramSummary(),
        SumOfSquares(),
        AbsMax(),
        DirectionalDots("d", direction),
        Histogram1dCounts(30, (-0.3, 0.25)),
        Histogram2dCounts((9, 7), ((-0.2, 0.3), (-0.5, 0.4))),
    ]


def _reduce(model, lossfunc, inputs, labels, stats, path, seen=None):
    params = list(model.parameters())
    if path == "batch_grad":  # the generic path: BackPACK's grad_batch on the parameters
        reducer = PerSampleReducer(stats, params, keep_grad_batch=False)
        extension = BatchGrad()
    else:
        reducer = PerSampleReducer(stats, params, keep_grad_batch=False)
        extension = PerSampleStatistics(reducer, factors=(path == "factors"))
    with backpack(extension, extension_hook=reducer):
        lossfunc(model(inputs), labels).backward()
    assert reducer.seen == (set(range(len(params))) if seen is None else seen)
    assert not any(hasattr(p, "grad_batch") for p in params)
    return reducer.results()


def _assert_equal(a, b):
    if a is None or b is None:
        assert a is None and b is None
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    elif isinstance(a, torch.Tensor) and not a.is_floating_point():
        assert torch.equal(a, b)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    else:
        assert a == b


@pytest.mark.parametrize("problem,bias", [("mlp", True), ("mlp", False), ("cnn", True), ("cnn", False)])
@pytest.mark.parametrize("batch_size", [1, 7])
def test_fast_path_equals_generic_path(problem, bias, batch_size):
    model, lossfunc, _ = make_problem(problem, bias=bias)
    inputs, labels = make_batch(problem, batch_size, 4)
    params = list(model.parameters())
    results = {path: _reduce(model, lossfunc, inputs, labels, _stats(params), path) for path in ("factors", "grad_batch", "batch_grad")}
    for stat in _stats(params):
        for path in ("grad_batch", "batch_grad"):
            _assert_equal(results["factors"][stat], results[path][stat])
    # and against torch.func per-sample gradients (grad_batch = g_i / B)
    grads = [g / batch_size for g in per_sample_grads(model, inputs, labels)]
    flat = torch.cat([g.reshape(batch_size, -1) for g in grads], 1)
    fast = results["factors"]
    _assert_summary(fast[GramSummary()], flat @ flat.T, rtol=1e-10, atol=1e-15)
    for s, g in zip(fast[SumOfSquares()], grads):
        torch.testing.assert_close(s, g.pow(2).sum(0), rtol=1e-10, atol=1e-15)
    value, batch = fast[AbsMax()]
    assert batch == batch_size and value.item() == pytest.approx(flat.abs().max().item(), rel=1e-12)
    direction = torch.cat([d.reshape(-1) for d in _stats(params)[3].direction])
    torch.testing.assert_close(fast[DirectionalDots("d")], flat @ direction, rtol=1e-10, atol=1e-14)
    assert fast[Histogram1dCounts(30, (-0.3, 0.25))].sum().item() == flat.numel()
    assert fast[Histogram1dCounts(30, (-0.3, 0.25))].dtype == torch.float64


def _conv_net(first: dict, second: dict, bias: bool, size: int = 9) -> torch.nn.Sequential:
    """Two convolutions of a given geometry, ReLU, then a linear layer (float64)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, bias=bias, **first),
        torch.nn.ReLU(),
        torch.nn.Conv2d(3, 4, bias=bias, **second),
        torch.nn.Flatten(),
    )
    net.append(torch.nn.Linear(net(torch.zeros(1, 2, size, size)).shape[1], 3))
    return net.double()


_CONV_GEOMETRIES = [
    (dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2)),
    (dict(kernel_size=3, padding="same", dilation=2), dict(kernel_size=(2, 3), padding="same")),
    (dict(kernel_size=(3, 1), stride=(1, 2), padding=(2, 0)), dict(kernel_size=3, padding="valid", dilation=(2, 1))),
    (dict(kernel_size=1), dict(kernel_size=3, padding=1, padding_mode="reflect")),
    (dict(kernel_size=3, padding=(2, 1), padding_mode="circular"), dict(kernel_size=2, padding="same", padding_mode="replicate")),
    (dict(kernel_size=3, padding=1), dict(kernel_size=3, groups=1)),
]


@pytest.mark.parametrize("geometry", range(len(_CONV_GEOMETRIES)))
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_unfold_path_equals_batch_grad_and_torch_func(geometry, bias):
    """The Conv2d unfold + bmm grad_batch: every statistic as with BatchGrad and as from torch.func."""
    from backpack import extend

    model = extend(_conv_net(*_CONV_GEOMETRIES[geometry], bias=bias))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    gen = torch.Generator().manual_seed(geometry)
    inputs = torch.randn(6, 2, 9, 9, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (6,), generator=gen)
    params = list(model.parameters())
    if any("padding_mode" in conv for conv in _CONV_GEOMETRIES[geometry]):
        # BackPACK's rules ignore padding modes: the extension leaves such layers to the cockpit's hooks (outside
        # trial 42), whose rows (the same unfold of the padded input) are checked through a cockpit below
        skipped = {i for i, p in enumerate(params) if any(p is q for m in model if getattr(m, "padding_mode", "zeros")
                                                          != "zeros" for q in m.parameters())}  # fmt: skip
        _reduce(model, lossfunc, inputs, labels, _stats(params), "factors", seen=set(range(len(params))) - skipped)
        _padding_modes_through_the_hooks(model, lossfunc, inputs, labels)
        return
    fast = _reduce(model, lossfunc, inputs, labels, _stats(params), "factors")
    if not any(conv.get("padding") == "same" or "padding_mode" in conv for conv in _CONV_GEOMETRIES[geometry]):
        # (BackPACK's BatchGrad raises for padding="same" and ignores padding modes; the unfold path handles both)
        slow = _reduce(model, lossfunc, inputs, labels, _stats(params), "batch_grad")
        for stat in _stats(params):
            _assert_equal(fast[stat], slow[stat])
    grads = [g / 6 for g in per_sample_grads(model, inputs, labels)]
    for s, g in zip(fast[SumOfSquares()], grads):
        torch.testing.assert_close(s, g.pow(2).sum(0), rtol=1e-10, atol=1e-15)
    flat = torch.cat([g.reshape(6, -1) for g in grads], 1)
    _assert_summary(fast[GramSummary()], flat @ flat.T, rtol=1e-10, atol=1e-15)


def _padding_modes_through_the_hooks(model, lossfunc, inputs, labels):
    """The per-sample rows of a net with padding modes, from a cockpit given the model: a loop's."""
    from cockpit_like.quantities import NormTest
    from cockpit_like.utils.schedules import linear
    from tests.helpers import assert_rows_match, gram_probe

    probe = gram_probe(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[probe, NormTest(linear(1))], model=model)
    model.zero_grad()  # (the extension's pass above left its gradients)
    losses = torch.nn.functional.cross_entropy(model(inputs), labels, reduction="none")
    with cockpit(0, info={"batch_size": len(labels), "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    grads = per_sample_grads(model, inputs, labels)
    assert_rows_match(cockpit, probe, 0, torch.cat([g.reshape(len(labels), -1) for g in grads], 1))


def test_conv2d_with_groups_falls_back_to_batch_grad(monkeypatch):
    from backpack import extend

    from cockpit_like.backends import per_sample_extension

    calls = []
    original = per_sample_extension.conv2d_weight_rows
    monkeypatch.setattr(per_sample_extension, "conv2d_weight_rows", lambda *a: calls.append(1) or original(*a))
    torch.manual_seed(1)
    model = extend(torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, groups=2), torch.nn.Flatten(), torch.nn.Linear(4 * 25, 3)).double())
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    inputs, labels = torch.randn(5, 2, 7, 7, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    params = list(model.parameters())
    fast = _reduce(model, lossfunc, inputs, labels, [SumOfSquares(), GramSummary()], "factors")
    assert not calls  # groups=2 is not unfolded
    grads = [g / 5 for g in per_sample_grads(model, inputs, labels)]
    for s, g in zip(fast[SumOfSquares()], grads):
        torch.testing.assert_close(s, g.pow(2).sum(0), rtol=1e-10, atol=1e-15)
    model2 = extend(_conv_net(dict(kernel_size=3), dict(kernel_size=3), bias=True))
    _reduce(model2, lossfunc, torch.randn(2, 2, 9, 9, dtype=torch.float64), torch.tensor([0, 2]), [SumOfSquares()], "factors")
    assert len(calls) == 2  # ... while groups=1 convolutions are


def test_retained_grad_batch_shared_with_histograms_on_the_fast_path():
    model, lossfunc, _ = make_problem("mlp")
    inputs, labels = make_batch("mlp", 5, 1)
    params = list(model.parameters())
    stats = [RetainedGradBatch(), Histogram1dCounts(11, (-0.1, 0.1)), GramSummary()]
    fast = _reduce(model, lossfunc, inputs, labels, stats, "factors")
    slow = _reduce(model, lossfunc, inputs, labels, stats, "batch_grad")
    for stat in stats[1:]:
        _assert_equal(fast[stat], slow[stat])
    # Linear layers are retained as factors on the fast path, as grad_batch otherwise;
    # both give the batch sum and the per-sample dots of the brute-force gradients.
    assert all(isinstance(kept, RetainedFactors) for kept in fast[RetainedGradBatch()])
    assert all(isinstance(kept, RetainedDense) for kept in slow[RetainedGradBatch()])
    generator = torch.Generator().manual_seed(3)
    for fast_kept, slow_kept, g in zip(fast[RetainedGradBatch()], slow[RetainedGradBatch()], per_sample_grads(model, inputs, labels)):
        direction = torch.randn(g.shape[1:], generator=generator, dtype=g.dtype)
        expected_dots = (g / 5).flatten(1) @ direction.reshape(-1)
        for kept in (fast_kept, slow_kept):
            torch.testing.assert_close(kept.batch_sum(), g.sum(0) / 5, rtol=1e-10, atol=1e-15)
            torch.testing.assert_close(kept.dots(direction), expected_dots, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("bias", [True, False])
def test_mlp_fast_path_never_materialises_per_sample_gradients(bias, monkeypatch):
    """Factor-form statistics only: no grad_batch attribute, no BackPACK weight Jacobian, no outer product."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a [B, out, in] per-sample gradient was materialised")

    monkeypatch.setattr(LinearDerivatives, "_weight_jac_t_mat_prod", forbidden)
    monkeypatch.setattr(per_sample, "materialize_linear", forbidden)
    model, lossfunc, individual = make_problem("mlp", bias=bias)
    params = list(model.parameters())
    live = []
    original = PerSampleReducer.__call__

    def spy(self, module):
        live.append(sum(hasattr(p, "grad_batch") for p in params))
        original(self, module)

    monkeypatch.setattr(PerSampleReducer, "__call__", spy)
    from cockpit_like import quantities
    from cockpit_like.quantities.bin_adaptation import GradAbsMax
    from cockpit_like.utils.schedules import linear

    qs = [quantities.NormTest(linear(1)), quantities.InnerTest(linear(1)), quantities.OrthoTest(linear(1)),
          quantities.MeanGSNR(linear(1)), quantities.CABS(linear(1)), quantities.EarlyStopping(linear(1)),
          quantities.GradHist1d(linear(1), adapt=GradAbsMax(linear(1)))]
    cockpit = Cockpit(params, quantities=qs)
    train(model, lossfunc, individual, cockpit, "mlp", 3, 6, torch.optim.SGD(params, lr=0.1))
    assert live and max(live) == 0
    assert all(len(q.get_output()) == 3 for q in qs)
    assert all(math.isfinite(v) for v in qs[0].get_output().values())


def test_raw_batch_grad_request_keeps_current_behaviour():
    model, lossfunc, _ = make_problem("mlp")
    params = list(model.parameters())
    extension, reducer = statistics_backend([GramSummary()], params, raw_batch_grad=True)
    assert isinstance(extension, BatchGrad) and reducer.keep_grad_batch
    extension, reducer = statistics_backend([GramSummary()], params, raw_batch_grad=False)
    assert isinstance(extension, PerSampleStatistics) and extension.reducer is reducer
    # through the cockpit: the user's BatchGrad is kept, statistics are equal
    inputs, labels = make_batch("mlp", 4, 2)
    from cockpit_like import quantities
    from cockpit_like.utils.schedules import linear

    outputs = []
    for exts in ((), (BatchGrad(),)):
        model, lossfunc, _ = make_problem("mlp")
        q = quantities.NormTest(linear(1))
        cockpit = Cockpit(model.parameters(), quantities=[q])
        loss = lossfunc(model(inputs), labels)
        with cockpit(0, *exts, info={"batch_size": 4, "loss": loss}):
            loss.backward()
        assert all(hasattr(p, "grad_batch") == bool(exts) for p in model.parameters())
        outputs.append(q.get_output()[0])
    assert outputs[0] == pytest.approx(outputs[1], rel=1e-10)


def _assert_same_log(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_log(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_log(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert float(a) == pytest.approx(float(b), rel=1e-10, abs=1e-13)


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_economy_fast_path_matches_batch_grad_path(problem):
    """The economy preset with the fast path logs what it logs with raw BatchGrad requested."""
    logs = []
    for exts in ((), (BatchGrad(),)):
        model, lossfunc, individual = make_problem(problem)
        cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        for step in range(3):
            inputs, labels = make_batch(problem, 5, seed=1000 + step)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = lossfunc(outputs, labels)
            info = {"batch_size": 5, "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
            with cockpit(step, *exts, info=info):
                loss.backward()
            optimizer.step()
        logs.append(cockpit.get_output())
    for step in logs[0]:
        logs[0][step].pop("Time", None), logs[1][step].pop("Time", None)
    _assert_same_log(logs[0], logs[1])


# ---- the chunked counters against torch.histc / hist2d_counts ----------------------------
def _edge_values(bins, lo, hi, dtype):
    edges = torch.linspace(lo, hi, bins + 1, dtype=dtype)
    near = [edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)]
    gen = torch.Generator().manual_seed(0)
    spread = torch.rand(4000, generator=gen, dtype=torch.float64).to(dtype) * (hi - lo) * 1.4 + lo - 0.2 * (hi - lo)
    special = torch.tensor([lo, hi, -1e30, 1e30, float("inf"), float("-inf"), 0.0], dtype=dtype)
    return torch.cat([*near, spread, special])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins,range_", [(100, (-2.0, 2.0)), (7, (-0.05, 0.1)), (13, (-0.3170001, 0.7712345)), (1, (0.0, 1.0))])
@pytest.mark.parametrize("chunk", [64, 1 << 16])
def test_hist1d_counter_equals_histc(dtype, bins, range_, chunk):
    values = _edge_values(bins, *range_, dtype)
    grad_batch = (values / 8).reshape(8, -1) if values.numel() % 8 == 0 else (values[: values.numel() // 8 * 8] / 8).reshape(8, -1)
    counter = Hist1dCounter(bins, range_, dtype)
    counts = counter.new_counts("cpu")
    counter.count_grad_batch(counts, grad_batch, chunk=chunk)
    expected = hist1d_counts(8 * grad_batch, bins, range_)
    result = Hist1dCounter.finish(counts, bins, dtype)
    assert result.dtype == expected.dtype and torch.equal(result, expected)


def test_hist1d_counter_drops_nan_as_histc():
    values = torch.tensor([[0.1, float("nan"), 0.3], [float("nan"), -0.2, 5.0]])
    counter = Hist1dCounter(4, (-1.0, 1.0), values.dtype)
    counts = counter.new_counts("cpu")
    counter.count_grad_batch(counts, values)
    assert torch.equal(Hist1dCounter.finish(counts, 4, values.dtype), hist1d_counts(2 * values, 4, (-1.0, 1.0)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [50, 1 << 16])
def test_outer_product_counts_equal_materialised_counts(dtype, chunk):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 13, generator=gen, dtype=torch.float64).to(dtype)
    delta = (torch.randn(9, 6, generator=gen, dtype=torch.float64) / 9).to(dtype)
    theta = torch.randn(6, 13, generator=gen, dtype=torch.float64).to(dtype)
    grad_batch = torch.einsum("no,ni->noi", delta, x)  # BackPACK's BatchGrad for nn.Linear
    counter = Hist1dCounter(17, (-0.7, 0.9), dtype)
    counts = counter.new_counts("cpu")
    counter.count_outer(counts, x, delta, chunk=chunk)
    assert torch.equal(Hist1dCounter.finish(counts, 17, dtype), hist1d_counts(9 * grad_batch, 17, (-0.7, 0.9)))
    ranges = ((-0.7, 0.9), (-1.5, 1.2))
    counter2 = Hist2dCounter((11, 5), ranges)
    for source in ("outer", "grad_batch"):
        counts2 = counter2.new_counts("cpu")
        if source == "outer":
            counter2.count_outer(counts2, x, delta, theta, chunk=chunk)
        else:
            counter2.count_grad_batch(counts2, grad_batch, theta, chunk=chunk)
        assert torch.equal(counter2.finish(counts2), hist2d_counts(9 * grad_batch, theta, (11, 5), ranges))


def test_hist2d_counter_equals_reference_at_edges():
    ranges = ((-0.25, 0.5), (-1.0, 0.75))
    values = _edge_values(12, *ranges[0], torch.float32)[:4000].reshape(4, -1) / 4
    theta = _edge_values(6, *ranges[1], torch.float32)[: values.shape[1]]
    theta = theta[: values.shape[1]] if theta.numel() >= values.shape[1] else torch.cat([theta, torch.zeros(values.shape[1] - theta.numel())])
    counter = Hist2dCounter((12, 6), ranges)
    counts = counter.new_counts("cpu")
    counter.count_grad_batch(counts, values, theta, chunk=333)
    np.testing.assert_array_equal(counter.finish(counts).numpy(), hist2d_counts(4 * values, theta, (12, 6), ranges).numpy())


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=3),
        dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        dict(kernel_size=3, padding="same", dilation=2, padding_mode="reflect"),
        dict(kernel_size=(4, 1), padding="same", padding_mode="circular"),
        dict(kernel_size=1, stride=3),
    ],
)
def test_unfold_conv2d_input_reproduces_the_convolution(conv):
    """weight @ unfold(x) + bias is the module's output; per-sample weight gradients match autograd."""
    from cockpit_like.backends.conv_unfold import conv2d_weight_grad_batch, unfold_conv2d_input

    torch.manual_seed(0)
    module = torch.nn.Conv2d(3, 5, **conv).double()
    x = torch.randn(4, 3, 11, 9, dtype=torch.float64)
    out = module(x)
    unfolded = unfold_conv2d_input(module, x)
    rebuilt = (module.weight.reshape(5, -1) @ unfolded).reshape(out.shape) + module.bias[:, None, None]
    torch.testing.assert_close(rebuilt, out, rtol=1e-12, atol=1e-12)
    delta = torch.randn_like(out)
    expected = torch.stack(
        [torch.autograd.grad((module(x[i : i + 1]) * delta[i : i + 1]).sum(), module.weight)[0] for i in range(4)]
    )
    # in one chunk, one sample per chunk, and chunks that do not divide the batch (3 + 1)
    for chunk_bytes in (1 << 30, 1, 3 * unfolded[0].numel() * 8):
        grad_batch = conv2d_weight_grad_batch(module, x, delta, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(grad_batch, expected, rtol=1e-12, atol=1e-12)
    if module.padding_mode == "zeros" and conv.get("padding") != "same":
        torch.testing.assert_close(
            unfolded,
            torch.nn.functional.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("layer", ["grad_batch", "outer"])
def test_the_accelerators_chunk_counts_what_the_cpus_does(layer):
    """On an accelerator the counters take chunks of ``DEVICE_CHUNK`` entries (a few kernel launches per chunk):
    the counts are those of ``histc`` / the 2-D rule whatever the chunk, checked here on the CPU with both."""
    from cockpit_like.backends import fast_histograms as fh

    assert fh.default_chunk(torch.device("cpu")) == fh.CHUNK
    assert fh.default_chunk(torch.device("cuda")) == fh.DEVICE_CHUNK > 16 * fh.CHUNK
    g = torch.Generator().manual_seed(3)
    x, delta = torch.randn(64, 300, generator=g) * 0.05, torch.randn(64, 90, generator=g) * 0.05  # 1.7M products
    grad_batch = torch.einsum("bo,bi->boi", delta, x)
    theta = torch.randn(90, 300, generator=g)
    one, two = Hist1dCounter(40, (-0.5, 0.5), torch.float32), Hist2dCounter((20, 10), ((-0.5, 0.5), (-2.0, 2.0)))
    found = {}
    for chunk in (fh.CHUNK, fh.DEVICE_CHUNK):
        c1, c2 = one.new_counts("cpu"), two.new_counts("cpu")
        if layer == "grad_batch":
            one.count_grad_batch(c1, grad_batch, chunk=chunk)
            two.count_grad_batch(c2, grad_batch, theta, chunk=chunk)
        else:
            one.count_outer(c1, x, delta, chunk=chunk, sparse=None)
            two.count_outer_dense(c2, x, delta, theta, chunk=chunk)
        found[chunk] = (one.finish(c1, 40, torch.float32), two.finish(c2))
    reference = hist1d_counts(64 * grad_batch.reshape(-1), 40, (-0.5, 0.5))
    assert torch.equal(found[fh.CHUNK][0], reference) and torch.equal(found[fh.DEVICE_CHUNK][0], reference)
    assert torch.equal(found[fh.CHUNK][1], found[fh.DEVICE_CHUNK][1]) and int(found[fh.CHUNK][1].sum()) == grad_batch.numel()
