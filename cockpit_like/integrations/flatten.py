"""Stored cockpit values as named scalars and histograms, for exporters.

A step's values ``{name: value}`` (as :meth:`Cockpit.get_output` or
:func:`cockpit_like.read_log` give them) become

- scalars ``{tag: float}``: a number under its name (``"Loss"``), a list of
  numbers (one per parameter tensor: GradNorm, Distance, UpdateSize,
  HessTrace) as ``"GradNorm/param_0"``, ``"GradNorm/param_1"``, ..., numeric
  fields of a dict as ``"KFACTrace/trace_total"`` (lists in them as
  ``"KFACTrace/trace/param_0"``);
- histograms ``{tag: (counts, edges)}``: a ``{"hist", "edges"}`` dict with 1-D
  counts as it is (GradHist1d); 2-D counts (GradHist2d, x = gradient,
  y = parameter) as its two marginals ``"GradHist2d/gradient"`` and
  ``"GradHist2d/parameter"``; per-layer histograms (``"param_0"``, ...)
  under ``"GradHist2d/param_0/gradient"`` and so on.

- texts ``{tag: str}``: a loss-spike post-mortem (``PostMortem``,
  :mod:`cockpit_like.spikes`) as the text ``cockpit-like spikes`` prints, beside
  the scalars ``{tag}/cause_index`` (its index in ``CAUSES``), ``{tag}/top_share``
  and the trigger's ratios ``{tag}/loss_ratio``, ``{tag}/grad_norm_ratio``.

Skipped: ``None`` (figures not given to ``cockpit.log``), booleans, strings,
``"param_groups"`` counts, and nested lists (``Parameters``' snapshots).
Pure Python and numpy (and the text of :mod:`cockpit_like.spikes.report`): no optional dependency.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Flat", "flatten"]


@dataclass
class Flat:
    """What one step exports: ``scalars`` ``{tag: float}`` and ``histograms`` ``{tag: (counts, edges)}``."""

    scalars: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _histogram(tag: str, value: Mapping[str, Any], flat: Flat) -> None:
    counts = np.asarray(value["hist"], dtype=float)
    edges = value["edges"]
    if counts.ndim == 1:
        flat.histograms[tag] = (counts, np.asarray(edges, dtype=float))
    elif counts.ndim == 2 and len(edges) == 2:
        flat.histograms[f"{tag}/gradient"] = (counts.sum(1), np.asarray(edges[0], dtype=float))
        flat.histograms[f"{tag}/parameter"] = (counts.sum(0), np.asarray(edges[1], dtype=float))
    for key, item in value.items():
        if str(key).startswith("param_") and key != "param_groups" and isinstance(item, Mapping) and "hist" in item:
            _histogram(f"{tag}/{key}", item, flat)


def _add(tag: str, value: Any, flat: Flat) -> None:
    if value is None or isinstance(value, (bool, np.bool_, str)):
        return
    if _is_number(value):
        flat.scalars[tag] = float(value)
        return
    if isinstance(value, Mapping):
        if "hist" in value and "edges" in value:
            _histogram(tag, value, flat)
            return
        if "trigger" in value and "cause" in value and "rows_by_share" in value:
            _post_mortem(tag, value, flat)
            return
        for key, item in value.items():
            if key != "param_groups":
                _add(f"{tag}/{key}", item, flat)
        return
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and all(_is_number(v) for v in value):
        for index, item in enumerate(value):
            flat.scalars[f"{tag}/param_{index}"] = float(item)


def _post_mortem(tag: str, value: Mapping[str, Any], flat: Flat) -> None:
    from cockpit_like.spikes.causes import CAUSES
    from cockpit_like.spikes.report import format_post_mortem

    flat.texts[tag] = format_post_mortem(int(value.get("step", -1)), value)
    if value.get("cause") in CAUSES:
        flat.scalars[f"{tag}/cause_index"] = float(CAUSES.index(value["cause"]))
    rows = value.get("rows") or {}
    if _is_number(rows.get("top_share")):
        flat.scalars[f"{tag}/top_share"] = float(rows["top_share"])
    trigger = value.get("trigger") or {}
    for name in ("loss", "grad_norm"):
        if isinstance(trigger.get(name), Mapping) and _is_number(trigger[name].get("ratio")):
            flat.scalars[f"{tag}/{name}_ratio"] = float(trigger[name]["ratio"])


def flatten(values: Mapping[str, Any], prefix: str = "") -> Flat:
    """The scalars and histograms of one step's ``{name: value}`` (see the module docstring).

    Example:
        >>> flatten({"Loss": 0.5, "GradNorm": [1.0, 2.0]}).scalars
        {'Loss': 0.5, 'GradNorm/param_0': 1.0, 'GradNorm/param_1': 2.0}
    """
    flat = Flat()
    for name, value in values.items():
        _add(f"{prefix}{name}", value, flat)
    return flat

