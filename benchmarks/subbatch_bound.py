#!/usr/bin/env python
"""The bound of *full every 10th step* and of *HessMaxEV alone* with curvature on a sub-batch.

A measurement of a lever (issue 37, item 3), not a feature of the library:
the Hessian is that of the mean loss of ``b < B`` rows of the step's batch,
from a forward and a ``create_graph`` backward of its own on those rows,
while the user's backward stays a plain one (no ``create_graph``). For each
problem of :mod:`benchmarks.overhead` (the models and batches of
:mod:`benchmarks.full_bound`) and each ``b`` in ``{B/8, B/4, B/2, B}`` (at
least 2 rows), in one process, on one thread, this script measures:

- ``plain``: one plain step on the ``B`` rows (forward, backward, SGD step);
- ``graph_b``: forward and ``torch.autograd.grad(loss, params,
  create_graph=True)`` on ``b`` rows (attention on the math kernel, which has
  a second derivative, as the cockpit sets it for graph steps);
- ``hvp_b``: one Hessian-vector product through that graph
  (``torch.autograd.grad(grads, params, v, retain_graph=True)``);

timed in rounds (a plain step, then each ``b``'s graph and product), so
that the machine's noise hits them alike; medians over ``--repeats`` rounds
at each of ``--steps`` measured steps. At each measured step (the model
trained by the rounds' SGD steps in between, on the same fixed batches as
``full_bound.py``), it runs the curvature engine's solver
(:func:`cockpit_like.functional.krylov.lanczos_decomposition` with the
engine's defaults: ``DEFAULT_RTOL``, ``DEFAULT_PROBES`` Rademacher probes
from the engine's per-step generator, at most 100 products) on the
sub-batch Hessian of ``--choices`` different row choices for each ``b < B``
(one for ``b = B``), and records the products ``P_b`` and HessMaxEV's value
(the Ritz value of largest magnitude, as ``benchmarks/stop_rule.py``
defines it), and the relative difference ``|lambda_b - lambda_B| /
|lambda_B|`` to the full batch's value at the same parameters.

Per problem and ``b`` (``P_b`` the median products):

- HessMaxEV alone, the tracked step in plain steps:
  ``1 + (graph_b + P_b x hvp_b) / plain`` (the user's plain step plus the
  curvature's own graph and products; the extra alone is that less 1);
- full every 10th step, its bound: ``1 + (graph_b + P_b x hvp_b) / (10 x plain)``
  (leaving out the engine's own work and every other quantity of the preset).

At ``b = B`` the separate forward is the dear way: ``full_bound.py``'s
tracked step reuses the user's forward, which this one does not.

    python benchmarks/subbatch_bound.py --problems mlp,3c3d,2c2d,gpt,resnet \\
        --json benchmarks/results/subbatch_bound.json --markdown benchmarks/results/subbatch_bound.md
    python benchmarks/subbatch_bound.py --render benchmarks/results/subbatch_bound.json  # the table again

About 12 minutes on one thread of this machine with ``--repeats 3 --steps 3 --choices 3`` (17 with
``--choices 5``): most of it the Lanczos solves (10 per step with 3 choices).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the issue's targets: HessMaxEV alone, plain steps per tracked step; full every 10th step, ratio to plain
TRACKED_TARGET = 6.0
FULL_EVERY10_TARGET = 2.5


def sub_batch_sizes(batch_size: int) -> list[int]:
    """``B/8, B/4, B/2, B`` (integer division, at least 2 rows, without repeats), ascending."""
    if batch_size < 2:
        raise ValueError(f"a sub-batch needs a batch of at least 2 rows, got {batch_size}")
    return sorted({max(2, batch_size // d) for d in (8, 4, 2)} | {batch_size})


def tracked_step_plain_steps(plain: float, graph: float, hvp: float, products: float, engine: float = 0.0) -> float:
    """HessMaxEV alone: the tracked step (plain step + the sub-batch's graph + ``products`` products, + the
    engine's own work if given) in plain steps."""
    return 1 + (graph + products * hvp + engine) / plain


def full_every10_bound(plain: float, graph: float, hvp: float, products: float, period: int = 10,
                       engine: float = 0.0) -> float:
    """Full every ``period``-th step, amortised, its curvature alone: ``1 + (graph + P x hvp [+ engine]) / (period x plain)``."""
    return 1 + (graph + products * hvp + engine) / (period * plain)


def relative_difference(value: float, reference: float) -> float:
    """``|value - reference| / |reference|`` (inf where the reference is 0 and the value is not)."""
    if reference == 0:
        return 0.0 if value == 0 else float("inf")
    return abs(value - reference) / abs(reference)


def rows_of(batch: tuple, rows) -> tuple:
    """The batch ``(inputs, targets)`` restricted to ``rows`` (a 1-D index tensor)."""
    inputs, targets = batch
    return inputs[rows], targets[rows]


def pick_rows(batch_size: int, size: int, step: int, choice: int):
    """Row indices of sub-batch ``choice`` at ``step``: all rows if ``size == batch_size``, else ``size`` drawn
    without replacement from a generator seeded by ``(step, choice)`` (the user's RNG untouched), sorted."""
    import torch

    if size >= batch_size:
        return torch.arange(batch_size)
    generator = torch.Generator().manual_seed(1_000_003 * (step + 1) + 7919 * choice + size)
    return torch.randperm(batch_size, generator=generator)[:size].sort().values


def math_attention():
    """Attention with a second derivative (the math kernel), as the cockpit sets it for graph steps."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.MATH])


def graph_of(loss_of, params: list, batch: tuple) -> list:
    """The mean loss's gradient on ``batch`` with its graph (``create_graph=True``), attention on the math kernel."""
    import torch

    with math_attention():
        loss = loss_of(batch)
    return list(torch.autograd.grad(loss, params, create_graph=True))


def top_eigenvalue(grads: list, params: list, step: int, max_products: int = 100) -> dict:
    """HessMaxEV's value on the Hessian whose graph ``grads`` carry, with the engine's solver and defaults.

    Returns ``{"value", "products", "converged", "solve_s", "products_s"}``: the Ritz value of largest
    magnitude, the products used, whether the stop rule was met, the solve's time and its products' time.
    """
    import torch

    from cockpit_like.backends.curvature_engine import DEFAULT_PROBES, DEFAULT_RTOL, rademacher, step_generator
    from cockpit_like.functional.krylov import lanczos_decomposition

    sizes = [p.numel() for p in params]
    spent = {"products": 0.0}

    def matvec(vector):
        start = time.perf_counter()
        pieces = [piece.reshape(p.shape) for piece, p in zip(vector.split(sizes), params)]
        out = torch.autograd.grad(grads, params, grad_outputs=pieces, retain_graph=True, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(p) if o is None else o).reshape(-1) for o, p in zip(out, params)])
        spent["products"] += time.perf_counter() - start
        return flat

    dtype, device = params[0].dtype, params[0].device
    starts = rademacher(DEFAULT_PROBES, sum(sizes), dtype, device, step_generator(step, "lanczos probes", device))
    start = time.perf_counter()
    decomposition = lanczos_decomposition(
        matvec, starts, max_products=max_products, rtol=DEFAULT_RTOL, probes=DEFAULT_PROBES
    )
    solve = time.perf_counter() - start
    values = decomposition.ritz_values()
    top, bottom = float(values[-1]), float(values[0])
    return {
        "value": top if abs(top) >= abs(bottom) else bottom,
        "products": int(decomposition.num_products),
        "converged": bool(decomposition.converged),
        "solve_s": solve,
        "products_s": spent["products"],
    }


def measure(problem: str, repeats: int, steps: int, choices: int, log=None) -> dict:
    import torch

    from benchmarks import full_bound

    log = log or (lambda line: print(line, flush=True))
    batch_size, model, batches, params, optimizer, lossfunc = full_bound.setup(problem)
    sizes = sub_batch_sizes(batch_size)

    def loss_of(batch):
        return full_bound._loss(problem, model, batch, lossfunc)

    def plain(index: int) -> float:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_of(batches[index % len(batches)]).backward()
        optimizer.step()
        return time.perf_counter() - start

    def graph_and_product(batch: tuple, size: int, step: int) -> tuple[float, float]:
        sub = rows_of(batch, pick_rows(batch_size, size, step, 0))
        start = time.perf_counter()
        grads = graph_of(loss_of, params, sub)
        graph = time.perf_counter() - start
        vector = [torch.randn_like(p) for p in params]
        start = time.perf_counter()
        torch.autograd.grad(grads, params, grad_outputs=vector, retain_graph=True)
        return graph, time.perf_counter() - start

    plain(0)
    for size in sizes:
        graph_and_product(batches[0], size, 0)  # warm-up
    plains: list[float] = []
    graphs: dict[int, list[float]] = {size: [] for size in sizes}
    hvps: dict[int, list[float]] = {size: [] for size in sizes}
    solves: dict[int, list[dict]] = {size: [] for size in sizes}
    index = 1
    for step in range(steps):
        for _ in range(repeats):  # timed rounds; their SGD steps train the model between measured steps
            plains.append(plain(index))
            for size in sizes:
                graph, hvp = graph_and_product(batches[index % len(batches)], size, index)
                graphs[size].append(graph)
                hvps[size].append(hvp)
            index += 1
        optimizer.zero_grad()
        batch = batches[step % len(batches)]
        full = None
        for size in reversed(sizes):  # the full batch first: the reference at these parameters
            for choice in range(1 if size == batch_size else choices):
                rows = pick_rows(batch_size, size, step, choice)
                grads = graph_of(loss_of, params, rows_of(batch, rows))
                solve = top_eigenvalue(grads, params, step)
                del grads
                if full is None:
                    full = solve["value"]
                solve.update(step=step, choice=choice, full_value=full,
                             relative_difference=relative_difference(solve["value"], full))
                solves[size].append(solve)
                log(f"[subbatch_bound] {problem} step {step} b={size} choice {choice}: "
                    f"{solve['products']} products, value {solve['value']:.4g} (full {full:.4g})")

    p = statistics.median(plains)
    per_size = []
    for size in sizes:
        g, h = statistics.median(graphs[size]), statistics.median(hvps[size])
        products = [s["products"] for s in solves[size]]
        used = statistics.median(products)
        differences = [s["relative_difference"] for s in solves[size]]
        per_size.append({
            "b": size,
            "graph_s": g,
            "hvp_s": h,
            "graph_per_plain": g / p,
            "hvp_per_plain": h / p,
            "products": products,
            "products_median": used,
            "converged": [s["converged"] for s in solves[size]],
            "values": [s["value"] for s in solves[size]],
            "full_values": [s["full_value"] for s in solves[size]],
            "steps": [s["step"] for s in solves[size]],
            "choices": [s["choice"] for s in solves[size]],
            "relative_differences": differences,
            "relative_difference_median": statistics.median(differences),
            "relative_difference_max": max(differences),
            "engine_s": statistics.median(s["solve_s"] - s["products_s"] for s in solves[size]),
            "tracked_step_plain_steps": tracked_step_plain_steps(p, g, h, used),
            "bound_ratio": full_every10_bound(p, g, h, used),
        })  # fmt: skip
    return {
        "problem": problem,
        "batch_size": batch_size,
        "parameters": sum(q.numel() for q in params),
        "plain_s": p,
        "plain_samples": len(plains),
        "sizes": per_size,
    }


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms" if seconds >= 0.01 else f"{1000 * seconds:.2f} ms"


def _fmt_products(products: list[int]) -> str:
    return f"{statistics.median(products):g} ({min(products)}-{max(products)})"


def table(results: list[dict]) -> str:
    lines = [
        "| problem | B | plain step | b | graph on b rows (plain steps) | one product (plain steps) "
        "| products, median (range) | tracked step, plain steps | full every 10th, bound "
        "| engine's own work per solve (plain steps) | the two with it "
        "| lambda_b vs lambda_B: median, max rel. difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["plain_s"]
        for s in r["sizes"]:
            tracked, bound = s["tracked_step_plain_steps"], s["bound_ratio"]
            used, engine = statistics.median(s["products"]), s.get("engine_s")
            tracked_text = f"**{tracked:.1f}**" if tracked <= TRACKED_TARGET else f"{tracked:.1f}"
            bound_text = f"**{bound:.2f}**" if bound <= FULL_EVERY10_TARGET else f"{bound:.2f}"
            if engine is None:
                engine_text = with_engine = "-"
            else:
                engine_text = f"{_ms(engine)} ({engine / p:.1f})"
                with_engine = (f"{tracked_step_plain_steps(p, s['graph_s'], s['hvp_s'], used, engine):.1f}, "
                               f"{full_every10_bound(p, s['graph_s'], s['hvp_s'], used, engine=engine):.2f}")
            difference = "- (reference)" if s["b"] == r["batch_size"] else (
                f"{100 * s['relative_difference_median']:.1f}%, {100 * s['relative_difference_max']:.1f}%")
            lines.append(
                f"| {r['problem']} | {r['batch_size']} | {_ms(r['plain_s'])} | {s['b']} "
                f"| {_ms(s['graph_s'])} ({s['graph_per_plain']:.2f}) "
                f"| {_ms(s['hvp_s'])} ({s['hvp_per_plain']:.2f}) | {_fmt_products(s['products'])} "
                f"| {tracked_text} | {bound_text} | {engine_text} | {with_engine} | {difference} |"
            )
    return "\n".join(lines)


def markdown(results: list[dict], meta: dict) -> str:
    return (
        "# Curvature on a sub-batch: the bound (benchmarks/subbatch_bound.py)\n\n"
        f"Command: `{meta['command']}`; commit {meta.get('commit') or '?'}; {meta['threads']} thread; "
        f"{meta['repeats']} timed rounds at each of {meta['steps']} measured steps; "
        f"{meta['choices']} row choices per b < B. Tracked step = 1 + (graph_b + P_b x product_b) / plain; "
        "bound = 1 + (graph_b + P_b x product_b) / (10 x plain); in bold where within the targets "
        f"({TRACKED_TARGET:g} plain steps, {FULL_EVERY10_TARGET:g}x). The relative difference is "
        "|lambda_b - lambda_B| / |lambda_B| over steps and row choices. The engine's own work (the Lanczos "
        "solve's time less its products', median) is left out of the bound, as in full_bound.py, and added in "
        "the next column.\n\n" + table(results) + "\n"
    )


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv=None):
    from benchmarks import overhead as ob

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", default="mlp,3c3d,2c2d,gpt,resnet")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds at each measured step (median over all)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (Lanczos solves on each b)")
    parser.add_argument("--choices", type=int, default=3, help="row choices for each b < B at each step")
    parser.add_argument("--json", help="write the results here (after each problem)")
    parser.add_argument("--markdown", help="write the table here (after each problem)")
    parser.add_argument("--render", metavar="JSON", help="measure nothing: write --markdown (or print) from this JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.choices < 1:
        parser.error("--repeats, --steps and --choices must be >= 1")
    args.problems = [p for p in args.problems.split(",") if p]
    unknown = [p for p in args.problems if p not in ob.PROBLEMS]
    if unknown or not args.problems:
        parser.error(f"unknown problems {unknown}; choose from {list(ob.PROBLEMS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        text = markdown(saved["results"], saved["meta"])
        if args.markdown:
            Path(args.markdown).write_text(text)
        else:
            print(text)
        return 0
    meta = {
        "command": "python benchmarks/subbatch_bound.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": _commit(),
        "threads": 1,
        "repeats": args.repeats,
        "steps": args.steps,
        "choices": args.choices,
    }
    results = []
    started = time.perf_counter()
    for problem in args.problems:
        results.append(measure(problem, args.repeats, args.steps, args.choices))
        meta["elapsed_s"] = time.perf_counter() - started
        print(f"[subbatch_bound] {problem} done after {meta['elapsed_s']:.0f} s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(markdown(results, meta))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
