"""Alpha: the normalized step length of the update ``theta_t -> theta_{t+1}``.

The fit itself (Cockpit paper, Schneider et al. 2021) is the pure function
:func:`cockpit_like.functional.alpha.alpha_from_observations`. This module
gathers its inputs at two consecutive steps for *any* ``torch.optim.Optimizer``
without keeping per-sample gradients from one step to the next:

- **Start step t** (after backward): the direction ``d`` of the coming update
  is not known yet. Alpha predicts it by a *look-ahead*: it runs
  ``optimizer.step()`` on shadow copies of the parameters, gradients and
  optimizer state, leaving the real ones untouched
  (:func:`cockpit_like.utils.optim.lookahead_update`, shared with
  :class:`~cockpit_like.utils.optim.ComputeStep`; an optimizer that keeps state
  elsewhere steps under a :class:`~cockpit_like.utils.optim.StepGuard`, and one
  whose step wrote the real parameters, a wrapper, gives no value at that step,
  with a note). With the per-sample gradients of this step
  (kept only until the end of this step) it reduces the slopes
  ``u_{0,i} = g_{t,i}^T d / ||d||`` to their mean and unbiased variance. Kept
  after the backward pass: ``theta_t`` (one copy, shared with UpdateSize), the
  predicted ``d`` and ``sum_i grad_batch_i``, nothing per sample. The actual
  update is compared with the prediction (below) right after
  ``optimizer.step()`` (a step post-hook of ``info["optimizer"]``); then only
  ``theta_t`` and a few floats are kept to step t+1: one copy of the
  parameters. Without the hook (no optimizer given, or one without
  ``register_step_post_hook``) the comparison waits for step t+1.
- **End step t+1**: the actual ``d = theta_{t+1} - theta_t`` is known when the
  step begins, so the slopes ``u_{1,i} = g_{t+1,i}^T d / ||d||`` are reduced
  layer by layer in the backward pass
  (:class:`~cockpit_like.backends.per_sample_stats.DirectionalDots`), each
  parameter's part of ``d`` made when it is read. The
  prediction is verified: if the actual update has the predicted *direction*
  (slopes depend only on the direction) the result is exact. Otherwise (the
  gradients were changed between backward and ``step()``, e.g. clipping with
  an adaptive optimizer, or no ``info["optimizer"]`` for a non-SGD optimizer)
  the start slopes' variance was taken along another direction: Alpha stores
  no value for that step, says why in the end step's notes, and from then on
  predicts the update when the optimizer steps (:meth:`Alpha.waits_for_optimizer`).

Scaling: mean loss, ``grad_batch[i] = g_i / B``; ``u_{k,i} = B grad_batch_{k,i}^T d / tau``
with ``B = info["batch_size"]``. Stored under the start step (``SAVE_SHIFT = 1``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from cockpit_like import context
from cockpit_like.backends.partitions import gradless, is_dtensor, optimizer_gradients, step_memo, whole
from cockpit_like.backends.per_sample_stats import DirectionalDots, PredictedSlopes
from cockpit_like.checks.invariants import tolerance_for
from cockpit_like.functional import tensor_lists
from cockpit_like.functional.alpha import alpha_from_observations, sample_mean_and_variance
from cockpit_like.quantities.quantity import TwoStepQuantity, parameter_snapshot
from cockpit_like.utils.optim import LookaheadNotValid, has_step_hooks, lookahead_update

__all__ = ["Alpha", "lookahead_update"]  # lookahead_update: re-exported from cockpit_like.utils.optim


class _Steps(Sequence):
    """``theta_{t+1} - theta_t`` per parameter, each made when it is read (``p - reference``; the last one
    read is kept for the next block of rows of the same layer), so that no copy of all the parameters
    exists at once (on a GPT-style model with a batch of 16 such a copy is 6% of its per-sample gradients'
    size); made all at once where a parameter is sharded (a ``DTensor``: its whole tensor is a collective
    that every rank makes in the same order)."""

    def __init__(self, params: list[torch.Tensor], reference: list[torch.Tensor]):
        self._params, self._reference = list(params), list(reference)
        self._last: tuple[int, torch.Tensor] | None = None
        self._made = None
        if any(is_dtensor(p) for p in self._params):
            self._made = [whole(p.detach()) - r for p, r in zip(self._params, self._reference)]

    def __len__(self) -> int:
        return len(self._reference)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if self._made is not None:
            return self._made[index]
        index = range(len(self))[index]  # IndexError past the end (ends iteration)
        if self._last is None or self._last[0] != index:
            self._last = None  # free the previous one first
            self._last = (index, self._params[index].detach() - self._reference[index])
        return self._last[1]

    def __iter__(self):
        """All the steps in order, made a group of parameters at a time (one kernel per group on an
        accelerator: a norm of the step reads every parameter)."""
        if self._made is not None:
            return iter(self._made)
        return tensor_lists.differences(self._params, self._reference)


def _norm(tensors) -> torch.Tensor:
    # one pass per tensor, no squared copy (GPT-2 small: 11 norms of all the parameters per tracked step),
    # a group of tensors per kernel launch on an accelerator
    return tensor_lists.norm(tensors)


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))


def _hyperparameters(optimizer) -> list[dict] | None:
    """The numbers and flags of each of ``optimizer``'s param groups (learning rate, weight decay, betas...)."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return None
    plain = (int, float, bool, tuple, type(None))
    return [{k: v for k, v in group.items() if k != "params" and isinstance(v, plain)} for group in groups]


def _changed(before: list[dict] | None, after: list[dict] | None) -> str | None:
    """What changed between two :func:`_hyperparameters` readings, in words (``None``: nothing, or unknown)."""
    if before is None or after is None or len(before) != len(after):
        return None
    changes = [f"{key} {old!r} -> {new!r}" + (f" (group {index})" if len(before) > 1 else "")
               for index, (old_group, new_group) in enumerate(zip(before, after))
               for key, old in old_group.items()
               if key in new_group and (new := new_group[key]) != old]  # fmt: skip
    return ", ".join(changes[:4]) + (" ..." if len(changes) > 4 else "") if changes else None


#: :meth:`Alpha._predict_update`'s answer where the look-ahead ran but could not predict the update (noted)
_NOT_VALID = object()


class Alpha(TwoStepQuantity):
    """Normalized step length from a noise-aware quadratic fit along the update.

    ``alpha = tau / x* - 1`` where ``tau = ||theta_{t+1} - theta_t||`` and ``x*``
    is the minimum of the quadratic fitted to the losses, the slopes and their
    single-sample variances at both ends (see :mod:`cockpit_like.functional.alpha`):
    0 = the step lands on the minimum, 1 = on the mirrored point, < 0 undershoot,
    > 0 overshoot, -1 for a concave fit; nothing (a note) for a step of length 0. Stored under the start step t
    once the cockpit is entered at t+1 (which need not be scheduled).

    Needs ``info["batch_size"]``, ``info["individual_losses"]`` and ``info["loss"]``
    at both steps, and ``info["optimizer"]`` (any ``torch.optim.Optimizer``) at
    the start step; without it the update direction is assumed to be the
    negative gradient (exact for plain SGD) and checked at the end step.
    Memory kept between the steps is O(D) (see the module docstring).
    """

    SAVE_SHIFT = 1
    _INFO = {"batch_size", "individual_losses", "loss"}
    reads_parameters = True
    predicts_update = True
    needs_two_samples = True  # the fit weighs by the variances of the losses and slopes over the samples

    def __init__(self, track_schedule, verbose: bool = False):
        super().__init__(track_schedule, verbose=verbose)
        self._end_direction: tuple[int, list[torch.Tensor]] | None = None
        self._tracked_params: list[torch.Tensor] = []
        #: an update was seen off the look-ahead made at the end of the backward pass (the gradients changed by
        #: a factor before the optimizer's step: clipping, a loss factor): start steps then wait for the step
        self._waits = False

    def waits_for_optimizer(self, global_step: int) -> bool:
        return self._waits and self.is_start(global_step)

    def learn_to_wait(self, global_step: int) -> bool:
        learned, self._waits = not self._waits, True
        return learned

    def required_info(self, global_step: int) -> set[str]:
        return set(self._INFO) if self.is_active(global_step) else set()

    def _dots_key(self, global_step: int) -> str:
        return f"Alpha-{id(self)}-step{global_step}"

    def _slopes_key(self, global_step: int) -> str:
        return f"Alpha-{id(self)}-start{global_step}"

    def per_sample_stats(self, global_step: int) -> list:
        stats = []
        if self.is_start(global_step):
            stats.append(PredictedSlopes(self._slopes_key(global_step)))
        start = global_step - self.SAVE_SHIFT
        self._end_direction = None
        if self.is_end(global_step) and self.is_cached(start, "params"):
            reference = self.load_from_cache(start, "params")
            # the cockpit's params (the same list at every step) were saved at the start step
            direction = _Steps(self._tracked_params, reference)  # one parameter's step at a time
            self._end_direction = (global_step, direction)
            stats.append(DirectionalDots(self._dots_key(global_step), direction))
        return stats

    # ---- start step ----------------------------------------------------------
    def _compute_start(self, global_step, params, batch_loss):
        record = context.get_record(global_step)
        batch_size = record.require("batch_size", "Alpha")
        result = record.stat(PredictedSlopes(self._slopes_key(global_step)))
        # from which gradients; "inside": at the end of a backward pass inside the optimizer's step(closure)
        prediction = "waited" if record.at_optimizer_step else "inside" if record.inside_optimizer_step else "backward"
        if result.get("not_valid"):  # the look-ahead could not predict the update (it wrote the real parameters)
            record.note(f"Alpha of step {global_step} is not stored: {result['not_valid']}.")
            return
        if result["mode"] == "predicted":
            grad_sum, predicted, slopes = self._predicted_slopes(global_step, record, params, result, batch_size)
            if prediction == "backward" and record.rows_tolerance > tolerance_for(torch.float32):
                off = self._half_rows_off(global_step, record, params, predicted)
                if off is not None:  # known now, and why: the end step would find the update off the prediction
                    if off:
                        record.note(off)
                    self._waits = True
                    return
        else:
            retained = result["retained"]
            try:
                if any(gb is None for gb in retained):
                    missing = [i for i, gb in enumerate(retained) if gb is None]
                    raise RuntimeError(f"Alpha: no per-sample gradients were computed for parameters {missing}")
                grad_sum = [kept.batch_sum() for kept in retained]
                predicted = self._predict_update(global_step, record, params, grad_sum)
                if predicted is _NOT_VALID:  # noted: nothing is kept, the end step stores no value
                    return
                if predicted is None:  # no look-ahead: the update is assumed along the negative gradient
                    predicted, prediction = [-g for g in grad_sum], "guessed"
                slopes = self._slopes(retained, predicted, batch_size)
            finally:
                retained.clear()  # nothing per-sample survives this step
        f0, var_f0 = self._loss_moments(record)
        self._tracked_params = list(record.live_params or params)  # read again at the next step's begin
        keep = lambda step, t=global_step: step <= t  # noqa: E731
        self.save_to_cache(global_step, "params", parameter_snapshot(params), keep)  # shared with UpdateSize
        self.save_to_cache(global_step, "predicted_update", predicted, keep)
        self.save_to_cache(global_step, "grad_batch_sum", grad_sum, keep)
        mean_u, var_u = sample_mean_and_variance(slopes)
        self.save_to_cache(global_step, "observations", (f0, var_f0, mean_u, var_u), keep)
        self.save_to_cache(global_step, "prediction", prediction, keep)
        if prediction == "guessed":  # why (the end step's note says it)
            self.save_to_cache(global_step, "guessed_because", self._guessed_because, keep)
        # the declared optimizer's hyperparameters the prediction used (a schedule that sets them between the block
        # and optimizer.step() changes the update: outside trial 36 got the general list of causes)
        self.save_to_cache(global_step, "hyperparameters", _hyperparameters(record.info.get("optimizer")), keep)
        # the prediction is made from the rows' sum, which may be this far from p.grad (half precision: 5e-2)
        self.save_to_cache(global_step, "rows_tolerance", record.rows_tolerance, keep)
        # settled at the optimizer's step: the predicted update and the gradient sum are not kept through
        # the next forward and backward pass (GPT-style model, B = 16: 40% -> 21% of B x D x 4 added)
        self._watch_step(global_step, record.info.get("optimizer"))

    # ---- the optimizer's step --------------------------------------------------
    def _watch_step(self, start: int, optimizer) -> None:
        """Settle the start step's check right after ``optimizer.step()`` (:meth:`_settle`), so that the
        predicted update and the gradient sum are not kept through the next forward and backward pass."""
        self._unwatch()
        register = getattr(optimizer, "register_step_post_hook", None)
        if callable(register) and has_step_hooks(optimizer):
            token = object()
            self._step_token = token
            hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
            self._step_hook = register(lambda opt, *_: self._settle_once(start, token, hooks, opt))
            self._step_hook_start = start

    def _settle_once(self, start: int, token: object, hooks, optimizer=None) -> None:
        """The optimizer's post-hook: settle once, then remove the hook where that cannot disturb the optimizer,
        which is iterating over its post-hooks: where it is the last of them (removing an earlier one broke
        ``optimizer.step()``, "OrderedDict mutated during iteration": outside trial 10, two cockpits on one
        model); else at the next start (:meth:`_watch_step`) or :meth:`forget`, a no-op until then."""
        if getattr(self, "_step_token", None) is not token:
            return
        self._step_token = None
        self._settle(start, optimizer)
        handle = getattr(self, "_step_hook", None)
        if handle is not None and isinstance(hooks, dict) and hooks and next(reversed(hooks)) == handle.id:
            self._unwatch()

    def _unwatch(self) -> None:
        handle, self._step_hook = getattr(self, "_step_hook", None), None
        if handle is not None:
            handle.remove()

    def forget(self, global_step: int) -> None:
        super().forget(global_step)
        if getattr(self, "_step_hook_start", None) == global_step:  # no hook stays on the optimizer for it
            self._unwatch()

    def _settle(self, start: int, optimizer=None) -> None:
        """After the optimizer's step from ``start``: the actual update ``theta_{t+1} - theta_t`` is known.
        Keep what the end step reads of the predicted update and the gradient sum (the update's norm,
        whether its direction is the predicted one, else the exact start slope mean) and free both."""
        if not (self.is_cached(start, "predicted_update") and self.is_cached(start, "params")):
            return
        reference = self.load_from_cache(start, "params")
        with torch.no_grad():
            direction = _Steps(self._tracked_params, reference)
            tau = _norm(direction).item()
            same, mean_u0 = self._check(start, direction, tau) if tau > 0 else (True, None)
        # (the parameters' version counters: which of them an in-place change after the step touched)
        settled = {"tau": tau, "same": same, "mean_u0": mean_u0,
                   "versions": [getattr(p, "_version", None) for p in self._tracked_params]}
        if not same and self.is_cached(start, "hyperparameters"):
            settled["hyperparameters"] = _changed(self.load_from_cache(start, "hyperparameters"),
                                                  _hyperparameters(optimizer))
        if not same and self.load_from_cache(start, "prediction") == "backward":
            self._waits = True  # already for the next start step, which begins before this one's value is made
        entries = self._cache[start]
        keep = entries["predicted_update"][1]
        for key in ("predicted_update", "grad_batch_sum", "rows_tolerance", "hyperparameters"):
            entries.pop(key, None)
        self.save_to_cache(start, "settled", settled, keep)

    def _predict_update(self, global_step, record, params, grad_sum):
        optimizer = record.info.get("optimizer")
        # why the update is guessed where it is (the end step's note says it: outside trial 36, SparseAdam's
        # failed look-ahead was told as "no info['optimizer'], or a closure")
        self._guessed_because = "no info['optimizer'] was declared"
        if optimizer is None:
            self._tell_once(
                "no optimizer",
                f"Alpha: no info['optimizer'] at step {global_step}; assuming the update points "
                "along the negative gradient (exact for plain SGD; checked at the next step). Pass "
                "info['optimizer'] = optimizer to cockpit(step, info=...) to use your optimizer's update "
                "(told once; each step's notes say what it stored)",
            )
            return None
        if _needs_closure(optimizer):  # (outside trial 29: the look-ahead's TypeError was shown as it came)
            self._guessed_because = f"{type(optimizer).__name__}.step() needs a closure (it evaluates the loss again)"
            self._tell_once(
                ("closure", type(optimizer)),
                f"Alpha: {type(optimizer).__name__}.step() needs a closure (it evaluates the loss again), so Alpha "
                "cannot look ahead at its update; it assumes the update points along the negative gradient (at "
                "LBFGS's first step it does, at its later steps mostly not) and checks that at the next step, where "
                "Alpha is not stored if it does not (each step's notes say so; told once)",
            )
            return None
        try:  # the optimizer owns the cockpit's own tensors (params may be whole stand-ins of sharded ones)
            live = record.live_params or params
            return step_memo(
                ("lookahead", id(optimizer), tuple(id(p) for p in live)),
                lambda: [whole(d) for d in lookahead_update(optimizer, live, optimizer_gradients(live))],
            )
        except LookaheadNotValid as error:  # the run was left alone; the prediction would be wrong
            record.note(f"Alpha of step {global_step} is not stored: {error}.")
            return _NOT_VALID
        except Exception as error:  # noqa: BLE001 - e.g. LBFGS needs a closure
            self._guessed_because = (f"its look-ahead with {type(optimizer).__name__}.step() on copies failed "
                                     f"({type(error).__name__}: {str(error)[:200]})")
            self._tell_once(
                ("look-ahead", type(optimizer), type(error)),
                f"Alpha: could not look ahead with {type(optimizer).__name__}.step() at step "
                f"{global_step} ({type(error).__name__}: {error}); assuming the update points along "
                "the negative gradient (checked at the next step). Alpha needs an optimizer whose step() "
                "can run on a copy of the state (the torch.optim optimizers do); otherwise track Alpha with "
                "plain SGD only (told once)",
            )
            return None

    def _tell_once(self, key, message: str) -> None:
        """Warn ``message`` the first time ``key`` comes up for this quantity (a notebook cell of 20 steps showed 20
        copies: the step in the text defeats Python's own once-per-location filter)."""
        from cockpit_like.tracked_step import _user_stacklevel

        told = self.__dict__.setdefault("_told", set())
        if key in told:
            return
        told.add(key)
        warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())

    def _predicted_slopes(self, global_step, record, params, result, batch_size):
        """Slopes from the dots reduced during backward along the per-layer predicted update (element-wise
        optimizers). The prediction is checked against the actual update, after ``optimizer.step()``
        (:meth:`_settle`) or at the end step (:meth:`_check`), as in the retained mode: a second
        look-ahead of the whole model with ``p.grad`` here would only warn earlier."""
        missing = [i for i, d in enumerate(result["direction"]) if d is None]
        if missing:
            raise RuntimeError(f"Alpha: no per-sample gradients were computed for parameters {missing}")
        predicted, grad_sum, dots = result["direction"], result["grad_sum"], result["dots"]
        # a parameter without a gradient (p.grad None: an unused head) was predicted, during the backward pass, from
        # its zero rows; the optimizer skips it (no weight decay, no momentum): its update is zero. Its rows add
        # nothing to the dots, so only the norm changes
        skipped = gradless(record.live_params or params)
        if skipped:
            predicted = [torch.zeros_like(d) if i in skipped else d for i, d in enumerate(predicted)]
        norm = _norm(predicted)
        slopes = torch.zeros_like(dots) if norm == 0 else batch_size * dots / norm
        return grad_sum, predicted, slopes

    def _half_rows_off(self, global_step, record, params, predicted) -> str | None:
        """Per-sample rows in half precision (autocast): their sum may be 5e-2 away from ``p.grad`` (the gradient
        check allows it), and an optimizer whose update is not a multiple of the gradient can turn that into
        another direction (Adam's first steps follow the sign of each entry: rounding flips the small ones; outside
        trial 14, bf16 autocast with AdamW, 4 of 28 runs). The look-ahead on ``p.grad`` tells it at the start step:
        the note where the two directions differ by more than the end step allows ("" where the look-ahead itself
        wrote its note), None where they agree."""
        from_grad = self._predict_update(global_step, record, params, None)
        if from_grad is _NOT_VALID:
            return ""
        if from_grad is None:
            return None
        norm = _norm(from_grad)
        if norm == 0 or _norm(predicted) == 0:
            return None
        relative_size = _norm(record.live_params or params).item() / float(norm)
        if self._same_direction(from_grad, predicted, relative_size, rows_tolerance=record.rows_tolerance):
            return None
        ratio = float(norm / _norm(predicted))
        gap = float(_norm(tensor_lists.differences(from_grad, predicted, alpha=ratio)) / norm)
        name = type(record.info.get("optimizer")).__name__
        return (f"Alpha of step {global_step} is not stored: the per-sample rows came in half precision (autocast), "
                f"their sum within {record.rows_tolerance:g} of p.grad as the gradient check allows, and {name}'s "
                f"update, which is not a multiple of the gradient (Adam's first steps follow the sign of each entry), "
                f"points {gap:.2g} away (relative) from there when predicted from the rows: Alpha needs the "
                f"per-sample slopes along the update {name} makes from p.grad. From the next start step on, Alpha "
                f"waits for {name}.step() and predicts the update from the gradients it steps with (the step's "
                "per-sample rows are kept until then).")

    @staticmethod
    def _slopes(retained: list, direction: list[torch.Tensor], batch_size: int) -> torch.Tensor:
        """``u_i = B grad_batch_i^T d / ||d||`` (zeros for d = 0), from the retained per-sample gradients."""
        norm = _norm(direction)
        dots = sum(kept.dots(d) for kept, d in zip(retained, direction))
        if norm == 0:
            return torch.zeros_like(dots)
        return batch_size * dots / norm

    @staticmethod
    def _loss_moments(record) -> tuple[float, float]:
        loss = record.require("loss", "Alpha")
        losses = record.require("individual_losses", "Alpha")
        value = loss.item() if isinstance(loss, torch.Tensor) else float(loss)
        _, variance = sample_mean_and_variance(torch.as_tensor(losses))
        return value, variance

    # ---- end step ------------------------------------------------------------
    def _compute_end(self, global_step, params, batch_loss):
        start = global_step - self.SAVE_SHIFT
        if not self.is_cached(start, "params") or self._end_direction is None:
            return None
        _, direction = self._end_direction
        self._end_direction = None
        record = context.get_record(global_step)
        batch_size = record.require("batch_size", "Alpha")
        tau = _norm(direction).item()
        f0, var_f0, mean_u0, var_u0 = self.load_from_cache(start, "observations")
        f1, var_f1 = self._loss_moments(record)
        if tau == 0:  # no step (Cockpit divides by zero here): alpha = tau / x* - 1 is undefined, not a concave fit
            record.note(f"Alpha of step {start} is not stored: the parameters did not move from step {start} to "
                        f"{global_step} (the update's norm is 0: a learning rate of 0, as in a warm-up's first step, "
                        "or a step the loop skipped), and the step length relative to the loss's minimum along "
                        "the update is undefined for a step of length 0.")
            return None
        if not math.isfinite(tau):  # NaN or inf: no direction to compare, and nothing for the loop to change
            record.note(f"Alpha of step {start} is not stored: the update from step {start} to {global_step} is "
                        f"not finite (its norm is {tau}: the gradients of step {start} or the parameters at step "
                        f"{global_step} hold NaN or infinite entries, or are too large for their dtype).")
            return None
        without = self._moved_without_gradient(record, direction)
        if without:  # its slope at the end is unknown: counted as 0, Alpha would be wrong (outside trial 9)
            record.note(f"Alpha of step {start} is not stored: {len(without)} tracked parameter(s) (indices "
                        f"{without[:5]}{' ...' if len(without) > 5 else ''}) moved from step {start} to {global_step} "
                        f"but have no gradient at step {global_step} (requires_grad=False since then: a layer frozen "
                        "mid-run, or left out of this backward pass), so the slope of the loss along the update at "
                        f"step {global_step}, which Alpha fits, is not known. Later steps are tracked as usual.")
            return None
        dots = record.stat(DirectionalDots(self._dots_key(global_step)))
        mean_u1, var_u1 = sample_mean_and_variance(batch_size * dots / tau)
        if self.is_cached(start, "settled"):  # checked right after optimizer.step() (_settle)
            settled = self.load_from_cache(start, "settled")
            # another norm: the parameters changed after optimizer.step(), not the settled update (a change by
            # rounding alone, as a perturbation added and subtracted again by SAM after the step, is the same)
            same = settled["same"] and self._same_length(settled["tau"], tau, self.load_from_cache(start, "params"))
            exact, hyper = settled["mean_u0"], settled.get("hyperparameters")
            after = settled if settled["same"] and not same else None  # the optimizer's update was the predicted one
        else:
            (same, exact), after, hyper = self._check(start, direction, tau), None, None
        mean_u0 = mean_u0 if exact is None else exact
        if not same:  # the start slopes' variance was taken along another direction: no value (never a wrong one)
            unheld = self._unheld_moved(start, global_step, direction, record.info.get("optimizer"))
            if unheld is None and after is not None:
                unheld = self._changed_after_step(start, global_step, after, tau)
            if unheld is None and hyper:
                unheld = self._hyperparameters_changed(start, global_step, hyper)
            record.note(unheld or self._off_prediction(start, global_step))
            return None
        value = alpha_from_observations(tau, (f0, f1), (mean_u0, mean_u1), (var_f0, var_f1), (var_u0, var_u1))
        if value is not None and not math.isfinite(value):  # stored as Cockpit stores such steps, and said (trial 37)
            record.note(f"Alpha of step {start} is {value}: the loss or the per-sample slopes at step {global_step} "
                        "are not finite (the step's other notes say where they came from), so the fit along the "
                        f"update from step {start} is not either.")
        return value

    @staticmethod
    def _same_length(settled: float, tau: float, reference) -> bool:
        """Whether the update's norm at the end step is the one settled at the optimizer's step up to the
        rounding of ``theta`` (the allowance of :meth:`_same_direction`): ``p.add_(e)`` then ``p.sub_(e)`` between
        the steps leaves the parameters a rounding error away (outside trial 12: Alpha withdrawn, "not in the
        predicted direction")."""
        if settled == tau:
            return True
        eps = torch.finfo(reference[0].dtype).eps if len(reference) else 0.0
        return abs(settled - tau) <= eps * (1000 * tau + 20 * _norm(reference).item())

    @staticmethod
    def _moved_without_gradient(record, direction) -> list[int]:
        """Indices of the parameters the update moved that have no gradient at the end step (``requires_grad``
        off, or no ``.grad`` from this step's backward pass): the step's gradient holds zeros there."""
        live = getattr(record, "live_params", None)
        if live is None or len(live) != len(direction):
            return []
        return [i for i, (p, d) in enumerate(zip(live, direction))
                if (not p.requires_grad or p.grad is None) and bool((d != 0).any())]

    def _unheld_moved(self, start: int, end: int, direction, optimizer) -> str | None:
        """The note where tracked parameters that ``optimizer`` (``info["optimizer"]``) does not hold moved from
        ``start`` to ``end`` (another optimizer stepped them: its look-ahead cannot predict that), else None."""
        if not hasattr(optimizer, "param_groups"):
            return None
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        name = type(optimizer).__name__
        unheld = [i for i, p in enumerate(self._tracked_params) if id(p) not in held]
        moved = [i for i in unheld if bool((direction[i] != 0).any())]
        if not moved:
            return None
        return (f"Alpha of step {start} is not stored: {len(moved)} of the tracked parameters (indices {moved[:5]}"
                f"{' ...' if len(moved) > 5 else ''}) moved from step {start} to {end}, and info['optimizer'] ({name}) "
                "does not hold them: another optimizer (or the loop) stepped them, and the look-ahead predicts the "
                f"update of {name} alone. Where several optimizers step in one iteration, declare the one that steps "
                "last (Alpha is then withdrawn at the optimizer's step, with a note), or step all the parameters "
                "with one optimizer (param groups) to track Alpha.")

    def _hyperparameters_changed(self, start: int, end: int, changes: str) -> str:
        """The note where the update was not the predicted one and the declared optimizer's hyperparameters changed
        between the block of ``start`` (where the prediction read them) and its step."""
        self._waits = True  # from the next start on, the prediction is made at the optimizer's step
        return (f"Alpha of step {start} is not stored: info['optimizer']'s hyperparameters changed between the end of "
                f"the block of step {start}, where Alpha predicted the update with them, and optimizer.step() "
                f"({changes}), so the update from step {start} to {end} is not the predicted one. A learning-rate "
                "or weight-decay schedule applied before optimizer.step() does this: step schedulers after it (as "
                "PyTorch's own schedulers are used). From the next start step on, Alpha predicts the update when "
                "the optimizer steps, with the values it then has.")

    def _changed_after_step(self, start: int, end: int, settled: dict, tau: float) -> str:
        """The note where the optimizer's update from ``start`` was the predicted one (checked in its post-hook,
        :meth:`_settle`) but the parameters moved again before ``end`` (outside trial 34: a weight scaled after
        ``optimizer.step()`` got the general list of causes); names the parameters whose version counter moved."""
        versions = settled.get("versions") or []
        touched = [i for i, (p, v) in enumerate(zip(self._tracked_params, versions))
                   if v is not None and getattr(p, "_version", v) != v]  # fmt: skip
        which = "" if not touched else (
            f" (in place: all {len(touched)} tracked parameters)" if len(touched) == len(self._tracked_params) > 1
            else f" (in place: the tracked parameters of indices {touched[:5]}{' ...' if len(touched) > 5 else ''})")
        return (f"Alpha of step {start} is not stored: the optimizer's update from step {start} was the one its "
                f"look-ahead predicted (checked right after optimizer.step()), but the parameters changed after "
                f"optimizer.step() and before step {end}{which}: the update's norm was {settled['tau']:.6g} at the "
                f"optimizer's step and is {tau:.6g} at step {end}. A projection or clamp of the weights after the step "
                "(max-norm, weight clipping), a rollback or load_state_dict, averaged weights copied into the model, "
                "or a second optimizer stepping after info['optimizer'] does this; Alpha fits the loss along one "
                "update, which such a change leaves unknown. Steps where the loop leaves the parameters as the "
                "optimizer made them are stored as usual. UpdateSize and Distance measure the parameters as they "
                f"are at each step, so UpdateSize of step {start} holds this change too.")

    def _off_prediction(self, start: int, end: int) -> str:
        """What the note says where the update from ``start`` was not in the predicted direction; the next start
        steps wait for the optimizer's step where that can help."""
        prediction = self.load_from_cache(start, "prediction") if self.is_cached(start, "prediction") else "backward"
        why = (f"Alpha of step {start} is not stored: the update from step {start} to {end} is not in the direction "
               "the optimizer's look-ahead predicted for the step's per-sample slopes, whose variance Alpha needs")
        if prediction == "guessed":
            because = self.load_from_cache(start, "guessed_because") if self.is_cached(start, "guessed_because") else None
            because = because or "no info['optimizer'], or an optimizer whose step() needs a closure"
            return (f"Alpha of step {start} is not stored: the update from step {start} to {end} is not along the "
                    f"negative gradient, which Alpha assumed as it could not look ahead with the optimizer ({because}). Alpha "
                    "predicts the update by running info['optimizer'].step() on copies of the parameters and its "
                    "state with the step's gradients: it needs an optimizer that can do so (the torch.optim "
                    "optimizers but LBFGS, which needs a closure, and SparseAdam, which takes sparse gradients only) "
                    "declared as info['optimizer']; with plain SGD the guess is exact.")
        if prediction == "inside":  # waiting cannot help: the backward pass runs inside the optimizer's step
            return (f"{why} from the gradients at the end of the backward pass. The gradients changed before the "
                    "optimizer's update (clipping, as Lightning's gradient_clip_val, or a loss factor, with an "
                    "optimizer whose update is not just a multiple of the gradient: momentum, weight decay, Adam), or "
                    "the parameters changed outside optimizer.step(). The cockpit's block runs inside "
                    "optimizer.step(closure) here (Lightning's automatic optimization does so), where Alpha cannot "
                    "wait for the optimizer's update: while the gradients change before it, Alpha is not stored. "
                    "Without the clipping (or with an optimizer that steps along the gradient, plain SGD), or in a "
                    "loop that calls optimizer.step() after the block, it is.")
        if prediction == "waited":
            return (f"{why}, although the look-ahead ran at the optimizer's step on the gradients it got: the "
                    "parameters changed outside optimizer.step() (a projection, a rollback, load_state_dict), or "
                    "info['optimizer'] is not the optimizer that made the update.")
        self._waits = True
        return (f"{why} from the gradients at the end of the backward pass. The gradients changed before the "
                "optimizer's step (clipping or a loss factor with an optimizer whose update is not just a multiple "
                "of the gradient: momentum, weight decay, Adam), or the parameters changed outside "
                "optimizer.step(), or info['optimizer'] is not the optimizer that made the update. From the next "
                "start step on, Alpha predicts the update when info['optimizer'] steps, from the gradients it gets "
                "(the step's per-sample rows are kept until then), where the loop lets it: one cockpit block per "
                "step outside optimizer.step(closure), in one process.")

    def _check(self, start: int, direction, tau: float) -> tuple[bool, float | None]:
        """Whether the update from ``start`` (``direction``, of norm ``tau > 0``) has the predicted direction;
        if not, also the exact start slope mean ``gbar^T d / tau`` (from the kept gradient sum)."""
        predicted = self.load_from_cache(start, "predicted_update")
        reference = self.load_from_cache(start, "params")
        rows = self.load_from_cache(start, "rows_tolerance") if self.is_cached(start, "rows_tolerance") else 0.0
        if self._same_direction(direction, predicted, _norm(reference).item() / tau, norm_actual=tau, rows_tolerance=rows):
            return True, None
        grad_sum = self.load_from_cache(start, "grad_batch_sum")
        return False, (_dot(grad_sum, direction) / tau).item()

    @staticmethod
    def _same_direction(actual, predicted: list[torch.Tensor], relative_size: float, norm_actual: float | None = None,
                        rows_tolerance: float = 0.0) -> bool:
        """Whether the unit vectors agree up to rounding.

        ``theta_{t+1} - theta_t`` carries a rounding error of about ``eps ||theta||``,
        i.e. ``eps * relative_size`` (``relative_size = ||theta_t|| / tau``) relative to
        the step, so a tiny step next to large parameters gets a wider tolerance. The
        prediction is made from the per-sample rows' sum, which may differ from ``p.grad``
        as much as the gradient self-check allows (:func:`~cockpit_like.checks.invariants.tolerance_for`:
        a model that computes inside in float32, autocast; ``rows_tolerance``: what the check allowed at the start
        step, 5e-2 where its rows came in half precision): directions within that agree.
        """
        norm_actual = _norm(actual) if norm_actual is None else norm_actual  # ||actual||, if known
        norm_predicted = _norm(predicted)
        if norm_predicted == 0:
            return False
        eps = torch.finfo(actual[0].dtype).eps
        # || a / |a| - p / |p| || = || a - (|a| / |p|) p || / |a|: temporaries a group of parameters at a time
        ratio = float(norm_actual / norm_predicted)
        gap = _norm(tensor_lists.differences(actual, predicted, alpha=ratio)) / norm_actual
        return bool(gap <= max(eps * (1000 + 20 * relative_size), tolerance_for(actual[0].dtype), rows_tolerance))


def _needs_closure(optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``closure`` argument without a default (``torch.optim.LBFGS``)."""
    import inspect

    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: the look-ahead will tell
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty
