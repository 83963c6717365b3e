"""Toolkit of the loop zoo (issue 34): tiny float64 models, data, brute-force references, assertions.

The reference of a tracked step is computed independently of cockpit_like and
of BackPACK: a *twin* model (built by the same factory, never seen by a
cockpit) gets the parameter values the step used (``load_state_dict`` before
the step's forward pass), and the per-sample gradients are a loop of
``torch.autograd.grad`` over the step's rows:

- the rows are ALL rows of all backward passes of the optimizer step;
- ``row_loss(i)`` is row ``i``'s term ``l_i`` in the step's mean-loss
  convention, so that the step's loss is ``mean_i l_i`` and the gradient the
  optimizer gets is ``gbar = mean_i g_i`` with ``g_i = grad l_i`` (NOT divided
  by B; QUANTITIES.md §0);
- :func:`check_twin` asserts that ``gbar`` equals the gradient autograd really
  accumulated (divided by the loss scale the loop applied), so a wrong
  reference cannot pass silently.

From ``g_i`` the values of GradNorm (per parameter), NormTest, InnerTest,
OrthoTest (§5), GradHist1d counts (§6), HessTrace / TICDiag with the exact
Hessian diagonal (§7), Loss and BatchSize follow by their definitions.

The contract of every tracked step (:func:`assert_exact_or_invalid`): the
stored value equals the reference, or the cockpit stores no value and the
step's ``checks`` say it is invalid with at least one failed check. Never a
wrong number. :func:`assert_exact` is the stricter form for loops where the
issue demands numbers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

DTYPE = torch.float64
RTOL = 1e-7


# ----------------------------------------------------------------------------------------------------
# models (float64, seeded: the twin is the same model)


def mlp(seed: int = 0, inputs: int = 6, hidden: int = 8, outputs: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, outputs)).to(DTYPE)


def cnn(seed: int = 0) -> nn.Sequential:
    """Inputs 2x6x6: Conv 2-3 3x3, ReLU, MaxPool 2, Flatten, Linear 12-4."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 4)
    ).to(DTYPE)


def batchnorm_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)


class RNNClassifier(nn.Module):
    """Sequences [B, 4, 3] -> GRU or LSTM (3, 5) -> last hidden state -> Linear(5, 4)."""

    def __init__(self, cell: str = "GRU", seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.rnn = getattr(nn, cell)(3, 5, batch_first=True)
        self.head = nn.Linear(5, 4)
        self.to(DTYPE)

    def forward(self, x):
        _, h = self.rnn(x)
        h = h[0] if isinstance(h, tuple) else h  # LSTM: (h, c)
        return self.head(h[-1])


class TinyEncoder(nn.Module):
    """Sequences [B, 3, 4] -> Linear(4, 8) -> TransformerEncoderLayer(8, 2 heads) -> mean over time -> Linear(8, 3)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(4, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.to(DTYPE)

    def forward(self, x, padding=None):
        """``padding``: [B, T] bool, True at padded positions (masked in attention and in the pooling)."""
        if padding is None:
            return self.head(self.layer(self.embed(x)).mean(1))
        hidden = self.layer(self.embed(x), src_key_padding_mask=padding)
        keep = (~padding).to(hidden.dtype)[:, :, None]
        return self.head((hidden * keep).sum(1) / keep.sum(1))


class TinyLM(nn.Module):
    """Token ids [B, T] -> Embedding(11, 6, padding_idx=0) -> Tanh -> Linear(6, 11): next-token logits."""

    VOCAB = 11

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(self.VOCAB, 6, padding_idx=0)
        self.out = nn.Linear(6, self.VOCAB)
        self.to(DTYPE)

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens)))


class TwoHeads(nn.Module):
    """A trunk and two heads; ``aux`` is used only when the loop asks for it."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
        self.main = nn.Linear(8, 4)
        self.aux = nn.Linear(8, 3)
        self.to(DTYPE)

    def forward(self, x, use_aux: bool = False):
        h = self.trunk(x)
        return (self.main(h), self.aux(h)) if use_aux else self.main(h)


class WithUnused(nn.Module):
    """An MLP with a layer and a parameter the loss never uses (like CLIP's post_layernorm, XLNet's mask_emb)."""

    def __init__(self, seed: int = 0, freeze_first: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.first = nn.Linear(6, 8)
        self.unused = nn.Linear(8, 8)
        self.mask_emb = nn.Parameter(torch.randn(8))
        self.last = nn.Linear(8, 4)
        self.to(DTYPE)
        if freeze_first:
            self.first.requires_grad_(False)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


class TiedLM(nn.Module):
    """Token ids [B, T] -> Embedding(11, 6) -> Tanh -> logits with the embedding table tied as the output layer."""

    VOCAB = 11

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(self.VOCAB, 6)
        self.bias = nn.Parameter(torch.zeros(self.VOCAB))
        self.to(DTYPE)

    def forward(self, tokens):
        return torch.tanh(self.embed(tokens)) @ self.embed.weight.T + self.bias


class TinyMoE(nn.Module):
    """Top-1 routing of rows to 3 experts (Linear 6-8, Tanh, weighted by the gate), then Linear(8, 4).
    The gate's bias keeps expert 2 from getting any row (an expert that gets no tokens)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.gate = nn.Linear(6, 3)
        self.experts = nn.ModuleList([nn.Linear(6, 8) for _ in range(3)])
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.gate.bias[2] = -50.0
        self.to(DTYPE)

    def forward(self, x):
        weights = torch.softmax(self.gate(x), dim=1)
        chosen = weights.argmax(1)
        hidden = x.new_zeros(len(x), 8)
        for e, expert in enumerate(self.experts):
            rows = chosen == e
            if rows.any():
                hidden[rows] = torch.tanh(expert(x[rows])) * weights[rows, e : e + 1]
        return self.head(hidden)


class LossInForward(nn.Module):
    """Hugging Face style: ``model(x, labels=y)`` returns a dict with the logits and the mean loss."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.body = mlp(seed)

    def forward(self, x, labels=None):
        logits = self.body(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class ScaleShift(nn.Module):
    """A custom layer no built-in rule knows: ``x * weight + bias`` elementwise."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, features))

    def forward(self, x):
        return x * self.weight + self.bias


def custom_layer_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), ScaleShift(8), nn.Linear(8, 4)).to(DTYPE)


def weight_norm_mlp(seed: int = 0) -> nn.Sequential:
    """The first layer's weight reparametrised by torch.nn.utils.parametrizations.weight_norm (``[8, 6]``: at
    8 rows its leading dimension is the batch size)."""
    model = mlp(seed)
    torch.nn.utils.parametrizations.weight_norm(model[0])
    return model


def weight_norm_hook_mlp(seed: int = 0) -> nn.Sequential:
    """The same with the older torch.nn.utils.weight_norm (a forward pre-hook computes the weight)."""
    model = mlp(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of the parametrization
        torch.nn.utils.weight_norm(model[0])
    return model


class SharedLayer(nn.Module):
    """One Linear(8, 8) applied twice on the same rows (weight sharing across depth, ALBERT style)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)
        self.to(DTYPE)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h)) + h
        h = torch.tanh(self.shared(h)) + h
        return self.out(h)


def dropout_mlp(seed: int = 0, p: float = 0.3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(p), nn.Linear(8, 4)).to(DTYPE)


# ----------------------------------------------------------------------------------------------------
# data


def classification(rows: int, seed: int, shape: Sequence[int] = (6,), classes: int = 4):
    generator = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(rows, *shape, generator=generator, dtype=DTYPE)
    y = torch.randint(0, classes, (rows,), generator=generator)
    return x, y


def regression(rows: int, seed: int, inputs: int = 6, outputs: int = 4):
    generator = torch.Generator().manual_seed(2000 + seed)
    return torch.randn(rows, inputs, generator=generator, dtype=DTYPE), torch.randn(
        rows, outputs, generator=generator, dtype=DTYPE
    )


def multilabel(rows: int, seed: int, inputs: int = 6, outputs: int = 4):
    generator = torch.Generator().manual_seed(3000 + seed)
    x = torch.randn(rows, inputs, generator=generator, dtype=DTYPE)
    return x, torch.randint(0, 2, (rows, outputs), generator=generator).to(DTYPE)


def padded_tokens(rows: int, seed: int, length: int = 6):
    """Token ids with 0 as padding at the end of each row (lengths 3..length), and next-token targets
    where padding is ``-100`` (ignored)."""
    generator = torch.Generator().manual_seed(4000 + seed)
    tokens = torch.randint(1, TinyLM.VOCAB, (rows, length), generator=generator)
    lengths = torch.randint(3, length + 1, (rows,), generator=generator)
    lengths[0] = length  # at least one full row
    lengths[1] = 3  # and one short one, so token means and row means differ
    for i, n in enumerate(lengths.tolist()):
        tokens[i, n:] = 0
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[targets == 0] = -100
    return inputs, targets


# ----------------------------------------------------------------------------------------------------
# brute-force reference


def snapshot(twin: nn.Module, model: nn.Module) -> nn.Module:
    """The twin with the parameter values (and buffers) the step is about to use."""
    twin.load_state_dict(model.state_dict())
    return twin


def row_grads(params: Sequence[torch.Tensor], row_loss: Callable[[int], torch.Tensor], rows: int):
    """``([g_i for each parameter] as [rows, *p.shape] tensors, [l_i])`` by a loop of autograd.grad.

    A parameter with ``requires_grad=False`` or unused by ``l_i`` gets zeros."""
    grads = [torch.zeros(rows, *p.shape, dtype=p.dtype) for p in params]
    trainable = [k for k, p in enumerate(params) if p.requires_grad]
    values = []
    for i in range(rows):
        loss = row_loss(i)
        values.append(float(loss.detach()))
        parts = torch.autograd.grad(loss, [params[k] for k in trainable], allow_unused=True)
        for k, g in zip(trainable, parts):
            if g is not None:
                grads[k][i] = g.detach()
    return grads, values


def check_twin(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """The reference describes the loop: ``mean_i g_i`` is the gradient autograd accumulated / ``scale``."""
    for k, (p, g) in enumerate(zip(params, grads)):
        actual = torch.zeros_like(p) if p.grad is None else p.grad.detach() / scale
        torch.testing.assert_close(actual, g.mean(0), rtol=1e-10, atol=1e-13, msg=f"reference of parameter {k}")


def gradient_statistics(grads: Sequence[torch.Tensor]) -> dict[str, object]:
    """GradNorm, NormTest, InnerTest, OrthoTest of per-sample gradients ``g_i`` (QUANTITIES.md §3, §5)."""
    rows = grads[0].shape[0]
    flat = torch.cat([g.reshape(rows, -1) for g in grads], dim=1)
    gbar = flat.mean(0)
    sq = gbar @ gbar
    pi = flat @ gbar
    denominator = (rows - 1) * rows
    return {
        "GradNorm": [float(g.mean(0).norm()) for g in grads],
        "NormTest": math.sqrt(float(((flat - gbar) ** 2).sum() / (denominator * sq))),
        "InnerTest": math.sqrt(float(((pi - sq) ** 2).sum() / (denominator * sq**2))),
        "OrthoTest": math.sqrt(float(((flat - (pi / sq)[:, None] * gbar) ** 2).sum() / (denominator * sq))),
    }


def histogram_counts(grads: Sequence[torch.Tensor], bins: int = 100, lo: float = -2.0, hi: float = 2.0):
    """GradHist1d's counts: every entry of every ``g_i``, clamped into [lo, hi] (QUANTITIES.md §6)."""
    return sum(torch.histc(g.clamp(lo, hi), bins, min=lo, max=hi) for g in grads)


def hessian_diagonal(params: Sequence[torch.Tensor], loss: torch.Tensor) -> list[torch.Tensor]:
    """The exact diagonal of the Hessian of ``loss`` with respect to each parameter, entry by entry."""
    first = torch.autograd.grad(loss, params, create_graph=True)
    diagonals = []
    for p, g in zip(params, first):
        flat, diag = g.reshape(-1), torch.zeros(p.numel(), dtype=p.dtype)
        for j in range(p.numel()):
            diag[j] = torch.autograd.grad(flat[j], p, retain_graph=True)[0].reshape(-1)[j]
        diagonals.append(diag.reshape(p.shape))
    return diagonals


def curvature_references(grads, diagonals, epsilon: float = 1e-7) -> dict[str, object]:
    """HessTrace ``[sum_j c_pj]`` and TICDiag ``sum_j ((1/B) sum_i g_ij^2) / (c_j + eps)`` (QUANTITIES.md §7)."""
    second_moment = torch.cat([(g**2).mean(0).reshape(-1) for g in grads])
    c = torch.cat([d.reshape(-1) for d in diagonals])
    return {
        "HessTrace": [float(d.sum()) for d in diagonals],
        "TICDiag": float((second_moment / (c + epsilon)).sum()),
    }


def reference(grads, losses, hist: bool = False, diagonals=None) -> dict[str, object]:
    """Every checked quantity of one tracked step from its rows' ``g_i`` and ``l_i``."""
    values = gradient_statistics(grads)
    values["Loss"] = sum(losses) / len(losses)
    values["BatchSize"] = len(losses)
    if hist:
        values["GradHist1d"] = histogram_counts(grads)
    if diagonals is not None:
        values.update(curvature_references(grads, diagonals))
    return values


# ----------------------------------------------------------------------------------------------------
# assertions


def _close(actual, expected, where: str, rtol: float = RTOL) -> None:
    if isinstance(expected, torch.Tensor):  # histogram counts: exactly equal
        counts = actual["hist"] if isinstance(actual, dict) else actual
        assert torch.equal(torch.as_tensor(counts, dtype=expected.dtype), expected), f"{where}: counts differ"
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: {actual} vs {expected}"
        for k, (a, e) in enumerate(zip(actual, expected)):
            if e == 0.0 and a is None:  # a parameter without gradient may be stored as None
                continue
            _close(a, e, f"{where}[{k}]", rtol)
    else:
        assert actual is not None and math.isclose(float(actual), float(expected), rel_tol=rtol, abs_tol=1e-12), (
            f"{where}: stored {actual!r}, brute force {expected!r}"
        )


def step_checks(cockpit, step: int):
    return cockpit.get_output().get(step, {}).get("checks")


def assert_invalid_checks(checks, where: str) -> None:
    """``checks`` of an invalid step: ``valid is False`` and a non-empty list of ``{"check", "reason"}``."""
    assert isinstance(checks, dict), f"{where}: no value and no checks entry ({checks!r})"
    assert checks.get("valid") is False, f"{where}: no value, but checks['valid'] is {checks.get('valid')!r}"
    failed = checks.get("failed")
    assert isinstance(failed, list) and failed, f"{where}: invalid step without failed checks ({failed!r})"
    for entry in failed:
        assert isinstance(entry, dict), f"{where}: failed check {entry!r} is not a dict"
        assert isinstance(entry.get("check"), str) and entry["check"], f"{where}: failed check without name {entry!r}"
        assert isinstance(entry.get("reason"), str) and entry["reason"], f"{where}: failed check without reason {entry!r}"


def assert_exact_or_invalid(cockpit, step: int, name: str, expected, rtol: float = RTOL) -> None:
    """The contract: the stored value equals the brute-force value, or there is no value and the
    step's checks say it is invalid, or a note of the valid step says it was left out and why. A value on a step marked invalid fails too, unless the gradient check
    is the only one that failed and the step's note says the value was kept (a quantity that reads no
    per-sample rows: it must then equal the brute-force value all the same)."""
    values = cockpit.get_output().get(step, {})
    where = f"step {step} {name}"
    checks = values.get("checks")
    if name in values:
        if isinstance(checks, dict) and checks.get("valid") is False:
            kept = [f.get("check") for f in checks.get("failed", [])] == ["gradient"] and any(
                "stored although the step failed the gradient check" in note and name in note.split(" stored")[0]
                for note in checks.get("notes", []))
            assert kept, f"{where}: a value on a step marked invalid ({checks})"
        _close(values[name], expected, where, rtol)
    elif isinstance(checks, dict) and checks.get("valid") is True:
        # a valid step may leave a per-sample quantity out, where a note names it and says why (rows that are not
        # the samples', a loss that reaches the parameters around the module calls)
        left = [note for note in checks.get("notes", []) if " left out: " in note and name in note.split(" left out: ")[0]]
        assert left, f"{where}: no value, but checks['valid'] is True and no note leaves it out ({checks})"
    else:
        assert_invalid_checks(checks, where)


def assert_exact(cockpit, step: int, name: str, expected, rtol: float = RTOL) -> None:
    """Stricter: the value is there and equals the brute-force value (the issue demands numbers)."""
    values = cockpit.get_output().get(step, {})
    assert name in values, f"step {step}: no {name} stored (checks: {values.get('checks')!r})"
    _close(values[name], expected, f"step {step} {name}", rtol)


def assert_step(cockpit, step: int, expected: dict[str, object], strict: bool = False) -> None:
    check = assert_exact if strict else assert_exact_or_invalid
    for name, value in expected.items():
        check(cockpit, step, name, value)
