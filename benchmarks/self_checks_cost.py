"""What the self-checks of a tracked step cost: economy with and without them, against plain, in one run.

Each round spawns, per problem, plain training, the economy preset with its
self-checks (the default) and without them (``Cockpit(self_checks=False)``),
in alternating order, through the children of :mod:`benchmarks.overhead`
(one thread each). The figure is the median over rounds of each round's
``(economy checked - economy unchecked) / economy unchecked``, and the
ratios to plain of the same round.

    python benchmarks/self_checks_cost.py --problems 3c3d,gpt --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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
    args = parser.parse_args(argv)
    problems = [p for p in args.problems.split(",") if p]
    unknown = [p for p in problems if p not in overhead.PROBLEMS + overhead.OPT_IN_PROBLEMS]
    if unknown:
        parser.error(f"unknown problems {unknown}; choose from {overhead.PROBLEMS + overhead.OPT_IN_PROBLEMS}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be positive")
    summary = measure(problems, args.rounds, args.steps, args.warmup, args.small)
    print(table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
