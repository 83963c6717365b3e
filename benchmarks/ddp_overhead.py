#!/usr/bin/env python
"""DDP overhead benchmark: the cockpit on 2 ranks x batch 64 against 1 process x batch 128.

For the ``mlp`` and ``3c3d`` problems of :mod:`benchmarks.overhead` (same
models, synthetic data, SGD, one thread per process) it measures the time
per training step of

- ``plain``: no cockpit (the model wrapped in ``DistributedDataParallel``
  in the DDP mode, not extended),
- ``nothing``: extended model, an economy cockpit that tracks only step 0
  (an untimed warm-up step): what a cockpit in the loop costs between
  tracked steps,
- ``economy``: the economy preset at every step,

in two modes: ``single`` (one process, batch 128) and ``ddp`` (two gloo
ranks on this machine, batch 64 each, ``Cockpit(..., model=ddp_model)``;
rank 0's step times, the ranks run in lock step). The machine is shared, so
the three configurations run *interleaved in one job* (three copies of the
model, one training step of each in turn, the order rotating): each
configuration's step is compared with the ``plain`` step next to it, under
the same load. A job's ratio is the median over its steps of
``config step / plain step``; each (mode, problem) job runs in fresh
processes, in a shuffled order, over several rounds, and the reported ratio
is the median over rounds. The question: is the economy overhead ratio under
DDP within 1.2x of the single-process one, and does a step that tracks
nothing cost nothing measurable?

Usage::

    python benchmarks/ddp_overhead.py                 # 3 rounds, prints the table, writes the JSON
    python benchmarks/ddp_overhead.py --rounds 1 --steps 5 --problems mlp   # a quick look

Results: ``benchmarks/results/ddp_overhead.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.overhead import build_problem, make_batches, make_quantities  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results" / "ddp_overhead.json"
PROBLEMS = ("mlp", "3c3d")
CONFIGS = ("plain", "nothing", "economy")
MODES = {"single": (1, 128), "ddp": (2, 64)}  # mode -> (ranks, local batch)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, problem: str, batch: int, steps: int, warmup: int,
               out: str) -> None:  # fmt: skip
    import copy

    import torch
    import torch.distributed as dist
    from backpack import extend
    from torch import nn

    from cockpit_like import Cockpit

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))  # fmt: skip
    base, shape = build_problem(problem, batch)
    batches = make_batches(problem, base, shape, batch)
    individual = nn.CrossEntropyLoss(reduction="none")
    runs = {}
    for config in CONFIGS:
        model, lossfunc = copy.deepcopy(base), nn.CrossEntropyLoss()
        quantities = make_quantities(config)
        if quantities is not None:
            model, lossfunc = extend(model), extend(lossfunc)
        net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        cockpit = None if quantities is None else Cockpit(model.parameters(), quantities, model=net)
        runs[config] = (net, lossfunc, optimizer, cockpit)
    times = {config: [] for config in CONFIGS}
    warmup = max(warmup, 1)
    for step in range(warmup + steps):
        inputs, labels = batches[(step * world + rank) % len(batches)]
        order = CONFIGS[step % len(CONFIGS) :] + CONFIGS[: step % len(CONFIGS)]
        for config in order:
            net, lossfunc, optimizer, cockpit = runs[config]
            start = time.perf_counter()
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = lossfunc(outputs, labels)
            if cockpit is None:
                loss.backward()
            else:
                info = {"batch_size": batch, "individual_losses": individual(outputs, labels), "loss": loss,
                        "optimizer": optimizer}  # fmt: skip
                with cockpit(step, info=info):
                    loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            if step >= warmup:
                times[config].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times}))
    if world > 1:
        dist.barrier()  # rank 0 has written the times before either rank tears its group down
        dist.destroy_process_group()


def measure(mode: str, problem: str, steps: int, warmup: int) -> dict:
    """One job: the configurations interleaved; per configuration the median step and the median ratio to plain."""
    import torch.multiprocessing as mp

    world, batch = MODES[mode]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "times.json")
        args = (world, _free_port(), problem, batch, steps, warmup, out)
        try:
            mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="spawn")
        except mp.ProcessExitedException:
            # gloo's threads can abort a rank while it tears its group down (SIGABRT, "terminate called without
            # an active exception"), after rank 0 wrote the times: those times stand
            if not os.path.exists(out):
                raise
        times = json.loads(Path(out).read_text())["times"]
    result = {"mode": mode, "problem": problem, "times": times}
    for config in CONFIGS:
        result[config] = {
            "median_s": statistics.median(times[config]),
            "ratio": statistics.median(t / p for t, p in zip(times[config], times["plain"])),
        }
    return result


def aggregate(runs: list[dict], problems: list[str]) -> dict:
    results = {}
    for mode in MODES:
        for problem in problems:
            mine = [run for run in runs if (run["mode"], run["problem"]) == (mode, problem)]
            entry = {}
            for config in CONFIGS:
                ratios = [run[config]["ratio"] for run in mine]
                entry[config] = {
                    "ratio": statistics.median(ratios),
                    "ratios": ratios,
                    "step_ms": 1000 * statistics.median(run[config]["median_s"] for run in mine),
                }
            results.setdefault(problem, {})[mode] = entry
    return results


def markdown(results: dict) -> str:
    lines = [
        "| problem | mode | plain ms/step | nothing (ratio) | economy (ratio) | economy ratio DDP / single |",
        "|---|---|---|---|---|---|",
    ]
    for problem, modes in results.items():
        for mode, entry in modes.items():
            ratio = ""
            if mode == "ddp":
                ratio = f"{entry['economy']['ratio'] / modes['single']['economy']['ratio']:.2f}"
            world, batch = MODES[mode]
            spread = lambda config: f"{min(entry[config]['ratios']):.2f}-{max(entry[config]['ratios']):.2f}"  # noqa: E731
            lines.append(
                f"| {problem} | {mode} ({world} x {batch}) | {entry['plain']['step_ms']:.1f} | "
                f"{entry['nothing']['ratio']:.2f} ({spread('nothing')}) | "
                f"{entry['economy']['ratio']:.2f} ({spread('economy')}) | {ratio} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    problems = args.problems.split(",")
    order = random.Random(args.seed)
    runs = []
    for round_ in range(args.rounds):
        jobs = [(mode, problem) for mode in MODES for problem in problems]
        order.shuffle(jobs)
        for mode, problem in jobs:
            run = measure(mode, problem, args.steps, args.warmup)
            run["round"] = round_
            runs.append(run)
            shown = ", ".join(f"{c} {1000 * run[c]['median_s']:.1f} ms ({run[c]['ratio']:.2f})" for c in CONFIGS)
            print(f"round {round_} {mode:6s} {problem:5s} {shown}", flush=True)
    results = aggregate(runs, problems)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "steps": args.steps,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
