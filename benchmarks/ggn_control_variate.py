#!/usr/bin/env python
"""Go/no-go for a Gauss-Newton control variate in Hutchinson's Hessian trace (issue 37, item 4).

``tr(H) = tr(G) + tr(H - G)``: ``tr(G)`` of the GGN ``G = (1/N) sum_n J_n^T (diag p_n - p_n p_n^T) J_n``
of the mean cross-entropy of the outputs is known exactly (``[B, C]`` outputs, ``C <= 10``: the cockpit's
exact GGN diagonal) or from sketched draws (sequences), and Hutchinson runs on ``H - G`` only. With
Rademacher vectors the variance of one sample ``v^T A v`` is ``2 (||A||_F^2 - sum_j A_jj^2)``, so this
script computes, exactly and densely in float64, on the 12 models and the same steps as
``benchmarks/trace_estimators.py`` (batch 4, SGD lr 0.05, batches seeded ``200 + step``):

- ``H`` from ``D`` Hessian-vector products on unit vectors, ``G`` from the dense Jacobian of the logits
  (a loop of ``autograd.grad`` over the logits' entries), ``tr H`` and ``tr G``;
- the samples for a standard error of 10% of ``|tr H|`` with plain Hutchinson (``A = H``) and with the
  control variate (``A = H - G``, and ``A = H - c* G`` with the oracle best ``c*`` as a bound), for the
  total and per parameter block (HessTrace stores one trace per parameter tensor; a Rademacher vector's
  block estimate ``v_b^T (A v)_b`` has the variance of ``A_bb`` alone);
- for outputs with a sequence axis (no exact GGN diagonal in the cockpit), the variance of one sketched
  draw of ``tr G`` (``s_n = S_n xi_n``, ``S_n S_n^T = diag p_n - p_n p_n^T``), which adds to the estimate's.

    python benchmarks/ggn_control_variate.py --json benchmarks/results/ggn_control_variate.json \\
        --markdown benchmarks/results/ggn_control_variate.md
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.trace_estimators import LANGUAGE_MODELS, loss_logits, model_arguments, run_models  # noqa: E402


def _flat(grads, params) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def _rows(outputs, params, chunk: int = 64) -> torch.Tensor:
    """``d outputs_k / d params`` for every entry ``k`` of the flat ``outputs`` (a graph), ``[K, D]``."""
    from benchmarks.stop_rule import _math_attention

    flat = outputs.reshape(-1)
    eye = torch.eye(flat.numel(), dtype=flat.dtype)
    rows = []
    for start in range(0, flat.numel(), chunk):
        block = eye[start : start + chunk]
        try:
            with _math_attention():
                got = torch.autograd.grad(flat, params, block, retain_graph=True, allow_unused=True,
                                          is_grads_batched=True)
            rows.append(torch.cat([(torch.zeros(len(block), p.numel(), dtype=flat.dtype) if g is None
                                    else g.reshape(len(block), -1)) for g, p in zip(got, params)], 1))
        except RuntimeError:  # an op without a batching rule: one at a time
            for e in block:
                with _math_attention():
                    got = torch.autograd.grad(flat, params, e, retain_graph=True, allow_unused=True)
                rows.append(_flat(got, params)[None])
    return torch.cat(rows)


def dense_hessian_and_ggn(name, problem, model, inputs, targets) -> dict:
    """Dense ``H`` of the mean loss, dense ``G`` of the mean cross-entropy of the loss's logits, and the
    sketch matrices ``A_n = S_n^T J_n J_n^T S_n / N^2``-free pieces for the sketched ``tr G``."""
    from benchmarks.stop_rule import _math_attention

    params = [p for p in model.parameters() if p.requires_grad]
    with _math_attention():
        outputs = problem.forward(model, inputs)
        logits = loss_logits(name, outputs)
        loss = problem.sample_losses(outputs, targets).mean()
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    flat_grad = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])
    hessian = _rows(flat_grad, params)
    hessian = (hessian + hessian.T) / 2
    # the GGN of the mean cross-entropy of the logits
    rows_n, classes = logits.reshape(-1, logits.shape[-1]).shape
    jacobian = _rows(logits, params).reshape(rows_n, classes, -1)
    flat_logits = logits.detach().reshape(rows_n, classes)
    probs = torch.softmax(flat_logits, dim=1)
    # is the loss the mean cross-entropy of these logits? p_n - N dL/df_n must be a label distribution
    full = outputs.logits if hasattr(outputs, "logits") else outputs
    (dlogits,) = torch.autograd.grad(loss, full, retain_graph=True)
    dlogits = dlogits[:, :-1] if name in LANGUAGE_MODELS else dlogits
    labels = probs - rows_n * dlogits.reshape(rows_n, classes)
    is_mean_ce = bool(torch.allclose(labels.sum(1), torch.ones(rows_n, dtype=labels.dtype), atol=1e-8)
                      and (labels > -1e-8).all())
    root = torch.diag_embed(probs.sqrt()) - probs.unsqueeze(2) * probs.sqrt().unsqueeze(1)  # S_n, S_n S_n^T = H_n
    pulled = torch.einsum("ncd,nce->ned", jacobian, root)  # S_n^T J_n: [N, C, D]
    ggn = torch.einsum("ncd,nce->de", pulled, pulled) / rows_n
    # one sketched draw of tr G: (1/N) sum_n xi_n^T A_n xi_n with A_n = S_n^T J_n J_n^T S_n
    a = torch.einsum("ncd,ned->nce", pulled, pulled)
    sketch_variance = float(2 * ((a**2).sum() - (torch.diagonal(a, dim1=1, dim2=2) ** 2).sum()) / rows_n**2)
    sizes = [p.numel() for p in params]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"hessian": hessian, "ggn": ggn, "sizes": sizes, "names": names, "is_mean_ce": is_mean_ce,
            "outputs": list(logits.shape), "sketch_variance": sketch_variance}


def rademacher_variance(a: torch.Tensor) -> float:
    """Variance of one sample ``v^T A v``, ``v`` Rademacher: ``2 (||A||_F^2 - sum_j A_jj^2)`` (``A`` symmetric)."""
    return float(2 * ((a**2).sum() - (torch.diagonal(a) ** 2).sum()))


def best_coefficient(h: torch.Tensor, g: torch.Tensor) -> float:
    """``c`` minimising the variance of ``v^T (H - c G) v``: ``<H, G>_off / ||G||_off^2`` (off-diagonal parts)."""
    off = ~torch.eye(len(h), dtype=torch.bool)
    denominator = float((g[off] ** 2).sum())
    return float((h[off] * g[off]).sum()) / denominator if denominator > 0 else 0.0


def facts(dense: dict) -> dict:
    h, g = dense["hessian"], dense["ggn"]
    c = best_coefficient(h, g)
    trace_h, trace_g = float(torch.trace(h)), float(torch.trace(g))
    out = {"trace_h": trace_h, "trace_g": trace_g, "trace_h_minus_g": trace_h - trace_g,
           "frobenius_h": float(h.norm()), "frobenius_g": float(g.norm()), "frobenius_h_minus_g": float((h - g).norm()),
           "variance_h": rademacher_variance(h), "variance_cv": rademacher_variance(h - g),
           "best_c": c, "variance_best_c": rademacher_variance(h - c * g),
           "sketch_variance_trace_g": dense["sketch_variance"]}
    for key in ("h", "cv", "best_c"):
        out[f"samples_for_10pct_{key}"] = out[f"variance_{key}"] / (0.1 * trace_h) ** 2
    blocks = []
    start = 0
    for name, size in zip(dense["names"], dense["sizes"]):
        hb, gb = h[start : start + size, start : start + size], g[start : start + size, start : start + size]
        start += size
        tb = float(torch.trace(hb))
        vh, vcv = rademacher_variance(hb), rademacher_variance(hb - gb)
        blocks.append({"name": name, "size": size, "trace_h": tb, "trace_g": float(torch.trace(gb)),
                       "variance_h": vh, "variance_cv": vcv,
                       "samples_for_10pct_h": vh / (0.1 * tb) ** 2 if tb else float("inf"),
                       "samples_for_10pct_cv": vcv / (0.1 * tb) ** 2 if tb else float("inf")})
    out["blocks"] = blocks
    return out


def run_model(name, factory, steps: int, batch_size: int) -> list[dict]:
    from benchmarks.stop_rule import _math_attention

    problem = factory(0)
    model = problem.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    rows = []
    for step in range(steps):
        inputs, targets = problem.batch(batch_size, 200 + step)
        started = time.time()
        dense = dense_hessian_and_ggn(name, problem, model, inputs, targets)
        row = {"model": name, "step": step, "dimension": sum(dense["sizes"]), "outputs": dense["outputs"],
               "is_mean_cross_entropy": dense["is_mean_ce"], **facts(dense), "seconds": time.time() - started}
        rows.append(row)
        del dense
        optimizer.zero_grad()
        with _math_attention():
            problem.sample_losses(problem.forward(model, inputs), targets).mean().backward()
        optimizer.step()
    return rows


def _quartiles(values):
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def summary(rows: list[dict]) -> dict:
    ratio = [r["variance_h"] / r["variance_cv"] for r in rows]
    out = {
        "steps": len(rows),
        "median_samples_for_10pct_h": statistics.median(r["samples_for_10pct_h"] for r in rows),
        "median_samples_for_10pct_cv": statistics.median(r["samples_for_10pct_cv"] for r in rows),
        "median_samples_for_10pct_best_c": statistics.median(r["samples_for_10pct_best_c"] for r in rows),
        "quartiles_samples_for_10pct_h": _quartiles([r["samples_for_10pct_h"] for r in rows]),
        "quartiles_samples_for_10pct_cv": _quartiles([r["samples_for_10pct_cv"] for r in rows]),
        "variance_ratio_h_over_cv_quartiles": _quartiles(ratio),
        "variance_ratio_min_max": (min(ratio), max(ratio)),
        "steps_where_cv_is_worse": sum(v < 1 for v in ratio),
        "median_best_c": statistics.median(r["best_c"] for r in rows),
        # why: G is a small part of H in Frobenius norm, and tr(H - G) carries most of the trace
        "quartiles_frobenius_g_over_h": _quartiles([r["frobenius_g"] / r["frobenius_h"] for r in rows]),
        "median_abs_trace_h_minus_g_over_trace_h": statistics.median(abs(r["trace_h_minus_g"]) / abs(r["trace_h"])
                                                                    for r in rows),
    }
    out["median_samples_ratio"] = out["median_samples_for_10pct_h"] / out["median_samples_for_10pct_cv"]
    blocks = [b for r in rows for b in r["blocks"] if b["trace_h"] != 0 and b["variance_h"] > 0]
    out["blocks"] = {
        "count": len(blocks),
        "median_samples_for_10pct_h": statistics.median(b["samples_for_10pct_h"] for b in blocks),
        "median_samples_for_10pct_cv": statistics.median(b["samples_for_10pct_cv"] for b in blocks),
        # capped at 1e12: a block where H_bb = G_bb (a last linear layer's) has Var(H - G) = 0 to rounding
        "variance_ratio_quartiles": _quartiles([min(b["variance_h"] / max(b["variance_cv"], 1e-300), 1e12)
                                                 for b in blocks]),
        "blocks_with_variance_ratio_over_3": sum(b["variance_h"] > 3 * b["variance_cv"] for b in blocks),
    }
    out["blocks"]["median_samples_ratio"] = (out["blocks"]["median_samples_for_10pct_h"]
                                             / out["blocks"]["median_samples_for_10pct_cv"])
    return out


def table(rows: list[dict]) -> str:
    lines = ["| model | step | D | tr H | tr G | tr(H - G) | ‖H‖_F / ‖H − G‖_F | Var ratio H / (H − G) | samples for 10%: H / H − G / H − c*G (c*) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['step']} | {r['dimension']} | {r['trace_h']:.4g} | {r['trace_g']:.4g} "
                     f"| {r['trace_h_minus_g']:.4g} | {r['frobenius_h']:.3g} / {r['frobenius_h_minus_g']:.3g} "
                     f"| {r['variance_h'] / r['variance_cv']:.3g} | {r['samples_for_10pct_h']:.3g} / "
                     f"{r['samples_for_10pct_cv']:.3g} / {r['samples_for_10pct_best_c']:.3g} ({r['best_c']:.2f}) |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    s, b = result["summary"], result["summary"]["blocks"]
    q_h, q_cv = s["quartiles_samples_for_10pct_h"], s["quartiles_samples_for_10pct_cv"]
    lines = [
        f"Generated by `{result['command']}` ({s['steps']} steps, torch {result['torch']}, {result['seconds']:.0f} s).", "",
        "Rademacher samples for a standard error of 10% of |tr H| (exact variances, float64):", "",
        f"- total, plain Hutchinson on H: median {s['median_samples_for_10pct_h']:.4g} (quartiles {q_h[0]:.4g}, {q_h[2]:.4g})",
        f"- total, control variate (tr G exact, Hutchinson on H - G): median {s['median_samples_for_10pct_cv']:.4g} "
        f"(quartiles {q_cv[0]:.4g}, {q_cv[2]:.4g}); the oracle best multiple c* G: {s['median_samples_for_10pct_best_c']:.4g}",
        f"- median ratio of the samples: {s['median_samples_ratio']:.3g}x; per-step variance ratio Var(H) / Var(H - G): "
        f"quartiles {', '.join(f'{v:.3g}' for v in s['variance_ratio_h_over_cv_quartiles'])}, min {s['variance_ratio_min_max'][0]:.3g}, "
        f"max {s['variance_ratio_min_max'][1]:.3g}; worse with the control variate on {s['steps_where_cv_is_worse']} steps",
        f"- why: ‖G‖_F / ‖H‖_F has quartiles {', '.join(f'{v:.2g}' for v in s['quartiles_frobenius_g_over_h'])}, "
        f"and |tr(H - G)| / |tr H| a median {s['median_abs_trace_h_minus_g_over_trace_h']:.2g}",
        f"- per parameter block ({b['count']} blocks with a nonzero trace): median samples {b['median_samples_for_10pct_h']:.4g} "
        f"(H) and {b['median_samples_for_10pct_cv']:.4g} (H - G), {b['median_samples_ratio']:.3g}x; variance ratio quartiles "
        f"{', '.join(f'{v:.3g}' for v in b['variance_ratio_quartiles'])}; over 3x on {b['blocks_with_variance_ratio_over_3']} blocks",
        "", table(result["rows"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = model_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", type=Path, default=None, help="write the summary and the table here")
    args = parser.parse_args(argv)
    _, rows, failures, started = run_models(
        run_model, args, lambda r: (round(r["trace_h"], 3), round(r["trace_g"], 3), round(r["samples_for_10pct_h"], 1),
                                    round(r["samples_for_10pct_cv"], 1)),
    )
    result = {"rows": rows, "summary": summary(rows) if rows else {}, "failures": failures,
              "seconds": time.time() - started, "torch": torch.__version__,
              "command": "python benchmarks/ggn_control_variate.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(result["summary"], indent=1))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
