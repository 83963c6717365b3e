"""benchmarks/hessmaxev_products.py: the oracle stop reads exact prefixes of one decomposition."""

from __future__ import annotations

import pytest
import torch

from benchmarks.hessmaxev_products import _first_within, measure
from cockpit_like.functional.krylov import lanczos_decomposition


def _matrix(n: int = 60, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    values = torch.linspace(-3.0, 1.0, n, dtype=torch.float64)
    values[-1], values[-2] = 4.0, 3.7  # a top pair close together: several products to resolve
    return q @ torch.diag(values) @ q.T


@pytest.mark.parametrize("target", ["magnitude", "largest"])
def test_first_within_is_the_first_prefix_within_tolerance(target):
    a = _matrix()
    start = torch.ones(1, 60, dtype=torch.float64)
    start[0, ::2] = -1.0
    full = lanczos_decomposition(lambda v: a @ v, start, max_products=40, rtol=0.0)
    exact = torch.linalg.eigvalsh(a)
    reference = float(exact[-1]) if target == "largest" or exact[-1].abs() >= exact[0].abs() else float(exact[0])
    found = _first_within(full, reference, target, 1e-3)

    def error(m: int) -> float:  # a decomposition stopped after m products, made from scratch
        alone = lanczos_decomposition(lambda v: a @ v, start, max_products=m, rtol=0.0).ritz_values()
        low, high = float(alone[0]), float(alone[-1])
        estimate = high if target == "largest" or abs(high) >= abs(low) else low
        return abs(estimate - reference) / abs(reference)

    assert found is not None and found > 2
    assert error(found) <= 1e-3 < error(found - 1)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_measure_on_a_small_problem():
    torch.manual_seed(0)
    (row,) = measure("resnet", steps=1, batch_size=4, lr=0.05, tolerance=1e-2)
    oracle, reference = row["oracle"], row["reference"]
    assert 1 <= oracle["magnitude"] <= reference["products"]
    assert oracle["largest"] <= reference["products"] and oracle["warm"] is None
    assert row["engine"]["error"] < 1e-2 and row["engine"]["products"] >= oracle["magnitude"]
