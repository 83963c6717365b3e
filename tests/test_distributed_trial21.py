"""Outside trial 21 (DDP on CPU, gloo): what the cockpit did to the run around graph steps, and the errors there.

- an ``UnequalBatchError`` the loop catches at a graph step (the full preset) left the ranks stepping with their
  own, unsynchronised gradients: the replicas drifted apart (0.13 after one step) and later steps were stored
  valid with numbers of no global batch. The cockpit now makes DDP's average before anything can stop the step;
- DDP skipped the broadcast of rank 0's buffers at the forward pass after a graph step (BatchNorm's running
  statistics on rank 1 followed its own batches);
- ``DistributedDataParallel(static_graph=True)`` crashed in PyTorch ("a leaf Variable ... in-place") at the first
  graph step: now a clear error before the backward pass, whose forward pass ran synchronised;
- ``UnequalBatchError`` at a step the schedule leaves out said "leave this step untracked": it names the two-step
  quantities that end there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.test_distributed import _spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _data(step: int, sizes: tuple[int, int], rank: int):
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(sum(sizes), 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (sum(sizes),), generator=generator)
    start = sum(sizes[:rank])
    return x[start : start + sizes[rank]], y[start : start + sizes[rank]]


def _run(rank: int, preset: str | None, sizes: dict, batchnorm: bool = False, static_graph: bool = False,
         schedule=None) -> dict:
    """Three DDP steps; the loop catches the cockpit's errors and backpropagates anyway (as without it)."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 5)] + ([nn.BatchNorm1d(5)] if batchnorm else []) + [nn.Tanh(), nn.Linear(5, 3)]
    model = nn.Sequential(*layers).double()
    net = nn.parallel.DistributedDataParallel(model, static_graph=static_graph)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    quantities = None if preset is None else configuration(preset, schedule or linear(1))
    cockpit = None if quantities is None else Cockpit(model.parameters(), quantities, model=net, distributed_timeout=60)
    errors = {}
    for step in range(3):
        x, y = _data(step, sizes.get(step, (4, 4)), rank)
        optimizer.zero_grad()
        outputs = net(x)
        losses = nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": len(y), "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
        if cockpit is None:
            losses.mean().backward()
        else:
            try:
                with cockpit(step, info=info):
                    losses.mean().backward(create_graph=cockpit.create_graph(step))
            except Exception as error:  # noqa: BLE001 - the loop goes on
                errors[step] = f"{type(error).__name__}: {error}"
                if not any(p.grad is not None for p in model.parameters()):
                    losses.mean().backward()  # refused before the backward pass: the step as without the cockpit
        optimizer.step()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()], "errors": errors,
            "output": None if cockpit is None else cockpit.get_output()}


def _job(rank: int) -> dict:
    unequal = {1: (5, 3)}
    return {
        "caught": _run(rank, "full", unequal), "caught_plain": _run(rank, None, unequal),
        "bn": _run(rank, "full", {}, batchnorm=True), "bn_plain": _run(rank, None, {}, batchnorm=True),
        "static": _run(rank, "full", {}, static_graph=True), "static_plain": _run(rank, None, {}, static_graph=True),
        "ending": _run(rank, "economy", {1: (5, 3)}, schedule=linear(2)),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn("tests.test_distributed_trial21:_job", tmp_path_factory.mktemp("ddp21"))


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_an_unequal_batch_error_caught_at_a_graph_step_leaves_the_run_a_ddp_run(ranks):
    for result in ranks:
        assert "UnequalBatchError" in result["caught"]["errors"][1]
        assert _same(result["caught"]["params"], result["caught_plain"]["params"])
    assert _same(ranks[0]["caught"]["params"], ranks[1]["caught"]["params"])
    stored = ranks[0]["caught"]["output"]  # (rank 0 keeps the output)
    assert sorted(stored) == [0, 2] and stored[2]["checks"]["valid"] and "HessMaxEV" in stored[2]


@pytest.mark.slow
def test_buffers_are_broadcast_after_a_graph_step_as_without_the_cockpit(ranks):
    for result in ranks:
        assert _same(result["bn"]["params"], result["bn_plain"]["params"])
        assert _same(result["bn"]["buffers"], result["bn_plain"]["buffers"])


@pytest.mark.slow
def test_static_graph_with_graph_quantities_is_a_clear_error_and_the_run_goes_on(ranks):
    for result in ranks:
        assert set(result["static"]["errors"]) == {0, 1, 2}
        assert all("static_graph=True" in error and "economy" in error for error in result["static"]["errors"].values())
        assert _same(result["static"]["params"], result["static_plain"]["params"])


@pytest.mark.slow
def test_unequal_batches_at_a_step_only_two_step_quantities_track_say_so(ranks):
    for result in ranks:
        (error,) = result["ending"]["errors"].values()
        assert "['Alpha', 'UpdateSize'] started at step 0 end here" in error
