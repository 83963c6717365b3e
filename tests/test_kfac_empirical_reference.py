"""KFACTrace(curvature="empirical") against empirical KFAC factors built by hand (float64).

Reference, from plain torch hooks and autograd only (no cockpit code):

- a weight whose per-sample gradient is a sum of outer products
  ``g_n / B = sum_t a_{n,t} b_{n,t}^T`` (``nn.Linear`` on 2-D or sequence
  inputs: ``a`` the output gradient of the mean loss, ``b`` the input;
  ``nn.MultiheadAttention``'s projections: ``a`` the gradient at the
  projected queries, keys and values / at the attention output, ``b`` the
  query input / the attention context) gets the factors
  ``[B sum_{n,t} a a^T, (1/(B T)) sum_{n,t} b b^T]`` (the "expand"
  convention over the ``T`` positions);
- every other parameter (biases, convolutions, embeddings, norms) its exact
  empirical-Fisher block ``(1/B) sum_n g_n g_n^T`` if it has at most 4096
  entries, else no block (``None``).

Compared: per-parameter trace, Frobenius norm and damped log-determinant, and
their totals, as KFACTrace reports them; also over two micro-batches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import KFACTrace
from cockpit_like.utils.schedules import linear

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")

DAMPING = 1e-3
BATCH = 6


class MLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 8, 3, padding=1)  # 144 weights: an exact block
        self.conv2 = nn.Conv2d(8, 72, 3)  # 5184 weights > 4096: no block
        self.head = nn.Linear(72, 3)

    def forward(self, x):
        x = self.conv2(torch.relu(self.conv1(x)))
        return self.head(x.mean((2, 3)))


class Transformer(nn.Module):
    """Embedding, LayerNorm, self-attention (nn.MultiheadAttention), an MLP on every token, a pooled head."""

    def __init__(self, vocab=11, width=8, heads=2, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        h = self.embed(tokens)
        n = self.norm(h)
        h = h + self.attention(n, n, n, need_weights=False)[0]
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h.mean(1))


def _problem(name: str, seed: int = 0):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    if name == "mlp":
        model, inputs = MLP(), torch.randn(BATCH, 6, generator=generator)
    elif name == "cnn":
        model, inputs = CNN(), torch.randn(BATCH, 2, 7, 7, generator=generator)
    else:
        model, inputs = Transformer(), torch.randint(0, 11, (BATCH, 5), generator=generator)
    model = model.double()
    if inputs.is_floating_point():
        inputs = inputs.double()
    targets = torch.randint(0, 3, (BATCH,), generator=generator)
    return model, inputs, targets


def _attention_by_hand(module: nn.MultiheadAttention, query: torch.Tensor, kept: dict):
    """Self-attention recomputed from the module's parameters, keeping the projections' inputs and outputs."""
    batch, length, width = query.shape
    heads = module.num_heads
    projected = F.linear(query, module.in_proj_weight, module.in_proj_bias)
    projected.retain_grad()
    q, k, v = (t.reshape(batch, length, heads, width // heads).transpose(1, 2) for t in projected.chunk(3, dim=-1))
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(width // heads), dim=-1)
    context = (weights @ v).transpose(1, 2).reshape(batch, length, width)
    out = F.linear(context, module.out_proj.weight, module.out_proj.bias)
    out.retain_grad()
    kept[id(module.in_proj_weight)] = (projected, query.detach())
    kept[id(module.out_proj.weight)] = (out, context.detach())
    return out


def _reference(model: nn.Module, inputs, targets) -> list:
    """Per parameter (model order): ``[F_a, F_b]``, ``[F]`` or ``None`` (see the module docstring)."""
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (output with .grad, input rows)

    def linear_hook(module, args, output):
        output.retain_grad()
        kept[id(module.weight)] = (output, args[0].detach())

    def attention_hook(module, args, output):
        query, key, value = args[:3]
        assert query is key is value
        return (_attention_by_hand(module, query, kept), None)

    handles = [m.register_forward_hook(linear_hook) for m in model.modules() if type(m) is nn.Linear]
    handles += [m.register_forward_hook(attention_hook) for m in model.modules() if type(m) is nn.MultiheadAttention]
    try:
        loss = F.cross_entropy(model(inputs), targets)
        model.zero_grad()
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    params = list(model.parameters())
    per_sample = [
        torch.autograd.grad(F.cross_entropy(model(inputs[n : n + 1]), targets[n : n + 1]), params)
        for n in range(len(inputs))
    ]
    reference = []
    for k, param in enumerate(params):
        if id(param) in kept:
            output, x = kept[id(param)]
            a = output.grad.reshape(-1, output.shape[-1])  # output gradients of the mean loss, [B T, out]
            b = x.reshape(-1, x.shape[-1])  # inputs [B T, in]
            reference.append([BATCH * a.T @ a, b.T @ b / b.shape[0]])
        elif param.numel() <= 4096:
            g = torch.stack([grads[k].reshape(-1) for grads in per_sample])
            reference.append([g.T @ g / BATCH])
        else:
            reference.append(None)
    return reference


def _summaries(reference: list) -> dict:
    def each(function):
        return [None if factors is None else function(factors) for factors in reference]

    traces = each(lambda fs: math.prod(float(f.trace()) for f in fs))
    norms = each(lambda fs: math.prod(float(torch.linalg.matrix_norm(f)) for f in fs))

    def logdet(fs):
        eigenvalues = torch.linalg.eigvalsh(fs[0])
        for f in fs[1:]:
            eigenvalues = torch.outer(eigenvalues, torch.linalg.eigvalsh(f)).reshape(-1)
        return float(torch.log(eigenvalues.clamp(min=0) + DAMPING).sum())

    logdets = each(logdet)
    return {
        "trace": traces,
        "trace_total": math.fsum(t for t in traces if t is not None),
        "frobenius": norms,
        "frobenius_total": math.sqrt(math.fsum(n * n for n in norms if n is not None)),
        "logdet": logdets,
        "logdet_total": math.fsum(d for d in logdets if d is not None),
    }


def _tracked(model, inputs, targets, micro_batches: int = 1, **quantity_args) -> dict:
    quantity = KFACTrace(linear(1), curvature="empirical", damping=DAMPING, **quantity_args)
    cockpit = Cockpit(model.parameters(), quantities=[quantity], model=model)
    model.zero_grad()
    size = len(inputs) // micro_batches
    for micro in range(micro_batches):
        part = slice(micro * size, (micro + 1) * size)
        loss = F.cross_entropy(model(inputs[part]), targets[part])
        info = {"batch_size": size, "loss": loss}
        if micro_batches > 1:
            info["micro_batches"] = micro_batches
        with cockpit(0, info=info):
            (loss / micro_batches).backward()
    return cockpit.get_output()[0]["KFACTrace"]


def _assert_matches(value: dict, expected: dict) -> None:
    assert set(value) == set(expected)
    for key, wanted in expected.items():
        got = value[key]
        if isinstance(wanted, list):
            assert len(got) == len(wanted), key
            for k, (x, y) in enumerate(zip(got, wanted)):
                if y is None:
                    assert x is None, (key, k)
                else:
                    assert x == pytest.approx(y, rel=1e-10, abs=1e-300), (key, k)
        else:
            assert got == pytest.approx(wanted, rel=1e-10), key


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_empirical_kfac_trace_equals_factors_built_by_hand(name):
    model, inputs, targets = _problem(name)
    expected = _summaries(_reference(model, inputs, targets))
    if name == "cnn":
        assert expected["trace"][2] is None  # conv2.weight has no block (5184 entries)
    _assert_matches(_tracked(model, inputs, targets), expected)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_empirical_kfac_trace_over_micro_batches_equals_one_pass_by_hand(name):
    model, inputs, targets = _problem(name)
    expected = _summaries(_reference(model, inputs, targets))
    _assert_matches(_tracked(model, inputs, targets, micro_batches=2), expected)
