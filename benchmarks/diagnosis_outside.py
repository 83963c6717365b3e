"""Runs in neither half of the corpus: the issue's examples, written out as a new user would (longer
runs, other sizes, the user's own loop), diagnosed live with the economy preset.

    python benchmarks/diagnosis_outside.py

Prints one line per run: what it is, whether it trained (its own loss), and the incidents of severity
warning or above (cause, step). Nothing here sets a threshold.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


class _Tokens(nn.Module):
    """A small transformer language model with N(0, 1) token and position embeddings."""

    def __init__(self, vocab=20, length=16, width=32):
        super().__init__()
        self.tokens, self.position = nn.Embedding(vocab, width), nn.Embedding(length, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("causal", torch.triu(torch.full((length, length), -math.inf), 1))

    def forward(self, x):
        h = self.tokens(x) + self.position(torch.arange(x.shape[1]))
        return self.head(self.encoder(h, mask=self.causal[: x.shape[1], : x.shape[1]]))


class _ReluRNN(nn.Module):
    def __init__(self, scale=1.8, width=24):
        super().__init__()
        self.inp, self.rec, self.act, self.out = nn.Linear(3, width), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4)
        with torch.no_grad():
            q, _ = torch.linalg.qr(torch.randn(width, width))
            self.rec.weight.copy_(scale * q)

    def forward(self, x):
        h = torch.zeros(x.shape[0], self.rec.in_features)
        for t in range(x.shape[1]):
            h = self.act(self.inp(x[:, t]) + self.rec(h))
        return self.out(h)


def _cnn():
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(256, 10))


def _mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def run_case(name, model, make_opt, steps, batch, data, schedule=None, softmax=False, zero_grad=True,
             freeze=None, lm=False):
    from cockpit_like import Cockpit
    from cockpit_like.diagnosis import group_findings
    from cockpit_like.diagnosis.findings import severity_rank
    from cockpit_like.utils.configuration import configuration

    torch.manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_opt(params)
    scheduler = schedule(optimizer) if schedule else None
    cockpit = Cockpit(params, quantities=configuration("economy"), model=model, diagnose=True)
    x_all, y_all = data
    generator = torch.Generator().manual_seed(1)
    losses, started = [], time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            if freeze is not None and step == freeze[0]:
                for p in freeze[1]:  # the accidental freeze: these stop being trained (left out of the step)
                    optimizer.param_groups[0]["params"] = [q for q in optimizer.param_groups[0]["params"] if q is not p]
            rows = torch.randint(0, len(x_all), (batch,), generator=generator)
            x = x_all[rows]
            y = x[:, 1:] if lm else y_all[rows]
            x = x[:, :-1] if lm else x
            if zero_grad:
                optimizer.zero_grad()
            out = model(x)
            if softmax:
                out = out.softmax(-1)
            per = nn.functional.cross_entropy(out.transpose(1, 2) if lm else out, y, reduction="none")
            per = per.mean(1) if lm else per
            loss = per.mean()
            losses.append(float(loss))
            with cockpit(step, info={"loss": loss, "batch_size": batch, "optimizer": optimizer,
                                     "individual_losses": per}):
                loss.backward()
            optimizer.step()
            if scheduler:
                scheduler.step()
    loud = [i for i in group_findings(cockpit.findings) if severity_rank(i.severity) >= 1]
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    causes = ", ".join(f"{i.cause} at {i.step} ({i.severity})" for i in loud) or "nothing"
    print(f"{name:58s} loss {first:.3g} -> {last:.3g}; {time.perf_counter() - started:.0f} s; {causes}", flush=True)
    return loud


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the models are built in this order: their initialization is reproducible
    x, y = _digits()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (1024, 17), generator=generator)
    tokens[:, 1::2] = (tokens[:, 0:-1:2] * 3 + 1) % 20  # every second token follows from the one before
    sequences = torch.randn(512, 12, 3, generator=generator)
    sequence_labels = (sequences[:, :, 0].sum(1) > 0).long() + 2 * (sequences[:, -1, 1] > 0).long()
    print("healthy runs (the issue's examples, rebuilt)")
    run_case("CNN, AdamW, cosine to 0 over 300 steps", _cnn(), lambda p: torch.optim.AdamW(p, 3e-3), 300, 32, (x, y),
             schedule=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 300, eta_min=0.0))
    run_case("transformer LM, Adam, 30 warm-up steps, N(0,1) embeddings", _Tokens(), lambda p: torch.optim.Adam(p, 1e-3),
             200, 32, (tokens, None), schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 30)),
             lm=True)
    run_case("MLP, RMSprop 1e-3, batch 16", _mlp(), lambda p: torch.optim.RMSprop(p, 1e-3), 250, 16, (x, y))
    run_case("CNN, SGD momentum, x0.1 at steps 100 and 200", _cnn(), lambda p: torch.optim.SGD(p, 0.05, momentum=0.9),
             300, 32, (x, y), schedule=lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [100, 200], 0.1))
    print("broken runs")
    run_case("ReLU RNN, recurrent weights 1.8 x orthogonal (exploding)", _ReluRNN(), lambda p: torch.optim.SGD(p, 0.01),
             150, 32, (sequences, sequence_labels))
    run_case("MLP, SGD momentum, optimizer.zero_grad() forgotten", _mlp(), lambda p: torch.optim.SGD(p, 0.01, momentum=0.9),
             150, 32, (x, y), zero_grad=False)
    run_case("CNN, Adam, softmax before CrossEntropyLoss", _cnn(), lambda p: torch.optim.Adam(p, 1e-3), 150, 32, (x, y),
             softmax=True)
    model = _mlp()
    run_case("MLP, Adam, two layers dropped from the optimizer at step 40", model, lambda p: torch.optim.Adam(p, 1e-3),
             150, 32, (x, y), freeze=(40, list(model[0].parameters()) + list(model[2].parameters())))


if __name__ == "__main__":
    main()
