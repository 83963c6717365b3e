"""How per-step results combine across ranks, in one process (no torch.distributed).

Two ranks are simulated: rank 1's flat buffer is recorded, rank 0's
all-reduce adds it. Each statistic's ``across_ranks`` on the two halves of a
batch (each half scaled for its own mean loss, ``grad_batch = g_i / B_r``)
must give what the statistic computes on the whole batch (``g_i / B``).
"""

from __future__ import annotations

import pytest
import torch

from cockpit_like.backends.distributed import RankReduction
from cockpit_like.backends.per_sample_stats import (
    AbsMax,
    DirectionalDots,
    Histogram1dCounts,
    Histogram2dCounts,
    Histogram1dTally,
    Histogram2dTally,
    SumOfSquares,
)

DTYPE = torch.float64


class _FakeRanks:
    """Rank ``rank`` of 2; rank 1 records its buffer, rank 0 adds the record (an all-reduce sum)."""

    world = 2

    def __init__(self, rank: int, record: dict):
        self.rank, self.record = rank, record

    def _all_reduce(self, buffer, step, what):
        if self.rank == 1:
            self.record["buffer"] = buffer.clone()
        else:
            buffer.add_(self.record["buffer"])


def _combine(results: list, batches: list[int], combine) -> object:
    """Run ``combine(result, reduction)`` on rank 1, then rank 0; rank 0's global result."""
    record = {}
    finished = {}
    for rank in (1, 0):
        reduction = RankReduction(_FakeRanks(rank, record), batches[rank], sum(batches), step=0, device="cpu")
        finish = combine(results[rank], reduction)
        reduction.run()
        finished[rank] = finish()
    return finished[0]


def test_reduction_parts():
    record, values = {}, {}
    for rank in (1, 0):
        reduction = RankReduction(_FakeRanks(rank, record), 3, 6, step=0, device="cpu")
        parts = {
            "sum": reduction.sum(torch.tensor([1.0, 2.0]) * (rank + 1)),
            "cat": reduction.cat(torch.arange(3, dtype=torch.float32) + 10 * rank),
            "max": reduction.max(torch.tensor([5, -1]) * (1 - 2 * rank)),
            "counts": reduction.sum(torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)),
        }
        mean = reduction.mean(torch.tensor(float(rank)))
        reduction.run()
        values[rank] = {key: part.value for key, part in parts.items()} | {"mean": mean()}
    got = values[0]
    assert torch.equal(got["sum"], torch.tensor([3.0, 6.0]))
    assert torch.equal(got["cat"], torch.tensor([0.0, 1, 2, 10, 11, 12]))
    assert got["cat"].dtype == torch.float32
    assert torch.equal(got["max"], torch.tensor([5, 1]))
    assert torch.equal(got["counts"], torch.tensor([[2, 4], [6, 8]])) and got["counts"].dtype == torch.int64
    assert got["mean"].item() == pytest.approx(0.5)  # (3 * 0 + 3 * 1) / 6


def _halves(stat, grads: torch.Tensor, params: list[torch.Tensor]):
    """The statistic of each half (scaled for its mean loss) and of the whole batch."""
    batch = grads.shape[0]

    def compute(rows):
        grad_batch = grads[rows] / grads[rows].shape[0]
        state = stat.init(params)
        state = stat.accumulate(state, 0, params[0], grad_batch)
        return stat.finalize(state)

    half = batch // 2
    return [compute(slice(0, half)), compute(slice(half, None))], compute(slice(None)), [half, batch - half]


@pytest.mark.parametrize(
    "stat",
    [
        SumOfSquares(),
        AbsMax(),
        Histogram1dCounts(7, (-1.0, 1.0)),
        Histogram2dCounts((4, 3), ((-1.0, 1.0), (-2.0, 2.0))),
        Histogram1dTally(7, (-1.0, 1.0)),
        Histogram2dTally((4, 3), ((-1.0, 1.0), (-2.0, 2.0))),
        DirectionalDots("d", (torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(2)),)),
    ],
    ids=lambda stat: type(stat).__name__,
)
def test_statistic_of_halves_is_the_statistic_of_the_whole(stat):
    generator = torch.Generator().manual_seed(0)
    grads = torch.randn(6, 3, 4, dtype=DTYPE, generator=generator)  # per-sample gradients g_i
    params = [torch.randn(3, 4, dtype=DTYPE, generator=generator)]
    halves, whole, batches = _halves(stat, grads, params)
    combined = _combine(halves, batches, stat.across_ranks)
    _assert_same(combined, whole)
    # and the halves alone differ from the whole (the test can fail)
    assert not _same(halves[0], whole)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    a, b = torch.as_tensor(a, dtype=DTYPE), torch.as_tensor(b, dtype=DTYPE)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def _assert_same(a, b) -> None:
    assert _same(a, b), (a, b)


@pytest.mark.parametrize("form", ["grad_batch", "factors", "sequence"])
def test_gram_summary_ddp_form_uses_the_global_mean_gradient(form):
    """GramSummary's DDP form: row sums against the synchronised p.grad, concatenated over the ranks."""
    from cockpit_like.backends.per_sample_stats import GramSummary

    generator = torch.Generator().manual_seed(3)
    batch, out, inp, positions = 6, 3, 4, 2
    delta = torch.randn(batch, positions, out, dtype=DTYPE, generator=generator)
    x = torch.randn(batch, positions, inp, dtype=DTYPE, generator=generator)
    if form == "factors":
        delta, x = delta[:, :1], x[:, :1]
    grads = torch.einsum("bto,bti->boi", delta, x)  # per-sample gradients g_i
    param = torch.zeros(out, inp, dtype=DTYPE)
    param.grad = grads.mean(0)  # what DDP leaves in p.grad: the global mean gradient

    def compute(stat, rows):
        size = len(range(batch)[rows])
        d, xs = delta[rows] / size, x[rows]
        state = stat.init([param])
        if form == "grad_batch":
            state = stat.accumulate(state, 0, param, torch.einsum("bto,bti->boi", d, xs))
        elif form == "factors":
            state = stat.accumulate_factors(state, 0, param, "weight", xs[:, 0], d[:, 0])
        else:
            state = stat.accumulate_sequence(state, 0, param, d, xs)
        return stat.finalize(state)

    synced = GramSummary().for_ranks()
    assert synced == GramSummary() and synced.synced
    halves = [compute(synced, slice(0, 3)), compute(synced, slice(3, None))]
    combined = _combine(halves, [3, 3], synced.across_ranks)
    whole = compute(GramSummary(), slice(None))
    _assert_same(combined, whole)
    assert not _same(compute(GramSummary(), slice(0, 3))[1], whole[1][:3])


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_curvature_statistics_of_halves_are_those_of_the_whole(problem):
    """LayerLogs (KFAC's logs, means, covariances, raw logs, a statistic with its own merge) across two ranks."""
    from torch import nn

    from cockpit_like import Cockpit
    from cockpit_like.quantities import CurvatureStatistics
    from cockpit_like.statistics import Covariance, Log, Mean
    from cockpit_like.statistics.base import Statistic
    from cockpit_like.statistics.collect import LayerLogs, finalize_logs
    from cockpit_like.utils.schedules import linear
    from tests.helpers import make_batch, make_cnn, make_mlp

    class Largest(Statistic):
        """Elementwise max of the rows: a statistic whose merge is not a sum."""

        def init(self):
            return {"max": None, "count": 0}

        def update(self, state, values, count):
            largest = values.amax(0)
            if state["max"] is not None:
                largest = torch.maximum(state["max"], largest)
            return {"max": largest, "count": state["count"] + int(count)}

        def merge(self, state, other):
            if state["max"] is None:
                return other
            return {"max": torch.maximum(state["max"], other["max"]), "count": state["count"] + other["count"]}

        def finalize(self, state):
            return state["max"]

    config = {"forward": [Covariance, Mean, Largest], "backward": [Covariance, Log], "grad": [Mean, Covariance]}
    model = (make_mlp if problem == "mlp" else make_cnn)(seed=1)
    inputs, labels = make_batch(problem, 6, seed=4)

    def logs_of(rows):
        quantity = CurvatureStatistics(linear(1), statistics=config, window="step")
        cockpit = Cockpit(list(model.parameters()), quantities=[quantity], model=model)
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs[rows]), labels[rows])
        with cockpit(0, info={"batch_size": len(labels[rows]), "loss": loss}):
            loss.backward()
        return quantity.plan, quantity.plan.running

    plan, whole = logs_of(slice(None))
    halves = [logs_of(slice(0, 3))[1], logs_of(slice(3, None))[1]]
    stat = LayerLogs("test", plan)
    combined = _combine(halves, [3, 3], stat.across_ranks)
    got, expected = finalize_logs(plan.stats, combined), finalize_logs(plan.stats, whole)
    alone = finalize_logs(plan.stats, halves[0])

    def flat(tree, prefix=""):
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}/{key}").items()}
        return {prefix: tree}

    got, expected, alone = flat(got), flat(expected), flat(alone)
    assert got.keys() == expected.keys() and len(got) > 10
    for key in expected:
        if key.endswith("/Log"):  # raw rows: rank 0's then rank 1's, the order of the whole batch
            torch.testing.assert_close(got[key], expected[key], rtol=1e-12, atol=1e-14)
        else:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12, msg=key)
    assert any(not torch.allclose(alone[key], expected[key]) for key in expected if not key.endswith("/Log"))
    # counts add up too
    backward = combined["layers"][next(iter(combined["layers"]))]["backward"]
    assert {state["count"] for state in backward.values()} == {6}


@pytest.mark.parametrize("form", ["factors", "sequence"])
def test_kronecker_logs_of_weights_given_as_factors_of_halves_are_those_of_the_whole(form):
    """KFACTrace(curvature="empirical")'s logs (layers_from="factors"): a weight's forward/backward
    covariances and a bias's exact block (grad log) across two ranks equal those of the whole batch."""
    from cockpit_like.statistics import Covariance, finalize_logs
    from cockpit_like.statistics.collect import LayerLogs, StatisticsPlan

    generator = torch.Generator().manual_seed(5)
    batch, out, inp, positions = 6, 3, 4, 1 if form == "factors" else 3
    delta = torch.randn(batch, positions, out, dtype=DTYPE, generator=generator)  # output gradients of g_i
    x = torch.randn(batch, positions, inp, dtype=DTYPE, generator=generator)
    weight, bias = torch.zeros(out, inp, dtype=DTYPE), torch.zeros(out, dtype=DTYPE)
    config = {"forward": [Covariance], "backward": [Covariance], "grad": [Covariance(max_dim=8, skip_longer=True)]}
    plan = StatisticsPlan(config, window="step", layers_from="factors")
    stat = LayerLogs("kfac", plan)

    def compute(rows):
        d, xs = delta[rows] / delta[rows].shape[0], x[rows]  # each part scaled for its own mean loss
        state = stat.init([weight, bias])
        if form == "factors":
            state = stat.accumulate_factors(state, 0, weight, "weight", xs[:, 0], d[:, 0])
            state = stat.accumulate_factors(state, 1, bias, "bias", None, d[:, 0])
        else:
            state = stat.accumulate_sequence(state, 0, weight, d, xs)
            state = stat.accumulate(state, 1, bias, d.sum(1))
        return stat.finalize(state)

    combined = _combine([compute(slice(0, 3)), compute(slice(3, None))], [3, 3], stat.across_ranks)
    got, expected = finalize_logs(plan.stats, combined), finalize_logs(plan.stats, compute(slice(None)))
    assert list(got["layers"]) == ["param0"] and list(got["grad"]) == ["param1"]
    a, b = delta.reshape(-1, out), x.reshape(-1, inp)
    g_bias = delta.sum(1)
    for value, reference in [
        (expected["layers"]["param0"]["backward"]["covariance"], a.T @ a / batch),  # G = (1/B) sum (B delta)(B delta)^T
        (expected["layers"]["param0"]["forward"]["covariance"], b.T @ b / (batch * positions)),
        (expected["grad"]["param1"]["covariance"], g_bias.T @ g_bias / batch),
    ]:
        torch.testing.assert_close(value, reference, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    # the weight (12 entries > max_dim 8) given as grad_batch is left out of the grad log
    state = stat.accumulate(stat.init([weight]), 0, weight, torch.einsum("bto,bti->boi", delta, x))
    assert stat.finalize(state)["grad"] == {} and stat.finalize(state)["layers"] == {}


class _TwoRanks:
    world, rank = 2, 0


def _reductions():
    """A step split across two ranks, into two micro-batches in one process, and both."""
    from cockpit_like.backends.partitions import Reduction

    return {
        "ranks under DistributedDataParallel": Reduction([4], 8, ranks=_TwoRanks()),
        "micro-batches (info['micro_batches']": Reduction([2, 2], 4),
        "micro-batches on ranks under DistributedDataParallel": Reduction([2, 2], 8, ranks=_TwoRanks()),
    }


def test_ekfac_statistics_refuse_split_steps_with_a_clear_error():
    from cockpit_like.statistics.collect import LayerLogs, StatisticsPlan

    plan = StatisticsPlan("ekfac")
    for said, reduction in _reductions().items():
        with pytest.raises(NotImplementedError, match="statistics='kfac'") as raised:
            LayerLogs("x", plan).across_ranks({"layers": {}, "grad": {}, "bases": {"l": None}}, reduction=reduction)
        assert f"split into {said}" in str(raised.value)


def test_self_influence_refuses_split_steps_by_name():
    from cockpit_like.quantities.curvature_statistics import RetainedForInfluence

    for said, reduction in _reductions().items():
        with pytest.raises(NotImplementedError, match="SelfInfluence on a step split into") as raised:
            RetainedForInfluence(key="k").across_ranks({}, reduction=reduction)
        assert said in str(raised.value) and ("DistributedDataParallel" in said) == ("DistributedDataParallel" in str(raised.value))


def test_alpha_without_an_elementwise_optimizer_names_the_split_and_the_fix():
    from cockpit_like.backends.per_sample_stats import PredictedSlopes

    for said, reduction in _reductions().items():
        with pytest.raises(NotImplementedError, match="needs an element-wise optimizer") as raised:
            PredictedSlopes("k").across_ranks({"mode": "retained"}, reduction)
        assert f"split into {said}" in str(raised.value) and "info['optimizer']" in str(raised.value)
