"""Post-mortems read back from a run's output or log, and printed (``cockpit-like spikes LOG``).

Plain data in, text out: works on ``cockpit.get_output()`` and on a log read
from disk alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["post_mortems", "format_post_mortem"]


def _is_post_mortem(value: Any) -> bool:
    return isinstance(value, Mapping) and "trigger" in value and "cause" in value and "rows_by_share" in value


def post_mortems(steps: Mapping[Any, Mapping[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """``[(step, post-mortem)]`` of every stored post-mortem (any quantity name starting ``PostMortem``), by step."""
    found = []
    for step in sorted(steps, key=int):
        values = steps[step]
        if not isinstance(values, Mapping):
            continue
        for name, value in values.items():
            if str(name).startswith("PostMortem") and _is_post_mortem(value):
                found.append((int(step), dict(value)))
    return found


def _g(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and math.isnan(value):
            return "nan"
        return f"{value:.4g}"
    return str(value)


def _share(value: Any, digits: int = 1) -> str:
    return f"{value:.{digits}%}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def _rows(rows: list[dict[str, Any]], title: str) -> list[str]:
    lines = [f"  {title}:", "    rank  row  id              share     loss      |g_i|     loss z"]
    for rank, row in enumerate(rows, 1):
        lines.append(f"    {rank:<5} {row.get('row', '-'):<4} {str(row.get('id', '-'))[:14]:<15} "
                     f"{_share(row.get('share')):>9} {_g(row.get('loss')):<9} {_g(row.get('grad_norm')):<9} "
                     f"{_g(row.get('loss_z'))}")
    return lines


def format_post_mortem(step: int, post: Mapping[str, Any], names: list[str] | None = None) -> str:
    """A post-mortem as text: trigger, cause and evidence, rows, earlier rows, layers, rate and precision."""
    trigger = post.get("trigger", {})
    rises = [f"{name.replace('_', ' ')} {_g(trigger[name]['value'])} = {_g(trigger[name]['ratio'])}x the window's "
             f"median (robust z {_g(trigger[name]['z'])})" for name in trigger.get("series", [])
             if isinstance(trigger.get(name), Mapping)]
    if "loss_scale" in trigger.get("series", []):
        rises.append(f"{trigger.get('skipped')} steps skipped by the GradScaler since the previous tracked step")
    lines = [f"step {step}: spike of " + "; ".join(rises),
             f"  likeliest cause: {post.get('cause')} [{post.get('strength')}]: {post.get('why')}"]
    for cause, check in (post.get("checks") or {}).items():
        lines.append(f"    {cause:<14} {'holds' if check.get('holds') else 'no':<6} {check.get('why')}")
    suspects = post.get("suspects") or []
    if suspects:
        lines.append("  suspects: " + "; ".join(
            f"step {r.get('step')} row {r.get('row')} id {r.get('id')} (share {_share(r.get('share'), 0)})"
            for r in suspects))
    if (post.get("rows") or {}).get("gradients") is False:
        lines.append("  rows by share of the step's gradient: none (no per-sample gradients at this step: a "
                     "BatchNorm in training mode couples the rows; ranked by loss below)")
    else:
        lines += _rows(post.get("rows_by_share") or [], "rows by share of the step's gradient")
    lines += _rows(post.get("rows_by_loss") or [], "rows by loss")
    earlier = post.get("earlier_rows") or []
    if earlier:
        lines.append("  earlier rows that stood out:")
        for row in earlier:
            lines.append(f"    step {row.get('step')}  row {row.get('row')}  id {row.get('id')}  ({row.get('why')})")
    layers = post.get("layers") or []
    if layers:
        lines.append("  layers that moved first:")
        for layer in layers:
            name = layer.get("name")
            if names and isinstance(layer.get("layer"), int) and layer["layer"] < len(names) and (
                    not name or str(name).startswith("param_")):
                name = names[layer["layer"]]
            lines.append(f"    step {layer.get('first_step')}  {name}  {str(layer.get('series')).replace('_', ' ')} "
                         f"z {_g(layer.get('z'))} (grad norm {_g(layer.get('grad_norm'))}, "
                         f"update ratio {_g(layer.get('update_ratio'))})")
    rate = post.get("learning_rate")
    if isinstance(rate, Mapping):
        lines.append(f"  learning rate {_g(rate.get('value'))} ({_g(rate.get('ratio'))}x the window's median "
                     f"{_g(rate.get('window_median'))})")
    precision = post.get("precision") or {}
    if precision.get("scaler"):
        lines.append(f"  loss scale {_g(precision.get('scale'))} (before: {_g(precision.get('previous_scale'))}); "
                     f"steps the scaler skipped: {precision.get('scaler_skips') or 0}; tracked steps missing "
                     f"{precision.get('missing_steps') or 'none'}")
    sharp = post.get("sharpness")
    if isinstance(sharp, Mapping):
        lines.append(f"  sharpness {_g(sharp.get('value'))} vs 2/lr {_g(sharp.get('two_over_lr'))}")
    return "\n".join(lines)
