"""The instrument of the loss-spike post-mortem (``PostMortem``, :mod:`cockpit_like.spikes`).

A pure draw function of stored data with the signature ``draw(ax, data,
options)`` (:mod:`cockpit_like.plotting.instruments`): the last post-mortem's
rows by share of the step's gradient as bars (labelled with their ids and
losses; by their loss where the step had no per-sample gradients), its cause and evidence in the title and a note, and the layers that
moved first. In the dashboard's bottom band once the run holds a
post-mortem (:func:`has_post_mortem`; a run without one keeps Cockpit's
layout), and offered as ``post_mortem_gauge`` in
:mod:`cockpit_like.instruments`. Artists carry
``gid`` tags: ``"post-mortem:rows"`` (the bars), ``"post-mortem:note"``.
"""

from __future__ import annotations

import textwrap

import numpy as np

from cockpit_like.plotting.data import RunData
from cockpit_like.plotting.instruments import _SMALL, _TITLE, COLORS, DrawOptions, Instrument, not_tracked

__all__ = ["draw_post_mortem", "has_post_mortem", "SPIKE_INSTRUMENTS"]

_CAUSE_COLORS = {"bad-rows": COLORS["red"], "precision": COLORS["purple"], "learning-rate": COLORS["orange"],
                 "curvature": COLORS["brown"], "unknown": COLORS["grey"]}


def _last_post_mortem(data: RunData):
    """``(step, post-mortem)`` of the last one stored under any name starting ``PostMortem``, or None."""
    found = []
    for name in [n for n in data.names() if str(n).startswith("PostMortem")]:
        steps, values = data.values(name)
        found += [(s, v) for s, v in zip(steps, values) if isinstance(v, dict) and "rows_by_share" in v]
    return max(found, key=lambda item: item[0]) if found else None


def has_post_mortem(data: RunData) -> bool:
    """Whether the run holds a loss-spike post-mortem (the dashboard then shows its panel)."""
    return _last_post_mortem(data) is not None


def draw_post_mortem(ax, data: RunData, options: DrawOptions) -> None:
    """The last post-mortem: the top rows' shares of the step's gradient, the cause, the layers that moved first."""
    title = "Loss-spike post-mortem"
    last = _last_post_mortem(data)
    if last is None:
        not_tracked(ax, title, ["PostMortem"], "add cockpit_like.spikes.PostMortem (no spike yet, or not tracked)")
        return
    step, post = last
    by_loss = (post.get("rows") or {}).get("gradients") is False  # no per-sample gradients: rows by loss alone
    rows = (post.get("rows_by_loss") if by_loss else post.get("rows_by_share")) or []
    fig = ax.get_figure()
    compact = fig is not None and ax.get_position().height * fig.get_size_inches()[1] < 2.5  # a dashboard panel
    if compact:  # the top 3 rows and a two-line note
        rows = rows[:3]
    cause = post.get("cause", "unknown")
    ax.set_title(f"Spike at step {step}: {cause}", **_TITLE)
    labels = [f"row {r.get('row')}" + (f" · id {r.get('id')}" if r.get("id") is not None else "") for r in rows]
    shares = np.asarray([r.get("loss" if by_loss else "share", np.nan) for r in rows], dtype=float)
    positions = np.arange(len(rows))[::-1]
    bars = ax.barh(positions, shares, color=_CAUSE_COLORS.get(cause, COLORS["grey"]), alpha=0.85)
    for bar in bars:
        bar.set_gid("post-mortem:rows")
    ax.set_yticks(positions, labels, fontsize=_SMALL)
    ax.set_xlabel("row loss (no per-sample gradients: a BatchNorm in training mode)" if by_loss else
                  "share of the step's gradient  <g_i/B, G> / ||G||²", fontsize=_SMALL)
    for position, row, width in zip(positions, rows, shares):
        text = f"  loss z {row.get('loss_z', float('nan')):.3g}" if by_loss else (
            f"  loss {row.get('loss', float('nan')):.3g}")
        ax.text(max(float(np.nan_to_num(width)), 0.0), position, text, va="center", fontsize=_SMALL, color="#333333")
    finite = shares[np.isfinite(shares)]
    top = 1.25 * float(finite.max()) if by_loss and finite.size and finite.max() > 0 else 1.25
    ax.set_xlim(min(0.0, float(finite.min())) if finite.size else 0.0, top)
    trigger = post.get("trigger", {})
    rises = ", ".join(f"{name.replace('_', ' ')} ×{trigger[name]['ratio']:.3g}" for name in trigger.get("series", [])
                      if isinstance(trigger.get(name), dict))
    if "loss_scale" in trigger.get("series", []):
        rises = ", ".join(filter(None, [rises, f"{trigger.get('skipped')} steps skipped by the GradScaler"]))
    layers = ", ".join(str(layer.get("name")) for layer in (post.get("layers") or [])[:3]) or "none stood out"
    why = [] if compact else textwrap.wrap(str(post.get("why", "")), 70)
    lines = [rises, *why, f"layers moved first: {layers}"]
    ax.set_ylim(-0.6 - 0.45 * len(lines) * max(len(rows), 1) / 5, len(rows) - 0.4)  # room below the bars for the note
    note = ax.text(0.99, 0.03, "\n".join(lines), transform=ax.transAxes, ha="right", va="bottom",
                   fontsize=_SMALL - 0.5, color="#444444", gid="post-mortem:note",
                   bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "#dddddd"})
    note.set_in_layout(False)  # inside the axes: never squeezes the panel


SPIKE_INSTRUMENTS: dict[str, Instrument] = {
    "post_mortem": Instrument("post_mortem", "Loss-spike post-mortem", ("PostMortem",), draw_post_mortem),
}
