"""Evidence runs: each rule fires on a short run built to show its problem; healthy runs stay quiet.

Small MLPs on scikit-learn's digits in float64 on the CPU, a few dozen steps
each, with the cockpit diagnosing live (``Cockpit(..., diagnose=True)``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit, read_log
from cockpit_like.cli import main
from cockpit_like.diagnosis import findings_in
from cockpit_like.diagnosis.findings import severity_rank
from cockpit_like.quantities import ActivationStats, Alpha, GradNorm, HessMaxEV, Loss, NormTest, ParamNorm, UpdateSize
from cockpit_like.utils.schedules import linear

DTYPE = torch.float64


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data, dtype=DTYPE) / 16.0, torch.tensor(data.target)


def mlp(widths, activation, std=None, hidden_bias=None, seed=0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for index, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        linear_layer = nn.Linear(fan_in, fan_out).to(DTYPE)
        hidden = index < len(widths) - 2
        with torch.no_grad():
            if std is not None:
                linear_layer.weight.normal_(0.0, std)
            if hidden_bias is not None and hidden:
                linear_layer.bias.fill_(hidden_bias)
        layers.append(linear_layer)
        if hidden:
            layers.append(activation())
    return nn.Sequential(*layers)


class Exp(nn.Module):
    """A custom layer whose output overflows when its input grows."""

    def forward(self, x):
        return torch.exp(x)


def run(data, model, lr=0.1, steps=25, batch=32, optimizer=None, mse=False, fixed_batch=False, hessian=False,
        valid=None, log_every=5, trainable=None, path=None, freeze=None):
    """Train with every quantity the rules read; return the cockpit (diagnosing live).

    ``hessian``: also track HessMaxEV (True: every 5th step; or a schedule). ``freeze``: ``{step: parameters}``
    set to ``requires_grad=False`` before that step's forward pass.
    """
    inputs, labels = data
    quantities = [Loss(linear(1)), GradNorm(linear(1)), UpdateSize(linear(1)), ParamNorm(linear(1)),
                  Alpha(linear(1)), NormTest(linear(1)), ActivationStats(linear(1))]
    if hessian:
        quantities.append(HessMaxEV(hessian if callable(hessian) else linear(5)))
    cockpit = Cockpit(list(model.parameters()), quantities=quantities, model=model, diagnose=True, stream_to=path)
    optimizer = optimizer or torch.optim.SGD(trainable or model.parameters(), lr=lr)
    if mse:
        def lossfunc(outputs, targets, reduction="mean"):
            errors = (outputs - nn.functional.one_hot(targets, 10).to(DTYPE)) ** 2
            return errors.mean() if reduction == "mean" else errors.mean(dim=1)
    else:
        def lossfunc(outputs, targets, reduction="mean"):
            return nn.functional.cross_entropy(outputs, targets, reduction=reduction)
    generator = torch.Generator().manual_seed(0)
    order = torch.randint(0, len(labels), (batch,), generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-finite losses warn by design
        for step in range(steps):
            if not fixed_batch and step:
                order = torch.randint(0, len(labels), (batch,), generator=generator)
            x, y = inputs[order], labels[order]
            for param in (freeze or {}).get(step, ()):
                param.requires_grad_(False)
            model.zero_grad()
            outputs = model(x)
            loss = lossfunc(outputs, y)
            info = {"batch_size": batch, "loss": loss, "individual_losses": lossfunc(outputs, y, "none"),
                    "optimizer": optimizer}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            if log_every and step % log_every == log_every - 1:
                figures = {"learning_rate": optimizer.param_groups[0]["lr"], "train_loss": loss.item()}
                if valid is not None:
                    with torch.no_grad():
                        figures["train_loss"] = lossfunc(model(inputs), labels).item()
                        figures["valid_loss"] = lossfunc(model(valid[0]), valid[1]).item()
                cockpit.log(step, **figures)
    return cockpit


def rules_of(cockpit, least="info") -> set[str]:
    return {f.rule for f in cockpit.findings if severity_rank(f.severity) >= severity_rank(least)}


def layers_of(cockpit, rule) -> set[str]:
    return {f.layer for f in cockpit.findings if f.rule == rule}


# ---- problems ---------------------------------------------------------------------------------------
def test_learning_rate_far_too_large_diverges(digits, tmp_path):
    # the top eigenvalue at each of the first 8 steps (later it turns negative as the net saturates)
    cockpit = run(digits, mlp([64, 32, 10], nn.Tanh), lr=3.0, mse=True, hessian=lambda step: step < 8,
                  path=tmp_path / "run")
    found = rules_of(cockpit)
    assert {"loss-diverging", "exploding-gradient", "update-ratio-too-large", "step-overshoots",
            "sharpness-above-stability"} <= found
    assert {"loss-not-decreasing", "step-too-short", "noise-dominated"}.isdisjoint(found)
    # issue 36: reported as a warning, and again as an error once the divergence is sustained
    assert [f.severity for f in cockpit.findings if f.rule == "loss-diverging"] == ["warning", "error"]
    cockpit.close()
    assert main(["diagnose", str(tmp_path / "run.jsonl")]) == 1  # the CI-style exit status


def test_nonfinite_loss_from_an_overflowing_layer(digits):
    model = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10), Exp()).to(DTYPE)
    torch.manual_seed(0)
    cockpit = run(digits, model, lr=5.0, steps=8)
    (nonfinite,) = [f for f in cockpit.findings if f.rule == "nonfinite-loss"]
    losses = {s: v["Loss"] for s, v in cockpit.get_output().items() if "Loss" in v}
    first_bad = min(s for s, v in losses.items() if v != v)
    assert nonfinite.severity == "error" and nonfinite.step == first_bad
    # the gradient exploded (a warning, steps before the NaN) and became NaN: one finding per (rule, layer)
    assert any(f.rule == "exploding-gradient" and f.step < first_bad for f in cockpit.findings)


def test_learning_rate_far_too_small_stalls(digits):
    cockpit = run(digits, mlp([64, 32, 10], nn.ReLU), lr=1e-4, batch=128, fixed_batch=True, steps=40)
    assert {"loss-not-decreasing", "step-too-short", "update-ratio-too-small"} <= rules_of(cockpit)
    assert {"loss-diverging", "step-overshoots", "update-ratio-too-large"}.isdisjoint(rules_of(cockpit))


def test_deep_sigmoid_with_tiny_weights_vanishes(digits):
    cockpit = run(digits, mlp([64] + [32] * 6 + [10], nn.Sigmoid, std=0.01), lr=0.05, steps=12)
    assert {"vanishing-gradient", "poor-initialization"} <= rules_of(cockpit)
    assert "0.weight" in layers_of(cockpit, "vanishing-gradient")  # the first layer, farthest from the loss
    assert "12.weight" not in layers_of(cockpit, "vanishing-gradient")


def test_deep_tanh_with_large_weights_saturates(digits):
    cockpit = run(digits, mlp([64] + [32] * 6 + [10], nn.Tanh, std=2.0), lr=0.05, steps=12)
    assert {"1", "3", "5", "7", "9", "11"} <= layers_of(cockpit, "saturated-units")
    assert "dead-units" not in rules_of(cockpit)


def test_relu_with_a_large_negative_bias_dies(digits):
    cockpit = run(digits, mlp([64, 32, 32, 10], nn.ReLU, hidden_bias=-5.0), lr=0.1, steps=12)
    assert layers_of(cockpit, "dead-units") == {"1", "3"}
    assert "saturated-units" not in rules_of(cockpit)


def test_tiny_batch_is_noise_dominated(digits):
    cockpit = run(digits, mlp([64, 32, 10], nn.ReLU), lr=0.05, steps=30, batch=2)
    (noise, *_) = [f for f in cockpit.findings if f.rule == "noise-dominated"]
    assert noise.severity == "info" and noise.evidence["batch_factor"] > 1


def test_frozen_layer_does_not_change(digits):
    model = mlp([64, 32, 10], nn.ReLU)
    cockpit = run(digits, model, lr=0.2, steps=12, trainable=list(model[2].parameters()))
    assert layers_of(cockpit, "unchanged-parameters") == {"0.weight", "0.bias"}


def test_layers_frozen_mid_run_are_named_frozen_live_and_from_the_log(digits, tmp_path):
    """``requires_grad=False`` from step 8 on: the rules read the step's checks (``checks["frozen"]``) and say so,
    the grouped diagnosis names a frozen layer (not a learning rate or dead units, which the zero gradient alone
    would suggest), and the log gives the same findings."""
    from cockpit_like.diagnosis import diagnose_log, group_findings

    model = mlp([64, 32, 32, 10], nn.ReLU)
    cockpit = run(digits, model, lr=0.2, steps=16, freeze={8: list(model[0].parameters())}, path=tmp_path / "run")
    frozen = [f for f in cockpit.findings if f.rule == "unchanged-parameters"]
    assert {f.layer for f in frozen} == {"0.weight", "0.bias"}
    assert all(f.evidence["frozen"] and f.evidence["since"] == 8 for f in frozen)
    assert "requires_grad=False since step 8" in frozen[0].message
    assert not [f for f in cockpit.findings if f.rule == "vanishing-gradient" and f.layer.startswith("0.")]
    warned = [i for i in group_findings(cockpit.findings) if severity_rank(i.severity) >= 1]
    assert [(i.cause, i.step) for i in warned] == [("frozen-layer", 8)]
    cockpit.close()
    replayed = [f for f in diagnose_log(tmp_path / "run.jsonl", stored=False).findings if f.rule == "unchanged-parameters"]
    assert [(f.step, f.layer, f.message) for f in replayed] == [(f.step, f.layer, f.message) for f in frozen]


def test_layers_frozen_from_the_start_are_left_alone(digits):
    """Fine-tuning: parameters with ``requires_grad=False`` from the first step are frozen on purpose."""
    model = mlp([64, 32, 32, 10], nn.ReLU)
    for param in model[0].parameters():
        param.requires_grad_(False)
    cockpit = run(digits, model, lr=0.2, steps=16)
    assert not [f for f in cockpit.findings if f.layer and f.layer.startswith("0.")]
    assert cockpit.checks[15]["frozen"] == ["0.weight", "0.bias"]


def test_label_noise_overfits(digits):
    inputs, labels = digits
    generator = torch.Generator().manual_seed(1)
    train_x, train_y = inputs[:48], labels[:48].clone()
    noisy = torch.rand(48, generator=generator) < 0.6
    train_y[noisy] = torch.randint(0, 10, (int(noisy.sum()),), generator=generator)
    model = mlp([64, 256, 10], nn.ReLU)
    cockpit = run((train_x, train_y), model, steps=40, batch=48, fixed_batch=True, log_every=2,
                  valid=(inputs[1000:1400], labels[1000:1400]),
                  optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    (overfit,) = [f for f in cockpit.findings if f.rule == "overfitting"]
    assert overfit.evidence["valid"] > 1.1 * overfit.evidence["best_valid"]
    assert overfit.evidence["train_now"] < overfit.evidence["train_then"]


# ---- healthy runs ----------------------------------------------------------------------------------------
def test_healthy_relu_sgd(digits):
    cockpit = run(digits, mlp([64, 32, 10], nn.ReLU), lr=0.2, steps=40, hessian=True)
    assert rules_of(cockpit, least="warning") == set()


def test_healthy_tanh_adam(digits):
    model = mlp([64, 32, 32, 10], nn.Tanh)
    cockpit = run(digits, model, steps=40, optimizer=torch.optim.Adam(model.parameters(), lr=0.01))
    assert rules_of(cockpit, least="warning") == set()


@pytest.mark.slow
def test_demo_run_is_healthy(tmp_path, capsys):
    from cockpit_like.demo import main as demo

    written = demo(["--no-plot", "--out", str(tmp_path / "digits")])
    steps = read_log(written["log"])
    stored = findings_in(steps)
    assert all(f.severity == "info" for f in stored), [(f.rule, f.severity) for f in stored]
    assert findings_in(read_log(written["stream"])) == stored
    assert main(["diagnose", written["log"]]) == 0
    text = capsys.readouterr().out
    assert "0 errors, 0 warnings" in text


class Maxout(nn.Module):
    """A Maxout layer: the largest of ``pieces`` linear maps (no activation module ``ActivationStats`` watches)."""

    def __init__(self, fan_in, fan_out, pieces=3, std=None):
        super().__init__()
        self.pieces, self.linear = pieces, nn.Linear(fan_in, fan_out * pieces).to(DTYPE)
        if std is not None:
            with torch.no_grad():
                self.linear.weight.normal_(0.0, std)

    def forward(self, x):
        return self.linear(x).unflatten(-1, (-1, self.pieces)).amax(-1)


def maxout_net(std=None, depth=5, width=32, seed=0):
    torch.manual_seed(seed)
    widths = [64] + [width] * (depth - 1)
    layers = [Maxout(a, b, std=std) for a, b in zip(widths[:-1], widths[1:])]
    return nn.Sequential(*layers, nn.Linear(width, 10).to(DTYPE))


def test_a_maxout_net_initialized_far_too_large_is_named_an_initialization_not_a_learning_rate(digits):
    """Round 11 (outside trial 15's B03): 5 Maxout layers with weights of std 3 put out values of about 1e6
    at step 0, before any update; the first update blows up at a normal learning rate. The outputs at step 0
    name the initialization first (it was a learning rate too large); the default initialization is quiet."""
    from cockpit_like.diagnosis import group_findings

    cockpit = run(digits, maxout_net(std=3.0), lr=0.01, steps=6)
    (found,) = [f for f in cockpit.findings if f.rule == "poor-initialization"]
    assert found.step == 0 and found.evidence["ratio"] > 1e3
    incidents = [i for i in group_findings(cockpit.findings) if severity_rank(i.severity) >= severity_rank("warning")]
    assert incidents[0].cause == "poor-initialization"
    healthy = run(digits, maxout_net(), lr=0.01, steps=6)
    assert "poor-initialization" not in rules_of(healthy)


class SharedReLUNet(nn.Module):
    """Layers each called once, one nn.ReLU module after every one of them (a TabNet's, a PixelCNN's pattern)."""

    def __init__(self, std, depth=5, width=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        widths = [64] + [width] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b).to(DTYPE) for a, b in zip(widths[:-1], widths[1:]))
        self.act, self.head = nn.ReLU(), nn.Linear(width, 10).to(DTYPE)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.normal_(0.0, std)

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return self.head(x)


class WrittenOutRNN(nn.Module):
    """A ReLU recurrence over the 8 rows of a digit, its recurrent weight `scale` x an orthogonal matrix."""

    def __init__(self, scale, width=24, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.rec, self.act = nn.Linear(8, width).to(DTYPE), nn.Linear(width, width).to(DTYPE), nn.ReLU()
        self.out = nn.Linear(width, 10).to(DTYPE)
        with torch.no_grad():
            q, _ = torch.linalg.qr(torch.randn(width, width, dtype=DTYPE))
            self.rec.weight.copy_(scale * q)

    def forward(self, x):
        h = torch.zeros(x.shape[0], self.rec.in_features, dtype=x.dtype)
        for t in range(8):
            h = self.act(self.inp(x[:, 8 * t : 8 * t + 8]) + self.rec(h))
        return self.out(h)


def test_one_activation_module_reused_through_depth_is_not_a_recurrence(digits):
    """Round 13 (outside trials 20 and 22: a TabNet, a PixelCNN and an ECG CNN initialized far too large, each with
    one nn.ReLU after every layer): the ReLU's several calls per sample were read as a recurrence, and the first cause
    was an exploding gradient with advice about recurrent weights. ActivationStats now tells whether a module with
    weights runs more often than another (a recurrent cell does); here none does, and the initialization is named.
    A written-out recurrence with recurrent weights 3x orthogonal is still named an exploding gradient."""
    from cockpit_like.diagnosis import group_findings

    def first_cause(cockpit):
        incidents = [i for i in group_findings(cockpit.findings) if severity_rank(i.severity) >= severity_rank("warning")]
        return incidents[0].cause if incidents else None

    deep = run(digits, SharedReLUNet(std=2.0), lr=0.01, steps=4)
    assert "exploding-recurrence" not in rules_of(deep)
    assert first_cause(deep) == "poor-initialization"
    stats = [f for f in deep.findings if f.rule == "poor-initialization"]
    assert stats and stats[0].step == 0
    recurrent = run(digits, WrittenOutRNN(scale=3.0), lr=0.01, steps=4)
    assert "exploding-recurrence" in rules_of(recurrent)
    assert first_cause(recurrent) == "exploding-gradient"
