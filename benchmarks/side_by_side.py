#!/usr/bin/env python
"""Side by side, same run: the cockpit against the tools a user would pick instead, same model and batch.

1. **Per-sample gradient norms**: a cockpit whose one quantity reads the
   per-sample squared norms (:class:`~cockpit_like.backends.per_sample_stats.SquaredNorms`,
   module hooks, ``model=``) against Opacus's ghost clipping
   (``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)``: the
   forward pass, its norm-computing backward pass and ``get_norm_sample()``;
   its second, clipped backward pass is not counted). Each configuration
   (and ``plain``, a step without either) runs in its own process: time per
   step (median), peak resident memory added over ``plain``'s, and the
   largest relative difference of the norms (they must agree).
2. **Top eigenvalue and trace of the Hessian** of the mean loss on one
   batch: ``HessMaxEV`` (products through ``p.grad``'s graph) against
   curvlinops' ``HessianLinearOperator`` with ``scipy.sparse.linalg.eigsh``
   at ``tol=1e-2``; both checked against ``eigsh`` at ``tol=1e-10``
   (Lanczos on exact products). Trace: Hutchinson with the same number of
   products (the same variance), ``HessTrace(curvature="hutchinson")``
   against ``curvlinops.hutchinson_trace``.
3. **KFAC and EK-FAC fitting** (empirical Fisher, expand): ``CurvatureStatistics``
   logged in the step's own backward pass (time of the tracked step minus a
   plain step) against building curvlinops' ``KFACLinearOperator`` /
   ``EKFACLinearOperator`` (its own forward and backward passes).

Benchmark-only dependencies: ``opacus`` (pinned in ``constraints.txt``;
``make benchmark-deps``) and ``curvlinops-for-pytorch`` (a test oracle, installed
by ``make install``). One thread per process.

Usage::

    python benchmarks/side_by_side.py            # mlp and 3c3d (norms), mlp (curvature); prints the tables
    python benchmarks/side_by_side.py --steps 3  # a quick look

Results: ``benchmarks/results/side_by_side.json`` and markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.overhead import build_problem, make_batches  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "side_by_side.json"
NORM_CONFIGS = ("plain", "cockpit", "opacus")


# ---- 1. per-sample gradient norms, one configuration per process -------------------------------------
def _norms_child(problem: str, config: str, steps: int, batch_size: int) -> dict:
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model, shape = build_problem(problem, batch_size)
    batches = make_batches(problem, model, shape, batch_size)
    individual = nn.CrossEntropyLoss(reduction="none")
    norms_of = None
    if config == "cockpit":
        from cockpit_like import Cockpit
        from cockpit_like.backends.per_sample_stats import SquaredNorms
        from cockpit_like.context import get_record
        from cockpit_like.quantities.quantity import SingleStepQuantity
        from cockpit_like.utils.schedules import linear

        class PerSampleNorms(SingleStepQuantity):
            def per_sample_stats(self, global_step):
                return [SquaredNorms()] if self.should_compute(global_step) else []

            def _compute(self, global_step, params, batch_loss):
                record = get_record(global_step)
                return record.stat(SquaredNorms()).sqrt() * record.info["batch_size"]

        quantity = PerSampleNorms(linear(1))
        cockpit = Cockpit(model.parameters(), [quantity], model=model)
        net = model
    elif config == "opacus":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        net = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True,
                                                   loss_reduction="mean")  # fmt: skip
    else:
        net = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for step in range(steps + 2):
        inputs, labels = batches[step % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad()
        losses = individual(net(inputs), labels)
        loss = losses.mean()
        if config == "cockpit":
            with cockpit(step, info={"batch_size": batch_size, "loss": loss}):
                loss.backward()
            norms = quantity.output[step]
        elif config == "opacus":
            loss.backward()
            norms = net.get_norm_sample()
        else:
            loss.backward()
            norms = None
        optimizer.step()
        if step >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
        norms_of = norms
    return {
        "median_s": statistics.median(times),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "norms": None if norms_of is None else [float(v) for v in norms_of],
    }


def norms_table(problems: list[str], steps: int, batch_size: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    results = {}
    for problem in problems:
        runs = {}
        for config in NORM_CONFIGS:
            output = subprocess.run(
                [sys.executable, __file__, "--child", f"{problem}:{config}", "--steps", str(steps),
                 "--batch-size", str(batch_size)],
                capture_output=True, text=True, env=env, check=True,
            ).stdout  # fmt: skip
            runs[config] = json.loads(output.strip().splitlines()[-1])
        ours, theirs = runs["cockpit"]["norms"], runs["opacus"]["norms"]
        # the last step's norms of both (the same batch, the same weights: plain SGD from the same start)
        difference = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs))
        plain = runs["plain"]
        results[problem] = {
            config: {
                "step_ms": 1000 * runs[config]["median_s"],
                "ratio": runs[config]["median_s"] / plain["median_s"],
                "added_mb": runs[config]["maxrss_mb"] - plain["maxrss_mb"],
            }
            for config in ("cockpit", "opacus")
        }
        results[problem]["plain_ms"] = 1000 * plain["median_s"]
        results[problem]["norms_max_relative_difference"] = difference
    return results


# ---- 2. eigenvalue and trace --------------------------------------------------------------------------
def curvature_table(problem: str, batch_size: int, samples: int) -> dict:
    import numpy as np
    import torch
    from curvlinops import HessianLinearOperator, hutchinson_trace
    from scipy.sparse.linalg import eigsh
    from torch import nn

    from cockpit_like import Cockpit
    from cockpit_like.quantities import HessMaxEV, HessTrace
    from cockpit_like.utils.schedules import linear

    torch.set_num_threads(1)
    model, shape = build_problem(problem, batch_size)
    (inputs, labels), *_ = make_batches(problem, model, shape, batch_size, count=1)
    params = [p for p in model.parameters() if p.requires_grad]
    lossfunc = nn.CrossEntropyLoss()

    def plain_step() -> float:
        start = time.perf_counter()
        model.zero_grad()
        lossfunc(model(inputs), labels).backward()
        return time.perf_counter() - start

    plain = statistics.median(plain_step() for _ in range(5))

    def tracked(quantity) -> float:
        cockpit = Cockpit(params, [quantity], model=model)
        model.zero_grad()
        torch.manual_seed(0)
        start = time.perf_counter()
        loss = lossfunc(model(inputs), labels)
        with cockpit(0, info={"batch_size": batch_size, "loss": loss}):
            loss.backward(create_graph=cockpit.create_graph(0))
        elapsed = time.perf_counter() - start
        for p in params:
            p.grad = None
        return elapsed, cockpit.get_output()[0][type(quantity).__name__]

    tracked(HessTrace(linear(1), curvature="hutchinson", hutchinson_samples=1))  # warm-up (first-step costs)
    top = HessMaxEV(linear(1))
    ours_s, ours_value = tracked(top)
    ours_products = top.hvp_counts.get(0)

    hessian = HessianLinearOperator(model, lossfunc, params, [(inputs, labels)], check_deterministic=False)
    scipy_op = hessian.to_scipy()
    counted = {"products": 0}

    def counting(matvec):
        def wrapped(x):
            counted["products"] += 1 if x.ndim == 1 else x.shape[1]
            return matvec(x)

        return wrapped

    from scipy.sparse.linalg import LinearOperator

    op = LinearOperator(scipy_op.shape, matvec=counting(scipy_op.matvec), matmat=counting(scipy_op.matmat),
                        dtype=scipy_op.dtype)  # fmt: skip
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    theirs_value = float(eigsh(op, k=1, which="LA", tol=1e-2, v0=rng.standard_normal(op.shape[0]))[0][0])
    theirs_s = time.perf_counter() - start
    theirs_products = counted["products"]
    exact = float(eigsh(scipy_op, k=1, which="LA", tol=1e-10, v0=rng.standard_normal(op.shape[0]))[0][0])

    trace_q = HessTrace(linear(1), curvature="hutchinson", hutchinson_samples=samples)
    ours_trace_s, ours_trace = tracked(trace_q)
    torch.manual_seed(0)
    start = time.perf_counter()
    theirs_trace = float(hutchinson_trace(hessian, samples))
    theirs_trace_s = time.perf_counter() - start
    return {
        "plain_ms": 1000 * plain,
        "exact_top_eigenvalue": exact,
        "cockpit": {"top": ours_value, "top_error": abs(ours_value - exact) / abs(exact), "products": ours_products,
                    "top_ms": 1000 * (ours_s - plain), "trace": float(sum(ours_trace)),
                    "trace_ms": 1000 * (ours_trace_s - plain)},
        "curvlinops": {"top": theirs_value, "top_error": abs(theirs_value - exact) / abs(exact),
                       "products": theirs_products, "top_ms": 1000 * theirs_s, "trace": theirs_trace,
                       "trace_ms": 1000 * theirs_trace_s},
        "samples": samples,
    }  # fmt: skip


# ---- 3. KFAC / EK-FAC fitting -----------------------------------------------------------------------
def kfac_table(problem: str, batch_size: int) -> dict:
    import torch
    from curvlinops import EKFACLinearOperator, KFACLinearOperator
    from curvlinops.kfac import FisherType, KFACType
    from torch import nn

    from cockpit_like import Cockpit
    from cockpit_like.quantities import CurvatureStatistics
    from cockpit_like.utils.schedules import linear

    torch.set_num_threads(1)
    model, shape = build_problem(problem, batch_size)
    (inputs, labels), *_ = make_batches(problem, model, shape, batch_size, count=1)
    params = [p for p in model.parameters() if p.requires_grad]
    lossfunc = nn.CrossEntropyLoss()

    def step(cockpit=None) -> float:
        model.zero_grad()
        start = time.perf_counter()
        loss = lossfunc(model(inputs), labels)
        if cockpit is None:
            loss.backward()
        else:
            with cockpit(0, info={"batch_size": batch_size, "loss": loss}):
                loss.backward()
        return time.perf_counter() - start

    plain = statistics.median(step() for _ in range(5))
    result = {"plain_ms": 1000 * plain}
    for kind, cls in (("kfac", KFACLinearOperator), ("ekfac", EKFACLinearOperator)):
        ours = statistics.median(
            step(Cockpit(params, [CurvatureStatistics(linear(1), statistics=kind)], model=model)) for _ in range(3)
        )
        times = []
        for _ in range(3):
            start = time.perf_counter()
            operator = cls(model, lossfunc, params, [(inputs, labels)], fisher_type=FisherType.EMPIRICAL,
                           kfac_approx=KFACType.EXPAND, check_deterministic=False)  # fmt: skip
            operator.compute_kronecker_factors()  # curvlinops builds them lazily, at the first product
            if kind == "ekfac":
                operator.compute_eigenvalue_correction()
            times.append(time.perf_counter() - start)
        result[kind] = {"cockpit_added_ms": 1000 * (ours - plain), "cockpit_step_ms": 1000 * ours,
                        "curvlinops_ms": 1000 * statistics.median(times)}  # fmt: skip
    return result


# ---- parent ---------------------------------------------------------------------------------------
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", default="mlp,3c3d", help="problems of the per-sample norm comparison")
    parser.add_argument("--curvature-problem", default="mlp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--samples", type=int, default=20, help="Hutchinson products of both traces")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        problem, config = args.child.split(":")
        print(json.dumps(_norms_child(problem, config, args.steps, args.batch_size)))
        return
    norms = norms_table(args.problems.split(","), args.steps, args.batch_size)
    curvature = curvature_table(args.curvature_problem, args.batch_size, args.samples)
    kfac = kfac_table(args.curvature_problem, args.batch_size)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"norms": norms, "curvature": curvature, "kfac": kfac,
                                           "batch_size": args.batch_size, "steps": args.steps}, indent=1))  # fmt: skip
    print("| problem (batch %d) | plain step (ms) | cockpit: ratio, added MB | Opacus ghost: ratio, added MB "
          "| norms agree (max rel. diff.) |" % args.batch_size)
    print("|---|---|---|---|---|")
    for problem, row in norms.items():
        c, o = row["cockpit"], row["opacus"]
        print(f"| {problem} | {row['plain_ms']:.1f} | {c['ratio']:.2f}, {c['added_mb']:.0f} | {o['ratio']:.2f}, "
              f"{o['added_mb']:.0f} | {row['norms_max_relative_difference']:.1e} |")
    c, l = curvature["cockpit"], curvature["curvlinops"]
    print(f"\nTop eigenvalue ({args.curvature_problem}, exact {curvature['exact_top_eigenvalue']:.5g}): "
          f"cockpit {c['top']:.5g} (error {c['top_error']:.1e}, {c['products']} products, {c['top_ms']:.0f} ms); "
          f"curvlinops+eigsh tol 1e-2 {l['top']:.5g} (error {l['top_error']:.1e}, {l['products']} products, "
          f"{l['top_ms']:.0f} ms)")
    print(f"Trace ({curvature['samples']} products each): cockpit {c['trace']:.5g} in {c['trace_ms']:.0f} ms; "
          f"curvlinops {l['trace']:.5g} in {l['trace_ms']:.0f} ms")
    for kind in ("kfac", "ekfac"):
        row = kfac[kind]
        print(f"{kind}: cockpit adds {row['cockpit_added_ms']:.1f} ms to a {kfac['plain_ms']:.1f} ms step; "
              f"curvlinops builds it in {row['curvlinops_ms']:.1f} ms")


if __name__ == "__main__":
    main()
