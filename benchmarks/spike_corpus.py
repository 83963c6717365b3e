"""Score the loss-spike post-mortem (``cockpit_like.spikes``) on the spike corpus, both halves.

    python benchmarks/spike_corpus.py                    # train (or read the cache), score, print the table
    python benchmarks/spike_corpus.py --update-doc       # also write the table into docs/spikes.md
    python benchmarks/spike_corpus.py --tune             # grid-search the thresholds on the tuning half only
    python benchmarks/spike_corpus.py --half tuning --show   # one line per run
    python benchmarks/spike_corpus.py --half gpt2-small --show   # the GPT-2 small slice (minutes a run; then --update-doc)
    python benchmarks/spike_corpus.py --half tuning --seeds 0 --out /tmp/s.json   # scores elsewhere than the tracked JSON

Runs are trained once with ``PostMortem(record_all=True)`` (a post-mortem at
every step, with the step's loss, gradient norm and learning rate) and kept in
``benchmarks/results/spike_corpus_runs.jsonl`` (one line per run, not
committed; delete it to retrain); every setting is scored by replaying the
detector over those series (``cockpit_like.spikes.corpus.replay``), exactly
what ``PostMortem`` with those settings would have stored. Thresholds are set on the tuning architectures
(``SPLIT["tuning"]``) and reported on the held-out ones. Training is
deterministic on the CPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "benchmarks" / "results" / "spike_corpus_runs.jsonl"
#: the GPT-2 small slice's runs (a file of its own: it is trained by a process of its own, alongside)
CACHE_GPT2 = ROOT / "benchmarks" / "results" / "spike_corpus_gpt2_small_runs.jsonl"
DOC = ROOT / "docs" / "spikes.md"
BEGIN, END = "<!-- spike-table:begin -->", "<!-- spike-table:end -->"
#: bump when the generator or the post-mortem changes what a run stores (old cache lines are ignored)
VERSION = 3
#: the columns of the table: the two halves, and the GPT-2 small slice (held out, trained with ``--half gpt2-small``)
COLUMNS = ("tuning", "held-out", "gpt2-small")


def run_half(half: str, cache: Path | None = None, show: bool = False, seeds: tuple[int, ...] = (0, 1)) -> list[dict]:
    from cockpit_like.spikes.corpus import gpt2_small_runs, spike_runs, train_spike_run

    cache = cache or (CACHE_GPT2 if half == "gpt2-small" else CACHE)

    stored = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("version") == VERSION:
                stored[entry["name"]] = entry
    results = []
    draw = gpt2_small_runs if half == "gpt2-small" else (lambda seed: spike_runs(half, seed=seed))
    for run in [run for seed in seeds for run in draw(seed)]:
        if run.name not in stored:
            result = train_spike_run(run, record_all=True)
            result["version"] = VERSION
            cache.parent.mkdir(parents=True, exist_ok=True)
            with cache.open("a") as handle:
                handle.write(json.dumps(result) + "\n")
            stored[run.name] = result
            if show:
                print(f"  trained {run.name} in {result['seconds']:.1f}s", flush=True)
        results.append(stored[run.name])
    return results


def _cached(seeds: tuple[int, ...], cache: Path = CACHE_GPT2) -> bool:
    """Whether every run of the GPT-2 small slice's ``seeds`` is in the cache (it is trained on its own)."""
    from cockpit_like.spikes.corpus import gpt2_small_runs

    if not cache.exists():
        return False
    names = {entry["name"] for entry in map(json.loads, cache.read_text().splitlines()) if entry.get("version") == VERSION}
    return all(run.name in names for seed in seeds for run in gpt2_small_runs(seed))


def _rate(numerator: int, denominator: int) -> str:
    return f"{numerator}/{denominator} ({numerator / denominator:.0%})" if denominator else "-"


def table(scores: dict[str, dict]) -> str:
    halves = list(scores)
    title = {"gpt2-small": "held-out: GPT-2 small"}
    lines = ["| | " + " | ".join(f"{title.get(half, half)} ({', '.join(scores[half]['archs'])})" for half in halves)
             + " |",
             "|---|" + "---|" * len(halves)]
    rows = [
        ("faults caught (a post-mortem within 5 steps of the onset)", lambda s: _rate(s["caught"], s["faulty_runs"])),
        ("row-caused spikes with an injected row in the top 3 by share (target >= 90%)",
         lambda s: _rate(s["rows_in_top3"], s["row_spikes"])),
        ("... in the top 3 by loss", lambda s: _rate(s["rows_in_top3_by_loss"], s["row_spikes"])),
        ("... among the post-mortem's suspects (its step's rows, or an earlier step's that stood out)",
         lambda s: _rate(s["rows_in_suspects"], s["row_spikes"])),
        ("one-row faults: an injected row in the top 3 by share at the onset step, spike or not",
         lambda s: _rate(s["row_faults_at_onset"], s["row_faults"])),
        ("... in the top 3 by loss", lambda s: _rate(s["row_faults_at_onset_by_loss"], s["row_faults"])),
        ("spikes caught whose cause is named right (target >= 85%)", lambda s: _rate(s["cause_right"], s["caught"])),
        ("healthy runs with a post-mortem (target <= 1 in 20)",
         lambda s: _rate(s["healthy_with_post_mortem"], s["healthy_runs"])),
        ("faulty runs with a post-mortem before the onset", lambda s: _rate(s["early_alarms"], s["faulty_runs"])),
    ]
    rows.append(("runs the cockpit stopped with an error (scored on the steps before it)",
                 lambda s: str(len(s["stopped_by_cockpit"]))))
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(scores[h]) for h in halves) + " |")
    faults = sorted({f for s in scores.values() for f in s["by_fault"]})
    lines += ["", "| fault | " + " | ".join(f"{h}: caught, top 3, cause right (causes named)" for h in halves) + " |",
              "|---|" + "---|" * len(halves)]
    for fault in faults:
        cells = []
        for half in halves:
            e = scores[half]["by_fault"].get(fault)
            cells.append("-" if e is None else f"{e['caught']}/{e['runs']}, {e['top3']}, {e['cause_right']} "
                         f"({', '.join(f'{k}: {v}' for k, v in sorted(e['causes'].items()))})")
        lines.append(f"| {fault} | " + " | ".join(cells) + " |")
    stopped = [line for h in halves for line in scores[h]["stopped_by_cockpit"]]
    if stopped:
        lines += ["", "Stopped by the cockpit:", ""] + [f"- {line}" for line in stopped]
    return "\n".join(lines)


def tune(results: list[dict], show: int = 10) -> None:
    """Grid search on the tuning half: the settings that keep at most 1 healthy run in 20 alarmed, ranked by
    spikes caught with the cause right plus row-caused spikes with an injected row in the top 3 (ties: fewer
    alarms before the onset, then fewer healthy alarms). Prints the best ``show``; the library's defaults are
    set by hand from them."""
    from cockpit_like.spikes.corpus import score

    ranked = []
    grid = itertools.product((5.0, 6.0, 7.0, 8.0), (1.3, 1.5), (2.0, 3.0, 4.0), (0.05, 0.1), (1.5, 2.0, 3.0))
    for z, loss_ratio, grad_ratio, loss_gap, batch_shift in grid:
        detector = {"z": z, "loss_ratio": loss_ratio, "grad_ratio": grad_ratio, "loss_gap": loss_gap}
        causes = {"batch_shift": batch_shift}
        s = score(results, detector, causes)
        if s["healthy_alarm_rate"] > 1 / 20:
            continue
        key = (s["cause_right"] + s["rows_in_top3"], -s["early_alarms"], -s["healthy_with_post_mortem"])
        ranked.append((key, detector, causes, s))
    if not ranked:
        print("no setting keeps healthy alarms at or below 1 in 20")
        return
    ranked.sort(key=lambda item: item[0], reverse=True)
    for key, detector, causes, s in ranked[:show]:
        print(key, detector, causes, f"caught {s['caught']}/{s['faulty_runs']} cause {s['cause_right']} "
              f"top3 {s['rows_in_top3']}/{s['row_spikes']} healthy {s['healthy_with_post_mortem']}/{s['healthy_runs']}")


def main(argv=None) -> int:
    from cockpit_like.spikes.corpus import SPLIT, score

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--half", choices=("tuning", "held-out", "gpt2-small", "both", "all"), default="all",
                        help="both: the two halves; all (default): with the GPT-2 small slice, read from the cache "
                             "when it was trained (--half gpt2-small), left out otherwise")
    parser.add_argument("--update-doc", action="store_true", help="write the table into docs/spikes.md")
    parser.add_argument("--tune", action="store_true", help="grid-search thresholds on the tuning half")
    parser.add_argument("--show", action="store_true", help="print each run as it is trained")
    parser.add_argument("--seeds", default="0,1", help="draws of runs per half (default 0,1)")
    parser.add_argument("--gpt2-seeds", default="0,1", help="draws of the GPT-2 small slice (default 0,1: 2 x 6 runs)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "spike_corpus.json",
                        help="where the scores go (default: the tracked benchmarks/results/spike_corpus.json)")
    args = parser.parse_args(argv)
    halves = ["tuning", "held-out"] if args.half in ("both", "all") else [args.half]
    started = time.perf_counter()
    seeds = tuple(int(seed) for seed in args.seeds.split(","))
    gpt2_seeds = tuple(int(seed) for seed in args.gpt2_seeds.split(","))
    results = {half: run_half(half, show=args.show, seeds=gpt2_seeds if half == "gpt2-small" else seeds)
               for half in halves}
    if args.half == "all" and _cached(gpt2_seeds):
        halves.append("gpt2-small")
        results["gpt2-small"] = run_half("gpt2-small", seeds=gpt2_seeds)
    if args.tune:  # (the defaults were set on the tuning half's seed 0)
        tune(results.get("tuning") or run_half("tuning", show=args.show, seeds=seeds))
        return 0
    scores = {half: {**score(results[half]), "archs": list(SPLIT.get(half, (half,)))} for half in halves}
    text = table(scores)
    print(text)
    seconds = {half: sum(r["seconds"] for r in results[half]) for half in halves}
    summary = args.out
    summary.write_text(json.dumps({"seeds": list(seeds), "scores": scores, "training_seconds": seconds}, indent=1,
                                  default=str) + "\n")
    print(f"training seconds per half: {seconds}; this call took {time.perf_counter() - started:.0f}s")
    if args.update_doc:
        doc = DOC.read_text()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
        head, rest = doc.split(BEGIN, 1)
        DOC.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
        print(f"wrote the table into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
