"""Alpha's start step layer by layer: per-sample dots with the per-parameter predicted update (element-wise optimizers)."""

import warnings

import pytest
import torch
from torch import nn

import cockpit_like.utils.optim as optim_utils
from cockpit_like import Cockpit
from cockpit_like.backends.per_sample_stats import PredictedSlopes, RetainedDense, RetainedFactors, RetainedSequence
from cockpit_like.quantities import Alpha
from cockpit_like.utils.schedules import linear
from tests.zoo import ZOO

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    # writes the shadows' gradients in place (the look-ahead's lent batch sums are made again)
    "nesterov_foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, foreach=True),
}


def _run(name, optimizer_name, steps=4):
    problem = ZOO[name](0)
    model = problem.model
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    alpha = Alpha(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[alpha], model=model)
    for step in range(steps):
        inputs, targets = problem.batch(5, step)
        optimizer.zero_grad()
        losses = problem.sample_losses(problem.forward(model, inputs), targets)
        loss = losses.mean()
        with cockpit(step, info={"batch_size": 5, "loss": loss, "individual_losses": losses.detach(), "optimizer": optimizer}):
            loss.backward()
        optimizer.step()
    return alpha.get_output()


@pytest.mark.parametrize("name", ["layernorm_mlp", "encoder", "resnet_groupnorm", "custom"])
@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_layer_by_layer_equals_retaining_everything(monkeypatch, name, optimizer_name):
    predicted = _run(name, optimizer_name)
    monkeypatch.setattr(optim_utils, "is_elementwise", lambda optimizer: False)  # the retaining path
    retained = _run(name, optimizer_name)
    assert list(predicted) == list(retained) == [0, 1, 2]
    assert list(predicted.values()) == pytest.approx(list(retained.values()), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("lent_sums_written", [False, True])
def test_the_kept_gradient_sum_survives_an_optimizer_that_writes_gradients(lent_sums_written):
    # the batch sums are lent to the look-ahead uncopied; foreach SGD with Nesterov momentum writes into them,
    # so they are made again: the kept sum (read when the update's direction turns out different) is exact
    problem = ZOO["encoder"](0)
    model = problem.model
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, foreach=lent_sums_written)
    alpha = Alpha(linear(1))
    cockpit = Cockpit(params, quantities=[alpha], model=model)
    for step in range(2):  # the second step has momentum buffers: nesterov adds them into the gradient
        inputs, targets = problem.batch(5, step)
        optimizer.zero_grad()
        losses = problem.sample_losses(problem.forward(model, inputs), targets)
        info = {"batch_size": 5, "loss": losses.mean(), "individual_losses": losses.detach(), "optimizer": optimizer}
        with cockpit(step, info=info):
            losses.mean().backward()
        grads = [p.grad.clone() for p in params]
        kept = alpha.load_from_cache(step, "grad_batch_sum")
        for g, k in zip(grads, kept):
            assert torch.allclose(k.reshape(g.shape), g, rtol=1e-10, atol=1e-13)
        optimizer.step()


def test_nothing_per_sample_is_kept_with_an_elementwise_optimizer():
    problem = ZOO["encoder"](0)
    model = problem.model
    params = list(model.parameters())
    from cockpit_like.backends.per_sample import PerSampleReducer
    from cockpit_like.backends.step import StepExecution

    seen = []
    original = PerSampleReducer.results

    def spy(self):
        results = original(self)
        seen.extend(v for k, v in results.items() if isinstance(k, PredictedSlopes))
        return results

    PerSampleReducer.results = spy
    try:
        optimizer = torch.optim.Adam(params, lr=1e-2)
        cockpit = Cockpit(params, quantities=[Alpha(linear(1))], model=model)
        inputs, targets = problem.batch(5, 0)
        losses = problem.sample_losses(model(inputs), targets)
        with cockpit(0, info={"batch_size": 5, "loss": losses.mean(), "individual_losses": losses.detach(), "optimizer": optimizer}):
            losses.mean().backward()
    finally:
        PerSampleReducer.results = original
    (result,) = seen
    assert result["mode"] == "predicted" and result["dots"].shape == (5,)
    assert all(d.shape == p.shape for d, p in zip(result["direction"], params))
    assert not any(isinstance(v, (RetainedDense, RetainedFactors, RetainedSequence)) for v in result.values())
    assert StepExecution  # imported for the reader: the statistic runs inside the step's reducer


class _CustomSGD(torch.optim.SGD):
    """A subclass may couple parameters in its step: not treated as element-wise."""


def test_other_optimizers_retain_and_agree():
    assert optim_utils.is_elementwise(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    assert not optim_utils.is_elementwise(_CustomSGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    assert not optim_utils.is_elementwise(torch.optim.LBFGS([nn.Parameter(torch.zeros(1))]))
    state = PredictedSlopes("k").init_for_step([nn.Parameter(torch.zeros(2))], {"optimizer": _CustomSGD([nn.Parameter(torch.zeros(1))], lr=0.1)})
    assert state["mode"] == "retained"
    assert PredictedSlopes("k").init_for_step([nn.Parameter(torch.zeros(2))], {})["mode"] == "retained"


def test_accumulated_gradients_are_flagged():
    """p.grad holds two backward passes, the per-sample gradients one: the update's direction differs from
    the layer-by-layer prediction. Since issue 34 the step's gradient check finds it first."""
    problem = ZOO["layernorm_mlp"](0)
    model = problem.model
    # with weight decay the update's direction depends on the gradient's size, not only its direction
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.5)
    alpha = Alpha(linear(2))
    cockpit = Cockpit(model.parameters(), quantities=[alpha], model=model)
    inputs, targets = problem.batch(5, 0)
    problem.sample_losses(model(inputs), targets).mean().backward()  # not zeroed before the step

    def tracked(step, expect_warning):
        losses = problem.sample_losses(model(inputs), targets)
        info = {"batch_size": 5, "loss": losses.mean(), "individual_losses": losses.detach(), "optimizer": optimizer}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with cockpit(step, info=info):
                losses.mean().backward()
        messages = [str(w.message) for w in caught if "Full backward hook" not in str(w.message)]
        assert any("differs in direction" in m for m in messages) == expect_warning, messages

    # issue 34: the self-check sees it first: the rows do not average to p.grad, so step 0 stores nothing
    # (Alpha made no prediction to flag) and says why
    tracked(0, expect_warning=False)
    optimizer.step()
    optimizer.zero_grad()
    tracked(1, expect_warning=False)
    assert list(alpha.get_output()) == []
    failed = cockpit.invalid_steps[0]
    assert failed[0]["check"] == "stale_gradient" and "zero_grad" in failed[0]["reason"]
    assert [f.rule for f in cockpit.findings] == ["gradients-accumulate"]  # the self-check's own finding, once


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
        lambda p: torch.optim.Adagrad(p, lr=0.1),
    ],
)
def test_lookahead_of_some_parameters_equals_the_full_lookahead(make):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 2, dtype=torch.float64)), nn.Parameter(torch.randn(4, dtype=torch.float64))]
    optimizer = make([{"params": params[:1]}, {"params": params[1:], "lr": 0.03}])
    for _ in range(2):  # some optimizer state
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    full = optim_utils.lookahead_update(optimizer, params)
    some = optim_utils.lookahead_parameters(optimizer, {params[1]: params[1].grad})
    each = optim_utils.lookahead_parameters(optimizer, {p: p.grad for p in params})
    torch.testing.assert_close(some[params[1]], full[1], rtol=0, atol=0)
    for p, f in zip(params, full):
        torch.testing.assert_close(each[p], f, rtol=0, atol=0)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # nothing was stepped


@pytest.mark.parametrize("budget", [0, 1 << 40])
def test_the_chunk_budget_does_not_change_the_dots(budget):
    """Flushing after every layer or once at the end gives the same dots (and the dense twin's)."""
    from cockpit_like.backends.per_sample import PerSampleReducer

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3, dtype=torch.float64)), nn.Parameter(torch.randn(4, dtype=torch.float64)), nn.Parameter(torch.randn(5, 2, dtype=torch.float64))]
    optimizer = torch.optim.Adam(params, lr=0.01)
    x, delta = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    a, b = torch.randn(6, 7, 5, dtype=torch.float64), torch.randn(6, 7, 2, dtype=torch.float64)
    stat = PredictedSlopes("k", budget_bytes=budget)
    reducer = PerSampleReducer([stat], params, keep_grad_batch=False, info={"optimizer": optimizer})
    reducer.reduce_factors(params[0], "weight", x, delta)
    reducer.reduce_factors(params[1], "bias", None, delta)
    reducer.reduce_sequence(params[2], a, b)
    result = reducer.results()[stat]
    dense = [delta.unsqueeze(2) * x.unsqueeze(1), delta, torch.einsum("btr,btc->brc", a, b)]
    sums = {p: g.sum(0) for p, g in zip(params, dense)}
    updates = optim_utils.lookahead_parameters(optimizer, sums)
    expected = sum(g.reshape(6, -1) @ updates[p].reshape(-1) for p, g in zip(params, dense))
    torch.testing.assert_close(result["dots"], expected, rtol=1e-12, atol=1e-14)
    for p, d in zip(params, result["direction"]):
        torch.testing.assert_close(d, updates[p])
