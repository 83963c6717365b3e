"""The Lanczos stop rule never stores an unconverged Ritz value as converged (issue 37, item 1).

References are ``torch.linalg.eigvalsh`` of the dense matrices; the spectra
include those the issue reports (wav2vec2: 0.703, -0.670, 0.670, -0.667;
SegFormer: +7.95 and -7.89) in a random orthogonal basis with a bulk.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import stop_rule
from cockpit_like.backends.curvature_engine import DEFAULT_PROBES, start_vectors, step_generator
from cockpit_like.functional.krylov import lanczos_decomposition

DT = torch.float64
SPECTRA = stop_rule.synthetic_spectra()


def _starts(seed, probes=DEFAULT_PROBES, n=300):
    return start_vectors(probes, n, DT, "cpu", step_generator(seed, "lanczos probes"))


def _solve(leading, seed, n=300, probes=DEFAULT_PROBES, **options):
    """The engine's solve (its default block of probes) on a synthetic matrix, and the exact eigenvalues."""
    matrix = stop_rule.synthetic_matrix(leading, n, seed)
    K = lanczos_decomposition(lambda v: matrix @ v, _starts(seed, probes, n), probes=probes, **options)
    return matrix, torch.linalg.eigvalsh(matrix), K


@pytest.mark.parametrize("name", ["wav2vec2-like cluster", "segformer-like +-tie", "degenerate top pair",
                                  "top 1% above the second", "clustered negatives"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_converged_extremes_are_within_the_tolerance(name, seed):
    rtol = 1e-2
    _, exact, K = _solve(SPECTRA[name], seed, rtol=rtol)
    assert K.converged
    values, residuals = K.ritz_values(), K.error_bounds()
    tolerance = rtol * values.abs().max().item()
    # the rule's claim: both extreme residuals within the tolerance ...
    assert residuals[0].item() <= tolerance and residuals[-1].item() <= tolerance
    # ... and the extreme Ritz values within it of the extreme eigenvalues (interlacing: from inside)
    assert exact[-1].item() - tolerance <= values[-1].item() <= exact[-1].item() + 1e-12
    assert exact[0].item() - 1e-12 <= values[0].item() <= exact[0].item() + tolerance


def test_the_gap_estimate_and_one_probe_stop_wrong_the_default_rule_does_not():
    """On the wav2vec2-like spectrum (0.703, -0.670, 0.670, -0.667 and a bulk), from one probe, the old
    estimate min(r, r^2/gap) says 'within 1%' at prefixes whose extreme Ritz values are still off, and even the
    residual rule stops on the second eigenvalue when the probe is nearly orthogonal to the top one (seed 2:
    overlap 0.0015 against a typical 0.058). The default (two probes, residuals) is within the tolerance."""
    rtol = 1e-2
    fooled_estimate, fooled_one_probe = 0, 0
    for seed in range(8):
        matrix = stop_rule.synthetic_matrix(SPECTRA["wav2vec2-like cluster"], 300, seed)
        exact = torch.linalg.eigvalsh(matrix)

        def wrong(K):
            values = K.ritz_values()
            tolerance = rtol * values.abs().max().item()
            return abs(values[-1].item() - exact[-1].item()) > tolerance or abs(values[0].item() - exact[0].item()) > tolerance

        for m in range(2, 12):  # prefixes of one-probe solves
            K = lanczos_decomposition(lambda v: matrix @ v, _starts(seed, 1), max_products=m, rtol=0.0, probes=1)
            tolerance = rtol * K.ritz_values().abs().max().item()
            estimates = K.error_estimates()
            fooled_estimate += wrong(K) and estimates[0].item() <= tolerance and estimates[-1].item() <= tolerance
        one = lanczos_decomposition(lambda v: matrix @ v, _starts(seed, 1), rtol=rtol, probes=1)
        fooled_one_probe += one.converged and wrong(one)
        default = lanczos_decomposition(lambda v: matrix @ v, _starts(seed), rtol=rtol, probes=DEFAULT_PROBES)
        assert default.converged and not wrong(default), seed
    assert fooled_estimate > 0 and fooled_one_probe > 0  # the failures the defaults avoid do occur here


def test_an_exhausted_budget_says_so_with_the_products_used():
    _, _, K = _solve(SPECTRA["flat bulk only"], 0, rtol=1e-6, max_products=7)
    assert not K.converged and K.num_products == 7


def test_an_invariant_space_is_exact():
    matrix = torch.diag(torch.tensor([3.0, -1.0, 0.5], dtype=DT))
    K = lanczos_decomposition(lambda v: matrix @ v, torch.ones(1, 3, dtype=DT), rtol=0.0)
    assert K.converged and K.num_products == 3
    torch.testing.assert_close(K.ritz_values(), torch.tensor([-1.0, 0.5, 3.0], dtype=DT))


def test_benchmark_lists_forty_models_and_regenerates_its_table(tmp_path, capsys):
    assert stop_rule.main(["--dry-run"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) >= 40 and any(line.startswith("held-out") for line in listed)
    docs = tmp_path / "curvature.md"
    docs.write_text(f"before\n{stop_rule.BEGIN}\nold\n{stop_rule.END}\nafter\n")
    out = tmp_path / "rows.json"
    argv = ["--only", "synthetic/one outlier", "--steps", "1", "--synthetic-size", "60", "--json", str(out), "--docs", str(docs)]
    assert stop_rule.main(argv) == 0
    text = docs.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| synthetic/one outlier | dev | 60 |" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["within"] and rows[0]["converged"]


def test_benchmark_groups_select_the_outside_testers_models(capsys):
    assert stop_rule.main(["--dry-run", "--groups", "outside-4"]) == 0
    listed = capsys.readouterr().out.strip().splitlines()
    assert len(listed) >= 20 and all(line.startswith("outside-4 outside4/") for line in listed)
    assert "outside-4 outside4/instnorm_lrn (p01)" in listed
    with pytest.raises(SystemExit, match="unknown groups"):
        stop_rule.main(["--dry-run", "--groups", "outside"])


def test_judge_accepts_either_end_only_when_their_magnitudes_tie():
    ok = stop_rule.judge(7.95, -7.89, 7.95, -7.89, -7.89, 7.95, 1e-2)
    assert ok["within"]  # |7.95| and |-7.89| are within 0.0795 of each other
    wrong = stop_rule.judge(7.95, -5.0, 7.95, -5.0, -5.0, 7.95, 1e-2)
    assert not wrong["within"]
    low = stop_rule.judge(0.703, -0.670, 0.646, -0.670, 0.646, 0.703, 1e-2)
    assert not low["within"]


def test_hessmaxev_says_when_its_budget_ran_out():
    from cockpit_like import Cockpit
    from cockpit_like.quantities import HessMaxEV
    from cockpit_like.utils import schedules
    from tests.helpers import make_batch, make_problem

    model, lossfunc, _ = make_problem("mlp")
    quantity = HessMaxEV(schedules.linear(1), max_iter=3)
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
    inputs, labels = make_batch("mlp", 6, seed=0)
    loss = lossfunc(model(inputs), labels)
    with pytest.warns(RuntimeWarning, match="did not converge in 3 Hessian-vector products"):
        with cockpit(0, info={"loss": loss}):
            loss.backward(create_graph=cockpit.create_graph(0))
    assert quantity.converged[0] is False and quantity.hvp_counts[0] == 3


# ---- products that are not a Hessian's: PyTorch's fused weight_norm ---------------------------------------------


def _nonsymmetric(leading, seed, n, skew):
    """A synthetic symmetric matrix plus an antisymmetric part of spectral norm ``skew * max|lambda|``."""
    matrix = stop_rule.synthetic_matrix(leading, n, seed)
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=generator, dtype=DT)
    antisymmetric = (a - a.T) / 2
    scale = torch.linalg.eigvalsh(matrix).abs().max()
    return matrix + skew * scale * antisymmetric / torch.linalg.matrix_norm(antisymmetric, ord=2)


@pytest.mark.parametrize("skew", [0.03, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_products_that_are_not_symmetric_are_never_converged(seed, skew):
    """The residual bound holds for a symmetric operator only; the antisymmetric part of T as multiplied,
    ``asymmetry()``, is a lower bound of how far the products are from any symmetric operator's. Above the
    tolerance the solve stops unconverged; a symmetric operator's is 0 to rounding (same stop as before)."""
    rtol = 1e-2
    n = 300
    matrix = _nonsymmetric(SPECTRA["one outlier"], seed, n, skew)
    K = lanczos_decomposition(lambda v: matrix @ v, _starts(seed, n=n), rtol=rtol)
    assert not K.converged
    assert K.asymmetry() > rtol * K.ritz_values().abs().max().item()
    _, _, S = _solve(SPECTRA["one outlier"], seed, n=n, rtol=rtol)
    assert S.converged and S.asymmetry() < 1e-12 * S.ritz_values().abs().max().item()


class DifferentiableWeightNorm(torch.nn.Module):
    """weight_norm (dim 0) by the formula PyTorch takes where it does not fuse: twice differentiable."""

    def forward(self, g, v):
        return v * (g / torch.norm_except_dim(v, 2, 0))

    def right_inverse(self, weight):
        return torch.norm_except_dim(weight, 2, 0), weight


def _weight_norm_problem(seed: int, fused: bool):
    """The outside tester's model: Linear(4, 5) with weight_norm, Tanh, Linear(5, 3); 6 rows (float64)."""
    from torch import nn
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5, dtype=DT), nn.Tanh(), nn.Linear(5, 3, dtype=DT))
    if fused:
        parametrizations.weight_norm(model[0])
    else:
        parametrize.register_parametrization(model[0], "weight", DifferentiableWeightNorm())
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    return model, x, y


def _dense_hessian(model, x, y) -> torch.Tensor:
    """torch.autograd.functional.hessian of the mean cross-entropy in the flat parameters."""
    import torch.nn.functional as F
    from torch.func import functional_call

    names = [name for name, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]

    def loss(flat):
        pieces = [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params)]
        return F.cross_entropy(functional_call(model, dict(zip(names, pieces)), (x,)), y)

    return torch.autograd.functional.hessian(loss, torch.cat([p.reshape(-1) for p in params]))


def _track(model, x, y, quantities):
    import torch.nn.functional as F

    from cockpit_like import Cockpit

    cockpit = Cockpit(list(model.parameters()), quantities=quantities, model=model)
    loss = F.cross_entropy(model(x), y)
    with cockpit(0, info={"loss": loss, "batch_size": len(y)}):
        loss.backward(create_graph=cockpit.create_graph(0))
    return cockpit.get_output()[0]


@pytest.mark.parametrize("seed", range(12))
def test_weight_norm_hessmaxev_against_the_dense_hessian(seed):
    """PyTorch's fused weight_norm has a wrong double backward (the norms ||v|| held constant): its products
    are neither the Hessian's nor symmetric. HessMaxEV stored 4 of these 12 seeds (0, 4, 5, 10) as converged
    outside the tolerance, the others too against the true Hessian; now it stores no value and says why.
    The same function with a twice differentiable weight norm (same parameters, the true Hessian) converges to
    the dense Hessian's eigenvalue of largest magnitude within the tolerance."""
    from cockpit_like.quantities import HessMaxEV

    rtol = 1e-2
    fused, x, y = _weight_norm_problem(seed, fused=True)
    twin, _, _ = _weight_norm_problem(seed, fused=False)
    twin.load_state_dict(fused.state_dict())
    exact = _dense_hessian(twin, x, y)
    assert (exact - exact.T).abs().max() < 1e-12  # the true Hessian
    eigenvalues = torch.linalg.eigvalsh(exact)
    scale = eigenvalues.abs().max().item()

    def within(value):  # the eigenvalue of largest magnitude (either end where the magnitudes tie)
        ends = [e for e in (eigenvalues[0].item(), eigenvalues[-1].item()) if abs(e) >= scale * (1 - rtol)]
        return min(abs(value - e) for e in ends) <= rtol * scale

    quantity = HessMaxEV(lambda step: True)
    output = _track(twin, x, y, [quantity])
    assert quantity.converged[0] and within(output["HessMaxEV"]), (output["HessMaxEV"], eigenvalues[[0, -1]])

    quantity = HessMaxEV(lambda step: True)
    output = _track(fused, x, y, [quantity])
    through_fused = _dense_hessian(fused, x, y)  # what the fused double backward gives
    if (through_fused - through_fused.T).abs().max() > rtol * scale:  # PyTorch's bug (torch 2.x)
        assert "HessMaxEV" not in output and quantity.converged[0] is False
        (note,) = [n for n in output["checks"]["notes"] if n.startswith("HessMaxEV")]
        assert "not symmetric" in note and "0.weight" in note
    else:  # should PyTorch fix it: the value, within the tolerance
        assert quantity.converged[0] and within(output["HessMaxEV"])


def test_weight_norm_every_krylov_quantity_stores_no_value():
    from cockpit_like.quantities import HessEigenvalues, HessMaxEV, HessSpectralDensity, HessTraceEstimate

    model, x, y = _weight_norm_problem(0, fused=True)
    every = lambda step: True  # noqa: E731
    quantities = [HessMaxEV(every), HessEigenvalues(every), HessSpectralDensity(every), HessTraceEstimate(every)]
    output = _track(model, x, y, quantities)
    names = [type(q).__name__ for q in quantities]
    assert not set(names) & set(output)
    notes = output["checks"]["notes"]
    assert all(any(n.startswith(f"{name} at step 0: no value stored") for n in notes) for name in names), notes
    assert all(q.converged[0] is False for q in quantities)


def test_a_product_that_is_not_finite_stops_the_solve_before_it():
    """A product with an inf (a half-precision graph that overflows): the solve keeps the products before it,
    unconverged and marked not finite, and never hands eigh a matrix with inf / NaN (it raised before)."""
    from cockpit_like.functional.krylov import lanczos_decomposition

    A = torch.diag(torch.linspace(-1.0, 2.0, 30, dtype=torch.float64))
    calls = []

    def matvec(v):
        calls.append(1)
        out = A @ v
        if len(calls) == 4:
            out[3] = float("inf")
        return out

    starts = torch.randn(2, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    result = lanczos_decomposition(matvec, starts, max_products=20, rtol=1e-12, probes=2)
    assert not result.finite and not result.converged
    assert result.num_products == 3 and len(calls) == 4
    assert torch.isfinite(result.ritz_values()).all()
    clean = lanczos_decomposition(lambda v: A @ v, starts, max_products=20, rtol=1e-12, probes=2)
    assert clean.finite


def test_a_clustered_end_is_not_stored_from_its_second_eigenvalue():
    """Outside trial 11's medium MLP (20-40-30-5, tanh and sigmoid, cross-entropy, 2,225 parameters): its
    smallest eigenvalues are a cluster (-0.0963, -0.0944, -0.0929, ...). With the residual rule alone the
    smallest Ritz value often sat near the second or third of them with a residual within the tolerance and
    was stored as converged, 1.0-1.4% of the scale off for the 1% claimed; the rule now waits until the
    residuals are within the tolerance again one product per start vector later, the ends having moved by
    less than it (step 0's Hessian, 20 draws: 13 outside before, none now)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 40), nn.Tanh(), nn.Linear(40, 30), nn.Sigmoid(), nn.Linear(30, 5)).double()
    generator = torch.Generator().manual_seed(123)
    x, y = torch.randn(32, 20, generator=generator).double(), torch.randint(0, 5, (32,), generator=generator)
    names, shapes = [n for n, _ in net.named_parameters()], [p.shape for p in net.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def loss(v):
        pieces = v.split([math.prod(s) for s in shapes])
        values = {n: t.reshape(s) for n, t, s in zip(names, pieces, shapes)}
        return F.cross_entropy(torch.func.functional_call(net, values, (x,)), y)

    hessian = torch.func.hessian(loss)(flat)
    exact = torch.linalg.eigvalsh(hessian)
    tolerance = 1e-2 * float(exact.abs().max())
    outside = {0: 0, None: 0}
    for confirm in outside:
        for seed in range(20):
            starts = start_vectors(2, flat.numel(), DT, "cpu", torch.Generator().manual_seed(seed))
            K = lanczos_decomposition(lambda v: hessian @ v, starts, max_products=100, rtol=1e-2, confirm=confirm)
            values = K.ritz_values()
            assert K.converged
            if max(abs(float(values[0]) - float(exact[0])), abs(float(values[-1]) - float(exact[-1]))) > tolerance:
                outside[confirm] += 1
    assert outside[None] == 0, outside
    assert outside[0] >= 3, outside  # the case is hard for the rule before (it is what the test is about)
