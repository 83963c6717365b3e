#!/usr/bin/env python
"""Cost of the optimizer step as the unit: gradient accumulation and FSDP2, as ratios in the same job.

**Accumulation** (one process per problem of :mod:`benchmarks.overhead`):
four copies of the model train side by side on the same batches,

- ``plain``: no cockpit, one backward pass over the batch,
- ``plain_k``: no cockpit, ``K`` micro-batches (each loss divided by ``K``),
- ``economy``: the economy preset at every step, one backward pass,
- ``economy_k``: the economy preset at every step over ``K`` micro-batches
  (``info["micro_batches"] = K``, docs/your_training_loop.md),

one training step of each in turn (the order rotating), so that the shared
machine's load swings touch them alike. Reported per problem (median over
steps, then over rounds): ``economy_k / economy`` (the question of issue 22:
at most 1.1), ``economy / plain`` and ``economy_k / plain_k``.

**FSDP2** (2 gloo ranks, each a ``fully_shard`` copy of the ``mlp`` problem
without BackPACK, batch 64 per rank): ``plain`` and ``economy`` interleaved
the same way, rank 0's step times: ``economy / plain``.

Usage::

    python benchmarks/accumulation_overhead.py                  # mlp, 3c3d, gpt; fsdp; 3 rounds
    python benchmarks/accumulation_overhead.py --rounds 1 --steps 4 --problems mlp --no-fsdp

Results: ``benchmarks/results/accumulation_overhead.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.overhead import HOOK_PROBLEMS, LANGUAGE_MODELS, batch_size_of, build_problem, make_batches, token_losses  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "accumulation_overhead.json"
CONFIGS = ("plain", "plain_k", "economy", "economy_k")


def _step(model, optimizer, cockpit, batch, step: int, micro: int, language_model: bool, lossfunc, individual):
    import torch

    inputs, labels = batch
    optimizer.zero_grad()
    size = len(labels) // micro
    for k in range(micro):
        part = slice(k * size, (k + 1) * size)
        outputs = model(inputs[part])
        if language_model:
            per_token = token_losses(outputs.logits, labels[part])
            loss, losses = per_token.mean(), per_token.detach().mean(1)
        else:
            loss = lossfunc(outputs, labels[part])
            losses = individual(outputs, labels[part]) if cockpit is not None else None
        if cockpit is None:
            (loss / micro).backward()
            continue
        info = {"batch_size": size, "individual_losses": losses, "loss": loss, "optimizer": optimizer,
                "micro_batches": micro}  # fmt: skip
        with cockpit(step, info=info):
            (loss / micro).backward(create_graph=cockpit.create_graph(step))
    optimizer.step()
    del torch


def accumulation_job(problem: str, steps: int, warmup: int, micro: int) -> dict:
    """Interleaved steps of the four configurations on one problem; per-config step times."""
    import torch
    from backpack import extend
    from torch import nn

    from cockpit_like import Cockpit
    from cockpit_like.utils.configuration import configuration

    torch.set_num_threads(1)
    batch_size = batch_size_of(problem, None)
    base, shape = build_problem(problem, batch_size)
    batches = make_batches(problem, base, shape, batch_size)
    language_model = problem in LANGUAGE_MODELS
    runs = {}
    for config in CONFIGS:
        model = copy.deepcopy(base)
        lossfunc, individual = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none")
        cockpit = None
        if config.startswith("economy"):
            if problem in HOOK_PROBLEMS:
                cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
            else:
                model, lossfunc = extend(model), extend(lossfunc)
                cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        runs[config] = (model, optimizer, cockpit, lossfunc, individual, micro if config.endswith("_k") else 1)
    times = {config: [] for config in CONFIGS}
    for step in range(warmup + steps):
        order = CONFIGS[step % len(CONFIGS):] + CONFIGS[: step % len(CONFIGS)]
        for config in order:
            model, optimizer, cockpit, lossfunc, individual, k = runs[config]
            start = time.perf_counter()
            _step(model, optimizer, cockpit, batches[step % len(batches)], step, k, language_model, lossfunc, individual)
            if step >= warmup:
                times[config].append(time.perf_counter() - start)
    return {"problem": problem, "batch_size": batch_size, "micro_batches": micro, "times": times}


def _ratios(times: dict) -> dict:
    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    return {
        "economy_k/economy": ratio("economy_k", "economy"),
        "economy/plain": ratio("economy", "plain"),
        "economy_k/plain_k": ratio("economy_k", "plain_k"),
        "plain_k/plain": ratio("plain_k", "plain"),
        "median_s": {config: statistics.median(values) for config, values in times.items()},
    }


# ---- FSDP2 ----------------------------------------------------------------------------------------
def _fsdp_worker(rank: int, port: int, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cockpit_like import Cockpit
    from cockpit_like.utils.configuration import configuration

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    mesh = init_device_mesh("cpu", (2,))
    base, shape = build_problem("mlp", 64)
    batches = make_batches("mlp", base, shape, 64)
    runs = {}
    for config in ("plain", "economy"):
        model = copy.deepcopy(base)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        quantities = configuration("economy") if config == "economy" else None
        cockpit = None if quantities is None else Cockpit(model.parameters(), quantities=quantities, model=model)
        runs[config] = (model, torch.optim.SGD(model.parameters(), lr=0.01), cockpit)
    times = {"plain": [], "economy": []}
    lossfunc, individual = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none")
    for step in range(warmup + steps):
        for config in (("plain", "economy") if step % 2 == 0 else ("economy", "plain")):
            model, optimizer, cockpit = runs[config]
            start = time.perf_counter()
            _step(model, optimizer, cockpit, batches[step % len(batches)], step, 1, False, lossfunc, individual)
            if step >= warmup:
                times[config].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def fsdp_job(steps: int, warmup: int) -> dict:
    import torch

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "times.json")
        try:
            torch.multiprocessing.start_processes(
                _fsdp_worker, args=(port, steps, warmup, out), nprocs=2, start_method="spawn"
            )
        except torch.multiprocessing.ProcessExitedException:
            if not os.path.exists(out):  # gloo's threads may abort at teardown, after the times are written
                raise
        times = json.loads(Path(out).read_text())
    return {"economy/plain": statistics.median(e / p for e, p in zip(times["economy"], times["plain"])),
            "median_s": {k: statistics.median(v) for k, v in times.items()}}  # fmt: skip


# ---- parent ---------------------------------------------------------------------------------------
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", default="mlp,3c3d,gpt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--no-fsdp", action="store_true")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = accumulation_job(args.child, args.steps, args.warmup, args.micro_batches)
        print(json.dumps(result))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    results = {"accumulation": {}, "fsdp": []}
    for round_ in range(args.rounds):
        for problem in args.problems.split(","):
            output = subprocess.run(
                [sys.executable, __file__, "--child", problem, "--steps", str(args.steps), "--warmup",
                 str(args.warmup), "--micro-batches", str(args.micro_batches)],
                capture_output=True, text=True, env=env, check=True,
            ).stdout  # fmt: skip
            job = json.loads(output.strip().splitlines()[-1])
            results["accumulation"].setdefault(problem, []).append(_ratios(job["times"]))
        if not args.no_fsdp:
            results["fsdp"].append(fsdp_job(args.steps, args.warmup))
    summary = {
        problem: {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "median_s"}
        for problem, rounds in results["accumulation"].items()
    }
    fsdp = statistics.median(r["economy/plain"] for r in results["fsdp"]) if results["fsdp"] else None
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "rounds": args.rounds, "steps": args.steps, "micro_batches": args.micro_batches}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "fsdp_economy/plain": fsdp,
                                           "rounds": results}, indent=1))  # fmt: skip
    print(f"| problem | economy, {args.micro_batches} micro-batches / economy, one pass (target <= 1.1) | "
          "economy / plain | economy, micro-batches / plain, micro-batches | plain, micro-batches / plain |")
    print("|---|---|---|---|---|")
    for problem, row in summary.items():
        print(f"| {problem} | {row['economy_k/economy']:.2f} | {row['economy/plain']:.2f} | "
              f"{row['economy_k/plain_k']:.2f} | {row['plain_k/plain']:.2f} |")
    if fsdp is not None:
        print(f"\nFSDP2 (2 gloo ranks x 64, mlp): economy / plain = {fsdp:.2f}")


if __name__ == "__main__":
    main()
