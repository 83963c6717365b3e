"""``curvature="auto"`` off BackPACK: Hutch++ on the step's Lanczos space where another quantity computes it anyway.

On a model BackPACK cannot handle, ``"auto"``'s Hessian diagonal (HessTrace,
TIC without ``info["outputs"]``) is Hutchinson's from 4 products; at a step
where the Lanczos engine runs for another quantity (HessMaxEV in the ``full``
preset) the same 4 products go to Hutch++ on that decomposition instead
(:class:`~cockpit_like.backends.curvature_engine.SharedSpaceDiagonal`). Checked
against dense twins in float64 with the cockpit's own draws: the Hutch++
diagonal on the engine's space at such steps, Hutchinson's at the others,
and ``estimators[step]`` saying which.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends import randomness
from cockpit_like.backends.curvature_engine import DEFAULT_PROBES, DEFAULT_RTOL, rademacher, start_vectors, step_generator
from cockpit_like.functional.krylov import deflated_diagonal, lanczos_decomposition
from cockpit_like.quantities import HessMaxEV, HessTrace
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.helpers import hutchinson_errors

DT = torch.float64
BATCH = 6


def _model(seed: int = 0) -> nn.Module:
    """LayerNorm: BackPACK has no Hessian diagonal for it, so ``"auto"`` estimates."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 5, generator=generator, dtype=DT), torch.randint(0, 3, (BATCH,), generator=generator)


def _dense_hessian(model, inputs, labels) -> torch.Tensor:
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(vector):
        params = {n: piece.view(s) for n, piece, s in zip(names, vector.split(sizes), shapes)}
        return nn.functional.cross_entropy(torch.func.functional_call(model, params, (inputs,)), labels)

    # reverse over reverse: torch.func.hessian is wrong through LayerNorm in this torch (tests/test_any_model.py)
    return torch.autograd.functional.hessian(loss, flat)


def _run(quantities, steps: int = 2):
    """SGD steps with the cockpit; the dense Hessian at each step (before its update)."""
    model = _model()
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hessians = []
    for step in range(steps):
        inputs, labels = _batch(step)
        hessians.append(_dense_hessian(model, inputs, labels))
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = nn.functional.cross_entropy(outputs, labels)
        info = {"batch_size": BATCH, "loss": loss, "optimizer": optimizer,
                "individual_losses": nn.functional.cross_entropy(outputs, labels, reduction="none")}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return model, hessians


def _hutch_plus_plus_blocks(hessian, step, sizes):
    D = hessian.shape[0]
    probes = start_vectors(DEFAULT_PROBES, D, DT, "cpu", step_generator(step, "lanczos probes"))
    K = lanczos_decomposition(lambda v: hessian @ v, probes, rtol=DEFAULT_RTOL, probes=DEFAULT_PROBES)
    draws = rademacher(4, D, DT, "cpu", step_generator(step, "deflated diagonal"))
    diagonal, estimates = deflated_diagonal(lambda v: hessian @ v, K, draws)
    blocks = torch.stack([e.sum(1) for e in estimates.split(sizes, dim=1)], dim=1)
    # the error bars' dense twin: the deflated operator (I - P) H (I - P), P = Q^T Q, times the draws
    Q = K.basis[: K.num_products]
    outside = torch.eye(D, dtype=DT) - Q.T @ Q
    errors = hutchinson_errors(draws, draws @ (outside @ hessian @ outside), sizes)
    return [float(b.sum()) for b in diagonal.split(sizes)], blocks, errors


def _hutchinson_blocks(hessian, step, sizes):
    D = hessian.shape[0]
    draws = randomness.generator(step, "hutchinson diagonal")
    samples = [torch.randint(0, 2, (D,), generator=draws).to(DT) * 2 - 1 for _ in range(4)]
    estimates = torch.stack([v * (hessian @ v) for v in samples])
    blocks = torch.stack([e.sum(1) for e in estimates.split(sizes, dim=1)], dim=1)
    signs = torch.stack(samples)
    return blocks.mean(0).tolist(), blocks, hutchinson_errors(signs, signs @ hessian, sizes)


def test_auto_uses_the_engines_space_where_hessmaxev_runs_and_hutchinson_where_not():
    """HessMaxEV every step, HessTrace every step: Hutch++ at every step (its dense twin, error bars too). With
    HessMaxEV at even steps only, the odd step is Hutchinson's (its own dense twin)."""
    trace = HessTrace(linear(1), curvature="auto")
    maxev = HessMaxEV(lambda step: step % 2 == 0)
    model, hessians = _run([maxev, trace], steps=2)
    sizes = [p.numel() for p in model.parameters()]
    assert trace.method == "hutchinson" and trace.settings()["computed_with"] == "hutchinson"
    assert trace.estimators == {0: "hutch++", 1: "hutchinson"}

    expected, blocks, (block_errors, total_error) = _hutch_plus_plus_blocks(hessians[0], 0, sizes)
    assert trace.get_output()[0] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert trace.standard_errors[0] == pytest.approx(block_errors, rel=1e-6, abs=1e-12)
    assert trace.total_errors[0] == pytest.approx(total_error, rel=1e-6)
    assert trace.total_errors[0] >= float(blocks.sum(1).std() / 2) * (1 - 1e-9)  # never below the samples' own

    expected, blocks, (block_errors, total_error) = _hutchinson_blocks(hessians[1], 1, sizes)
    assert trace.get_output()[1] == pytest.approx(expected, rel=1e-8, abs=1e-12)
    assert trace.standard_errors[1] == pytest.approx(block_errors, rel=1e-8, abs=1e-12)
    assert trace.total_errors[1] == pytest.approx(total_error, rel=1e-8)
    # the two estimators differ (so the first comparison could fail): Hutchinson's at step 0 is another number
    hutchinson_at_0, _, _ = _hutchinson_blocks(hessians[0], 0, sizes)
    assert sum(hutchinson_at_0) != pytest.approx(sum(trace.get_output()[0]), rel=1e-3)


def test_the_full_preset_gives_explicit_hutch_plus_plus_and_business_explicit_hutchinson():
    """The presets, where every quantity shares one schedule: ``full`` (HessMaxEV runs) is the value of an
    explicit ``curvature="hutch++"`` beside HessMaxEV; ``business`` (no engine) that of ``"hutchinson"``."""

    def trace_of(quantities):
        _run(quantities, steps=1)
        return next(q for q in quantities if isinstance(q, HessTrace))

    full = trace_of(configuration("full"))
    explicit = trace_of([HessMaxEV(linear(1)), HessTrace(linear(1), curvature="hutch++")])
    assert full.estimators[0] == "hutch++"
    assert full.get_output()[0] == pytest.approx(explicit.get_output()[0], rel=1e-10, abs=1e-13)
    assert full.total_errors[0] == pytest.approx(explicit.total_errors[0], rel=1e-10)

    business = trace_of(configuration("business"))
    plain = trace_of([HessTrace(linear(1), curvature="hutchinson")])
    assert business.estimators[0] == "hutchinson"
    assert business.get_output()[0] == pytest.approx(plain.get_output()[0], rel=1e-10, abs=1e-13)


def test_an_explicit_hutchinson_stays_hutchinson_beside_the_engine():
    trace = HessTrace(linear(1), curvature="hutchinson")
    model, hessians = _run([HessMaxEV(linear(1)), trace], steps=1)
    expected, _, _ = _hutchinson_blocks(hessians[0], 0, [p.numel() for p in model.parameters()])
    assert trace.estimators == {0: "hutchinson"}
    assert trace.get_output()[0] == pytest.approx(expected, rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("engine", [False, True])
def test_an_explicit_estimator_of_the_same_kind_shares_the_products(engine, monkeypatch):
    """'auto' beside an explicit estimator of the kind it picks at the step (Hutchinson without the engine,
    Hutch++ with it): one set of 4 products, the same values."""
    from cockpit_like.backends import hvp

    calls = []
    original = hvp.hessian_vector_product

    def counting(*args, **kwargs):
        matvec = original(*args, **kwargs)

        def counted(vector):
            calls.append(1)
            return matvec(vector)

        return counted

    monkeypatch.setattr(hvp, "hessian_vector_product", counting)
    import cockpit_like.backends.curvature_engine as engine_module

    monkeypatch.setattr(engine_module, "hessian_vector_product", counting)
    explicit = HessTrace(linear(1), curvature="hutch++" if engine else "hutchinson")
    auto = HessTrace(linear(1), curvature="auto")
    maxev = HessMaxEV(linear(1))
    _run(([maxev] if engine else []) + [explicit, auto], steps=1)
    assert auto.estimators[0] == ("hutch++" if engine else "hutchinson")
    assert auto.get_output()[0] == explicit.get_output()[0]
    assert len(calls) == (maxev.hvp_counts[0] if engine else 0) + 4


def test_the_log_keeps_each_estimates_standard_error_beside_it(tmp_path):
    """Each estimated value's standard error, estimator, samples and sign certainty are in its step's
    ``checks["standard_errors"]`` under the quantity's name in the cockpit (a second HessTrace is
    ``HessTrace_1``), written to the log and read back; the exact diagonals of BackPACK keep none."""
    from cockpit_like.logs import read_log
    from cockpit_like.quantities import TICTrace

    auto, explicit = HessTrace(linear(1), curvature="auto"), HessTrace(linear(1), curvature="hutchinson")
    tic = TICTrace(linear(1), curvature="hutchinson")
    model = _model()
    cockpit = Cockpit(model.parameters(), quantities=[HessMaxEV(linear(1)), auto, explicit, tic], model=model)
    inputs, labels = _batch(0)
    outputs = model(inputs)
    loss = nn.functional.cross_entropy(outputs, labels)
    info = {"batch_size": BATCH, "loss": loss,
            "individual_losses": nn.functional.cross_entropy(outputs, labels, reduction="none")}  # fmt: skip
    with cockpit(0, info=info):
        loss.backward(create_graph=cockpit.create_graph(0))
    logged = read_log(cockpit.write(tmp_path / "run"))[0]["checks"]["standard_errors"]
    assert logged == cockpit.get_output()[0]["checks"]["standard_errors"]
    assert set(logged) == {"HessTrace", "HessTrace_1", "TICTrace"}
    assert logged["HessTrace"] == {"standard_error": pytest.approx(auto.total_errors[0], rel=1e-12),
                                   "estimator": "hutch++", "samples": 4, "reliable": auto.reliable[0]}  # fmt: skip
    assert logged["HessTrace_1"]["standard_error"] == pytest.approx(explicit.total_errors[0], rel=1e-12)
    assert logged["HessTrace_1"]["estimator"] == "hutchinson"
    assert logged["TICTrace"]["standard_error"] == pytest.approx(tic.standard_errors[0], rel=1e-12)
    assert logged["HessTrace"]["standard_error"] > 0

    # BackPACK's exact Hessian diagonal: no error bar, no standard_errors in the step's checks
    from backpack import extend

    exact_model = extend(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    exact = HessTrace(linear(1), curvature="auto")
    cockpit = Cockpit(exact_model.parameters(), quantities=[exact], model=exact_model)
    loss = lossfunc(exact_model(inputs), labels)
    with cockpit(0, info={"batch_size": BATCH, "loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    assert exact.method == "diag_h" and 0 in exact.get_output()
    assert "standard_errors" not in cockpit.get_output()[0].get("checks", {})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_standard_error_is_never_below_the_rounding_of_the_sums(dtype):
    """Outside trial 9: on a space the products leave invariant (a rank-2 Hessian), Hutch++ is exact up to
    rounding, and its stored standard error was the samples' 2e-33 (float64) / 2e-15 (float32) while the value
    was 5.6e-17 / 5e-8 off: the exact trace 1e7-1e16 'standard errors' away. Now the error is at least the
    rounding of the sums (eps x sqrt(D) x sum |c|), and the exact trace lies within it."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(dtype)  # squared error: a Hessian of rank <= 4 (inputs and bias)
    inputs, targets = torch.randn(8, 3, dtype=dtype), torch.randn(8, 1, dtype=dtype)
    every = linear(1)
    trace = HessTrace(every, curvature="hutch++")
    cockpit = Cockpit(model.parameters(), quantities=[HessMaxEV(every), trace], model=model)
    loss = ((model(inputs) - targets) ** 2).mean()
    with cockpit(0, info={"loss": loss, "batch_size": 8}):
        loss.backward(create_graph=cockpit.create_graph(0))
    value, error = sum(cockpit.get_output()[0]["HessTrace"]), trace.total_errors[0]
    design = torch.cat([inputs, torch.ones(8, 1, dtype=dtype)], 1).double()
    exact = float(torch.trace(2 * design.T @ design / 8))
    eps = torch.finfo(dtype).eps
    assert trace.estimators[0] == "hutch++"
    assert error >= eps * exact  # the floor: not the samples' spread of ~0
    assert abs(value - exact) <= 3 * error
