"""Outside trial 12's model finding: operations that mix the samples while keeping the shape, which the walk
of the graph took for operations that keep the rows.

A "set" model pooled its hidden rows *along the batch* (``F.avg_pool1d(h.T[None], 3)``, ``max_pool1d``,
``avg_pool2d`` with the batch in the last dimension) or renormed each feature over the batch
(``torch.renorm(h, 2, 1, 1.0)``): the step passed every check and NormTest, InnerTest and OrthoTest were stored
2-19% off a loop of ``torch.autograd.grad`` over the rows. Pooling is now a window over its input's trailing
dimensions and renorm a norm over every dimension but its own, for the walk (``backends/row_paths.py``).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.rerun import UncoveredParameterError
from cockpit_like.utils.configuration import configuration

DT = torch.float64
B, K = 6, 3

MIXERS = {
    "avg_pool1d": lambda h: F.avg_pool1d(h.T[None], 3, stride=1, padding=1)[0].T,
    "max_pool1d": lambda h: F.max_pool1d(h.T[None], 3, stride=1, padding=1)[0].T,
    "avg_pool2d": lambda h: F.avg_pool2d(h.T[None, None], (1, 3), stride=1, padding=(0, 1))[0, 0].T,
    "renorm": lambda h: torch.renorm(h, 2, 1, 1.0),
}
KEEPERS = {  # the same operations where they keep the rows apart
    "pool_within_rows": lambda h: F.max_pool1d(h[:, None], 3, stride=1, padding=1)[:, 0],
    "renorm_each_row": lambda h: torch.renorm(h, 2, 0, 1.0),
    "none": lambda h: 0 * h,
}


class SetModel(nn.Module):
    def __init__(self, mix):
        super().__init__()
        self.enc, self.head, self.mix = nn.Linear(4, 8), nn.Linear(8, K), mix

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        return self.head(h + self.mix(h))


def step(mix):
    torch.manual_seed(1)
    model = SetModel(mix).to(DT)
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(100)
    x, y = torch.randn(B, 4, generator=generator, dtype=DT), torch.randint(0, K, (B,), generator=generator)
    losses = F.cross_entropy(model(x), y, reduction="none")
    rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], params, retain_graph=True)])
                        for i in range(B)])
    mean = rows.mean(0)
    expected = math.sqrt(((rows - mean) ** 2).sum() / ((B - 1) * B * (mean @ mean)))
    with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    return cockpit.get_output()[0], expected


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_an_operation_that_mixes_the_samples_stores_no_per_sample_statistics(name):
    values, _ = step(MIXERS[name])
    assert "NormTest" not in values and "InnerTest" not in values and "OrthoTest" not in values
    # a norm over the rows is named by its rule; pooling by the enclosing call's re-run, which cannot reproduce
    # the rows (an error until 2026-11-29, a note since)
    assert any("a norm over the rows" in note or "did not reproduce the outputs" in note
               for note in values["checks"]["notes"]), values["checks"]["notes"]


@pytest.mark.parametrize("name", sorted(KEEPERS))
def test_the_same_operations_within_each_row_keep_the_numbers_exact(name):
    values, expected = step(KEEPERS[name])
    assert values["NormTest"] == pytest.approx(expected, rel=1e-10)


class TimeMajorByMistake(nn.Module):
    """``nn.TransformerEncoderLayer`` without ``batch_first`` fed ``[B, T, d]``: it attends across the batch."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.head = nn.Linear(8, K)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


class EmbeddedTimeMajorByMistake(TimeMajorByMistake):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)

    def forward(self, x):
        return super().forward(self.inp(x))


@pytest.mark.parametrize("model_class, width", [(TimeMajorByMistake, 8), (EmbeddedTimeMajorByMistake, 3)])
def test_an_attention_layer_fed_batch_first_without_batch_first_is_named(model_class, width):
    """The step is refused (right), and the error now names the likely cause (before: with a layer in front, a
    re-run error that blamed a key/value cache, random numbers or a statistic over the batch; without one, a
    raw RuntimeError from adding rows of 5 and 6 samples)."""
    torch.manual_seed(0)
    model = model_class().to(DT)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    x, y = torch.randn(B, 5, width, dtype=DT), torch.randint(0, K, (B,))
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(UncoveredParameterError, match="batch_first=False"):
        with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()


class Hyper(nn.Module):
    """A generator net makes the weights a target layer is called with through ``torch.func.functional_call``:
    the target's own registered parameters are never used (tracked all the same, as ``model.parameters()``)."""

    def __init__(self):
        super().__init__()
        self.gen = nn.Linear(2, 5 * 4 + 5)
        self.target = nn.Linear(4, 5)
        self.head = nn.Linear(5, K)

    def forward(self, x):
        made = self.gen(torch.ones(2, dtype=x.dtype))
        h = torch.func.functional_call(self.target, {"weight": made[:20].view(5, 4), "bias": made[20:]}, (x,))
        return self.head(torch.tanh(h))


def test_a_layer_called_with_other_tensors_gets_no_rows_for_its_own_parameters():
    """Before: the hooks computed rows for target.weight and target.bias from the call, every step failed the
    gradient check ("rows -0.035, gradient 0"), nothing per-sample was stored; now their rows are zero, as for
    any unused parameter, and the numbers are the brute force's."""
    torch.manual_seed(0)
    model = Hyper().to(DT)
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(B, 4, generator=generator, dtype=DT), torch.randint(0, K, (B,), generator=generator)
    losses = F.cross_entropy(model(x), y, reduction="none")
    used = [p for p in params if p is not model.target.weight and p is not model.target.bias]
    rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], used, retain_graph=True)])
                        for i in range(B)])
    mean = rows.mean(0)
    expected = math.sqrt(((rows - mean) ** 2).sum() / ((B - 1) * B * (mean @ mean)))
    with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    values = cockpit.get_output()[0]
    assert values["checks"]["valid"], values["checks"]
    assert values["NormTest"] == pytest.approx(expected, rel=1e-10)
