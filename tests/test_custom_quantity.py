"""A custom quantity written only against the documented base classes."""

import pytest
import torch

from cockpit_like import Cockpit
from examples.custom_quantity import LargestSampleGradNorm, LossChange, main
from cockpit_like.utils.schedules import linear
from tests.helpers import PROBLEMS, make_batch, make_problem, mean_loss_fn, per_sample_grads, train


@pytest.mark.parametrize("extended", [True, False])
@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_largest_sample_grad_norm_matches_torch_func(problem, extended):
    """docs/custom_quantities.md's first example: ``BatchGrad()`` alone gives ``p.grad_batch`` on an extended model
    (BackPACK) and on a plain one (the hooks; it raised ``NotExtendedError`` before, outside trial 26)."""
    model, lossfunc, individual = make_problem(problem)
    if not extended:
        model, lossfunc = PROBLEMS[problem][0](bias=True, seed=0), torch.nn.CrossEntropyLoss()
    expected = {}

    def record(step, model, inputs, labels):
        grads = per_sample_grads(model, inputs, labels)
        expected[step] = sum(g.flatten(1).pow(2).sum(1) for g in grads).sqrt().max().item()

    quantity = LargestSampleGradNorm(linear(2))
    cockpit = Cockpit(model.parameters(), quantities=[quantity], model=None if extended else model)
    train(model, lossfunc, individual, cockpit, problem, steps=5, record=record)
    output = quantity.get_output()
    assert sorted(output) == [0, 2, 4]
    for step, value in output.items():
        assert value == pytest.approx(expected[step], rel=1e-10)
    # The quantity asked for grad_batch itself, so it was freed after the step.
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


def test_two_step_custom_quantity():
    model, lossfunc, individual = make_problem("mlp")
    losses = {}

    def record(step, model, inputs, labels):
        flat, _, loss = mean_loss_fn(model, inputs, labels)
        losses[step] = loss(flat).item()

    quantity = LossChange(linear(2))
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
    train(model, lossfunc, individual, cockpit, "mlp", steps=6, record=record)
    output = quantity.get_output()
    assert sorted(output) == [0, 2, 4]
    for t in output:
        assert output[t] == pytest.approx(losses[t + 1] - losses[t], rel=1e-10)
    assert quantity.cached_keys() == []


def test_example_script_runs():
    output = main(steps=3)
    assert sorted(output) == [0, 1, 2]
    assert set(output[0]) - {"checks"} == {"LargestSampleGradNorm", "LossChange"}
    assert set(output[1]) == {"LargestSampleGradNorm"}


def test_users_batch_grad_on_a_plain_model_is_left_for_the_user():
    """``with cockpit(step, BatchGrad(), info=...)`` on a model that is not extended: ``p.grad_batch`` after the
    block (the user's extension keeps its field, as in Cockpit), equal to the per-sample gradients / B."""
    from backpack.extensions import BatchGrad

    from cockpit_like.quantities import GradNorm, Loss

    model = PROBLEMS["mlp"][0](bias=True, seed=0).double()
    cockpit = Cockpit(model.parameters(), quantities=[Loss(linear(1)), GradNorm(linear(1))], model=model)
    inputs, labels = make_batch("mlp", 6, seed=3)
    inputs = inputs.double()
    expected = per_sample_grads(model, inputs, labels)
    outputs = model(inputs)
    loss = torch.nn.functional.cross_entropy(outputs, labels)
    losses = torch.nn.functional.cross_entropy(outputs, labels, reduction="none")
    with cockpit(0, BatchGrad(), info={"batch_size": 6, "individual_losses": losses, "loss": loss}):
        loss.backward()
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad_batch * 6, g, rtol=1e-12, atol=1e-14)
