"""The rule ``loss-spike``: a stored post-mortem (``PostMortem``, :mod:`cockpit_like.spikes`) as a finding.

The post-mortem quantity finds the spike and names its cause; this rule only
reads what it stored, so the spike shows where findings show (the dashboard,
``cockpit-like diagnose``, ``on_finding``). Imports no torch, like every rule.
"""

from __future__ import annotations

from typing import Any

from cockpit_like.diagnosis.findings import Finding
from cockpit_like.diagnosis.history import RunHistory
from cockpit_like.diagnosis.rule import Rule

__all__ = ["LossSpike", "FIXES"]

#: what to try, by the post-mortem's cause
FIXES = {
    "bad-rows": "inspect the rows named (their sample ids) in the data pipeline; drop or repair them, or skip "
                "the batch; clip gradients to bound one row's pull",
    "precision": "the fp16 loss scale overflowed: use bf16, keep the loss and the softmax in fp32, or lower the "
                 "GradScaler's growth (growth_interval) / its init_scale",
    "learning-rate": "check the learning-rate schedule at that step; lower the peak rate or lengthen the warmup",
    "curvature": "the sharpness is past 2/lr: lower the learning rate, add warmup, or clip gradients",
    "unknown": "look at the post-mortem's layers and rows (cockpit-like spikes LOG); clip gradients meanwhile",
}


def _row_text(row: dict[str, Any]) -> str:
    who = (f"step {row['step']} " if row.get("step") is not None else "") + f"row {row['row']}" + (
        f" (id {row['id']})" if row.get("id") is not None else "")
    return f"{who}: share {row['share']:.0%}, loss {row['loss']:.3g}"


class LossSpike(Rule):
    """A spike of the loss or the gradient norm, with the post-mortem's cause (reported at the spike's step)."""

    id = "loss-spike"
    severity = "warning"
    reads = ("PostMortem",)

    def check(self, history: RunHistory) -> list[Finding]:
        step, post = history.last("PostMortem")[0]
        if step != history.latest_step or not isinstance(post, dict):
            return []
        trigger = post.get("trigger", {})
        series = [name for name in trigger.get("series", [])]
        rises = ", ".join(f"{name.replace('_', ' ')} {trigger[name]['ratio']:.3g}x its window's median"
                          for name in series if isinstance(trigger.get(name), dict))
        if "loss_scale" in series:
            rises = ", ".join(filter(None, [rises, f"{trigger.get('skipped')} steps skipped by the GradScaler"]))
        rows = post.get("suspects") or post.get("rows_by_share") or []
        cause = post.get("cause", "unknown")
        message = (f"spike at step {step} ({rises}); likeliest cause: {cause} ({post.get('why', '')})"
                   + (f"; {'suspect' if post.get('suspects') else 'top row by share'} {_row_text(rows[0])}"
                      if rows else ""))
        return [self.finding(
            step, message, fix=FIXES.get(cause, FIXES["unknown"]),
            evidence={"strength": post.get("strength", "suggestive"), "cause": cause, "series": series,
                      "rows": [{k: r.get(k) for k in ("step", "row", "id", "share", "loss")} for r in rows[:3]]},
        )]
