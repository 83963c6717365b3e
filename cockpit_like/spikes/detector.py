"""Spikes of the loss and of the gradient norm against the run's own noise.

:class:`SpikeDetector` sees each tracked step's loss ``L_t``, gradient norm
``||G_t||`` and learning rate. A series spikes at ``t`` when, against the
trailing window of the ``window`` tracked steps before it
(:func:`~cockpit_like.functional.spikes.robust_score`, in log space):

- its robust z-score is at least ``z``: against the median of the window's
  last 5 values (where a falling loss is now), in units of the spread of the
  step-to-step differences (``1.4826 MAD / sqrt(2)``: neither a trend nor a
  few earlier spikes move it), and
- it is at least ``ratio`` times that median (a very quiet run does not
  alarm on a small wobble), and for the loss, the rise is at least
  ``loss_gap`` x the run's first loss (the median of its first 3 tracked
  losses: a loss near 0 that quadruples from 0.03 to 0.12 is no spike).

Warmup: no alarm before ``warmup`` tracked steps were seen (the first
steps of a run move fast by design). Schedule: while the learning rate is
ramping up (the rate of the step above the window's median by the schedule,
one small step at a time), the gradient norm needs ``ramp_z`` instead of
``z``; a *jump* of the rate is left to be found, it is a cause the
post-mortem names. After a spike, ``cooldown`` tracked steps raise no new
one (the same incident).

Mixed precision: steps a ``GradScaler`` skipped (non-finite scaled
gradients: an fp16 overflow) leave no tracked step behind, so the loss and
the gradient norm of those steps are never seen. ``skipped`` (passed by
:class:`~cockpit_like.spikes.PostMortem`, read off the scaler's scale) says
how many steps the scaler skipped since the previous tracked step; at least
``skip_steps`` of them (in a row: the scale dropped ``backoff^-skip_steps``
times) is a spike of its own, series ``"loss_scale"``. One skipped step is
the scaler's routine (its scale grows every ``growth_interval`` steps until
it overflows once and backs off), so the default is 2: a back-off that did
not cure the overflow. Defaults were set on the tuning half of the spike
corpus (``benchmarks/spike_corpus.py``, ``docs/spikes.md``).
"""

from __future__ import annotations

import math
from typing import Any

from cockpit_like.functional.spikes import robust_center_scale, robust_score

__all__ = ["SpikeDetector", "RECENT"]

#: the level a value is compared with is the median of the window's last ``RECENT`` values
RECENT = 5


class SpikeDetector:
    """Robust spike detection of the loss and the gradient norm (see the module docstring).

    Args:
        window: tracked steps in the trailing window.
        warmup: tracked steps seen before the first alarm.
        z: robust z-score a spike needs (loss and gradient norm).
        loss_ratio, grad_ratio: the least ratio to the window's median.
        ramp_z: ``z`` of the gradient norm while the learning rate ramps up.
        cooldown: tracked steps after a spike that raise no new one.
        loss_gap: the least rise of the loss, as a fraction of the run's first loss.
        skip_steps: steps a GradScaler skipped since the previous tracked step that make a spike
            (series ``"loss_scale"``).

    Example:
        >>> detector = SpikeDetector(window=5, warmup=5)
        >>> [detector.update(t, 1.0 + 0.01 * (t % 2), 1.0) for t in range(6)][-1] is None
        True
        >>> detector.update(6, 5.0, 1.0)["series"]
        ['loss']
    """

    def __init__(self, window: int = 20, warmup: int = 10, z: float = 7.0, loss_ratio: float = 1.3,
                 grad_ratio: float = 3.0, ramp_z: float = 10.0, cooldown: int = 5, loss_gap: float = 0.05,
                 skip_steps: int = 2):
        if isinstance(window, bool) or not isinstance(window, int) or window < 3:
            raise ValueError(f"SpikeDetector: window must be an int of at least 3 tracked steps, got {window!r}")
        for name, value in (("warmup", warmup), ("cooldown", cooldown)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SpikeDetector: {name} must be a non-negative int, got {value!r}")
        if isinstance(skip_steps, bool) or not isinstance(skip_steps, int) or skip_steps < 1:
            raise ValueError(f"SpikeDetector: skip_steps must be a positive int (steps a GradScaler skipped in a "
                             f"row), got {skip_steps!r}")
        if not (isinstance(loss_gap, (int, float)) and math.isfinite(loss_gap) and loss_gap >= 0):
            raise ValueError(f"SpikeDetector: loss_gap must be a non-negative number, got {loss_gap!r}")
        for name, value in (("z", z), ("loss_ratio", loss_ratio), ("grad_ratio", grad_ratio), ("ramp_z", ramp_z)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SpikeDetector: {name} must be a positive number, got {value!r}")
        self.window, self.warmup, self.z = window, warmup, float(z)
        self.loss_ratio, self.grad_ratio, self.ramp_z, self.cooldown = (
            float(loss_ratio), float(grad_ratio), float(ramp_z), cooldown)
        self.loss_gap, self.skip_steps = float(loss_gap), skip_steps
        #: the run's first tracked losses (up to 3): their median is the scale of ``loss_gap``
        self.first_losses: list[float] = []
        #: ``[step, loss, grad norm, learning rate]`` of the last ``window`` tracked steps
        self.history: list[list[float]] = []
        self.seen = 0
        self.last_spike: int | None = None
        #: the scores of the last step after the warmup, spike or not (``update``'s dict)
        self.last_scores: dict[str, Any] | None = None
        #: the ``skipped`` of the last step (steps a GradScaler skipped before it)
        self.last_skipped = 0
        self._since_spike = cooldown + 1

    def settings(self) -> dict[str, Any]:
        return {"window": self.window, "warmup": self.warmup, "z": self.z, "loss_ratio": self.loss_ratio,
                "grad_ratio": self.grad_ratio, "ramp_z": self.ramp_z, "cooldown": self.cooldown,
                "loss_gap": self.loss_gap, "skip_steps": self.skip_steps}

    @property
    def first_loss(self) -> float:
        """The median of the run's first (up to 3) finite tracked losses (NaN before any)."""
        return robust_center_scale(self.first_losses)[0]

    def baseline(self, column: int) -> tuple[float, float]:
        """``(median, robust scale)`` of a window column (1: loss, 2: gradient norm, 3: learning rate)."""
        return robust_center_scale([row[column] for row in self.history])

    def ramping(self, rate: float | None) -> bool:
        """Whether the learning rate is above the window's median by a gradual schedule (no step of it
        more than 1.5x the one before)."""
        rates = [row[3] for row in self.history if row[3] is not None and math.isfinite(row[3])]
        if rate is None or len(rates) < 2 or not rate > rates[-1] * 1.001:
            return False
        steps = [b / a for a, b in zip(rates, rates[1:] + [rate]) if a > 0]
        return bool(steps) and max(steps) <= 1.5 and rate > sorted(rates)[len(rates) // 2]

    def update(self, step: int, loss: float, grad_norm: float, rate: float | None = None,
               skipped: int = 0) -> dict[str, Any] | None:
        """Add a tracked step (``skipped``: steps a GradScaler skipped since the previous tracked step); return
        ``{"step", "series", "loss", "grad_norm", "skipped"}`` when it spikes, else None.

        ``loss`` / ``grad_norm`` entries: ``{"value", "baseline", "z", "ratio", "spike"}``."""
        found, self.last_scores, self.last_skipped = None, None, int(skipped)
        self._since_spike += 1
        if self.seen >= self.warmup and len(self.history) >= 3:
            ramp = self.ramping(rate)
            result: dict[str, Any] = {"step": int(step), "series": [], "ramping": ramp, "skipped": int(skipped)}
            for name, column, ratio, z in (("loss", 1, self.loss_ratio, self.z),
                                           ("grad_norm", 2, self.grad_ratio, self.ramp_z if ramp else self.z)):
                value = loss if name == "loss" else grad_norm
                window = [row[column] for row in self.history]
                score = robust_score(window, value, min_window=3, recent=RECENT)
                center = robust_center_scale([v for v in window if v > 0 and math.isfinite(v)][-RECENT:])[0]
                rise = value / center if center and center > 0 and math.isfinite(value) else math.inf
                spike = bool(score >= z and rise >= ratio)
                if name == "loss" and math.isfinite(value) and math.isfinite(self.first_loss):
                    spike = spike and value - center >= self.loss_gap * abs(self.first_loss)
                result[name] = {"value": value, "baseline": center, "z": score, "ratio": rise, "spike": spike}
                if spike:
                    result["series"].append(name)
            if skipped >= self.skip_steps:
                result["series"].append("loss_scale")
            self.last_scores = result
            if result["series"] and self._since_spike > self.cooldown:
                found = result
                self.last_spike, self._since_spike = int(step), 0
        if len(self.first_losses) < 3 and math.isfinite(loss):
            self.first_losses.append(float(loss))
        self.history.append([float(step), float(loss), float(grad_norm), None if rate is None else float(rate)])
        del self.history[: max(0, len(self.history) - self.window)]
        self.seen += 1
        return found

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(row) for row in self.history], "seen": self.seen, "last_spike": self.last_spike,
                "since_spike": self._since_spike, "first_losses": list(self.first_losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.seen = [list(row) for row in state["history"]], state["seen"]
        self.last_spike, self._since_spike = state["last_spike"], state["since_spike"]
        self.first_losses = list(state.get("first_losses", []))
