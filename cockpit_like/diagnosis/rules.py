"""The built-in diagnosis rules (one class each; ``docs/diagnosis.md`` lists them).

Every rule reads stored values only (see :mod:`cockpit_like.diagnosis.rule`
for the contract). Thresholds are constructor arguments; the defaults are
chosen so that the demo run and other healthy runs raise nothing of severity
``warning`` or above (``tests/test_diagnosis_runs.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from cockpit_like.diagnosis.causes import exploding_gradient_fix
from cockpit_like.diagnosis.findings import STRENGTHS, Finding
from cockpit_like.diagnosis import recipe
from cockpit_like.diagnosis.history import RunHistory, block_values, to_float
from cockpit_like.diagnosis.rule import Rule

__all__ = [
    "NonFiniteLoss",
    "LossDiverging",
    "LossNotDecreasing",
    "NoisyLoss",
    "SmallBatch",
    "LargeInputScale",
    "ConstantInputs",
    "LossAtChance",
    "ExplodingGradient",
    "VanishingGradient",
    "UpdateRatioTooSmall",
    "UpdateRatioTooLarge",
    "StepOvershoots",
    "StepTooShort",
    "SharpnessAboveStability",
    "NoiseDominated",
    "DeadUnits",
    "SaturatedUnits",
    "PoorInitialization",
    "UnchangedParameters",
    "Overfitting",
    "LearningRateJump",
    "WeightsShrinking",
    "GradientsAccumulate",
    "SaturatedOutput",
    "LossJump",
    "ExplodingRecurrence",
    "default_rules",
]


def _median(values) -> float:
    """The median of a short sequence (faster than numpy's for the few values of a window)."""
    ordered = sorted(float(v) for v in values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def _column_median(matrix: np.ndarray) -> np.ndarray:
    """The median of each column of a few rows (``np.median(matrix, axis=0)`` without its overhead;
    a NaN in a column gives NaN)."""
    ordered = np.sort(matrix, axis=0)
    rows = ordered.shape[0]
    middle = ordered[rows // 2] if rows % 2 else 0.5 * (ordered[rows // 2 - 1] + ordered[rows // 2])
    return np.where(np.isnan(matrix).any(axis=0), np.nan, middle)


def _g(value: float) -> str:
    return f"{value:.3g}"




def _strength(margin: float, moderate: float, strong: float) -> str:
    """``suggestive`` below ``moderate``, ``moderate`` below ``strong``, else ``strong``: how far a
    statistic is past its threshold, in the rule's own units (a log ratio, standard errors, steps)."""
    if not margin >= moderate:
        return "suggestive"
    return "moderate" if margin < strong else "strong"


def _finite(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def _total_norm(value: Any) -> float:
    blocks = block_values(value)
    return math.nan if blocks is None else float(np.sqrt(np.sum(blocks**2)))


def _global_update_ratio(history: RunHistory, steps) -> float:
    """The median over ``steps`` of ``||update|| / ||parameters||`` over every tracked parameter (``UpdateSize``
    and ``ParamNorm``), or NaN where either is not tracked: whether the parameters move at all."""
    if not (history.has("UpdateSize") and history.has("ParamNorm")):
        return math.nan
    wanted = {int(step) for step in steps}
    updates = dict(history.last("UpdateSize", len(wanted) + 2))
    norms = dict(history.last("ParamNorm", len(wanted) + 2))
    ratios = []
    for step in wanted & set(updates) & set(norms):
        update, norm = _total_norm(updates[step]), _total_norm(norms[step])
        if math.isfinite(update) and norm > 0:
            ratios.append(update / norm)
    return _median(ratios) if ratios else math.nan


def _blocks(value: Any) -> np.ndarray | None:
    return block_values(value)


def _check_positive(name: str, value: float) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def _check_nonnegative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


#: how many recent values the noise scales of a run look at (keeps the cost per step flat)
NOISE_VALUES = 200
#: after how many new values a run's noise scale is computed again (it changes slowly)
NOISE_EVERY = 8


def _robust_scale(values: np.ndarray) -> float:
    """``1.4826 * median(|x - median(x)|)``: the standard deviation for normal data, robust to outliers."""
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return 0.0
    center = _median(values)
    return 1.4826 * _median(np.abs(values - center))


def _noise(history: RunHistory, name: str, log: bool) -> float:
    """The run's own noise of ``name`` (or of its logarithm) per step: a robust scale of its steps over
    the last :data:`NOISE_VALUES` finite values, divided by sqrt 2. Kept in ``history.memo`` and
    computed again after every :data:`NOISE_EVERY` new values (at every value for the first 40),
    so that the cost per step stays small; the scale changes slowly."""
    memo = history.memo.setdefault("noise", {})
    key = (name, log)
    count, version = history.count(name), history.version(name)
    cached = memo.get(key)
    if cached is not None and cached[0] == version and 0 <= count - cached[1] < (NOISE_EVERY if count > 40 else 1):
        return cached[2]
    _, values = history.tail(name, NOISE_VALUES)
    if log:
        values = np.log(values[values > 0])
    value = _robust_scale(np.diff(values)) / math.sqrt(2.0) if len(values) >= 3 else 0.0
    memo[key] = (version, count, value)
    return value


def _log_noise(history: RunHistory, name: str) -> float:
    """The run's own noise of ``log(value)`` per step (positive values only)."""
    return _noise(history, name, True)


def _abs_noise(history: RunHistory, name: str) -> float:
    """The run's own noise of a scalar per step."""
    return _noise(history, name, False)


def _check_window(value: int, name: str = "window") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class _Persistent(Rule):
    """A scalar quantity whose recent values stay on the wrong side of a threshold."""

    quantity: str = ""

    def __init__(self, threshold: float, window: int = 10, share: float = 0.8):
        self.threshold = float(threshold)
        self.window = _check_window(window)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must lie in (0, 1], got {share!r}")
        self.share = float(share)

    def _beyond(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _recent(self, history: RunHistory) -> tuple[np.ndarray, np.ndarray] | None:
        steps, values = history.tail(self.quantity, self.window)
        if len(values) < self.window:
            return None
        beyond = self._beyond(values)
        if beyond.sum() >= self.share * self.window and self._beyond(np.asarray([_median(values)]))[0]:
            return steps, values
        return None

    def _message(self, median: float, span: str) -> str:
        raise NotImplementedError

    fix: str = ""

    def check(self, history: RunHistory) -> list[Finding]:
        recent = self._recent(history)
        if recent is None:
            return []
        steps, values = recent
        median, first, last = _median(values), int(steps[0]), int(steps[-1])
        return [self.finding(last, self._message(median, f"{first}..{last}"), fix=self.fix,
                             evidence={"median": median, "steps": [first, last]})]


# ---- the loss -----------------------------------------------------------------------------
class NonFiniteLoss(Rule):
    """The mini-batch loss (``Loss``) became NaN or infinite."""

    id = "nonfinite-loss"
    severity = "error"
    strength = "conclusive"
    reads = ("Loss",)

    def check(self, history: RunHistory) -> list[Finding]:
        step, count = history.nonfinite("Loss")
        if step is None:
            return []
        value = to_float(history.get("Loss", step))
        total = history.count("Loss")
        return [
            self.finding(
                step,
                f"the loss is {value} at step {step} ({count} of {total} tracked steps non-finite so far)",
                fix="after a blow-up (losses growing before it): lower the learning rate or clip gradients "
                "(torch.nn.utils.clip_grad_norm_); without one, check that step's batch for NaN or inf and look "
                "for log(0), division by zero or exp overflow in the model and loss (cockpit.record(step) names "
                "the operation that made the first non-finite value, or says the step received it)",
                evidence={"first_step": step, "value": value, "nonfinite_steps": count},
            )
        ]


class LossDiverging(Rule):
    """The loss blows up: its recent median is far above a reference that an early explosion cannot hide.

    The reference is the smaller of the first finite tracked loss and the
    best (lowest) moving median so far; the recent median is over the last
    ``window`` finite losses. With ``r = log(recent / reference)`` and
    ``sigma`` the run's own noise (a robust scale of the steps of
    ``log(loss)``, from the median absolute deviation), the rule fires when
    ``r > log(factor)`` (measured from the best moving median, which a noisy
    run pushes low, only when also ``r > z * sigma``), or when
    ``r > log(min_factor)`` and ``r > z * sigma`` (a smaller rise that is
    still far outside the run's noise); in both cases
    the rise must also exceed ``min_gap`` x the first tracked loss (a loss
    that went from 0.02 to 0.07 late in a run has not diverged), and
    ``min_gap_best`` x it when measured from the best moving median (a noisy
    late phase of a run near a loss of 0 swings by several times its best
    median: on the generated corpus's tuning families, healthy runs rose by up
    to 0.36 x their first loss so in seeds 0 and 1, up to 0.58 x in seeds 2 and 3: 0.6 since round 5). With batches of at most ``small_batch``
    samples the median is over ``small_batch_window`` losses. The loss is
    assumed positive (cross-entropy, squared error).

    Severity: ``warning`` at first; ``error`` once the divergence is
    sustained (the median of the last ``sustain`` losses above ``factor`` x
    the reference and none back below ``min_factor`` x it), so that a
    3-step spike after a step decay is not an error. The engine reports the
    finding again when its severity rises.
    """

    id = "loss-diverging"
    severity = "error"
    reads = ("Loss",)

    def __init__(self, window: int = 3, factor: float = 3.0, min_factor: float = 1.15, z: float = 12.0,
                 min_gap: float = 0.1, sustain: int = 8, min_gap_best: float = 0.6, small_batch: int = 2,
                 small_batch_window: int = 9, noise_values: int = 10):
        self.window = _check_window(window)
        self.noise_values = _check_window(noise_values, "noise_values")
        self.min_gap_best = float(min_gap_best)
        self.small_batch = int(small_batch)
        self.small_batch_window = _check_window(small_batch_window, "small_batch_window")
        self.sustain = _check_window(sustain, "sustain")
        self.min_gap = float(min_gap)
        self.factor = _check_positive("factor", factor)
        self.min_factor = _check_positive("min_factor", min_factor)
        self.z = _check_positive("z", z)

    def _best(self, history: RunHistory) -> tuple[float, int]:
        """The smallest moving median of the finite losses and the step that ends its window
        (incremental: each loss is looked at once)."""
        steps, values = history.scalars("Loss")
        memo = history.memo.setdefault(f"{self.id}/{self.window}", {})
        if memo.get("version") != history.version("Loss") or memo.get("done", 0) > len(values):
            memo.update(version=history.version("Loss"), done=0, best=math.inf, at=0, last=[])
        last = memo["last"]
        for step, value in zip(steps[memo["done"] :], values[memo["done"] :]):
            if math.isfinite(value):
                last.append(float(value))
                if len(last) >= self.window:
                    median = _median(last[-self.window :])
                    if median < memo["best"]:
                        memo["best"], memo["at"] = median, int(step)
                    del last[: len(last) - self.window + 1]
        memo["done"] = len(values)
        return memo["best"], memo["at"]

    def check(self, history: RunHistory) -> list[Finding]:
        window = self.window
        if history.has("BatchSize") and to_float(history.last("BatchSize")[0][1]) <= self.small_batch:
            window = max(window, self.small_batch_window)  # the loss of one or two samples is mostly noise
        if history.count("Loss") - history.nonfinite("Loss")[1] < window + 1:
            return []
        first_steps, first_values = history.head("Loss", 1)
        steps, values = history.tail("Loss", window)
        first, recent = float(first_values[0]), _median(values)
        best, best_step = self._best(history)
        reference, where = (first, int(first_steps[0])) if first <= best else (best, best_step)
        if not reference > 0 or not recent > 0 or int(steps[0]) <= where:
            return []
        rise = math.log(recent / reference)
        sigma = _log_noise(history, "Loss")
        # the run's noise is read from noise_values finite losses at least: from 3 steps a robust scale can be
        # any size (round 12: a healthy Poisson regression at batch 4, three first losses within 0.5% of each
        # other, was called diverging at step 3 by a rise of 1.47x, "far outside" that noise)
        known = history.count("Loss") - history.nonfinite("Loss")[1] >= self.noise_values
        outside = known and rise > self.z * sigma
        far = rise > math.log(self.factor) and (reference == first or outside)
        if not (far or (rise > math.log(self.min_factor) and outside)):
            return []
        gap = self.min_gap if reference == first else self.min_gap_best
        if recent - reference <= gap * first:  # small in the loss's own units (late, low losses)
            return []
        step = int(steps[-1])
        what = "the first tracked loss" if reference == first else "the best moving median"
        sustained = self._sustained(history, reference, where)
        lr_then, lr_now = recipe.rate_at(history, where), recipe.rate_at(history, step)
        return [
            self.finding(
                step,
                f"the loss is diverging: its median over the last {self.window} tracked steps is {_g(recent)}, "
                f"{_g(recent / reference)}x {what} ({_g(reference)} at step {where}); the run's own noise is "
                f"{_g(100 * sigma)}% per step"
                + (f"; it has stayed above {_g(self.factor)}x for {self.sustain} steps" if sustained else
                   " (an error once it stays there for " + f"{self.sustain} steps)"),
                fix="lower the learning rate (e.g. by 10x), add warm-up or gradient clipping",
                evidence={"recent": recent, "reference": reference, "reference_step": where, "noise": sigma,
                          "window": self.window, "steps": [int(steps[0]), step], "since": int(steps[0]),
                          "sustained": sustained, "from_first": reference == first,
                          "rate_ratio": (lr_now / lr_then) if lr_then > 0 else math.nan,
                          "strength": "conclusive" if sustained else _strength(
                              rise / max(self.z * sigma, 1e-12), 1.5, 3.0)},
                severity="error" if sustained else "warning",
            )
        ]

    def _sustained(self, history: RunHistory, reference: float, where: int) -> bool:
        """Whether the last ``sustain`` finite losses, all after ``where``, have a median above
        ``factor`` x ``reference`` and none of them is back below ``min_factor`` x it."""
        steps, values = history.tail("Loss", self.sustain)
        if len(values) < self.sustain or int(steps[0]) <= where:
            return False
        return bool(_median(values) > self.factor * reference and values.min() > self.min_factor * reference)


class LossNotDecreasing(Rule):
    """The loss has not fallen, and the evidence for that is strong relative to the run's noise.

    After ``min_values`` finite tracked losses, compares the median of the
    first quarter with the median of the last quarter (at least ``window``
    values each, at most ``max_quarter``, so the cost per step stays flat). ``sigma`` is the run's noise (a robust scale of the steps
    of the loss), ``se = 1.25 sigma sqrt(2 / n)`` the standard error of the
    difference of two medians of ``n`` values. The rule fires when even the
    optimistic decrease ``first - recent + z * se`` is below
    ``min_decrease * first``. A loss that rose above ``1 + max_rise`` times
    its start is left to ``loss-diverging``.

    ``z`` (default 4) asks for strong evidence: on the corpus's tuning half,
    slow healthy runs with batches of 8 reach ``z`` up to 3.4 (their loss
    falls 2-5% in 60 steps at a noise of 2-3% per step), runs with shuffled
    labels 5.1 and 7.6.

    After a warm-up (or a raised rate) no verdict before ``min_values`` finite losses counted from where
    the run began to train at its rate (``recipe.rate_settled``: the running peak of the rate within 1.2x
    of today's; round 9): a loss that did not fall while the rate still rose has not yet stalled at the
    run's rate (outside trial 8's healthy one-cycle CNN sat at chance for its 60-step warm-up and fell 20
    steps after the peak). The comparison itself still starts at the run's first loss: counted from the
    end of the warm-up, a healthy language model of the generated corpus whose loss fell during its
    8-step warm-up and then sat at the unigram level for 40 steps was called stalled.
    """

    id = "loss-not-decreasing"
    severity = "warning"
    strength = "strong"  # z = 4 standard errors
    reads = ("Loss",)

    def __init__(self, window: int = 5, min_values: int = 40, min_decrease: float = 0.03, z: float = 4.0,
                 max_rise: float = 0.5, max_quarter: int = 50):
        self.window = _check_window(window)
        self.max_quarter = _check_window(max_quarter, "max_quarter")
        self.min_values = _check_window(min_values, "min_values")
        if not 0.0 <= min_decrease < 1.0:
            raise ValueError(f"min_decrease must lie in [0, 1), got {min_decrease!r}")
        self.min_decrease = float(min_decrease)
        self.z = float(z)
        self.max_rise = _check_positive("max_rise", max_rise)

    def check(self, history: RunHistory) -> list[Finding]:
        finite = history.count("Loss") - history.nonfinite("Loss")[1]
        if finite < max(self.min_values, 2 * self.window):
            return []
        loss_steps, losses = history.scalars("Loss")
        settled = recipe.rate_settled(history, int(loss_steps[-1]))
        if settled is not None and settled > loss_steps[0]:
            # no verdict before ``min_values`` finite losses at the run's rate (after a warm-up; round 9); the
            # finite losses before it are counted once per settled step, so the cost per step stays flat
            at = int(np.searchsorted(loss_steps, settled))
            memo = history.memo.setdefault(f"{self.id}/{id(self)}", {})
            if memo.get("key") != (settled, history.version("Loss")):
                memo.update(key=(settled, history.version("Loss")), before=int(np.isfinite(losses[:at]).sum()))
            if finite - memo["before"] < max(self.min_values, 2 * self.window):
                return []
        count = max(self.window, min(finite // 4, self.max_quarter))
        first_steps, first_values = history.head("Loss", count)
        last_steps, last_values = history.tail("Loss", count)
        first, recent = _median(first_values), _median(last_values)
        if not first > 0 or recent > (1.0 + self.max_rise) * first:
            return []
        sigma = _abs_noise(history, "Loss")
        se = 1.25 * sigma * math.sqrt(2.0 / count)
        if first - recent + self.z * se >= self.min_decrease * first:
            return []
        change = 100.0 * (first - recent) / first
        return [
            self.finding(
                int(last_steps[-1]),
                f"the loss is not decreasing: median {_g(first)} over the first {count} tracked steps, "
                f"{_g(recent)} over the last {count} (steps {int(first_steps[0])}..{int(last_steps[-1])}, "
                f"{_g(change)}% lower, noise {_g(sigma)} per step; expected at least {_g(100 * self.min_decrease)}%)",
                fix="raise the learning rate (try 10x) if the updates are small; check that the optimizer gets the "
                "model's parameters, that the labels match the inputs and that no layer is frozen",
                evidence={"first": first, "recent": recent, "noise": sigma, "quarter": count,
                          "steps": [int(first_steps[0]), int(last_steps[-1])], "tracked": int(finite)},
            )
        ]


def _loss_progress(history: RunHistory, sigma: float, from_start: bool = False) -> tuple[float, float, int]:
    """How far the loss fell beyond its own noise ``sigma`` (per step): over the last
    :data:`NOISE_VALUES` values, the earlier half's median minus the later half's (``fall``), in
    standard errors of that difference (``1.2533 sigma sqrt(2 / h)`` for halves of ``h`` values,
    ``progress``), and the first step of the comparison. ``from_start``: the first ``h`` values of
    the run against the last ``h`` (``h`` at most half the run and :data:`NOISE_VALUES` / 2), so
    that a run that learned and then levelled off counts as having learned."""
    if from_start:
        half = len(history.tail("Loss", NOISE_VALUES)[1]) // 2  # at most NOISE_VALUES / 2, at a bounded cost
        run_steps, early = history.head("Loss", half)
        late = history.tail("Loss", half)[1]
    else:
        run_steps, run = history.tail("Loss", NOISE_VALUES)
        half = len(run) // 2
        early, late = run[:half], run[len(run) - half:]
    fall = _median(early) - _median(late)
    scale = 1.2533 * sigma * math.sqrt(2.0 / half)
    progress = fall / scale if scale > 0 else (math.inf if fall > 0 else -math.inf if fall < 0 else 0.0)
    return fall, progress, int(run_steps[0])


def _held(history: RunHistory, rule: Rule, step: int, failing: bool, margin: bool) -> bool:
    """Hysteresis for a test that fires below a limit: whether ``rule``'s finding holds at ``step``.

    ``failing`` says whether the test fails at its limit, ``margin`` whether it fails at the limit
    raised by the rule's ``release`` (a finding that holds stays until the test passes that one, so
    that a statistic hovering at the limit does not report, clear and report again). The state is
    kept in ``history.memo`` per rule instance; checking the same step twice gives the same answer.
    """
    memo = history.memo.setdefault(f"{rule.id}/held/{id(rule)}", {"step": None, "before": False, "now": False})
    if memo["step"] != step:
        memo["before"] = memo["now"] if memo["step"] is not None and memo["step"] < step else False
        memo["step"] = step
    memo["now"] = failing or (memo["before"] and margin)
    return memo["now"]


class _LossProgress(Rule):
    """A rule that fires while the loss has not fallen beyond its own noise: the noise ``sigma`` over
    the last ``window + 1`` values, the progress test of :func:`_loss_progress` below ``z``, held
    until ``z + release``."""

    def __init__(self, window: int, z: float, release: float):
        self.window = _check_window(window)
        self.z = _check_positive("z", z)
        self.release = _check_nonnegative("release", release)

    def _recent(self, history: RunHistory) -> tuple[np.ndarray, float] | None:
        """The steps of the last ``window + 1`` finite losses and their noise per step (None: too few)."""
        steps, values = history.tail("Loss", self.window + 1)
        if len(values) < self.window + 1:
            return None
        return steps, _robust_scale(np.diff(values)) / math.sqrt(2.0)

    def _stalled(self, history: RunHistory, step: int, sigma: float | None,
                 from_start: bool = False) -> tuple[float, float, int] | None:
        """``(fall, progress, since)`` when the finding holds at ``step``, else None; ``sigma`` None:
        the rule's other condition failed (the finding is released)."""
        if sigma is None:
            _held(history, self, step, False, False)
            return None
        fall, progress, since = _loss_progress(history, sigma, from_start)
        if not _held(history, self, step, progress < self.z, progress < self.z + self.release):
            return None
        return fall, progress, since


class NoisyLoss(_LossProgress):
    """The loss jumps from step to step far more than it falls: a batch too small for the task.

    ``sigma`` is a robust scale (median absolute deviation) of the steps of
    the loss over the last ``window`` tracked values, relative to the first
    tracked loss. The rule fires when it is above ``threshold`` *and* the loss
    has not fallen beyond its own noise: over the last :data:`NOISE_VALUES`
    finite values (the whole run on short runs), the median of the later half
    is not below that of the earlier half by ``z`` standard errors
    (``1.2533 sigma sqrt(2 / h)`` for halves of ``h`` values). A noisy run that
    learns (batches of 8 at a good learning rate) is left alone; a noisy run
    that does not is named. Once it fires, the finding holds (while the
    noise stays above ``threshold``) until the progress reaches
    ``z + release``, so that a loss at the edge does not report, clear and
    report again. Where ``BatchSize`` is stored, batches above ``max_batch``
    (default 1) are left alone: the rule names a batch too small, and a
    regression loss of batches of 16 swings by 40% of its start while it
    learns (``max_batch=8`` until round 11: outside trial 15's healthy
    regressions with batches of 2, 4 and 8 swing by 50-170% of their first
    loss at their optimum, and no run of any set had a batch of 2-8 that the
    rule was right about). A batch of one is read by ``small-batch`` too; the
    rule's own reach is the runs whose batch size is not stored.
    """

    id = "noisy-loss"
    severity = "warning"
    reads = ("Loss",)

    def __init__(self, window: int = 20, threshold: float = 0.17, z: float = 2.0, release: float = 1.0,
                 max_batch: int = 1):
        super().__init__(window, z, release)
        self.threshold = _check_positive("threshold", threshold)
        self.max_batch = _check_window(max_batch, "max_batch")

    def check(self, history: RunHistory) -> list[Finding]:
        if history.has("BatchSize") and to_float(history.last("BatchSize")[0][1]) > self.max_batch:
            return []  # a noisy loss from a batch of more than max_batch samples is the task's, not the batch's
        recent = self._recent(history)
        first = float(history.head("Loss", 1)[1][0]) if recent is not None else math.nan
        if recent is None or not first > 0:
            return []
        steps, sigma = recent
        relative = sigma / first
        stalled = self._stalled(history, int(steps[-1]), sigma if relative > self.threshold else None)
        if stalled is None:
            return []
        fall, progress, since = stalled
        return [
            self.finding(
                int(steps[-1]),
                f"the loss is noisy: it moves by {_g(sigma)} from step to step (a robust scale over steps "
                f"{int(steps[0])}..{int(steps[-1])}), {_g(100 * relative)}% of the first tracked loss, and it "
                f"has not fallen beyond that noise since step {since} (the later half's median "
                f"{_g(fall)} lower, {_g(progress)} standard errors; {_g(self.z)} needed)",
                fix="use a larger batch (or accumulate gradients over several), or lower the learning rate",
                evidence={"noise": sigma, "relative": relative, "steps": [int(steps[0]), int(steps[-1])],
                          "fall": fall, "progress": progress, "progress_from": since},
            )
        ]


class SmallBatch(_LossProgress):
    """Batches of at most ``max_batch`` samples (default 1) and a loss that has not fallen beyond its
    own noise over ``window`` tracked steps: the gradient of so few samples is mostly noise.

    With one sample per step nothing within a step measures the gradient's
    noise (``NormTest`` and the other gradient tests need two samples), and a
    single sample's loss can sit at a healthy batch's noise level, below
    ``noisy-loss``'s threshold. The rule reads the batch size the cockpit
    stores (``BatchSize``, the samples of the optimizer step, all
    micro-batches and ranks together), waits for ``window`` tracked steps of
    such batches, and fires when the loss's progress test stays below ``z``:
    the median of the run's first ``h`` values against that of its last
    ``h`` (``h`` half the run, at most 100), in standard errors of the run's
    own step-to-step noise (as in ``noisy-loss``, which compares the halves
    of the last 200 values). A tiny batch that learns, or that learned and
    levelled off, is left alone. Once it fires, the finding holds until the
    progress reaches ``z + release``.
    """

    id = "small-batch"
    severity = "warning"
    reads = ("Loss", "BatchSize")

    def __init__(self, max_batch: int = 1, window: int = 20, z: float = 2.0, release: float = 1.0):
        super().__init__(window, z, release)
        self.max_batch = _check_window(max_batch, "max_batch")

    def check(self, history: RunHistory) -> list[Finding]:
        batch_steps, batches = history.tail("BatchSize", self.window + 1)  # finite values only
        if len(batches) < self.window + 1:
            return []
        largest = float(np.max(batches))
        if not largest <= self.max_batch:  # the usual case: nothing more to compute
            self._stalled(history, int(batch_steps[-1]), None)
            return []
        recent = self._recent(history)
        if recent is None or int(batch_steps[0]) > int(recent[0][0]):
            return []
        steps, sigma = recent
        stalled = self._stalled(history, int(steps[-1]), sigma, from_start=True)
        if stalled is None:
            return []
        fall, progress, since = stalled
        return [
            self.finding(
                int(steps[-1]),
                f"each step's gradient comes from at most {int(largest)} sample(s) (steps {int(steps[0])}.."
                f"{int(steps[-1])}), and the loss has not fallen beyond its own noise since step {since} "
                f"(the later half's median {_g(fall)} lower, {_g(progress)} standard errors of a step-to-step "
                f"noise of {_g(sigma)}; {_g(self.z)} needed)",
                fix="use a larger batch (or accumulate gradients over several micro-batches and pass "
                    "info['micro_batches']), or lower the learning rate",
                evidence={"batch_size": largest, "noise": sigma, "steps": [int(steps[0]), int(steps[-1])],
                          "fall": fall, "progress": progress, "progress_from": since},
            )
        ]


# ---- gradients ------------------------------------------------------------------------------
def _moving_parameters(history: RunHistory) -> np.ndarray | None:
    """Which parameters the optimizer moved at the latest step (``UpdateSize`` above 0), or ``None`` where
    every one moved, none did, or ``UpdateSize`` is not tracked. A parameter left out of the optimizer keeps
    its gradient (``optimizer.zero_grad()`` clears only the optimizer's), which then adds up over steps
    harmlessly: no step uses it."""
    latest = history.last("UpdateSize", 1)
    blocks = block_values(latest[0][1]) if latest else None
    if blocks is None or not np.isfinite(blocks).all():
        return None
    moving = blocks > 0
    return None if moving.all() or not moving.any() else moving


def _masked_norm(value: Any, mask: np.ndarray) -> float:
    """The total norm of the parameters ``mask`` selects (NaN where ``value`` has another layout)."""
    blocks = block_values(value)
    return math.nan if blocks is None or len(blocks) != len(mask) else float(np.sqrt(np.sum(blocks[mask] ** 2)))


def _recurrent_parameters(history: RunHistory) -> list[str] | None:
    """The parameters the log's ``param_names`` show as a recurrence's (``weight_hh``: ``nn.RNN``, ``LSTM``,
    ``GRU`` and their cells); ``None`` where the log has no names. ``[]`` does not rule a recurrence out (one
    made of ``nn.Linear`` layers has no such name): the fix then names none (:func:`exploding_gradient_fix`)."""
    names = history.metadata.get("param_names")
    if not isinstance(names, (list, tuple)) or not names:
        return None
    return [str(name) for name in names if "weight_hh" in str(name).rsplit(".", 1)[-1]]


class ExplodingGradient(Rule):
    """The total gradient norm (from ``GradNorm``) explodes, or is not finite.

    Two references that an early explosion cannot hide:

    - *growth*: the latest norm is above ``factor`` x the smaller of the first
      tracked norm and the median of the norms so far (the explosion came after
      updates: typically the learning rate);
    - *at the start*: while ``window`` to ``start_steps`` norms are stored, the
      first tracked norm is above ``start_factor`` x the median of the norms so
      far (the gradient was already exploding before any update: the model or
      the data, e.g. a recurrent layer that amplifies the gradient through
      time). Evidence ``at_start: true``, ``since`` the first step,
      ``recurrent`` the parameters named as a recurrence's (``weight_hh``)
      where the log's ``param_names`` show one; the fix names recurrent weights
      only then. ``start_factor`` is lower than ``factor``: the norms right
      after an early explosion stay high for a few steps and hold the median
      up. On the corpus's tuning half the first norm is at most 2.4x the
      median on every run that is not labelled with a problem of the model or
      the data, and 35x and 640x on the two exploding recurrent runs (at most
      13x on the saturating-tanh initialization runs). Only at the start:
      later, a first norm far above the median says that the run converged (a
      healthy 1-D CNN's norms fell 20x in 143 steps), not that the gradient
      exploded; on the tuning halves of both corpora the first norm passed
      ``start_factor`` within 7-21 norms on every run where it did.

    Severity ``error`` when the latest norm is NaN or infinite.

    Where ``UpdateSize`` is tracked and some parameters did not move at the latest step (left out of
    the optimizer: their gradients add up, since ``zero_grad()`` does not clear them), the growth test
    is made again on the norm of the parameters that moved (round 5 of issue 36).
    """

    id = "exploding-gradient"
    severity = "warning"
    reads = ("GradNorm",)  # (and UpdateSize where tracked: parameters the optimizer does not move are left out)

    def __init__(self, window: int = 5, factor: float = 50.0, start_factor: float = 20.0, start_steps: int = 30):
        self.window = _check_window(window)
        self.factor = _check_positive("factor", factor)
        self.start_factor = _check_positive("start_factor", start_factor)
        self.start_steps = _check_window(start_steps, "start_steps")
        if self.start_steps < self.window:
            raise ValueError(f"start_steps must be at least window ({self.window}), got {start_steps!r}")

    def _median_so_far(self, history: RunHistory, totals: list[float]) -> float:
        """The median of the last :data:`NOISE_VALUES` finite norms (computed again every
        :data:`NOISE_EVERY` norms once there are 40)."""
        memo = history.memo.setdefault(f"{self.id}/median", {})
        version, count = history.version("GradNorm"), len(totals)
        if memo.get("version") == version and 0 <= count - memo.get("count", -99) < (
                NOISE_EVERY if count > 40 else 1):
            return memo["value"]
        finite = [v for v in totals[-NOISE_VALUES:] if math.isfinite(v)]
        value = _median(finite) if finite else math.nan
        memo.update(version=version, count=count, value=value)
        return value

    @staticmethod
    def _loss_rose(history: RunHistory, steps: list[int]) -> bool:
        """Whether the median loss at ``steps`` lies above the loss at the first of them."""
        losses = [to_float(history.get("Loss", step)) for step in steps]
        finite = [v for v in losses if math.isfinite(v)]
        return bool(finite and math.isfinite(losses[0]) and _median(finite) > losses[0])

    def check(self, history: RunHistory) -> list[Finding]:
        steps, totals = history.series("GradNorm", _total_norm)
        if not totals:
            return []
        step, latest = steps[-1], totals[-1]
        if not math.isfinite(latest):
            return [
                self.finding(
                    step,
                    f"the gradient norm is {latest} at step {step}",
                    fix="lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), look for "
                    "log(0) or exp overflow",
                    evidence={"step": step, "norm": latest, "since": step},
                    severity="error",
                )
            ]
        if len(totals) < 2:
            return []
        first, typical = totals[0], self._median_so_far(history, totals)
        # ... and the loss did not rise over those steps: norms that fell while the loss rose come from a
        # collapse (an embedding that collapsed to a point), not from a start that was exploding (round 7)
        if self.window <= len(totals) <= self.start_steps and typical > 0 and first > self.start_factor * typical \
                and not self._loss_rose(history, steps):
            recurrent = _recurrent_parameters(history)
            return [
                self.finding(
                    step,
                    f"the gradient was exploding from the first tracked step: {_g(first)} at step {steps[0]}, "
                    f"{_g(first / typical)}x the median {_g(typical)} of the first {len(totals)} tracked norms "
                    f"(steps {steps[0]}..{step}), before any update",
                    fix=exploding_gradient_fix(recurrent),
                    evidence={"step": step, "norm": first, "median": typical, "at_start": True,
                              "since": int(steps[0]), "recurrent": recurrent},
                )
            ]
        reference = min(first, typical) if math.isfinite(typical) else first
        if not (reference > 0 and latest > self.factor * reference):
            return []
        moving = _moving_parameters(history)
        if moving is not None:  # only the parameters the optimizer moves (the growth of left-out ones is harmless)
            norms = [_masked_norm(value, moving) for _, value in history.last("GradNorm", NOISE_VALUES)]
            finite = [v for v in norms if math.isfinite(v)]
            first = _masked_norm(history.first("GradNorm", 1)[0][1], moving)
            latest, typical = norms[-1], (_median(finite) if finite else math.nan)
            reference = min(first, typical) if math.isfinite(typical) else first
            if not (reference > 0 and latest > self.factor * reference):
                return []
        return [
            self.finding(
                step,
                f"the gradient norm is exploding: {_g(latest)} at step {step}, {_g(latest / reference)}x its "
                f"reference {_g(reference)} (the first tracked norm or the run's median, the smaller)",
                fix="lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), or normalize "
                "activations (LayerNorm/BatchNorm)",
                evidence={"step": step, "norm": latest, "reference": reference, "since": step,
                          "recurrent": _recurrent_parameters(history)},
            )
        ]


def _frozen_at(history: RunHistory, step: int) -> set[str]:
    """The tracked parameters with ``requires_grad=False`` at ``step``: the step's ``checks["frozen"]`` (the
    checks are stored, and read here, at the steps where they say something)."""
    checks = history.get("checks", step)
    frozen = checks.get("frozen") if isinstance(checks, Mapping) else None
    return set(frozen) if isinstance(frozen, (list, tuple)) else set()


def _frozen_since(history: RunHistory, series: str, steps: list[int]) -> dict[str, int]:
    """``{parameter: the first step of its current frozen stretch}`` (``requires_grad=False`` at every step of
    ``steps``, the steps of ``series``, from there to the last; ``-1`` when that is from the first of ``steps``
    on: frozen on purpose, as in fine-tuning). Kept up to date a step at a time in ``history.memo``: each
    tracked step reads only its own checks."""
    if not steps or not history.has("checks"):
        return {}
    memo = history.memo.setdefault("frozen-since", {}).setdefault(series, {})
    key = (history.version(series), history.version("checks"))
    if memo.get("key") != key or memo.get("count", 0) > len(steps):
        memo.update(key=key, count=0, starts={})
    starts = memo["starts"]
    for position in range(memo["count"], len(steps)):
        frozen = _frozen_at(history, steps[position])
        for name in [name for name in starts if name not in frozen]:
            del starts[name]
        for name in frozen:
            starts.setdefault(name, -1 if position == 0 else steps[position])
    memo["count"] = len(steps)
    return starts


def _structurally_zero(history: RunHistory, ratio: float = 1e-4) -> set[int]:
    """Vectors (biases, norm scales) whose gradient was below ``ratio`` x the largest layer's at the
    first stored ``GradNorm``: a bias right before a normalization layer gets no gradient by design
    (the normalization removes it), so its silence is not a finding."""
    first = history.first("GradNorm", 1)
    memo = history.memo.setdefault("structurally-zero", {})
    key = (first[0][0] if first else None, history.version("GradNorm"), ratio)
    if memo.get("key") != key:
        found: set[int] = set()
        row = block_values(first[0][1]) if first else None
        if row is not None and np.isfinite(row).all() and row.max() > 0:
            found = {i for i in range(len(row)) if (history.param_ndim(i) or 2) < 2 and row[i] < ratio * row.max()}
        memo.update(key=key, value=found)
    return memo["value"]


def _passed_through(history: RunHistory, norms: np.ndarray, index: int, floor: float) -> bool:
    """Whether a weight registered before parameter ``index`` (closer to the input, in the order of
    ``model.parameters()``) has a gradient norm of at least ``floor``: the backward signal reached the layers
    below ``index`` undiminished, so a small gradient of ``index`` itself is local to the layer (an attention
    query or key at initialization, whose gradient is second order in near-zero logits), not a gradient that
    vanishes through depth, which leaves every layer below it small too (round 6 of issue 36)."""
    return any((history.param_ndim(j) or 2) >= 2 and norms[j] >= floor for j in range(index))


#: the fix of a weight whose gradient is exactly 0 (``vanishing-gradient``, ``poor-initialization``)
CUT_OFF_FIX = ("find what cuts the gradient off above this layer: units that are off for every sample (ReLU with "
               "negative biases: initialize biases at 0, use Kaiming initialization or LeakyReLU/GELU), a detached "
               "tensor, or an output the loss does not use")


class VanishingGradient(Rule):
    """A layer's gradient norm is below ``ratio`` x the largest layer's (median over ``window`` steps) or below ``floor``.

    A vector (bias, norm scale) whose gradient was already below ``1e-4`` x
    the largest at the first stored step is skipped while other layers get a
    gradient: a bias right before a BatchNorm/GroupNorm gets none by design.
    """

    id = "vanishing-gradient"
    severity = "warning"
    reads = ("GradNorm",)

    def __init__(self, window: int = 3, ratio: float = 1e-4, floor: float = 1e-10):
        self.window = _check_window(window)
        self.ratio = _check_positive("ratio", ratio)
        self.floor = float(floor)

    def check(self, history: RunHistory) -> list[Finding]:
        all_steps, all_rows = history.series("GradNorm", block_values)  # converted once per value
        if len(all_steps) < self.window:
            return []
        recent = list(zip(all_steps[-self.window :], all_rows[-self.window :]))
        rows = [row for _, row in recent]
        if any(row is None for row in rows) or len({len(row) for row in rows}) != 1:
            return []
        norms = np.vstack(rows)
        if not np.isfinite(norms).all():
            return []
        largest = norms.max(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            relative = _column_median(np.where(largest > 0, norms / largest, 1.0))
        median = _column_median(norms)
        found = []
        steps = [step for step, _ in recent]
        silent = _structurally_zero(history)
        for index in range(norms.shape[1]):
            if index in silent and norms.shape[1] > 1 and not (norms[:, [i for i in range(norms.shape[1])
                                                                          if i not in silent]] == 0).all():
                continue  # a bias before a normalization: no gradient by design
            if relative[index] < self.ratio or median[index] < self.floor:
                layer = history.param_name(index)
                if layer in _frozen_since(history, "GradNorm", all_steps):
                    continue  # requires_grad=False: no gradient by construction (unchanged-parameters says so)
                zero = bool((norms[:, index] == 0).all())
                if not zero and median[index] >= self.floor and _passed_through(
                        history, np.where(median >= self.floor, relative, 0.0), index, self.ratio):
                    continue  # a weight below it gets a normal gradient: small here, not vanishing through depth
                if zero:  # cut off, not small: a ratio of 0 says nothing
                    message = (f"the gradient of {layer} is exactly 0 at steps {steps[0]}..{steps[-1]} (the "
                               f"largest layer's: {_g(_column_median(largest)[0])}): nothing reaches it")
                    fix = CUT_OFF_FIX
                elif median[index] == 0:  # exactly 0 at most steps, not at all: said as such, never as "0x"
                    at = [steps[k] for k in range(len(steps)) if norms[k, index] == 0]
                    other = [f"{_g(norms[k, index])} at step {steps[k]}" for k in range(len(steps))
                             if norms[k, index] != 0]
                    message = (f"the gradient of {layer} is exactly 0 at step{'s' if len(at) > 1 else ''} "
                               f"{', '.join(str(s) for s in at)} of steps {steps[0]}..{steps[-1]} "
                               f"({', '.join(other)}): mostly nothing reaches it")
                    fix = CUT_OFF_FIX
                else:
                    message = (f"the gradient of {layer} vanishes: norm {_g(median[index])} (median over steps "
                               f"{steps[0]}..{steps[-1]}), {_g(relative[index])}x the largest layer's")
                    fix = ("use an initialization scaled to the layer width (Kaiming/Xavier), ReLU-like "
                           "activations instead of saturating tanh/sigmoid, normalization layers or residual "
                           "connections")
                found.append(
                    self.finding(
                        steps[-1],
                        message,
                        fix=fix,
                        layer=layer,
                        evidence={"norm": float(median[index]), "relative": float(relative[index]),
                                  "steps": steps, "zero": zero,
                                  "since": steps[0], "at_start": steps[0] == history.first("GradNorm", 1)[0][0]},
                    )
                )
        return found


# ---- parameter motion -------------------------------------------------------------------------
class _UpdateRatio(Rule):
    """``UpdateSize / ParamNorm`` per layer, median over the last ``window`` steps with both.

    Parameters whose first stored norm is 0 (zero-initialized position
    embeddings, LoRA factors) are skipped: relative to nothing, any update
    is large.
    """

    reads = ("UpdateSize", "ParamNorm")

    def __init__(self, threshold: float, window: int = 5, include_biases: bool = False):
        self.threshold = _check_positive("threshold", threshold)
        self.window = _check_window(window)
        self.include_biases = bool(include_biases)

    def _ratios(self, history: RunHistory) -> tuple[list[int], np.ndarray] | None:
        """``(steps, ratios [steps x parameters])`` for up to ``window`` recent steps (oldest first);
        shared through ``history.memo`` by the rules that read them at the same data."""
        key = ("ratios", self.window, history.count("UpdateSize"), history.count("ParamNorm"),
               history.version("UpdateSize"), history.version("ParamNorm"))
        memo = history.memo.setdefault("update-ratios", {})
        if memo.get("key") != key:
            memo.update(key=key, value=self._compute_ratios(history))
        return memo["value"]

    def _compute_ratios(self, history: RunHistory) -> tuple[list[int], np.ndarray] | None:
        update_steps, updates = history.series("UpdateSize", block_values)
        norm_steps, norms = history.series("ParamNorm", block_values)
        recent_norms = dict(zip(norm_steps[-8 * self.window :], norms[-8 * self.window :]))
        steps, pairs = [], []
        for index in range(len(update_steps) - 1, max(len(update_steps) - 4 * self.window, 0) - 1, -1):
            step, update = update_steps[index], updates[index]
            norm = recent_norms.get(step)
            if update is not None and norm is not None and len(update) == len(norm):
                steps.append(step)
                pairs.append((update, norm))
                if len(pairs) == self.window:
                    break
        if not pairs or len({len(update) for update, _ in pairs}) != 1:
            return None
        update, norm = np.vstack([u for u, _ in pairs[::-1]]), np.vstack([n for _, n in pairs[::-1]])
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = np.where(norm > 0, update / norm, np.nan)
        # a layer with a zero norm in the window gets NaN and is skipped
        return steps[::-1], ratios

    def _layers(self, history: RunHistory, count: int) -> list[int]:
        first = history.first("ParamNorm", 1)
        initial = block_values(first[0][1]) if first else None
        return [i for i in range(count) if (self.include_biases or (history.param_ndim(i) or 2) >= 2)
                and not (initial is not None and i < len(initial) and initial[i] == 0)]

    def _wrong(self, ratio: float) -> bool:
        raise NotImplementedError

    def _finding(self, history: RunHistory, index: int, steps: list[int], ratio: float, what: str,
                 since: int) -> Finding:
        layer = history.param_name(index)
        return self.finding(
            steps[-1],
            f"the updates of {layer} are {_g(ratio)} of its norm ({what}; {self.bound} {_g(self.threshold)})",
            fix=self.fix,
            layer=layer,
            evidence={"ratio": ratio, "threshold": self.threshold, "steps": steps, "since": since},
        )

    def check(self, history: RunHistory) -> list[Finding]:
        found = self._ratios(history)
        if found is None or len(found[0]) < self.window:
            return []
        steps, ratios = found
        median = _column_median(ratios)
        findings = []
        for index in self._layers(history, ratios.shape[1]):
            ratio = float(median[index])
            if math.isfinite(ratio) and self._wrong(ratio):
                findings.append(self._finding(history, index, steps, ratio,
                                              f"median over steps {steps[0]}..{steps[-1]}", steps[0]))
        return findings


class UpdateRatioTooSmall(_UpdateRatio):
    """Updates below ``threshold`` x the parameter norm (exactly zero updates: ``unchanged-parameters``),
    unless the recipe explains them.

    Small updates are not a finding when the learning rate was *scheduled*
    small: below ``scheduled`` x the largest rate so far (a cosine tail, a
    step decay), or rising over the window (warm-up, the first half of a
    one-cycle schedule); nor when the loss fell below ``learning`` x its
    start (the run learned; its gradient shrank because it converged).
    """

    id = "update-ratio-too-small"
    severity = "warning"
    bound = "expected at least"
    fix = "raise the learning rate (for this layer's parameter group); check weight decay and gradient scaling"

    def __init__(self, threshold: float = 1e-4, window: int = 5, include_biases: bool = False,
                 scheduled: float = 0.5, learning: float = 0.8):
        super().__init__(threshold, window, include_biases)
        self.scheduled = _check_positive("scheduled", scheduled)
        self.learning = _check_positive("learning", learning)

    def _wrong(self, ratio: float) -> bool:
        return 0.0 < ratio < self.threshold

    def _plain(self, history: RunHistory, step: int) -> bool:
        """Whether the update at ``step`` was a plain (not adaptive) step, at most ``lr x gradient``: the
        median over weights of ``UpdateSize / (lr x GradNorm)`` at most ``plain``. An adaptive optimizer
        (Adam, Adagrad: about ``lr`` per coordinate, far more than ``lr x`` a gradient whose coordinates are
        well below 1) makes such steps only while it is not yet adaptive: RAdam's un-rectified first steps
        (``lr x`` the bias-corrected momentum; round 7). Until round 9 the ratio had to lie within ``plain``
        of 1; RAdam's momentum averages gradients of different sizes (outside trial 8: a FiLM MLP with
        RAdam, whose second to fifth steps were 0.3-0.6x ``lr x`` the gradient, was named a learning rate
        too small, healthy and at batch 1)."""
        update, grad, rate = (history.get(name, step) for name in ("UpdateSize", "GradNorm", "LearningRate"))
        update, grad, rate = _blocks(update), _blocks(grad), to_float(rate)
        if update is None or grad is None or len(update) != len(grad) or not (math.isfinite(rate) and rate > 0):
            return False
        ratios = [update[i] / (rate * grad[i]) for i in range(len(grad))
                  if (history.param_ndim(i) or 2) >= 2 and grad[i] > 0 and math.isfinite(update[i])]
        return bool(ratios) and _median(ratios) <= self.plain

    plain: float = 1.5

    def check(self, history: RunHistory) -> list[Finding]:
        found = self._ratios(history)
        if found is None or len(found[0]) < self.window:
            return []
        steps = found[0]
        share = recipe.scheduled_share(history, steps[-1])
        if (math.isfinite(share) and share < self.scheduled) or recipe.warming_up(history, steps[0], steps[-1]):
            return []  # the schedule made the rate small
        if recipe.loss_share(history) < self.learning:
            return []  # the run learned: small updates of a converging run are not a finding
        if recipe.adaptive(history) and any(self._plain(history, step) for step in steps):
            return []  # the adaptive optimizer's own warm-up (RAdam's first steps), not a small rate
        findings = super().check(history)
        for finding in findings:
            finding.evidence.update(scheduled_share=share, strength=_strength(
                math.log10(self.threshold / max(finding.evidence["ratio"], 1e-300)), 0.5, 1.5))
        return findings


class UpdateRatioTooLarge(_UpdateRatio):
    """Updates above ``threshold`` x the parameter norm (median over ``window`` steps) while the loss
    has not fallen below ``learning`` x its start, or a single update above ``spike`` x the norm (a
    blow-up: reported at once, without waiting for a window).

    An adaptive optimizer (Adam, RMSprop, Adagrad: ``Momentum`` NaN) takes
    large first steps by design (RMSprop's first step is 10x its learning
    rate per coordinate): its first ``adaptive_steps`` tracked steps are
    not looked at.

    The defaults (0.5, a spike of 1.0) were set on the generated corpus's
    tuning families, where healthy tiny models reached window medians of
    0.2-0.4 in their first steps (Adagrad, SGD at a step-decay peak) and
    learning rates 30-300x too large 0.34-100; round 4 (issue 36) raised
    the window median's threshold from 0.3 to 0.5: a transformer's learned
    position table (initialized at 0.02 x N(0, 1)) reached 0.30-0.41 in
    healthy runs, and on the tuning families no run with a fault lost its
    cause named first.
    """

    id = "update-ratio-too-large"
    severity = "warning"
    bound = "expected at most"
    fix = "lower the learning rate (for this layer's parameter group) or add warm-up"

    def __init__(self, threshold: float = 0.5, window: int = 5, include_biases: bool = False,
                 spike: float | None = 1.0, adaptive_steps: int = 10, learning: float = 0.8):
        super().__init__(threshold, window, include_biases)
        self.spike = None if spike is None else _check_positive("spike", spike)
        self.adaptive_steps = int(_check_nonnegative("adaptive_steps", adaptive_steps))
        self.learning = _check_positive("learning", learning)

    def _wrong(self, ratio: float) -> bool:
        return ratio > self.threshold

    def _falling(self, history: RunHistory, steps: list[int]) -> bool:
        """Whether the loss fell over the window by more than ``falling`` x its first value (large
        updates that make progress are the recipe's, e.g. Adagrad's early steps)."""
        loss_steps, losses = history.tail("Loss", 4 * self.window)
        inside = losses[loss_steps >= steps[0]]
        if len(inside) < 4:
            return False
        first, half = float(history.head("Loss", 1)[1][0]), len(inside) // 2
        return bool(_median(inside[:half]) - _median(inside[-half:]) > self.falling * first)

    falling: float = 0.02

    confirm: int = 2

    def _spike_verdict(self, history: RunHistory, step: int) -> str:
        """``"blow-up"``, ``"progress"`` or ``"wait"`` for a single large update at ``step``. The losses after
        it (which it made) are read against the lower of the loss at ``step`` and the run's first loss: one at
        or above it, or not finite, is a blow-up (reported at once); ``confirm`` below it are progress (no
        finding); fewer, all below it, are waited for. Without a tracked loss every spike is a blow-up.

        Round 9: outside trial 8's healthy logistic regression took a first SGD step of 1.03x its small
        initial weights and its loss fell 0.76 -> 0.48 -> 0.45 (0.26 after 10 steps); it was named a
        learning rate too large at step 0. The run's first loss is in the reference because a network that
        dies from a spike falls back to chance, below a loss the spike had raised (the fixed corpus's CNN at
        lr 5: 2.31, then 2.47 at the spike, then 2.34 and 2.35)."""
        if not history.has("Loss"):
            return "blow-up"  # nothing to judge it by: reported at once
        loss_steps, losses = history.scalars("Loss")
        at = int(np.searchsorted(loss_steps, step))
        here = float(losses[at]) if at < len(loss_steps) and loss_steps[at] == step else math.nan
        first = history.head("Loss", 1)[1]
        reference = min(here, float(first[0])) if len(first) else here
        if not math.isfinite(reference):
            return "blow-up"
        after = losses[np.searchsorted(loss_steps, step, side="right") :][: self.confirm]
        if not (np.isfinite(after).all() and (after < reference).all()):
            return "blow-up"
        return "progress" if len(after) >= self.confirm else "wait"

    def check(self, history: RunHistory) -> list[Finding]:
        found = self._ratios(history)
        if found is None:
            return []
        steps, ratios = found
        if recipe.adaptive(history):
            start = history.first("UpdateSize", 1)[0][0] + self.adaptive_steps
            keep = [i for i, step in enumerate(steps) if step >= start]
            steps, ratios = [steps[i] for i in keep], ratios[keep]
            if not steps:
                return []
        findings = []
        if len(steps) >= self.window and not recipe.loss_share(history) < self.learning and not self._falling(
                history, steps):
            median = _column_median(ratios)
            for index in self._layers(history, ratios.shape[1]):
                ratio = float(median[index])
                if math.isfinite(ratio) and self._wrong(ratio):
                    # the evidence starts at the window's first update above the threshold (round 9: a spike
                    # that waits for the losses after it left the window's median to report a rate raised
                    # at step 28 as large since step 26, the window's start)
                    column = ratios[:, index]
                    since = next((steps[i] for i in range(len(steps)) if column[i] > self.threshold), steps[0])
                    finding = self._finding(history, index, steps, ratio,
                                            f"median over steps {steps[0]}..{steps[-1]}", since)
                    finding.evidence["strength"] = _strength(math.log10(ratio / self.threshold), 0.3, 1.0)
                    findings.append(finding)
        if self.spike is None:
            return findings
        seen = {f.layer for f in findings}
        for index in self._layers(history, ratios.shape[1]):
            column = ratios[:, index]
            if history.param_name(index) in seen or not (column > self.spike).any():  # NaN compares False
                continue
            # the earliest spike the losses after it confirm (a later, larger one does not hide it)
            at = None
            for candidate in np.flatnonzero(column > self.spike):
                verdict = self._spike_verdict(history, steps[int(candidate)])
                if verdict == "blow-up":
                    at = int(candidate)
                if verdict != "progress":
                    break
            if at is None:
                continue
            finding = self._finding(history, index, steps, float(column[at]), f"at step {steps[at]}", steps[at])
            finding.message += f"; a single update above {_g(self.spike)} x the norm is a blow-up"
            finding.evidence.update(spike=self.spike, strength=_strength(math.log10(column[at] / self.spike), 0.3, 1.0))
            findings.append(finding)
        return findings


class UnchangedParameters(Rule):
    """A layer whose update (``UpdateSize``, else ``Distance``) is at most ``tolerance`` for ``window`` steps.

    Evidence ``has_gradient``: whether ``GradNorm`` (if stored) was above 0 at
    those steps; a parameter that gets a gradient and does not move is not
    being trained (a frozen layer), one without a gradient is cut off (dead
    units upstream, a detached branch). A parameter with ``requires_grad=False``
    (the step's ``checks["frozen"]``) since a step after the first is reported
    as frozen (evidence ``frozen``, ``since`` the step it was frozen); one frozen
    from the first step on is frozen on purpose (fine-tuning) and left alone,
    as it is by ``vanishing-gradient`` and ``poor-initialization``.
    """

    id = "unchanged-parameters"
    severity = "warning"
    strength = "strong"  # exactly zero for several steps

    def __init__(self, window: int = 3, tolerance: float = 0.0):
        self.window = _check_window(window)
        self.tolerance = float(tolerance)

    def missing(self, history: RunHistory) -> list[str]:
        return [] if history.has("UpdateSize") or history.has("Distance") else ["UpdateSize or Distance"]

    def check(self, history: RunHistory) -> list[Finding]:
        name = "UpdateSize" if history.has("UpdateSize") else "Distance"
        all_steps, all_rows = history.series(name, block_values)  # converted once per value
        if len(all_steps) < self.window or (name == "Distance" and history.count(name) <= self.window):
            return []
        rows = all_rows[-self.window :]
        if any(row is None for row in rows) or len({len(row) for row in rows}) != 1:
            return []
        still = (np.vstack(rows) <= self.tolerance).all(axis=0)
        if not still.any():
            return []
        steps = list(all_steps[-self.window :])
        what = "update" if name == "UpdateSize" else "distance to the start"
        gradients = [block_values(history.get("GradNorm", step)) for step in steps]
        found = []
        silent = _structurally_zero(history) if history.has("GradNorm") else set()
        for i in np.flatnonzero(still):
            if i in silent:
                continue  # a bias before a normalization: no gradient, no update, by design
            frozen = _frozen_since(history, name, all_steps).get(history.param_name(i))
            if frozen == -1:
                continue  # requires_grad=False from the first step: frozen on purpose (fine-tuning)
            if frozen is not None:
                found.append(self.finding(
                    steps[-1],
                    f"{history.param_name(i)} does not change: it has requires_grad=False since step {frozen} "
                    "(it was trained before), so it gets no gradient and no update",
                    fix="if this layer should still train, set requires_grad=True again (and check that the "
                    "code that freezes it runs when you meant it to)",
                    layer=history.param_name(i),
                    evidence={"quantity": name, "steps": steps, "has_gradient": False, "frozen": True,
                              "since": frozen},
                ))
                continue
            known = [g[i] for g in gradients if g is not None and i < len(g) and math.isfinite(g[i])]
            has_gradient = bool(known) and all(g > 0 for g in known)
            found.append(self.finding(
                steps[-1],
                f"{history.param_name(i)} does not change: its {what} is 0 at steps {steps[0]}..{steps[-1]}"
                + (", although it gets a gradient" if has_gradient else
                   (", and its gradient is 0" if known else "")),
                fix="check that the optimizer was given this parameter (model.parameters()), that its "
                "learning rate is not 0 and that it gets a gradient (requires_grad, used in forward)",
                layer=history.param_name(i),
                # a parameter that gets a gradient and has not moved since the first tracked step is a layer
                # left out of training from the start: evidence of its own (round 7), not a symptom
                evidence={"quantity": name, "steps": steps, "has_gradient": has_gradient, "since": steps[0],
                          "at_start": bool(has_gradient and steps[0] == all_steps[0])},
            ))
        return found


# ---- step size and curvature -------------------------------------------------------------------
class StepOvershoots(_Persistent):
    """Alpha above ``threshold`` (default 1) in a ``share`` of the last ``window`` tracked steps, median too."""

    id = "step-overshoots"
    severity = "warning"
    reads = ("Alpha",)
    quantity = "Alpha"

    def __init__(self, threshold: float = 1.0, window: int = 10, share: float = 0.8):
        super().__init__(threshold, window, share)

    def _beyond(self, values: np.ndarray) -> np.ndarray:
        return values > self.threshold

    fix = "lower the learning rate (alpha near 0 steps to the minimum along the update direction)"

    def _message(self, median: float, span: str) -> str:
        return (f"the steps overshoot: the normalized step size alpha is {_g(median)} (median of steps {span}; "
                f"above {_g(self.threshold)} means past the mirrored point of the local parabola)")


class StepTooShort(_Persistent):
    """Alpha below ``threshold`` (default -0.7: near -1) in a ``share`` of the last ``window`` steps.

    Severity ``info``: on the corpus's tuning half it fired on 7 of 18
    healthy runs (the early plateau of SGD with momentum and of Adam, where
    alpha sits near -1) and on one of the four runs whose learning rate was
    too small; ``update-ratio-too-small`` is the stronger signal."""

    id = "step-too-short"
    severity = "info"
    reads = ("Alpha",)
    quantity = "Alpha"

    def __init__(self, threshold: float = -0.7, window: int = 10, share: float = 0.8):
        super().__init__(threshold, window, share)

    def _beyond(self, values: np.ndarray) -> np.ndarray:
        return values < self.threshold

    fix = "raise the learning rate (try 2-10x)"

    def _message(self, median: float, span: str) -> str:
        return (f"the steps are too short: alpha is {_g(median)} (median of steps {span}); near -1 the step "
                "stops far before the minimum of the fitted parabola")


class SharpnessAboveStability(Rule):
    """``learning_rate x HessMaxEV > margin x limit`` at the last ``window`` values (``limit`` 2: gradient
    descent's stability bound on a quadratic).

    The learning rate is the latest ``cockpit.log(step, learning_rate=...)``
    at or before each step (else the tracked ``LearningRate``). With
    heavy-ball momentum ``beta`` the bound is ``limit (1 + beta)``: read from
    the tracked ``Momentum`` when stored (the cockpit feeds it when
    diagnosing); an adaptive optimizer (``Momentum`` NaN) never fires.

    ``margin`` (default 1.5): healthy SGD runs sharpen until the product
    reaches the bound and then hover there (the "edge of stability"); the
    corpus's healthy ResNet with SGD at lr 0.05 held 2.03 for three tracked
    steps, its runs with a learning rate 10x too large 4.2-6.6. The rule
    reports a product clearly above the bound, not one at it.
    """

    id = "sharpness-above-stability"
    severity = "warning"
    reads = ("HessMaxEV", "learning_rate")

    def __init__(self, limit: float = 2.0, window: int = 3, margin: float = 1.5):
        self.limit = _check_positive("limit", limit)
        self.window = _check_window(window)
        self.margin = _check_positive("margin", margin)

    def missing(self, history: RunHistory) -> list[str]:
        found = [] if history.has("HessMaxEV") else ["HessMaxEV"]
        if not (history.has("learning_rate") or history.has("LearningRate")):
            found.append("learning_rate (cockpit.log) or LearningRate")
        return found

    @staticmethod
    def _rate(history: RunHistory, step: int) -> float:
        """The logged ``learning_rate`` at or before ``step``, else the tracked ``LearningRate``
        (the largest of its parameter groups)."""
        name = "learning_rate" if history.has("learning_rate") else "LearningRate"
        value = history.at_or_before(name, step)[1]
        if isinstance(value, (list, tuple)):
            rates = [to_float(v) for v in value]
            return max(rates) if rates else math.nan
        return to_float(value)

    def check(self, history: RunHistory) -> list[Finding]:
        recent = history.last("HessMaxEV", self.window)
        if len(recent) < self.window:
            return []
        products, rates, limits = [], [], []
        for step, value in recent:
            rate = self._rate(history, step)
            rates.append(rate)
            products.append(rate * to_float(value))
            beta = to_float(history.at_or_before("Momentum", step)[1]) if history.has("Momentum") else 0.0
            limits.append(self.limit * (1.0 + beta))  # NaN for an adaptive optimizer: never exceeded
        if not all(math.isfinite(p) and p > self.margin * limit for p, limit in zip(products, limits)):
            return []
        steps = [step for step, _ in recent]
        sharp = to_float(recent[-1][1])
        return [
            self.finding(
                steps[-1],
                f"the top Hessian eigenvalue {_g(sharp)} times the learning rate {_g(rates[-1])} is "
                f"{_g(products[-1])} at steps {steps[0]}..{steps[-1]}, above {_g(self.margin)} x the stability "
                f"bound {_g(limits[-1])}: along that direction a gradient step is unstable",
                fix=f"lower the learning rate below {_g(limits[-1] / sharp)} (= {_g(limits[-1])} / top eigenvalue) "
                "or add warm-up",
                evidence={"products": products, "learning_rates": rates, "limits": limits, "margin": self.margin,
                          "steps": steps},
            )
        ]


class NoiseDominated(_Persistent):
    """NormTest above ``threshold`` (default 1) in a ``share`` of the last ``window`` steps, median too.

    Severity ``info``: the statistic is about ``sqrt(x / (1 + x))`` with
    ``x = tr(Sigma) / (B ||grad L||^2)`` (its denominator holds the noisy
    mini-batch gradient), so it hovers near 1 whenever noise dominates, as it
    does late in many healthy SGD runs; a larger batch is then a suggestion,
    not a fault.
    """

    id = "noise-dominated"
    severity = "info"
    reads = ("NormTest",)
    quantity = "NormTest"

    def __init__(self, threshold: float = 1.0, window: int = 20, share: float = 0.5):
        super().__init__(threshold, window, share)

    def _beyond(self, values: np.ndarray) -> np.ndarray:
        return values > self.threshold

    def check(self, history: RunHistory) -> list[Finding]:
        recent = self._recent(history)
        if recent is None:
            return []
        steps, values = recent
        median = _median(values)
        factor = (median / self.threshold) ** 2
        fix = f"use a batch about {_g(factor)}x larger (the norm test passes at B x test^2)"
        evidence: dict[str, Any] = {"median": median, "batch_factor": factor,
                                    "steps": [int(steps[0]), int(steps[-1])]}
        cabs = history.last("CABS")
        if cabs and math.isfinite(to_float(cabs[0][1])):
            fix += f" (for comparison, CABS estimates a batch size of {to_float(cabs[0][1]):.0f} at step {cabs[0][0]})"
            evidence["cabs"] = to_float(cabs[0][1])
        fix += ", or lower the learning rate"
        return [
            self.finding(
                int(steps[-1]),
                f"gradient noise dominates: the norm test is {_g(median)} (median of steps {int(steps[0])}.."
                f"{int(steps[-1])}); above 1 the variance of the mini-batch gradient exceeds its squared norm",
                fix=fix,
                evidence=evidence,
            )
        ]


# ---- activations ------------------------------------------------------------------------------------
class _ActivationShare(Rule):
    """A per-layer field of ``ActivationStats`` above ``threshold`` (median over ``window`` steps)."""

    reads = ("ActivationStats",)
    field: str = ""

    def __init__(self, threshold: float = 0.5, window: int = 3, min_samples: int = 1):
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must lie in (0, 1), got {threshold!r}")
        self.threshold = float(threshold)
        self.window = _check_window(window)
        self.min_samples = _check_window(min_samples, "min_samples")

    def _shares(self, history: RunHistory) -> tuple[list[int], dict[str, tuple[str, float]]]:
        recent = history.last("ActivationStats", self.window)
        steps = [step for step, _ in recent]
        if len(recent) < self.window:
            return steps, {}
        collected: dict[str, list[float]] = {}
        kinds: dict[str, str] = {}
        for _, value in recent:
            for layer, stats in (value or {}).items():
                if isinstance(stats, Mapping) and self.field in stats and (
                        to_float(stats.get("samples", math.inf)) >= self.min_samples):
                    collected.setdefault(layer, []).append(to_float(stats[self.field]))
                    kinds[layer] = str(stats.get("kind", "?"))
        return steps, {
            layer: (kinds[layer], _median(shares))
            for layer, shares in collected.items()
            if len(shares) == self.window and np.isfinite(shares).all()
        }

    fix: str = ""

    def _message(self, layer: str, kind: str, share: float, span: str) -> str:
        raise NotImplementedError

    def check(self, history: RunHistory) -> list[Finding]:
        steps, shares = self._shares(history)
        found = []
        for layer, (kind, share) in shares.items():
            if not share > self.threshold:
                continue
            evidence = {self.field: share, "kind": kind, "steps": steps, "since": steps[0],
                        "at_start": steps[0] == history.first("ActivationStats", 1)[0][0],
                        "developed": self._developed(history, layer)}
            found.append(self.finding(steps[-1], self._message(layer, kind, share, f"{steps[0]}..{steps[-1]}"),
                                      fix=self.fix, layer=layer, evidence=evidence))
        return found

    def _developed(self, history: RunHistory, layer: str) -> bool:
        """Whether the layer's share was at most the threshold at the first tracked step (the units were
        alive at the start, by the rule's own measure, and went off later)."""
        first = history.first("ActivationStats", 1)
        stats = first[0][1].get(layer) if first and isinstance(first[0][1], Mapping) else None
        if not isinstance(stats, Mapping) or self.field not in stats:
            return False
        return bool(to_float(stats[self.field]) <= self.threshold)


class DeadUnits(_ActivationShare):
    """ReLU/GELU layers where a share of units above ``threshold`` is off for every sample.

    Steps with fewer than ``min_samples`` rows (default 8) are not counted:
    with one sample, half of the units of a healthy ReLU layer are off for
    "every sample". Units that were alive at the first tracked step and died
    later are reported only after ``settle`` tracked steps and while the loss
    has not fallen below ``learning`` x its start: a CNN with Adagrad or
    RMSprop loses half its units in its first (large) steps and still trains
    well (seen on the generated corpus's tuning families). Round 4 (issue
    36) raised ``settle`` from 10 to 30: healthy Adagrad CNNs and MLPs whose
    units died in the first 10 steps were still above 0.7 x their first
    loss at step 10-20, and trained well. Round 6: units dead from the first
    step are reported at once only where at least ``blocked`` of the layer
    is dead (the layer passes next to no gradient); a smaller share (a
    healthy autoencoder's ReLU after its 8-unit code: 56-59% at
    initialization) is held to the same test as units that died later, and
    then reported from the first step (``since``, ``at_start``, ``held``).
    """

    id = "dead-units"
    severity = "warning"
    strength = "strong"
    field = "dead_fraction"

    def __init__(self, threshold: float = 0.5, window: int = 3, min_samples: int = 8, learning: float = 0.7,
                 settle: int = 30, blocked: float = 0.9):
        super().__init__(threshold, window, min_samples)
        self.learning = _check_positive("learning", learning)
        self.settle = _check_window(settle, "settle")
        if not threshold <= blocked <= 1.0:
            raise ValueError(f"blocked must lie in [threshold ({threshold}), 1], got {blocked!r}")
        self.blocked = float(blocked)

    def check(self, history: RunHistory) -> list[Finding]:
        found = super().check(history)
        if not found:
            return found
        first = history.first("ActivationStats", 1)[0][0]
        kept = []
        for finding in found:
            # dead from the first step, but not (nearly) all of the layer: the rest still passes a gradient
            partial = not finding.evidence.get("developed") and finding.evidence[self.field] < self.blocked
            if (finding.evidence.get("developed") or partial) and (
                    finding.step - first < self.settle
                    or recipe.loss_share(history, before_updates=True) < self.learning
                    or self._still_falling(history)):
                continue  # wait, and let a run that learns (well, or still) keep its share of dead units
            if partial:  # dead since the first step (above the threshold there), found once the loss has not fallen
                finding.evidence.update(since=int(first), at_start=True, held=True)
            kept.append(finding)
        return kept
    fix = "lower the learning rate, initialize biases at 0 (not negative), use Kaiming initialization, or LeakyReLU/GELU"

    falling: float = 0.01

    def _still_falling(self, history: RunHistory) -> bool:
        """Whether the loss still falls (round 7): over the last ``settle`` losses, the median of the last 5
        lies below that of the first 5 by more than ``falling`` x the start (the smaller of the first loss and
        the median of the first 5), and no loss so far was above ``blow_up`` x the start."""
        _, recent = history.tail("Loss", self.settle)
        _, start = history.head("Loss", 5)
        if len(recent) < self.settle or len(start) < 5:
            return False
        begin = min(_median(start), float(start[0]))
        _, every = history.head("Loss", history.count("Loss"))
        # ... in a run whose loss never blew up (above ``blow_up`` x its start): a loss falling back after a
        # blow-up is recovering from large updates, and the units they killed are their symptom
        return bool(begin > 0 and max(every) <= self.blow_up * begin
                    and _median(recent[:5]) - _median(recent[-5:]) > self.falling * begin)

    blow_up: float = 2.0

    def _message(self, layer: str, kind: str, share: float, span: str) -> str:
        return (f"{_g(100 * share)}% of the units of {layer} ({kind}) are dead: zero for every sample (median of "
                f"steps {span}); they pass no gradient")


class SaturatedUnits(_ActivationShare):
    """tanh/sigmoid layers whose share of saturated outputs is above ``threshold``."""

    id = "saturated-units"
    severity = "warning"
    field = "saturated_fraction"
    fix = ("scale the initialization down (Xavier/Glorot for tanh and sigmoid), normalize the inputs, add "
           "LayerNorm/BatchNorm before the activation, or use ReLU-like activations")

    def _message(self, layer: str, kind: str, share: float, span: str) -> str:
        return (f"{_g(100 * share)}% of the outputs of {layer} ({kind}) are saturated, where the derivative is "
                f"nearly 0 (median of steps {span})")


class LargeInputScale(Rule):
    """At the first tracked step, the model's raw inputs, or else the first activation layer's outputs,
    are far larger than unit scale.

    With ``DataStats`` tracked and floating-point inputs, reads the raw
    input's ``input_rms`` at the first tracked step: a normalization layer
    after the first layer (GroupNorm, BatchNorm, LayerNorm) hides the scale
    from every activation, not from the input itself. Without it, or for
    integer inputs (token ids), reads the ``rms`` of the first layer of
    ``ActivationStats`` (in the order the model calls them). Above ``limit``
    (default 10), the inputs are most likely not normalized (pixels in
    0..255, raw features). Bounded activations (tanh, sigmoid) are skipped;
    their saturation is ``saturated-units``' business. So is a layer called
    more than once per sample (more rows than ``BatchSize``: the activation
    of a recurrence, whose large outputs are the recurrence exploding, not
    the inputs). On the generated corpus's tuning families (issue 36, round
    4) healthy inputs had an rms of at most 1.9, inputs 30-255x their scale
    at least 14.
    """

    id = "large-input-scale"
    severity = "warning"
    reads = ("ActivationStats",)

    def __init__(self, limit: float = 10.0):
        self.limit = _check_positive("limit", limit)

    def missing(self, history: RunHistory) -> list[str]:
        return [] if history.has("ActivationStats") or history.has("DataStats") else ["ActivationStats or DataStats"]

    def check(self, history: RunHistory) -> list[Finding]:
        raw = history.first("DataStats", 1) if history.has("DataStats") else []
        if raw and isinstance(raw[0][1], Mapping) and not raw[0][1].get("input_integer", True):
            step, value = raw[0]
            rms = to_float(value.get("input_rms"))
            if math.isfinite(rms):
                if not rms > self.limit:
                    return []
                return [self.finding(
                    step,
                    f"the model's inputs have a scale of {_g(rms)} (rms) at the first tracked step {step}, above "
                    f"{_g(self.limit)}: they look unnormalized",
                    fix="scale the inputs to about unit size (divide 0..255 pixels by 255, standardize features "
                    "with the training set's mean and standard deviation)",
                    evidence={"input_rms": rms, "limit": self.limit, "since": int(step), "at_start": True,
                              "strength": _strength(math.log10(rms / self.limit), 0.3, 0.6)},
                )]
        if not history.has("ActivationStats"):
            return []
        first = history.first("ActivationStats", 1)
        if not first or not isinstance(first[0][1], Mapping) or not first[0][1]:
            return []
        step, value = first[0]
        layer, stats = next(iter(value.items()))
        if not isinstance(stats, Mapping) or stats.get("kind") in ("tanh", "sigmoid"):
            return []
        batch = to_float(history.get("BatchSize", step)) if history.has("BatchSize") else math.nan
        if to_float(stats.get("samples", 0)) > batch:
            return []  # called more than once per sample: a recurrence, whose scale is its own
        rms = to_float(stats.get("rms"))
        if not rms > self.limit:
            return []
        return [
            self.finding(
                step,
                f"the first activation layer {layer} ({stats.get('kind', '?')}) has outputs of scale {_g(rms)} "
                f"(rms) at the first tracked step {step}, above {_g(self.limit)}: the inputs look unnormalized",
                fix="scale the inputs to about unit size (divide 0..255 pixels by 255, standardize features "
                "with the training set's mean and standard deviation)",
                layer=layer,
                evidence={"rms": rms, "limit": self.limit, "since": int(step)},
            )
        ]


class ConstantInputs(Rule):
    """The rows of the batch became all the same: ``DataStats``' ``input_spread`` (the spread of the
    model's input over the batch, relative to its scale) at most ``limit`` for the last ``window``
    tracked steps of batches of at least 2 rows, after it was above ``limit`` (a data pipeline that
    repeats one sample, or zeroes or fills the inputs, from some step on). The model can then only
    learn the mean label of the batch: the loss and the gradient change, and neither the learning
    rate nor the model is the cause.

    On the generated corpus's tuning families (issue 36, round 4) healthy runs had a spread of at
    least 0.49, batches of one repeated input exactly 0.
    """

    id = "constant-inputs"
    severity = "warning"
    strength = "strong"
    reads = ("DataStats",)

    def __init__(self, limit: float = 1e-3, window: int = 2):
        self.limit = _check_positive("limit", limit)
        self.window = _check_window(window)

    def _spread(self, value: Any) -> float:
        if not isinstance(value, Mapping) or to_float(value.get("samples", 0)) < 2:
            return math.nan
        return to_float(value.get("input_spread"))

    def check(self, history: RunHistory) -> list[Finding]:
        recent = history.last("DataStats", self.window)
        if len(recent) < self.window:
            return []
        spreads = [self._spread(value) for _, value in recent]
        if not all(math.isfinite(v) and v <= self.limit for v in spreads):
            return []
        # kept up to date incrementally: the last step with a spread above limit, and the first step
        # of the constant stretch after it
        memo = history.memo.setdefault(f"{self.id}/{id(self)}", {"count": 0, "before": False, "since": None})
        count = history.count("DataStats")
        if count < memo["count"]:  # a new history: start over
            memo.update(count=0, before=False, since=None)
        for step, value in history.last("DataStats", count - memo["count"]) if count > memo["count"] else []:
            spread = self._spread(value)
            if math.isfinite(spread) and spread > self.limit:
                memo.update(before=True, since=None)
            elif math.isfinite(spread) and memo["since"] is None:
                memo["since"] = step
        memo["count"] = count
        if not memo["before"] or memo["since"] is None:
            return []
        since = int(memo["since"])
        step = int(recent[-1][0])
        return [self.finding(
            step,
            f"every row of the batch is the same input since step {since} (the spread of the model's inputs over "
            f"the batch is {_g(spreads[-1])} of their scale, above {_g(self.limit)} before): the data changed",
            fix="check the data pipeline at that step: a loader that repeats one sample, inputs zeroed or "
            "filled with one value, a broadcast over the batch",
            evidence={"input_spread": spreads[-1], "limit": self.limit, "since": since, "data_changed": True},
        )]


class PoorInitialization(Rule):
    """At the first ``first`` tracked steps: activation scales (``ActivationStats`` rms) that shrink
    below ``shrink`` or grow above ``grow`` x the first activation layer's, or weight gradients
    (``GradNorm``) spread over more than ``spread`` between layers (frozen weights, ``requires_grad=False``
    at one of those steps, left out); or (round 11) at step 0, before any update, the model's outputs
    (``DataStats``) spanning more than ``output_grow`` x the scale of its inputs (at least 1).

    The output test reads no module list: outside trial 15's Maxout net with weights of std 3 (its
    maximum is no activation module ``ActivationStats`` watches) put out values of 1e7 for inputs of
    unit scale at step 0, and was named a learning rate too large by the blow-up of its first update.
    On every healthy run of the corpus, the generated families and outside trials 9, 10 and 15 (571
    runs tracked from step 0), the outputs at step 0 spanned at most 7.6 x the inputs' scale."""

    id = "poor-initialization"
    severity = "warning"

    def __init__(self, first: int = 3, shrink: float = 1e-2, grow: float = 1e2, spread: float = 1e4,
                 dead: float = 0.5, output_grow: float = 1e3):
        self.first = _check_window(first, "first")
        self.dead = _check_positive("dead", dead)
        self.shrink = _check_positive("shrink", shrink)
        self.grow = _check_positive("grow", grow)
        self.spread = _check_positive("spread", spread)
        self.output_grow = _check_positive("output_grow", output_grow)

    def missing(self, history: RunHistory) -> list[str]:
        return [] if any(history.has(name) for name in ("ActivationStats", "GradNorm", "DataStats")) else [
            "ActivationStats, GradNorm or DataStats"]

    def check(self, history: RunHistory) -> list[Finding]:
        # only the first values count: the answer is kept until they change
        key = tuple((history.version(name), min(history.count(name), self.first))
                    for name in ("ActivationStats", "GradNorm", "DataStats")) + (
            tuple(history.metadata.get("param_names") or ()), self.first, self.shrink, self.grow, self.spread, self.dead,
            self.output_grow)
        memo = history.memo.setdefault(self.id, {})
        if memo.get("key") != key:
            memo.update(key=key, found=self._activations(history) + self._gradients(history) + self._outputs(history))
        return list(memo["found"])

    def _outputs(self, history: RunHistory) -> list[Finding]:
        """The model's outputs at step 0 (before any update) far larger than its inputs."""
        early = history.first("DataStats", 1)
        if not early or int(early[0][0]) != 0 or not isinstance(early[0][1], Mapping):
            return []  # tracked from a later step: large outputs may come from the updates, not the initialization
        value = early[0][1]
        if value.get("output_probabilities"):
            return []
        low, high = to_float(value.get("output_min", math.nan)), to_float(value.get("output_max", math.nan))
        rms = to_float(value.get("input_rms", math.nan))
        scale = 1.0 if value.get("input_integer") or not math.isfinite(rms) else max(1.0, rms)
        span = high - low
        if not (math.isfinite(span) and span > self.output_grow * scale):
            return []  # (outputs that are not finite at step 0 are the non-finite rules' to name)
        return [
            self.finding(
                0,
                f"the model's outputs at step 0, before any update, span {_g(low)}..{_g(high)} for inputs of "
                f"scale (rms) {_g(rms)}: {_g(span / scale)}x, where an initialization that keeps the signal's "
                f"scale through depth gives outputs of a few units",
                fix="initialize weights with a variance scaled to the layer width (Kaiming for ReLU, Xavier for "
                    "tanh/sigmoid), or add normalization layers",
                evidence={"output_min": low, "output_max": high, "input_rms": rms, "ratio": span / scale,
                          "steps": [0]},
            )
        ]

    def _activations(self, history: RunHistory) -> list[Finding]:
        early = history.first("ActivationStats", self.first)
        if len(early) < self.first:
            return []
        scales: dict[str, list[float]] = {}
        dead: dict[str, list[float]] = {}
        for _, value in early:
            for layer, stats in (value or {}).items():
                if isinstance(stats, Mapping):
                    scales.setdefault(layer, []).append(to_float(stats.get("rms")))
                    dead.setdefault(layer, []).append(to_float(stats.get("dead_fraction", math.nan)))
        medians = {layer: float(np.median(v)) for layer, v in scales.items() if len(v) == self.first}
        # a layer whose units are mostly dead (off for every sample) cannot be the reference: its scale is
        # that of the few live units, and every layer after it would look large (round 7)
        layers = list(medians)
        while layers and _median(dead[layers[0]]) >= self.dead:
            layers = layers[1:]
        if len(layers) < 2:
            return []
        reference = medians[layers[0]]
        if not reference > 0:
            return []
        steps = [step for step, _ in early]
        found = []
        for layer in layers[1:]:
            ratio = medians[layer] / reference
            # the first tracked step's own scales come before any update: a huge first update (a learning
            # rate far too large) changes the later steps' scales, not the initialization (round 7)
            first = scales[layer][0] / scales[layers[0]][0] if scales[layers[0]][0] > 0 else math.nan
            if not (first < self.shrink or first > self.grow):
                continue
            if ratio < self.shrink or ratio > self.grow:
                direction = "shrink" if ratio < self.shrink else "grow"
                found.append(
                    self.finding(
                        steps[-1],
                        f"activations {direction} through depth at the first steps: the output scale (rms) of "
                        f"{layer} is {_g(medians[layer])}, {_g(ratio)}x that of {layers[0]} ({_g(reference)})",
                        fix="initialize weights with a variance scaled to the layer width (Kaiming for ReLU, "
                        "Xavier for tanh/sigmoid), or add normalization layers",
                        layer=layer,
                        evidence={"rms": medians[layer], "reference": reference, "ratio": ratio, "steps": steps},
                    )
                )
        return found

    def _gradients(self, history: RunHistory) -> list[Finding]:
        early = history.first("GradNorm", self.first)
        if len(early) < self.first:
            return []
        rows = [_blocks(value) for _, value in early]
        if any(row is None for row in rows) or len({len(row) for row in rows}) != 1:
            return []
        norms = np.median(np.vstack(rows), axis=0)
        frozen = set().union(*(_frozen_at(history, step) for step, _ in early))  # no gradient on purpose
        weights = [i for i in range(len(norms)) if (history.param_ndim(i) or 2) >= 2 and math.isfinite(norms[i])
                   and history.param_name(i) not in frozen]
        if len(weights) < 2:
            return []
        largest = max(norms[i] for i in weights)
        if not largest > 0:
            return []
        # a weight whose gradient is small while one registered before it gets a gradient within the spread
        # is small for a reason of its own (attention queries and keys at initialization), not through depth
        weights = [i for i in weights if norms[i] == 0 or not _passed_through(
            history, np.where(np.isin(np.arange(len(norms)), weights), norms, 0.0), i, largest / self.spread)]
        if not weights:
            return []
        smallest = min(weights, key=lambda i: norms[i])
        if norms[smallest] * self.spread >= largest:
            return []
        layer = history.param_name(smallest)
        steps = [step for step, _ in early]
        span = f"median of steps {steps[0]}..{steps[-1]}"
        if norms[smallest] == 0:  # no ratio to give: the gradient is cut off, not small
            message = (f"the gradient of {layer} is exactly 0 at the first steps ({span}), while the largest weight "
                       f"gradient is {_g(largest)}: nothing reaches it")
            fix = CUT_OFF_FIX
        else:
            message = (f"weight gradients differ by {_g(largest / norms[smallest])}x between layers at the first "
                       f"steps ({span}); the smallest is {layer}'s ({_g(norms[smallest])})")
            fix = ("initialize weights with a variance scaled to the layer width (Kaiming for ReLU, Xavier for "
                   "tanh/sigmoid), or add normalization layers or residual connections")
        return [
            self.finding(
                steps[-1],
                message,
                fix=fix,
                layer=layer,
                evidence={"norms": [float(norms[i]) for i in weights], "steps": steps,
                          "zero": bool(norms[smallest] == 0)},
            )
        ]


# ---- generalization ---------------------------------------------------------------------------------
class Overfitting(Rule):
    """The validation loss (``cockpit.log(valid_loss=...)``) rose above its best by more than ``rise`` x its
    scale for the last ``patience`` logs while the training loss kept falling.

    The scale is the larger of the best validation loss (in absolute value) and how far the validation loss
    had fallen to it (its highest value up to the best minus the best). Until round 9 it was the best value
    alone: outside trial 8's healthy 1-D CNN (validation loss 0.60 -> 0.062 -> 0.106 -> 0.083 -> 0.018) and
    Gaussian-NLL regression (0.60 -> -0.0094 -> 0.0116, a negative best, for which a relative rise means
    nothing) were called overfitting by rises of 4% and 2% of the fall they had made; the fixed corpus's
    overfitting runs rose by 29% and 127% of theirs when the rule first fired."""

    id = "overfitting"
    severity = "warning"
    reads = ("train_loss", "valid_loss")

    def __init__(self, patience: int = 2, rise: float = 0.1):
        self.patience = _check_window(patience, "patience")
        self.rise = _check_positive("rise", rise)

    def check(self, history: RunHistory) -> list[Finding]:
        steps, valid = _finite(*history.scalars("valid_loss"))
        if len(valid) < self.patience + 1:
            return []
        best_at = int(np.argmin(valid))
        best, best_step = float(valid[best_at]), int(steps[best_at])
        latest_step, latest = int(steps[-1]), float(valid[-1])
        # the rise is measured against the loss's scale: the larger of the best value and how far the validation
        # loss had fallen to it (a loss near 0, or a negative one as a Gaussian likelihood's, has no relative scale)
        scale = max(abs(best), float(np.max(valid[: best_at + 1])) - best)
        if best_at > len(valid) - 1 - self.patience or not (valid[-self.patience :] > best + self.rise * scale).all():
            return []
        train_then = history.at_or_before("train_loss", best_step)
        train_now = history.at_or_before("train_loss", latest_step)
        if train_then is None or train_now is None:
            return []
        then, now = to_float(train_then[1]), to_float(train_now[1])
        if not now < then:
            return []
        return [
            self.finding(
                latest_step,
                f"overfitting: the validation loss rose from {_g(best)} (step {best_step}) to {_g(latest)} "
                f"(step {latest_step}) while the training loss fell from {_g(then)} to {_g(now)}",
                fix=f"stop early (keep the model of step {best_step}), add regularization (weight decay, dropout, "
                "augmentation) or more data; check the labels for noise",
                evidence={"best_valid": best, "best_step": best_step, "valid": latest, "train_then": then,
                          "train_now": now},
            )
        ]



class ExplodingRecurrence(Rule):
    """At the first tracked step, an activation module called more than once per sample (a recurrence:
    more rows than ``BatchSize``) has outputs of scale (rms) above ``limit`` (ReLU-like), or more than
    ``saturated`` of its outputs saturated (tanh, sigmoid): the recurrence amplifies its state through
    time before any update, and so does the gradient through time.

    ``saturated`` set on the generated corpus's tuning families (seeds 0-3, round 5): the tanh of 72
    recurrent runs without this fault had at most 2.2% of its outputs saturated at the first step,
    those of recurrent weights 2.5-3.8x an orthogonal matrix 21% and 42% (0.5, round 4's default,
    saw neither)."""

    id = "exploding-recurrence"
    severity = "warning"
    reads = ("ActivationStats", "BatchSize")

    def __init__(self, limit: float = 10.0, saturated: float = 0.1):
        self.limit = _check_positive("limit", limit)
        self.saturated = _check_positive("saturated", saturated)

    def check(self, history: RunHistory) -> list[Finding]:
        first = history.first("ActivationStats", 1)
        if not first or not isinstance(first[0][1], Mapping):
            return []
        step, value = first[0]
        batch = to_float(history.get("BatchSize", step))
        found = []
        for layer, stats in value.items():
            if not isinstance(stats, Mapping) or not to_float(stats.get("samples", 0)) > batch:
                continue
            if stats.get("weights_reused") is False:
                # (round 13) one activation module reused through depth, after layers each called once (a TabNet's,
                # a PixelCNN's, an ECG CNN's nn.ReLU in outside trials 20 and 22, initialized far too large): no
                # module with weights runs more often than another, so no recurrence; the initialization is
                # poor-initialization's to name. Logs without the field: read as before
                continue
            bounded = stats.get("kind") in ("tanh", "sigmoid")
            measure = to_float(stats.get("saturated_fraction")) if bounded else to_float(stats.get("rms"))
            limit = self.saturated if bounded else self.limit
            if not measure > limit:
                continue
            what = f"{_g(100 * measure)}% of its outputs saturated" if bounded else f"outputs of scale {_g(measure)} (rms)"
            found.append(self.finding(
                step,
                f"the recurrent activation {layer} ({stats.get('kind', '?')}, {int(to_float(stats.get('samples')) // batch)} "
                f"calls per sample) has {what} at the first tracked step {step}, before any update: the recurrence "
                "amplifies its state through time",
                fix="initialize the recurrent weights with a spectral radius at most 1 (orthogonal init), clip "
                "gradients, or use gated cells (LSTM/GRU)",
                layer=layer,
                evidence={"measure": measure, "limit": limit, "since": int(step), "at_start": True,
                          "strength": _strength(math.log10(measure / limit), 0.3, 1.0) if not bounded else "moderate"},
            ))
        return found


# ---- the recipe --------------------------------------------------------------------------------------
class LearningRateJump(Rule):
    """The learning rate jumped above ``factor`` x the largest rate stored before (a schedule bug: a
    scheduler stepped with the wrong unit, a multiplier applied twice, a restart far above the peak).

    Reads the tracked ``LearningRate`` (the largest of the parameter groups)
    or the logged ``learning_rate``. Warm-up and one-cycle schedules rise by
    far less than ``factor`` (default 5) per step; the finding holds while
    the rate stays above ``factor`` x the peak before the jump.
    """

    id = "learning-rate-jump"
    severity = "warning"

    def __init__(self, factor: float = 5.0):
        self.factor = _check_positive("factor", factor)

    def missing(self, history: RunHistory) -> list[str]:
        return [] if recipe.rate_name(history) else ["LearningRate or learning_rate"]

    def check(self, history: RunHistory) -> list[Finding]:
        steps, values = recipe.rates(history)
        if len(values) < 2:
            return []
        memo = history.memo.setdefault(f"{self.id}/{id(self)}", {})
        name = recipe.rate_name(history)
        if memo.get("version") != history.version(name) or memo.get("done", 0) > len(values):
            memo.update(version=history.version(name), done=1, best=values[0] if math.isfinite(values[0]) else 0.0,
                        jump=None)
        for index in range(memo["done"], len(values)):
            value = values[index]
            if memo["jump"] is None and memo["best"] > 0 and value > self.factor * memo["best"]:
                memo["jump"] = (int(steps[index]), memo["best"], float(value))
            if math.isfinite(value) and memo["jump"] is None:
                memo["best"] = max(memo["best"], value)
        memo["done"] = len(values)
        if memo["jump"] is None:
            return []
        at, before, after = memo["jump"]
        if not values[-1] > self.factor * before:
            return []
        return [
            self.finding(
                int(steps[-1]),
                f"the learning rate jumped to {_g(after)} at step {at}, {_g(after / before)}x the largest rate "
                f"before it ({_g(before)}); it is {_g(values[-1])} now",
                fix="check the learning-rate schedule (a scheduler stepped per batch instead of per epoch, a "
                "multiplier applied twice, a restart far above the peak)",
                evidence={"step": at, "before": before, "after": after, "since": at,
                          "strength": "strong" if after > 10 * self.factor * before else "moderate"},
            )
        ]


class WeightsShrinking(Rule):
    """The total norm of the weights (``ParamNorm`` of parameters with two or more dimensions) fell
    below ``shrink`` x its first stored value: weight decay far too strong pulls every weight to 0.

    Healthy runs grow their weights or keep them (on the generated corpus's
    tuning families the smallest ratio of a healthy run was 0.99); a decay
    of 3-6% per step halves them within 10-20 steps.
    """

    id = "weights-shrinking"
    severity = "warning"
    reads = ("ParamNorm",)

    def __init__(self, shrink: float = 0.7):
        if not 0.0 < shrink < 1.0:
            raise ValueError(f"shrink must lie in (0, 1), got {shrink!r}")
        self.shrink = float(shrink)

    def check(self, history: RunHistory) -> list[Finding]:
        steps, rows = history.series("ParamNorm", block_values)
        if len(rows) < 2 or rows[0] is None or rows[-1] is None or len(rows[0]) != len(rows[-1]):
            return []
        weights = [i for i in range(len(rows[0])) if (history.param_ndim(i) or 2) >= 2]
        if not weights:
            return []
        first = float(np.sqrt(np.sum(rows[0][weights] ** 2)))
        now = float(np.sqrt(np.sum(rows[-1][weights] ** 2)))
        if not (first > 0 and math.isfinite(now) and now < self.shrink * first):
            return []
        return [
            self.finding(
                int(steps[-1]),
                f"the weights shrink: their total norm is {_g(now)} at step {steps[-1]}, {_g(now / first)}x its "
                f"first value {_g(first)} (step {steps[0]})",
                fix="lower the weight decay (typical: 1e-4..5e-4 for SGD, 0.01..0.1 for AdamW); with AdamW the "
                "decay per step is lr x weight_decay",
                evidence={"first": first, "now": now, "ratio": now / first, "since": int(steps[0]),
                          "strength": _strength(math.log(self.shrink * first / now), 0.2, 0.7)},
            )
        ]



class GradientsAccumulate(Rule):
    """The total gradient norm grows steadily and smoothly: gradients are summed over steps (a
    forgotten ``optimizer.zero_grad()``).

    Over the last ``window`` tracked steps: the norm rose at a ``share`` of
    them, its median relative change per step is below ``smooth`` (each step
    adds one mini-batch gradient to a growing sum, so the sum changes by a
    shrinking fraction; a fresh mini-batch gradient changes by 10-50% per
    step), and it is above ``growth`` x the first tracked norm. Thresholds set
    on the generated corpus's tuning families (seeds 0 and 1): healthy runs
    leaving a plateau with large batches grew smoothly to 4.4x their first
    norm; runs with a forgotten ``zero_grad`` reached 7-14x within 11 steps,
    changing by 2-10% per step.

    The cockpit's self-check sees a forgotten ``zero_grad`` for certain (p.grad not zero when a tracked step's
    first backward pass began: a conclusive ``gradients-accumulate`` finding, ``evidence["source"]`` "self-check",
    at the first tracked step it affects). Where the run's metadata says that check ran
    (``stale_gradients_checked``), this statistical rule stays silent: a smooth rise of the gradient norm is
    then a healthy one (a run leaving a plateau). It runs on logs without that key and where the check cannot
    read the gradients (sharded parameters, self-checks off).
    """

    id = "gradients-accumulate"
    severity = "warning"
    reads = ("GradNorm",)  # (and UpdateSize where tracked: parameters the optimizer does not move are left out)

    def __init__(self, window: int = 10, share: float = 0.8, smooth: float = 0.1, growth: float = 6.0):
        self.window = _check_window(window)
        self.share = float(share)
        self.smooth = _check_positive("smooth", smooth)
        self.growth = _check_positive("growth", growth)

    def check(self, history: RunHistory) -> list[Finding]:
        if history.metadata.get("stale_gradients_checked"):
            return []  # the self-check decides, for certain (see the docstring)
        steps, totals = history.series("GradNorm", _total_norm)
        if len(totals) < self.window + 1:
            return []
        recent = np.asarray(totals[-self.window - 1:])
        first = totals[0]
        moving = _moving_parameters(history) if recent[-1] > self.growth * first else None
        if moving is not None:
            # gradients of parameters no optimizer step uses (a layer left out of the optimizer, whose
            # gradient zero_grad() does not clear) add up harmlessly: the sum over those that move
            recent = np.asarray([_masked_norm(value, moving) for _, value in history.last("GradNorm", self.window + 1)])
            first = _masked_norm(history.first("GradNorm", 1)[0][1], moving)
        if not (np.isfinite(recent).all() and math.isfinite(first) and first > 0 and recent[-1] > self.growth * first):
            return []
        change = np.diff(recent)
        relative = _median(np.abs(change) / recent[1:])
        rising = float((change > 0).mean())
        if not (rising >= self.share and relative < self.smooth):
            return []
        since = int(steps[-self.window - 1])
        return [
            self.finding(
                int(steps[-1]),
                f"the gradient norm grows steadily: {_g(recent[-1])} at step {steps[-1]}, {_g(recent[-1] / first)}x "
                f"the first ({_g(first)}), rising at {_g(100 * rising)}% of the last {self.window} steps by a median "
                f"{_g(100 * relative)}% per step; a sum of gradients grows so (is optimizer.zero_grad() called?)",
                fix="call optimizer.zero_grad() once per optimizer step, before loss.backward()",
                evidence={"norm": float(recent[-1]), "first": first, "rising": rising, "relative_change": relative,
                          "since": since, "strength": _strength(self.smooth / max(relative, 1e-12), 1.5, 3.0)},
            )
        ]


class SaturatedOutput(Rule):
    """The loss barely varies between batches from the start and does not fall: the outputs are
    squashed before the loss (softmax before ``CrossEntropyLoss``, sigmoid before
    ``BCEWithLogitsLoss``), so every sample's loss sits near the same value.

    Over the first ``window`` finite losses and over the last ``window``
    (once there are ``patience``): their robust noise per step (``1.4826 MAD``
    of the steps over sqrt 2) is below ``quiet`` x their median, and the
    median of the last 5 is above ``flat`` x that of the first 5 (a healthy
    CNN or GRU whose initial logits are near 0 starts as quiet, and its
    plateau breaks within 30 steps). Set on the generated corpus's tuning families: healthy runs had
    a relative noise of at least 0.003 over their first 15 losses, runs with
    softmax before cross-entropy on 10 or 16 classes 0.0006-0.0011 (on two
    classes the loss of a squashed output still varies, and this test does
    not see it).

    A second test reads the per-sample losses (``DataStats`` with
    ``info["individual_losses"]``) and the number of classes ``C`` (the
    output's last dimension): cross-entropy over probabilities ``p`` (a
    softmax already applied) lies between ``log(e + C - 1) - 1`` (``p`` one-hot
    on the label) and ``log(e + C - 1)``, a band of width 1, whatever the
    label smoothing. It fires when every per-sample loss since the first
    tracked step lies in that band (within ``tolerance``, relative), and at
    half or more of the last ``band_window`` tracked steps (after at least
    ``band_settle`` more) the lowest came within ``touch`` (relative) of the
    floor without ever passing it: samples pressed against a floor that a
    cross-entropy over logits passes through. With many classes (a floor at
    least ``narrow`` x chance, ``log C``: about 8 classes or more), it fires
    too once the losses stayed in the band for ``band_long`` tracked steps
    and the lowest came at least half way from chance (``log C``) to the
    floor: that band lies around chance, and a run that learns leaves it
    (one that stays at chance, with shuffled labels, stays in it). Set on
    the generated corpus's tuning families (issue 36, round 4): runs with
    softmax before cross-entropy never left the band, and those that learned
    came within 0-2% of its floor; healthy runs with 2 classes left it below
    the floor, those with 10 or 16 classes by step 38 at the latest (a run
    that stays at chance, with shuffled labels or a tiny learning rate,
    stays 10% or more above the floor and leaves through the ceiling).

    The first test also needs the parameters to move (the global update ratio over the last ``window``
    steps, with ``UpdateSize`` and ``ParamNorm`` tracked, at least ``moving``, as ``loss-at-chance``'s):
    a loss that neither varies nor falls while the weights barely move is a learning rate too small
    (round 9: outside trial 8's denoising autoencoder at a rate 10,000x too small, whose reconstruction
    loss over 64 pixels per sample is quiet by nature, was named a squashed output).
    """

    id = "saturated-output"
    severity = "warning"
    reads = ("Loss",)

    def __init__(self, window: int = 15, quiet: float = 0.0015, flat: float = 0.95, patience: int = 30,
                 band_window: int = 20, band_settle: int = 10, tolerance: float = 1e-3, touch: float = 0.05,
                 band_long: int = 50, narrow: float = 0.6, moving: float = 3e-4):
        self.moving = _check_nonnegative("moving", moving)
        self.window = _check_window(window)
        self.patience = _check_window(patience, "patience")
        self.quiet = _check_positive("quiet", quiet)
        self.flat = _check_positive("flat", flat)
        self.band_window = _check_window(band_window, "band_window")
        self.band_settle = _check_window(band_settle, "band_settle")
        self.tolerance = _check_positive("tolerance", tolerance)
        self.touch = _check_positive("touch", touch)
        self.band_long = _check_window(band_long, "band_long")
        self.narrow = _check_positive("narrow", narrow)

    def check(self, history: RunHistory) -> list[Finding]:
        return self._band(history) or self._quiet(history)

    def _band(self, history: RunHistory) -> list[Finding]:
        if not history.has("DataStats"):
            return []
        # kept up to date incrementally: the number of classes, whether any per-sample loss left the band
        # since the first tracked step, and per step whether the lowest came within ``touch`` of the floor
        memo = history.memo.setdefault(f"{self.id}/band/{id(self)}", {"count": 0})
        count = history.count("DataStats")
        if count < memo["count"] or "left" not in memo:
            memo.update(count=0, classes=None, left=False, touches=[], steps=[], low=math.inf, high=-math.inf)
        for step, value in history.last("DataStats", count - memo["count"]) if count > memo["count"] else []:
            if memo["left"]:
                break
            classes = value.get("outputs") if isinstance(value, Mapping) else None
            low, high = (to_float(value.get("loss_min")), to_float(value.get("loss_max"))) if isinstance(
                value, Mapping) else (math.nan, math.nan)
            if not isinstance(classes, int) or classes < 2 or memo["classes"] not in (None, classes) or not (
                    math.isfinite(low) and math.isfinite(high)):
                memo["left"] = True
                break
            floor = math.log(math.e + classes - 1) - 1.0
            if low < floor * (1 - self.tolerance) or high > (floor + 1.0) * (1 + self.tolerance):
                memo["left"] = True
                break
            memo["classes"] = classes
            memo["touches"].append(low <= floor * (1 + self.touch))
            memo["steps"].append(int(step))
            memo["low"], memo["high"] = min(memo["low"], low), max(memo["high"], high)
        memo["count"] = count
        touches = memo["touches"]
        if memo["left"] or len(touches) < self.band_settle + self.band_window:
            return []
        touched = sum(touches[-self.band_window:])
        classes = memo["classes"]
        floor = math.log(math.e + classes - 1) - 1.0
        # the model's outputs were probabilities (rows >= 0 summing to 1: a softmax inside the model) at every
        # tracked step, and the losses of a cross-entropy over them stayed in the band (round 7)
        if memo.get("flag_count") != count:
            memo["flag_count"] = count
            memo["flagged"] = all(isinstance(v, Mapping) and v.get("output_probabilities") is True
                                  for _, v in history.last("DataStats", count))
        if memo["flagged"] and len(touches) >= self.band_settle + self.band_window:
            steps = memo["steps"]
            return [self.finding(
                steps[-1],
                f"the model's outputs are probabilities (every row non-negative, summing to 1) at every tracked "
                f"step since step {steps[0]}, and every per-sample loss lies between {_g(floor)} and "
                f"{_g(floor + 1)}, the bounds of a cross-entropy over probabilities of {classes} classes: a softmax "
                "inside the model before a loss that applies its own",
                fix="pass raw logits to CrossEntropyLoss / BCEWithLogitsLoss: remove a final softmax or sigmoid",
                evidence={"classes": classes, "floor": floor, "ceiling": floor + 1.0, "lowest": memo["low"],
                          "highest": memo["high"], "touched": touched, "since": steps[0],
                          "output_probabilities": True, "strength": "strong"},
            )]
        # many classes: the floor lies near chance (log C), and a run that learns leaves the band soon
        # ... once some sample got well below chance (half way to the floor): a model that learned, and
        # not one that sits at chance (shuffled labels: every loss near log C, inside the band too)
        held = (floor >= self.narrow * math.log(classes) and len(touches) >= self.band_long
                and memo["low"] <= (floor + math.log(classes)) / 2)
        if 2 * touched < self.band_window and not held:
            return []
        steps = memo["steps"]
        return [self.finding(
            steps[-1],
            f"every per-sample loss since step {steps[0]} lies between {_g(floor)} and {_g(floor + 1)}, the bounds "
            f"of a cross-entropy over probabilities of {classes} classes"
            + (f", and the lowest came within {_g(100 * self.touch)}% of the lower bound without ever passing it"
               if 2 * touched >= self.band_window else f", for {len(touches)} tracked steps")
            + ": the outputs look squashed (softmax) before a loss that applies its own",
            fix="pass raw logits to CrossEntropyLoss / BCEWithLogitsLoss: remove a final softmax or sigmoid",
            evidence={"classes": classes, "floor": floor, "ceiling": floor + 1.0, "lowest": memo["low"],
                      "highest": memo["high"], "touched": touched, "since": steps[0],
                      "strength": "strong" if 4 * touched >= 3 * self.band_window else "moderate"},
        )]

    def _quiet(self, history: RunHistory) -> list[Finding]:
        memo = history.memo.setdefault(f"{self.id}/{id(self)}", {})
        if memo.get("version") != history.version("Loss"):
            memo.clear()
            memo["version"] = history.version("Loss")
        if "quiet" not in memo:  # the first window never changes: judged once
            steps, values = history.head("Loss", self.window)
            if len(values) < self.window:
                return []
            center = _median(values)
            noise = _robust_scale(np.diff(values)) / math.sqrt(2.0)
            memo.update(quiet=bool(center > 0 and noise < self.quiet * center), steps=steps, center=center, noise=noise)
        if not memo["quiet"] or history.count("Loss") < self.patience:
            return []
        steps, center, noise = memo["steps"], memo["center"], memo["noise"]
        recent_steps, recent = history.tail("Loss", self.window)
        late_center = _median(recent)
        if not (late_center > 0 and _robust_scale(np.diff(recent)) / math.sqrt(2.0) < self.quiet * late_center):
            return []  # a plateau that broke: its loss varies now
        share = recipe.loss_share(history)
        if not share > self.flat:
            return []
        ratio = _global_update_ratio(history, recent_steps)
        if math.isfinite(ratio) and ratio < self.moving:
            return []  # the parameters barely move: a flat loss of a learning rate too small (round 9)
        return [
            self.finding(
                int(history.tail("Loss", 1)[0][-1]),
                f"the loss barely varies from batch to batch: {_g(100 * noise / center)}% of its value over steps "
                f"{int(steps[0])}..{int(steps[-1])}, and it has not fallen (now {_g(share)}x its start): the outputs "
                "look squashed before the loss",
                fix="pass raw logits to CrossEntropyLoss / BCEWithLogitsLoss: remove a final softmax or sigmoid",
                evidence={"relative_noise": noise / center, "loss_share": share, "since": int(steps[0]),
                          "strength": _strength(math.log10(self.quiet * center / max(noise, 1e-300)), 0.2, 0.6)},
            )
        ]


class LossAtChance(Rule):
    """The loss sits at chance level: for the last ``window`` tracked steps the moving median of
    ``median_of`` losses stayed within ``margin`` (relative) of ``log C``, the cross-entropy of a
    uniform guess over the ``C`` classes (``DataStats``' ``outputs``, 2 or more), while the
    parameters move at a normal rate (the global update ratio ``||update|| / ||parameters||``,
    median over the window, at least ``moving``; without ``UpdateSize`` and ``ParamNorm`` this is
    not checked) and the loss is not falling (the median of the window's last third at most
    ``max_fall`` x ``log C`` below that of its first third: a slow start near chance, as the fixed
    corpus's healthy batch-8 MLPs, is left alone). The model predicts no better than a guess: the labels do not depend on the
    inputs it sees (labels shuffled against the inputs, a wrong label encoding, inputs that carry
    no signal).

    A model fed integer inputs (token ids: ``DataStats``' ``input_integer``) gets ``token_window``
    steps: a language model's loss sits near ``log V`` for a while before it learns.

    Set on the generated corpus's tuning families (issue 36, round 4): healthy runs sat within 2%
    of chance for at most 24 tracked steps (language models: 50) before they learned, runs with
    shuffled labels for 61 steps or more (language models: 42-70, so some are not seen); runs with
    a learning rate 300-3000x too small had update ratios up to 8e-5, runs with shuffled labels
    1e-3 or more.

    For inputs other than tokens it also fires when the moving median stayed within ``wide_margin``
    (4%) of chance for ``wide_window`` (45) tracked steps (round 5, tuning families of seeds 0-3:
    healthy runs stayed within 4% for at most 29 steps; two-class runs with shuffled labels, whose
    loss wanders 2-4% around ``log 2``, for 50 or more).

    Not while the learning rate rises over the window (a warm-up, the first half of a one-cycle schedule:
    ``recipe.warming_up``, as ``update-ratio-too-small`` reads it): the window counts steps taken at the
    run's rate (round 9: outside trial 8's healthy squeeze-and-excitation CNN with a one-cycle schedule sat
    at chance while its rate rose for 60 steps, and left it 20 steps after the peak).
    """

    id = "loss-at-chance"
    severity = "warning"
    reads = ("Loss", "DataStats")

    def __init__(self, window: int = 40, margin: float = 0.02, median_of: int = 10, moving: float = 3e-4,
                 token_window: int = 60, max_fall: float = 0.01, wide_margin: float = 0.04, wide_window: int = 45):
        self.max_fall = _check_positive("max_fall", max_fall)
        self.wide_margin = _check_positive("wide_margin", wide_margin)
        self.wide_window = _check_window(wide_window, "wide_window")
        self.window = _check_window(window)
        self.token_window = _check_window(token_window, "token_window")
        self.margin = _check_positive("margin", margin)
        self.median_of = _check_window(median_of, "median_of")
        self.moving = _check_nonnegative("moving", moving)

    def _classes(self, history: RunHistory) -> tuple[int | None, bool]:
        latest = history.last("DataStats", 1)
        value = latest[0][1] if latest else None
        if not isinstance(value, Mapping):
            return None, False
        classes = value.get("outputs")
        tokens = bool(value.get("input_integer", False))
        return (classes if isinstance(classes, int) and not isinstance(classes, bool) and classes >= 2 else None,
                tokens)

    def _at_chance(self, values: np.ndarray, chance: float, margin: float | None = None) -> np.ndarray:
        """Per value from the ``median_of``-th on: whether the moving median ending there is at chance."""
        windows = np.lib.stride_tricks.sliding_window_view(values, self.median_of)
        return np.abs(np.median(windows, axis=1) / chance - 1.0) <= (self.margin if margin is None else margin)

    def _stretch(self, history: RunHistory, chance: float, tokens: bool) -> tuple[np.ndarray, np.ndarray, float] | None:
        """``(steps, losses, margin)`` of the window at chance ending at the latest step, or ``None``: within
        ``margin`` for ``window`` steps (``token_window`` for token inputs), or, for other inputs, within
        ``wide_margin`` for ``wide_window`` steps."""
        tests = [(self.token_window, self.margin)] if tokens else [(self.window, self.margin),
                                                                  (self.wide_window, self.wide_margin)]
        for window, margin in tests:
            steps, values = history.tail("Loss", window + self.median_of - 1)
            if len(values) >= window + self.median_of - 1 and self._at_chance(values, chance, margin).all():
                return steps, values, margin
        return None

    def check(self, history: RunHistory) -> list[Finding]:
        classes, tokens = self._classes(history)
        if classes is None:
            return []
        chance = math.log(classes)
        widest = self.margin if tokens else max(self.margin, self.wide_margin)
        _, latest = history.tail("Loss", self.median_of)
        if len(latest) < self.median_of or not abs(_median(latest) / chance - 1.0) <= widest:
            return []  # (most steps: the latest median is not at chance)
        stretch = self._stretch(history, chance, tokens)
        if stretch is None:
            return []
        steps, values, margin = stretch
        window = len(values) - self.median_of + 1
        third = max(len(values) // 3, 1)
        if (_median(values[:third]) - _median(values[-third:])) > self.max_fall * chance:
            return []  # at chance, but falling: a slow start
        if recipe.warming_up(history, int(steps[self.median_of - 1]), int(steps[-1])):
            return []  # the learning rate still rises: the run has not yet trained at its rate (round 9)
        ratio = _global_update_ratio(history, steps[self.median_of - 1:])
        if math.isfinite(ratio) and ratio < self.moving:
            return []  # the parameters barely move: a learning rate too small, not the data
        # where the stretch at chance began (kept while it lasts)
        memo = history.memo.setdefault(f"{self.id}/{id(self)}", {})
        last = int(steps[-1])
        if memo.get("classes") != classes or memo.get("margin") != margin or memo.get("previous") not in (
                int(steps[-2]), last):
            all_steps, all_values = history.scalars("Loss")
            keep = np.isfinite(all_values)
            all_steps, all_values = all_steps[keep], all_values[keep]
            at = self._at_chance(all_values, chance, margin)
            start = len(at)
            while start > 0 and at[start - 1]:
                start -= 1
            # at chance from the start of the run: since its first loss; else since the middle of the first
            # median at chance (a loss that returns to chance after a blow-up starts there, not before)
            memo["since"] = int(all_steps[0] if start < self.median_of // 2 else all_steps[start + self.median_of // 2])
            memo["classes"], memo["margin"] = classes, margin
        memo["previous"] = last
        since = memo["since"]
        recent = float(np.median(values[-self.median_of:]))
        return [self.finding(
            last,
            f"the loss has stayed at chance level since step {since}: {_g(recent)} (median of the last "
            f"{self.median_of}), within {_g(100 * margin)}% of log({classes}) = {_g(chance)}, the loss of a "
            "uniform guess, while the parameters move"
            + (f" (update ratio {_g(ratio)})" if math.isfinite(ratio) else ""),
            fix="check that labels and inputs are shuffled together and encoded as the loss expects, that the "
            "inputs reach the model, and that the task is learnable (try to overfit one batch)",
            evidence={"loss": recent, "chance": chance, "classes": classes, "since": since, "update_ratio": ratio,
                      "strength": "strong" if last - since >= 2 * window else "moderate"},
        )]


class LossJump(Rule):
    """The loss jumped to a higher level mid-run: the median of the last ``after`` finite losses is
    above the median of the ``before`` losses preceding them by more than ``gap`` x the first loss and
    ``z`` x their noise, after the run had learned (that median below ``learned`` x the first loss).

    Read in context by the cause layer: with the learning rate raised or the
    updates grown before it, the learning rate; otherwise the data changed.

    A new level, not a spike: every loss of the ``after`` window is at least ``hold`` x the jump above the
    old level (round 10: outside trial 9's healthy WaveNet rose for 6 steps to 5x its level and was back
    within 2 more; its ``after`` window held a loss 0.3x the jump above the level, and its finding named the
    data. Labels replaced mid-run lift every batch's loss).
    """

    id = "loss-jump"
    severity = "warning"
    reads = ("Loss",)

    def __init__(self, before: int = 10, after: int = 5, gap: float = 0.2, z: float = 6.0, learned: float = 0.9,
                 hold: float = 0.5):
        self.hold = _check_nonnegative("hold", hold)
        self.before = _check_window(before, "before")
        self.after = _check_window(after, "after")
        self.gap = _check_positive("gap", gap)
        self.z = _check_positive("z", z)
        self.learned = _check_positive("learned", learned)

    def check(self, history: RunHistory) -> list[Finding]:
        steps, values = history.tail("Loss", self.before + self.after)
        if len(values) < self.before + self.after:
            return []
        first = float(history.head("Loss", 1)[1][0])
        early, late = values[: self.before], values[self.before:]
        level, now = _median(early), _median(late)
        noise = _robust_scale(np.diff(early)) / math.sqrt(2.0)
        jump = now - level
        if not (first > 0 and level < self.learned * first and jump > self.gap * first and jump > self.z * noise):
            return []
        if late.min() <= level + self.hold * jump:
            return []  # not a new level: a spike among values back near the old one
        since = int(steps[self.before])
        rate_then, rate_now = recipe.rate_at(history, int(steps[0])), recipe.rate_at(history, int(steps[-1]))
        return [
            self.finding(
                int(steps[-1]),
                f"the loss jumped from {_g(level)} (median of steps {int(steps[0])}..{int(steps[self.before - 1])}) "
                f"to {_g(now)} (steps {since}..{int(steps[-1])}), {_g(jump / first)}x the first loss",
                fix="check the learning-rate schedule at that step, then the data pipeline (constant or zeroed "
                "inputs, labels replaced)",
                evidence={"before": level, "after": now, "first": first, "noise": noise, "since": since,
                          "rate_ratio": (rate_now / rate_then) if rate_then > 0 else math.nan,
                          "strength": _strength(jump / max(self.z * noise, 1e-12), 1.5, 3.0)},
            )
        ]


def default_rules() -> list[Rule]:
    """One instance of every built-in rule with default thresholds."""
    return [
        NonFiniteLoss(),
        LossDiverging(),
        LossNotDecreasing(),
        NoisyLoss(),
        SmallBatch(),
        ExplodingGradient(),
        VanishingGradient(),
        UpdateRatioTooSmall(),
        UpdateRatioTooLarge(),
        UnchangedParameters(),
        StepOvershoots(),
        StepTooShort(),
        SharpnessAboveStability(),
        NoiseDominated(),
        DeadUnits(),
        SaturatedUnits(),
        PoorInitialization(),
        LargeInputScale(),
        ConstantInputs(),
        LossAtChance(),
        Overfitting(),
        LearningRateJump(),
        WeightsShrinking(),
        GradientsAccumulate(),
        SaturatedOutput(),
        LossJump(),
        ExplodingRecurrence(),
        _loss_spike(),
    ]


def _loss_spike() -> Rule:
    from cockpit_like.diagnosis.spike_rule import LossSpike  # (its own module: the rule of issue 38)

    return LossSpike()
