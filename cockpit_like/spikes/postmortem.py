"""The :class:`PostMortem` quantity: at each spike of the loss or the gradient norm, what happened.

At every tracked step it reads the per-row statistic ``GramSummary`` and
``info["individual_losses"]`` (optionally ``info["sample_ids"]``,
``info["optimizer"]``, ``info["grad_scaler"]``), the per-layer gradient norms
from ``p.grad`` and the per-layer update ratios ``||theta_t - theta_prev|| /
||theta_prev||`` (from a copy of the parameters at the previous tracked step:
``D`` numbers, ``layer_updates=False`` leaves it out). It keeps a
:class:`~cockpit_like.spikes.rows.RowBuffer` of the last steps' top rows and
a :class:`~cockpit_like.spikes.detector.SpikeDetector`. At a spike it stores,
under ``"PostMortem"`` at that step (nothing at other steps):

- ``trigger``: which series spiked (loss, gradient norm), with the value,
  the window's median, the robust z-score and the ratio;
- ``rows_by_share`` / ``rows_by_loss``: the step's top rows
  ``{"row", "id", "loss", "grad_norm", "share", "loss_z"}`` (share:
  ``<g_i / B, G> / ||G||^2``; ``loss_z``: the row's loss against the previous
  steps' rows);
- ``rows``: ``batch``, ``outlier_rows``, ``outlier_share`` (the share of the
  rows whose ``loss_z >= row_z``), ``top_share``, ``median_shift`` (the
  median row loss against the previous steps' rows, in their spread: a whole
  bad batch);
- ``earlier_rows``: rows of the previous ``look_back`` tracked steps that
  stood out (outlier loss or a share of at least ``top_share_flag``);
- ``layers``: the layers whose gradient norm or update ratio moved first
  (robust z against their own window at each of the last ``moved_steps``
  steps), earliest first;
- ``learning_rate``, ``precision`` (GradScaler scale, drops, the steps it
  skipped: ``scaler_skips``, read off the scale as ``log(previous / scale) /
  log(1 / backoff_factor)``, a skipped step leaving no tracked step behind),
  ``sharpness`` (``HessMaxEV`` against ``2 / lr``, when a ``HessMaxEV``
  quantity is passed as ``sharpness=``);
- ``cause``, ``why``, ``strength``, ``checks``, ``suspects`` (the rows
  behind a ``bad-rows`` cause, each with its step):
  :func:`~cockpit_like.spikes.causes.name_cause`.

Memory: the row buffer (``keep_steps x (2 top_k x 40 + 64)`` bytes), the
layers' window (``(window + moved_steps) x layers x 16`` bytes) and, with
``layer_updates``, one copy of the parameters; :attr:`nbytes` counts them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cockpit_like import context
from cockpit_like.backends.per_sample_stats import GramSummary
from cockpit_like.functional.row_summaries import row_norms, row_shares, top_rows
from cockpit_like.functional.spikes import robust_center_scale, robust_score
from cockpit_like.quantities.quantity import SingleStepQuantity
from cockpit_like.spikes.causes import name_cause
from cockpit_like.spikes.detector import RECENT, SpikeDetector
from cockpit_like.spikes.rows import RowBuffer, ids_of, row_summary

__all__ = ["PostMortem"]


class PostMortem(SingleStepQuantity):
    """A post-mortem at each spike of the loss or the gradient norm (see the module docstring).

    Args:
        track_schedule: when to compute (every step is best: the detector's window counts tracked steps).
        keep_steps, top_k: the row buffer's N and k.
        window, warmup, z, loss_ratio, grad_ratio, ramp_z, cooldown, loss_gap, skip_steps: the detector's
            (:class:`~cockpit_like.spikes.detector.SpikeDetector`).
        row_z: a row's loss is an outlier at this robust z against the previous steps' rows.
        look_back: previous tracked steps searched for rows that stood out.
        layer_updates: keep a copy of the parameters for per-layer update ratios.
        sharpness: a ``HessMaxEV`` quantity of the same cockpit, read for the curvature cause.
        cause_settings: keyword arguments of :func:`~cockpit_like.spikes.causes.name_cause`.
        record_all: store a post-mortem at every tracked step after the warmup, spike or not (its
            ``trigger["series"]`` empty when none): for setting thresholds offline on labelled runs
            (``cockpit_like.spikes.corpus``), not for training.

    Example::

        post = PostMortem(every(1))
        cockpit = Cockpit(params, quantities=[post, ...])
        with cockpit(step, info={"individual_losses": losses, "sample_ids": idx, "optimizer": opt, ...}): ...
        cockpit.get_output().get(step, {}).get("PostMortem")   # a dict at a spike
    """

    _STATE_SKIP = SingleStepQuantity._STATE_SKIP + ("_sharpness", "_names")
    #: under a BatchNorm in training mode (no per-sample gradients) it still detects spikes and ranks the rows
    #: by their loss (``rows["gradients"]`` False, ``rows_by_share`` empty)
    works_without_per_sample_stats = True

    def __init__(self, track_schedule, keep_steps: int = 32, top_k: int = 5, window: int = 20, warmup: int = 10,
                 z: float = 7.0, loss_ratio: float = 1.3, grad_ratio: float = 3.0, ramp_z: float = 10.0,
                 cooldown: int = 5, loss_gap: float = 0.05, skip_steps: int = 2, row_z: float = 6.0, look_back: int = 5, moved_steps: int = 3,
                 layer_z: float = 4.0, top_share_flag: float = 0.3, layer_updates: bool = True,
                 sharpness: Any = None, cause_settings: dict[str, float] | None = None, record_all: bool = False,
                 verbose: bool = False):
        super().__init__(track_schedule, verbose=verbose)
        self.buffer = RowBuffer(keep_steps, top_k)
        self.detector = SpikeDetector(window, warmup, z, loss_ratio, grad_ratio, ramp_z, cooldown, loss_gap, skip_steps)
        for name, value in (("row_z", row_z), ("layer_z", layer_z), ("top_share_flag", top_share_flag)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"PostMortem: {name} must be a positive number, got {value!r}")
        for name, value in (("look_back", look_back), ("moved_steps", moved_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PostMortem: {name} must be a positive int, got {value!r}")
        if not isinstance(layer_updates, bool):
            raise ValueError(f"PostMortem: layer_updates must be True or False, got {layer_updates!r}")
        if sharpness is not None and not hasattr(sharpness, "output"):
            raise ValueError("PostMortem(sharpness=...) takes the HessMaxEV quantity tracked by the same cockpit "
                             f"(its output is read), got {type(sharpness).__name__}")
        self.row_z, self.look_back, self.moved_steps, self.layer_z = float(row_z), look_back, moved_steps, float(layer_z)
        self.top_share_flag, self.layer_updates = float(top_share_flag), bool(layer_updates)
        self.cause_settings = dict(cause_settings or {})
        name_cause({}, **self.cause_settings)  # a wrong keyword fails here, not at the first spike
        self._sharpness = sharpness
        self.record_all = bool(record_all)
        self._names: dict[int, str] = {}
        #: ``[step, [grad norms per layer], [update ratios per layer]]`` of the last window + moved_steps steps
        self.layer_history: list[list[Any]] = []
        self._previous: list[torch.Tensor] | None = None
        self._last_step: int | None = None
        self._scale: float | None = None

    # ---- what it needs -----------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        return {"keep_steps": self.buffer.keep_steps, "top_k": self.buffer.top_k, **self.detector.settings(),
                "row_z": self.row_z, "look_back": self.look_back, "moved_steps": self.moved_steps,
                "layer_z": self.layer_z, "top_share_flag": self.top_share_flag, "layer_updates": self.layer_updates,
                "sharpness": None if self._sharpness is None else type(self._sharpness).__name__,
                "record_all": self.record_all,
                "cause_settings": dict(self.cause_settings)}

    def per_sample_stats(self, global_step: int) -> list:
        return [GramSummary()] if self.should_compute(global_step) else []

    def required_info(self, global_step: int) -> set[str]:
        return {"individual_losses"} if self.should_compute(global_step) else set()

    def adapt_to_models(self, models: list) -> None:
        self._names = {id(p): name for model in models for name, p in model.named_parameters()}

    @property
    def nbytes(self) -> int:
        """Bytes kept across steps: the row buffer, the layers' window and the parameter copy."""
        layers = sum(16 * len(row[1]) + 8 for row in self.layer_history)
        copy = sum(t.numel() * t.element_size() for t in self._previous) if self._previous else 0
        return self.buffer.nbytes + layers + copy

    # ---- computing -------------------------------------------------------------------------------
    def _compute(self, global_step, params, batch_loss):
        owner = type(self).__name__
        record = context.get_record(global_step)
        losses = record.require("individual_losses", owner)
        losses = torch.as_tensor(losses).detach().to(torch.float64).reshape(-1)
        stats = record.stat(GramSummary(), None)
        grad_norms = [float(p.grad.detach().norm()) if p.grad is not None else 0.0 for p in params]
        if stats is None:  # no per-sample gradients at this step (a BatchNorm in training mode): rows by loss alone
            nothing = torch.full_like(losses, math.nan)
            diag, row_sums = nothing, nothing
        else:
            diag, row_sums = stats
        ids = ids_of(record.info, diag.shape[0], owner)
        summary = row_summary(global_step, losses, diag, row_sums, ids, self.buffer.top_k)
        if stats is None:
            summary["grad_norm"] = math.sqrt(sum(norm * norm for norm in grad_norms))  # the step's gradient, exact
        live = record.live_params if record.live_params is not None else params
        names = [self._names.get(id(p), f"param_{i}") for i, p in enumerate(live)]
        updates = self._update_ratios(live)
        rate = _learning_rate(record.info)
        precision = self._precision(global_step, record, summary["loss"])
        rate_median = self.detector.baseline(3)[0] if self.detector.history else math.nan
        rate_previous = self.detector.history[-1][3] if self.detector.history else None
        spike = self.detector.update(global_step, summary["loss"], summary["grad_norm"], rate,
                                     skipped=precision.get("scaler_skips", 0))
        if spike is None and self.record_all:
            spike = self.detector.last_scores
        result = None
        if spike is not None:
            result = self._post_mortem(global_step, spike, summary, losses, diag, row_sums, ids, names, grad_norms,
                                       updates, rate, rate_median, rate_previous, precision, gradients=stats is not None)
        self.buffer.add(summary)
        self.layer_history.append([int(global_step), grad_norms, updates])
        del self.layer_history[: max(0, len(self.layer_history) - self.detector.window - self.moved_steps)]
        self._last_step = int(global_step)
        return result

    def _update_ratios(self, live: list[torch.Tensor]) -> list[float]:
        if not self.layer_updates:
            return [math.nan] * len(live)
        now = [p.detach().clone() for p in live]
        before, self._previous = self._previous, now
        if before is None or len(before) != len(now):
            return [math.nan] * len(now)
        ratios = []
        for a, b in zip(before, now):
            base = float(a.norm())
            ratios.append(float((b - a).norm()) / base if base > 0 else math.nan)
        return ratios

    def _precision(self, step: int, record: Any, loss: float) -> dict[str, Any]:
        scaler = record.info.get("grad_scaler")
        missing = []
        if self._last_step is not None:
            missing = [s for s in range(self._last_step + 1, step) if self.should_compute(s)][:20]
        result: dict[str, Any] = {"scaler": False, "missing_steps": missing, "nonfinite": not math.isfinite(loss)}
        if scaler is not None and callable(getattr(scaler, "get_scale", None)) and scaler.is_enabled():
            scale = float(scaler.get_scale())
            previous, self._scale = self._scale, scale
            dropped = previous is not None and scale < previous
            result.update(scaler=True, scale=scale, previous_scale=previous, scale_dropped=dropped,
                          scaler_skips=_skips(previous, scale, scaler) if dropped else 0)
        return result

    def _post_mortem(self, step, spike, summary, losses, diag, row_sums, ids, names, grad_norms, updates, rate,
                     rate_median, rate_previous, precision, gradients: bool = True) -> dict[str, Any]:
        shares, norms = row_shares(row_sums.detach().to(torch.float64)), row_norms(diag.detach().to(torch.float64))
        earlier = self.buffer.steps[-RECENT:]  # the rows of the last steps: where the loss is now
        base = robust_center_scale([s["row_loss_median"] for s in earlier])[0] if earlier else math.nan
        spread = robust_center_scale([s["row_loss_scale"] for s in earlier])[0] if earlier else math.nan
        first = self.detector.first_loss
        if math.isfinite(base):  # (a spread of row losses near 0 is floored at 2% of the run's first loss)
            floor = 0.02 * abs(first) if math.isfinite(first) else 1e-3 * abs(base)
            spread = max(spread if math.isfinite(spread) else 0.0, floor, 1e-12)
            loss_z = (losses - base) / spread
        else:
            loss_z = torch.full_like(losses, math.nan)
        finite = losses[torch.isfinite(losses)]
        shift = float((finite.median() - base) / spread) if finite.numel() and math.isfinite(base) else math.nan
        outlier = loss_z >= self.row_z
        finite_shares = torch.nan_to_num(shares, nan=0.0)
        # without per-sample gradients, the rows' share of the batch's loss rise above the previous steps' rows
        rise = (losses - base).clamp(min=0) if math.isfinite(base) else torch.zeros_like(losses)
        rise = torch.nan_to_num(rise, nan=0.0, posinf=0.0)
        loss_shares = rise / rise.sum() if float(rise.sum()) > 0 else torch.zeros_like(rise)

        def row(i: int) -> dict[str, Any]:
            return {"row": i, "id": ids[i], "loss": float(losses[i]), "grad_norm": float(norms[i]),
                    "share": float(shares[i]), "loss_z": float(loss_z[i])}

        k = self.buffer.top_k
        evidence: dict[str, Any] = {
            "rows": {"batch": int(losses.shape[0]), "outlier_rows": int(outlier.sum()),
                     "outlier_share": float(finite_shares[outlier].sum()), "top_share": float(finite_shares.max()),
                     "gradients": gradients,
                     "outlier_loss_share": float(loss_shares[outlier].sum()), "top_loss_share": float(loss_shares.max()),
                     "row_loss_baseline": base, "row_loss_scale": spread, "median_shift": shift},
            "learning_rate": None if rate is None else {
                "value": rate, "window_median": rate_median, "previous": rate_previous,
                "ratio": rate / rate_median if rate_median and math.isfinite(rate_median) and rate_median > 0 else math.nan},
            "precision": precision,
            "sharpness": self._sharpness_at(step, rate),
        }
        evidence.update(step=int(step), rows_by_share=[row(i) for i in top_rows(shares, k)] if gradients else [],
                        rows_by_loss=[row(i) for i in top_rows(losses, k)],
                        earlier_rows=self._earlier_rows(base, spread))
        verdict = name_cause(evidence, **self.cause_settings)
        return {
            "trigger": spike,
            "cause": verdict["cause"], "why": verdict["why"], "strength": verdict["strength"],
            "checks": verdict["checks"], "suspects": verdict["suspects"],
            "layers": self._layers_moved(step, names, grad_norms, updates),
            **evidence,
        }

    def _earlier_rows(self, base: float, spread: float) -> list[dict[str, Any]]:
        found = []
        for summary in self.buffer.steps[-self.look_back:]:
            for entry in summary["rows"]:
                z = (entry["loss"] - base) / spread if math.isfinite(base) else math.nan
                why = []
                if z >= self.row_z:
                    why.append(f"loss z {z:.1f}")
                if entry["share"] >= self.top_share_flag:
                    why.append(f"share {entry['share']:.0%}")
                if why:
                    found.append({"step": summary["step"], **entry, "loss_z": z, "why": ", ".join(why)})
        return found[-2 * self.buffer.top_k:]

    def _layers_moved(self, step: int, names: list[str], grad_norms: list[float],
                      updates: list[float]) -> list[dict[str, Any]]:
        rows = self.layer_history + [[int(step), grad_norms, updates]]
        recent, window = rows[-self.moved_steps:], rows[: -self.moved_steps]
        moved = []
        for layer, name in enumerate(names):
            entry: dict[str, Any] = {"layer": layer, "name": name, "grad_norm": grad_norms[layer],
                                     "update_ratio": updates[layer], "first_step": None, "z": 0.0, "series": None}
            for column, series in ((1, "grad_norm"), (2, "update_ratio")):
                past = [r[column][layer] for r in window if layer < len(r[column])]
                for r in recent:
                    score = robust_score(past, r[column][layer], min_window=3)
                    if math.isfinite(score) and score >= self.layer_z:
                        if entry["first_step"] is None or r[0] < entry["first_step"] or (
                                r[0] == entry["first_step"] and score > entry["z"]):
                            entry.update(first_step=int(r[0]), z=float(score), series=series)
                        break
            if entry["first_step"] is not None:
                moved.append(entry)
        moved.sort(key=lambda e: (e["first_step"], -e["z"]))
        return moved[: self.buffer.top_k]

    def _sharpness_at(self, step: int, rate: float | None) -> dict[str, Any] | None:
        if self._sharpness is None or not rate:
            return None
        known = [(s, v) for s, v in self._sharpness.output.items() if s <= step and isinstance(v, (int, float))]
        if not known:
            return None
        at, value = max(known)
        return {"value": float(value), "step": int(at), "two_over_lr": 2.0 / rate, "ratio": float(value) * rate / 2.0}


def _learning_rate(info: dict) -> float | None:
    """The largest learning rate of ``info["optimizer"]``'s groups (None without an optimizer)."""
    groups = getattr(info.get("optimizer"), "param_groups", None)
    rates = [float(g["lr"]) for g in groups or [] if isinstance(g.get("lr"), (int, float, torch.Tensor))]
    return max(rates) if rates else None


def _skips(previous: float, scale: float, scaler: Any) -> int:
    """Steps a GradScaler skipped between two scales: each skip multiplies the scale by its back-off factor
    (``log(previous / scale) / log(1 / backoff)``, rounded; at least 1 when the scale dropped; a growth in
    between would hide one skip per growth)."""
    backoff = getattr(scaler, "get_backoff_factor", lambda: 0.5)()
    if not (isinstance(backoff, (int, float)) and 0 < backoff < 1) or not (scale > 0 and previous > scale):
        return 1
    return max(1, round(math.log(previous / scale) / math.log(1 / backoff)))
