"""Score the diagnosis rules on the labelled corpus (``cockpit_like.corpus``), both halves.

    python benchmarks/diagnosis_corpus.py                 # train, diagnose, print the tables
    python benchmarks/diagnosis_corpus.py --update-doc    # also write them into docs/diagnosis.md
    python benchmarks/diagnosis_corpus.py --cache runs.pkl   # keep the trained runs (re-score fast)
    python benchmarks/diagnosis_corpus.py --half tuning --show   # one line per run

Thresholds are set on the tuning half (seeds 0 and 1); the evaluation half
(seeds 2 and 3) is only reported. Training is deterministic on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BEGIN, END = "<!-- corpus-table:begin -->", "<!-- corpus-table:end -->"


def run_corpus(specs, cache: str | None = None, progress: bool | None = None) -> list[dict]:
    from cockpit_like.corpus import train
    from cockpit_like.utils.progress import progress as progress_bar

    stored = {}
    if cache and os.path.exists(cache):
        with open(cache, "rb") as handle:
            stored = pickle.load(handle)
    runs = []
    for spec in progress_bar(specs, len(specs), "corpus runs", progress, unit="run"):
        if spec.name not in stored:
            stored[spec.name] = train(spec)
        runs.append(stored[spec.name])
    if cache:
        with open(cache, "wb") as handle:
            pickle.dump(stored, handle)
    return runs


def score(runs: list[dict]) -> tuple[list[dict], float]:
    """Score each run with the default rules; return the scored runs and the diagnosis seconds per step."""
    from cockpit_like.diagnosis import diagnose
    from cockpit_like.diagnosis.scoring import score_run

    scored, seconds, steps = [], 0.0, 0
    for run in runs:
        started = time.perf_counter()
        report = diagnose(run["steps"], run["metadata"])
        seconds += time.perf_counter() - started
        steps += len(run["steps"])
        result = score_run(run["spec"].problem, run["onset"], report.findings, skipped=report.notes)
        result["name"] = run["spec"].name
        scored.append(result)
    return scored, seconds / max(steps, 1)


def update_doc(table: str, path: Path) -> bool:
    text = path.read_text()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    return True


def main(argv=None) -> dict:
    from cockpit_like.corpus import corpus, split
    from cockpit_like.diagnosis.scoring import format_summary, summarize

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", help="pickle file to keep trained runs in (re-scoring skips training)")
    parser.add_argument("--half", choices=["tuning", "evaluation", "both"], default="both")
    parser.add_argument("--settings", nargs="*", help="only these settings")
    parser.add_argument("--show", action="store_true", help="one line per run")
    parser.add_argument("--update-doc", action="store_true", help="write the tables into docs/diagnosis.md")
    parser.add_argument("--json", help="write the summaries to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal anyway)")
    args = parser.parse_args(argv)
    specs = corpus(settings=args.settings)
    halves = split(specs)
    names = ["tuning", "evaluation"] if args.half == "both" else [args.half]
    started = time.perf_counter()
    summaries, per_step = {}, {}
    for name in names:
        runs = run_corpus(halves[name], args.cache, progress=False if args.no_progress else None)
        scored, per_step[name] = score(runs)
        summaries[name] = summarize(scored)
        if args.show:
            for s in scored:
                print(f"{name:10s} {s['name']:44s} problem={s['problem']} onset={s['onset']} "
                      f"first={s['first_cause']} delay={s['delay']} alarms={s['alarms']} rules={s['rules']} info={s['info']}")
    table = format_summary(summaries)
    print(table)
    print(f"\n{len(specs)} runs in the corpus; {time.perf_counter() - started:.0f} s; diagnosis "
          + ", ".join(f"{1e3 * v:.2f} ms per step ({k})" for k, v in per_step.items()))
    if args.update_doc:
        print("docs updated" if update_doc(table, ROOT / "docs" / "diagnosis.md") else "no markers in the doc")
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1, default=str))
    return summaries


if __name__ == "__main__":
    main()
