"""A custom quantity written only against the documented base classes."""

import pytest
import torch

from cockpit_like import Cockpit
from examples.custom_quantity import LargestSampleGradNorm, LossChange, main
from cockpit_like.utils.schedules import linear
from tests.helpers import make_problem, mean_loss_fn, per_sample_grads, train


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_largest_sample_grad_norm_matches_torch_func(problem):
    model, lossfunc, individual = make_problem(problem)
    expected = {}

    def record(step, model, inputs, labels):
        grads = per_sample_grads(model, inputs, labels)
        expected[step] = sum(g.flatten(1).pow(2).sum(1) for g in grads).sqrt().max().item()

    quantity = LargestSampleGradNorm(linear(2))
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
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
