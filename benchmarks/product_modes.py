#!/usr/bin/env python
"""Ways to form a Hessian-vector product, timed against a plain step: the lever "products where they are faster".

Issue 37 (item 3) lists, among the levers for the curvature's cost, products
"by forward-over-reverse where they are faster". The cockpit forms every
product by reverse-over-reverse: ``loss.backward(create_graph=True)`` keeps
the gradient's graph and each product is one more backward pass through it
(:func:`cockpit_like.backends.hvp.hessian_vector_product`). For each problem
of :mod:`benchmarks.overhead` (its model and batch, one process, one thread)
this script times, at the same parameters and batch:

- ``plain``: one plain forward and backward pass;
- ``reverse``: one product through the kept graph (the cockpit's way), per
  vector, the graph built once beforehand (as at a tracked step);
- ``reverse batched``: ``k`` products in one ``torch.autograd.grad(...,
  is_grads_batched=True)`` call (what block Lanczos with ``k`` start vectors
  could do), per vector;
- ``forward-over-reverse``: ``torch.func.jvp(torch.func.grad(loss), ...)``
  through ``torch.func.functional_call`` (a forward and a backward pass in
  dual numbers, no kept graph), per vector;
- ``forward-over-reverse vmapped``: the same over ``k`` vectors at once with
  ``torch.func.vmap``, per vector.

Each mode's product is checked against the cockpit's on the same vector
(the largest relative difference is reported). Times are medians of
``--repeats`` after one warm-up, in the same process, interleaved by mode.
Attention runs on the math kernel throughout (the one with a second
derivative, as the cockpit sets it for graph steps). Buffers (BatchNorm's
running statistics) are cloned for the functional passes so that they
leave the model alone.

    python benchmarks/product_modes.py --problems mlp,3c3d,2c2d,gpt,resnet --json benchmarks/results/product_modes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("reverse", "reverse batched", "forward-over-reverse", "forward-over-reverse vmapped")


def measure(problem: str, repeats: int, block: int) -> dict:
    """Per-vector times of each mode (seconds and plain steps) and their agreement with ``reverse``."""
    import torch
    from torch.func import functional_call, grad, jvp, vmap
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks import full_bound

    _, model, batches, params, _, lossfunc = full_bound.setup(problem)
    batch = batches[0]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    primals = {name: p.detach() for name, p in zip(names, params)}

    def functional_loss(values: dict) -> torch.Tensor:
        state = {**values, **{name: b.clone() for name, b in buffers.items()}}
        return full_bound._loss(problem, lambda inputs: functional_call(model, state, (inputs,)), batch, lossfunc)

    def kept_graph():
        with sdpa_kernel([SDPBackend.MATH]):
            loss = full_bound._loss(problem, model, batch, lossfunc)
        return torch.autograd.grad(loss, params, create_graph=True)

    grads = kept_graph()

    def vectors(k: int) -> list[list[torch.Tensor]]:
        return [[torch.randn_like(p) for p in params] for _ in range(k)]

    def reverse(vs):
        return [torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True) for v in vs]

    def reverse_batched(vs):
        stacked = [torch.stack([v[i] for v in vs]) for i in range(len(params))]
        out = torch.autograd.grad(grads, params, grad_outputs=stacked, retain_graph=True, is_grads_batched=True)
        return [[piece[j] for piece in out] for j in range(len(vs))]

    def forward_over_reverse(vs):
        results = []
        with sdpa_kernel([SDPBackend.MATH]):
            for v in vs:
                _, product = jvp(grad(functional_loss), (primals,), (dict(zip(names, v)),))
                results.append([product[name] for name in names])
        return results

    def forward_over_reverse_vmapped(vs):
        tangents = {name: torch.stack([v[i] for v in vs]) for i, name in enumerate(names)}
        with sdpa_kernel([SDPBackend.MATH]):
            out = vmap(lambda t: jvp(grad(functional_loss), (primals,), (t,))[1])(tangents)
        return [[out[name][j] for name in names] for j in range(len(vs))]

    functions = dict(zip(MODES, (reverse, reverse_batched, forward_over_reverse, forward_over_reverse_vmapped)))
    sizes = {"reverse": 1, "reverse batched": block, "forward-over-reverse": 1, "forward-over-reverse vmapped": block}

    check = vectors(block)
    reference = reverse(check)
    errors, failures = {}, {}
    for mode, function in functions.items():
        try:
            got = function(check)
        except Exception as error:  # noqa: BLE001 - a mode that torch cannot run on this model is a finding
            failures[mode] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        errors[mode] = max(
            float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
            for got_v, ref_v in zip(got, reference)
            for g, r in zip(got_v, ref_v)
        )

    def plain() -> float:
        start = time.perf_counter()
        model.zero_grad()
        full_bound._loss(problem, model, batch, lossfunc).backward()
        return time.perf_counter() - start

    def timed(mode: str) -> float:
        vs = vectors(sizes[mode])
        start = time.perf_counter()
        functions[mode](vs)
        return (time.perf_counter() - start) / sizes[mode]

    live = [mode for mode in MODES if mode not in failures]
    plain()
    for mode in live:
        timed(mode)
    times = {"plain": [], **{mode: [] for mode in live}}
    for _ in range(repeats):
        times["plain"].append(plain())
        for mode in live:
            times[mode].append(timed(mode))
    medians = {key: statistics.median(values) for key, values in times.items()}
    model.zero_grad()
    return {
        "problem": problem,
        "parameters": sum(p.numel() for p in params),
        "block": block,
        "plain_s": medians["plain"],
        "per_vector_s": {mode: medians[mode] for mode in live},
        "per_vector_plain_steps": {mode: medians[mode] / medians["plain"] for mode in live},
        "max_relative_difference": errors,
        "failed": failures,
    }


def table(results: list[dict]) -> str:
    def cell(row, mode):
        if mode in row["failed"]:
            return "fails"
        return f"{row['per_vector_plain_steps'][mode]:.2f}"

    lines = [
        "| problem | D | plain pass | " + " | ".join(f"{mode} (plain passes per vector)" for mode in MODES)
        + " | largest relative difference to reverse |",
        "|---|---|---|" + "---|" * len(MODES) + "---|",
    ]
    for row in results:
        worst = max((v for k, v in row["max_relative_difference"].items() if k != "reverse"), default=float("nan"))
        lines.append(
            f"| {row['problem']} | {row['parameters']} | {1000 * row['plain_s']:.1f} ms | "
            + " | ".join(cell(row, mode) for mode in MODES)
            + f" | {worst:.1e} |"
        )
    failed = [f"{row['problem']}, {mode}: {why}" for row in results for mode, why in row["failed"].items()]
    if failed:
        lines += ["", "Modes torch could not run: " + "; ".join(failed) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", default="mlp,3c3d,2c2d,gpt,resnet")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=2, help="vectors per batched call (the engine's block: 2)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.block < 1:
        parser.error("--repeats and --block must be at least 1")
    import torch

    from benchmarks import overhead

    unknown = [p for p in args.problems.split(",") if p not in overhead.PROBLEMS + overhead.OPT_IN_PROBLEMS]
    if unknown:
        parser.error(f"unknown problems {unknown}; choose from {overhead.PROBLEMS + overhead.OPT_IN_PROBLEMS}")
    started = time.perf_counter()
    results = []
    for problem in args.problems.split(","):
        results.append(measure(problem, args.repeats, args.block))
        print(table(results[-1:]).splitlines()[2], flush=True)
    markdown = table(results)
    meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "repeats": args.repeats, "seconds": time.perf_counter() - started}  # fmt: skip
    print(markdown)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
