"""Loss, Time, Parameters, GradNorm, Distance, UpdateSize against brute force (float64)."""

import time

import pytest
import torch

from cockpit_like import Cockpit, quantities
from cockpit_like.utils import schedules
from tests.helpers import make_problem, mean_loss_fn, train

SCHEDULES = {
    "every": lambda: schedules.linear(1),
    "odd": lambda: schedules.linear(2, offset=1),
    "log": lambda: schedules.logarithmic(0, 1, steps=4),
}
STEPS = 7


def reference_run(problem, bias, steps=STEPS, optimizer_cls=torch.optim.SGD, **opt_kwargs):
    """Per step: parameters, mean loss and mean gradient, from an independent computation."""
    model, lossfunc, individual = make_problem(problem, bias=bias)
    optimizer = optimizer_cls(model.parameters(), **(opt_kwargs or {"lr": 0.3}))
    refs = {}

    def record(step, model, inputs, labels):
        flat, unflatten, loss = mean_loss_fn(model, inputs, labels)
        gradient = torch.func.grad(loss)(flat)
        refs[step] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "loss": loss(flat).item(),
            "grads": list(unflatten(gradient).values()),
        }

    return model, lossfunc, individual, optimizer, refs, record


def run(problem, bias, make_quantities, optimizer_cls=torch.optim.SGD, **opt_kwargs):
    model, lossfunc, individual, optimizer, refs, record = reference_run(
        problem, bias, optimizer_cls=optimizer_cls, **opt_kwargs
    )
    made = make_quantities()
    cockpit = Cockpit(model.parameters(), quantities=made)
    train(model, lossfunc, individual, cockpit, problem, STEPS, optimizer=optimizer, record=record)
    return cockpit, made, refs


def tracked(schedule_name):
    schedule = SCHEDULES[schedule_name]()
    return [t for t in range(STEPS) if schedule(t)]


def norms(tensors):
    return [t.norm().item() for t in tensors]


ALL = ["Loss", "GradNorm", "Parameters", "Distance", "UpdateSize", "Time"]


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("schedule_name", ["every", "odd", "log"])
@pytest.mark.parametrize("together", [False, True], ids=["alone", "together"])
def test_against_brute_force(problem, bias, schedule_name, together):
    names = ALL if together else ["Loss", "GradNorm", "Parameters", "Distance", "UpdateSize"]
    outputs = {}
    if together:
        cockpit, made, refs = run(
            problem, bias, lambda: [getattr(quantities, n)(SCHEDULES[schedule_name]()) for n in names]
        )
        outputs = {type(q).__name__: q.get_output() for q in made}
    else:
        for name in names:
            cockpit, made, refs = run(problem, bias, lambda: [getattr(quantities, name)(SCHEDULES[schedule_name]())])
            outputs[name] = made[0].get_output()

    steps = tracked(schedule_name)
    assert sorted(outputs["Loss"]) == steps
    for t in steps:
        ref = refs[t]
        assert outputs["Loss"][t] == pytest.approx(ref["loss"], rel=1e-12)
        assert isinstance(outputs["Loss"][t], float)
        assert outputs["GradNorm"][t] == pytest.approx(norms(ref["grads"]), rel=1e-10)
        assert len(outputs["GradNorm"][t]) == len(ref["params"])
        for stored, param in zip(outputs["Parameters"][t], ref["params"]):
            assert torch.equal(torch.tensor(stored, dtype=param.dtype), param)
        distance = norms([p - p0 for p, p0 in zip(ref["params"], refs[0]["params"])])
        assert outputs["Distance"][t] == pytest.approx(distance, rel=1e-12, abs=1e-15)
    update_steps = [t for t in steps if t + 1 < STEPS]
    assert sorted(outputs["UpdateSize"]) == update_steps
    for t in update_steps:
        update = norms([a - b for a, b in zip(refs[t + 1]["params"], refs[t]["params"])])
        assert outputs["UpdateSize"][t] == pytest.approx(update, rel=1e-12)


def test_update_size_with_adam_matches_parameter_difference():
    cockpit, made, refs = run("mlp", True, lambda: [quantities.UpdateSize(schedules.linear(1))], torch.optim.Adam, lr=0.01)
    for t in range(STEPS - 1):
        update = norms([a - b for a, b in zip(refs[t + 1]["params"], refs[t]["params"])])
        assert made[0].get_output()[t] == pytest.approx(update, rel=1e-12)


def test_time_is_taken_when_tracked():
    before = time.time()
    cockpit, made, refs = run("mlp", True, lambda: [quantities.Time(schedules.linear(3))])
    values = made[0].get_output()
    assert sorted(values) == [0, 3, 6]
    assert before <= values[0] <= values[3] <= values[6] <= time.time()


def test_update_size_cache_is_freed_after_the_end_step():
    model, lossfunc, individual = make_problem("mlp")
    update = quantities.UpdateSize(schedules.linear(3))
    cockpit = Cockpit(model.parameters(), quantities=[update])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}

    class Spy(quantities.ByproductQuantity):
        def _compute(self, step, params, loss):
            seen[step] = update.cached_keys()

    cockpit.add(Spy(schedules.linear(1)))
    train(model, lossfunc, individual, cockpit, "mlp", STEPS, optimizer=optimizer)
    # Spy is tracked after UpdateSize: it sees the cache after UpdateSize's own clean-up.
    assert seen == {0: [(0, "params")], 1: [], 2: [], 3: [(3, "params")], 4: [], 5: [], 6: [(6, "params")]}
    assert sorted(update.get_output()) == [0, 3]


def test_update_size_needs_the_next_step():
    """Skipping the step after a start leaves nothing stored for it (and frees the cache)."""
    model, lossfunc, individual = make_problem("mlp")
    update = quantities.UpdateSize(schedules.linear(2))
    cockpit = Cockpit(model.parameters(), quantities=[update])
    for step in [0, 2, 3]:  # step 1 skipped: no cockpit context there
        loss = lossfunc(model(torch.randn(4, 3, 4, dtype=torch.float64)), torch.tensor([0, 1, 2, 3]))
        with cockpit(step, info={"loss": loss}):
            loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    assert sorted(update.get_output()) == [2]
    assert update.cached_keys() == []


def test_distance_reference_is_the_first_step_seen():
    """Cockpit raises when step 0 is skipped; we take the first step the cockpit sees."""
    model, lossfunc, individual = make_problem("mlp")
    distance = quantities.Distance(schedules.linear(2))
    cockpit = Cockpit(model.parameters(), quantities=[distance])
    params = {}
    for step in [3, 4, 5, 6]:
        params[step] = [p.detach().clone() for p in model.parameters()]
        loss = lossfunc(model(torch.randn(4, 3, 4, dtype=torch.float64)), torch.tensor([0, 1, 2, 3]))
        with cockpit(step, info={"loss": loss}):
            loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
    output = distance.get_output()
    assert sorted(output) == [4, 6]
    for t in [4, 6]:
        assert output[t] == pytest.approx(norms([a - b for a, b in zip(params[t], params[3])]), rel=1e-12)
    assert distance.cached_keys() == [(3, "params")]


def test_grad_norm_of_a_parameter_without_gradient_is_zero_and_named():
    """Issue 34: a tracked parameter the loss does not use has a zero gradient (it was an error)."""
    model, lossfunc, individual = make_problem("mlp")
    unused = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    cockpit = Cockpit([*model.parameters(), unused], quantities=[quantities.GradNorm(schedules.linear(1))])
    loss = lossfunc(model(torch.randn(4, 3, 4, dtype=torch.float64)), torch.tensor([0, 1, 2, 3]))
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    values = cockpit.get_output()[0]
    assert values["GradNorm"][6] == 0.0
    assert values["GradNorm"][:6] == pytest.approx([p.grad.norm().item() for p in model.parameters()], rel=1e-12)
    assert values["checks"]["no_gradient"] == ["param_6"] and unused.grad is None
