"""What the rules read: :class:`RunHistory`, the stored values of a run so far.

Filled step by step, live (the cockpit hands over each tracked step's new
values and each ``cockpit.log`` call) or from a log file (replayed in step
order); the rules see the same object either way.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from cockpit_like.diagnosis.findings import DIAGNOSIS_KEYS

__all__ = ["RunHistory", "to_float", "block_values"]


def to_float(value: Any) -> float:
    """A stored scalar as a float (NaN for anything else)."""
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def block_values(value: Any) -> np.ndarray | None:
    """A per-parameter list (GradNorm, UpdateSize, ...) as a float array, or None."""
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        return None
    return array if array.ndim == 1 else None


class RunHistory:
    """Stored values by name and step, plus the run's metadata.

    Args:
        metadata: the log metadata (``param_names``, ``param_shapes`` are
            used to name layers; both optional).

    Values are kept as stored (floats, lists, dicts); :meth:`scalars` gives
    a scalar quantity as float arrays.
    """

    def __init__(self, metadata: Mapping[str, Any] | None = None):
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._steps: dict[str, list[int]] = {}
        self._values: dict[str, dict[int, Any]] = {}
        self._arrays: dict[str, list] = {}  # name -> [size, steps buffer, values buffer] (capacity doubles)
        self._nonfinite: dict[str, tuple[int, int, int | None, int]] = {}
        self._reduced: dict[tuple, tuple[int, list[Any]]] = {}
        #: per name, incremented whenever a value is inserted before the last step or replaced
        self._version: dict[str, int] = {}
        #: scratch space for rules that keep incremental state, ``memo[rule id]``
        self.memo: dict[str, dict[str, Any]] = {}
        #: the largest step seen so far (None before the first value)
        self.latest_step: int | None = None

    # ---- filling ------------------------------------------------------------------
    def add(self, step: int, values: Mapping[str, Any]) -> bool:
        """Store ``values`` under ``step``; return whether anything was stored.

        ``None`` values (e.g. ``cockpit.log`` arguments not given) and the
        findings themselves are skipped.
        """
        step = int(step)
        stored = False
        for name, value in values.items():
            if value is None or name in DIAGNOSIS_KEYS:
                continue
            by_step = self._values.setdefault(name, {})
            steps = self._steps.setdefault(name, [])
            if step in by_step or (steps and step < steps[-1]):  # not an append: caches start over
                self._version[name] = self._version.get(name, 0) + 1
            if step not in by_step:
                if not steps or step > steps[-1]:
                    steps.append(step)
                else:
                    bisect.insort(steps, step)
            by_step[step] = value
            stored = True
        if stored and (self.latest_step is None or step > self.latest_step):
            self.latest_step = step
        return stored

    # ---- reading ------------------------------------------------------------------
    def has(self, name: str) -> bool:
        """Whether ``name`` was stored at any step."""
        return bool(self._steps.get(name))

    def names(self) -> list[str]:
        return [name for name, steps in self._steps.items() if steps]

    def count(self, name: str) -> int:
        return len(self._steps.get(name, ()))

    def steps(self, name: str) -> list[int]:
        return list(self._steps.get(name, ()))

    def get(self, name: str, step: int) -> Any:
        """The value of ``name`` at ``step`` (None if not stored there)."""
        return self._values.get(name, {}).get(step)

    def last(self, name: str, count: int = 1) -> list[tuple[int, Any]]:
        """The last ``count`` ``(step, value)`` pairs of ``name``, oldest first."""
        steps = self._steps.get(name, [])[-count:] if count > 0 else []
        values = self._values.get(name, {})
        return [(step, values[step]) for step in steps]

    def first(self, name: str, count: int = 1) -> list[tuple[int, Any]]:
        """The first ``count`` ``(step, value)`` pairs of ``name``."""
        steps = self._steps.get(name, [])[:count]
        values = self._values.get(name, {})
        return [(step, values[step]) for step in steps]

    def at_or_before(self, name: str, step: int) -> tuple[int, Any] | None:
        """The latest ``(step, value)`` of ``name`` at or before ``step``, else the first one after it."""
        steps = self._steps.get(name)
        if not steps:
            return None
        index = bisect.bisect_right(steps, step) - 1
        chosen = steps[max(index, 0)]
        return chosen, self._values[name][chosen]

    def version(self, name: str) -> int:
        """Changes whenever a value of ``name`` is replaced or inserted before its last step
        (appends keep it): incremental state built from the values so far stays valid while it holds."""
        return self._version.get(name, 0)

    def scalars(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of a scalar quantity as float arrays (non-numbers become NaN)."""
        steps, floats = self.series(name, to_float)  # drops the buffers when the version changes
        cached = self._arrays.get(name)
        size = len(steps)
        if cached is None or cached[0] > size:
            cached = self._arrays[name] = [0, np.empty(max(16, 2 * size)), np.empty(max(16, 2 * size))]
        done = cached[0]
        if done < size:
            if len(cached[1]) < size:  # grow: amortized O(1) per appended value
                for index in (1, 2):
                    grown = np.empty(2 * size)
                    grown[:done] = cached[index][:done]
                    cached[index] = grown
            cached[1][done:size] = steps[done:]
            cached[2][done:size] = floats[done:]
            cached[0] = size
        return cached[1][:size], cached[2][:size]

    def tail(self, name: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The last ``count`` finite values of a scalar quantity as ``(steps, values)`` (fewer if
        there are not that many); cost grows with ``count``, not with the run."""
        steps, values = self.scalars(name)
        size = max(count, 1)
        while True:
            part_steps, part = steps[-size:], values[-size:]
            keep = np.isfinite(part)
            if keep.sum() >= count or size >= len(values):
                return part_steps[keep][-count:], part[keep][-count:]
            size *= 2

    def head(self, name: str, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``count`` finite values of a scalar quantity as ``(steps, values)``."""
        steps, values = self.scalars(name)
        size = max(count, 1)
        while True:
            part_steps, part = steps[:size], values[:size]
            keep = np.isfinite(part)
            if keep.sum() >= count or size >= len(values):
                return part_steps[keep][:count], part[keep][:count]
            size *= 2

    def nonfinite(self, name: str) -> tuple[int | None, int]:
        """``(first step with a non-finite value or None, how many)`` of a scalar quantity (incremental)."""
        steps, values = self.scalars(name)
        version, done, first, count = self._nonfinite.get(name, (self.version(name), 0, None, 0))
        if version != self.version(name) or done > len(values):
            done, first, count = 0, None, 0
        bad = np.flatnonzero(~np.isfinite(values[done:]))
        if len(bad):
            first = int(steps[done + bad[0]]) if first is None else first
            count += len(bad)
        self._nonfinite[name] = (self.version(name), len(values), first, count)
        return first, count

    def series(self, name: str, reduce) -> tuple[list[int], list[Any]]:
        """``(steps, [reduce(value) ...])`` of ``name``, cached: values appended since the last
        call are reduced once (``reduce`` must be a module-level function). Do not modify the lists."""
        steps = self._steps.get(name, [])
        key = (name, reduce)
        version = self.version(name)
        cached = self._reduced.get(key)
        if cached is None or cached[0] != version:
            cached = (version, [])
            self._reduced[key] = cached
            self._arrays.pop(name, None)
        reduced = cached[1]
        if len(reduced) < len(steps):
            values = self._values[name]
            reduced.extend(reduce(values[s]) for s in steps[len(reduced):])
        return steps, reduced

    # ---- layers -----------------------------------------------------------------------
    def param_name(self, index: int) -> str:
        """The name of parameter block ``index`` (``"0.weight"``; ``"param_3"`` if unknown)."""
        names = self.metadata.get("param_names") or []
        if index < len(names) and names[index]:
            return str(names[index])
        return f"param_{index}"

    def param_ndim(self, index: int) -> int | None:
        """The number of dimensions of parameter block ``index`` (None if unknown)."""
        shapes = self.metadata.get("param_shapes") or []
        return len(shapes[index]) if index < len(shapes) else None
