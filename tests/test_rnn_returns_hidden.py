"""An RNN language model that returns ``(logits, hidden)`` (PyTorch's word_language_model example, truncated
BPTT with the hidden state carried detached): ``h_n`` is ``[layers, B, H]``, its batch on dimension 1. The walk
of the rows ended there "along another dimension of the model's output" and every tracked step raised
UncoveredParameterError (an outside tester, sixth round); the per-sample quantities are exact."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import GradNorm, NormTest
from cockpit_like.utils.schedules import linear

V, B, T = 9, 6, 5


class _LM(nn.Module):
    def __init__(self, cell, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(V, 6)
        self.rnn = getattr(nn, cell)(6, 7, num_layers=2, batch_first=batch_first)
        self.head = nn.Linear(7, V)

    def forward(self, x, hidden=None):
        embedded = self.emb(x)  # [B, T, 6]
        out, hidden = self.rnn(embedded if self.batch_first else embedded.transpose(0, 1), hidden)
        return self.head(out if self.batch_first else out.transpose(0, 1)), hidden


def _row_losses(model, x, y, hidden):
    logits, hidden = model(x, hidden)
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").reshape(B, T).mean(1), hidden


def _detach(hidden):
    return tuple(h.detach() for h in hidden) if isinstance(hidden, tuple) else hidden.detach()


def _rows_of(hidden, i):
    take = lambda h: h[:, i:i + 1]  # noqa: E731 - the batch is dimension 1 of h_n / c_n
    return tuple(take(h) for h in hidden) if isinstance(hidden, tuple) else take(hidden)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_per_sample_quantities_of_an_rnn_returning_its_hidden_state(cell, batch_first):
    torch.manual_seed(0)
    model = _LM(cell, batch_first).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))], model=model)
    hidden, params = None, list(model.parameters())
    for step in range(3):
        x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
        # brute force first (the same parameters, the same carried hidden state), one row at a time
        rows = []
        for i in range(B):
            loss_i, _ = _row_losses_one(model, x[i:i + 1], y[i:i + 1], None if hidden is None else _rows_of(hidden, i))
            rows.append(torch.autograd.grad(loss_i, params))
        mean = [torch.stack(g).mean(0) for g in zip(*rows)]
        norm2 = sum((g ** 2).sum() for g in mean)
        spread = sum(((torch.stack(g) - m) ** 2).sum() for g, m in zip(zip(*rows), mean))
        expected_test = torch.sqrt(spread / ((B - 1) * B * norm2)).item()  # QUANTITIES.md

        optimizer.zero_grad()
        losses, new_hidden = _row_losses(model, x, y, hidden)
        with cockpit(step, info={"batch_size": B, "loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward()
        assert cockpit.checks[step]["valid"], cockpit.checks[step]
        stored = cockpit.get_output()[step]
        norms = torch.as_tensor(stored["GradNorm"], dtype=torch.float64)
        assert torch.allclose(norms, torch.stack([g.norm() for g in mean]), rtol=1e-9, atol=1e-14)
        assert stored["NormTest"] == pytest.approx(expected_test, rel=1e-9)
        optimizer.step()
        hidden = _detach(new_hidden)


def _row_losses_one(model, x, y, hidden):
    logits, hidden = model(x, hidden)
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1)), hidden
