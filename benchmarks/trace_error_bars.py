#!/usr/bin/env python
"""Are HessTrace's error bars honest? Coverage of the exact trace by value ± 2 / 3 standard errors, over seeds.

On models BackPACK cannot handle HessTrace estimates the trace from 4
Hessian-vector products (Hutchinson, or Hutch++ on the step's Lanczos space)
and keeps a standard error beside the value. This script measures, per model
and step, over ``--seeds`` seeds of the cockpit (the same parameters and
batch, only the cockpit's draws change), how often the exact trace (float64,
``D`` products on unit vectors: ``trace_estimators.exact_hessian_facts``)
lies within 2 and 3 standard errors of the value, for the standard errors
of the same draws:

- ``sample``: the samples' standard deviation over ``sqrt(4)`` (before);
- ``sample, t3``: the same with Student-t quantiles for 3 degrees of freedom
  (the 95.45% / 99.73% of 2 / 3 Gaussian standard errors: 3.31 and 9.22);
- ``products``: the bound ``sqrt(2 mean_k ||A v_k||^2 / 4)`` from the
  products' squared norms alone (``A`` the Hessian, or the deflated one);
- ``max``: the larger of ``sample`` and ``products`` (what the cockpit stores).

Width: the median over a model's steps of the median standard error over
seeds divided by the spread of the values over the seeds (their standard
deviation), times the 2-error band's half-width over 2 (1 for all but
``sample, t3``: 1.65): 1 is an error bar as wide as the estimator's actual
error, above 1 wider.

Two sets of models: the 12 of ``benchmarks/trace_estimators.py``, on which
the choice was made (dev), and 6 others, not looked at before it (held-out).

    python benchmarks/trace_error_bars.py --json benchmarks/results/trace_error_bars.json --docs docs/curvature.md

(about 7 minutes on one CPU thread; the smoke test runs one held-out model:
``tests/test_trace_estimators.py``.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

BEGIN, END = "<!-- trace-error-bars table -->", "<!-- /trace-error-bars table -->"

#: error bars compared: name -> (which standard error, the half-widths in it of the bands "2 / 3 standard errors")
VARIANTS = {
    "sample (before)": ("sample_errors", (2.0, 3.0)),
    "sample, t3 quantiles": ("sample_errors", (3.31, 9.22)),  # Student t_3's quantiles of the normal's 95.45% / 99.73%
    "products": ("product_errors", (2.0, 3.0)),
    "max (after)": ("errors", (2.0, 3.0)),
}
ESTIMATORS = ("hutchinson", "hutch++")
DTYPE = torch.float64


# ---- held-out models (not in the repository's zoo or the dev set) -------------------------------------------------

def _problem(model, features, classes):
    from tests.zoo import Problem, _ce, _classification

    return Problem(model.to(DTYPE), _classification(features, classes), _ce)


class _Swish(torch.autograd.Function):
    """``x * sigmoid(x)`` with its own (differentiable) backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + x * s * (1 - s))


class _SwishLinear(nn.Module):
    """A parameter used through a custom autograd function, twice."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 4) * 0.5)

    def forward(self, x):
        return _Swish.apply(x @ self.weight.T) + _Swish.apply(self.weight).sum(1)


class _Last(nn.Module):
    def __init__(self, rnn, width, classes, norm=False):
        super().__init__()
        self.rnn, self.head = rnn, nn.Linear(width, classes)
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(self.norm(out[:, -1]))


class _Attention(nn.Module):
    def __init__(self, features=4, width=8, heads=2, classes=3):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        h = self.norm(h + self.attention(h, h, h, need_weights=False)[0])
        return self.head(h.mean(1))


def _seeded(build):
    def factory(seed):
        torch.manual_seed(seed)
        return build()

    return factory


def held_out() -> dict:
    return {
        "prelu_channels": _seeded(lambda: _problem(
            nn.Sequential(nn.Conv2d(2, 3, 2), nn.PReLU(3), nn.AdaptiveAvgPool2d(1), nn.Flatten()), (2, 3, 3), 3)),
        "custom_function": _seeded(lambda: _problem(
            nn.Sequential(_SwishLinear(), nn.Tanh(), nn.Linear(5, 3)), (4,), 3)),
        "lstm_2_layers": _seeded(lambda: _problem(_Last(nn.LSTM(3, 5, num_layers=2, batch_first=True), 5, 3), (6, 3), 3)),
        "gru_layernorm": _seeded(lambda: _problem(_Last(nn.GRU(4, 6, batch_first=True), 6, 3, norm=True), (5, 4), 3)),
        "attention": _seeded(lambda: _problem(_Attention(), (5, 4), 3)),
        "depthwise_silu": _seeded(lambda: _problem(
            nn.Sequential(nn.Conv2d(3, 3, 3, groups=3, padding=1), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(3, 4)), (3, 5, 5), 4)),
    }


def dev() -> dict:
    from benchmarks.trace_estimators import models

    return models()


# ---- the measurement ----------------------------------------------------------------------------------------------

def _estimates(name, factory, state, inputs, targets, step, seed) -> dict:
    """``{estimator: {"value", "errors", "sample_errors", "product_errors"}}`` (trace errors) of one cockpit seed."""
    from benchmarks.trace_estimators import _track_once
    from cockpit_like.backends import randomness
    from cockpit_like.quantities import HessTrace
    from cockpit_like.utils import schedules

    randomness.set_seed(seed)
    try:
        problem = factory(0)
        problem.model.load_state_dict(state)
        params = [p for p in problem.model.parameters() if p.requires_grad]
        quantities = {method: HessTrace(schedules.linear(1), curvature=method) for method in ESTIMATORS}
        _track_once(name, problem, problem.model, params, inputs, targets, len(inputs), step, list(quantities.values()))
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    out = {}
    for method, quantity in quantities.items():
        errors = quantity._errors  # the step's result: the stored errors and the two they are the larger of
        out[method] = {"value": sum(quantity.get_output()[step]), "errors": quantity.total_errors[step],
                       "sample_errors": errors["sample_errors"]["trace_error"],
                       "product_errors": errors["product_errors"]["trace_error"]}
    return out


def run_model(name, factory, steps: int, batch_size: int, seeds: int) -> list[dict]:
    from benchmarks.trace_estimators import step_reference

    problem, reference = factory(0), factory(0)
    model, twin = problem.model, reference.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    rows = []
    for step in range(steps):
        inputs, targets, state, facts = step_reference(problem, reference, model, twin, batch_size, step)
        exact = sum(facts["traces"])
        draws = [_estimates(name, factory, state, inputs, targets, step, 1000 + seed) for seed in range(seeds)]
        rows.append({"model": name, "step": step, "dimension": sum(p.numel() for p in params), "exact_trace": exact,
                     "hutchinson_exact_error": (2 * (facts["frobenius2"] - facts["diagonal2"]) / 4) ** 0.5,
                     "seeds": {method: [d[method] for d in draws] for method in ESTIMATORS}})
        optimizer.zero_grad()  # the next step's parameters: one plain SGD step on this batch
        problem.sample_losses(problem.forward(model, inputs), targets).mean().backward()
        optimizer.step()
    return rows


def summary(rows: list[dict]) -> dict:
    """``{estimator: {variant: {"within_2", "within_3", "width", "worst_z", "reliable"}}}`` over all draws, and per model."""
    out = {}
    for method in ESTIMATORS:
        out[method] = {}
        for variant, (key, (two, three)) in VARIANTS.items():
            draws = [(d, r["exact_trace"]) for r in rows for d in r["seeds"][method]]
            widths = {}
            for r in rows:
                values = [d["value"] for d in r["seeds"][method]]
                spread = statistics.stdev(values)
                widths.setdefault(r["model"], []).append(
                    two / 2 * statistics.median(d[key] for d in r["seeds"][method]) / spread if spread else float("nan"))
            per_model = {}
            for r in rows:
                entry = per_model.setdefault(r["model"], [])
                entry += [(d, r["exact_trace"]) for d in r["seeds"][method]]
            z = [abs(d["value"] - e) / d[key] if d[key] else float("inf") for d, e in draws]
            out[method][variant] = {
                "draws": len(draws),
                "within_2": sum(abs(d["value"] - e) <= two * d[key] for d, e in draws) / len(draws),
                "within_3": sum(abs(d["value"] - e) <= three * d[key] for d, e in draws) / len(draws),
                "width": statistics.median(statistics.median(w) for w in widths.values()),
                "worst_z": max(z),
                "reliable": sum(abs(d["value"]) > two * d[key] for d, _ in draws) / len(draws),
                "worst_model_within_2": min(
                    (sum(abs(d["value"] - e) <= two * d[key] for d, e in these) / len(these), model)
                    for model, these in per_model.items()),
            }
    return out


def markdown(sets: dict[str, list[dict]], header: str) -> str:
    lines = [header, "",
             "| models | estimator | error bar | exact within 2 / 3 standard errors | worst model within 2 | worst |value − exact| / error | median width (error / spread over seeds) | reliable |",
             "|---|---|---|---|---|---|---|---|"]
    for label, rows in sets.items():
        s = summary(rows)
        for method in ESTIMATORS:
            for variant, v in s[method].items():
                share, model = v["worst_model_within_2"]
                lines.append(f"| {label} ({len({r['model'] for r in rows})} models, {v['draws']} draws) | {method} | {variant} "
                             f"| {100 * v['within_2']:.1f}% / {100 * v['within_3']:.1f}% | {100 * share:.0f}% ({model}) "
                             f"| {v['worst_z']:.3g} | {v['width']:.2f} | {100 * v['reliable']:.0f}% |")
    lines += ["", "Per model (all its steps and seeds): the exact trace within 2 / 3 standard errors, and the worst "
              "|value − exact| / error, before (the samples' standard error) → after (the larger of it and the bound).", "",
              "| models | model | D | hutchinson: within 2 / 3 | hutchinson: worst | hutch++: within 2 / 3 | hutch++: worst |",
              "|---|---|---|---|---|---|---|"]
    for label, rows in sets.items():
        for model in dict.fromkeys(r["model"] for r in rows):
            these = [r for r in rows if r["model"] == model]
            cells = []
            for method in ESTIMATORS:
                shown = []
                for key in ("sample_errors", "errors"):
                    draws = [(d, r["exact_trace"]) for r in these for d in r["seeds"][method]]
                    z = [abs(d["value"] - e) / d[key] if d[key] else float("inf") for d, e in draws]
                    shown.append((sum(v <= 2 for v in z) / len(z), sum(v <= 3 for v in z) / len(z), max(z)))
                (b2, b3, bz), (a2, a3, az) = shown
                cells += [f"{100 * b2:.0f}% / {100 * b3:.0f}% → {100 * a2:.0f}% / {100 * a3:.0f}%", f"{bz:.3g} → {az:.3g}"]
            lines.append(f"| {label} | {model} | {these[0]['dimension']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=20, help="cockpit seeds per step of a dev model")
    parser.add_argument("--held-out-seeds", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4, help="the dev models' (as benchmarks/trace_estimators.py)")
    parser.add_argument("--held-out-batch-size", type=int, default=6)
    parser.add_argument("--sets", default="dev,held-out", help="dev, held-out or both (comma-separated)")
    parser.add_argument("--only", default=None, help="comma-separated substrings of model names")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=None, help="rewrite the table between the markers in this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    started = time.time()
    sets, failures = {}, []
    for label in args.sets.split(","):
        chosen = {"dev": dev, "held-out": held_out}[label]()
        if args.only:
            chosen = {k: v for k, v in chosen.items() if any(part in k for part in args.only.split(","))}
        rows = []
        for name, factory in chosen.items():
            try:
                batch = args.batch_size if label == "dev" else args.held_out_batch_size
                seeds = args.seeds if label == "dev" else args.held_out_seeds
                got = run_model(name, factory, args.steps, batch, seeds)
            except Exception as error:  # noqa: BLE001 - reported
                failures.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                print("FAILED", failures[-1], flush=True)
                continue
            rows += got
            print(label, name, f"{time.time() - started:.0f}s", flush=True)
        sets[label] = rows
    for label, rows in sets.items():
        if rows:
            print(label, json.dumps(summary(rows), indent=1))
    header = (f"Regenerated by `python benchmarks/trace_error_bars.py --docs docs/curvature.md` ({args.steps} steps, "
              f"batch {args.batch_size} and {args.seeds} cockpit seeds per step (dev), {args.held_out_batch_size} and "
              f"{args.held_out_seeds} (held-out), 4 samples, torch {torch.__version__}, "
              f"{time.time() - started:.0f} s).")
    if failures:
        header += " Could not run: " + "; ".join(failures) + "."
    if args.json:
        args.json.write_text(json.dumps({"sets": sets, "summary": {k: summary(v) for k, v in sets.items() if v},
                                         "failures": failures}, indent=1))
    if args.docs:
        text = args.docs.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{args.docs}: no {BEGIN} ... {END} markers")
        head, rest = text.split(BEGIN, 1)
        args.docs.write_text(f"{head}{BEGIN}\n{markdown({k: v for k, v in sets.items() if v}, header)}{END}"
                             f"{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
