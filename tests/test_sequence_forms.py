"""Statistics of per-sample gradients given as sequence factors ``gb_i = sum_t a_it b_it^T``, against ``gb`` itself."""

import pytest
import torch

from cockpit_like.backends.per_sample import PerSampleReducer, materialize_sequence
from cockpit_like.backends.per_sample_stats import (
    AbsMax,
    DirectionalDots,
    GramSummary,
    Histogram1dCounts,
    RetainedDense,
    RetainedFactors,
    RetainedGradBatch,
    RetainedSequence,
    SumOfSquares,
)
from cockpit_like.statistics import Covariance, LayerLogs, StatisticsPlan, finalize_logs


def _kronecker_logs() -> LayerLogs:
    """The curvature logs of every weight given as factors (KFACTrace(curvature="empirical")'s)."""
    plan = StatisticsPlan({"forward": [Covariance], "backward": [Covariance]}, window="step", layers_from="factors")
    return LayerLogs("sequence", plan)


def _kronecker_factors(stat: LayerLogs, result: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, A)``: the backward and forward covariances of the one logged weight."""
    (layer,) = finalize_logs(stat.plan.stats, result)["layers"].values()
    return layer["backward"]["covariance"], layer["forward"]["covariance"]


def _factors(batch, positions, rows, cols, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, positions, rows, generator=generator, dtype=torch.float64)
    b = torch.randn(batch, positions, cols, generator=generator, dtype=torch.float64)
    return a, b


def _dense(a, b, shape):
    return torch.einsum("btr,btc->brc", a, b).reshape(a.shape[0], *shape)


@pytest.mark.parametrize("positions,rows,cols", [(2, 6, 5), (9, 3, 4), (1, 4, 4)])  # both Gram branches, T = 1
def test_sequence_forms_equal_the_dense_path(positions, rows, cols):
    a, b = _factors(5, positions, rows, cols)
    param = torch.nn.Parameter(torch.randn(rows, cols, dtype=torch.float64))
    gb = _dense(a, b, param.shape)
    torch.testing.assert_close(materialize_sequence(a, b, param.shape), gb)
    direction = (torch.randn(rows, cols, dtype=torch.float64),)
    for stat in (GramSummary(), DirectionalDots("d", direction), _kronecker_logs()):
        assert stat.sequence_form
        by_factors = stat.finalize(stat.accumulate_sequence(stat.init([param]), 0, param, a, b))
        if isinstance(stat, LayerLogs):  # not gb's own function: check the defining sums instead
            factor_a, factor_b = _kronecker_factors(stat, by_factors)
            torch.testing.assert_close(factor_a, 5 * torch.einsum("btr,bts->rs", a, a))
            torch.testing.assert_close(factor_b, torch.einsum("btc,btd->cd", b, b) / (5 * positions))
            continue
        dense = stat.finalize(stat.accumulate(stat.init([param]), 0, param, gb))
        for x, y in zip(by_factors if isinstance(by_factors, tuple) else (by_factors,), dense if isinstance(dense, tuple) else (dense,)):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    kept = RetainedGradBatch().accumulate_sequence([None], 0, param, a, b)[0]
    assert isinstance(kept, RetainedSequence)
    torch.testing.assert_close(kept.batch_sum(), gb.sum(0))
    torch.testing.assert_close(kept.dots(direction[0]), gb.reshape(5, -1) @ direction[0].reshape(-1))


def test_the_reducer_materialises_once_and_keeps_factors_where_it_did_not():
    """With a statistic that needs grad_batch (a histogram) every statistic reads the materialised tensor
    (T times cheaper sums and dots); without one, the sequence forms run and Alpha keeps factors."""
    a, b = _factors(3, 4, 5, 2)
    param = torch.nn.Parameter(torch.zeros(5, 2, dtype=torch.float64))
    gb = _dense(a, b, param.shape)
    stats = [RetainedGradBatch(), GramSummary(), Histogram1dCounts(bins=8, range=(-2.0, 2.0)), SumOfSquares(), AbsMax()]
    calls = []
    original = GramSummary.accumulate_sequence
    GramSummary.accumulate_sequence = lambda self, *args, **kwargs: calls.append("sequence") or original(self, *args, **kwargs)
    try:
        reducer = PerSampleReducer(stats, [param], keep_grad_batch=False)
        reducer.reduce_sequence(param, a, b)
        results = reducer.results()
        assert calls == []
        assert isinstance(results[RetainedGradBatch()][0], RetainedDense)
        torch.testing.assert_close(results[RetainedGradBatch()][0].grad_batch, gb)
        torch.testing.assert_close(results[SumOfSquares()][0], (gb**2).sum(0))
        assert float(results[AbsMax()][0]) == pytest.approx(float(gb.abs().max()))
        reducer = PerSampleReducer([RetainedGradBatch(), GramSummary()], [param], keep_grad_batch=False)
        reducer.reduce_sequence(param, a, b)
        assert calls == ["sequence"]
        assert isinstance(reducer.results()[RetainedGradBatch()][0], RetainedSequence)
    finally:
        GramSummary.accumulate_sequence = original
    # one position: the 2-D factor form, as for BackPACK's linear path
    reducer = PerSampleReducer([RetainedGradBatch()], [param], keep_grad_batch=False)
    reducer.reduce_sequence(param, a[:, :1], b[:, :1])
    assert isinstance(reducer.results()[RetainedGradBatch()][0], RetainedFactors)


@pytest.mark.parametrize("with_histogram", [False, True])  # sequence factors only / grad_batch materialised
def test_a_batch_sum_read_anyway_is_made_once_and_the_probe_reads_it(with_histogram, monkeypatch):
    """GramSummary reads each layer's sum of rows; the reducer makes it once and the self-check's probe projects it
    (no pass over the rows of its own), with the same numbers as the probe on the rows and GramSummary alone."""
    from cockpit_like.backends import per_sample
    from cockpit_like.checks.probe import GradientProbe, probe_directions, project

    a, b = _factors(4, 6, 5, 3, seed=3)
    param = torch.nn.Parameter(torch.zeros(5, 3, dtype=torch.float64))
    gb = _dense(a, b, param.shape)
    made, rows_read = [], []
    original_sum = per_sample.sequence_sum
    monkeypatch.setattr(per_sample, "sequence_sum", lambda *args: made.append(1) or original_sum(*args))
    monkeypatch.setattr(GradientProbe, "accumulate_sequence", lambda *args: rows_read.append(1) or args[1])
    extra = [Histogram1dCounts(bins=8, range=(-2.0, 2.0))] if with_histogram else []
    probe = GradientProbe(seed=5)
    reducer = PerSampleReducer([GramSummary(), *extra, probe], [param], keep_grad_batch=False)
    reducer.reduce_sequence(param, a, b)
    results = reducer.results()
    assert rows_read == []
    assert len(made) == (0 if with_histogram else 1)
    total, absolute = results[probe][0]
    expected = float(project(gb.sum(0), probe_directions(5, 0, param.shape, "cpu")))
    assert float(total) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert float(absolute) == pytest.approx(abs(expected), rel=1e-12)
    alone = GramSummary().accumulate(None, 0, param, gb)
    for x, y in zip(results[GramSummary()], alone):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    # without a statistic that reads the sum, the probe reads the rows (its own sequence form)
    reducer = PerSampleReducer([DirectionalDots("d", (torch.ones(5, 3, dtype=torch.float64),)), GradientProbe(seed=5)],
                               [param], keep_grad_batch=False)
    reducer.reduce_sequence(param, a, b)
    assert rows_read == [1]
