"""What the self-checks of a tracked step cost: economy with and without them, against plain, in one run.

Each round spawns, per problem, plain training, the economy preset with its
self-checks (the default) and without them (``Cockpit(self_checks=False)``),
in alternating order, through the children of :mod:`benchmarks.overhead`
(one thread each). The figure is the median over rounds of each round's
``(economy checked - economy unchecked) / economy unchecked``, and the
ratios to plain of the same round.

    python benchmarks/self_checks_cost.py --problems 3c3d,gpt --rounds 3

``--interleaved`` measures inside one process instead: the economy preset on
every step, its checks switched on and off step by step in the order
on, off, off, on (``Cockpit.self_checks`` between steps), so that the load of
a shared machine, which drifts over minutes, falls on both alike; the figure
is the median over rounds of ``(median checked step - median unchecked step)
/ median unchecked step``.

    python benchmarks/self_checks_cost.py --problems 3c3d,gpt --interleaved --rounds 3 --steps 120
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import overhead  # noqa: E402


def measure(problems: list[str], rounds: int, steps: int, warmup: int, small: bool = False) -> dict:
    args = overhead.parse_args(["--steps", str(steps), "--warmup", str(warmup)] + (["--small"] if small else []))
    args.budget = 8.0 if args.budget is None else args.budget  # overhead.main's defaults for a full run
    args.min_time = 1.0 if args.min_time is None else args.min_time
    runs: dict[str, dict[str, list[float]]] = {p: {"plain": [], "checked": [], "unchecked": []} for p in problems}
    for round_ in range(rounds):
        for problem in problems:
            order = ["plain", "checked", "unchecked"] if round_ % 2 == 0 else ["unchecked", "checked", "plain"]
            for kind in order:
                config = "plain" if kind == "plain" else "economy"
                previous = os.environ.get("COCKPIT_LIKE_SELF_CHECKS")
                os.environ["COCKPIT_LIKE_SELF_CHECKS"] = "0" if kind == "unchecked" else "1"
                try:
                    result = overhead.spawn(problem, config, steps, warmup, args)
                finally:
                    if previous is None:
                        os.environ.pop("COCKPIT_LIKE_SELF_CHECKS", None)
                    else:
                        os.environ["COCKPIT_LIKE_SELF_CHECKS"] = previous
                if "error" in result:
                    raise RuntimeError(f"{problem} {kind}: {result['error']}")
                runs[problem][kind].append(result["median_s"])
    return summarise(runs)


def summarise(runs: dict[str, dict[str, list[float]]]) -> dict:
    """Per problem: median step times, median ratios to plain (same round) and the checks' share."""
    summary = {}
    for problem, kinds in runs.items():
        plain, checked, unchecked = kinds["plain"], kinds["checked"], kinds["unchecked"]
        summary[problem] = {
            "plain_ms": 1e3 * statistics.median(plain),
            "economy_ratio": statistics.median(c / p for c, p in zip(checked, plain)),
            "economy_unchecked_ratio": statistics.median(u / p for u, p in zip(unchecked, plain)),
            "checks_share": statistics.median((c - u) / u for c, u in zip(checked, unchecked)),
            "rounds": len(plain),
        }
    return summary


def measure_interleaved(problems: list[str], rounds: int, steps: int, warmup: int, small: bool = False) -> dict:
    """Per problem, in this process: the economy step with and without its checks, switched step by step."""
    summary = {}
    for problem in problems:
        args = overhead.parse_args(["--steps", "1"] + (["--small"] if small else []))
        args.problem, args.config, args.device = problem, "economy", "cpu"
        args.batch_size = overhead.batch_size_of(problem, None)
        train_step, *_ = overhead._training(args)
        cockpit = train_step.cockpit
        step, shares, checked_ms, unchecked_ms = 0, [], [], []
        for _ in range(max(warmup, 1)):
            train_step(step)
            step += 1
        for _ in range(rounds):
            times: dict[bool, list[float]] = {True: [], False: []}
            for k in range(steps):
                checked = k % 4 in (0, 3)
                cockpit.self_checks = checked
                start = time.perf_counter()
                train_step(step)
                times[checked].append(time.perf_counter() - start)
                step += 1
            on, off = statistics.median(times[True]), statistics.median(times[False])
            shares.append((on - off) / off)
            checked_ms.append(1e3 * on)
            unchecked_ms.append(1e3 * off)
        cockpit.self_checks = True
        summary[problem] = {
            "checked_ms": statistics.median(checked_ms),
            "unchecked_ms": statistics.median(unchecked_ms),
            "checks_share": statistics.median(shares),
            "shares": shares,
            "rounds": rounds,
            "steps_per_round": steps,
        }
    return summary


def table_interleaved(summary: dict) -> str:
    lines = [
        "| problem | economy step, checks on | checks off | checks' cost, % of the economy step (median; rounds) |",
        "|---|---|---|---|",
    ]
    for problem, row in summary.items():
        rounds = ", ".join(f"{100 * share:+.1f}%" for share in row["shares"])
        lines.append(
            f"| {problem} | {row['checked_ms']:.1f} ms | {row['unchecked_ms']:.1f} ms | "
            f"{100 * row['checks_share']:+.1f}% ({rounds}) |"
        )
    return "\n".join(lines)


def table(summary: dict) -> str:
    lines = [
        "| problem | plain step | economy (checks) | economy (no checks) | checks' cost, % of the economy step |",
        "|---|---|---|---|---|",
    ]
    for problem, row in summary.items():
        lines.append(
            f"| {problem} | {row['plain_ms']:.1f} ms | {row['economy_ratio']:.2f} | {row['economy_unchecked_ratio']:.2f} | "
            f"{100 * row['checks_share']:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", default="3c3d,gpt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="tiny models (for tests)")
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    parser.add_argument("--interleaved", action="store_true",
                        help="one process per problem, the checks switched on and off step by step (see the docstring)")
    args = parser.parse_args(argv)
    problems = [p for p in args.problems.split(",") if p]
    unknown = [p for p in problems if p not in overhead.PROBLEMS + overhead.OPT_IN_PROBLEMS]
    if unknown:
        parser.error(f"unknown problems {unknown}; choose from {overhead.PROBLEMS + overhead.OPT_IN_PROBLEMS}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be positive")
    if args.interleaved:
        summary = measure_interleaved(problems, args.rounds, args.steps, args.warmup, args.small)
        print(table_interleaved(summary))
    else:
        summary = measure(problems, args.rounds, args.steps, args.warmup, args.small)
        print(table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
