"""Bin adaptation for the gradient histograms: GradAbsMax and ParamAbsMax.

An adapter has its own schedule. It runs inside its host histogram's
tracking at every step the cockpit is entered, *after* that step's histogram,
so a new range applies from the next histogram on. When its schedule holds it
sets the range to ``(-e, e)`` with ``e = (1 + padding) * max(min_size / 2, m)``:

- :class:`GradAbsMax`: ``m = B * max_{p,i,j} |grad_batch_{i,p,j}| = max |g_{i,p,j}|``
  (``B`` = ``grad_batch``'s leading dimension; needs per-sample gradients at
  its steps);
- :class:`ParamAbsMax`: ``m = max_{p,j} |theta_{p,j}|``.

:class:`NoAdaptation` (never scheduled) stands for "no adaptation": a
histogram built without ``adapt`` holds one, as in Cockpit, so code that
calls ``hist._adapt.should_compute(step)`` works either way.

Example:
    >>> from cockpit_like.quantities import GradHist1d
    >>> from cockpit_like.utils.schedules import linear
    >>> hist = GradHist1d(linear(10), adapt=GradAbsMax(linear(100), padding=0.1))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cockpit_like import context
from cockpit_like.backends.per_sample_stats import AbsMax
from cockpit_like.utils.schedules import check_schedule

__all__ = ["BinAdaptation", "NoAdaptation", "GradAbsMax", "ParamAbsMax"]


class BinAdaptation:
    """Base class: a schedule and a rule ``m`` for the new symmetric range."""

    def __init__(
        self,
        track_schedule: Callable[[int], bool],
        verbose: bool = False,
        padding: float = 0.0,
        min_size: float = 1e-6,
    ):
        check_schedule(track_schedule, type(self).__name__)
        if padding < 0 or min_size < 0:
            raise ValueError(f"{type(self).__name__}: padding and min_size must be >= 0")
        self._track_schedule = track_schedule
        self._verbose = verbose
        self._padding = padding
        self._min_size = min_size

    def should_compute(self, global_step: int) -> bool:
        return bool(self._track_schedule(global_step))

    def per_sample_stats(self, global_step: int) -> list:
        """Per-sample statistics needed at ``global_step`` (requested through the host histogram)."""
        return []

    def extensions(self, global_step: int) -> list:
        """BackPACK extensions needed (none: what an adapter needs is a per-sample statistic)."""
        return []

    def extension_hooks(self, global_step: int) -> list:
        """BackPACK extension hooks needed (none, see :meth:`extensions`)."""
        return []

    def settings(self) -> dict:
        return {"class": type(self).__name__, "padding": self._padding, "min_size": self._min_size}

    def _abs_max(self, record, params: list[torch.Tensor]) -> float:
        raise NotImplementedError

    def new_range(self, global_step: int, record, params: list[torch.Tensor]) -> tuple[float, float]:
        """The range ``(-e, e)`` to use from the next histogram on."""
        extent = (1.0 + self._padding) * max(self._min_size / 2, self._abs_max(record, params))
        if self._verbose:
            print(f"[Step {global_step}] {type(self).__name__}: new range (-{extent}, {extent})")
        return (-extent, extent)

    def compute(self, global_step: int, params: list[torch.Tensor], batch_loss, range) -> tuple[float, float]:
        """Cockpit's call: the new range ``(-e, e)``, while the cockpit tracks ``global_step``.

        ``batch_loss`` and the current ``range`` are not used; the statistics
        are read from the step record (:func:`cockpit_like.context.get_record`),
        so this works inside a histogram's ``track``, as in Cockpit.
        """
        return self.new_range(global_step, context.get_record(global_step), params)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(padding={self._padding}, min_size={self._min_size})"


class NoAdaptation(BinAdaptation):
    """Leave the range as it is: a schedule that never holds.

    What a histogram holds in ``_adapt`` when it was built without ``adapt``.
    """

    def __init__(self, verbose: bool = False):
        super().__init__(_never, verbose=verbose)

    def settings(self) -> dict:
        return {"class": "NoAdaptation"}

    def compute(self, global_step, params, batch_loss, range):
        """The given ``range``, unchanged."""
        return tuple(range)

    def _abs_max(self, record, params):
        raise RuntimeError("NoAdaptation never computes a range (its schedule never holds)")

    def __repr__(self) -> str:
        return "NoAdaptation()"


def _never(global_step: int) -> bool:
    return False


_never.description = "never"


class GradAbsMax(BinAdaptation):
    """Range from the largest absolute per-sample gradient entry ``B * max |grad_batch|``."""

    def per_sample_stats(self, global_step: int) -> list:
        return [AbsMax()] if self.should_compute(global_step) else []

    def _abs_max(self, record, params):
        value, batch = record.stat(AbsMax())
        return batch * value.item()


class ParamAbsMax(BinAdaptation):
    """Range from the largest absolute parameter entry ``max |theta|``."""

    def _abs_max(self, record, params):
        return max(p.detach().abs().max().item() for p in params)

