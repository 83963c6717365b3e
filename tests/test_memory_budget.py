"""Per-sample statistics under a memory budget: blocks of rows give the same numbers (float64).

``Cockpit(..., memory_budget=...)`` bounds the per-sample gradients
materialised at once: a layer whose ``[B, *param.shape]`` is larger is
reduced a block of rows at a time (factors, sequence factors, convolutions,
embeddings, a tied weight's uses summed). A budget of a few bytes forces one
row per block on every layer; the outputs must equal the default budget's
(where every test layer fits in one block) and, through the existing
brute-force tests of the default path, the autograd references.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends import per_sample
from cockpit_like.quantities import Alpha, GradHist1d, GradHist2d, GradNorm, InnerTest, MeanGSNR, NormTest, OrthoTest
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.helpers import accumulated_steps, assert_nested_close, zoo_or_helper_problem

STEPS, ROWS = 3, 6


def _quantities():
    return configuration("economy") + [GradHist2d(linear(1)), MeanGSNR(linear(1))]


_problem = zoo_or_helper_problem


def _run(name: str, quantities, optimizer_class=torch.optim.SGD, micro_batches: int = 1, **cockpit_args):
    problem = _problem(name)
    model = problem[0]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model, **cockpit_args)
    optimizer = optimizer_class(model.parameters(), lr=0.05, momentum=0.5)
    output = accumulated_steps(cockpit, problem, optimizer, STEPS, ROWS, micro_batches)
    return {step: {k: v for k, v in values.items() if k != "Time"} for step, values in output.items()}


@pytest.fixture
def blocks(monkeypatch):
    """Counts the blocks of rows the reducers materialised."""
    made = []
    original = per_sample.PerSampleReducer.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(per_sample.PerSampleReducer, "__init__", init)
    return lambda: sum(reducer.blocks for reducer in made)


# mlp, cnn: BackPACK (factors, unfolded convolutions); the others: module hooks (sequence factors,
# convolutions and group norms, embeddings, GPT-2's tied input/output embedding, a custom layer and a GRU,
# both by the torch.func fallback: vmap, and the loop over rows for the GRU)
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "encoder", "resnet_groupnorm", "custom", "gru"])
def test_a_tiny_budget_gives_the_same_numbers(name, blocks):
    reference = _run(name, _quantities())
    assert blocks() == 0  # every layer of these small models fits the default budget
    tiny = _run(name, _quantities(), memory_budget=1)
    if name == "mlp":  # every statistic reads a linear layer's factors: nothing per-sample is materialised
        assert blocks() == 0
    else:
        assert blocks() >= STEPS * ROWS  # at least one block per row of some layer at every step
    names = {key for values in reference.values() for key in values}
    assert {"Alpha", "NormTest", "InnerTest", "OrthoTest", "GradHist1d", "GradHist2d", "MeanGSNR"} <= names
    assert_nested_close(tiny, reference, f"{name} budget 1 byte", rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["cnn", "gpt2", "custom"])
def test_a_budget_of_a_few_rows_gives_the_same_numbers(name, blocks):
    """Blocks of several rows (the last one shorter): 4 rows of the largest layer fit."""
    model = _problem(name)[0]
    largest = max(p.numel() for p in model.parameters()) * 8  # float64
    reference = _run(name, _quantities())
    blocked = _run(name, _quantities(), memory_budget=4 * largest)
    assert blocks() > 0
    assert_nested_close(blocked, reference, f"{name} budget 4 rows", rtol=1e-10, atol=1e-13)


class CoupledSGD(torch.optim.SGD):
    """Not one of the known element-wise optimizers: Alpha keeps the layers (retained mode)."""


@pytest.mark.parametrize("name", ["cnn", "gpt2"])
def test_alpha_keeps_layers_in_blocks_with_any_optimizer(name, blocks):
    """An optimizer the cockpit cannot step layer by layer: Alpha keeps every layer until the step ends (as blocks of rows)."""
    kinds = [Alpha, GradNorm, NormTest, InnerTest, OrthoTest, GradHist1d]
    reference = _run(name, [kind(linear(1)) for kind in kinds], optimizer_class=CoupledSGD)
    tiny = _run(name, [kind(linear(1)) for kind in kinds], optimizer_class=CoupledSGD, memory_budget=1)
    assert blocks() > 0
    assert_nested_close(tiny, reference, f"{name} LBFGS budget 1 byte", rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["cnn", "gpt2"])
def test_a_tiny_budget_with_micro_batches_equals_one_pass(name):
    reference = _run(name, _quantities())
    accumulated = _run(name, _quantities(), micro_batches=2, memory_budget=1)
    assert_nested_close(accumulated, reference, f"{name} 2 micro-batches, budget 1 byte", rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize(
    "budget, expected", [("256MB", 256 << 20), ("1.5 GB", int(1.5 * (1 << 30))), (4096, 4096), ("64 MiB", 64 << 20)]
)
def test_memory_budget_accepts_sizes(budget, expected):
    model = nn.Linear(2, 2)
    assert Cockpit(model.parameters(), quantities=[GradNorm(linear(1))], memory_budget=budget).memory_budget == expected


@pytest.mark.parametrize("budget", ["lots", -5, 0, "0MB", True, [1]])
def test_memory_budget_rejects_nonsense(budget):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="memory_budget"):
        Cockpit(model.parameters(), quantities=[GradNorm(linear(1))], memory_budget=budget)


@pytest.mark.parametrize("optimizer_class, alpha_budget", [(torch.optim.SGD, 0), (torch.optim.SGD, None), (CoupledSGD, 0)])
def test_a_reused_buffer_for_large_layers_gives_the_same_numbers(optimizer_class, alpha_budget, monkeypatch):
    """Every sequence layer's ``grad_batch`` made in the reducer's reused buffer where all statistics only
    read it (``BORROW_BYTES`` = 0): the numbers are unchanged. Alpha's predicted mode reads a layer over
    its own budget at once (budget 0: lent) but holds smaller ones (default budget on these small layers:
    never lent), and its retained mode (an optimizer that is not element-wise) keeps every layer."""
    from cockpit_like.backends.per_sample_stats import PredictedSlopes

    if alpha_budget is not None:
        monkeypatch.setattr(PredictedSlopes.__init__, "__defaults__", (alpha_budget, False))
    reference = _run("gpt2", _quantities(), optimizer_class=optimizer_class)
    lent = []
    borrowed = per_sample.PerSampleReducer._borrowed

    def spy(self, numel, like):
        buffer = borrowed(self, numel, like)
        lent.append(buffer is not None)
        return buffer

    monkeypatch.setattr(per_sample, "BORROW_BYTES", 0)
    monkeypatch.setattr(per_sample.PerSampleReducer, "_borrowed", spy)
    reused = _run("gpt2", _quantities(), optimizer_class=optimizer_class)
    assert lent
    assert any(lent) == (optimizer_class is torch.optim.SGD and alpha_budget == 0)
    assert_nested_close(reused, reference, "reused buffer", rtol=1e-10, atol=1e-13)


def test_the_torch_func_fallback_stays_under_the_budget():
    """A layer without a per-layer rule (the zoo's custom ``Scaled``, 256 x 256 mixing matrix: 0.5 MB per
    row, 16 MB for a batch of 32 in float64) is re-run a block of rows at a time under the budget: the
    numbers of the default, and a peak of live tensors lower by most of the whole ``[B, *p.shape]``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.overhead import profiled_live_peak
    from tests.zoo import Scaled

    def run(budget):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 256), Scaled(256), nn.Linear(256, 3)).to(torch.float64)
        quantities = [GradNorm(linear(1)), NormTest(linear(1)), GradHist1d(linear(1))]
        cockpit = Cockpit(model.parameters(), quantities=quantities, model=model, memory_budget=budget)
        generator = torch.Generator().manual_seed(1)
        inputs = torch.randn(32, 16, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, 3, (32,), generator=generator)

        def step():
            model.zero_grad()
            losses = nn.functional.cross_entropy(model(inputs), labels, reduction="none")
            with cockpit(0, info={"batch_size": 32, "individual_losses": losses, "loss": losses.mean()}):
                losses.mean().backward()

        peak = profiled_live_peak(step)
        return {k: v for k, v in cockpit.get_output()[0].items() if k != "Time"}, peak

    (whole, whole_peak), (blocked, blocked_peak) = run(None), run(1 << 20)
    assert_nested_close(blocked, whole, "fallback in blocks of rows", rtol=1e-10, atol=1e-13)
    rows = 32 * 256 * 256 * 8
    assert whole_peak - blocked_peak > 0.5 * rows, (whole_peak, blocked_peak)
