"""A corpus *generator*: labelled training runs drawn from families, for leave-family-out scoring.

A **family** is an ``(architecture, optimizer, schedule)`` combination.
:func:`families` lists them; :func:`family_split` puts each whole family in
the **tuning** half (thresholds may be set on it) or the **held-out** half
(only reported), by a fixed seeded shuffle, so that no held-out combination
is ever seen while tuning. :func:`generate` draws runs from the families of
one half: per run a data set and loss, a batch size, a learning rate around
the family's healthy one, and either nothing (a healthy run) or a fault with
a known onset (:data:`FAULTS`). :func:`train_generated` trains a run, small
and fast (tiny models, 80 steps, the cheap quantities the rules read at every
step), and :func:`healthy_check` says whether a healthy run trained well, by
its own loss (never by the rules): a healthy draw that fails the check is
left out of the scoring and counted.

Architectures: ``mlp``, ``cnn``, ``resnet-gn`` and ``resnet-bn`` (GroupNorm /
BatchNorm residual CNNs), ``rnn`` (tanh), ``gru``, ``lstm``, ``transformer``
(a classifier over the rows of a digit) and ``gpt`` (a causal language model
with token embeddings). Optimizers: ``sgd``, ``momentum``, ``nesterov``,
``adam``, ``adamw``, ``rmsprop``, ``adagrad``. Schedules: ``constant``,
``warmup``, ``cosine`` (to 0), ``warmup-cosine``, ``step`` (x0.1 at 50% and
75% of the run), ``onecycle``. Data and loss: digits with cross-entropy or
label smoothing, synthetic blobs (10 classes), synthetic regression (MSE),
synthetic binary classification (BCE), sign sequences, token sequences.

Example::

    from cockpit_like.corpus_generator import generate, train_generated
    specs = generate("tuning", count=40, seed=0)
    run = train_generated(specs[0])   # {"spec", "steps", "metadata", "onset", "seconds", "healthy_check"}
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cockpit_like.corpus import _AttentionBlock, _digits, _Image, _sequences, _signal_sequences, quantities_for_rules

__all__ = ["ARCHITECTURES", "OPTIMIZERS", "SCHEDULES", "FAULTS", "GeneratedRun", "families", "family_split",
           "generate", "train_generated", "healthy_check", "scheduled_rate", "HELD_OUT_SHARE", "SPLIT_SEED"]

ARCHITECTURES = ("mlp", "cnn", "resnet-gn", "resnet-bn", "rnn", "gru", "lstm", "transformer", "gpt")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad")
SCHEDULES = ("constant", "warmup", "cosine", "warmup-cosine", "step", "onecycle")

#: the data sets and losses each architecture is drawn with
DATA = {
    "mlp": ("digits-ce", "digits-smooth", "blobs-ce", "regression-mse", "binary-bce"),
    "cnn": ("digits-ce", "digits-smooth"),
    "resnet-gn": ("digits-ce", "digits-smooth"),
    "resnet-bn": ("digits-ce",),
    "rnn": ("signs-ce",),
    "gru": ("signs-ce",),
    "lstm": ("signs-ce",),
    "transformer": ("digits-ce", "digits-smooth"),
    "gpt": ("tokens-lm",),
}

#: a healthy learning rate per optimizer (constant schedule, batch 32), and per architecture a factor
_BASE_LR = {"sgd": 0.1, "momentum": 0.02, "nesterov": 0.02, "adam": 2e-3, "adamw": 2e-3, "rmsprop": 1e-3,
            "adagrad": 0.03}
_ARCH_LR = {"mlp": 2.5, "cnn": 2.0, "resnet-gn": 2.5, "resnet-bn": 2.5, "rnn": 1.0, "gru": 1.0, "lstm": 1.0,
            "transformer": 2.5, "gpt": 5.0}
#: ... and for the SGD family (plain, momentum, Nesterov), where the scale of the gradient matters
_ARCH_LR_SGD = {"mlp": 4.0, "cnn": 2.0, "resnet-gn": 2.0, "resnet-bn": 2.0, "rnn": 1.0, "gru": 1.0, "lstm": 1.0,
                "transformer": 3.0, "gpt": 20.0}
_ADAPTIVE = ("adam", "adamw", "rmsprop", "adagrad")
#: the architectures tracked with ``Alpha`` (it needs per-sample work: undefined under batch norm in
#: training mode, and 20-40x the run's cost on the GRU, the transformer and the GPT)
_WITH_ALPHA = ("mlp", "cnn", "resnet-gn", "rnn", "lstm")

#: fault label -> (cause the diagnosis should name, what the generator does)
FAULTS = {
    "lr-huge": ("learning-rate-too-large", "a learning rate 30-300x the family's healthy one, from the start"),
    "lr-jump": ("learning-rate-too-large", "a schedule bug: the learning rate multiplied by 30-200 from step k"),
    "lr-tiny": ("learning-rate-too-small", "a learning rate 300-3000x below the family's healthy one"),
    "zero-grad": ("gradients-accumulate", "optimizer.zero_grad() forgotten: gradients add up over the steps"),
    "double-softmax": ("saturated-output", "softmax applied before a loss that applies its own (cross-entropy)"),
    "frozen": ("frozen-layer", "a layer left out of the optimizer from the start, or its learning rate set to "
               "0 from step k (a freeze meant for another layer)"),
    "exploding-recurrence": ("exploding-gradient", "recurrent weights with a spectral radius of 2.5-4 "
                             "(tanh or ReLU recurrence)"),
    "label-noise-mid": ("labels-do-not-match", "labels replaced at random from step k (a data bug mid-run)"),
    "constant-inputs-mid": ("labels-do-not-match", "every input replaced by the same one from step k"),
    "shuffled-labels": ("labels-do-not-match", "labels shuffled against the inputs from the start"),
    "weight-decay": ("weight-decay-too-large", "weight decay that shrinks every weight by 3-6% per step"),
    "unnormalized": ("unnormalized-inputs", "inputs 30-255x their normalized scale"),
    "init-small": ("poor-initialization", "a deep sigmoid MLP with weights of std 0.01"),
    "dead-bias": ("dead-units", "ReLU hidden biases of -5"),
    "batch-one": ("batch-too-small", "a batch of one sample"),
    "nan-input": ("nonfinite-operation", "one input row made NaN at step k"),
}

#: the share of families held out from tuning, and the seed of the split
HELD_OUT_SHARE = 0.5
SPLIT_SEED = 36


@dataclass(frozen=True)
class GeneratedRun:
    """One generated run.

    Attributes:
        family: ``"arch/optimizer/schedule"``.
        arch, optimizer, schedule: the family's parts.
        data: a key of :data:`DATA`'s lists, e.g. ``"digits-ce"``.
        lr: the base (peak) learning rate.
        batch: batch size.
        seed: seeds the model, the data and the batches.
        fault: a key of :data:`FAULTS`, or None for a healthy run.
        onset: the step where the fault starts (0: from the start).
        steps: optimizer steps (every one tracked).
        options: what makes the fault (e.g. ``{"lr_jump": 100.0}``).
        index: the run's number in its half.
    """

    family: str
    arch: str
    optimizer: str
    schedule: str
    data: str
    lr: float
    batch: int
    seed: int
    fault: str | None = None
    onset: int = 0
    steps: int = 80
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    index: int = 0

    @property
    def problem(self) -> str | None:
        """The cause the diagnosis should name first (None: healthy)."""
        return None if self.fault is None else FAULTS[self.fault][0]

    @property
    def name(self) -> str:
        return f"{self.index:03d}-{self.family}/{self.data}/b{self.batch}/{self.fault or 'healthy'}/s{self.seed}"


def families() -> list[tuple[str, str, str]]:
    """Every ``(architecture, optimizer, schedule)`` combination."""
    return [(a, o, s) for a in ARCHITECTURES for o in OPTIMIZERS for s in SCHEDULES]


def family_split(seed: int = SPLIT_SEED, held_out: float = HELD_OUT_SHARE) -> dict[str, list[tuple[str, str, str]]]:
    """``{"tuning": [...], "held-out": [...]}``: whole families, by a seeded shuffle within each
    architecture (so both halves hold every architecture, with different optimizer x schedule pairs)."""
    rng = random.Random(seed)
    halves: dict[str, list[tuple[str, str, str]]] = {"tuning": [], "held-out": []}
    for arch in ARCHITECTURES:
        mine = [f for f in families() if f[0] == arch]
        rng.shuffle(mine)
        cut = round(len(mine) * (1.0 - held_out))
        halves["tuning"] += sorted(mine[:cut])
        halves["held-out"] += sorted(mine[cut:])
    return halves


def _fault_fits(fault: str, arch: str, optimizer: str, data: str) -> bool:
    classify = data.endswith("-ce") or data.endswith("-smooth") or data == "tokens-lm" or data == "binary-bce"
    if fault == "double-softmax":
        return data.endswith("-ce") or data == "digits-smooth" or data == "tokens-lm"
    if fault == "exploding-recurrence":
        return arch == "rnn"
    if fault in ("label-noise-mid", "shuffled-labels"):
        return classify
    if fault == "constant-inputs-mid":
        return True
    if fault == "weight-decay":
        return optimizer in ("sgd", "momentum", "nesterov", "adamw")
    if fault == "unnormalized":
        return data.startswith("digits") or data in ("blobs-ce", "regression-mse", "binary-bce")
    if fault in ("init-small", "dead-bias"):
        return arch == "mlp"
    if fault == "batch-one":
        return arch in ("mlp", "cnn", "resnet-gn", "transformer")
    if fault == "nan-input":  # (resnet-bn: a NaN row under the cockpit makes backward fail, an engine bug)
        return arch not in ("gpt", "resnet-bn")
    return True


def generate(half: str, count: int, seed: int = 0, healthy_share: float = 0.45,
             split_seed: int = SPLIT_SEED) -> list[GeneratedRun]:
    """``count`` runs drawn from the families of ``half`` (``"tuning"`` or ``"held-out"``).

    About ``healthy_share`` of them are healthy; the others carry a fault drawn
    uniformly among those that fit the family (:data:`FAULTS`).
    """
    halves = family_split(split_seed)
    if half not in halves:
        raise ValueError(f"unknown half {half!r}; use 'tuning' or 'held-out'")
    if not 0.0 <= healthy_share <= 1.0:
        raise ValueError(f"healthy_share must lie in [0, 1], got {healthy_share!r}")
    rng = random.Random(f"{half}/{seed}")
    pool = halves[half]
    runs = []
    for index in range(count):
        arch, optimizer, schedule = pool[rng.randrange(len(pool))]
        data = rng.choice(DATA[arch])
        batch = rng.choice((16, 32, 64))
        factor = (_ARCH_LR if optimizer in _ADAPTIVE else _ARCH_LR_SGD)[arch]
        lr = _BASE_LR[optimizer] * factor * math.exp(rng.uniform(math.log(0.6), math.log(1.6)))
        if data == "regression-mse" and optimizer in ("sgd", "momentum", "nesterov"):
            lr *= 0.3
        fault, onset, options, steps = None, 0, {}, 80
        if rng.random() >= healthy_share:
            fits = [f for f in FAULTS if _fault_fits(f, arch, optimizer, data)]
            fault = rng.choice(fits)
            options, onset, lr, batch = _fault_options(fault, rng, lr, batch, optimizer, schedule)
        runs.append(GeneratedRun(f"{arch}/{optimizer}/{schedule}", arch, optimizer, schedule, data, lr, batch,
                                 seed=rng.randrange(10**6), fault=fault, onset=onset, steps=steps, options=options,
                                 index=index))
    return runs


def _fault_options(fault: str, rng: random.Random, lr: float, batch: int, optimizer: str,
                   schedule: str) -> tuple[dict, int, float, int]:
    onset = 0
    options: dict[str, Any] = {}
    mid = rng.randrange(25, 50)
    if fault == "lr-huge":
        lr *= math.exp(rng.uniform(math.log(30), math.log(300)))
    elif fault == "lr-jump":
        onset, options["lr_jump"] = mid, math.exp(rng.uniform(math.log(30), math.log(200)))
    elif fault == "lr-tiny":
        lr /= math.exp(rng.uniform(math.log(300), math.log(3000)))
    elif fault == "frozen":
        if rng.random() < 0.5:
            options["frozen_from"] = 0
        else:
            onset = options["frozen_from"] = mid
    elif fault == "exploding-recurrence":
        options["recurrent_scale"] = rng.uniform(2.5, 4.0)
        options["recurrent_activation"] = rng.choice(("tanh", "relu"))
    elif fault in ("label-noise-mid", "constant-inputs-mid", "nan-input"):
        onset = mid
    elif fault == "weight-decay":
        options["weight_decay_per_step"] = rng.uniform(0.03, 0.06)
    elif fault == "unnormalized":
        options["input_scale"] = math.exp(rng.uniform(math.log(30), math.log(255)))
    elif fault == "init-small":
        options.update(activation="sigmoid", depth=6, init_std=0.01)
    elif fault == "dead-bias":
        options["hidden_bias"] = -5.0
    elif fault == "batch-one":
        batch = 1
    return options, onset, lr, batch


# ---- the schedule -------------------------------------------------------------------------------
def scheduled_rate(run: GeneratedRun, step: int) -> float:
    """The learning rate of ``run`` at ``step``: the schedule, then the ``lr_jump`` fault."""
    total, warm = run.steps, 10
    s = run.schedule
    factor = 1.0
    if s == "warmup":
        factor = min(1.0, (step + 1) / warm)
    elif s == "cosine":
        factor = 0.5 * (1 + math.cos(math.pi * step / total))
    elif s == "warmup-cosine":
        factor = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
    elif s == "step":
        factor = 1.0 if step < total // 2 else (0.1 if step < 3 * total // 4 else 0.01)
    elif s == "onecycle":
        peak = int(0.3 * total)
        factor = (0.04 + 0.96 * step / peak) if step < peak else 0.5 * (1 + math.cos(math.pi * (step - peak) / (total - peak)))
    if "lr_jump" in run.options and step >= run.onset:
        factor = max(factor, 0.1) * run.options["lr_jump"]
    return run.lr * factor


# ---- data ---------------------------------------------------------------------------------------
def _blobs(seed: int, count: int = 1024, classes: int = 10, dim: int = 16):
    generator = torch.Generator().manual_seed(5000 + seed)
    centers = torch.randn(classes, dim, generator=generator) * 1.5
    labels = torch.randint(0, classes, (count,), generator=generator)
    return centers[labels] + torch.randn(count, dim, generator=generator), labels


def _regression(seed: int, count: int = 1024, dim: int = 16):
    generator = torch.Generator().manual_seed(6000 + seed)
    x = torch.randn(count, dim, generator=generator)
    w1, w2 = torch.randn(dim, 8, generator=generator) / 4, torch.randn(8, 1, generator=generator)
    return x, torch.tanh(x @ w1) @ w2 + 0.1 * torch.randn(count, 1, generator=generator)


def _binary(seed: int, count: int = 1024, dim: int = 16):
    generator = torch.Generator().manual_seed(7000 + seed)
    x = torch.randn(count, dim, generator=generator)
    w = torch.randn(dim, generator=generator)
    return x, ((x @ w + 0.5 * torch.randn(count, generator=generator)) > 0).float().unsqueeze(1)


def _data(run: GeneratedRun):
    """``(inputs, targets, in_features, out_features)``."""
    if run.data == "tokens-lm":
        return _sequences(run.seed, 512, 12, 16), None, 16, 16
    if run.data == "signs-ce":
        x, y = _signal_sequences(run.seed, 512, 20)
        return x, y, 1, 2
    if run.data.startswith("digits"):
        x, y = _digits()
        return x, y, 64, 10
    if run.data == "blobs-ce":
        x, y = _blobs(run.seed)
        return x, y, 16, 10
    if run.data == "regression-mse":
        x, y = _regression(run.seed)
        return x, y, 16, 1
    x, y = _binary(run.seed)
    return x, y, 16, 1


def _loss(run: GeneratedRun, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample losses."""
    if run.data == "tokens-lm":
        return nn.functional.cross_entropy(outputs.transpose(1, 2), targets, reduction="none").mean(dim=1)
    if run.data == "regression-mse":
        return ((outputs - targets) ** 2).mean(dim=1)
    if run.data == "binary-bce":
        return nn.functional.binary_cross_entropy_with_logits(outputs, targets, reduction="none").mean(dim=1)
    smoothing = 0.1 if run.data.endswith("-smooth") else 0.0
    return nn.functional.cross_entropy(outputs, targets, reduction="none", label_smoothing=smoothing)


# ---- models -------------------------------------------------------------------------------------
class _Recurrent(nn.Module):
    """A written-out tanh or ReLU RNN (the activation a module the cockpit sees), or nn.GRU / nn.LSTM."""

    def __init__(self, kind: str, width: int = 16, scale: float | None = None, activation: str = "tanh"):
        super().__init__()
        self.kind = kind
        if kind == "rnn":
            self.input = nn.Linear(1, width)
            self.recurrent = nn.Linear(width, width, bias=False)
            self.act = nn.ReLU() if activation == "relu" else nn.Tanh()
            if scale is not None:
                with torch.no_grad():
                    q, _ = torch.linalg.qr(torch.randn(width, width))
                    self.recurrent.weight.copy_(scale * q)
        else:
            self.cell = (nn.GRU if kind == "gru" else nn.LSTM)(1, width, batch_first=True)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        if self.kind != "rnn":
            return self.head(self.cell(x)[0][:, -1])
        h = torch.zeros(x.shape[0], self.recurrent.in_features)
        for t in range(x.shape[1]):
            h = self.act(self.input(x[:, t]) + self.recurrent(h))
        return self.head(h)


class _ResBlock(nn.Module):
    def __init__(self, channels: int, norm: str):
        super().__init__()
        make = (lambda: nn.BatchNorm2d(channels)) if norm == "bn" else (lambda: nn.GroupNorm(4, channels))
        self.conv1, self.norm1, self.act1 = nn.Conv2d(channels, channels, 3, padding=1), make(), nn.ReLU()
        self.conv2, self.norm2, self.act2 = nn.Conv2d(channels, channels, 3, padding=1), make(), nn.ReLU()

    def forward(self, x):
        return self.act2(x + self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x))))))


class _Transformer(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(0.02 * torch.randn(8, width))
        self.block = _AttentionBlock(width, 2, causal=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.block(self.embed(x.view(-1, 8, 8)) + self.position).mean(dim=1))


class _GPT(nn.Module):
    """Token and position embeddings (N(0, 1) init, as nn.Embedding's), one causal block, a head."""

    def __init__(self, vocab: int = 16, length: int = 12, width: int = 16):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.position = nn.Embedding(length, width)
        self.block = _AttentionBlock(width, 2, causal=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        return self.head(self.norm(self.block(self.tokens(tokens) + self.position(positions))))


def _model(run: GeneratedRun, in_features: int, out_features: int) -> nn.Module:
    o = run.options
    if run.arch == "mlp":
        act = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}[o.get("activation", "relu")]
        widths = [in_features] + [32] * o.get("depth", 2) + [out_features]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layer = nn.Linear(a, b)
            hidden = i < len(widths) - 2
            with torch.no_grad():
                if "init_std" in o:
                    layer.weight.normal_(0.0, o["init_std"])
                if hidden and "hidden_bias" in o:
                    layer.bias.fill_(o["hidden_bias"])
            layers += [layer, act()] if hidden else [layer]
        return nn.Sequential(*layers)
    if run.arch == "cnn":
        return nn.Sequential(_Image(), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                             nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 16, 10))
    if run.arch in ("resnet-gn", "resnet-bn"):
        norm = run.arch[-2:]
        first = nn.BatchNorm2d(8) if norm == "bn" else nn.GroupNorm(4, 8)
        return nn.Sequential(_Image(), nn.Conv2d(1, 8, 3, padding=1), first, nn.ReLU(), _ResBlock(8, norm),
                             nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))
    if run.arch in ("rnn", "gru", "lstm"):
        return _Recurrent(run.arch, scale=o.get("recurrent_scale"), activation=o.get("recurrent_activation", "tanh"))
    if run.arch == "transformer":
        return _Transformer()
    if run.arch == "gpt":
        return _GPT()
    raise ValueError(f"unknown architecture {run.arch!r}; use one of {ARCHITECTURES}")


def _optimizer(run: GeneratedRun, groups) -> torch.optim.Optimizer:
    decay = run.options.get("weight_decay_per_step")
    wd = (decay / run.lr) if decay else None
    name = run.optimizer
    if name == "sgd":
        return torch.optim.SGD(groups, lr=run.lr, weight_decay=wd or 0.0)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD(groups, lr=run.lr, momentum=0.9, nesterov=name == "nesterov", weight_decay=wd or 0.0)
    if name == "adam":
        return torch.optim.Adam(groups, lr=run.lr)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=run.lr, weight_decay=wd or 0.01)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=run.lr)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=run.lr)
    raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")


# ---- training -------------------------------------------------------------------------------------
def healthy_check(run: GeneratedRun, losses: list[float]) -> dict[str, Any]:
    """Whether a run trained well, by its own losses: the median of the last 10 finite losses below
    ``limit`` x the median of the first 3 (0.6 for classification and regression, 0.85 for sign
    sequences and 0.9 for language modelling, whose loss floors are high). Never reads a rule."""
    finite = [v for v in losses if math.isfinite(v)]
    if len(finite) < 13 or len(finite) < len(losses):
        return {"passed": False, "why": "non-finite or too few losses"}
    first, last = float(torch.tensor(finite[:3]).median()), float(torch.tensor(finite[-10:]).median())
    limit = 0.9 if run.data == "tokens-lm" else (0.85 if run.data == "signs-ce" else 0.6)
    return {"passed": last < limit * first, "first": first, "last": last, "limit": limit}


def train_generated(run: GeneratedRun) -> dict[str, Any]:
    """Train ``run`` under a cockpit tracking :func:`~cockpit_like.corpus.quantities_for_rules` at every
    step; return ``{"spec", "steps", "metadata", "onset", "seconds", "healthy_check"}``."""
    from cockpit_like import Cockpit

    started = time.perf_counter()
    torch.manual_seed(run.seed)
    inputs, targets, in_features, out_features = _data(run)
    if "input_scale" in run.options:
        inputs = inputs * run.options["input_scale"]
    model = _model(run, in_features, out_features)
    params = list(model.parameters())
    frozen_from = run.options.get("frozen_from")
    if frozen_from is None:
        groups, frozen = [{"params": params}], []
    else:  # the first layer with a weight: its own group (from step 0: left out of the optimizer)
        first = next(m for m in model.modules() if isinstance(getattr(m, "weight", None), nn.Parameter))
        frozen = list(first.parameters(recurse=False))
        rest = [p for p in params if all(p is not f for f in frozen)]
        groups = [{"params": rest}] + ([{"params": frozen}] if frozen_from > 0 else [])
    optimizer = _optimizer(run, groups)
    quantities = quantities_for_rules()
    if run.arch not in _WITH_ALPHA:
        quantities = [q for q in quantities if type(q).__name__ != "Alpha"]
    cockpit = Cockpit(params, quantities=quantities, model=model)
    generator = torch.Generator().manual_seed(run.seed + 1)
    shuffled = None
    if run.fault == "shuffled-labels":  # (language modelling: the next tokens of another sequence)
        shuffled = (inputs if targets is None else targets)[torch.randperm(len(inputs), generator=generator)]
    double_softmax = run.fault == "double-softmax"
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(run.steps):
            rate = scheduled_rate(run, step)
            for index, group in enumerate(optimizer.param_groups):
                frozen_now = frozen_from is not None and index == 1 and step >= frozen_from
                group["lr"] = 0.0 if frozen_now else rate
            rows = torch.randint(0, len(inputs), (run.batch,), generator=generator)
            x = inputs[rows].clone()
            if run.data == "tokens-lm":
                x, y = x[:, :-1], (x if shuffled is None else shuffled[rows])[:, 1:].clone()
            else:
                y = (shuffled if shuffled is not None else targets)[rows].clone()
            if step >= run.onset and run.fault == "label-noise-mid":
                y = _random_targets(run, y, generator)
            if step >= run.onset and run.fault == "constant-inputs-mid":
                x = x[:1].expand_as(x).clone()
            if step == run.onset and run.fault == "nan-input":
                x[0] = math.nan
            if run.fault != "zero-grad" or step < run.onset:
                optimizer.zero_grad()
            model.train()
            outputs = model(x)
            if double_softmax:
                outputs = outputs.softmax(dim=-1)
            individual = _loss(run, outputs, y)
            loss = individual.mean()
            losses.append(float(loss))
            info = {"batch_size": run.batch, "loss": loss, "optimizer": optimizer, "individual_losses": individual}
            with cockpit(step, info=info):
                loss.backward()
            optimizer.step()
    steps = cockpit.get_output()
    return {"spec": run, "steps": steps, "metadata": cockpit.metadata(), "onset": run.onset,
            "seconds": time.perf_counter() - started, "healthy_check": healthy_check(run, losses),
            "losses": losses}


def _random_targets(run: GeneratedRun, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if run.data == "binary-bce":
        return torch.randint(0, 2, y.shape, generator=generator).float()
    classes = 16 if run.data == "tokens-lm" else (2 if run.data == "signs-ce" else 10)
    return torch.randint(0, classes, y.shape, generator=generator)
