"""Hutch++ for the curvature diagonal on the engine's Lanczos space (issue 37, item 4).

``curvature="hutch++"`` (what ``"auto"`` picks where BackPACK cannot run):
the Hessian diagonal exact on the step's Lanczos space, Hutchinson on the
rest. Checked against the dense Hessian (``torch.func.hessian``, float64):
unbiased over every sign vector, exact on an invariant space, the quantity
equal to its dense twin with the same draws, the standard error stored.
"""

from __future__ import annotations

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.backends.curvature_engine import DEFAULT_PROBES, DEFAULT_RTOL, rademacher, start_vectors, step_generator
from cockpit_like.functional.krylov import deflated_diagonal, lanczos_decomposition
from cockpit_like.quantities import HessMaxEV, HessTrace, TICTrace
from cockpit_like.utils import schedules
from tests.helpers import block_sizes, dense_hessian, hutchinson_errors, make_batch, make_problem

DT = torch.float64


def _symmetric(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=generator, dtype=DT)
    return a + a.T


@pytest.mark.parametrize("products", [1, 2, 4])
def test_unbiased_over_every_sign_vector(products):
    n = 6
    matrix = _symmetric(n, products)
    K = lanczos_decomposition(lambda v: matrix @ v, torch.ones(1, n, dtype=DT), max_products=products, rtol=0.0)
    signs = torch.tensor([[1 - 2 * ((k >> j) & 1) for j in range(n)] for k in range(2**n)], dtype=DT)
    diagonal, estimates = deflated_diagonal(lambda v: matrix @ v, K, signs)
    torch.testing.assert_close(diagonal, torch.diagonal(matrix), rtol=1e-12, atol=1e-12)
    assert estimates.shape == (2**n, n)
    # a single draw is not exact (the test can fail): the Hutchinson part carries the rest
    single, _ = deflated_diagonal(lambda v: matrix @ v, K, signs[3:4])
    assert not torch.allclose(single, torch.diagonal(matrix))


def test_exact_when_the_space_is_invariant():
    matrix = _symmetric(7, 0)
    K = lanczos_decomposition(lambda v: matrix @ v, torch.ones(1, 7, dtype=DT), rtol=0.0)
    assert K.num_products == 7
    diagonal, _ = deflated_diagonal(lambda v: matrix @ v, K, torch.ones(1, 7, dtype=DT))
    torch.testing.assert_close(diagonal, torch.diagonal(matrix), rtol=1e-10, atol=1e-10)


def test_deflation_removes_the_variance_of_dominant_directions():
    """A Hessian-like spectrum (a few large outliers, a small bulk): the Krylov part removes most of the spread."""
    n = 200
    generator = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=DT))
    spectrum = torch.cat([torch.tensor([50.0, 30.0, -20.0], dtype=DT), 0.1 * torch.randn(n - 3, generator=generator, dtype=DT)])
    matrix = (q * spectrum) @ q.T
    draws = rademacher(8, n, DT, "cpu", step_generator(0, "test"))
    K = lanczos_decomposition(lambda v: matrix @ v, rademacher(2, n, DT, "cpu", step_generator(0, "p")), rtol=1e-2, probes=2)
    _, deflated = deflated_diagonal(lambda v: matrix @ v, K, draws)
    plain = draws * (draws @ matrix)  # Hutchinson, the same draws
    exact = torch.trace(matrix).item()
    assert deflated.sum(1).std() < 0.1 * plain.sum(1).std()
    estimate = (torch.trace(K.projection) + deflated.sum(1).mean()).item()
    assert abs(estimate - exact) < 0.05 * abs(plain.sum(1).mean().item() - exact) + 0.5


def _train_step(quantities, problem="mlp", batch=6):
    model, lossfunc, _ = make_problem(problem)
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    inputs, labels = make_batch(problem, batch, seed=2)
    hessian = dense_hessian(model, inputs, labels)
    loss = lossfunc(model(inputs), labels)
    with cockpit(0, info={"loss": loss, "batch_size": batch, "individual_losses": torch.nn.functional.cross_entropy(
            model(inputs), labels, reduction="none")}):  # fmt: skip
        loss.backward(create_graph=cockpit.create_graph(0))
    return model, hessian


def test_hess_trace_equals_its_dense_twin_with_the_same_draws_and_stores_its_error():
    trace = HessTrace(schedules.linear(1), curvature="hutch++")
    tic = TICTrace(schedules.linear(1), curvature="hutch++")
    model, hessian = _train_step([trace, tic])
    D = hessian.shape[0]
    probes = start_vectors(DEFAULT_PROBES, D, DT, "cpu", step_generator(0, "lanczos probes"))
    K = lanczos_decomposition(lambda v: hessian @ v, probes, rtol=DEFAULT_RTOL, probes=DEFAULT_PROBES)
    draws = rademacher(4, D, DT, "cpu", step_generator(0, "deflated diagonal"))
    diagonal, estimates = deflated_diagonal(lambda v: hessian @ v, K, draws)
    sizes = block_sizes(model)
    expected = [float(b.sum()) for b in diagonal.split(sizes)]
    assert trace.get_output()[0] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    # the error bars: the larger of the samples' and the bound from the deflated operator's products (dense)
    Q = K.basis[: K.num_products]
    outside = torch.eye(D, dtype=DT) - Q.T @ Q
    block_errors, total_error = hutchinson_errors(draws, draws @ (outside @ hessian @ outside), sizes)
    assert trace.standard_errors[0] == pytest.approx(block_errors, rel=1e-6, abs=1e-12)
    assert trace.total_errors[0] == pytest.approx(total_error, rel=1e-6)
    assert tic.standard_errors[0] > 0
    # the exact trace lies within a few standard errors of the estimate
    assert abs(sum(trace.get_output()[0]) - torch.trace(hessian).item()) <= 4 * total_error + 1e-8
    assert trace.settings() == {"curvature": "hutch++", "computed_with": "hutch++", "hutchinson_samples": 4}


def test_shares_the_decomposition_and_gives_the_same_value_alone_and_with_hessmaxev():
    alone = HessTrace(schedules.linear(1), curvature="hutch++")
    _train_step([alone])
    together, maxev = HessTrace(schedules.linear(1), curvature="hutch++"), HessMaxEV(schedules.linear(1))
    _train_step([maxev, together])
    assert alone.get_output()[0] == together.get_output()[0]
    assert alone.standard_errors[0] == together.standard_errors[0]


def test_hutchinson_stores_the_standard_errors_of_its_own_samples():
    """curvature='hutchinson' (the 'auto' choice off BackPACK): the block traces' standard errors of the same draws
    and products (the larger of the samples' and the bound from the products' squared norms), and TICTrace's."""
    trace = HessTrace(schedules.linear(1), curvature="hutchinson")
    tic = TICTrace(schedules.linear(1), curvature="hutchinson")
    model, hessian = _train_step([trace, tic])
    from cockpit_like.backends import randomness

    D = hessian.shape[0]
    draws = randomness.generator(0, "hutchinson diagonal")
    samples = [torch.randint(0, 2, (D,), generator=draws).to(DT) * 2 - 1 for _ in range(4)]
    estimates = torch.stack([v * (hessian @ v) for v in samples])
    sizes = block_sizes(model)
    blocks = torch.stack([e.sum(1) for e in estimates.split(sizes, dim=1)], dim=1)
    assert trace.get_output()[0] == pytest.approx(blocks.mean(0).tolist(), rel=1e-8, abs=1e-12)
    signs = torch.stack(samples)
    block_errors, total_error = hutchinson_errors(signs, signs @ hessian, sizes)
    assert trace.standard_errors[0] == pytest.approx(block_errors, rel=1e-8, abs=1e-12)
    assert trace.total_errors[0] == pytest.approx(total_error, rel=1e-8)
    total = blocks.sum(1).mean().item()
    numerator = tic.get_output()[0] * (total + 1e-7)
    assert tic.standard_errors[0] == pytest.approx(abs(numerator) / (total + 1e-7) ** 2 * total_error, rel=1e-6)


def test_the_benchmark_scripts_run_end_to_end(tmp_path):
    """``benchmarks/trace_estimators.py`` (the command that regenerates docs/curvature.md's table) and
    ``benchmarks/ggn_control_variate.py`` over one small model: every model runs (a refactor once left
    ``run_model`` with an undefined name, and the regeneration failed on every model), and where the GGN
    diagonal is exact the cockpit's TIC is the script's dense reference."""
    import json

    from benchmarks import ggn_control_variate, trace_estimators

    trace_estimators.main(["--only", "zoo/custom", "--steps", "2", "--json", str(tmp_path / "t.json")])
    found = json.loads((tmp_path / "t.json").read_text())
    assert found["failures"] == [] and len(found["rows"]) == 2
    auto = "ggn ('auto', new default)"
    for row in found["rows"]:
        tic = row["tic"][auto]
        assert tic["tic_diag"]["standard_error"] == 0.0  # 3 classes: the exact diagonal
        assert tic["tic_diag"]["value"] == pytest.approx(row["exact_ggn_tic_diag"], rel=1e-8)
        assert tic["tic_trace"]["value"] == pytest.approx(row["exact_ggn_tic_trace"], rel=1e-8)
    ggn_control_variate.main(["--only", "zoo/custom", "--steps", "2", "--json", str(tmp_path / "g.json")])
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert len(rows) == 2
    for row, other in zip(rows, found["rows"]):
        assert row["trace_h"] == pytest.approx(other["exact_trace"], rel=1e-10)  # two scripts, one exact trace
        assert row["trace_h"] == pytest.approx(row["trace_g"] + row["trace_h_minus_g"], rel=1e-9, abs=1e-12)


def test_the_error_bar_benchmark_runs_end_to_end(tmp_path):
    """``benchmarks/trace_error_bars.py`` (the command that regenerates docs/curvature.md's coverage table) on one
    small held-out model: every variant of the error bar is measured on the same draws, the stored error is the
    larger of the samples' and the products' bound, and the table is written between its markers."""
    import json

    from benchmarks import trace_error_bars

    docs = tmp_path / "doc.md"
    docs.write_text(f"before\n{trace_error_bars.BEGIN}\nold\n{trace_error_bars.END}\nafter\n")
    trace_error_bars.main(["--sets", "held-out", "--only", "depthwise", "--steps", "1", "--held-out-seeds", "3",
                           "--json", str(tmp_path / "e.json"), "--docs", str(docs)])
    found = json.loads((tmp_path / "e.json").read_text())
    assert found["failures"] == [] and len(found["sets"]["held-out"]) == 1
    row = found["sets"]["held-out"][0]
    for method in trace_error_bars.ESTIMATORS:
        assert len(row["seeds"][method]) == 3
        for draw in row["seeds"][method]:
            assert draw["errors"] == pytest.approx(max(draw["sample_errors"], draw["product_errors"]), rel=1e-12)
    assert set(found["summary"]["held-out"]["hutch++"]) == set(trace_error_bars.VARIANTS)
    text = docs.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text and "depthwise_silu" in text


def test_the_exact_part_in_blocks_of_columns_equals_it_in_one(monkeypatch):
    """The exact part is computed in blocks of columns (its temporaries stay small): 3 blocks give the one-block
    value, with a decomposition that has not-yet-multiplied rows (the ``E^T R`` term)."""
    from cockpit_like.functional import krylov

    n = 2500
    generator = torch.Generator().manual_seed(3)
    low = torch.randn(n, 4, generator=generator, dtype=DT)
    scale = torch.rand(n, generator=generator, dtype=DT)

    def matvec(v):
        return scale * v + low @ (low.T @ v)

    K = lanczos_decomposition(matvec, rademacher(2, n, DT, "cpu", step_generator(0, "p")), max_products=6, rtol=0.0, probes=2)
    assert K.basis.shape[0] > K.num_products  # rows not yet multiplied: the E^T R term is there
    draws = rademacher(2, n, DT, "cpu", step_generator(0, "d"))
    monkeypatch.setattr(krylov, "_DIAGONAL_BLOCK", 1 << 30)
    whole, _ = deflated_diagonal(matvec, K, draws)
    monkeypatch.setattr(krylov, "_DIAGONAL_BLOCK", 1)  # width 1024: 3 blocks
    blocks, _ = deflated_diagonal(matvec, K, draws)
    torch.testing.assert_close(blocks, whole, rtol=1e-12, atol=1e-12)
    # and the exact part is the formula's: diag(Q^T T Q) + 2 diag(Q^T E^T R)
    m = K.num_products
    Q, R = K.basis[:m], K.basis[m:]
    E = K.coefficients[m : m + R.shape[0], :m]
    exact = (Q * (K.projection @ Q)).sum(0) + 2 * (Q * (E.T @ R)).sum(0)
    empty = torch.zeros(0, n, dtype=DT)
    torch.testing.assert_close(deflated_diagonal(matvec, K, empty)[0], exact, rtol=1e-12, atol=1e-12)
