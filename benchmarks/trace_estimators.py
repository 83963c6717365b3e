#!/usr/bin/env python
"""HessTrace, TICDiag and TICTrace on models BackPACK cannot handle: the estimators against exact values (issue 37, item 4).

On each model (float64, the cockpit with ``model=model``, a few SGD steps) at
each step:

- HessTrace and TICTrace (Hessian) with ``hutchinson`` (4 products, the
  ``"auto"`` choice for HessTrace where BackPACK cannot run) and ``hutch++``
  (exact on the step's Lanczos space, Hutchinson on the rest), against the
  exact per-parameter traces (``D`` Hessian-vector products on unit vectors
  of an independent copy of the model, which also give ``||H||_F^2`` and
  ``sum_j H_jj^2``, so Hutchinson's exact variance per sample and the
  samples a given relative standard error takes);
- TICDiag and TICTrace with four curvatures: Hutchinson's Hessian diagonal
  (the old default), the one-draw sampled-label GGN (``"diag_ggn_mc"``), the
  GGN from 4 sketched draws, and ``"auto"`` (the new default: the GGN,
  exact per class for outputs ``[B, C]`` with at most 10 classes, else 4
  sketched draws), against the TIC of the exact GGN diagonal (dense
  Jacobian of the logits, float64), with the spread over the main run and
  ``SEEDS`` more seeds of the cockpit at the same step and parameters.

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


#: models whose loss is the LM loss: the logits of position t predict token t + 1 (the last position is no loss's)
LANGUAGE_MODELS = ("zoo/gpt2", "hf/llama")

#: TIC estimators compared: curvature argument (or "ggn-mc4": the GGN diagonal from 4 sketched draws always)
TIC_ESTIMATORS = {
    "hessian (hutchinson, old default)": "hutchinson",
    "ggn, 1 sampled draw ('diag_ggn_mc')": "diag_ggn_mc",
    "ggn, 4 sketched draws": "ggn-mc4",
    "ggn ('auto', new default)": "auto",
}

#: spread over seeds: the main run and this many more seeds of the cockpit at each step
SEEDS = 4


def loss_logits(name, outputs):
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return logits[:, :-1] if name in LANGUAGE_MODELS else logits


def step_reference(problem, reference, model, twin, batch_size: int, step: int):
    """The step's batch, a copy of ``model``'s state, and the exact facts of its Hessian (on ``twin``, a plain
    copy of ``model`` in ``reference``): ``(inputs, targets, state, facts)``."""
    inputs, targets = problem.batch(batch_size, 200 + step)
    twin.load_state_dict(model.state_dict())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return inputs, targets, state, exact_hessian_facts(reference, twin, inputs, targets)


def exact_hessian_facts(problem, model, inputs, targets) -> dict:
    """Per-block traces, ``||H||_F^2`` and ``sum_j H_jj^2`` of the mean loss's Hessian (``D`` products on unit
    vectors, float64): Hutchinson's variance per sample of the total is ``2 (||H||_F^2 - sum_j H_jj^2)``."""
    from benchmarks.stop_rule import _math_attention

    params = [p for p in model.parameters() if p.requires_grad]
    with _math_attention():
        loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
        grads = torch.autograd.grad(loss, params, create_graph=True)
    traces, frobenius, diagonal, entries = [], 0.0, 0.0, []
    for index, (p, g) in enumerate(zip(params, grads)):
        total = 0.0
        flat = g.reshape(-1)
        for j in range(p.numel()):
            with _math_attention():
                row = torch.autograd.grad(flat[j], params, retain_graph=True, allow_unused=True)
            frobenius += sum(float((r**2).sum()) for r in row if r is not None)
            entry = 0.0 if row[index] is None else float(row[index].reshape(-1)[j])
            total += entry
            diagonal += entry**2
            entries.append(entry)
        traces.append(total)
    return {"traces": traces, "frobenius2": frobenius, "diagonal2": diagonal,
            "diagonal": torch.tensor(entries, dtype=torch.float64)}


def exact_ggn_diagonal(name, problem, model, inputs) -> torch.Tensor:
    """The GGN diagonal of the mean cross-entropy, ``(1/N) sum_n J_n^T (diag p_n - p_n p_n^T) J_n`` (dense
    Jacobian by a loop over the logits' entries, float64)."""
    from benchmarks.stop_rule import _math_attention

    params = [p for p in model.parameters() if p.requires_grad]
    with _math_attention():
        logits = loss_logits(name, problem.forward(model, inputs))
    flat = logits.reshape(-1, logits.shape[-1])
    rows, classes = flat.shape
    jacobian = []
    for entry in flat.reshape(-1):
        grads = torch.autograd.grad(entry, params, retain_graph=True, allow_unused=True)
        jacobian.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]))
    jacobian = torch.stack(jacobian).reshape(rows, classes, -1)
    probs = torch.softmax(flat.detach(), dim=1)
    hessians = torch.diag_embed(probs) - probs.unsqueeze(2) * probs.unsqueeze(1)
    return torch.einsum("ncd,nce,ned->d", jacobian, hessians, jacobian) / rows


def squared_grads(problem, model, inputs, targets) -> torch.Tensor:
    """``(1/B) sum_i g_i ** 2`` per entry, by a loop over rows (the TIC numerator)."""
    from benchmarks.stop_rule import _math_attention

    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(len(inputs)):
        with _math_attention():
            loss = problem.sample_losses(problem.forward(model, inputs[i : i + 1]), targets[i : i + 1]).mean()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        total += torch.cat([(torch.zeros_like(p) if g is None else g**2).reshape(-1) for p, g in zip(params, grads)])
    return total / len(inputs)


def _tic_quantities(schedule):
    from cockpit_like.backends.sampled import GGNDiagonal
    from cockpit_like.quantities import TICDiag, TICTrace

    def always_sampled(cls):
        class Sampled(cls):  # the GGN diagonal from 4 sketched draws even where 'auto' computes it exactly
            def _need(self, global_step):
                return GGNDiagonal(self._samples, max_classes=0)

        Sampled.__name__ = cls.__name__
        return Sampled(schedule, curvature="ggn")

    made = {}
    for label, curvature in TIC_ESTIMATORS.items():
        if curvature == "ggn-mc4":
            made[label] = (always_sampled(TICDiag), always_sampled(TICTrace))
        elif curvature == "hutchinson":  # the old default, refused by TICDiag since outside trial 35: measured as it was
            refusing_nothing = type("TICDiag", (TICDiag,), {"_refused": {}})
            made[label] = (refusing_nothing(schedule, curvature=curvature), TICTrace(schedule, curvature=curvature))
        else:
            made[label] = (TICDiag(schedule, curvature=curvature), TICTrace(schedule, curvature=curvature))
    return made


def _track_once(name, problem, model, params, inputs, targets, batch_size, step, quantities):
    from cockpit_like import Cockpit

    cockpit = Cockpit(params, quantities=quantities, model=model)
    _tracked_backward(cockpit, name, problem, model, inputs, targets, batch_size, step)
    return cockpit


def _tracked_backward(cockpit, name, problem, model, inputs, targets, batch_size, step):
    """One forward pass and the backward pass inside ``cockpit`` at ``step`` (with the graph if it asks);
    returns the forward pass's outputs."""
    outputs = problem.forward(model, inputs)
    losses = problem.sample_losses(outputs, targets)
    loss = losses.mean()
    info = {"loss": loss, "batch_size": batch_size, "individual_losses": losses.detach(),
            "outputs": loss_logits(name, outputs)}
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    return outputs


def _spread(name, factory, state, inputs, targets, batch_size, step) -> dict:
    """Values of the TIC estimators and of Hutchinson's HessTrace for ``SEEDS`` more seeds of the cockpit."""
    from cockpit_like.backends import randomness
    from cockpit_like.quantities import HessTrace
    from cockpit_like.utils import schedules

    values: dict = {}
    try:
        for seed in range(1, SEEDS + 1):
            randomness.set_seed(seed)
            problem = factory(0)
            problem.model.load_state_dict(state)
            params = [p for p in problem.model.parameters() if p.requires_grad]
            tic = _tic_quantities(schedules.linear(1))
            trace = HessTrace(schedules.linear(1), curvature="hutchinson")
            deflated = HessTrace(schedules.linear(1), curvature="hutch++")
            quantities = [q for pair in tic.values() for q in pair] + [trace, deflated]
            _track_once(name, problem, problem.model, params, inputs, targets, batch_size, step, quantities)
            for label, (diag, tr) in tic.items():
                values.setdefault(label, {"tic_diag": [], "tic_trace": []})
                values[label]["tic_diag"].append(diag.get_output()[step])
                values[label]["tic_trace"].append(tr.get_output()[step])
            values.setdefault("hutchinson_trace", []).append(sum(trace.get_output()[step]))
            values.setdefault("hutch++_trace", []).append(sum(deflated.get_output()[step]))
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    return values


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
    tic = _tic_quantities(schedule)
    quantities = [q for pair in estimators.values() for q in pair] + [q for pair in tic.values() for q in pair]
    quantities.append(HessMaxEV(schedule))
    params = [p for p in model.parameters() if p.requires_grad]
    cockpit = Cockpit(params, quantities=quantities, model=model)
    optimizer = torch.optim.SGD(params, lr=0.05)
    rows = []
    for step in range(steps):
        inputs, targets, state, facts = step_reference(problem, reference, model, twin, batch_size, step)
        exact = facts["traces"]
        squares = squared_grads(reference, twin, inputs, targets)
        ggn = exact_ggn_diagonal(name, reference, twin, inputs)
        numerator = float(squares.sum())
        optimizer.zero_grad()
        outputs = _tracked_backward(cockpit, name, problem, model, inputs, targets, batch_size, step)
        optimizer.step()
        for p in params:
            p.grad = None
        spread = _spread(name, factory, state, inputs, targets, batch_size, step)
        total = sum(exact)
        per_sample_variance = 2 * (facts["frobenius2"] - facts["diagonal2"])
        row = {"model": name, "step": step, "dimension": sum(p.numel() for p in params), "exact_trace": total,
               "hutchinson_sample_std": per_sample_variance**0.5,
               # Hutchinson samples for a standard error of 10% / 50% of |trace|
               "samples_for_10pct": per_sample_variance / (0.1 * total) ** 2,
               "samples_for_50pct": per_sample_variance / (0.5 * total) ** 2,
               "exact_tic_trace": numerator / (total + 1e-7), "products_lanczos": quantities[-1].hvp_counts[step],
               "exact_ggn_tic_diag": float((squares / (ggn + 1e-7)).sum()),
               "exact_ggn_tic_trace": numerator / (float(ggn.sum()) + 1e-7),
               # the old default's own target: the TIC of the exact Hessian diagonal
               "exact_hessian_tic_diag": float((squares / (facts["diagonal"] + 1e-7)).sum()),
               "exact_hessian_tic_trace": numerator / (total + 1e-7),
               "outputs": list(loss_logits(name, outputs).shape),
               "hutchinson_trace_seeds": [sum(estimators["hutchinson"][0].get_output()[step])] + spread["hutchinson_trace"],
               "hutch++_trace_seeds": [sum(estimators["hutch++"][0].get_output()[step])] + spread["hutch++_trace"]}
        for method, (trace, tr) in estimators.items():
            estimate = sum(trace.get_output()[step])
            se = trace.total_errors.get(step)
            row[method] = {
                "trace": estimate,
                "relative_error": abs(estimate - total) / abs(total),
                "standard_error": se,
                "reliable": trace.reliable.get(step),
                "tic_trace": tr.get_output()[step],
                "tic_relative_error": abs(tr.get_output()[step] - row["exact_tic_trace"]) / abs(row["exact_tic_trace"]),
            }
        row["tic"] = {}
        for label, (diag, tr) in tic.items():
            entry = {}
            target = "hessian" if TIC_ESTIMATORS[label] == "hutchinson" else "ggn"
            for key, quantity in (("tic_diag", diag), ("tic_trace", tr)):
                exact_value = row[f"exact_{target}_{key}"]
                value = quantity.get_output()[step]
                seeds = [value] + spread[label][key]
                entry[key] = {
                    "value": value, "standard_error": quantity.standard_errors.get(step), "exact": exact_value,
                    "reliable": quantity.reliable.get(step),
                    "relative_error": abs(value - exact_value) / abs(exact_value),
                    "seeds": seeds,
                    "relative_spread": statistics.stdev(seeds) / abs(exact_value),
                    "positive_share": sum(v > 0 for v in seeds) / len(seeds),
                }
            entry["computed_with"] = diag.settings().get("computed_with")
            row["tic"][label] = entry
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
            "reliable_share": sum(bool(r[method]["reliable"]) for r in rows) / len(rows),
        }
    for method in ("hutchinson", "hutch++"):
        seeds = [r.get(f"{method}_trace_seeds") for r in rows]
        if all(seeds):  # (results files from before the Hutch++ seeds have none)
            out[method]["median_relative_spread"] = statistics.median(
                statistics.stdev(v) / abs(r["exact_trace"]) for v, r in zip(seeds, rows))
    out["hutchinson"]["median_samples_for_10pct"] = statistics.median(r["samples_for_10pct"] for r in rows)
    out["hutchinson"]["median_samples_for_50pct"] = statistics.median(r["samples_for_50pct"] for r in rows)
    out["tic"] = {}
    for label in TIC_ESTIMATORS:
        entry = {}
        for key in ("tic_diag", "tic_trace"):
            these = [r["tic"][label][key] for r in rows]
            z = [abs(t["value"] - t["exact"]) / t["standard_error"] for t in these if t["standard_error"]]
            entry[key] = {
                "median_relative_error": statistics.median(t["relative_error"] for t in these),
                "max_relative_error": max(t["relative_error"] for t in these),
                "median_relative_spread": statistics.median(t["relative_spread"] for t in these),
                "max_relative_spread": max(t["relative_spread"] for t in these),
                "positive_share": statistics.mean(t["positive_share"] for t in these),
                "exact_positive_share": statistics.mean(t["exact"] > 0 for t in these),
                "within_2se": sum(v <= 2 for v in z) / len(z) if z else None,
                "exact_steps": sum(t["standard_error"] == 0.0 for t in these),
            }
        out["tic"][label] = entry
    return out


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(rows: list[dict], header: str) -> str:
    s = summary(rows)
    lines = [header, "",
             "**Hessian trace (HessTrace, 4 samples)** against the exact trace; spread: standard deviation over "
             f"{SEEDS + 1} seeds of the cockpit at the same step, relative to |exact|; samples for 10% / 50%: "
             "Hutchinson samples whose standard error is 10% / 50% of |exact trace| (from the exact per-sample "
             "variance `2 (‖H‖_F² − Σ H_jj²)`); reliable: `|value| > 2` standard errors.", "",
             "| estimator | steps | trace: median / max relative error | median spread over seeds | exact within 2 / 3 standard errors | reliable | median samples for 10% / 50% | TICTrace of the Hessian: median / max relative error |",
             "|---|---|---|---|---|---|---|---|"]
    for method in ("hutchinson", "hutch++"):
        v = s[method]
        within = "-" if v["within_2se"] is None else f"{100 * v['within_2se']:.0f}% / {100 * v['within_3se']:.0f}%"
        spread = _pct(v.get("median_relative_spread"))
        samples = (f"{v['median_samples_for_10pct']:.3g} / {v['median_samples_for_50pct']:.3g}"
                   if method == "hutchinson" else "-")
        lines.append(f"| {method} | {v['steps']} | {_pct(v['median_relative_error'])} / {_pct(v['max_relative_error'])} "
                     f"| {spread} | {within} | {100 * v['reliable_share']:.0f}% | {samples} "
                     f"| {_pct(v['median_tic_relative_error'])} / {_pct(v['max_tic_relative_error'])} |")
    lines += ["", "**TIC (TICDiag, TICTrace)** against the exact TIC of each curvature's own target, dense and float64: "
              "the GGN diagonal's for the GGN rows, the Hessian diagonal's for the old default; spread over "
              f"{SEEDS + 1} seeds relative to the exact value; positive: share of those values > 0, and of the exact "
              "values; exact steps: steps whose standard error is 0 (the GGN diagonal computed exactly).", "",
              "| TIC curvature | TICDiag: median / max relative error | TICDiag: median / max spread | TICTrace: median / max relative error | TICTrace: median / max spread | positive (diag / trace; exact diag / trace) | exact within 2 standard errors (diag / trace) | exact steps |",
              "|---|---|---|---|---|---|---|---|"]
    for label, v in s["tic"].items():
        d, t = v["tic_diag"], v["tic_trace"]
        within = f"{_pct(d['within_2se'])} / {_pct(t['within_2se'])}"
        lines.append(f"| {label} | {_pct(d['median_relative_error'])} / {_pct(d['max_relative_error'])} "
                     f"| {_pct(d['median_relative_spread'])} / {_pct(d['max_relative_spread'])} "
                     f"| {_pct(t['median_relative_error'])} / {_pct(t['max_relative_error'])} "
                     f"| {_pct(t['median_relative_spread'])} / {_pct(t['max_relative_spread'])} "
                     f"| {100 * d['positive_share']:.0f}% / {100 * t['positive_share']:.0f}%; {100 * d['exact_positive_share']:.0f}% / "
                     f"{100 * t['exact_positive_share']:.0f}% | {within} | {d['exact_steps']} / {len(rows)} |")
    auto = "ggn ('auto', new default)"
    old = "hessian (hutchinson, old default)"
    lines += ["", "| model | D | step | exact trace | hutchinson (standard error) | hutch++ (standard error) | Hutchinson samples for 10% | Lanczos products | TICDiag: exact with the GGN / auto (standard error) / old default (Hessian by Hutchinson) | TICTrace: exact with the GGN / auto (standard error) / old default |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h, k = r["hutchinson"], r["hutch++"]
        a, o = r["tic"][auto], r["tic"][old]
        lines.append(f"| {r['model']} | {r['dimension']} | {r['step']} | {r['exact_trace']:.4g} | {h['trace']:.4g} "
                     f"({h['standard_error']:.2g}) | {k['trace']:.4g} ({k['standard_error']:.2g}) | {r['samples_for_10pct']:.3g} "
                     f"| {r['products_lanczos']} "
                     f"| {r['exact_ggn_tic_diag']:.4g} / {a['tic_diag']['value']:.4g} ({a['tic_diag']['standard_error']:.2g}) / {o['tic_diag']['value']:.3g} "
                     f"| {r['exact_ggn_tic_trace']:.4g} / {a['tic_trace']['value']:.4g} ({a['tic_trace']['standard_error']:.2g}) / {o['tic_trace']['value']:.3g} |")
    return "\n".join(lines) + "\n"


def model_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments every script over :func:`models` takes: ``--steps``, ``--batch-size``, ``--only``, ``--json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--only", default=None, help="comma-separated substrings of model names")
    parser.add_argument("--json", type=Path, default=None)
    return parser


def run_models(run, args, shown) -> tuple[dict, list, list, float]:
    """``run(name, factory, steps, batch_size) -> rows`` on each of :func:`models` (``--only`` chosen), one
    thread, a model that fails reported and skipped; ``shown(row)`` is printed per model as it finishes.
    Returns ``(chosen, rows, failures, started)``."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    chosen = models()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if any(part in k for part in args.only.split(","))}
    rows, failures = [], []
    started = time.time()
    for name, factory in chosen.items():
        try:
            got = run(name, factory, args.steps, args.batch_size)
        except Exception as error:  # noqa: BLE001 - reported
            failures.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            print("FAILED", failures[-1], flush=True)
            continue
        rows += got
        print(name, f"{time.time() - started:.0f}s", [shown(r) for r in got], flush=True)
    return chosen, rows, failures, started


def _shown(r: dict) -> tuple:
    auto = "ggn ('auto', new default)"
    return (round(r["exact_trace"], 3), round(r["hutchinson"]["trace"], 3), round(r["exact_ggn_tic_trace"], 4),
            round(r["tic"][auto]["tic_trace"]["value"], 4), round(r["exact_ggn_tic_diag"], 1),
            round(r["tic"][auto]["tic_diag"]["value"], 1))


def main(argv=None) -> int:
    parser = model_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=Path, default=None, help="rewrite the table between the markers in this file")
    args = parser.parse_args(argv)
    chosen, rows, failures, started = run_models(run_model, args, _shown)
    print(json.dumps(summary(rows) if rows else {}, indent=1))
    header = (f"Regenerated by `python benchmarks/trace_estimators.py --docs docs/curvature.md` ({len(chosen)} models, "
              f"{args.steps} steps, batch {args.batch_size}, 4 samples each, {SEEDS + 1} seeds, torch {torch.__version__}, "
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
