"""Tracking schedules: functions ``global_step -> bool``.

Any callable ``int -> bool`` works as a schedule; these two are the common
ones (and give the same steps as Cockpit's).
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["linear", "logarithmic", "check_schedule"]


def linear(interval: int, offset: int = 0) -> Callable[[int], bool]:
    """Track at the non-negative steps among ``offset + n * interval`` (``n`` any integer >= 0).

    ``offset`` may be negative, as in Cockpit: ``linear(10, -1)`` tracks
    9, 19, 29, ... (the steps ``t >= 0`` with ``(t - offset) % interval == 0``
    and ``t >= offset``).

    Example:
        >>> s = linear(3, offset=1)
        >>> [t for t in range(10) if s(t)]
        [1, 4, 7]
        >>> s = linear(10, offset=-1)
        >>> [t for t in range(30) if s(t)]
        [9, 19, 29]
    """
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"linear(interval=...) needs a positive int, got {interval!r}")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"linear(offset=...) needs an int, got {offset!r}")

    def schedule(global_step: int) -> bool:
        # Python's % is non-negative for a positive interval, so negative offsets work too
        return global_step >= offset and (global_step - offset) % interval == 0

    schedule.description = f"linear(interval={interval}, offset={offset})"
    return schedule


def logarithmic(
    start: float, end: float, steps: int = 300, base: float = 10, init: bool = True
) -> Callable[[int], bool]:
    """Track at ``steps`` integer, log-spaced steps from ``base**start`` to ``base**end``.

    ``start`` and ``end`` are truncated toward zero to integers; the exponents
    are spaced evenly (symmetrically from both ends, as ``torch.logspace``)
    and ``base**e`` is truncated to an int. Duplicates collapse, so fewer than
    ``steps`` distinct steps can result. ``init=True`` adds step 0.

    Example:
        >>> s = logarithmic(0, 3, steps=10)
        >>> [t for t in range(1001) if s(t)]
        [0, 1, 2, 4, 10, 21, 46, 100, 215, 464, 1000]
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"logarithmic(steps=...) needs a positive int, got {steps!r}")
    low, high = int(start), int(end)
    if steps == 1:
        members = {int(math.pow(base, low))}
    else:
        step = (high - low) / (steps - 1)
        half = steps // 2
        exponents = [
            low + step * k if k < half else high - step * (steps - 1 - k) for k in range(steps)
        ]
        members = {int(math.pow(base, e)) for e in exponents}
    if init:
        members.add(0)
    frozen = frozenset(members)

    def schedule(global_step: int) -> bool:
        return global_step in frozen

    schedule.description = f"logarithmic(start={start}, end={end}, steps={steps}, base={base}, init={init})"
    return schedule


def check_schedule(track_schedule: object, owner: str) -> None:
    """Raise a clear error unless ``track_schedule`` is a usable ``int -> bool``."""
    if not callable(track_schedule):
        raise TypeError(
            f"{owner}: track_schedule must be a callable int -> bool (for example "
            f"cockpit_like.utils.schedules.linear(1)), got {type(track_schedule).__name__} "
            f"{track_schedule!r}"
        )
    try:
        answer = track_schedule(0)
    except Exception as error:  # noqa: BLE001 - reported with context below
        raise TypeError(
            f"{owner}: track_schedule must accept one int (the global step); calling it "
            f"with 0 raised {type(error).__name__}: {error}"
        ) from error
    if not isinstance(answer, (bool, int)) and not hasattr(answer, "__bool__"):
        raise TypeError(f"{owner}: track_schedule(0) must return a bool, got {answer!r}")
