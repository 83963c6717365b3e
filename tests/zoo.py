"""Models people train, for the any-model tests: each built small, in float64, offline.

Every entry of :data:`ZOO` is ``name -> factory(seed) -> Problem``; a problem
has the model, a batch maker and the per-sample loss (``[B]``) whose mean is
the mini-batch loss. A sample is one row of the batch (one sequence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

DTYPE = torch.float64


@dataclass
class Problem:
    model: nn.Module
    batch: Callable[[int, int], tuple]  # (batch_size, seed) -> (inputs, targets)
    sample_losses: Callable[[object, object], torch.Tensor]  # (outputs, targets) -> [B]
    forward: Callable[[nn.Module, object], object] = lambda model, inputs: model(inputs)


def _classification(features: tuple[int, ...], classes: int, integer_inputs: int | None = None):
    def batch(size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        if integer_inputs is not None:
            inputs = torch.randint(0, integer_inputs, (size, *features), generator=generator)
        else:
            inputs = torch.randn(size, *features, generator=generator, dtype=DTYPE)
        return inputs, torch.randint(0, classes, (size,), generator=generator)

    return batch


def _ce(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def gpt2(seed: int = 0) -> Problem:
    """Hugging Face GPT-2 (2 layers, width 16, vocabulary 40, tied input/output embedding), LM loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).to(DTYPE).train()
    assert model.lm_head.weight is model.transformer.wte.weight

    def batch(size, seed):
        tokens = torch.randint(0, 40, (size, 6), generator=torch.Generator().manual_seed(seed))
        return tokens, tokens

    def sample_losses(outputs, tokens):  # mean over the predicted tokens of each sequence
        logits = outputs.logits[:, :-1]
        per_token = nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        return per_token.mean(1)

    return Problem(model, batch, sample_losses)


class EncoderClassifier(nn.Module):
    """Token embedding + ``nn.TransformerEncoder`` (2 layers) + mean pooling + linear head."""

    def __init__(self, vocab=30, width=16, heads=2, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def encoder(seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    return Problem(EncoderClassifier().to(DTYPE), _classification((5,), 3, integer_inputs=30), _ce)


def layernorm_mlp(seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 12), nn.LayerNorm(12), nn.GELU(), nn.Linear(12, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4)
    ).to(DTYPE)
    return Problem(model, _classification((6,), 4), _ce)


class GRUClassifier(nn.Module):
    def __init__(self, vocab=20, width=8, hidden=10, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):
        _, last = self.rnn(self.embed(tokens))
        return self.head(last[-1])


def gru(seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    return Problem(GRUClassifier().to(DTYPE), _classification((7,), 3, integer_inputs=20), _ce)


class Block(nn.Module):
    def __init__(self, channels, norm):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = norm(channels)

    def forward(self, x):
        y = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(y)))


class ResNet(nn.Module):
    def __init__(self, norm, channels=4, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(2, channels, 3, padding=1)
        self.blocks = nn.Sequential(Block(channels, norm), Block(channels, norm))
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


def resnet_groupnorm(seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    model = ResNet(lambda c: nn.GroupNorm(2, c)).to(DTYPE)
    return Problem(model, _classification((2, 5, 5), 3), _ce)


def resnet_batchnorm_eval(seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    model = ResNet(nn.BatchNorm2d).to(DTYPE)
    with torch.no_grad():  # non-trivial running statistics
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    return Problem(model.eval(), _classification((2, 5, 5), 3), _ce)


class Scaled(nn.Module):
    """A custom layer with its own parameters: ``tanh(x * scale + shift) @ mix``."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.shift = nn.Parameter(torch.zeros(width))
        self.mix = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        return torch.tanh(x * self.scale + self.shift) @ self.mix


def custom(seed: int = 0) -> Problem:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), Scaled(6), nn.Linear(6, 3)).to(DTYPE)
    return Problem(model, _classification((5,), 3), _ce)


ZOO: dict[str, Callable[[int], Problem]] = {
    "gpt2": gpt2,
    "encoder": encoder,
    "layernorm_mlp": layernorm_mlp,
    "gru": gru,
    "resnet_groupnorm": resnet_groupnorm,
    "resnet_batchnorm_eval": resnet_batchnorm_eval,
    "custom": custom,
}


def per_sample_grads_loop(problem: Problem, inputs, targets, params) -> list[torch.Tensor]:
    """``g_i`` (not divided by B) by a loop of ``torch.autograd.grad`` over single rows: the brute force."""
    rows = []
    for i in range(len(targets)):
        outputs = problem.forward(problem.model, inputs[i : i + 1])
        loss = problem.sample_losses(outputs, targets[i : i + 1]).sum()
        rows.append(torch.autograd.grad(loss, params, allow_unused=True))
    return [torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows]) for k, p in enumerate(params)]
