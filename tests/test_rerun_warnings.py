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


class _Recurrent(nn.Module):
    """An LSTM (vmap cannot run it: the re-run loops over the rows) and a layer without a rule that vmap runs."""

    def __init__(self):
        super().__init__()
        self.lstm, self.scale, self.head = nn.LSTM(4, 5, batch_first=True), _Scale(), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.scale(self.lstm(x)[0][:, -1]))


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return x * self.weight


def test_vmap_is_tried_once_per_module_where_it_fails(monkeypatch):
    """An LSTM's vmap failed at every tracked step before the loop over the rows took over: it is tried once,
    later steps loop at once (the same numbers), and a module whose vmap runs keeps it."""
    monkeypatch.setattr(rerun, "_NO_VMAP", rerun.weakref.WeakKeyDictionary())
    attempts, original = [], rerun._vmapped

    def counted(run, *args):
        attempts.append(run)
        return original(run, *args)

    monkeypatch.setattr(rerun, "_vmapped", counted)
    torch.manual_seed(0)
    model = _Recurrent().double()
    batches = [(torch.randn(6, 3, 4, dtype=torch.float64), torch.randint(0, 3, (6,))) for _ in range(3)]
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))], model=model)
    per_step = []
    for step, (x, y) in enumerate(batches):
        model.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": 6, "loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward()
        per_step.append(len(attempts))
        # brute force: per-sample gradients from a loop of autograd.grad, the mean of their squared norms
        rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
                for i in range(6)]
        grads = [torch.stack(g).mean(0) for g in zip(*rows)]
        expected_norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        stored = cockpit.get_output()[step]["GradNorm"]
        assert torch.allclose(torch.as_tensor(stored, dtype=torch.float64).norm(), expected_norm, rtol=1e-9)
        spread = sum(((torch.stack(g) - m) ** 2).sum() for g, m in zip(zip(*rows), grads))
        expected_test = torch.sqrt(spread / (5 * 6 * expected_norm ** 2)).item()  # QUANTITIES.md, B = 6
        assert abs(cockpit.get_output()[step]["NormTest"] - expected_test) < 1e-9 * max(1.0, abs(expected_test))
    assert rerun._NO_VMAP.get(model.lstm) and model.scale not in rerun._NO_VMAP
    lstm_tries = per_step[0] - 1  # step 0: the LSTM once (failed), the scale layer once
    assert lstm_tries == 1 and per_step[1] - per_step[0] == 1 and per_step[2] - per_step[1] == 1  # the scale only
