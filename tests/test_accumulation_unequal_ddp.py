"""Unequal micro-batches under DDP: each rank's 4 rows in micro-batches of other sizes on each rank (3 + 1 on
rank 0, 1 + 3 on rank 1), each backpropagating its mean loss times its share of the rank's rows, the first inside
``no_sync()``. DDP averages the ranks' gradients: the step's mean-loss gradient over all 8 rows. Every quantity
equals one process on the 8 rows as one batch (float64; the one-process reference is checked against brute force
in tests/test_accumulation.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cockpit_like import Cockpit
from tests.helpers import assert_nested_close
from tests.test_distributed import GLOBAL_BATCH, STEPS, _ddp, _problem, _quantities, _rows, _spawn, _train_accumulated

CASES = [("mlp", "economy"), ("cnn", "full")]
SIZES = {0: (3, 1), 1: (1, 3)}


def _train_unequal(problem: str, preset: str, rank: int) -> Cockpit:
    model, batch, lossfunc, individual = _problem(problem)
    net = _ddp(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), _quantities(preset), model=net, log_rank=None, distributed_timeout=60)
    sizes = SIZES[rank]
    for step in range(STEPS):
        inputs, labels = batch(GLOBAL_BATCH, 1000 + step)
        inputs, labels = inputs[_rows(rank)], labels[_rows(rank)]
        optimizer.zero_grad()
        start = 0
        for micro, size in enumerate(sizes):
            part = slice(start, start + size)
            start += size
            last = micro == len(sizes) - 1
            with contextlib.nullcontext() if last else net.no_sync():
                outputs = net(inputs[part])
                loss = lossfunc(outputs, labels[part])
                info = {"batch_size": size, "individual_losses": individual(outputs, labels[part]), "loss": loss,
                        "optimizer": optimizer, "micro_batches": len(sizes)}  # fmt: skip
                if last:
                    torch.manual_seed(step)
                with cockpit(step, info=info):
                    (loss * size / len(labels)).backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit


def job(rank: int) -> dict:
    results = {}
    for problem, preset in CASES:
        cockpit = _train_unequal(problem, preset, rank)
        results[(problem, preset)] = (cockpit.get_output(), {s: dict(c) for s, c in cockpit.checks.items()})
    return results


@pytest.mark.slow
def test_unequal_micro_batches_under_ddp_match_one_process(tmp_path):
    ranks = _spawn("tests.test_accumulation_unequal_ddp:job", tmp_path)
    for problem, preset in CASES:
        expected = _train_accumulated(problem, preset, slice(None), 1).get_output()
        for rank, result in enumerate(ranks):
            output, checks = result[(problem, preset)]
            assert all(c["valid"] for c in checks.values()), checks
            output = {s: {k: v for k, v in values.items() if k != "checks"} for s, values in output.items()}
            reference = {s: {k: v for k, v in values.items() if k != "checks"} for s, values in expected.items()}
            assert_nested_close(output, reference, f"unequal DDP {problem}/{preset}/rank{rank}")
