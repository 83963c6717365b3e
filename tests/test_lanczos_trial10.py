"""Outside trial 10's curvature finding: a whole end of the spectrum missed, stored as converged.

A 6-parameter bilinear model (inputs near all ones) has Hessian eigenvalues -3.002 and +3.004 with
eigenvectors of entries of nearly equal size, and four near 1e-3. Rademacher start vectors are then nearly
(or exactly) orthogonal to one of the two: the first products see only the rest, whose residuals are within
the tolerance, and HessEigenvalues stored 0.0022 as the converged largest eigenvalue (9 of 60 seed-steps);
HessTraceEstimate on the whole space stored a standard error of 1e-62 beside a trace 1e-16 off. The engine
now waits for 4 products per start vector, goes on from a fresh Gaussian vector where the space became
invariant before that, and floors the trace's error bar at the rounding of its sums.
"""

import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends import randomness
from cockpit_like.functional.krylov import lanczos_decomposition
from cockpit_like.quantities import HessEigenvalues, HessMaxEV, HessTraceEstimate

DT = torch.float64


def test_an_invariant_space_that_misses_the_extremes_is_not_converged_there():
    """A start vector that is an eigenvector: the space is invariant after one product. Its eigenvalue (1) is
    exact, but neither extreme; the solve goes on from a fresh vector and finds 3 and -2."""
    A = torch.diag(torch.tensor([3.0, 1.0, -2.0, 0.5], dtype=DT))
    start = torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=DT)
    K = lanczos_decomposition(lambda v: A @ v, start, rtol=1e-8)
    values = K.ritz_values()
    assert K.converged and abs(float(values[-1]) - 3.0) < 1e-12 and abs(float(values[0]) + 2.0) < 1e-12
    # the global random stream is not touched by the fresh vectors
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    lanczos_decomposition(lambda v: A @ v, start, rtol=1e-8)
    assert torch.equal(torch.rand(3), expected)


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3, dtype=DT))
        self.b = nn.Parameter(torch.zeros(3, dtype=DT))

    def forward(self, x):
        return (x * self.a).sum(1) * (x * self.b).sum(1)


def data():
    generator = torch.Generator().manual_seed(1234)
    x = torch.ones(6, 3, dtype=DT) + 0.05 * torch.randn(6, 3, dtype=DT, generator=generator)
    return x, torch.ones(6, dtype=DT)


def row_losses(model, x, y):
    penalty = 1e-3 * model.a.square().sum() + 1.1e-3 * model.b.square().sum()
    return 0.5 * (model(x) - y) ** 2 + 0.5 * penalty


def exact_hessian():
    model = Bilinear()
    x, y = data()
    params = list(model.parameters())
    loss = row_losses(model, x, y).mean()
    gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, create_graph=True)])
    rows = [torch.cat([h.reshape(-1) for h in torch.autograd.grad(gradient[i], params, retain_graph=True)])
            for i in range(gradient.numel())]
    return torch.stack(rows)


def test_a_near_tie_of_opposite_sign_is_found_at_both_ends_for_every_seed():
    hessian = exact_hessian()
    exact = torch.linalg.eigvalsh(hessian)
    tolerance = 1e-2 * float(exact.abs().max())
    x, y = data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(20):
            randomness.set_seed(seed)
            model = Bilinear()
            quantities = [HessEigenvalues(lambda s: True), HessTraceEstimate(lambda s: True),
                          HessMaxEV(lambda s: True, use_power=False)]
            cockpit = Cockpit(list(model.parameters()), quantities=quantities, model=model)
            losses = row_losses(model, x, y)
            loss = losses.mean()
            with cockpit(1, info={"batch_size": 6, "loss": loss, "individual_losses": losses}):
                loss.backward(create_graph=cockpit.create_graph(1))
            values = cockpit.get_output()[1]
            ends = values["HessEigenvalues"]
            assert ends["converged"]
            assert abs(ends["largest"] - float(exact[-1])) <= tolerance, (seed, ends)
            assert abs(ends["smallest"] - float(exact[0])) <= tolerance, (seed, ends)
            assert abs(values["HessMaxEV"] - float(exact[-1])) <= tolerance
            trace = values["HessTraceEstimate"]
            assert abs(trace["trace"] - float(hessian.trace())) <= 3 * trace["standard_error"], (seed, trace)
    randomness.set_seed(0)


def test_an_eigenvector_orthogonal_to_sign_vectors_is_found_with_random_magnitudes():
    """Eigenvectors (e_2k +- e_2k+1)/sqrt(2) are exactly orthogonal to a +-1 start vector half the time: with two
    Rademacher starts HessMaxEV stored 1.0 as converged where the top eigenvalue is 10 (an outside check, 38 of
    120 seed-steps; 4 of these 20 seeds). The start vectors' entries have random magnitudes now (``start_vectors``)."""
    pairs = 6
    values = torch.cat([torch.tensor([10.0, -9.99], dtype=DT), torch.linspace(0.1, 1.0, 2 * pairs - 2, dtype=DT)])
    basis = torch.zeros(2 * pairs, 2 * pairs, dtype=DT)
    for k in range(pairs):
        basis[2 * k, 2 * k] = basis[2 * k + 1, 2 * k] = basis[2 * k, 2 * k + 1] = 2 ** -0.5
        basis[2 * k + 1, 2 * k + 1] = -(2 ** -0.5)
    matrix = basis @ torch.diag(values) @ basis.T

    class Quadratic(nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = nn.Parameter(torch.zeros(2 * pairs, dtype=DT))

        def forward(self, x):
            return 0.5 * self.theta @ matrix @ self.theta + x @ self.theta

    converged, wrong = 0, []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for seed in range(20):
                randomness.set_seed(seed)
                model = Quadratic()
                top = HessMaxEV(lambda s: True, use_power=False)
                cockpit = Cockpit(list(model.parameters()), quantities=[top], model=model)
                x = torch.randn(4, 2 * pairs, dtype=DT, generator=torch.Generator().manual_seed(seed))
                losses = torch.stack([model(row) for row in x])
                with cockpit(0, info={"batch_size": 4, "loss": losses.mean(), "individual_losses": losses}):
                    losses.mean().backward(create_graph=cockpit.create_graph(0))
                if top.converged[0]:
                    converged += 1
                    if abs(cockpit.get_output()[0]["HessMaxEV"] - 10.0) > 0.1:
                        wrong.append((seed, cockpit.get_output()[0]["HessMaxEV"]))
    finally:
        randomness.set_seed(0)
    assert converged == 20 and not wrong, (converged, wrong)


def test_fresh_vectors_after_an_invariant_space_come_from_the_steps_own_generator(monkeypatch):
    """On ``H = 2 I`` every start vector is an eigenvector: the space is invariant after each product, and the
    solve goes on from fresh vectors until 4 products per start vector. They are start vectors of the engine's
    kind (random signs, magnitudes within a factor 3) from the step's generator: different at every step, the
    same when a step is repeated, and torch's global stream untouched (before, a Gaussian vector seeded by the
    product count alone: the same vector at every step)."""
    from cockpit_like.backends import curvature_engine

    real, drawn = curvature_engine.lanczos_decomposition, []

    def spy(matvec, starts, **options):
        inner = options["restart"]

        def record(m):
            vector = inner(m)
            drawn[-1].append(vector.clone())
            return vector

        drawn.append([])
        return real(matvec, starts, **{**options, "restart": record})

    monkeypatch.setattr(curvature_engine, "lanczos_decomposition", spy)

    class Quadratic(nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = nn.Parameter(torch.ones(10, dtype=DT))

        def forward(self, x):
            return self.theta.square().sum() + x @ self.theta

    def tracked_step(step):
        model = Quadratic()
        top = HessMaxEV(lambda s: True, use_power=False)
        cockpit = Cockpit(list(model.parameters()), quantities=[top], model=model)
        x = torch.linspace(-1, 1, 30, dtype=DT).reshape(3, 10)
        losses = torch.stack([model(row) for row in x])
        with cockpit(step, info={"batch_size": 3, "loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        return cockpit.get_output()[step]["HessMaxEV"], top.converged[step]

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = [tracked_step(0), tracked_step(1), tracked_step(0)]
    assert torch.equal(torch.rand(3), expected)
    for value, converged in results:
        assert converged and abs(value - 2.0) < 1e-12
    assert [len(d) for d in drawn] == [6, 6, 6]  # after products 2, 3, ..., 7 (8 = 4 per start vector)
    for vector in drawn[0] + drawn[1]:
        magnitudes = vector.abs()
        assert vector.shape == (10,) and float(magnitudes.min()) > 0
        assert float(magnitudes.max() / magnitudes.min()) <= 3 + 1e-12
        assert len(set(magnitudes.tolist())) == 10  # random magnitudes, not +-1
    assert not any(torch.equal(a, b) for a in drawn[0] for b in drawn[1])
    assert all(torch.equal(a, b) for a, b in zip(drawn[0], drawn[2]))
