"""The likeliest cause of a spike, from a post-mortem's evidence (plain data in, plain data out).

Causes, checked in this order (the first whose evidence holds is named; the
others' checks are kept beside it):

1. ``"precision"``: a ``GradScaler`` was in play and its scale dropped since
   the previous tracked step (it skipped steps: non-finite scaled gradients)
   or the loss is not finite: an fp16 overflow (tracked steps missing while
   the scale held are not the scaler's: a step whose self-check failed);
2. ``"learning-rate"``: the learning rate of the step is at least
   ``lr_jump`` x the median of the window before it (a jump, not a ramp);
3. ``"curvature"``: the sharpness is tracked (``HessMaxEV``) and
   ``lambda_max >= sharpness x 2 / lr`` (past the stability limit of
   gradient descent) while no row stands out;
4. ``"bad-rows"``: rows stand out: the rows whose loss is an outlier against
   the previous steps' rows (robust z >= ``row_z``) carry at least
   ``outlier_share`` of the step's gradient, or one row carries at least
   ``top_share`` of it (and ``top_factor / B``), or a row of one of the
   ``earlier_steps`` steps before carried at least ``top_share`` of that step's
   gradient (its update made this spike: a spike often shows one step after
   the bad row, once its update landed), or the whole batch's median
   row loss is at least ``batch_shift`` spreads above the previous steps' (a bad
   batch: with the learning rate unchanged and the sharpness not past 2/lr or
   not tracked, the data is the likeliest cause; a slow blow-up of a too
   large learning rate looks the same when the sharpness is not tracked);
5. ``"unknown"``: none of these.

Without per-sample gradients (``rows["gradients"]`` False: a BatchNorm in
training mode couples the rows), a row's share of the batch's loss rise above
the previous steps' rows (``outlier_loss_share``, ``top_loss_share``) stands
in for its share of the gradient, with the same thresholds (not tuned for it),
and the suspects are the top rows by loss.

``suspects`` names the rows behind a ``bad-rows`` cause, at most 3, each
with its step: the step's top rows by share when they stand out, else the
earlier rows, else (a bad batch) the step's top rows by share.

The defaults were set on the tuning half of the spike corpus
(``benchmarks/spike_corpus.py``; ``docs/spikes.md`` reports the other half).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CAUSES", "name_cause"]

CAUSES = ("bad-rows", "precision", "learning-rate", "curvature", "unknown")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _batch_median(shift: Any, baseline: Any, spread: Any) -> str:
    """The clause on the whole batch: its median row loss (``baseline + shift x spread``), the previous steps'
    median row loss and their spread, and the shift in spreads (``median_shift``, a robust z-score); "" when
    not known."""
    if not _finite(shift):
        return ""
    side = "above" if shift >= 0 else "below"
    if not (_finite(baseline) and _finite(spread)):
        return f"; the batch's median row loss is {abs(shift):.3g} spreads {side} the previous steps' median row loss"
    median = baseline + shift * spread
    return (f"; the batch's median row loss is {median:.3g} against the previous steps' {baseline:.3g} "
            f"(spread {spread:.3g}): {abs(shift):.3g} spreads {side}")


def name_cause(evidence: dict[str, Any], lr_jump: float = 1.5, sharpness: float = 1.0, outlier_share: float = 0.5,
               top_share: float = 0.3, top_factor: float = 4.0, batch_shift: float = 1.5,
               earlier_steps: int = 2) -> dict[str, Any]:
    """``{"cause", "why", "strength", "checks", "suspects"}`` from ``evidence`` with the keys ``precision``,
    ``learning_rate``, ``rows``, ``sharpness``, ``step``, ``rows_by_share`` and ``earlier_rows`` of
    :class:`~cockpit_like.spikes.postmortem.PostMortem` (missing keys: not known).

    Example:
        >>> name_cause({"learning_rate": {"ratio": 10.0, "value": 1.0, "window_median": 0.1}})["cause"]
        'learning-rate'
        >>> name_cause({})["cause"]
        'unknown'
    """
    checks: dict[str, dict[str, Any]] = {}
    precision = evidence.get("precision") or {}
    if precision.get("scaler"):
        events = []
        if precision.get("scale_dropped"):
            skips = precision.get("scaler_skips") or 0
            events.append(f"the loss scale dropped from {precision.get('previous_scale'):g} to {precision.get('scale'):g}"
                          + (f": the scaler skipped {skips} step{'s' if skips != 1 else ''} (non-finite scaled "
                             "gradients)" if skips else ""))
            if precision.get("missing_steps"):  # (steps missing without a drop are not the scaler's: a failed check)
                events.append(f"steps {precision['missing_steps']} left no tracked step")
        if precision.get("nonfinite"):
            events.append("the loss is not finite")
        checks["precision"] = {"holds": bool(events), "why": "; ".join(events) or "no scaler event"}
    rate = evidence.get("learning_rate") or {}
    if _finite(rate.get("ratio")):
        holds = rate["ratio"] >= lr_jump
        checks["learning-rate"] = {
            "holds": bool(holds),
            "why": f"the learning rate is {rate['value']:.3g}, {rate['ratio']:.3g}x the window's {rate['window_median']:.3g}",
        }
    rows = evidence.get("rows") or {}
    stand_out, row_why, suspects = False, "no rows", []
    current = [{"step": evidence.get("step"), **row} for row in (evidence.get("rows_by_share") or [])[:3]]
    if rows:
        batch = max(int(rows.get("batch", 1)), 1)
        gradients = rows.get("gradients", True)
        # no per-sample gradients (a BatchNorm in training mode): the rows' share of the batch's loss rise instead
        share_out = rows.get("outlier_share" if gradients else "outlier_loss_share", 0.0) or 0.0
        top = rows.get("top_share" if gradients else "top_loss_share", 0.0) or 0.0
        of_what = "the step's gradient" if gradients else "the batch's loss rise (no per-sample gradients)"
        shift = rows.get("median_shift")
        individual = (share_out >= outlier_share) or (top >= top_share and top >= top_factor / batch)
        step = evidence.get("step")
        earlier = sorted((r for r in evidence.get("earlier_rows") or [] if _finite(r.get("share"))
                          and r["share"] >= top_share and (step is None or r.get("step", step) >= step - earlier_steps)),
                         key=lambda r: -r["share"])
        whole = _finite(shift) and shift >= batch_shift
        stand_out = individual or bool(earlier) or whole
        if not gradients:  # the step's top rows by loss stand in for those by share
            current = [{"step": step, **row} for row in (evidence.get("rows_by_loss") or [])[:3]]
        suspects = current if individual else (earlier[:3] if earlier else (current if whole else []))
        row_why = (f"{rows.get('outlier_rows', 0)} of {batch} rows have outlier losses and carry "
                   f"{share_out:.0%} of {of_what}; the top row carries {top:.0%}"
                   + _batch_median(shift, rows.get("row_loss_baseline"), rows.get("row_loss_scale")))
        if earlier and not individual:
            culprit = earlier[0]
            row_why = (f"row {culprit.get('row')} (id {culprit.get('id')}) of step {culprit.get('step')} carried "
                       f"{culprit['share']:.0%} of that step's gradient, whose update led here; " + row_why)
    curvature = evidence.get("sharpness") or {}
    if _finite(curvature.get("ratio")):
        holds = curvature["ratio"] >= sharpness and not stand_out
        checks["curvature"] = {
            "holds": bool(holds),
            "why": f"lambda_max = {curvature['value']:.3g} is {curvature['ratio']:.3g}x 2/lr = {curvature['two_over_lr']:.3g}",
        }
    if rows:
        checks["bad-rows"] = {"holds": bool(stand_out), "why": row_why}
    for cause in ("precision", "learning-rate", "curvature", "bad-rows"):
        if checks.get(cause, {}).get("holds"):
            margin = {"precision": 1.0, "learning-rate": (rate.get("ratio", 0) or 0) / (3 * lr_jump),
                      "curvature": (curvature.get("ratio", 0) or 0) / (2 * sharpness),
                      "bad-rows": max(share_out / max(outlier_share, 1e-12), top / max(top_share, 1e-12)) / 1.8
                      if rows else 0.0}[cause]
            strength = "conclusive" if cause == "precision" else ("strong" if margin >= 1 else "moderate")
            return {"cause": cause, "why": checks[cause]["why"], "strength": strength, "checks": checks,
                    "suspects": suspects if cause == "bad-rows" else []}
    return {"cause": "unknown", "why": "no scaler event, no learning-rate jump, no row that stands out"
            + (", sharpness below 2/lr" if "curvature" in checks else ", sharpness not tracked"),
            "strength": "suggestive", "checks": checks, "suspects": []}
