"""KFACTrace against dense Kronecker products and, where KFLR is exact, the GGN (float64)."""

import math

import pytest
import torch
from backpack import extend
from backpack.extensions import KFAC, KFLR
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.functional.kronecker import kron_eigenvalues, kron_frobenius, kron_logdet, kron_trace
from cockpit_like.quantities import KFACTrace
from cockpit_like.utils import schedules
from tests.helpers import make_batch, make_problem, plain_copy

DAMPING = 1e-2


def random_psd(n, seed, rank=None):
    generator = torch.Generator().manual_seed(seed)
    factor = torch.randn(n, rank or n, generator=generator, dtype=torch.float64)
    return factor @ factor.T


def dense_summary(factors, damping):
    dense = factors[0]
    for factor in factors[1:]:
        dense = torch.kron(dense, factor)
    shifted = dense + damping * torch.eye(dense.shape[0], dtype=dense.dtype)
    sign, logdet = torch.linalg.slogdet(shifted)
    assert sign > 0
    return dense.trace().item(), torch.linalg.matrix_norm(dense).item(), logdet.item()


# ---- functional ---------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [(3,), (4, 3), (2, 3, 2)])
def test_kronecker_identities_against_dense(sizes):
    factors = [random_psd(n, seed=10 + i, rank=max(1, n - 1)) for i, n in enumerate(sizes)]
    trace, frobenius, logdet = dense_summary(factors, DAMPING)
    assert kron_trace(factors) == pytest.approx(trace, rel=1e-12)
    assert kron_frobenius(factors) == pytest.approx(frobenius, rel=1e-12)
    assert kron_logdet(factors, DAMPING) == pytest.approx(logdet, rel=1e-10)
    dense = factors[0]
    for f in factors[1:]:
        dense = torch.kron(dense, f)
    assert torch.allclose(kron_eigenvalues(factors).sort().values, torch.linalg.eigvalsh(dense).clamp(min=0), atol=1e-10)


def test_kronecker_errors():
    with pytest.raises(ValueError, match="at least one"):
        kron_trace([])
    with pytest.raises(ValueError, match="square"):
        kron_frobenius([torch.ones(2, 3)])
    with pytest.raises(ValueError, match="damping must be > 0"):
        kron_logdet([torch.eye(2)], 0.0)


# ---- the quantity against the dense product of BackPACK's factors --------------------
def run_with_factors(problem, bias, batch_size, curvature, steps=3, damping=DAMPING):
    """Train with KFACTrace and the same extension passed by the user, so factors stay."""
    model, lossfunc, _ = make_problem(problem, bias=bias)
    quantity = KFACTrace(schedules.linear(1), curvature=curvature, damping=damping)
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    user_ext = KFAC() if curvature == "kfac" else KFLR()
    factors = {}
    for step in range(steps):
        inputs, labels = make_batch(problem, batch_size, seed=step)
        optimizer.zero_grad()
        loss = lossfunc(model(inputs), labels)
        with cockpit(step, user_ext, info={"loss": loss}):
            loss.backward()
        factors[step] = [[f.clone() for f in getattr(p, curvature)] for p in model.parameters()]
        optimizer.step()
    return model, quantity.get_output(), factors


@pytest.mark.parametrize("curvature", ["kflr", "kfac"])
@pytest.mark.parametrize("problem,bias,batch_size", [("mlp", True, 5), ("mlp", False, 3), ("cnn", True, 4), ("cnn", False, 6)])
def test_against_dense_kronecker_product(problem, bias, batch_size, curvature):
    model, output, factors = run_with_factors(problem, bias, batch_size, curvature)
    params = list(model.parameters())
    for step, per_param in factors.items():
        value = output[step]
        assert set(value) == {"trace", "trace_total", "frobenius", "frobenius_total", "logdet", "logdet_total"}
        assert len(value["trace"]) == len(params)
        for p, fs in zip(params, per_param):
            assert len(fs) == (2 if p.dim() > 1 else 1)  # bias: a single factor G
            assert math.prod(f.shape[0] for f in fs) == p.numel()
        refs = [dense_summary(fs, DAMPING) for fs in per_param]
        for i, (trace, frobenius, logdet) in enumerate(refs):
            assert value["trace"][i] == pytest.approx(trace, rel=1e-10)
            assert value["frobenius"][i] == pytest.approx(frobenius, rel=1e-10)
            assert value["logdet"][i] == pytest.approx(logdet, rel=1e-8)
        assert value["trace_total"] == pytest.approx(sum(r[0] for r in refs), rel=1e-10)
        block_diagonal = torch.block_diag(*[_kron(fs) for fs in per_param])
        assert value["frobenius_total"] == pytest.approx(torch.linalg.matrix_norm(block_diagonal).item(), rel=1e-10)
        assert value["logdet_total"] == pytest.approx(sum(r[2] for r in refs), rel=1e-8)
        assert all(isinstance(x, float) for key in ("trace", "frobenius", "logdet") for x in value[key])


def _kron(factors):
    dense = factors[0]
    for f in factors[1:]:
        dense = torch.kron(dense, f)
    return dense


def test_no_logdet_without_damping():
    _, output, _ = run_with_factors("mlp", True, 4, "kflr", steps=1, damping=None)
    assert set(output[0]) == {"trace", "trace_total", "frobenius", "frobenius_total"}


@pytest.mark.parametrize("bias", [True, False])
def test_kflr_is_exact_for_a_linear_layer_with_mse(bias):
    """One linear layer, MSE loss: the GGN (= the Hessian) blocks are exactly G ⊗ A and G."""
    torch.manual_seed(0)
    model = extend(nn.Linear(5, 3, bias=bias).double())
    lossfunc = extend(nn.MSELoss())
    inputs = torch.randn(7, 5, dtype=torch.float64)
    targets = torch.randn(7, 3, dtype=torch.float64)
    quantity = KFACTrace(schedules.linear(1), curvature="kflr", damping=DAMPING)
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
    loss = lossfunc(model(inputs), targets)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    value = quantity.get_output()[0]

    plain = plain_copy(model)
    names = [n for n, _ in plain.named_parameters()]
    params = {n: p.detach() for n, p in plain.named_parameters()}

    def loss_of(*tensors):
        out = torch.func.functional_call(plain, dict(zip(names, tensors)), (inputs,))
        return nn.functional.mse_loss(out, targets)

    hessian = torch.autograd.functional.hessian(loss_of, tuple(params[n] for n in names))
    for i, name in enumerate(names):
        numel = params[name].numel()
        block = hessian[i][i].reshape(numel, numel)
        assert value["trace"][i] == pytest.approx(block.trace().item(), rel=1e-10)
        assert value["frobenius"][i] == pytest.approx(torch.linalg.matrix_norm(block).item(), rel=1e-10)
        shifted = block + DAMPING * torch.eye(numel, dtype=block.dtype)
        assert value["logdet"][i] == pytest.approx(torch.linalg.slogdet(shifted)[1].item(), rel=1e-9)


def test_kfac_monte_carlo_agrees_with_kflr_in_expectation():
    """E[KFAC's sampled G] = KFLR's G, so with many samples the traces agree."""
    traces = {}
    for curvature, samples in (("kflr", 1), ("kfac", 3000)):
        model, lossfunc, _ = make_problem("mlp")
        inputs, labels = make_batch("mlp", 8, seed=0)
        quantity = KFACTrace(schedules.linear(1), curvature=curvature, mc_samples=samples)
        cockpit = Cockpit(model.parameters(), quantities=[quantity])
        loss = lossfunc(model(inputs), labels)
        torch.manual_seed(0)
        with cockpit(0, info={"loss": loss}):
            loss.backward()
        traces[curvature] = quantity.get_output()[0]["trace"]
    for mc, exact in zip(traces["kfac"], traces["kflr"]):
        assert mc == pytest.approx(exact, rel=0.1)
    assert traces["kfac"] != traces["kflr"]


def test_extensions_settings_and_errors():
    q = KFACTrace(schedules.linear(2), curvature="kfac", mc_samples=3, damping=1e-3)
    assert q.extensions(1) == []
    (ext,) = q.extensions(2)
    assert isinstance(ext, KFAC) and ext.get_num_mc_samples() == 3
    assert isinstance(KFACTrace(schedules.linear(1), curvature="kflr").extensions(0)[0], KFLR)
    assert q.settings() == {"curvature": "kfac", "mc_samples": 3, "damping": 1e-3}
    with pytest.raises(ValueError, match=r"'kfac', 'kflr'"):
        KFACTrace(schedules.linear(1), curvature="kfra")
    with pytest.raises(ValueError, match="damping"):
        KFACTrace(schedules.linear(1), damping=0)
    with pytest.raises(ValueError, match="mc_samples"):
        KFACTrace(schedules.linear(1), mc_samples=0)
