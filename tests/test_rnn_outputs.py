"""A recurrent model that returns ``(logits, hidden)`` (PyTorch's word_language_model, truncated BPTT).

An LSTM's or GRU's ``h_n`` (and ``c_n``) is ``[layers, B, H]``: batch along
dimension 1, with ``batch_first`` too. The walk of
:mod:`cockpit_like.backends.row_paths` took every model output's batch
dimension to be 0, so the RNN's rows "ended along another dimension of the
model's output" and every tracked step raised ``UncoveredParameterError``
out of the ``with`` block, though the loss reads only the logits (sixth
round of outside trials). A model output's batch dimension is now the first
whose size is a multiple of ``B``, and the rows of an output the loss does not
read may lie anywhere.

References never come from cockpit_like: per-sample gradients by a loop of
``torch.autograd.grad`` over the rows, in float64, with the hidden state
carried (detached) from step to step as in the training loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.rerun import UncoveredParameterError
from cockpit_like.quantities import NormTest

from .helpers import gram_probe

DTYPE = torch.float64
VOCAB, WIDTH, HIDDEN, TOKENS = 7, 4, 5, 4


class LanguageModel(nn.Module):
    """Ids ``[B, T]`` -> ``(logits [B, T, V], hidden)``; without ``batch_first`` the RNN runs on ``[T, B, E]``."""

    def __init__(self, cell, batch_first: bool, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, WIDTH).to(DTYPE)
        self.rnn = cell(WIDTH, HIDDEN, num_layers=layers, batch_first=batch_first).to(DTYPE)
        self.head = nn.Linear(HIDDEN, VOCAB).to(DTYPE)

    def forward(self, ids, hidden=None):
        x = self.embed(ids)
        out, hidden = self.rnn(x if self.batch_first else x.transpose(0, 1), hidden)
        return self.head(out if self.batch_first else out.transpose(0, 1)), hidden


def _h_n(hidden):
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _losses(model, ids, targets, hidden, penalty):
    logits, hidden = model(ids, hidden)
    rows = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none").reshape(ids.shape).mean(1)
    h_n = _h_n(hidden)
    if penalty == "per_row":
        rows = rows + 0.1 * h_n.pow(2).sum((0, 2))
    elif penalty == "coupled":  # each row's penalty reads the batch mean of h_n
        rows = rows + 0.1 * (h_n - h_n.mean(1, keepdim=True)).pow(2).sum((0, 2))
    return rows, hidden


def _detached(hidden):
    return tuple(h.detach() for h in hidden) if isinstance(hidden, tuple) else hidden.detach()


def _train(model, rows: int, steps: int, penalty=None, quantities=None):
    """Truncated BPTT with the hidden state carried across steps; per step, ``G[i]`` (row ``i``'s gradient)."""
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=quantities, model=model)
    optimizer = torch.optim.SGD(params, lr=0.5)
    generator = torch.Generator().manual_seed(1)
    hidden, references = None, []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
        targets = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
        losses, _ = _losses(model, ids, targets, hidden, penalty)
        G = []
        for i in range(rows):
            grads = torch.autograd.grad(losses[i], params, retain_graph=True)
            G.append(torch.cat([g.reshape(-1) for g in grads]))
        references.append(torch.stack(G))
        losses, new_hidden = _losses(model, ids, targets, hidden, penalty)
        loss = losses.mean()
        with cockpit(step, info={"batch_size": rows, "individual_losses": losses, "loss": loss, "optimizer": optimizer}):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hidden = _detached(new_hidden)
    return cockpit, references


def _assert_rows(probe, references):
    for step, G in enumerate(references):
        rows = G.shape[0]
        got = probe.output[step]
        torch.testing.assert_close(torch.as_tensor(got["diag"]), (G**2).sum(1) / rows**2, rtol=1e-9, atol=1e-15)
        torch.testing.assert_close(torch.as_tensor(got["row_sums"]), G @ G.mean(0) / rows, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
@pytest.mark.parametrize("penalty", [None, "per_row"], ids=["logits_only", "penalty_on_h_n"])
def test_a_model_returning_its_hidden_state_matches_the_loop(cell, batch_first, penalty):
    """``h_n`` ``[2, 3, H]``: the loss reads only the logits, or adds a per-row penalty on ``h_n``."""
    model = LanguageModel(cell, batch_first)
    probe, norm = gram_probe(lambda step: True), NormTest(lambda step: True)
    cockpit, references = _train(model, rows=3, steps=3, penalty=penalty, quantities=[probe, norm])
    _assert_rows(probe, references)
    for step, G in enumerate(references):
        assert cockpit.checks[step].get("valid", True), cockpit.checks[step]
        gbar = G.mean(0)
        expected = (((G - gbar) ** 2).sum() / (2 * 3 * (gbar @ gbar))).sqrt()
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(float(expected), rel=1e-9)


def test_the_testers_repro_with_the_economy_preset():
    """The outside tester's loop: one-layer LSTM, ``h_n`` ``[1, 6, 7]``, economy preset: no error, NormTest exact."""
    from cockpit_like.utils.configuration import configuration

    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn, self.head = nn.Embedding(9, 6), nn.LSTM(6, 7, batch_first=True), nn.Linear(7, 9)

        def forward(self, x, h=None):
            o, h = self.rnn(self.emb(x), h)
            return self.head(o), h

    model = LM().to(DTYPE)
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=configuration("economy"), model=model)
    x, y = torch.randint(0, 9, (6, 5)), torch.randint(0, 9, (6, 5))

    def losses():
        return F.cross_entropy(model(x)[0].reshape(-1, 9), y.reshape(-1), reduction="none").reshape(6, 5).mean(1)

    rows = losses()
    G = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(rows[i], params, retain_graph=True)]) for i in range(6)])
    rows = losses()
    with cockpit(0, info={"batch_size": 6, "individual_losses": rows, "loss": rows.mean()}):
        rows.mean().backward()
    gbar = G.mean(0)
    expected = (((G - gbar) ** 2).sum() / (5 * 6 * (gbar @ gbar))).sqrt()
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(float(expected), rel=1e-9)


def test_a_penalty_that_couples_the_rows_of_h_n_stores_no_numbers():
    """The loss reads ``h_n`` minus its batch mean: the row check at the loss now sees ``h_n`` (its rows along
    dimension 1) and leaves the per-sample quantities out with a note naming the output."""
    model = LanguageModel(nn.GRU, batch_first=True)
    probe = gram_probe(lambda step: True)
    cockpit, _ = _train(model, rows=3, steps=1, penalty="coupled", quantities=[probe])
    assert 0 not in probe.output
    notes = " ".join(cockpit.checks[0]["notes"])
    assert "not separable by rows" in notes and "output 1" in notes, notes


def test_hidden_state_with_as_many_layers_as_rows_not_read_by_the_loss():
    """``h_n`` ``[2, 2, H]`` with ``B = 2``: its first dimension could hold the rows, but the loss does not read
    it, so where its rows lie does not matter."""
    model = LanguageModel(nn.LSTM, batch_first=True, layers=2)
    probe = gram_probe(lambda step: True)
    _, references = _train(model, rows=2, steps=3, quantities=[probe])
    _assert_rows(probe, references)


def test_hidden_state_with_as_many_layers_as_rows_read_by_the_loss_is_refused_by_name():
    """The loss reads ``h_n`` ``[2, 2, H]`` (``B = 2``): which dimension it takes for the rows cannot be told from
    the shape, so the step says which output and what to do (before: a re-run of the whole model that failed
    with a shape error about graphs)."""
    model = LanguageModel(nn.GRU, batch_first=True, layers=2)
    with pytest.raises(UncoveredParameterError) as raised:
        _train(model, rows=2, steps=1, penalty="per_row", quantities=[gram_probe(lambda step: True)])
    message = str(raised.value)
    assert "GRU layer 'rnn'" in message and "shape [2, 2, 5]" in message and "which the loss reads" in message
    assert "h_n.transpose(0, 1)" in message
