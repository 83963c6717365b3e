"""The loss's own curvature under the Hessian-vector products (outside trial 32).

A hand-written cross-entropy ``torch.autograd.Function`` whose backward returns ``(p - onehot(y)) / N`` with the
softmax saved in forward is not twice differentiable, but not marked so: its double backward misses
``diag(p) - p p^T`` in the logits, the products stay symmetric, and HessMaxEV was stored as converged with the
wrong sign (HessTrace 4.5 standard errors off). Where ``info["outputs"]`` is a mean cross-entropy's logits, the
cockpit now compares the loss's second derivative there with the known one
(``cockpit_like/backends/loss_curvature.py``) and stores no curvature value where they disagree.

The functional tests import inside the tests, so that the cockpit's tests also run on the code before the check.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DTYPE = torch.float64


class SavedSoftmaxCE(torch.autograd.Function):
    """The outside tester's cross-entropy: backward from the softmax saved in forward (not twice differentiable)."""

    @staticmethod
    def forward(ctx, z, y):
        p = z.softmax(1)
        ctx.save_for_backward(p, y)
        return -(z.log_softmax(1).gather(1, y[:, None])[:, 0])

    @staticmethod
    def backward(ctx, g):
        p, y = ctx.saved_tensors
        return g[:, None] * (p - F.one_hot(y, p.shape[1]).to(p.dtype)), None


class RecomputedSoftmaxCE(torch.autograd.Function):
    """The same loss whose backward computes the softmax from the saved logits with torch operations: its
    double backward is the cross-entropy's."""

    @staticmethod
    def forward(ctx, z, y):
        ctx.save_for_backward(z, y)
        return -(z.log_softmax(1).gather(1, y[:, None])[:, 0])

    @staticmethod
    def backward(ctx, g):
        z, y = ctx.saved_tensors
        return g[:, None] * (z.softmax(1) - F.one_hot(y, z.shape[1]).to(z.dtype)), None


LOSSES = {
    "saved_softmax": lambda out, y: SavedSoftmaxCE.apply(out, y),
    "recomputed_softmax": lambda out, y: RecomputedSoftmaxCE.apply(out, y),
    "functional": lambda out, y: F.cross_entropy(out, y, reduction="none"),
}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)


def _batches(steps: int, seed: int = 77):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=generator, dtype=DTYPE) * 1.5
        yield x, torch.randint(0, 4, (8,), generator=generator)


def _run(loss_name: str, quantities, steps: int = 4, outputs: bool = True, micro_batches: int = 1, model=None):
    """The outside tester's loop (SGD, a tracked step each); the cockpit's output, the dense float64 Hessians' top
    eigenvalues by magnitude (of the mean cross-entropy: the loss's Hessian) and torch's RNG state after each step."""
    from cockpit_like import Cockpit

    model = model or _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    cockpit = Cockpit(params, quantities=quantities, model=model)
    batches = _batches(steps * micro_batches)
    tops, states = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for _ in range(micro_batches):
            x, y = next(batches)
            out = model(x)
            losses = LOSSES[loss_name](out, y)
            loss = losses.mean()
            tops.append(_top_eigenvalue(model, x, y))
            info = {"batch_size": 8, "individual_losses": losses, "loss": loss, "optimizer": optimizer}
            if outputs:
                info["outputs"] = out
            if micro_batches > 1:
                info["micro_batches"] = micro_batches
            with cockpit(step, info=info):
                (loss / micro_batches).backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        states.append(torch.get_rng_state())
    return cockpit.get_output(), tops, states


def _top_eigenvalue(model, x, y) -> float:
    """The eigenvalue of largest magnitude of the dense Hessian of F.cross_entropy in the flat parameters."""
    from torch.func import functional_call

    names = [name for name, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]

    def loss(flat):
        pieces = [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]), params)]
        return F.cross_entropy(functional_call(model, dict(zip(names, pieces)), (x,)), y)

    hessian = torch.autograd.functional.hessian(loss, torch.cat([p.reshape(-1) for p in params]))
    eigenvalues = torch.linalg.eigvalsh((hessian + hessian.T) / 2)
    return float(eigenvalues[-1] if eigenvalues[-1].abs() >= eigenvalues[0].abs() else eigenvalues[0])


def _every(step):
    return True


def _quantities():
    from cockpit_like.quantities import HessEigenvalues, HessMaxEV, HessTrace, TICDiag

    return [HessMaxEV(_every), HessTrace(_every), HessEigenvalues(_every), TICDiag(_every)]


@pytest.fixture
def without_check(monkeypatch):
    """The cockpit as before the check: the need computes nothing and says 'not checked'."""

    def off():
        from cockpit_like.backends.loss_curvature import LossCurvature, LossCurvatureCheck

        monkeypatch.setattr(LossCurvatureCheck, "compute", lambda self, execution: LossCurvature())

    return off


# ---- the math alone ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_product_is_the_dense_hessians_of_the_mean_cross_entropy(smoothing):
    from cockpit_like.functional.loss_hessian import cross_entropy_hessian_product

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5, generator=generator, dtype=DTYPE) * 3
    labels = torch.randint(0, 5, (7,), generator=generator)
    labels[[1, 4]] = -100  # ignored: no curvature, and the mean is over the other 5
    vectors = torch.randn(7, 5, generator=generator, dtype=DTYPE)

    def loss(flat):
        return F.cross_entropy(flat.view(7, 5), labels, label_smoothing=smoothing)

    dense = torch.autograd.functional.hessian(loss, logits.reshape(-1))
    counted = labels != -100
    product, rounding = cross_entropy_hessian_product(logits, vectors, counted)
    assert product.dtype == torch.float64
    assert torch.allclose(product.reshape(-1), dense @ vectors.reshape(-1), rtol=0, atol=1e-15)
    assert bool((rounding >= product.abs()).all())
    assert product[~counted].abs().max() == 0
    # every position counted: the mean over all 7
    full, _ = cross_entropy_hessian_product(logits, vectors)
    assert torch.allclose(full[counted] * 7, product[counted] * 5, rtol=1e-13, atol=0)


def test_the_mismatch_tells_rounding_from_a_missing_curvature():
    from cockpit_like.functional.loss_hessian import cross_entropy_hessian_product, hessian_product_mismatch

    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 6, generator=generator, dtype=DTYPE) * 4
    vectors = torch.randn(16, 6, generator=generator, dtype=DTYPE)
    expected, rounding = cross_entropy_hessian_product(logits, vectors)
    # the loss's own double backward in float32: rounding, well within
    narrow = logits.float().requires_grad_()
    (gradient,) = torch.autograd.grad(F.cross_entropy(narrow, logits.argmax(1)), narrow, create_graph=True)
    (found,) = torch.autograd.grad(gradient, narrow, vectors.float())
    error, tolerance, factor = hessian_product_mismatch(found, expected, rounding, torch.float32)
    assert 0 < error < 1e-2 * tolerance and factor == 1.0
    # no curvature at all (the saved-softmax double backward): off by all of it
    error, tolerance, _ = hessian_product_mismatch(torch.zeros_like(found), expected, rounding, torch.float32)
    assert error > 100 * tolerance and math.isclose(error, float(expected.norm()), rel_tol=1e-12)
    # a count known within a range (rows whose gradient rounded to 0): the best factor in it, and only in it
    error, tolerance, factor = hessian_product_mismatch(expected * 15 / 16, expected, rounding, torch.float64, (15 / 16, 1))
    assert error <= tolerance and math.isclose(factor, 15 / 16, rel_tol=1e-12)
    error, tolerance, factor = hessian_product_mismatch(expected / 2, expected, rounding, torch.float64, (15 / 16, 1))
    assert error > tolerance and factor == 15 / 16


# ---- (1) the outside tester's loss: no curvature value, and the note says why ------------------------------------


def test_a_double_backward_without_the_softmax_curvature_stores_no_curvature_value():
    """Fails before the check: HessMaxEV was stored, as converged, -0.98 where the loss's Hessian has +1.13."""
    quantities = _quantities()
    output, tops, _ = _run("saved_softmax", quantities)
    hess_max_ev, hess_trace, hess_eigenvalues, tic = quantities
    for step in range(4):
        stored = output[step]
        assert "HessMaxEV" not in stored and "HessTrace" not in stored and "HessEigenvalues" not in stored, stored
        assert step not in hess_max_ev.converged and step not in hess_max_ev.hvp_counts  # no products computed
        assert "TICDiag" in stored  # the GGN of info['outputs'] uses the cross-entropy's curvature, not autograd's
        (note,) = [n for n in stored["checks"]["notes"] if "second derivative" in n]
        assert note.startswith(f"HessEigenvalues, HessMaxEV, HessTrace at step {step}: no value stored"), note
        assert "not twice differentiable" in note and "torch.nn.functional.cross_entropy" in note, note
        assert "100.0% off" in note, note


def test_every_quantity_of_hessian_vector_products_is_left_out_plain_power_iteration_and_hutchinson_too():
    from cockpit_like.quantities import HessMaxEV, HessSpectralDensity, HessTrace, HessTraceEstimate

    quantities = [HessMaxEV(_every, accelerate=False), HessTrace(_every, curvature="hutchinson"),
                  HessSpectralDensity(_every), HessTraceEstimate(_every)]
    output, _, _ = _run("saved_softmax", quantities, steps=2)
    for step in range(2):
        assert set(output[step]) == {"checks"}, output[step]
        (note,) = [n for n in output[step]["checks"]["notes"] if "second derivative" in n]
        assert "HessMaxEV, HessSpectralDensity, HessTrace, HessTraceEstimate at step" in note


def test_micro_batches_are_checked_each():
    from cockpit_like.quantities import HessMaxEV, HessTrace

    output, _, _ = _run("saved_softmax", [HessMaxEV(_every), HessTrace(_every)], steps=2, micro_batches=2)
    for step in range(2):
        assert "HessMaxEV" not in output[step] and "HessTrace" not in output[step]
        assert any("second derivative" in n for n in output[step]["checks"]["notes"])


def test_without_declared_outputs_or_a_cross_entropy_nothing_changes(without_check):
    """Where the cockpit cannot know the loss's curvature it checks nothing: the same output as before."""
    from cockpit_like.quantities import HessMaxEV, HessTrace

    def run(**kwargs):
        return _run("saved_softmax", [HessMaxEV(_every), HessTrace(_every)], steps=2, **kwargs)[0]

    with_check = run(outputs=False)
    assert all("HessMaxEV" in with_check[step] for step in range(2))
    without_check()
    assert run(outputs=False) == with_check


def test_a_loss_that_is_not_a_cross_entropy_of_the_outputs_is_not_checked():
    from cockpit_like import Cockpit
    from cockpit_like.quantities import HessMaxEV

    model = _model()
    quantity = HessMaxEV(_every)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantity], model=model)
    x, _ = next(_batches(1))
    out = model(x)
    losses = (out**2).mean(1)  # an MSE to 0: its Hessian is not the cross-entropy's, and it is not checked
    loss = losses.mean()
    with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": loss, "outputs": out}):
        loss.backward(create_graph=cockpit.create_graph(0))
    assert quantity.converged[0] and "HessMaxEV" in cockpit.get_output()[0]


# ---- (2) a twice differentiable cross-entropy: the values as before, the dense Hessian's ---------------------------


@pytest.mark.parametrize("loss_name", ["functional", "recomputed_softmax"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_correct_double_backward_stores_the_same_values_as_before(loss_name, micro_batches, without_check):
    output, tops, states = _run(loss_name, _quantities(), micro_batches=micro_batches)
    without_check()
    before, _, states_before = _run(loss_name, _quantities(), micro_batches=micro_batches)
    assert output == before  # bitwise: values, standard errors, checks and notes
    assert all(torch.equal(a, b) for a, b in zip(states, states_before))
    if micro_batches == 1:
        for step in range(4):
            value, top = output[step]["HessMaxEV"], tops[step]
            assert abs(value - top) <= 1e-2 * abs(top), (step, value, top)  # rtol * max|theta| (docs/curvature.md)
            assert all("second derivative" not in n for n in output[step]["checks"].get("notes", []))


# ---- (3) the user's random streams and hooks ------------------------------------------------------------------------


def test_the_check_leaves_the_users_random_stream_and_hooks_alone(without_check):
    """The probe comes from the cockpit's generator, and a hook the user put on the outputs does not run in the
    check's backward passes (own_backward): the run is bitwise the same with and without the check."""
    from cockpit_like import Cockpit
    from cockpit_like.quantities import HessMaxEV

    def run():
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 4)).to(DTYPE)
        cockpit = Cockpit(list(model.parameters()), quantities=[HessMaxEV(_every)], model=model)
        calls, states = [], []
        for step, (x, y) in enumerate(_batches(3)):
            out = model(x)
            out.register_hook(lambda grad: calls.append(torch.rand(()).item()) or grad)  # draws from torch's RNG
            losses = F.cross_entropy(out, y, reduction="none")
            with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "outputs": out}):
                losses.mean().backward(create_graph=cockpit.create_graph(step))
            model.zero_grad()
            states.append(torch.get_rng_state())
        return cockpit.get_output(), calls, states

    output, calls, states = run()
    without_check()
    before, calls_before, states_before = run()
    assert len(calls) == 3 and calls == calls_before
    assert all(torch.equal(a, b) for a, b in zip(states, states_before))
    assert output == before
