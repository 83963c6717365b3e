"""Findings as text: the table and the JSON of ``cockpit-like diagnose``."""

from __future__ import annotations

import json
import textwrap
from typing import Any

from cockpit_like.diagnosis.causes import Incident, group_findings, since
from cockpit_like.diagnosis.engine import DiagnosisReport
from cockpit_like.diagnosis.findings import Finding

__all__ = ["format_table", "format_incidents", "to_json", "exit_status"]

_HEADER = ("severity", "step", "rule", "layer", "finding")


def _rows(findings: list[Finding], width: int) -> list[tuple[str, ...]]:
    rows = []
    for finding in findings:
        text = finding.message + (f" -- fix: {finding.fix}" if finding.fix else "")
        lines = textwrap.wrap(text, width) or [""]
        rows.append((finding.severity.upper(), str(finding.step), finding.rule, finding.layer or "-", lines[0]))
        rows.extend(("", "", "", "", line) for line in lines[1:])
    return rows


def _listing(findings: list[Finding]) -> str:
    """``rule (layers; from step S[, found at step N]), ...``: per rule, in the order found, the layers it
    named, where its first finding's evidence starts and, when later, the step that finding was made at."""
    by_rule: dict[str, list[Finding]] = {}
    for finding in sorted(findings, key=lambda f: f.step):
        by_rule.setdefault(finding.rule, []).append(finding)
    parts = []
    for rule, found in by_rule.items():
        layers = list(dict.fromkeys(f.layer for f in found if f.layer))
        named = ", ".join(layers[:3]) + (f" +{len(layers) - 3}" if len(layers) > 3 else "")
        start, step = since(found[0]), found[0].step
        span = f"from step {start}" + (f", found at step {step}" if step != start else "")
        parts.append(f"{rule} ({named + '; ' if named else ''}{span})")
    return "; ".join(parts)


def format_incidents(incidents: list[Incident], width: int = 72) -> list[str]:
    """The grouped diagnosis as text: per incident the cause, its evidence, the symptoms it explains, the fix."""
    lines = []
    for number, incident in enumerate(incidents, 1):
        lines.append(f"{number}. {incident.severity.upper()} {incident.cause} ({incident.span()}): {incident.title}")
        for label, text in (("evidence", _listing(incident.evidence)), ("symptoms", _listing(incident.symptoms)),
                            ("fix", incident.fix)):
            if text:
                wrapped = textwrap.wrap(f"{label}: {text}", width, subsequent_indent="     ",
                                        break_on_hyphens=False)
                lines.extend("   " + line for line in wrapped)
    return lines


def format_table(report: DiagnosisReport, path: str = "", width: int = 72, active_only: bool = False) -> str:
    """The grouped diagnosis (cause, evidence, symptoms, fix), then the findings (or only the active
    ones) as an aligned table, then the notes of skipped rules."""
    findings = report.active if active_only else report.findings
    counts = {severity: sum(f.severity == severity for f in findings) for severity in ("error", "warning", "info")}
    summary = ", ".join(f"{n} {severity}{'s' if n != 1 else ''}" for severity, n in counts.items())
    lines = [f"{path + ': ' if path else ''}{len(findings)} finding{'s' if len(findings) != 1 else ''} ({summary})"]
    incidents = group_findings(report.findings)  # the causes read in the context of every finding
    if active_only:
        # the incidents that still hold: with an active finding among theirs (grouping the active findings alone
        # lost that context: a run at a 100x learning rate listed its dead units first, as if from the start, with
        # an initialization fix, where the whole diagnosis and --json name the learning rate; outside trial 10)
        live = {id(f) for f in report.active}
        incidents = [i for i in incidents if any(id(f) in live for f in i.evidence + i.symptoms)]
    if incidents:
        lines.append("")
        lines.append(f"diagnosis ({len(incidents)} incident{'s' if len(incidents) != 1 else ''}, cause first):")
        lines.extend(format_incidents(incidents, width))
        lines.append("")
    if findings:
        rows = _rows(findings, width)
        widths = [max(len(row[i]) for row in [_HEADER, *rows]) for i in range(len(_HEADER) - 1)]
        def line(row):
            return "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths)) + "  " + row[-1]
        lines.append(line(_HEADER))
        lines.append("  ".join("-" * w for w in widths) + "  " + "-" * min(width, 40))
        lines.extend(line(row).rstrip() for row in rows)
    if report.notes:
        lines.append("")
        lines.extend(f"note: {note}" for note in report.notes.values())
    return "\n".join(lines)


def to_json(report: DiagnosisReport, path: str = "") -> str:
    """``{"log", "incidents", "findings", "active", "notes", "errors"}`` as JSON text (NaN and infinities
    written as the strings ``"NaN"``, ``"Infinity"``, as in the logs)."""
    from cockpit_like.logs import encode

    document: dict[str, Any] = {"log": path, **report.to_dict(), "errors": report.has_errors}
    return json.dumps(encode(document), indent=1, allow_nan=False)


def exit_status(report: DiagnosisReport) -> int:
    """1 when an ``error`` finding is present, else 0 (2, bad usage, is the command line's)."""
    return 1 if report.has_errors else 0
