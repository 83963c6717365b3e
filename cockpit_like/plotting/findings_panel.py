"""The check-engine panel: the active findings of a run, coloured by severity.

A pure draw function of stored data (:class:`~cockpit_like.plotting.data.RunData`):
it groups the findings stored under ``"findings"`` by cause
(:func:`cockpit_like.diagnosis.group_findings`) and lists the incidents that
still have a finding no later ``"findings_cleared"`` entry cleared, most
severe first, so a live cockpit and its log draw the same panel.
"""

from __future__ import annotations

import textwrap

from typing import Any

from cockpit_like.diagnosis.causes import group_findings
from cockpit_like.diagnosis.findings import FINDINGS_KEY, active_findings, findings_in, severity_rank
from cockpit_like.plotting.data import RunData

__all__ = ["SEVERITY_COLORS", "draw_findings", "MAX_LINES"]

#: text colour per severity
SEVERITY_COLORS = {"error": "#c00000", "warning": "#d97a00", "info": "#1f5fa8"}
#: most incidents (or findings without a known cause) listed; the rest are counted
MAX_LINES = 6


def draw_findings(ax, data: RunData, options: Any) -> None:
    """The grouped diagnosis: per incident with an active finding, the cause (severity, cause id,
    from which step), the evidence, the symptoms it explains and the fix; most severe first.

    Incidents come from every stored finding
    (:func:`~cockpit_like.diagnosis.causes.group_findings`), so a cause whose
    own finding cleared still heads the symptoms it left behind; an incident
    is listed while one of its findings is active. Findings no known cause
    explains (custom rules) are listed one by one as before. Without any
    stored finding the panel is the blank "not tracked" one (the light is
    off): either the run was not diagnosed or nothing was found.
    """
    from cockpit_like.plotting.instruments import not_tracked

    if not data.has(FINDINGS_KEY):
        not_tracked(ax, "Check engine", (), "no findings stored:\nCockpit(..., diagnose=True)\nor cockpit-like diagnose LOG")
        return
    ax.set_title("Check engine", fontsize=10, fontweight="bold")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    active = {(f.rule, f.layer, f.step) for f in active_findings(data.steps)}
    incidents = [incident for incident in group_findings(findings_in(data.steps))
                 if any((f.rule, f.layer, f.step) in active for f in incident.findings)]
    incidents.sort(key=lambda i: (-severity_rank(i.severity), i.step))
    if not incidents:
        ax.text(0.5, 0.5, "no active findings\n(earlier ones cleared)", ha="center", va="center", fontsize=8,
                color="#2a7a2a", gid="findings:none", transform=ax.transAxes)
        return
    worst = incidents[0].severity
    for spine in ax.spines.values():
        spine.set_color(SEVERITY_COLORS[worst])
        spine.set_linewidth(1.5)
    blocks = []  # (gid, head, severity, body)
    for incident in incidents:
        if incident.cause == "other":
            for finding in incident.findings:
                if (finding.rule, finding.layer, finding.step) not in active:
                    continue
                where = f" {finding.layer}" if finding.layer else ""
                body = textwrap.fill(textwrap.shorten(finding.message, 110, placeholder=" ..."), 58)
                blocks.append((f"finding:{finding.severity}:{finding.rule}",
                               f"● {finding.severity.upper()} {finding.rule}{where} (step {finding.step})",
                               finding.severity, body))
            continue
        evidence = _rules(incident.evidence)
        symptoms = _rules(incident.symptoms)
        text = f"{incident.title}. Evidence: {evidence}."
        if symptoms:
            text += f" Explains: {symptoms}."
        body = textwrap.fill(textwrap.shorten(text, 300, placeholder=" ..."), 66, break_on_hyphens=False)
        body += "\n" + textwrap.fill(textwrap.shorten("Fix: " + incident.fix, 200, placeholder=" ..."), 66,
                                     break_on_hyphens=False)
        blocks.append((f"incident:{incident.severity}:{incident.cause}",
                       f"● {incident.severity.upper()} {incident.cause} ({incident.span()})",
                       incident.severity, body))
    y, shown = 0.97, 0
    for gid, head, severity, body in blocks[:MAX_LINES]:
        height = 0.072 * (body.count("\n") + 2) + 0.02
        if shown and y - height < 0.1:
            break
        ax.text(0.02, y, head, ha="left", va="top", fontsize=7, fontweight="bold",
                color=SEVERITY_COLORS[severity], gid=gid, transform=ax.transAxes)
        ax.text(0.04, y - 0.072, body, ha="left", va="top", fontsize=6, color="#333333", transform=ax.transAxes,
                gid=gid.replace(":", "-body:", 1))
        y -= height
        shown += 1
    if len(blocks) > shown:
        ax.text(0.98, 0.02, f"+{len(blocks) - shown} more (cockpit-like diagnose)", ha="right", va="bottom",
                fontsize=6.5, color="#555555", gid="findings:more", transform=ax.transAxes)


def _rules(findings: list) -> str:
    """``rule (N layers), rule``: which rules saw it, how many layers each."""
    layers: dict[str, set] = {}
    for finding in findings:
        layers.setdefault(finding.rule, set()).add(finding.layer)
    return ", ".join(f"{rule} ({len(n)} layers)" if len(n) > 1 else rule for rule, n in layers.items())
