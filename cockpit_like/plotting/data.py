"""A read-only view of stored cockpit output for the instruments.

The plotter reads ``{step: {name: value}}`` either from a live
:class:`~cockpit_like.Cockpit` (``get_output()``) or from a log file
(:func:`cockpit_like.read_log`). Values from a log come back as nested lists,
live values may be numpy arrays; :class:`RunData` hides the difference, so
both sources give the same picture.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cockpit_like.logs import EPOCH_KEYS

__all__ = ["RunData", "load_source", "smooth", "EPOCH_KEYS", "KNOWN_QUANTITIES"]

#: Quantities that have a dedicated instrument.
KNOWN_QUANTITIES = (
    "Loss",
    "Time",
    "Parameters",
    "GradNorm",
    "Distance",
    "UpdateSize",
    "Alpha",
    "CABS",
    "EarlyStopping",
    "MeanGSNR",
    "NormTest",
    "InnerTest",
    "OrthoTest",
    "GradHist1d",
    "GradHist2d",
    "HessTrace",
    "HessMaxEV",
    "HessEigenvalues",
    "HessSpectralDensity",
    "HessTraceEstimate",
    "TICDiag",
    "TICTrace",
    "KFACTrace",
)


def _to_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _norm_of_blocks(value: Any) -> float:
    """``sqrt(sum_p v_p^2)`` of per-parameter L2 norms (the norm over all parameters)."""
    blocks = np.asarray(value, dtype=float).ravel()
    return float(np.sqrt(np.sum(blocks**2)))


def _sum_of_blocks(value: Any) -> float:
    return float(np.sum(np.asarray(value, dtype=float)))


def smooth(values: np.ndarray, window: int | None = None) -> np.ndarray:
    """Centred moving average that does not reach across a non-finite value (no lag, unlike an exponential average).

    ``window`` defaults to about a fifteenth of the points (odd, at least 3).
    A NaN, inf or -inf splits the series: each stretch of finite values is
    averaged on its own (near its ends the window shrinks to the points
    available) and the non-finite points are NaN, a gap in the curve, so that
    a curve never passes smoothly through a step whose value is not finite
    (the instruments mark those steps, :func:`~cockpit_like.plotting.instruments.mark_nonfinite`).

    Example:
        >>> smooth(np.array([1.0, 2.0, np.nan, 4.0, 6.0]), 3).tolist()
        [1.5, 1.5, nan, 5.0, 5.0]
    """
    values = np.asarray(values, dtype=float)
    n = len(values)
    if n == 0:
        return values
    if window is None:
        window = max(3, (n // 15) | 1)
    half = window // 2
    finite = np.isfinite(values)
    index = np.arange(n)
    # the finite stretch around each point: [one past the last non-finite point before it, the next one)
    start = np.maximum.accumulate(np.where(finite, -1, index)) + 1
    end = np.minimum.accumulate(np.where(finite, n, index)[::-1])[::-1]
    low, high = np.maximum(index - half, start), np.minimum(index + half + 1, end)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    number = high - low
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite & (number > 0), (sums[np.clip(high, 0, n)] - sums[np.clip(low, 0, n)])
                        / np.maximum(number, 1), np.nan)


class RunData:
    """Stored output of one run, with typed accessors for the instruments.

    Args:
        output: ``{step: {name: value}}``; steps may be ints or strings.
        discard: keep only steps ``<= discard`` (Cockpit's meaning: the
            global step after which data is discarded); ``None`` keeps all.
    """

    def __init__(self, output: Mapping[Any, Mapping[str, Any]], discard: int | None = None):
        steps: dict[int, Mapping[str, Any]] = {}
        for step, values in output.items():
            step = int(step)
            if discard is not None and step > discard:
                continue
            if isinstance(values, Mapping):
                steps[step] = values
        self.steps: dict[int, Mapping[str, Any]] = dict(sorted(steps.items()))

    # ---- what is there -------------------------------------------------------
    def names(self) -> list[str]:
        """Every key stored at any step, in first-seen order."""
        seen: dict[str, None] = {}
        for values in self.steps.values():
            for name in values:
                seen.setdefault(name, None)
        return list(seen)

    def has(self, name: str) -> bool:
        return any(values.get(name) is not None for values in self.steps.values())

    def values(self, name: str) -> tuple[list[int], list[Any]]:
        """``(steps, raw values)`` of every step where ``name`` is stored and not None."""
        steps, values = [], []
        for step, stored in self.steps.items():
            value = stored.get(name)
            if value is not None:
                steps.append(step)
                values.append(value)
        return steps, values

    def last(self, name: str) -> tuple[int, Any] | None:
        """``(step, value)`` of the last stored value of ``name``, or None."""
        for step in reversed(self.steps):
            value = self.steps[step].get(name)
            if value is not None:
                return step, value
        return None

    # ---- series -------------------------------------------------------------------
    def series(self, name: str, reduce: Callable[[Any], float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` as float arrays; ``reduce`` turns a stored value into a float."""
        steps, raw = self.values(name)
        convert = reduce or _to_float
        values = []
        for value in raw:
            try:
                values.append(convert(value))
            except (TypeError, ValueError, KeyError):
                values.append(math.nan)
        return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)

    def scalar(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A quantity stored as one float per step."""
        return self.series(name)

    def block_norm(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-parameter L2 norms combined into the norm over all parameters."""
        return self.series(name, _norm_of_blocks)

    def standard_errors(self, name: str, steps: np.ndarray) -> np.ndarray:
        """The standard error the log keeps beside ``name``'s value at each of ``steps`` (the step's
        ``checks["standard_errors"][name]``; NaN where there is none: an exact value, or an older log)."""
        errors = []
        for step in steps:
            checks = self.steps.get(int(step), {}).get("checks")
            entry = checks.get("standard_errors", {}).get(name) if isinstance(checks, Mapping) else None
            errors.append(_to_float(entry.get("standard_error")) if isinstance(entry, Mapping) else math.nan)
        return np.asarray(errors, dtype=float)

    def block_sum(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-parameter values summed over all parameters (e.g. traces)."""
        return self.series(name, _sum_of_blocks)

    def field(self, name: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        """A float stored under ``key`` of a dict-valued quantity (e.g. KFACTrace)."""

        def pick(value: Any) -> float:
            if not isinstance(value, Mapping):
                return math.nan
            return _to_float(value.get(key))

        return self.series(name, pick)

    def custom_scalars(self) -> list[str]:
        """Keys without a dedicated instrument whose values are plain numbers."""
        names = []
        for name in self.names():
            if name in KNOWN_QUANTITIES or name in EPOCH_KEYS:
                continue
            _, raw = self.values(name)
            if raw and all(isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) for v in raw):
                names.append(name)
        return names


def load_source(source: Any, discard: int | None = None) -> tuple[RunData, str | None]:
    """``(RunData, log path or None)`` from a live cockpit, a log path, or an output dict."""
    if isinstance(source, (str, os.PathLike)):
        from cockpit_like.logs import read_log

        return RunData(read_log(source), discard), os.fspath(source)
    if hasattr(source, "get_output"):
        return RunData(source.get_output(), discard), None
    if isinstance(source, Mapping):
        return RunData(source, discard), None
    raise TypeError(
        f"CockpitPlotter.plot(source): expected a Cockpit, a path to a cockpit log, or an "
        f"output dict, got {type(source).__name__}"
    )
