"""SquaredNorms: per-sample gradient norms, against a brute-force loop over rows (float64)."""

from __future__ import annotations

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.backends.per_sample_stats import SquaredNorms
from cockpit_like.context import get_record
from cockpit_like.quantities.quantity import SingleStepQuantity
from cockpit_like.utils.schedules import linear
from tests import zoo


class PerSampleNorms(SingleStepQuantity):
    """``[||g_i|| for i]`` through the custom-quantity extension point."""

    def per_sample_stats(self, global_step):
        return [SquaredNorms()] if self.should_compute(global_step) else []

    def _compute(self, global_step, params, batch_loss):
        record = get_record(global_step)
        return (record.stat(SquaredNorms()).sqrt() * record.info["batch_size"]).tolist()


@pytest.mark.parametrize("name", ["encoder", "layernorm_mlp", "resnet_groupnorm"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_per_sample_norms_equal_brute_force(name, micro_batches):
    problem = zoo.ZOO[name](0)
    params = list(problem.model.parameters())
    inputs, targets = problem.batch(4, 3)
    cockpit = Cockpit(params, [PerSampleNorms(linear(1))], model=problem.model)
    size = 4 // micro_batches
    for micro in range(micro_batches):
        part = slice(micro * size, (micro + 1) * size)
        losses = problem.sample_losses(problem.forward(problem.model, inputs[part]), targets[part])
        with cockpit(0, info={"batch_size": size, "loss": losses.mean(), "micro_batches": micro_batches}):
            (losses.mean() / micro_batches).backward()
    rows = zoo.per_sample_grads_loop(problem, inputs, targets, params)
    expected = torch.cat([g.reshape(4, -1) for g in rows], 1).square().sum(1).sqrt()
    torch.testing.assert_close(torch.tensor(cockpit.get_output()[0]["PerSampleNorms"], dtype=torch.float64), expected)
