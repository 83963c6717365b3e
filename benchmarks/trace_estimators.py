#!/usr/bin/env python
"""HessTrace / TICTrace on models BackPACK cannot handle: the estimators against exact traces (issue 37, item 4).

On each model (float64, the cockpit with ``model=model``, a few SGD steps) three
HessTrace instances and two TICTrace instances are tracked at once:

- ``hutchinson``: Hutchinson's diagonal from ``hutchinson_samples = 4`` products
  (the ``"auto"`` choice where BackPACK cannot run), with its standard error;
- ``hutch++``: exact on the step's Lanczos space (the engine's decomposition,
  shared with HessMaxEV) plus Hutchinson on the rest from 4 products
  (:class:`~cockpit_like.backends.curvature_engine.DeflatedDiagonal`), with its
  standard error;

against the exact per-parameter traces ``tr H_pp`` (``D`` Hessian-vector
products on unit vectors of an independent copy of the model) and the exact
TICTrace from them. Reported: the total trace's error relative to the exact
value, how often the exact value lies within 2 and 3 standard errors, and the
TICTrace error.

    python benchmarks/trace_estimators.py --json benchmarks/results/trace_estimators.json --docs docs/curvature.md
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

BEGIN, END = "<!-- trace-estimator table -->", "<!-- /trace-estimator table -->"


def models() -> dict:
    from benchmarks import stop_rule
    from tests.hf_zoo import HF_ZOO
    from tests.zoo import ZOO

    chosen = {f"zoo/{name}": ZOO[name] for name in ("gpt2", "encoder", "layernorm_mlp", "gru", "resnet_groupnorm", "custom")}
    chosen.update({f"hf/{name}": HF_ZOO[name] for name in ("bert", "llama", "vit")})
    chosen.update({"new/convnext": stop_rule._convnext, "new/lstm": stop_rule.lstm, "new/wav2vec2": stop_rule._hf_audio})
    return chosen


def exact_traces(problem, model, inputs, targets) -> list[float]:
    from benchmarks.stop_rule import _math_attention

    params = [p for p in model.parameters() if p.requires_grad]
    with _math_attention():
        loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
        grads = torch.autograd.grad(loss, params, create_graph=True)
    traces = []
    for p, g in zip(params, grads):
        total = 0.0
        flat = g.reshape(-1)
        for j in range(p.numel()):
            with _math_attention():
                (row,) = torch.autograd.grad(flat[j], p, retain_graph=True, allow_unused=True)
            total += 0.0 if row is None else float(row.reshape(-1)[j])
        traces.append(total)
    return traces


def squared_grad_sum(problem, model, inputs, targets) -> float:
    """``(1/B) sum_i ||g_i||^2`` by a loop over rows (the TIC numerator)."""
    from benchmarks.stop_rule import _math_attention

    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    for i in range(len(inputs)):
        with _math_attention():
            loss = problem.sample_losses(problem.forward(model, inputs[i : i + 1]), targets[i : i + 1]).mean()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        total += sum(float((g**2).sum()) for g in grads if g is not None)
    return total / len(inputs)


def run_model(name, factory, steps: int, batch_size: int) -> list[dict]:
    from cockpit_like import Cockpit
    from cockpit_like.quantities import HessMaxEV, HessTrace, TICTrace
    from cockpit_like.utils import schedules

    problem, reference = factory(0), factory(0)
    model, twin = problem.model, reference.model
    schedule = schedules.linear(1)
    estimators = {
        "hutchinson": (HessTrace(schedule, curvature="hutchinson"), TICTrace(schedule, curvature="hutchinson")),
        "hutch++": (HessTrace(schedule, curvature="hutch++"), TICTrace(schedule, curvature="hutch++")),
    }
    quantities = [q for pair in estimators.values() for q in pair] + [HessMaxEV(schedule)]
    params = [p for p in model.parameters() if p.requires_grad]
    cockpit = Cockpit(params, quantities=quantities, model=model)
    optimizer = torch.optim.SGD(params, lr=0.05)
    rows = []
    for step in range(steps):
        inputs, targets = problem.batch(batch_size, 200 + step)
        twin.load_state_dict(model.state_dict())
        exact = exact_traces(reference, twin, inputs, targets)
        numerator = squared_grad_sum(reference, twin, inputs, targets)
        optimizer.zero_grad()
        outputs = problem.forward(model, inputs)
        losses = problem.sample_losses(outputs, targets)
        loss = losses.mean()
        with cockpit(step, info={"loss": loss, "batch_size": batch_size, "individual_losses": losses.detach()}):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
        for p in params:
            p.grad = None
        total = sum(exact)
        row = {"model": name, "step": step, "dimension": sum(p.numel() for p in params), "exact_trace": total,
               "exact_tic_trace": numerator / (total + 1e-7), "products_lanczos": quantities[-1].hvp_counts[step]}
        for method, (trace, tic) in estimators.items():
            estimate = sum(trace.get_output()[step])
            # the total's own standard error (the samples' sums over all blocks; the blocks are not independent)
            se = float(trace._errors["trace_error"]) if trace._errors else None
            row[method] = {
                "trace": estimate,
                "relative_error": abs(estimate - total) / abs(total),
                "standard_error": se,
                "tic_trace": tic.get_output()[step],
                "tic_relative_error": abs(tic.get_output()[step] - row["exact_tic_trace"]) / abs(row["exact_tic_trace"]),
            }
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for method in ("hutchinson", "hutch++"):
        errors = [r[method]["relative_error"] for r in rows]
        tic = [r[method]["tic_relative_error"] for r in rows]
        z = [abs(r[method]["trace"] - r["exact_trace"]) / r[method]["standard_error"]
             for r in rows if r[method]["standard_error"]]
        out[method] = {
            "steps": len(rows),
            "median_relative_error": statistics.median(errors),
            "max_relative_error": max(errors),
            "median_tic_relative_error": statistics.median(tic),
            "max_tic_relative_error": max(tic),
            "within_2se": sum(v <= 2 for v in z) / len(z) if z else None,
            "within_3se": sum(v <= 3 for v in z) / len(z) if z else None,
        }
    return out


def markdown(rows: list[dict], header: str) -> str:
    s = summary(rows)
    lines = [header, "",
             "| estimator | steps | trace: median / max relative error | exact within 2 / 3 standard errors | TICTrace: median / max relative error |",
             "|---|---|---|---|---|"]
    for method, v in s.items():
        within = "-" if v["within_2se"] is None else f"{100 * v['within_2se']:.0f}% / {100 * v['within_3se']:.0f}%"
        lines.append(f"| {method} | {v['steps']} | {100 * v['median_relative_error']:.1f}% / {100 * v['max_relative_error']:.1f}% "
                     f"| {within} | {100 * v['median_tic_relative_error']:.1f}% / {100 * v['max_tic_relative_error']:.1f}% |")
    lines += ["", "| model | D | step | exact trace | hutchinson (standard error) | hutch++ (standard error) | Lanczos products |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        h, k = r["hutchinson"], r["hutch++"]
        lines.append(f"| {r['model']} | {r['dimension']} | {r['step']} | {r['exact_trace']:.4g} | {h['trace']:.4g} "
                     f"({h['standard_error']:.2g}) | {k['trace']:.4g} ({k['standard_error']:.2g}) | {r['products_lanczos']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--only", default=None, help="comma-separated substrings of model names")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=None, help="rewrite the table between the markers in this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    chosen = models()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if any(part in k for part in args.only.split(","))}
    rows, failures = [], []
    started = time.time()
    for name, factory in chosen.items():
        try:
            got = run_model(name, factory, args.steps, args.batch_size)
        except Exception as error:  # noqa: BLE001 - reported
            failures.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            print("FAILED", failures[-1], flush=True)
            continue
        rows += got
        print(name, [(round(r["exact_trace"], 3), round(r["hutchinson"]["trace"], 3), round(r["hutch++"]["trace"], 3),
                      round(r["hutch++"]["standard_error"] or 0, 3)) for r in got], flush=True)
    print(json.dumps(summary(rows), indent=1))
    header = (f"Regenerated by `python benchmarks/trace_estimators.py --docs docs/curvature.md` ({len(chosen)} models, "
              f"{args.steps} steps, batch {args.batch_size}, 4 samples each, torch {torch.__version__}, "
              f"{time.time() - started:.0f} s).")
    if failures:
        header += " Could not run: " + "; ".join(failures) + "."
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary(rows), "failures": failures}, indent=1))
    if args.docs:
        text = args.docs.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{args.docs}: no {BEGIN} ... {END} markers")
        head, rest = text.split(BEGIN, 1)
        args.docs.write_text(f"{head}{BEGIN}\n{markdown(rows, header)}{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
