"""nn.EmbeddingBag's per-sample gradients (a sample is a bag), against a loop of autograd.grad over rows (float64):
2-D ids, 1-D ids with offsets (the re-run split the offsets as if batched: torch's 'offsets[0] has to be 0'),
per_sample_weights, padding_idx, include_last_offset, an empty bag; 'max' mode with offsets refused clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cockpit_like.backends.hooks as hooks
from cockpit_like import Cockpit
from cockpit_like.backends.hooks import UncoveredParameterError
from tests.helpers import row_stats_probe

ROWS = 6



class Bags(nn.Module):
    def __init__(self, mode="sum", padding_idx=None, include_last_offset=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset)
        self.head = nn.Linear(4, 3)

    def forward(self, ids, offsets=None, weights=None):
        return self.head(torch.tanh(self.bag(ids, offsets, per_sample_weights=weights)))


def _inputs(form: str, weighted: bool, include_last: bool):
    generator = torch.Generator().manual_seed(3)
    if form == "2d":
        ids = torch.randint(0, 10, (ROWS, 3), generator=generator)
        ids[1, 0] = 0  # the padding index where one is set
        offsets = None
    else:
        ids = torch.randint(0, 10, (14,), generator=generator)
        ids[3] = 0
        offsets = torch.tensor([0, 2, 5, 5, 9, 11])  # the fourth bag is empty
        if include_last:
            offsets = torch.cat((offsets, torch.tensor([14])))  # the end of the last bag
    weights = torch.rand(ids.shape, generator=generator, dtype=torch.float64) if weighted else None
    return ids, offsets, weights, torch.randint(0, 3, (ROWS,), generator=generator)


CASES = [
    # form, mode, weighted, padding_idx, include_last_offset
    ("2d", "sum", False, None, False),
    ("2d", "mean", False, 0, False),
    ("2d", "sum", True, 0, False),
    ("offsets", "sum", False, None, False),
    ("offsets", "mean", False, None, False),
    ("offsets", "mean", False, 0, False),
    ("offsets", "sum", True, 0, False),
    ("offsets", "sum", True, None, True),
    ("offsets", "mean", False, None, True),
]


@pytest.mark.parametrize("form,mode,weighted,padding_idx,include_last", CASES)
def test_embedding_bag_rule_matches_the_loop(monkeypatch, form, mode, weighted, padding_idx, include_last):
    torch.manual_seed(0)
    model = Bags(mode, padding_idx, include_last).double()
    ids, offsets, weights, labels = _inputs(form, weighted, include_last)
    params = list(model.parameters())
    losses = F.cross_entropy(model(ids, offsets, weights), labels, reduction="none")
    rows = [torch.autograd.grad(losses[i] / ROWS, params, retain_graph=True) for i in range(ROWS)]

    def no_generic_fallback(*args, **kwargs):
        raise AssertionError("the generic torch.func fallback ran: the EmbeddingBag rule did not apply")

    monkeypatch.setattr(hooks, "per_sample_grads", no_generic_fallback)
    probe = row_stats_probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe], model=model)
    loss = F.cross_entropy(model(ids, offsets, weights), labels)
    with cockpit(0, info={"loss": loss, "batch_size": ROWS}):
        loss.backward()
    assert cockpit.checks[0]["valid"], cockpit.checks[0]["failed"]
    squares, norms = probe.output[0]
    for k, got in enumerate(squares):
        torch.testing.assert_close(torch.as_tensor(got), sum(r[k] ** 2 for r in rows), rtol=1e-9, atol=1e-15)
    expected = torch.stack([sum(g.square().sum() for g in r) for r in rows])
    torch.testing.assert_close(torch.as_tensor(norms), expected, rtol=1e-9, atol=1e-15)


def test_max_mode_with_2d_ids_is_re_run():
    torch.manual_seed(0)
    model = Bags("max").double()
    ids, _, _, labels = _inputs("2d", False, False)
    params = list(model.parameters())
    losses = F.cross_entropy(model(ids), labels, reduction="none")
    rows = [torch.autograd.grad(losses[i] / ROWS, params, retain_graph=True) for i in range(ROWS)]
    probe = row_stats_probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe], model=model)
    loss = F.cross_entropy(model(ids), labels)
    with cockpit(0, info={"loss": loss, "batch_size": ROWS}):
        loss.backward()
    for k, got in enumerate(probe.output[0][0]):
        torch.testing.assert_close(torch.as_tensor(got), sum(r[k] ** 2 for r in rows), rtol=1e-9, atol=1e-15)


def test_max_mode_with_offsets_is_refused_naming_the_layer_and_the_fix():
    torch.manual_seed(0)
    model = Bags("max").double()
    ids, offsets, _, labels = _inputs("offsets", False, False)
    offsets = torch.tensor([0, 2, 5, 6, 9, 11])
    cockpit = Cockpit(model.parameters(), quantities=[row_stats_probe(lambda step: True)], model=model)
    loss = F.cross_entropy(model(ids, offsets), labels)
    with pytest.raises(UncoveredParameterError, match=r"EmbeddingBag layer .*bag.*mode='max'.*1-D ids and offsets.*2-D"):
        with cockpit(0, info={"loss": loss, "batch_size": ROWS}):
            loss.backward()
