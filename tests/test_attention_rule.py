"""The per-layer rule of nn.MultiheadAttention's projections, against a loop of autograd.grad over rows."""

import pytest
import torch
from torch import nn

import cockpit_like.backends.hooks as hooks
from cockpit_like import Cockpit
from cockpit_like.backends.per_sample_stats import SumOfSquares
from cockpit_like.context import get_record
from cockpit_like.quantities.quantity import SingleStepQuantity


class _Probe(SingleStepQuantity):
    def per_sample_stats(self, step):
        return [SumOfSquares()]

    def _compute(self, step, params, loss):
        return [s.clone() for s in get_record(step).stat(SumOfSquares())]


class _Model(nn.Module):
    def __init__(self, batch_first, cross, padding, causal):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first).double()
        self.head = nn.Linear(8, 3).double()
        self.batch_first, self.cross, self.padding, self.causal = batch_first, cross, padding, causal

    def forward(self, x):
        memory = x.flip(1) * 0.5 if self.cross else x
        if not self.batch_first:
            x, memory = x.transpose(0, 1), memory.transpose(0, 1)
        kwargs = {"need_weights": False}
        if self.padding:
            kwargs["key_padding_mask"] = torch.zeros(x.shape[0 if self.batch_first else 1], 5, dtype=torch.bool)
            kwargs["key_padding_mask"][:, -1] = True
        if self.causal:
            kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
        key = x if not self.cross else memory
        out = self.attention(x, key, key, **kwargs)[0]
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out.mean(1))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("padding,causal", [(False, False), (True, False), (False, True)])
def test_attention_rule_matches_the_loop(monkeypatch, batch_first, cross, padding, causal):
    torch.manual_seed(0)
    model = _Model(batch_first, cross, padding, causal)
    inputs = torch.randn(4, 5, 8, dtype=torch.float64)
    labels = torch.randint(0, 3, (4,))
    params = list(model.parameters())
    rows = []
    for i in range(4):
        loss = nn.functional.cross_entropy(model(inputs[i : i + 1]), labels[i : i + 1])
        rows.append(torch.autograd.grad(loss, params))
    expected = [sum((r[k] / 4) ** 2 for r in rows) for k in range(len(params))]

    def no_generic_fallback(*args, **kwargs):
        raise AssertionError("the generic torch.func fallback ran: the attention rule did not apply")

    monkeypatch.setattr(hooks, "per_sample_grads", no_generic_fallback)
    probe = _Probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe], model=model)
    loss = nn.functional.cross_entropy(model(inputs), labels)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    for got, want in zip(probe.output[0], expected):
        torch.testing.assert_close(torch.as_tensor(got), want, rtol=1e-9, atol=1e-14)


def test_options_the_rule_does_not_reproduce_use_the_generic_fallback():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True).double()
    inputs = torch.randn(3, 4, 8, dtype=torch.float64)
    probe = _Probe(lambda step: True)
    cockpit = Cockpit(attention.parameters(), quantities=[probe], model=attention)
    out = attention(inputs, inputs, inputs, need_weights=False)[0]
    loss = out.square().mean()
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    params = list(attention.parameters())
    rows = []
    for i in range(3):
        row = attention(inputs[i : i + 1], inputs[i : i + 1], inputs[i : i + 1], need_weights=False)[0]
        rows.append(torch.autograd.grad(row.square().sum() / out.numel(), params))
    for k, got in enumerate(probe.output[0]):
        torch.testing.assert_close(torch.as_tensor(got), sum(r[k] ** 2 for r in rows), rtol=1e-9, atol=1e-14)


class _Cross(nn.Module):
    """Cross attention: 3 queries attend over 5 keys/values (memory of another width with ``kdim``/``vdim``)."""

    def __init__(self, batch_first, widths, padding, mask, weights):
        super().__init__()
        kdim, vdim = (6, 4) if widths else (None, None)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=vdim).double()
        self.memory = nn.Linear(8, 6 if widths else 8).double()
        self.values = nn.Linear(8, 4).double() if widths else None
        self.head = nn.Linear(8, 3).double()
        self.batch_first, self.padding, self.mask, self.weights = batch_first, padding, mask, weights

    def forward(self, x):
        query = x[:, :3] * 0.7
        key = self.memory(x)  # [B, 5, kdim]
        value = self.values(x) if self.values is not None else key
        rows = x.shape[0]
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        kwargs = {"need_weights": self.weights is not None}
        if self.weights is not None:
            kwargs["average_attn_weights"] = self.weights == "average"
        if self.padding:
            kwargs["key_padding_mask"] = torch.zeros(rows, 5, dtype=torch.bool)
            kwargs["key_padding_mask"][:, -1] = True
        if self.mask == "2d":
            kwargs["attn_mask"] = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(3, 5)
        elif self.mask == "3d":
            kwargs["attn_mask"] = torch.linspace(-1, 1, rows * 2 * 15, dtype=torch.float64).reshape(rows * 2, 3, 5)
        out, weights = self.attention(query, key, value, **kwargs)
        if not self.batch_first:
            out = out.transpose(0, 1)
        logits = self.head(out.mean(1))
        if weights is not None:  # the weights reach the loss too
            logits = logits + weights.flatten(1)[:, :3]
        return logits


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("widths", [False, True], ids=["embed", "kdim-vdim"])
@pytest.mark.parametrize(
    "padding,mask,weights",
    [(False, None, None), (True, None, None), (False, "2d", None), (True, "3d", None), (False, None, "average"),
     (True, "2d", "heads")],
)
def test_cross_attention_of_other_lengths_matches_the_loop(monkeypatch, batch_first, widths, padding, mask, weights):
    """Query length 3, key/value length 5 (crashed the rule before), masks, kdim/vdim, weights in the loss."""
    torch.manual_seed(0)
    model = _Cross(batch_first, widths, padding, mask, weights)
    inputs = torch.randn(4, 5, 8, dtype=torch.float64)
    labels = torch.randint(0, 3, (4,))
    params = list(model.parameters())
    logits = model(inputs)
    losses = nn.functional.cross_entropy(logits, labels, reduction="none")
    rows = [torch.autograd.grad(losses[i] / 4, params, retain_graph=True) for i in range(4)]
    expected = [sum(r[k] ** 2 for r in rows) for k in range(len(params))]

    def no_generic_fallback(*args, **kwargs):
        raise AssertionError("the generic torch.func fallback ran: the attention rule did not apply")

    monkeypatch.setattr(hooks, "per_sample_grads", no_generic_fallback)
    probe = _Probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe], model=model)
    loss = nn.functional.cross_entropy(model(inputs), labels)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    for got, want in zip(probe.output[0], expected):
        torch.testing.assert_close(torch.as_tensor(got), want, rtol=1e-9, atol=1e-14)


class _SelfWeights(nn.Module):
    """Self attention whose (per-head) weights reach the loss besides its output."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True).double()
        self.head = nn.Linear(8, 3).double()

    def forward(self, x):
        out, weights = self.attention(x, x, x, need_weights=True, average_attn_weights=False)
        return self.head(out.mean(1)) + weights.flatten(1)[:, :3]


def test_self_attention_weights_in_the_loss_match_the_loop(monkeypatch):
    """The weights' own gradient enters the rule (it was left out: wrong rows, which the step's self-check
    then refused)."""
    torch.manual_seed(0)
    model = _SelfWeights()
    inputs, labels = torch.randn(4, 5, 8, dtype=torch.float64), torch.randint(0, 3, (4,))
    params = list(model.parameters())
    losses = nn.functional.cross_entropy(model(inputs), labels, reduction="none")
    rows = [torch.autograd.grad(losses[i] / 4, params, retain_graph=True) for i in range(4)]
    probe = _Probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe], model=model)
    loss = nn.functional.cross_entropy(model(inputs), labels)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    assert cockpit.checks[0]["valid"], cockpit.checks[0]["failed"]
    for k, got in enumerate(probe.output[0]):
        torch.testing.assert_close(torch.as_tensor(got), sum(r[k] ** 2 for r in rows), rtol=1e-9, atol=1e-14)
