"""HessMaxEV and the eigen solvers against torch.linalg.eigvalsh (float64)."""

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.backends import randomness
from cockpit_like.functional.eigen import accelerated_power_iteration, lanczos, power_iteration
from cockpit_like.quantities import HessMaxEV, HessTrace
from cockpit_like.quantities.hess_max_ev import MissingGraphError
from cockpit_like.utils import schedules
from tests.helpers import dense_hessian, make_batch, make_problem, train


def random_symmetric(eigenvalues, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    n = len(eigenvalues)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return (q @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ q.T).to(dtype)


# ---- solvers ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_power_iteration_top_magnitude_any_dtype(dtype):
    """Cockpit's power iteration crashes on float64; ours works in both dtypes."""
    matrix = random_symmetric([5.0, 2.0, 1.0, -1.0, 0.5, 0.1], seed=1, dtype=dtype)
    start = torch.rand(6, generator=torch.Generator().manual_seed(2), dtype=dtype)
    result = power_iteration(lambda v: matrix @ v, start)
    assert result.converged and result.vector.dtype == dtype
    assert result.value == pytest.approx(5.0, rel=2e-3)
    assert result.num_matvecs >= 2


def test_power_iteration_finds_largest_magnitude_and_warm_start_is_cheaper():
    matrix = random_symmetric([3.0, 1.0, 0.2, -6.0], seed=3)
    start = torch.ones(4, dtype=torch.float64)
    cold = power_iteration(lambda v: matrix @ v, start, rtol=1e-10, atol=0, max_iter=1000)
    assert cold.value == pytest.approx(-6.0, rel=1e-8)
    warm = power_iteration(lambda v: matrix @ v, cold.vector, rtol=1e-10, atol=0)
    assert warm.num_matvecs == 2 < cold.num_matvecs


def test_power_iteration_stop_rule_and_max_iter_warning():
    matrix = random_symmetric([1.0, 0.999, 0.5], seed=4)
    calls = []

    def matvec(v):
        calls.append(1)
        return matrix @ v

    with pytest.warns(RuntimeWarning, match="did not converge in 3"):
        result = power_iteration(matvec, torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64), rtol=0, atol=0, max_iter=3)
    assert not result.converged and result.num_matvecs == len(calls) == 3
    zero = power_iteration(lambda v: torch.zeros_like(v), torch.ones(3, dtype=torch.float64))
    assert zero.value == 0.0 and zero.converged
    with pytest.raises(ValueError, match="non-zero"):
        power_iteration(lambda v: v, torch.zeros(3))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("spectrum", [[5.0, 4.9, 4.7, 2.0, 1.0, 0.3, -0.5], [3.0, 1.0, 0.2, -5.8, -5.9, 0.1, 2.9]])
def test_accelerated_power_iteration_never_behind_power_iteration(seed, spectrum):
    """After the same number of products the Ritz estimate is at least as close to the eigenvalue
    of largest magnitude (the second spectrum's is negative) as the power iteration's."""
    matrix = random_symmetric(spectrum, seed=seed)
    target = max(spectrum, key=abs)
    start = torch.rand(len(spectrum), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for k in range(1, 7):
        plain = power_iteration(lambda v: matrix @ v, start, max_iter=k, rtol=0, atol=0, warn=False)
        fast = accelerated_power_iteration(lambda v: matrix @ v, start, max_iter=k, rtol=0, atol=0, warn=False)
        assert plain.num_matvecs == fast.num_matvecs == k
        assert abs(fast.value - target) <= abs(plain.value - target) + 1e-12
    # with the stop rule: converged, correct and cheaper than the plain iteration
    plain = power_iteration(lambda v: matrix @ v, start, rtol=1e-6, atol=0, max_iter=500)
    fast = accelerated_power_iteration(lambda v: matrix @ v, start, rtol=1e-6, atol=0)
    assert fast.converged and fast.value == pytest.approx(target, rel=1e-6)
    assert fast.num_matvecs < plain.num_matvecs
    assert abs(float(fast.vector @ matrix @ fast.vector) - target) < 1e-5  # its Ritz vector
    torch.testing.assert_close(fast.vector.norm(), torch.tensor(1.0, dtype=torch.float64))


def test_accelerated_power_iteration_edge_cases():
    zero = accelerated_power_iteration(lambda v: torch.zeros_like(v), torch.ones(3, dtype=torch.float64))
    assert zero.value == 0.0 and zero.converged and zero.num_matvecs == 1
    matrix = random_symmetric([1.0, 0.999, 0.5, 0.2], seed=4)
    with pytest.warns(RuntimeWarning, match="did not converge in 2"):
        result = accelerated_power_iteration(lambda v: matrix @ v, torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64),
                                             rtol=0, atol=0, max_iter=2)
    assert not result.converged
    # the whole space spanned: exact, and stops
    full = accelerated_power_iteration(lambda v: matrix @ v, torch.ones(4, dtype=torch.float64), rtol=0, atol=0)
    assert full.converged and full.num_matvecs <= 4 and full.value == pytest.approx(1.0, rel=1e-10)
    with pytest.raises(ValueError, match="max_iter"):
        accelerated_power_iteration(lambda v: v, torch.ones(2), max_iter=0)


def test_plain_power_option_is_cockpits_power_iteration():
    """accelerate=False, warm_start=False: Cockpit's algorithm, i.e. power_iteration from
    U[0, 1) entries per parameter (drawn by the cockpit's generator of the step, not torch's), value for value."""
    model, lossfunc, individual = make_problem("mlp")
    quantity = HessMaxEV(schedules.linear(1), accelerate=False, warm_start=False)
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
    inputs, labels = make_batch("mlp", 6, seed=0)
    torch.manual_seed(3)
    loss = lossfunc(model(inputs), labels)
    with cockpit(0, info={"loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    hessian = dense_hessian(model, inputs, labels)
    draws = randomness.generator(0, "power iteration start")
    start = torch.cat([torch.rand(p.shape, dtype=p.dtype, generator=draws).reshape(-1) for p in model.parameters()])
    expected = power_iteration(lambda v: hessian @ v, start)
    assert quantity.hvp_counts[0] == expected.num_matvecs
    assert quantity.get_output()[0] == pytest.approx(expected.value, rel=1e-9)


def test_power_iteration_residual_is_that_of_its_value():
    """The residual power_iteration returns is ||A u - value u|| of the unit vector whose Rayleigh quotient it is."""
    matrix = random_symmetric([2.0, 1.9, -1.95, 0.3, 0.1], seed=4)
    start = torch.rand(5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for max_iter in (1, 2, 5, 40):
        result = power_iteration(lambda v: matrix @ v, start, max_iter=max_iter, warn=False)
        # replay the iteration by hand: the vector before the last product
        u = start / start.norm()
        for _ in range(result.num_matvecs - 1):
            u = matrix @ u / (matrix @ u).norm()
        assert float(u @ matrix @ u) == pytest.approx(result.value, rel=1e-12)
        assert result.residual == pytest.approx(float((matrix @ u - result.value * u).norm()), rel=1e-9, abs=1e-15)


def test_plain_power_iteration_is_never_stored_as_converged():
    """accelerate=False: Cockpit's stop rule (two consecutive estimates agree) is met by chance far from an
    eigenvector on a GroupNorm CNN whose two ends have nearly equal magnitude (seed 3: 0.325 after 4 products
    where the eigenvalue of largest magnitude is -1.208, dense float64 Hessian). The value stays Cockpit's
    (bit for bit), and no step of the plain power iteration is stored as converged."""
    from benchmarks.power_iteration_claims import GroupNormCNN

    generator = torch.Generator().manual_seed(123)
    inputs = torch.randn(4, 1, 5, 5, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 3, (4,), generator=generator)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = GroupNormCNN()
    finally:
        torch.set_default_dtype(default)
    lossfunc = torch.nn.CrossEntropyLoss()
    hessian = dense_hessian(model, inputs, labels)
    eigenvalues = torch.linalg.eigvalsh(hessian)
    target = float(eigenvalues[eigenvalues.abs().argmax()])
    far_off_stops, before = 0, randomness.get_seed()
    try:
        for seed in range(10):
            randomness.set_seed(seed)
            quantity = HessMaxEV(schedules.linear(1), accelerate=False)
            cockpit = Cockpit(model.parameters(), quantities=[quantity], model=model)
            model.zero_grad()
            loss = lossfunc(model(inputs), labels)
            with cockpit(0, info={"loss": loss}):
                loss.backward(create_graph=cockpit.create_graph(0))
            draws = randomness.generator(0, "power iteration start")
            start = torch.cat([torch.rand(p.shape, dtype=p.dtype, generator=draws).reshape(-1) for p in model.parameters()])
            cockpits = power_iteration(lambda v: hessian @ v, start)
            assert quantity.get_output()[0] == pytest.approx(cockpits.value, rel=1e-9)  # Cockpit's value, kept
            assert quantity.hvp_counts[0] == cockpits.num_matvecs
            assert quantity.converged[0] is False
            far_off_stops += cockpits.converged and abs(cockpits.value - target) > 0.5 * abs(target)
    finally:
        randomness.set_seed(before)
    assert far_off_stops >= 1  # what the flag would have claimed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lanczos_largest_algebraic(seed):
    generator = torch.Generator().manual_seed(seed)
    n = 40
    matrix = torch.randn(n, n, generator=generator, dtype=torch.float64)
    matrix = matrix + matrix.T
    exact = torch.linalg.eigvalsh(matrix)
    result = lanczos(lambda v: matrix @ v, torch.rand(n, generator=generator, dtype=torch.float64), rtol=1e-10)
    assert result.converged
    assert result.value == pytest.approx(exact[-1].item(), rel=1e-9)
    residual = matrix @ result.vector - result.value * result.vector
    assert residual.norm() <= 1e-8 * abs(result.value)
    # warm start from the answer converges at once
    again = lanczos(lambda v: matrix @ v, result.vector, rtol=1e-8)
    assert again.num_matvecs < result.num_matvecs and again.value == pytest.approx(result.value, rel=1e-9)


def test_lanczos_negative_dominant_and_small_space():
    matrix = torch.diag(torch.tensor([2.0, -9.0, 1.0], dtype=torch.float64))
    result = lanczos(lambda v: matrix @ v, torch.ones(3, dtype=torch.float64))
    assert result.value == pytest.approx(2.0, rel=1e-12)  # "LA", not largest magnitude
    assert result.num_matvecs <= 3


# ---- the quantity -----------------------------------------------------------------
CASES = [("mlp", True, 5), ("mlp", False, 3), ("cnn", True, 4), ("cnn", False, 6)]


@pytest.mark.parametrize("problem,bias,batch_size", CASES)
def test_against_dense_hessian(problem, bias, batch_size):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    power = HessMaxEV(schedules.linear(1))
    krylov = HessMaxEV(schedules.linear(1), use_power=False, rtol=1e-10)
    cockpit = Cockpit(model.parameters(), quantities=[power, krylov])
    refs = {}

    def record(step, model, inputs, labels):
        refs[step] = torch.linalg.eigvalsh(dense_hessian(model, inputs, labels))

    torch.manual_seed(0)
    train(model, lossfunc, individual, cockpit, problem, steps=3, batch_size=batch_size, record=record)
    for step, eigenvalues in refs.items():
        largest = eigenvalues[-1].item()
        largest_magnitude = eigenvalues[eigenvalues.abs().argmax()].item()
        value = power.get_output()[step]
        assert isinstance(value, float)
        # the power iteration's own accuracy (stop rule rtol=1e-3); Cockpit allows 2e-2
        assert value == pytest.approx(largest_magnitude, rel=2e-2)
        assert krylov.get_output()[step] == pytest.approx(largest, rel=1e-9)
    assert sorted(power.hvp_counts) == sorted(krylov.hvp_counts) == [0, 1, 2]
    assert all(power.converged.values()) and all(krylov.converged.values())


def test_warm_start_keeps_values_and_records_products():
    """warm_start=True (block Lanczos from the probe and the previous Ritz vectors) gives the same
    eigenvalues to the tolerance; the first step is the cold start of the same probe."""
    counts = {}
    values = {}
    for warm in (True, False):
        model, lossfunc, individual = make_problem("mlp")
        quantity = HessMaxEV(schedules.linear(1), warm_start=warm)
        cockpit = Cockpit(model.parameters(), quantities=[quantity])
        torch.manual_seed(0)
        train(model, lossfunc, individual, cockpit, "mlp", steps=4, batch_size=8,
              optimizer=torch.optim.SGD(model.parameters(), lr=0.02))
        counts[warm] = quantity.hvp_counts
        values[warm] = quantity.get_output()
        assert all(quantity.converged.values())
    assert counts[True][0] == counts[False][0]  # same random start at the first step
    assert values[True][0] == values[False][0]
    for step in values[True]:
        assert values[True][step] == pytest.approx(values[False][step], rel=2e-3)


def test_declares_graph_only_at_its_steps_and_no_special_case():
    schedule = schedules.linear(2)
    quantity = HessMaxEV(schedule)
    assert quantity.create_graph(0) and not quantity.create_graph(1)
    assert quantity.extensions(0) == []
    model, _, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(schedules.linear(1)), quantity])
    assert [cockpit.create_graph(s) for s in range(4)] == [True, False, True, False]

    class SubclassedEV(HessMaxEV):
        """A plugin subclass works the same: the graph comes from create_graph()."""

    sub = SubclassedEV(schedules.linear(1), use_power=False)
    assert Cockpit(model.parameters(), quantities=[sub]).create_graph(5)


def test_missing_graph_is_a_clear_error():
    model, lossfunc, _ = make_problem("mlp")
    inputs, labels = make_batch("mlp", 4, seed=0)
    cockpit = Cockpit(model.parameters(), quantities=[HessMaxEV(schedules.linear(1))])
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(MissingGraphError, match="create_graph=cockpit.create_graph"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()  # create_graph forgotten


@pytest.mark.parametrize("kwargs,match", [({"max_iter": 0}, "max_iter"), ({"rtol": 0.0}, "rtol")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HessMaxEV(schedules.linear(1), **kwargs)


def test_settings_and_float32_model():
    quantity = HessMaxEV(schedules.linear(1), use_power=False)
    assert quantity.settings() == {
        "use_power": False, "warm_start": False, "accelerate": True, "max_iter": 100, "rtol": 1e-2, "atol": 1e-6,
        "solver": "lanczos",
    }
    model, lossfunc, individual = make_problem("mlp")
    model = model.float()
    cockpit = Cockpit(model.parameters(), quantities=[HessMaxEV(schedules.linear(1))])
    inputs, labels = make_batch("mlp", 4, seed=0)
    loss = lossfunc(model(inputs.float()), labels)
    with cockpit(0, info={"loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    exact = torch.linalg.eigvalsh(dense_hessian(model.double(), inputs, labels))
    largest_magnitude = exact[exact.abs().argmax()].item()
    assert cockpit.get_output()[0]["HessMaxEV"] == pytest.approx(largest_magnitude, rel=2e-2)


def test_in_place_change_before_tracking():
    """The shared decomposition runs before any quantity is tracked, so a quantity that modifies the
    parameters in place no longer breaks HessMaxEV; Cockpit's plain power iteration (its own products,
    when it is tracked) still gets a clear error."""
    from cockpit_like.quantities.quantity import SingleStepQuantity

    class Meddler(SingleStepQuantity):
        def _compute(self, global_step, params, batch_loss):
            with torch.no_grad():
                for p in params:
                    p.add_(0.0)
            return 0.0

    model, lossfunc, _ = make_problem("mlp")
    inputs, labels = make_batch("mlp", 4, seed=0)
    cockpit = Cockpit(model.parameters(), quantities=[Meddler(schedules.linear(1)), HessMaxEV(schedules.linear(1))])
    loss = lossfunc(model(inputs), labels)
    with cockpit(0, info={"loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    assert isinstance(cockpit.get_output()[0]["HessMaxEV"], float)
    model.zero_grad(set_to_none=True)
    plain = HessMaxEV(schedules.linear(1), accelerate=False)
    cockpit = Cockpit(model.parameters(), quantities=[Meddler(schedules.linear(1)), plain])
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(RuntimeError, match="modified in place after backward"):
        with cockpit(0, info={"loss": loss}):
            loss.backward(create_graph=cockpit.create_graph(0))


def test_create_graph_steps_record_no_graph_for_the_extensions():
    """At a HessMaxEV step (backward with create_graph=True) the BackPACK extensions and the
    per-sample statistics run under no_grad: the user's buffers carry no graph and every value
    equals the one computed at the same step without HessMaxEV."""
    from backpack.extensions import BatchGrad, DiagHessian

    from cockpit_like.quantities import GradHist1d, NormTest

    results = {}
    for with_ev in (False, True):
        model, lossfunc, individual = make_problem("cnn")
        quantities = [HessTrace(schedules.linear(1)), NormTest(schedules.linear(1)), GradHist1d(schedules.linear(1))]
        if with_ev:
            quantities.append(HessMaxEV(schedules.linear(1)))
        cockpit = Cockpit(model.parameters(), quantities=quantities)
        inputs, labels = make_batch("cnn", 6, seed=5)
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        user_exts = (BatchGrad(), DiagHessian())
        info = {"batch_size": 6, "individual_losses": individual(outputs, labels), "loss": loss}
        assert cockpit.create_graph(0) is with_ev
        with cockpit(0, *user_exts, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))
        assert [type(ext) for ext in user_exts] == [BatchGrad, DiagHessian]  # the user's objects are untouched
        buffers = [(p.grad_batch, p.diag_h) for p in model.parameters()]
        for grad_batch, diag_h in buffers:  # no graph hangs on them (a bias's grad_batch may be
            assert grad_batch.grad_fn is None and diag_h.grad_fn is None  # autograd's own leaf)
        results[with_ev] = (buffers, cockpit.get_output()[0])
    for (gb0, dh0), (gb1, dh1) in zip(results[False][0], results[True][0]):
        torch.testing.assert_close(gb1, gb0, rtol=0, atol=0)
        torch.testing.assert_close(dh1, dh0, rtol=0, atol=0)
    without, with_ev = results[False][1], results[True][1]
    assert with_ev["NormTest"] == without["NormTest"]
    for a, b in zip(with_ev["HessTrace"], without["HessTrace"]):
        assert a == b
    assert "HessMaxEV" in with_ev
