"""What the rules know of the training recipe, read from stored values: the scheduled learning rate,
whether the optimizer is adaptive, and how far the loss has come.

A rule that sees small updates must know whether the learning rate was
*scheduled* small (warm-up, a cosine tail, a step decay): then small updates
are the recipe, not a finding. The learning rate is the tracked
``LearningRate`` (the largest of the parameter groups, so that a group frozen
at 0 does not hide the others), else ``cockpit.log(learning_rate=...)``.
An optimizer is adaptive (Adam, RMSprop, Adagrad: their first steps are
large by design) when the tracked ``Momentum`` is NaN.

Every helper reads stored values only and keeps its incremental state in
``history.memo``, so that the cost per step stays flat.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from cockpit_like.diagnosis.history import RunHistory, to_float

__all__ = ["rate_name", "rates", "rate_at", "peak_rate_before", "scheduled_share", "warming_up", "rate_settled", "adaptive",
           "loss_share"]


def rate_name(history: RunHistory) -> str | None:
    """The stored key that holds the learning rate (``LearningRate``, else ``learning_rate``), or None."""
    if history.has("LearningRate"):
        return "LearningRate"
    return "learning_rate" if history.has("learning_rate") else None


def _largest(value) -> float:
    if isinstance(value, (list, tuple)):
        found = [to_float(v) for v in value]
        found = [v for v in found if math.isfinite(v)]
        return max(found) if found else math.nan
    return to_float(value)


def rates(history: RunHistory) -> tuple[list[int], list[float]]:
    """``(steps, learning rates)`` (the largest of the parameter groups); empty when not stored."""
    name = rate_name(history)
    if name is None:
        return [], []
    return history.series(name, _largest)


def rate_at(history: RunHistory, step: int) -> float:
    """The learning rate at or before ``step`` (NaN when unknown)."""
    name = rate_name(history)
    found = history.at_or_before(name, step) if name else None
    return _largest(found[1]) if found else math.nan


def _running_peaks(history: RunHistory) -> tuple[list[int], list[float]]:
    """Per stored learning rate, the largest one up to and including it (incremental)."""
    steps, values = rates(history)
    memo = history.memo.setdefault("recipe/peaks", {})
    name = rate_name(history)
    version = history.version(name) if name else 0
    if memo.get("version") != version or memo.get("done", 0) > len(values):
        memo.update(version=version, done=0, peaks=[], best=-math.inf)
    for value in values[memo["done"]:]:
        if math.isfinite(value):
            memo["best"] = max(memo["best"], value)
        memo["peaks"].append(memo["best"])
    memo["done"] = len(values)
    return steps, memo["peaks"]


def peak_rate_before(history: RunHistory, step: int) -> float:
    """The largest learning rate stored before ``step`` (NaN when none)."""
    steps, peaks = _running_peaks(history)
    index = int(np.searchsorted(np.asarray(steps), step, side="left")) - 1
    return peaks[index] if index >= 0 and math.isfinite(peaks[index]) else math.nan


def scheduled_share(history: RunHistory, step: int) -> float:
    """The learning rate at ``step`` as a share of the largest one so far (1 at the peak; a cosine
    tail or a step decay gives less; NaN when the rate is not stored)."""
    steps, peaks = _running_peaks(history)
    if not steps:
        return math.nan
    index = int(np.searchsorted(np.asarray(steps), step, side="right")) - 1
    if index < 0 or not peaks[index] > 0:
        return math.nan
    return rate_at(history, step) / peaks[index]


def warming_up(history: RunHistory, since: int, step: int, factor: float = 1.2) -> bool:
    """Whether the learning rate rose by more than ``factor`` between ``since`` and ``step`` (warm-up,
    the rising half of a one-cycle schedule), or rose at all between them while above ``factor`` x the
    first stored rate (a slow warm-up seen over a short window: a one-cycle schedule's 60-step rise
    gains 2-10% over 5 steps; round 9)."""
    start, end = rate_at(history, since), rate_at(history, step)
    if not start > 0:
        return False
    if end > factor * start:
        return True
    _, values = rates(history)
    first = next((value for value in values if math.isfinite(value)), math.nan)
    return bool(end > start and first > 0 and end > factor * first)


def rate_settled(history: RunHistory, step: int, factor: float = 1.2) -> int | None:
    """The first stored step at which the running peak of the learning rate came within ``factor`` of
    its value at ``step``: where the run began to train at its rate (the end of a warm-up, the step of a
    raised rate; the first step for a constant or decaying schedule). ``None`` when the rate is not stored."""
    steps, peaks = _running_peaks(history)
    index = bisect.bisect_right(steps, step) - 1  # (lists, searched in place: no copy per tracked step)
    if index < 0 or not math.isfinite(peaks[index]):
        return None
    first = bisect.bisect_left(peaks, peaks[index] / factor, 0, index + 1)  # running peaks never fall
    return int(steps[first])


def adaptive(history: RunHistory) -> bool:
    """Whether the optimizer is adaptive (Adam, RMSprop, Adagrad): the tracked ``Momentum`` is NaN."""
    if not history.has("Momentum"):
        return False
    return not math.isfinite(to_float(history.last("Momentum")[0][1]))


def loss_share(history: RunHistory, count: int = 5, before_updates: bool = False) -> float:
    """The median of the last ``count`` finite losses as a share of the median of the first ``count``
    (below 1: the loss fell); NaN when there are too few or the start is not positive.
    ``before_updates``: the start is the smaller of that median and the first tracked loss (a blow-up
    in the first steps does not count as a high start)."""
    _, first = history.head("Loss", count)
    _, last = history.tail("Loss", count)
    if len(first) < count or len(last) < count:
        return math.nan
    start = float(np.median(first))
    if before_updates:
        start = min(start, float(first[0]))
    return float(np.median(last)) / start if start > 0 else math.nan
