"""Warnings of the ``torch.func`` re-run: torch.func's "performance drop ... batching rule for aten::op" is told
once per operation, in the cockpit's words (it came back at every tracked step for an LSTM fed a
``pack_padded_sequence``); any other warning raised inside a re-run is passed on."""

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from cockpit_like import Cockpit
from cockpit_like.backends import rerun
from cockpit_like.quantities import GradNorm, NormTest
from cockpit_like.utils.schedules import linear

TORCH_MESSAGE = "There is a performance drop because we have not yet implemented the batching rule"


class _Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(20, 6), nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, ids, lengths):
        packed = pack_padded_sequence(self.emb(ids), lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.lstm(packed)[1][0][-1])


class _Warns(nn.Module):
    """A layer without a rule (re-run) whose forward pass warns."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        warnings.warn("the user's own warning", UserWarning)
        return x * self.scale


def _steps(model, batch, steps=3):
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1)), GradNorm(linear(1))], model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            inputs, y = batch(step)
            model.zero_grad()
            losses = F.cross_entropy(model(*inputs), y, reduction="none")
            with cockpit(step, info={"batch_size": len(y), "loss": losses.mean(), "individual_losses": losses}):
                losses.mean().backward()
    assert all(cockpit.checks[step]["valid"] for step in range(steps))
    return [str(w.message) for w in caught]


def test_a_missing_batching_rule_is_told_once(monkeypatch):
    monkeypatch.setattr(rerun, "_TOLD", set())
    torch.manual_seed(0)

    def batch(step):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(1, 20, (5, 7), generator=generator)
        return (ids, torch.tensor([7, 3, 5, 2, 6])), torch.randint(0, 3, (5,), generator=generator)

    messages = _steps(_Packed(), batch)
    assert not [m for m in messages if TORCH_MESSAGE in m]
    told = [m for m in messages if "no batching rule in torch.func" in m]
    assert len(told) == 1 and "aten::_pack_padded_sequence" in told[0] and "[cockpit_like]" in told[0]


def test_other_warnings_inside_a_rerun_are_passed_on():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), _Warns())

    def batch(step):
        generator = torch.Generator().manual_seed(step)
        return (torch.randn(5, 4, generator=generator),), torch.randint(0, 3, (5,), generator=generator)

    messages = _steps(model, batch, steps=2)
    # per step: the forward pass, and the re-run (vmap runs the forward once for all rows)
    assert messages.count("the user's own warning") >= 4
