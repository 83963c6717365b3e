"""Scoring the rules against labelled runs: recall, precision, false alarms, delay, root cause.

A labelled run is ``(problem, onset, findings)``: ``problem`` is a cause id
(:data:`~cockpit_like.diagnosis.causes.CAUSES`) or None for a healthy run,
``onset`` the step where the problem starts, ``findings`` what the rules
reported (``diagnose(...).findings``). Only findings of severity ``warning``
or above count as alarms.

Per run (:func:`score_run`):

- **detected**: a problem run with an alarm at or after its onset;
- **delay**: the first such alarm's step minus the onset (tracked steps, as
  every corpus step is tracked);
- **early alarms**: alarms before the onset (a problem that starts later);
- **root cause**: the first incident opened by an alarm
  (:func:`~cockpit_like.diagnosis.causes.group_findings`) names the label;
- on a healthy run, every alarm is a **false alarm**;
- **info findings** (``step-too-short``, ``noise-dominated``) are kept
  apart, with the first step of each rule, and ``skipped`` lists the rules
  that could not run (their inputs were not tracked).

Over runs (:func:`summarize`): recall (detected problem runs / problem runs),
precision (problem runs with an alarm / runs with an alarm), false alarms
per healthy run (alarms counted per ``(rule, layer)``), healthy runs with an
alarm, the median delay, root-cause accuracy (over problem runs); per rule:
the runs it alarmed on, its precision, its recall over the problem runs whose
label it is evidence of, its false alarms per healthy run and its median
delay; per problem: recall and root-cause accuracy. A rule's recall counts
only the problem runs it could run on (a rule that needs ``HessMaxEV`` is not
missing a run that did not track it). Info rules get figures of their own
(:data:`INFO_LABELS`): runs with the finding, healthy runs with it, and the
share of the problem runs of the label it suggests (where it could run).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import math

import numpy as np

from cockpit_like.diagnosis.causes import cause_of, group_findings
from cockpit_like.diagnosis.findings import Finding, severity_rank

__all__ = ["score_run", "summarize", "format_summary", "format_generated", "wilson", "INFO_LABELS"]

#: the corpus label each ``info`` rule's suggestion points at (its cause is not a labelled fault)
INFO_LABELS = {"step-too-short": "learning-rate-too-small", "noise-dominated": "batch-too-small"}


def _alarms(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if severity_rank(f.severity) >= severity_rank("warning")]


def score_run(problem: str | None, onset: int, findings: list[Finding],
              skipped: Iterable[str] = ()) -> dict[str, Any]:
    """What the findings of one labelled run score (see the module docstring); ``skipped``: the ids
    of the rules that could not run (``diagnose(...).notes``)."""
    alarms = sorted(_alarms(findings), key=lambda f: f.step)
    incidents = [i for i in group_findings(findings) if severity_rank(i.severity) >= 1]
    first_cause = incidents[0].cause if incidents else None
    result: dict[str, Any] = {
        "problem": problem, "onset": int(onset), "alarms": len({f.key for f in alarms}),
        "rules": sorted({f.rule for f in alarms}), "first_cause": first_cause,
        "causes": [i.cause for i in incidents], "skipped": sorted(skipped),
        "info": {},
    }
    for finding in sorted(findings, key=lambda f: f.step):
        if severity_rank(finding.severity) < severity_rank("warning"):
            result["info"].setdefault(finding.rule, finding.step)
    per_rule: dict[str, dict[str, Any]] = {}
    for finding in alarms:
        entry = per_rule.setdefault(finding.rule, {"first_step": finding.step, "layers": set(), "causes": set()})
        entry["layers"].add(finding.layer)
        entry["causes"].add(cause_of(finding, alarms))
    result["per_rule"] = {
        rule: {"first_step": e["first_step"], "count": len(e["layers"]), "causes": sorted(e["causes"])}
        for rule, e in per_rule.items()
    }
    if problem is None:
        result.update(detected=False, delay=None, early_alarms=0, root_cause=None)
        return result
    after = [f for f in alarms if f.step >= onset]
    result.update(
        detected=bool(after),
        delay=(after[0].step - onset) if after else None,
        early_alarms=len({f.key for f in alarms if f.step < onset}),
        root_cause=first_cause == problem,
    )
    return result


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def summarize(scored: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures over scored runs (from :func:`score_run`), overall, per rule and per problem."""
    problems = [s for s in scored if s["problem"] is not None]
    healthy = [s for s in scored if s["problem"] is None]
    alarmed = [s for s in scored if s["alarms"]]
    delays = [s["delay"] for s in problems if s["delay"] is not None]
    overall = {
        "runs": len(scored), "problem_runs": len(problems), "healthy_runs": len(healthy),
        "recall": sum(s["detected"] for s in problems) / len(problems) if problems else None,
        "precision": sum(s["problem"] is not None for s in alarmed) / len(alarmed) if alarmed else None,
        "false_alarms_per_healthy_run": sum(s["alarms"] for s in healthy) / len(healthy) if healthy else None,
        "healthy_runs_with_alarm": sum(bool(s["alarms"]) for s in healthy),
        "median_delay": _median(delays),
        "root_cause_accuracy": sum(bool(s["root_cause"]) for s in problems) / len(problems) if problems else None,
        "early_alarm_runs": sum(bool(s["early_alarms"]) for s in problems),
    }
    rules = sorted({rule for s in scored for rule in s["per_rule"]})
    per_rule = {}
    for rule in rules:
        fired = [s for s in scored if rule in s["per_rule"]]
        targets = {cause for s in fired for cause in s["per_rule"][rule]["causes"]}
        relevant = [s for s in problems if s["problem"] in targets and rule not in s.get("skipped", ())]
        rule_delays = [s["per_rule"][rule]["first_step"] - s["onset"] for s in fired
                       if s["problem"] is not None and s["per_rule"][rule]["first_step"] >= s["onset"]]
        per_rule[rule] = {
            "runs": len(fired),
            "precision": sum(s["problem"] is not None for s in fired) / len(fired),
            "recall": (sum(rule in s["per_rule"] for s in relevant) / len(relevant)) if relevant else None,
            "false_alarms_per_healthy_run": (sum(s["per_rule"][rule]["count"] for s in healthy if rule in s["per_rule"])
                                             / len(healthy)) if healthy else None,
            "median_delay": _median(rule_delays),
        }
    per_problem = {}
    for problem in sorted({s["problem"] for s in problems}):
        runs = [s for s in problems if s["problem"] == problem]
        per_problem[problem] = {
            "runs": len(runs),
            "recall": sum(s["detected"] for s in runs) / len(runs),
            "root_cause_accuracy": sum(bool(s["root_cause"]) for s in runs) / len(runs),
            "median_delay": _median([s["delay"] for s in runs if s["delay"] is not None]),
            "first_causes": sorted({str(s["first_cause"]) for s in runs}),
        }
    per_info = {}
    for rule in sorted({rule for s in scored for rule in s.get("info", {})} | set(INFO_LABELS)):
        could = [s for s in scored if rule not in s.get("skipped", ())]
        if not could:
            continue
        fired = [s for s in could if rule in s.get("info", {})]
        label = INFO_LABELS.get(rule)
        relevant = [s for s in could if label is not None and s["problem"] == label]
        per_info[rule] = {
            "could_run": len(could), "runs": len(fired),
            "healthy_runs": sum(s["problem"] is None for s in fired),
            "healthy_could_run": sum(s["problem"] is None for s in could),
            "label": label, "label_runs": len(relevant),
            "recall": (sum(rule in s["info"] for s in relevant) / len(relevant)) if relevant else None,
        }
    return {"overall": overall, "per_rule": per_rule, "per_problem": per_problem, "per_info": per_info}


def _cell(value: Any, percent: bool = False) -> str:
    if value is None:
        return "-"
    if percent:
        return f"{100 * value:.0f}%"
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return str(value)


def format_summary(halves: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown tables of :func:`summarize` results, one column (or block) per half."""
    names = list(halves)
    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    rows = [("runs (problem / healthy)", lambda o: f"{o['runs']} ({o['problem_runs']} / {o['healthy_runs']})"),
            ("recall", lambda o: _cell(o["recall"], True)),
            ("precision", lambda o: _cell(o["precision"], True)),
            ("false alarms per healthy run", lambda o: _cell(o["false_alarms_per_healthy_run"])),
            ("healthy runs with an alarm", lambda o: _cell(o["healthy_runs_with_alarm"])),
            ("median detection delay (steps)", lambda o: _cell(o["median_delay"])),
            ("root cause named first", lambda o: _cell(o["root_cause_accuracy"], True)),
            ("problem runs with an alarm before the onset", lambda o: _cell(o["early_alarm_runs"]))]
    for label, get in rows:
        lines.append(f"| {label} | " + " | ".join(get(halves[n]["overall"]) for n in names) + " |")
    lines += ["", "Per rule (" + " / ".join(names) + "): runs alarmed, precision, recall over the problems it "
              "points at, false alarms per healthy run, median delay", "",
              "| rule | runs | precision | recall | false alarms / healthy run | median delay |",
              "|---|---|---|---|---|---|"]
    rules = sorted({rule for n in names for rule in halves[n]["per_rule"]})
    for rule in rules:
        cells = []
        for key, percent in (("runs", False), ("precision", True), ("recall", True),
                             ("false_alarms_per_healthy_run", False), ("median_delay", False)):
            cells.append(" / ".join(_cell(halves[n]["per_rule"].get(rule, {}).get(key), percent) for n in names))
        lines.append(f"| `{rule}` | " + " | ".join(cells) + " |")
    lines += ["", "Per problem (" + " / ".join(names) + "): recall, root cause named first, median delay, "
              "first causes named", "", "| problem | runs | recall | root cause | median delay | first cause named |",
              "|---|---|---|---|---|---|"]
    problems = sorted({p for n in names for p in halves[n]["per_problem"]})
    for problem in problems:
        cells = []
        for key, percent in (("runs", False), ("recall", True), ("root_cause_accuracy", True), ("median_delay", False)):
            cells.append(" / ".join(_cell(halves[n]["per_problem"].get(problem, {}).get(key), percent) for n in names))
        firsts = " / ".join(", ".join(halves[n]["per_problem"].get(problem, {}).get("first_causes", []))
                            or "-" for n in names)
        lines.append(f"| {problem} | " + " | ".join(cells) + f" | {firsts} |")
    infos = sorted({rule for n in names for rule in halves[n].get("per_info", {})})
    if infos:
        lines += ["", "Info rules (" + " / ".join(names) + "; never alarms): runs it could run on, runs with the "
                  "finding, healthy runs with it, share of the runs of the label it suggests", "",
                  "| rule | could run | runs with it | healthy runs with it | label | label runs with it |",
                  "|---|---|---|---|---|---|"]
        for rule in infos:
            got = [halves[n].get("per_info", {}).get(rule, {}) for n in names]
            label = next((g.get("label") for g in got if g.get("label")), None) or "-"
            lines.append(
                f"| `{rule}` | " + " / ".join(_cell(g.get("could_run")) for g in got)
                + " | " + " / ".join(_cell(g.get("runs")) for g in got)
                + " | " + " / ".join(f"{_cell(g.get('healthy_runs'))} of {_cell(g.get('healthy_could_run'))}"
                                     for g in got)
                + f" | {label} | " + " / ".join(
                    "-" if not g.get("label_runs") else f"{_cell(g.get('recall'), True)} of {g['label_runs']}"
                    for g in got) + " |")
    return "\n".join(lines)


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float] | None:
    """The Wilson score interval of a rate ``successes / trials`` (95% for ``z = 1.96``); None for no trials."""
    if trials <= 0:
        return None
    p = successes / trials
    denominator = 1.0 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * np.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return float(max(0.0, center - half)), float(min(1.0, center + half))


def _rate(successes: int, trials: int) -> str:
    interval = wilson(successes, trials)
    if interval is None:
        return "-"
    return f"{successes}/{trials} = {100 * successes / trials:.1f}% [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]"


def format_generated(halves: Mapping[str, list[dict[str, Any]]], dropped: Mapping[str, Any] | None = None,
                     cost: Mapping[str, float] | None = None) -> str:
    """Markdown tables for generated runs scored with :func:`score_run` (each with ``"fault"``), per half:
    rates with 95% Wilson intervals; ``dropped``: per half, healthy draws that failed their own check
    (or a pair: those, and runs whose training raised);
    ``cost``: the rules' seconds per tracked step."""
    names = list(halves)
    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, get) -> None:
        lines.append(f"| {label} | " + " | ".join(get(halves[n], n) for n in names) + " |")

    def problems(runs):
        return [s for s in runs if s["problem"] is not None]

    def healthy(runs):
        return [s for s in runs if s["problem"] is None]

    row("runs (problem / healthy)", lambda r, n: f"{len(r)} ({len(problems(r))} / {len(healthy(r))})")
    if dropped is not None:
        def left_out(r, n):
            value = dropped.get(n, 0)
            return " + ".join(str(v) for v in value) if isinstance(value, (tuple, list)) else str(value)

        row("left out: healthy draws that failed their own loss check" + (
            " + runs whose training raised" if any(isinstance(v, (tuple, list)) for v in dropped.values()) else ""),
            left_out)
    row("healthy runs with an alarm (95% interval)",
        lambda r, n: _rate(sum(bool(s["alarms"]) for s in healthy(r)), len(healthy(r))))
    row("alarms per healthy run", lambda r, n: _cell(sum(s["alarms"] for s in healthy(r)) / max(len(healthy(r)), 1)))
    row("recall", lambda r, n: _rate(sum(s["detected"] for s in problems(r)), len(problems(r))))
    row("cause named first", lambda r, n: _rate(sum(bool(s["root_cause"]) for s in problems(r)), len(problems(r))))
    row("median delay (steps)", lambda r, n: _cell(_median([s["delay"] for s in problems(r) if s["delay"] is not None])))
    row("problem runs with an alarm before the onset", lambda r, n: str(sum(bool(s["early_alarms"]) for s in problems(r))))
    if cost is not None:
        row("rules' cost per tracked step", lambda r, n: f"{1e3 * cost.get(n, math.nan):.2f} ms")
    lines += ["", "Per rule (" + " / ".join(names) + "): healthy runs it alarmed on (95% interval), and the problem "
              "runs it alarmed on", "", "| rule | " + " | ".join(f"false alarms ({n})" for n in names)
              + " | " + " | ".join(f"problem runs ({n})" for n in names) + " |", "|---|" + "---|" * (2 * len(names))]
    rules = sorted({rule for n in names for s in halves[n] for rule in s["per_rule"]})
    for rule in rules:
        cells = [_rate(sum(rule in s["per_rule"] for s in healthy(halves[n])), len(healthy(halves[n]))) for n in names]
        cells += [str(sum(rule in s["per_rule"] for s in problems(halves[n]))) for n in names]
        lines.append(f"| `{rule}` | " + " | ".join(cells) + " |")
    lines += ["", "Per fault (" + " / ".join(names) + "): runs, detected, cause named first, median delay; the "
              "first causes named (held-out half)", "",
              "| fault | expected cause | runs | detected | cause first | median delay | first causes named |",
              "|---|---|---|---|---|---|---|"]
    faults = sorted({s["fault"] for n in names for s in problems(halves[n])})
    for fault in faults:
        per = {n: [s for s in problems(halves[n]) if s["fault"] == fault] for n in names}
        expected = next(s["problem"] for n in names for s in per[n])
        cells = [" / ".join(str(len(per[n])) for n in names),
                 " / ".join(str(sum(s["detected"] for s in per[n])) for n in names),
                 " / ".join(str(sum(bool(s["root_cause"]) for s in per[n])) for n in names),
                 " / ".join(_cell(_median([s["delay"] for s in per[n] if s["delay"] is not None])) for n in names)]
        last = per[names[-1]]
        named = {}
        for s in last:
            named[str(s["first_cause"])] = named.get(str(s["first_cause"]), 0) + 1
        lines.append(f"| {fault} | {expected} | " + " | ".join(cells) + " | "
                     + ", ".join(f"{k} {v}" for k, v in sorted(named.items(), key=lambda kv: -kv[1])) + " |")
    return "\n".join(lines)
