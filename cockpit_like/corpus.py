"""A labelled corpus of small training runs for measuring the diagnosis rules.

Each run is a :class:`RunSpec`: an architecture, an optimizer with its
learning-rate schedule, a seed and, for a problem run, the problem's label
(the cause a person would name) and the step where it starts. :func:`train`
trains it on built-in data (scikit-learn's digits, or synthetic sequences),
deterministically, on the CPU, under a cockpit that tracks the
quantities the rules read (all but ``HessMaxEV`` and ``NormTest``, which the settings with
``options["track"]`` add), and returns the stored output and metadata;
:mod:`cockpit_like.diagnosis.scoring` replays the rules on them and scores
the findings against the labels.

Architectures: ``mlp`` (ReLU, tanh or sigmoid), ``cnn``, ``resnet`` (with
GroupNorm), ``transformer`` (a classifier over the 8 rows of a digit), ``gpt``
(a causal language model on synthetic sequences) and ``rnn`` (a tanh RNN on
synthetic sequences). The corpus (:func:`corpus`) holds every setting with
four seeds; :func:`split` puts seeds 0 and 1 in the tuning half and 2 and 3
in the evaluation half.

Example::

    from cockpit_like.corpus import corpus, train
    spec = corpus(seeds=(0,))[0]
    run = train(spec)          # {"spec", "steps", "metadata", "onset", "seconds"}
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

__all__ = ["RunSpec", "PROBLEMS", "SETTINGS", "corpus", "split", "train", "TUNING_SEEDS", "EVALUATION_SEEDS"]

#: problem labels (the cause a person would name), with what the corpus does to make them
PROBLEMS = {
    "learning-rate-too-large": "a learning rate far too large (blow-up at the start or later in the run) or "
    "somewhat too large (loss spikes)",
    "learning-rate-too-small": "a learning rate 100-1000x too small",
    "poor-initialization": "weights initialized far too small (vanishing signals) or too large (saturation)",
    "dead-units": "ReLU units off for every sample from the start (hidden biases -5)",
    "frozen-layer": "a layer left out of the optimizer",
    "labels-do-not-match": "labels shuffled against the inputs (a data bug)",
    "unnormalized-inputs": "inputs in 0..255 instead of 0..1",
    "overfitting": "a tiny training set with noisy labels and a validation split",
    "nonfinite-operation": "an operation that makes NaN (a division by a zero norm) at one step",
    "exploding-gradient": "a tanh RNN whose recurrent weights amplify the gradient through time",
    "batch-too-small": "a batch of one sample (MLP, CNN, ResNet, transformer classifier)",
}

TUNING_SEEDS = (0, 1)
EVALUATION_SEEDS = (2, 3)


@dataclass(frozen=True)
class RunSpec:
    """One labelled run.

    Attributes:
        setting: the setting's name (shared by its seeds).
        arch: ``mlp``, ``cnn``, ``resnet``, ``transformer``, ``gpt`` or ``rnn``.
        optimizer: ``sgd``, ``momentum`` (SGD, 0.9), ``adam`` or ``adamw``.
        lr: the base learning rate.
        seed: seeds the model, the data order and the data made for the run.
        problem: a key of :data:`PROBLEMS`, or None for a healthy run.
        onset: the step where the problem starts (0: from the start).
        steps: optimizer steps (all tracked).
        batch: batch size.
        schedule: ``constant``, ``warmup`` (linear over the first 10 steps),
            ``decay`` (cosine to 10%) or ``warmup-decay``.
        options: what makes the problem, e.g. ``{"init_std": 0.01}``.
    """

    setting: str
    arch: str
    optimizer: str
    lr: float
    seed: int
    problem: str | None = None
    onset: int = 0
    steps: int = 60
    batch: int = 32
    schedule: str = "constant"
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.setting}/seed{self.seed}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _setting(setting: str, arch: str, optimizer: str, lr: float, problem: str | None = None, **kwargs) -> dict:
    return {"setting": setting, "arch": arch, "optimizer": optimizer, "lr": lr, "problem": problem, **kwargs}


#: what ``options["track"]`` adds for the settings that measure ``sharpness-above-stability`` and
#: ``noise-dominated`` (their inputs cost Hessian-vector products and per-sample gradients)
_CURVATURE = ("HessMaxEV", "NormTest")

#: every setting of the corpus (each run with every seed)
SETTINGS: list[dict[str, Any]] = [
    # ---- healthy: the usual early plateau, warm-up, decay, noisy small batches
    _setting("healthy-mlp-sgd", "mlp", "sgd", 0.1),
    _setting("healthy-mlp-momentum-decay", "mlp", "momentum", 0.02, schedule="decay"),
    _setting("healthy-mlp-adam", "mlp", "adam", 1e-3, options={"activation": "tanh"}),
    _setting("healthy-mlp-small-batch", "mlp", "sgd", 0.05, batch=8),
    _setting("healthy-cnn-momentum", "cnn", "momentum", 0.02),
    _setting("healthy-resnet-adamw-warmup-decay", "resnet", "adamw", 3e-3, schedule="warmup-decay"),
    _setting("healthy-transformer-adamw-warmup", "transformer", "adamw", 2e-3, schedule="warmup"),
    _setting("healthy-gpt-adam-warmup-decay", "gpt", "adam", 3e-3, schedule="warmup-decay"),
    _setting("healthy-rnn-adam", "rnn", "adam", 3e-3),
    # ---- healthy, slow and noisy: batches of 8-16, small learning rates (added after the first
    # evaluation showed a false alarm on such a run; the tuning half had too few of them)
    _setting("healthy-mlp-sgd-slow-b16", "mlp", "sgd", 0.03, batch=16),
    _setting("healthy-mlp-tanh-sgd-b8", "mlp", "sgd", 0.03, batch=8, options={"activation": "tanh"}),
    _setting("healthy-mlp-momentum-slow-b8", "mlp", "momentum", 0.003, batch=8),
    _setting("healthy-mlp-adam-b8", "mlp", "adam", 3e-4, batch=8),
    _setting("healthy-cnn-momentum-b8", "cnn", "momentum", 0.01, batch=8),
    _setting("healthy-resnet-momentum-b8", "resnet", "momentum", 0.01, batch=8),
    _setting("healthy-transformer-adam-b8", "transformer", "adam", 1e-3, batch=8),
    _setting("healthy-gpt-adamw-warmup-b8", "gpt", "adamw", 1e-3, batch=8, schedule="warmup"),
    # ---- healthy, fast and noisy: batches of 8 at learning rates that make quick progress (added in
    # the third round: a fast ResNet with batches of 8 alarmed `noisy-loss` in the evaluation half)
    _setting("healthy-resnet-adamw-b8", "resnet", "adamw", 3e-3, batch=8),
    _setting("healthy-cnn-sgd-fast-b8", "cnn", "sgd", 0.1, batch=8),
    _setting("healthy-mlp-momentum-fast-b8", "mlp", "momentum", 0.02, batch=8),
    _setting("healthy-transformer-adamw-fast-b8", "transformer", "adamw", 3e-3, batch=8),
    _setting("healthy-resnet-momentum-fast-b8", "resnet", "momentum", 0.03, batch=8),
    # ---- healthy, with the curvature and gradient-noise inputs (HessMaxEV, NormTest) tracked too
    _setting("healthy-mlp-sgd-curvature", "mlp", "sgd", 0.1, options={"track": _CURVATURE}),
    _setting("healthy-mlp-small-batch-curvature", "mlp", "sgd", 0.05, batch=8, options={"track": _CURVATURE}),
    _setting("healthy-mlp-adam-curvature", "mlp", "adam", 1e-3, options={"activation": "tanh", "track": _CURVATURE}),
    _setting("healthy-cnn-momentum-curvature", "cnn", "momentum", 0.02, options={"track": _CURVATURE}),
    _setting("healthy-resnet-sgd-curvature", "resnet", "sgd", 0.05, options={"track": _CURVATURE}),
    # ---- learning rate far too large, at the start
    _setting("lr-huge-mlp-sgd", "mlp", "sgd", 40.0, "learning-rate-too-large"),
    _setting("lr-huge-mlp-adam", "mlp", "adam", 0.5, "learning-rate-too-large"),
    _setting("lr-huge-cnn-sgd", "cnn", "sgd", 5.0, "learning-rate-too-large"),
    _setting("lr-huge-transformer-adamw", "transformer", "adamw", 0.3, "learning-rate-too-large"),
    # ---- ... and later in the run (a schedule bug multiplies it at step 30)
    _setting("lr-jump-resnet-momentum", "resnet", "momentum", 0.02, "learning-rate-too-large", onset=30,
             options={"lr_jump": 200.0}),
    _setting("lr-jump-gpt-adam", "gpt", "adam", 3e-3, "learning-rate-too-large", onset=30,
             options={"lr_jump": 100.0}),
    # ---- somewhat too large: oscillation and loss spikes
    _setting("lr-large-mlp-momentum", "mlp", "momentum", 0.6, "learning-rate-too-large"),
    # ... with SGD at 10x a healthy rate: the loss oscillates, lr x top Hessian eigenvalue stays above 2
    # (HessMaxEV and NormTest tracked, for sharpness-above-stability)
    _setting("lr-large-mlp-sgd-curvature", "mlp", "sgd", 1.0, "learning-rate-too-large",
             options={"track": _CURVATURE}),
    _setting("lr-large-cnn-sgd-curvature", "cnn", "sgd", 0.5, "learning-rate-too-large",
             options={"track": _CURVATURE}),
    _setting("lr-large-resnet-sgd-curvature", "resnet", "sgd", 0.5, "learning-rate-too-large",
             options={"track": _CURVATURE}),
    # ---- too small
    _setting("lr-tiny-mlp-sgd", "mlp", "sgd", 1e-4, "learning-rate-too-small"),
    _setting("lr-tiny-transformer-adam", "transformer", "adam", 1e-6, "learning-rate-too-small"),
    # ---- initialization, activations, frozen layers
    _setting("init-vanishing-sigmoid", "mlp", "sgd", 0.1, "poor-initialization",
             options={"activation": "sigmoid", "depth": 6, "init_std": 0.01}),
    _setting("init-saturating-tanh", "mlp", "sgd", 0.05, "poor-initialization",
             options={"activation": "tanh", "depth": 6, "init_std": 2.0}),
    _setting("dead-relu-bias", "mlp", "sgd", 0.1, "dead-units", options={"hidden_bias": -5.0}),
    _setting("frozen-cnn-layer", "cnn", "momentum", 0.02, "frozen-layer", options={"frozen": True}),
    # ---- data
    _setting("shuffled-labels-mlp-adam", "mlp", "adam", 1e-3, "labels-do-not-match", options={"shuffle_labels": True}),
    _setting("unnormalized-inputs-mlp-sgd", "mlp", "sgd", 0.1, "unnormalized-inputs", options={"input_scale": 255.0}),
    _setting("overfitting-mlp-adam", "mlp", "adam", 3e-3, "overfitting", steps=80,
             options={"train_size": 48, "label_noise": 0.6, "width": 256, "valid_every": 2}),
    _setting("nan-operation-mlp", "mlp", "adam", 1e-3, "nonfinite-operation", onset=25,
             options={"normalize_rows": True, "zero_row_at": 25}),
    # ---- gradients through time, batch size
    _setting("exploding-rnn", "rnn", "sgd", 0.05, "exploding-gradient", options={"recurrent_scale": 3.0}),
    _setting("batch-of-one-mlp-sgd", "mlp", "sgd", 0.1, "batch-too-small", batch=1),
    # ... on other models and optimizers (third round): each a healthy setting of batches of 8 with
    # the batch set to one, nothing else changed
    _setting("batch-of-one-cnn-momentum", "cnn", "momentum", 0.01, "batch-too-small", batch=1),
    _setting("batch-of-one-resnet-momentum", "resnet", "momentum", 0.01, "batch-too-small", batch=1),
    _setting("batch-of-one-transformer-adam", "transformer", "adam", 1e-3, "batch-too-small", batch=1),
]


def corpus(seeds: tuple[int, ...] = TUNING_SEEDS + EVALUATION_SEEDS, settings: list[str] | None = None) -> list[RunSpec]:
    """Every setting (or the named ones) with every seed, as :class:`RunSpec` s."""
    known = {s["setting"] for s in SETTINGS}
    unknown = sorted(set(settings or ()) - known)
    if unknown:
        raise ValueError(f"unknown corpus settings {unknown}; known: {sorted(known)}")
    chosen = [s for s in SETTINGS if settings is None or s["setting"] in settings]
    return [RunSpec(seed=seed, **setting) for setting in chosen for seed in seeds]


def split(specs: list[RunSpec]) -> dict[str, list[RunSpec]]:
    """``{"tuning": seeds 0 and 1, "evaluation": seeds 2 and 3}``."""
    return {"tuning": [s for s in specs if s.seed in TUNING_SEEDS],
            "evaluation": [s for s in specs if s.seed in EVALUATION_SEEDS]}


# ---- data ---------------------------------------------------------------------------------------
_DIGITS: tuple[torch.Tensor, torch.Tensor] | None = None


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    global _DIGITS
    if _DIGITS is None:
        from sklearn.datasets import load_digits

        data = load_digits()
        _DIGITS = torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)
    return _DIGITS


def _sequences(seed: int, count: int, length: int, vocab: int) -> torch.Tensor:
    """Token sequences of a noisy affine recurrence ``x_{t+1} = (3 x_t + x_{t-1}) mod vocab``
    (10% of tokens replaced at random): learnable, with a loss floor above 0."""
    generator = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.empty(count, length, dtype=torch.long)
    tokens[:, :2] = torch.randint(0, vocab, (count, 2), generator=generator)
    for t in range(2, length):
        tokens[:, t] = (3 * tokens[:, t - 1] + tokens[:, t - 2]) % vocab
    noise = torch.rand(count, length, generator=generator) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=generator)
    return tokens


def _signal_sequences(seed: int, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of ±1 (shape ``[count, length, 1]``); the label says whether the last 5 sum above 0."""
    generator = torch.Generator().manual_seed(2000 + seed)
    signs = torch.randint(0, 2, (count, length, 1), generator=generator).float() * 2 - 1
    return signs, (signs[:, -5:, 0].sum(dim=1) > 0).long()


# ---- models -------------------------------------------------------------------------------------
_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU}


class RowNormalize(nn.Module):
    """``x / ||x||`` per sample: NaN for an all-zero input (0 / 0)."""

    def forward(self, x):
        return x / x.norm(dim=1, keepdim=True) * 8.0


def _mlp(options: dict[str, Any]) -> nn.Module:
    activation = _ACTIVATIONS[options.get("activation", "relu")]
    width, depth = options.get("width", 32), options.get("depth", 1)
    widths = [64] + [width] * depth + [10]
    layers: list[nn.Module] = [RowNormalize()] if options.get("normalize_rows") else []
    for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        layer = nn.Linear(fan_in, fan_out)
        hidden = index < len(widths) - 2
        with torch.no_grad():
            if "init_std" in options:
                layer.weight.normal_(0.0, options["init_std"])
            if hidden and "hidden_bias" in options:
                layer.bias.fill_(options["hidden_bias"])
        layers.append(layer)
        if hidden:
            layers.append(activation())
    return nn.Sequential(*layers)


class _Image(nn.Module):
    """Reshapes the 64 pixels of a digit to ``[1, 8, 8]``."""

    def forward(self, x):
        return x.view(-1, 1, 8, 8)


def _cnn(options: dict[str, Any]) -> nn.Module:
    return nn.Sequential(_Image(), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 16, 10))


class _Block(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, channels)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, channels)
        self.act2 = nn.ReLU()

    def forward(self, x):
        return self.act2(x + self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x))))))


def _resnet(options: dict[str, Any]) -> nn.Module:
    return nn.Sequential(_Image(), nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), _Block(8), _Block(8),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))


class _AttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.causal = causal

    def forward(self, x):
        mask = None
        if self.causal:
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class _TransformerClassifier(nn.Module):
    """The 8 rows of a digit as 8 tokens of 8 pixels; mean-pooled to 10 classes."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(torch.zeros(8, width))
        self.block = _AttentionBlock(width, 4, causal=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.embed(x.view(-1, 8, 8)) + self.position
        return self.head(self.block(h).mean(dim=1))


class _GPT(nn.Module):
    """A causal language model: token and position embeddings, two attention blocks, a head."""

    def __init__(self, vocab: int = 16, length: int = 16, width: int = 32):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        self.blocks = nn.Sequential(_AttentionBlock(width, 4, causal=True), _AttentionBlock(width, 4, causal=True))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.tokens(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(h)))


class _RNN(nn.Module):
    """A tanh RNN written out (so the activation is a module the cockpit sees), classifying the sequence."""

    def __init__(self, width: int = 16, recurrent_scale: float | None = None):
        super().__init__()
        self.input = nn.Linear(1, width)
        self.recurrent = nn.Linear(width, width, bias=False)
        self.act = nn.Tanh()
        self.head = nn.Linear(width, 2)
        with torch.no_grad():
            if recurrent_scale is not None:
                q, _ = torch.linalg.qr(torch.randn(width, width))
                self.recurrent.weight.copy_(recurrent_scale * q)

    def forward(self, x):
        h = torch.zeros(x.shape[0], self.recurrent.in_features)
        for t in range(x.shape[1]):
            h = self.act(self.input(x[:, t]) + self.recurrent(h))
        return self.head(h)


def _model(spec: RunSpec) -> nn.Module:
    options = spec.options
    if spec.arch == "mlp":
        return _mlp(options)
    if spec.arch == "cnn":
        return _cnn(options)
    if spec.arch == "resnet":
        return _resnet(options)
    if spec.arch == "transformer":
        return _TransformerClassifier()
    if spec.arch == "gpt":
        return _GPT()
    if spec.arch == "rnn":
        return _RNN(recurrent_scale=options.get("recurrent_scale"))
    raise ValueError(f"unknown architecture {spec.arch!r}; use mlp, cnn, resnet, transformer, gpt or rnn")


def _optimizer(spec: RunSpec, params) -> torch.optim.Optimizer:
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr)
    if spec.optimizer == "momentum":
        return torch.optim.SGD(params, lr=spec.lr, momentum=0.9)
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.01)
    raise ValueError(f"unknown optimizer {spec.optimizer!r}; use sgd, momentum, adam or adamw")


def learning_rate(spec: RunSpec, step: int) -> float:
    """The learning rate of ``spec`` at ``step`` (schedule, then the ``lr_jump`` problem)."""
    factor = 1.0
    if "warmup" in spec.schedule and step < 10:
        factor *= (step + 1) / 10
    if "decay" in spec.schedule:
        factor *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / spec.steps))
    if "lr_jump" in spec.options and step >= spec.onset:
        factor *= spec.options["lr_jump"]
    return spec.lr * factor


# ---- training -----------------------------------------------------------------------------------
def _data(spec: RunSpec):
    """``(train inputs, train labels, validation or None, task)`` for the run."""
    options = spec.options
    if spec.arch == "gpt":
        tokens = _sequences(spec.seed, 512, 16, 16)
        return tokens, None, None, "language"
    if spec.arch == "rnn":
        x, y = _signal_sequences(spec.seed, 512, 30)
        return x, y, None, "classify"
    inputs, labels = _digits()
    generator = torch.Generator().manual_seed(3000 + spec.seed)
    order = torch.randperm(len(labels), generator=generator)
    inputs, labels = inputs[order] * options.get("input_scale", 1.0), labels[order].clone()
    valid = (inputs[1400:], labels[1400:])
    inputs, labels = inputs[: options.get("train_size", 1400)], labels[: options.get("train_size", 1400)]
    if options.get("shuffle_labels"):
        labels = labels[torch.randperm(len(labels), generator=generator)]
    if "label_noise" in options:
        noisy = torch.rand(len(labels), generator=generator) < options["label_noise"]
        labels[noisy] = torch.randint(0, 10, (int(noisy.sum()),), generator=generator)
    return inputs, labels, (valid if "valid_every" in options else None), "classify"


def _loss(outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if outputs.dim() == 3:  # language model: per-token cross-entropy, averaged per sequence
        per_token = nn.functional.cross_entropy(outputs.transpose(1, 2), targets, reduction="none")
        per_sample = per_token.mean(dim=1)
        return per_sample.mean() if reduction == "mean" else per_sample
    return nn.functional.cross_entropy(outputs, targets, reduction=reduction)


def quantities_for_rules(schedule=None) -> list:
    """The quantities every built-in rule reads, except the curvature (``HessMaxEV``) and the
    gradient noise (``NormTest``) ones, which cost per-sample work."""
    from cockpit_like.quantities import (ActivationStats, Alpha, BatchSize, DataStats, GradNorm, LearningRate,
                                         Loss, Momentum, ParamNorm, UpdateSize)
    from cockpit_like.utils.schedules import linear

    schedule = schedule or linear(1)
    return [Loss(schedule), GradNorm(schedule), UpdateSize(schedule), ParamNorm(schedule), ActivationStats(schedule),
            DataStats(schedule), LearningRate(schedule), Momentum(schedule), BatchSize(schedule), Alpha(schedule)]


def _extra(spec: RunSpec) -> list:
    """The quantities ``spec.options["track"]`` names beyond :func:`quantities_for_rules` (``HessMaxEV``,
    ``NormTest``: the inputs of ``sharpness-above-stability`` and ``noise-dominated``), every step."""
    from cockpit_like import quantities
    from cockpit_like.utils.schedules import linear

    names = spec.options.get("track", ())
    unknown = [name for name in names if name not in ("HessMaxEV", "NormTest")]
    if unknown:
        raise ValueError(f"unknown tracked quantities {unknown}; the corpus adds HessMaxEV and NormTest")
    return [getattr(quantities, name)(linear(1)) for name in names]


def train(spec: RunSpec) -> dict[str, Any]:
    """Train ``spec`` under a cockpit (no live diagnosis); return ``{"spec", "steps", "metadata", "onset", "seconds"}``.

    ``steps`` is the cockpit's output (what the rules read) with
    ``train_loss`` / ``valid_loss`` logged every ``valid_every`` steps when
    the run has a validation split.
    """
    from cockpit_like import Cockpit

    if spec.problem is not None and spec.problem not in PROBLEMS:
        raise ValueError(f"unknown problem {spec.problem!r}; use one of {sorted(PROBLEMS)}")
    started = time.perf_counter()
    torch.manual_seed(spec.seed)
    inputs, labels, valid, task = _data(spec)
    model = _model(spec)
    frozen = set()
    if spec.options.get("frozen"):
        frozen = {id(p) for p in list(model.parameters())[:2]}  # the first layer's weight and bias
    optimizer = _optimizer(spec, [p for p in model.parameters() if id(p) not in frozen])
    cockpit = Cockpit(list(model.parameters()), quantities=quantities_for_rules() + _extra(spec), model=model)
    generator = torch.Generator().manual_seed(4000 + spec.seed)
    zero_row_at = spec.options.get("zero_row_at")
    valid_every = spec.options.get("valid_every")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-finite losses warn by design
        for step in range(spec.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(spec, step)
            rows = torch.randint(0, len(inputs), (spec.batch,), generator=generator)
            x = inputs[rows].clone()
            if task == "language":
                x, y = x[:, :-1], x[:, 1:]
            else:
                y = labels[rows]
            if zero_row_at is not None and step == zero_row_at:
                x[0] = 0.0  # a corrupted sample: its norm is 0
            optimizer.zero_grad()
            outputs = model(x)
            loss = _loss(outputs, y)
            info = {"batch_size": spec.batch, "loss": loss, "optimizer": optimizer,
                    "individual_losses": _loss(outputs, y, reduction="none")}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            if valid_every and step % valid_every == valid_every - 1:
                with torch.no_grad():
                    figures = {"train_loss": _loss(model(inputs), labels).item(),
                               "valid_loss": _loss(model(valid[0]), valid[1]).item()}
                cockpit.log(step, **figures)
    steps = cockpit.get_output()
    return {"spec": spec, "steps": steps, "metadata": cockpit.metadata(), "onset": onset_of(spec, steps),
            "seconds": time.perf_counter() - started}


def onset_of(spec: RunSpec, steps: dict[int, dict[str, Any]]) -> int:
    """The step where the run's problem starts: ``spec.onset``, except for overfitting, where it is
    the step of the lowest validation loss (after it the validation loss rises)."""
    if spec.problem != "overfitting":
        return spec.onset
    logged = [(values["valid_loss"], step) for step, values in steps.items() if "valid_loss" in values]
    return min(logged)[1] if logged else spec.onset
