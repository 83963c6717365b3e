"""Outside trial 28 (curvature numbers on 22 models the team had not built): what it found, fixed.

- Hutch++ (HessTraceEstimate, HessTrace's ``"hutch++"``) on a model of a few parameters: the Lanczos space
  spanned all but one or two directions and the 4 Rademacher samples of the rest all missed its largest one, so
  their spread and the products' norms vanished together: a multi-output linear regression (12 parameters) had
  its trace stored 12.5 standard errors off as reliable. Where at most ``2 x samples`` directions are left, the
  rest is now exact from as many products (:func:`~cockpit_like.functional.krylov.complement_rows`).
- The sketched GGN (more than 10 classes) under gradient accumulation or DDP: TICDiag and TICTrace were stored
  with no standard error and no ``reliable`` flag (8.5% off in the median, 35% at worst). The parts' draws are
  now merged one by one (draw ``k`` of the step: the batch-weighted mean of the parts' draws ``k``), which gives
  the step its standard errors as one batch has them.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cockpit_like import Cockpit
from cockpit_like.backends import randomness
from cockpit_like.functional.krylov import complement_rows, lanczos_decomposition
from cockpit_like.quantities import HessMaxEV, HessTrace, HessTraceEstimate, TICDiag, TICTrace
from cockpit_like.utils.schedules import linear


# ---- the functional piece ------------------------------------------------------------------------------
def test_complement_rows_span_what_the_space_leaves_out():
    torch.manual_seed(0)
    n = 9
    A = torch.randn(n, n, dtype=torch.float64)
    A = A + A.T
    starts = torch.randn(2, n, dtype=torch.float64)
    partial = lanczos_decomposition(lambda v: A @ v, starts, rtol=1e-12, max_products=6)
    m = partial.num_products
    rows = complement_rows(partial, n - m)
    assert rows is not None and rows.shape == (n - m, n)
    assert torch.allclose(rows @ rows.T, torch.eye(n - m, dtype=torch.float64), atol=1e-12)
    Q = partial.basis[:m]
    assert (rows @ Q.T).abs().max() < 1e-12
    assert complement_rows(partial, n - m - 1) is None  # more left than the limit: sampled, as before
    # the trace from the space and the rest, exact
    rest = rows @ torch.stack([A @ r for r in rows]).T
    assert float(torch.trace(partial.projection) + torch.trace(rest)) == pytest.approx(float(torch.trace(A)), rel=1e-12)


# ---- Hutch++ where a few directions are left --------------------------------------------------------------
def _regression(outputs: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(8, 5, generator=generator, dtype=torch.float64)
    Y = torch.randn(8, outputs, generator=generator, dtype=torch.float64)
    torch.manual_seed(1)
    return nn.Linear(5, outputs).double(), X, Y


def _dense_hessian(model, loss_of):
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    shapes = [p.shape for p in params]

    def loss_at(vector):
        pieces, start = [], 0
        for shape in shapes:
            count = math.prod(shape)
            pieces.append(vector[start : start + count].reshape(shape))
            start += count
        return loss_of(pieces)

    return torch.autograd.functional.hessian(loss_at, flat)


@pytest.mark.parametrize("outputs", [2, 3])
def test_hutchpp_is_exact_where_the_space_leaves_a_few_directions(outputs):
    """Every eigenvalue repeats ``outputs`` times (``I (x) X^T X``): before, seed 51 of 60 stored the trace 12.5
    standard errors off as reliable (2 outputs), seed 49 3.5 off (3 outputs). Now every seed is exact to rounding,
    HessTrace's ``"hutch++"`` diagonal too, at no more than ``2 x samples`` products beyond the space's."""
    model, X, Y = _regression(outputs)
    H = _dense_hessian(model, lambda p: ((X @ p[0].T + p[1] - Y) ** 2).mean())
    exact = float(torch.trace(H))
    try:
        for seed in range(0, 60, 3):
            randomness.set_seed(seed)
            estimate, diagonal = HessTraceEstimate(linear(1)), HessTrace(linear(1), curvature="hutch++")
            cockpit = Cockpit(model.parameters(), quantities=[estimate, diagonal, HessMaxEV(linear(1))], model=model)
            out = model(X)
            losses = ((out - Y) ** 2).mean(1)
            loss = losses.mean()
            with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": loss}):
                loss.backward(create_graph=cockpit.create_graph(0))
            for p in model.parameters():
                p.grad = None
            value = cockpit.get_output()[0]["HessTraceEstimate"]
            assert value["trace"] == pytest.approx(exact, rel=1e-10), seed
            assert value["standard_error"] < 1e-10 * exact and estimate.reliable[0]
            assert value["products"] <= model.weight.numel() + model.bias.numel() + 4  # r <= D - m products
            stored = torch.cat([torch.as_tensor(b, dtype=torch.float64).reshape(-1) for b in cockpit.get_output()[0]["HessTrace"]])
            blocks = torch.stack([torch.diagonal(H)[: model.weight.numel()].sum(), torch.diagonal(H)[model.weight.numel() :].sum()])
            assert torch.allclose(stored.to(torch.float64), blocks, rtol=1e-10), (seed, stored, blocks)
            assert diagonal.estimators[0] == "hutch++" and max(diagonal.standard_errors[0]) < 1e-10 * exact
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)


def test_hutchpp_samples_where_many_directions_are_left():
    """A model of 147 parameters: the space leaves far more than 8 directions, so the rest is sampled (4 products
    beyond the space's) with an error bar, as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    X, Y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    estimate, top = HessTraceEstimate(linear(1)), HessMaxEV(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[estimate, top], model=model)
    out = model(X)
    losses = F.cross_entropy(out, Y, reduction="none")
    with cockpit(0, info={"batch_size": 16, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    value = cockpit.get_output()[0]["HessTraceEstimate"]
    assert value["products"] == top.hvp_counts[0] + 4  # the space's (shared with HessMaxEV) and 4 samples
    assert value["standard_error"] > 1e-6 * abs(value["trace"])


# ---- the sketched GGN's TIC over parts of a step ---------------------------------------------------------
CLASSES, ROWS = 16, 6


def _sketch_problem():
    generator = torch.Generator().manual_seed(3)
    X = torch.randn(ROWS, 5, generator=generator, dtype=torch.float64)
    Y = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.Linear(6, CLASSES)).double(), X, Y


def _exact_tic(model, X, Y) -> tuple[float, float]:
    """``(TICDiag, TICTrace)`` of the exact GGN (dense Jacobians, per-row gradients)."""
    params = list(model.parameters())
    out = model(X)
    losses = F.cross_entropy(out, Y, reduction="none")
    rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], params, retain_graph=True)])
                        for i in range(ROWS)])  # fmt: skip
    jac = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(out.reshape(-1)[k], params, retain_graph=True)])
                       for k in range(ROWS * CLASSES)]).reshape(ROWS, CLASSES, -1)  # fmt: skip
    p = torch.softmax(out, -1).detach()
    ggn = sum(torch.einsum("cd,ce,ed->d", jac[n], torch.diag(p[n]) - torch.outer(p[n], p[n]), jac[n]) for n in range(ROWS)) / ROWS
    squares = (rows**2).mean(0)
    return float((squares / (ggn + 1e-7)).sum()), float(squares.sum() / (ggn.sum() + 1e-7))


def _tic_in_parts(model, X, Y, parts: list[slice]):
    params = list(model.parameters())
    diag, trace = TICDiag(linear(1)), TICTrace(linear(1))
    cockpit = Cockpit(params, quantities=[diag, trace], model=model)
    for p in params:
        p.grad = None
    for part in parts:
        out = model(X[part])
        losses = F.cross_entropy(out, Y[part], reduction="none")
        info = {"batch_size": len(losses), "individual_losses": losses, "loss": losses.mean(), "outputs": out,
                "micro_batches": len(parts)}  # fmt: skip
        with cockpit(0, info=info):
            (losses.mean() * len(losses) / ROWS).backward(create_graph=cockpit.create_graph(0))
    for p in params:
        p.grad = None
    return cockpit, diag, trace


@pytest.mark.parametrize("parts", [[slice(0, 3), slice(3, 6)], [slice(0, 1), slice(1, 6)]], ids=["equal", "unequal"])
def test_sketched_tic_over_micro_batches_has_its_error_bars(parts):
    """Before, the step stored both TICs with no standard error and no ``reliable`` flag. Now each has its error
    bar, and over 40 cockpit seeds the exact TIC of the GGN lies within 3 of them about as often as in one pass."""
    model, X, Y = _sketch_problem()
    exact_diag, exact_trace = _exact_tic(model, X, Y)
    z = {"diag": [], "trace": []}
    try:
        for seed in range(40):
            randomness.set_seed(seed)
            cockpit, diag, trace = _tic_in_parts(model, X, Y, parts)
            assert cockpit.checks[0]["valid"]
            for key, quantity, exact in (("diag", diag, exact_diag), ("trace", trace, exact_trace)):
                error = quantity.standard_errors[0]
                assert 0 < error < float("inf") and isinstance(quantity.reliable[0], bool), (seed, key)
                z[key].append(abs(cockpit.get_output()[0][type(quantity).__name__] - exact) / error)
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    # over 200 seeds (docs/curvature.md): TICTrace 99-99.5% within 3 errors, TICDiag 96-99% (one pass: 100%, 99%)
    assert sum(s <= 3 for s in z["trace"]) >= 38, sorted(z["trace"])[-5:]
    assert sum(s <= 3 for s in z["diag"]) >= 34, sorted(z["diag"])[-5:]
    assert max(z["trace"]) < 6 and max(z["diag"]) < 10


def test_sketched_tic_of_one_part_is_the_one_pass_tic():
    """One micro-batch declared as one: the merge is not run, the same numbers as a plain pass."""
    model, X, Y = _sketch_problem()
    randomness.set_seed(7)
    try:
        _, whole_diag, _ = _tic_in_parts(model, X, Y, [slice(0, ROWS)])
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    assert whole_diag.standard_errors[0] > 0


# ---- under DDP ---------------------------------------------------------------------------------------------
def job(rank: int) -> dict:
    """Two ranks of 3 rows each, the sketched GGN's TIC; what each rank stored."""
    model, X, Y = _sketch_problem()
    net = nn.parallel.DistributedDataParallel(model)
    diag, trace = TICDiag(linear(1)), TICTrace(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[diag, trace], model=net, log_rank=None, distributed_timeout=60)
    rows = slice(3 * rank, 3 * rank + 3)
    out = net(X[rows])
    losses = F.cross_entropy(out, Y[rows], reduction="none")
    info = {"batch_size": 3, "individual_losses": losses, "loss": losses.mean(), "outputs": out}
    with cockpit(0, info=info):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    output = cockpit.get_output()[0]
    return {"values": (output["TICDiag"], output["TICTrace"]), "errors": (diag.standard_errors[0], trace.standard_errors[0]),
            "valid": cockpit.checks[0]["valid"]}  # fmt: skip


@pytest.mark.slow
def test_sketched_tic_under_ddp_has_the_same_error_bars_on_every_rank(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from tests.test_distributed import _spawn

    ranks = _spawn("tests.test_loops_trial28:job", tmp_path)
    model, X, Y = _sketch_problem()
    exact = _exact_tic(model, X, Y)
    assert ranks[0] == ranks[1]
    assert ranks[0]["valid"]
    for value, error, reference in zip(ranks[0]["values"], ranks[0]["errors"], exact):
        assert 0 < error < float("inf")
        assert abs(value - reference) <= 4 * error, (value, error, reference)
