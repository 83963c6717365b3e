"""The cockpit under FSDP2 (``torch.distributed.fsdp.fully_shard``): 2 gloo ranks on CPU.

Every quantity of the economy preset (and the other first-order quantities
that work sharded) equals one process on the concatenated batch (float64,
rtol 1e-8), on an MLP (also with a frozen layer), a LayerNorm MLP and a transformer encoder, each with
every layer and the root sharded. Per-sample statistics come from module
hooks on each rank's rows, merged as under DDP; the quantities read whole
gradients gathered once per tracked step. Quantities that need
Hessian-vector products are refused with an error that names them.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests import zoo
from tests.test_distributed import _assert_close, _spawn

WORLD, GLOBAL_BATCH, STEPS = 2, 8, 3
PROBLEMS = ("layernorm_mlp", "encoder", "mlp", "frozen_mlp")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _mlp(seed: int = 0) -> zoo.Problem:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3)).to(torch.float64)
    return zoo.Problem(model, zoo._classification((6,), 3), zoo._ce)


def _problem(name: str) -> zoo.Problem:
    if name == "frozen_mlp":  # a frozen first weight (found outside the tests: no gradient to gather, it crashed)
        problem = _mlp()
        problem.model[0].weight.requires_grad_(False)
        return problem
    return _mlp() if name == "mlp" else getattr(zoo, name)(seed=0)


def _quantities() -> list:
    from cockpit_like.quantities import GradHist2d, MeanGSNR

    every = linear(1)
    return configuration("economy", every) + [MeanGSNR(every), GradHist2d(every)]


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for module in list(model.modules())[1:]:
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding, nn.TransformerEncoderLayer)):
            if not any(isinstance(parent, nn.TransformerEncoderLayer) for parent in _ancestors(model, module)):
                fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ancestors(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    for name, module in root.named_modules():
        if module is target:
            parts = name.split(".")
            return [root.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return []


def _train(name: str, rows: slice, sharded: bool, quantities=None, steps: int = STEPS) -> Cockpit:
    problem = _problem(name)
    model = _shard(problem.model) if sharded else problem.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = {"log_rank": None} if sharded else {}
    cockpit = Cockpit(model.parameters(), quantities or _quantities(), model=model, **extra)
    for step in range(steps):
        inputs, targets = problem.batch(GLOBAL_BATCH, 1000 + step)
        inputs, targets = inputs[rows], targets[rows]
        optimizer.zero_grad()
        outputs = model(inputs)
        losses = problem.sample_losses(outputs, targets)
        loss = losses.mean()
        info = {"batch_size": len(targets), "individual_losses": losses, "loss": loss, "optimizer": optimizer}
        with cockpit(step, info=info):
            loss.backward()
        optimizer.step()
    return cockpit


def _rows(rank: int) -> slice:
    local = GLOBAL_BATCH // WORLD
    return slice(rank * local, (rank + 1) * local)


def _job(rank: int) -> dict:
    result = {name: _train(name, _rows(rank), sharded=True).get_output() for name in PROBLEMS}
    from cockpit_like.quantities import HessMaxEV

    try:
        _train("mlp", _rows(rank), sharded=True, quantities=[HessMaxEV(linear(1))], steps=1)
        result["refused"] = "no error"
    except Exception as error:  # noqa: BLE001
        result["refused"] = f"{type(error).__name__}: {error}"
    result["failing_rank"] = _failing_rank(rank)
    return result


def _failing_rank(rank: int) -> str:
    """Rank 1 raises inside the cockpit context after its backward pass: rank 0 stops with a clear error."""
    problem = _mlp()
    model = _shard(problem.model)
    cockpit = Cockpit(model.parameters(), configuration("economy", linear(1)), model=model, distributed_timeout=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = problem.batch(GLOBAL_BATCH, 5)
    outputs = model(inputs[_rows(rank)])
    losses = problem.sample_losses(outputs, targets[_rows(rank)])
    info = {"batch_size": 4, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
    try:
        with cockpit(0, info=info):
            losses.mean().backward()
            if rank == 1:
                raise ValueError("boom on rank 1")
        return "no error"
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What both ranks of one 2-process job (:func:`_job`) returned."""
    return _spawn("tests.test_fsdp:_job", tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("name", PROBLEMS)
def test_fsdp_matches_one_process_on_the_concatenated_batch(ranks, name):
    expected = _train(name, slice(None), sharded=False).get_output()
    names = {key for values in expected.values() for key in values}
    assert {"Alpha", "GradNorm", "InnerTest", "NormTest", "OrthoTest", "GradHist1d", "GradHist2d", "MeanGSNR"} <= names
    for rank in range(WORLD):
        _assert_close(ranks[rank][name], expected, f"{name} rank {rank}")


def test_hessian_vector_products_are_refused_by_name(ranks):
    for rank in range(WORLD):
        message = ranks[rank]["refused"]
        assert message.startswith("NotImplementedError") and "HessMaxEV" in message and "fully_shard" in message


def test_a_rank_that_raises_ends_the_other_with_a_clear_error(ranks):
    assert ranks[1]["failing_rank"] == "ValueError: boom on rank 1"
    assert ranks[0]["failing_rank"].startswith("DistributedStepError") and "rank(s) [1]" in ranks[0]["failing_rank"]
