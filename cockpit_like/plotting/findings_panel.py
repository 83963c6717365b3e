"""The check-engine panel: the active findings of a run, coloured by severity.

A pure draw function of stored data (:class:`~cockpit_like.plotting.data.RunData`):
it lists the findings stored under ``"findings"`` that no later
``"findings_cleared"`` entry cleared (:func:`cockpit_like.diagnosis.active_findings`),
most severe first, so a live cockpit and its log draw the same panel.
"""

from __future__ import annotations

import textwrap

from typing import Any

from cockpit_like.diagnosis.findings import FINDINGS_KEY, active_findings, severity_rank
from cockpit_like.plotting.data import RunData

__all__ = ["SEVERITY_COLORS", "draw_findings", "MAX_LINES"]

#: text colour per severity
SEVERITY_COLORS = {"error": "#c00000", "warning": "#d97a00", "info": "#1f5fa8"}
#: most findings listed; the rest are counted
MAX_LINES = 6


def draw_findings(ax, data: RunData, options: Any) -> None:
    """List the active findings (severity, rule, layer, step, message), most severe first.

    Without any stored finding the panel is the blank "not tracked" one
    (the light is off): either the run was not diagnosed or nothing was found.
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
    found = sorted(active_findings(data.steps), key=lambda f: (-severity_rank(f.severity), f.step))
    if not found:
        ax.text(0.5, 0.5, "no active findings\n(earlier ones cleared)", ha="center", va="center", fontsize=8,
                color="#2a7a2a", gid="findings:none", transform=ax.transAxes)
        return
    worst = found[0].severity
    for spine in ax.spines.values():
        spine.set_color(SEVERITY_COLORS[worst])
        spine.set_linewidth(1.5)
    y, shown = 0.97, 0
    for finding in found[:MAX_LINES]:
        where = f" {finding.layer}" if finding.layer else ""
        head = f"● {finding.severity.upper()} {finding.rule}{where} (step {finding.step})"
        wrapped = textwrap.fill(textwrap.shorten(finding.message, 110, placeholder=" ..."), 58)
        height = 0.075 * (wrapped.count("\n") + 2) + 0.02
        if shown and y - height < 0.1:
            break
        ax.text(0.02, y, head, ha="left", va="top", fontsize=7, fontweight="bold",
                color=SEVERITY_COLORS[finding.severity], gid=f"finding:{finding.severity}:{finding.rule}",
                transform=ax.transAxes)
        ax.text(0.04, y - 0.075, wrapped, ha="left", va="top", fontsize=6, color="#333333", transform=ax.transAxes)
        y -= height
        shown += 1
    if len(found) > shown:
        ax.text(0.98, 0.02, f"+{len(found) - shown} more (cockpit-like diagnose)", ha="right", va="bottom",
                fontsize=6.5, color="#555555", gid="findings:more", transform=ax.transAxes)
