"""benchmarks/full_bound.py: the bound of full every 10th step from its measured parts."""

from __future__ import annotations

import statistics

import pytest

from benchmarks import full_bound


def test_bound_is_assembled_from_the_measured_parts(capsys):
    result = full_bound.measure("mlp", repeats=1, steps=2)
    assert len(result["products"]) == 2 and all(2 <= p <= 100 for p in result["products"])
    p, g, h = result["plain_s"], result["graph_s"], result["hvp_s"]
    used = statistics.median(result["products"])
    assert result["bound_ratio"] == pytest.approx(1 + (g - p + used * h) / (10 * p))
    assert result["bound_ratio_at_target_products"] == pytest.approx(
        1 + (g - p + full_bound.TARGET_PRODUCTS["mlp"] * h) / (10 * p))
    assert result["tracked_step_plain_steps"] == pytest.approx((g + used * h) / p)
    assert result["engine_s"] >= 0  # the solves' time less their products' (the engine's own work)
    assert "| mlp | 128 |" in full_bound.table([result]) and full_bound.table([result]).endswith(" ms |")


def test_unknown_problems_are_named():
    with pytest.raises(SystemExit):
        full_bound.main(["--problems", "mlp,vgg"])
    with pytest.raises(SystemExit):
        full_bound.main(["--repeats", "0"])
