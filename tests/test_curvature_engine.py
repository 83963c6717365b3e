"""The shared Lanczos engine and the curvature quantities on it, against float64 dense references.

References: ``torch.linalg.eigvalsh`` of dense matrices (the functional
layer) and of the dense Hessian ``torch.func.hessian`` of the mean loss (the
quantities), with the probes reproduced from the same torch RNG state.
"""

import math

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.backends import curvature_engine
from cockpit_like.functional.krylov import (
    deflated_trace,
    gaussian_density,
    lanczos_decomposition,
    quadrature_moments,
)
from cockpit_like.quantities import HessEigenvalues, HessMaxEV, HessSpectralDensity, HessTraceEstimate
from cockpit_like.utils import schedules
from tests.helpers import dense_hessian, make_batch, make_mlp, make_problem

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")
DT = torch.float64


def random_symmetric(eigenvalues, seed=0):
    generator = torch.Generator().manual_seed(seed)
    n = len(eigenvalues)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=DT))
    return q @ torch.diag(torch.tensor(eigenvalues, dtype=DT)) @ q.T


def rademacher_rows(count, n, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (count, n), generator=generator) * 2 - 1).to(DT)


# ---- functional: the decomposition -----------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extreme_ritz_values_and_error_bounds_against_eigvalsh(seed):
    generator = torch.Generator().manual_seed(seed)
    n = 80
    matrix = torch.randn(n, n, generator=generator, dtype=DT)
    matrix = matrix + matrix.T
    exact = torch.linalg.eigvalsh(matrix)
    K = lanczos_decomposition(lambda v: matrix @ v, rademacher_rows(1, n, seed), rtol=1e-10)
    assert K.converged and K.num_products <= n
    values = K.ritz_values()
    assert values[-1].item() == pytest.approx(exact[-1].item(), rel=1e-8)
    assert values[0].item() == pytest.approx(exact[0].item(), rel=1e-8)
    # every residual is a rigorous bound: an eigenvalue lies within it of each Ritz value
    early = lanczos_decomposition(lambda v: matrix @ v, rademacher_rows(1, n, seed), max_products=12, rtol=1e-14)
    nearest = (early.ritz_values().reshape(-1, 1) - exact.reshape(1, -1)).abs().min(dim=1).values
    assert bool((nearest <= early.residuals() * (1 + 1e-8) + 1e-10).all())
    # the residual is that of the Ritz vector, computed densely
    x = early.ritz_vector(-1)
    dense_residual = (matrix @ x - early.ritz_values()[-1] * x).norm()
    assert dense_residual.item() == pytest.approx(early.residuals()[-1].item(), rel=1e-6)


def test_whole_space_is_exact_and_block_start():
    spectrum = [4.0, 3.0, 1.0, 0.5, -0.2, -2.0]
    matrix = random_symmetric(spectrum, seed=3)
    K = lanczos_decomposition(lambda v: matrix @ v, rademacher_rows(1, 6, 0), rtol=0.0)
    assert K.converged and K.num_products == 6
    torch.testing.assert_close(K.ritz_values(), torch.tensor(sorted(spectrum), dtype=DT))
    # a block start with an exact eigenvector: the top Ritz value is exact at once
    top = torch.linalg.eigh(matrix)[1][:, -1]
    block = torch.stack([rademacher_rows(1, 6, 1)[0], top])
    K = lanczos_decomposition(lambda v: matrix @ v, block, probes=1, max_products=2, rtol=0.0)
    assert K.num_products == 2 and K.ritz_values()[-1].item() == pytest.approx(4.0, rel=1e-12)
    with pytest.raises(ValueError, match="non-zero"):
        lanczos_decomposition(lambda v: v, torch.zeros(1, 3, dtype=DT))


def test_quadrature_moments_are_the_probes_moments():
    """Gauss quadrature of the probe u: sum_i w_i theta_i^j = u^T A^j u for j <= 2k - 1 (k products)."""
    n, k = 60, 6
    generator = torch.Generator().manual_seed(4)
    matrix = torch.randn(n, n, generator=generator, dtype=DT)
    matrix = (matrix + matrix.T) / 4
    probe = rademacher_rows(1, n, 5)
    K = lanczos_decomposition(lambda v: matrix @ v, probe, max_products=k, rtol=1e-14)
    nodes, weights = K.quadrature()
    assert weights.sum().item() == pytest.approx(1.0, rel=1e-12)
    u = probe[0] / probe[0].norm()
    exact = torch.stack([u @ torch.linalg.matrix_power(matrix, j) @ u for j in range(2 * k)])
    torch.testing.assert_close(quadrature_moments(nodes, weights, 2 * k - 1), exact, rtol=1e-9, atol=1e-10)
    assert (n * K.probe_traces()).item() == pytest.approx((probe[0] @ matrix @ probe[0]).item(), rel=1e-10)
    # smoothing keeps the mass
    grid = torch.linspace(-30, 30, 6001, dtype=DT)
    density = gaussian_density(nodes, weights, grid, width=0.3)
    assert (density.sum() * (grid[1] - grid[0])).item() == pytest.approx(1.0, rel=1e-6)


def test_slq_moments_estimate_the_spectral_density_moments():
    """Averaged over probes, the quadrature's moments estimate tr(A^j) / n (unbiased)."""
    n = 50
    matrix = random_symmetric(torch.linspace(-1, 2, n).tolist(), seed=6)
    probes = rademacher_rows(400, n, 7)
    estimates = []
    for row in probes:
        K = lanczos_decomposition(lambda v: matrix @ v, row.reshape(1, -1), max_products=8, rtol=1e-14)
        estimates.append(quadrature_moments(*K.quadrature(), 4))
    estimate = torch.stack(estimates).mean(0)
    exact = torch.stack([torch.trace(torch.linalg.matrix_power(matrix, j)) / n for j in range(5)])
    torch.testing.assert_close(estimate, exact, rtol=0.05, atol=0.02)


def test_deflated_trace_is_unbiased_and_exact_on_the_whole_space():
    spectrum = [50.0, 30.0, 20.0] + torch.linspace(-1, 1, 37).tolist()
    matrix = random_symmetric(spectrum, seed=8)
    n = len(spectrum)
    exact = sum(spectrum)
    full = lanczos_decomposition(lambda v: matrix @ v, rademacher_rows(1, n, 0), rtol=0.0)
    estimate, _ = deflated_trace(lambda v: matrix @ v, full, rademacher_rows(2, n, 1))
    assert estimate == pytest.approx(exact, rel=1e-9)
    hutchpp, hutchinson = [], []
    for seed in range(200):
        K = lanczos_decomposition(lambda v: matrix @ v, rademacher_rows(1, n, seed), max_products=5, rtol=1e-14)
        hutchpp.append(deflated_trace(lambda v: matrix @ v, K, rademacher_rows(3, n, 1000 + seed))[0])
        g = rademacher_rows(8, n, 2000 + seed)  # Hutchinson with as many products
        hutchinson.append(float(torch.einsum("ki,ij,kj->k", g, matrix, g).mean()))
    hutchpp, hutchinson = torch.tensor(hutchpp), torch.tensor(hutchinson)
    assert hutchpp.mean().item() == pytest.approx(exact, abs=4 * hutchpp.std().item() / math.sqrt(200))
    assert hutchpp.std() < hutchinson.std() / 5  # the dominant directions are deflated


# ---- the quantities against the dense Hessian -----------------------------------------------
def _run(problem, quantities, batch_size=5, seed=0, steps=(0,), bias=True):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    hessians, states = {}, {}
    for step in steps:
        inputs, labels = make_batch(problem, batch_size, seed=seed + step)
        loss = lossfunc(model(inputs), labels)
        torch.manual_seed(100 + step)
        states[step] = torch.get_rng_state()
        with cockpit(step, info={"loss": loss, "batch_size": batch_size}):
            loss.backward(create_graph=cockpit.create_graph(step))
        hessians[step] = dense_hessian(model, inputs, labels)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad.detach())
                p.grad = None
    return cockpit, hessians, states


@pytest.mark.parametrize("problem,bias", [("mlp", True), ("mlp", False), ("cnn", True), ("cnn", False)])
def test_eigenvalues_against_dense_hessian(problem, bias):
    tight = HessEigenvalues(schedules.linear(1), rtol=1e-10)
    default = HessMaxEV(schedules.linear(1))
    largest = HessMaxEV(schedules.linear(1), use_power=False)
    cockpit, hessians, _ = _run(problem, [tight, default, largest], steps=(0, 1, 2), bias=bias)
    for step, hessian in hessians.items():
        exact = torch.linalg.eigvalsh(hessian)
        value = tight.get_output()[step]
        assert value["largest"] == pytest.approx(exact[-1].item(), rel=1e-8)
        assert value["smallest"] == pytest.approx(exact[0].item(), rel=1e-8, abs=1e-10)
        assert value["converged"] and value["products"] == tight.hvp_counts[step]
        magnitude = exact[exact.abs().argmax()].item()
        # the default tolerance: within 1% of the exact eigenvalue (Cockpit's power iteration: 2e-2)
        assert default.get_output()[step] == pytest.approx(magnitude, rel=1e-2)
        assert largest.get_output()[step] == pytest.approx(exact[-1].item(), rel=1e-2)
        assert default.converged[step]


def test_negative_dominant_eigenvalue_is_reported_like_cockpit():
    """Both ends converge, so the eigenvalue of largest magnitude (Cockpit's target) is found when negative."""
    matrix = random_symmetric([1.0, 0.5, -3.0, 0.1], seed=2)
    K = lanczos_decomposition(lambda v: matrix @ v, rademacher_rows(1, 4, 0), rtol=0.0)
    values = K.ritz_values()
    assert values[0].item() == pytest.approx(-3.0) and values[-1].item() == pytest.approx(1.0)


def test_spectral_density_and_traces_against_the_dense_twin():
    """Same probes (the cockpit's generator of the step): the stored quadrature is the dense Hessian's for
    those probes (averaged), the Hutchinson trace is the mean of D u^T H u, and Hutch++ is the dense twin
    with the same draws."""
    density = HessSpectralDensity(schedules.linear(1), rtol=1e-10)
    hutchpp = HessTraceEstimate(schedules.linear(1), rtol=1e-10, samples=3)
    hutchinson = HessTraceEstimate(schedules.linear(1), rtol=1e-10, method="hutchinson")
    cockpit, hessians, states = _run("mlp", [density, hutchpp, hutchinson], batch_size=4, steps=(0, 1))
    for step, hessian in hessians.items():
        D = hessian.shape[0]
        P = curvature_engine.DEFAULT_PROBES
        probe = curvature_engine.start_vectors(P, D, DT, "cpu", curvature_engine.step_generator(step, "lanczos probes"))
        samples = curvature_engine.rademacher(3, D, DT, "cpu", curvature_engine.step_generator(step, "hutch++"))
        twin = lanczos_decomposition(lambda v: hessian @ v, probe, rtol=1e-10)
        value = density.get_output()[step]
        assert value["dimension"] == D and len(value["nodes"]) == twin.num_products
        nodes, weights = torch.tensor(value["nodes"], dtype=DT), torch.tensor(value["weights"], dtype=DT)
        units = probe / math.sqrt(D)
        moments = torch.stack([
            torch.stack([u @ torch.linalg.matrix_power(hessian, j) @ u for u in units]).mean() for j in range(6)
        ])
        torch.testing.assert_close(quadrature_moments(nodes, weights, 5), moments, rtol=1e-7, atol=1e-10)
        expected_hutchinson = torch.stack([r @ hessian @ r for r in probe]).mean().item()
        assert hutchinson.get_output()[step]["trace"] == pytest.approx(expected_hutchinson, rel=1e-8)
        expected, _ = deflated_trace(lambda v: hessian @ v, twin, samples)
        out = hutchpp.get_output()[step]
        assert out["trace"] == pytest.approx(expected, rel=1e-7)
        assert out["products"] == twin.num_products + 3
        # and against the exact trace: within a few standard errors
        assert abs(out["trace"] - torch.trace(hessian).item()) <= 5 * out["standard_error"] + 1e-6


def _all_quantities():
    return {
        "HessMaxEV": HessMaxEV(schedules.linear(1)),
        "HessEigenvalues": HessEigenvalues(schedules.linear(1)),
        "HessSpectralDensity": HessSpectralDensity(schedules.linear(1)),
        "HessTraceEstimate": HessTraceEstimate(schedules.linear(1)),
    }


def test_tracked_together_share_products_and_give_the_numbers_of_each_alone(monkeypatch):
    calls = []
    original = curvature_engine.hessian_vector_product

    def counting(params, owner):
        matvec = original(params, owner)

        def counted(v):
            calls.append(1)
            return matvec(v)

        return counted

    monkeypatch.setattr(curvature_engine, "hessian_vector_product", counting)
    alone, alone_calls = {}, {}
    for name in _all_quantities():
        calls.clear()
        quantity = _all_quantities()[name]
        cockpit, _, _ = _run("cnn", [quantity], steps=(0, 1))
        alone[name] = cockpit.get_output()
        alone_calls[name] = len(calls)
    calls.clear()
    together = _all_quantities()
    cockpit, _, _ = _run("cnn", list(together.values()), steps=(0, 1))
    output = cockpit.get_output()
    for name in together:
        for step in (0, 1):
            assert output[step][name] == alone[name][step][name], name
    # one decomposition per step (+ Hutch++'s own samples): as many products as the trace alone
    assert len(calls) == alone_calls["HessTraceEstimate"]
    assert alone_calls["HessMaxEV"] == sum(together["HessMaxEV"].hvp_counts.values())
    assert len(calls) == alone_calls["HessMaxEV"] + 2 * 4


def test_warm_start_survives_resume():
    def quantity():
        return HessEigenvalues(schedules.linear(1), warm_start=True)

    straight = quantity()
    _run("mlp", [straight], steps=(0, 1, 2))
    first = quantity()
    _run("mlp", [first], steps=(0, 1))
    assert first.lanczos_need().warm is not None
    resumed = quantity()
    resumed.load_state_dict(first.state_dict())
    assert resumed.lanczos_need() == first.lanczos_need()
    # continue at step 2 from the parameters the straight run had there
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[resumed])
    reference_model = _model_after("mlp", steps=2)
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference_model.parameters()):
            p.copy_(q)
    inputs, labels = make_batch("mlp", 5, seed=2)
    loss = lossfunc(model(inputs), labels)
    torch.manual_seed(102)
    with cockpit(2, info={"loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(2))
    assert resumed.get_output()[2] == straight.get_output()[2]
    assert resumed.hvp_counts[2] == straight.hvp_counts[2]


def _model_after(problem, steps):
    model, lossfunc, _ = make_problem(problem)
    for step in range(steps):
        inputs, labels = make_batch(problem, 5, seed=step)
        loss = lossfunc(model(inputs), labels)
        loss.backward(create_graph=True)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad.detach())
                p.grad = None
    return model


def test_arguments_and_settings():
    with pytest.raises(ValueError, match="probes"):
        HessSpectralDensity(schedules.linear(1), probes=0)
    with pytest.raises(ValueError, match="rtol"):
        HessEigenvalues(schedules.linear(1), rtol=0.0)
    with pytest.raises(ValueError, match="method"):
        HessTraceEstimate(schedules.linear(1), method="exact")
    with pytest.warns(FutureWarning, match="atol"):
        HessMaxEV(schedules.linear(1), atol=1e-3)
    assert HessTraceEstimate(schedules.linear(1)).settings() == {
        "max_products": 100, "rtol": 1e-2, "probes": 2, "warm_start": False, "method": "hutch++", "samples": 4
    }
    quantity = HessEigenvalues(schedules.linear(2))
    assert quantity.create_graph(0) and not quantity.create_graph(1)
    assert quantity.curvature_needs(1) == [] and quantity.curvature_needs(0) == [quantity.lanczos_need()]


def test_spectral_density_instrument_draws_the_logged_quadrature(tmp_path):
    from matplotlib.figure import Figure

    from cockpit_like import instruments

    density = HessSpectralDensity(schedules.linear(1))
    cockpit, _, _ = _run("mlp", [density, HessMaxEV(schedules.linear(1))], steps=(0, 1, 2))
    path = cockpit.write(tmp_path / "run")
    fig = Figure(figsize=(4, 3))
    ax = instruments.hess_spectral_density_gauge(path, fig, fig.add_gridspec(1, 1)[0, 0])
    curves = {line.get_gid(): line for line in ax.lines if str(line.get_gid()).startswith("density:")}
    assert {"density:0", "density:1", "density:2", "density:extreme"} <= set(curves)
    last = density.get_output()[2]
    x, y = curves["density:2"].get_xdata(), curves["density:2"].get_ydata()
    assert x.min() < min(last["nodes"]) and x.max() > max(last["nodes"])
    assert abs(float((y[1:] * (x[1:] - x[:-1])).sum()) - 1.0) < 0.02  # a probability density
    extremes = sorted(line.get_xdata()[0] for line in ax.lines if line.get_gid() == "density:extreme")
    assert extremes == pytest.approx([min(last["nodes"]), max(last["nodes"])])
    assert ax.get_yscale() == "log"
    fig.savefig(tmp_path / "density.png", dpi=110)
    assert (tmp_path / "density.png").stat().st_size > 5000
    # not tracked: a clear empty panel
    empty = Figure()
    cockpit, _, _ = _run("mlp", [HessMaxEV(schedules.linear(1))])
    ax = instruments.hess_spectral_density_gauge(cockpit.write(tmp_path / "other"), empty, empty.add_gridspec(1, 1)[0, 0])
    assert not [line for line in ax.lines if str(line.get_gid()).startswith("density:")]


def test_basis_grows_with_the_products_not_with_max_products():
    """A solve that stops after k products holds O(k) vectors, not max_products (memory on large models).

    The rows are reserved up to max_products on the CPU, but only those written take memory:
    tests/test_krylov_bookkeeping.py measures the resident memory."""
    n = 5000
    diagonal = torch.cat([torch.tensor([10.0, -8.0], dtype=DT), torch.linspace(-1, 1, n - 2, dtype=DT)])
    K = lanczos_decomposition(lambda v: diagonal * v, rademacher_rows(1, n, 0), max_products=1000, rtol=1e-2)
    assert K.converged and K.num_products < 60
    assert K.basis.shape[0] <= K.num_products + 1
    assert K.ritz_values()[-1].item() == pytest.approx(10.0, rel=1e-2)


@pytest.mark.parametrize("seed", [0, 2])
def test_freshly_initialised_bart_top_eigenvalue(seed):
    """The issue's case, small: a fresh BART-style encoder-decoder (float64). HessMaxEV (largest magnitude)
    and HessEigenvalues against Lanczos on the same exact products run to a tight tolerance from another
    start vector; within 1% at the default tolerance, of the right sign."""
    transformers = pytest.importorskip("transformers")
    from cockpit_like.backends.hvp import hessian_vector_product

    torch.manual_seed(seed)
    config = transformers.BartConfig(
        vocab_size=32, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=16,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    model = transformers.BartForConditionalGeneration(config).double()
    params = [p for p in model.parameters() if p.requires_grad]
    top, extremes = HessMaxEV(schedules.linear(1)), HessEigenvalues(schedules.linear(1))
    cockpit = Cockpit(params, quantities=[top, extremes], model=model)
    inputs, labels = torch.randint(4, 32, (4, 10)), torch.randint(4, 32, (4, 8))
    loss = model(input_ids=inputs, labels=labels).loss
    with cockpit(0, info={"loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    D = sum(p.numel() for p in params)
    start = torch.randn(1, D, dtype=DT, generator=torch.Generator().manual_seed(99))
    reference = lanczos_decomposition(hessian_vector_product(params), start, max_products=D, rtol=1e-9)
    exact = reference.ritz_values()
    assert reference.converged
    magnitude = exact[-1] if exact[-1].abs() >= exact[0].abs() else exact[0]
    assert top.get_output()[0] == pytest.approx(magnitude.item(), rel=1e-2)
    assert extremes.get_output()[0]["largest"] == pytest.approx(exact[-1].item(), rel=1e-2)
    assert extremes.get_output()[0]["smallest"] == pytest.approx(exact[0].item(), rel=1e-2)


@pytest.mark.parametrize("extended", [True, False])
def test_frozen_parameters_are_left_out_of_the_curvature_operator(extended):
    """A frozen parameter passed in Cockpit(model.parameters()) (as documented): the curvature quantities
    describe the Hessian of the trainable parameters, the submatrix of the dense float64 Hessian (its
    eigenvalues, spectral density, trace; the same draws of the cockpit's generator on a dense twin), and a
    frozen parameter's block of the diagonal is zero; before the fix the products raised
    ("One of the differentiated Tensors does not require grad")."""
    from cockpit_like.backends.randomness import generator
    from cockpit_like.quantities import HessTrace

    model, lossfunc, _ = make_problem("mlp") if extended else (make_mlp(), torch.nn.CrossEntropyLoss(), None)
    frozen = [1, 4]  # first layer's bias and the last layer's weight
    params = list(model.parameters())
    for index in frozen:
        params[index].requires_grad_(False)
    eigen = HessEigenvalues(schedules.linear(1), rtol=1e-10)
    density = HessSpectralDensity(schedules.linear(1), rtol=1e-10)
    hutchpp = HessTraceEstimate(schedules.linear(1), rtol=1e-10, samples=3)
    hutchinson = HessTraceEstimate(schedules.linear(1), rtol=1e-10, method="hutchinson")
    plain = HessMaxEV(schedules.linear(1), accelerate=False, rtol=1e-10, atol=0.0, max_iter=500)
    diagonal = HessTrace(schedules.linear(1), curvature="hutchinson", hutchinson_samples=3)
    quantities = [eigen, density, hutchpp, hutchinson, plain, diagonal]
    cockpit = Cockpit(params, quantities=quantities, **({} if extended else {"model": model}))
    inputs, labels = make_batch("mlp", 5, seed=0)
    loss = lossfunc(model(inputs), labels)
    with cockpit(0, info={"loss": loss, "batch_size": 5}):
        loss.backward(create_graph=cockpit.create_graph(0))
    assert cockpit.checks[0]["valid"] and len(cockpit.checks[0]["frozen"]) == 2
    full = dense_hessian(model, inputs, labels)
    sizes = [p.numel() for p in params]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    keep = torch.cat([torch.arange(s, s + n) for i, (s, n) in enumerate(zip(starts, sizes)) if i not in frozen])
    hessian = full[keep][:, keep]  # the trainable parameters' Hessian
    D = hessian.shape[0]
    exact = torch.linalg.eigvalsh(hessian)
    value = eigen.get_output()[0]
    assert value["largest"] == pytest.approx(exact[-1].item(), rel=1e-8)
    assert value["smallest"] == pytest.approx(exact[0].item(), rel=1e-8, abs=1e-10)
    assert plain.get_output()[0] == pytest.approx(exact[exact.abs().argmax()].item(), rel=1e-6)
    probe = curvature_engine.start_vectors(
        curvature_engine.DEFAULT_PROBES, D, DT, "cpu", curvature_engine.step_generator(0, "lanczos probes"))
    twin = lanczos_decomposition(lambda v: hessian @ v, probe, rtol=1e-10)
    out = density.get_output()[0]
    assert out["dimension"] == D and len(out["nodes"]) == twin.num_products
    units = probe / math.sqrt(D)
    moments = torch.stack([
        torch.stack([u @ torch.linalg.matrix_power(hessian, j) @ u for u in units]).mean() for j in range(6)
    ])
    nodes, weights = torch.tensor(out["nodes"], dtype=DT), torch.tensor(out["weights"], dtype=DT)
    torch.testing.assert_close(quadrature_moments(nodes, weights, 5), moments, rtol=1e-7, atol=1e-10)
    assert hutchinson.get_output()[0]["trace"] == pytest.approx(
        torch.stack([r @ hessian @ r for r in probe]).mean().item(), rel=1e-8)
    samples = curvature_engine.rademacher(3, D, DT, "cpu", curvature_engine.step_generator(0, "hutch++"))
    assert hutchpp.get_output()[0]["trace"] == pytest.approx(deflated_trace(lambda v: hessian @ v, twin, samples)[0], rel=1e-7)
    # Hutchinson's diagonal: the same draws on the trainable entries; a frozen parameter's block is zero
    draws = generator(0, "hutchinson diagonal", "cpu")
    estimate = torch.zeros(D, dtype=DT)
    for _ in range(3):
        v = torch.randint(0, 2, (D,), generator=draws).to(DT).mul_(2).sub_(1)
        estimate += v * (hessian @ v) / 3
    blocks = iter(estimate.split([n for i, n in enumerate(sizes) if i not in frozen]))
    expected = [0.0 if i in frozen else next(blocks).sum().item() for i in range(len(params))]
    assert diagonal.get_output()[0] == pytest.approx(expected, rel=1e-8, abs=1e-12)
