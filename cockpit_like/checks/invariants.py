"""The invariants of a tracked step and the ``checks`` record stored with it.

``Cockpit.checks[step]`` of every tracked step; in ``get_output()[step]["checks"]``
and the stream when they say something beyond "valid as declared" (:func:`notable`)::

    {"valid": True,                 # False: the step failed a check (see "failed")
     "failed": [],                  # [{"check": "gradient", "reason": "...", ...}]
     "backward_passes": 1,          # backward passes merged into the optimizer step (all of them)
     "declared_passes": 1,          # info["micro_batches"] x info["backward_passes"] (1: not declared)
     "loss_factor": 1.0,            # d(backpropagated root) / d info["loss"], seen by a hook (None: not seen)
     "assumed_factor": 1.0,         # what the declarations (grad_scaler, micro_batches, loss_scale) said
     "gradient": {"layers": 4, "worst": 3e-8, "tolerance": 2.4e-4},
     "no_gradient": [],             # tracked parameters that got no gradient at this step (zero rows)
     "frozen": [],                  # tracked parameters with requires_grad=False
     "notes": []}                   # what was left out and why (e.g. BatchNorm in training mode)

May import torch, :mod:`cockpit_like.checks.probe`, :mod:`cockpit_like.checks.prints` and
:mod:`cockpit_like.checks.graphs`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

from cockpit_like.checks.graphs import class_weights_mismatch, smoothing_mismatch, weighs_rows
from cockpit_like.checks.prints import NonFinitePrint
from cockpit_like.checks.probe import project_all

__all__ = ["CHECKS_KEY", "StepChecks", "check_losses_mean", "tolerance_for", "notable"]

#: the output key of a tracked step's self-checks
CHECKS_KEY = "checks"


def tolerance_for(dtype: torch.dtype) -> float:
    """Relative tolerance of the gradient check for gradients in ``dtype``, relative to the sum of the rows'
    absolute projections: float64 1e-6 (models that compute inside in float32 even with float64 parameters,
    Mamba's scan, Llama's norms: their batch gradient and mean row gradient differ by ~1e-7); float32 5e-3 (under autocast, products made in half precision
    accumulate into float32 gradients: 2.4e-4 was reached on an fp16 MLP); float16 and bfloat16 0.05. A
    wrong decomposition (a missed loss term, a wrong factor) is off by tens of percent."""
    if dtype == torch.float64:
        return 1e-6
    if dtype in (torch.float16, torch.bfloat16):
        return 0.05
    return 5e-3


def _norms(tensors: list[torch.Tensor]) -> list[float]:
    """Frobenius norms of ``tensors`` as Python floats, read from the device at once (a sparse tensor's values)."""
    if not tensors:
        return []
    norms = []
    for tensor in tensors:  # in the gradient's own dtype (no float64 copy of it), half precision widened
        values = tensor.detach()
        values = values.coalesce().values() if values.is_sparse else values
        values = values.float() if values.dtype in (torch.float16, torch.bfloat16) else values
        norms.append(torch.linalg.vector_norm(values).to(torch.float64))
    return torch.stack([n.to(norms[0].device) for n in norms]).tolist()


def check_losses_mean(info: dict, step: int) -> None:
    """``info["loss"]`` must be the mean of ``info["individual_losses"]`` (the documented form), else a clear error.

    Both describe this backward pass's rows. A loss averaged over every token of a padded batch is not
    the mean of each row's own token mean; a loss with an extra term (weight decay, an auxiliary loss)
    is not the mean of the rows' losses without it.
    """
    loss, losses = info.get("loss"), info.get("individual_losses")
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1 or losses.numel() == 0:
        return
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            return
        dtype = loss.dtype
        loss_value = float(loss.detach().reshape(-1)[0])
    elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
        dtype, loss_value = losses.dtype, float(loss)
    else:
        return
    detached = losses.detach()
    mean = float(detached.to(torch.float64).mean())
    if math.isfinite(loss_value) and not math.isfinite(mean):
        bad = torch.nonzero(~torch.isfinite(detached.to(torch.float64))).reshape(-1).tolist()
        shown = ", ".join(str(row) for row in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(
            f"cockpit step {step}: info['loss'] is {loss_value:.8g} but info['individual_losses'] is not finite at "
            f"row(s) {shown} of {detached.numel()}. The cockpit's per-sample quantities need loss = "
            "mean(individual_losses) over this backward pass's rows, each row finite. Common cause: a row whose loss "
            "divides by its number of counted tokens when it has none (0/0, all padding) while the loss skips it "
            "(nanmean): give each row its token sum times B / N, N the counted tokens of the whole batch (0 for a row "
            "without any; docs/your_model.md, 'Padding or ignored tokens'), or drop the row from the batch."
        )
    if not (math.isfinite(mean) and math.isfinite(loss_value)):
        return  # the non-finite loss is handled (and recorded) elsewhere
    wide = detached.dtype if detached.dtype.is_floating_point else torch.float32
    eps = max(torch.finfo(wide).eps, torch.finfo(dtype).eps if dtype.is_floating_point else 0.0)
    scale = float(detached.to(torch.float64).abs().mean()) + abs(loss_value)
    if abs(mean - loss_value) <= 64 * eps * scale + 1e-300:
        return
    rounding = _rounding_level(abs(mean - loss_value) / max(abs(mean), abs(loss_value)), eps)
    if rounding is not None:
        lower = (
            f"A difference at {rounding} rounding level can mean that they agree but one of them went through lower "
            "precision: a factor or term computed in a lower precision than the losses (an integer tensor in a "
            "division: `B / counted` with `counted = (labels != -100).sum()` is float32 even for float64 losses; "
            "compute it in the losses' dtype, `counted.to(per_token.dtype)`: docs/your_model.md, 'Padding or "
            "ignored tokens'), or the per-row losses computed from other logits (a float32 copy, autocast) than "
            "the loss. Compute both from the same tensors in the same dtype."
        )
        # (outside trial 38: float32 losses of a padded batch, each row its own token mean, 7.3e-4 apart, were told
        # a half-precision rounding or an extra term only. The half-precision level is named only where neither
        # tensor is in half precision, so it needs an intermediate step in half precision: the causes come first)
        unlikely = rounding.startswith("half")
        raise ValueError(
            f"cockpit step {step}: info['loss'] is {loss_value:.17g} but the mean of info['individual_losses'] is "
            f"{mean:.17g} (relative difference {abs(mean - loss_value) / max(abs(mean), abs(loss_value)):.2g}, "
            f"beyond the {_dtype_name(dtype)} / {_dtype_name(detached.dtype)} rounding this check allows). The "
            "cockpit's per-sample quantities need loss = mean(individual_losses) over this backward pass's rows. "
            + (f"Neither is in half precision, so a real difference is likelier. Common causes: {_MEAN_CAUSES} "
               f"Else: {lower}" if unlikely else f"{lower} (Otherwise: a small extra term in the loss that the rows lack, "
               "such as an auxiliary loss or a penalty.)")
        )
    named = _graph_hint(loss, losses)
    raise ValueError(
        f"cockpit step {step}: info['loss'] is {loss_value:.8g} but the mean of info['individual_losses'] is "
        f"{mean:.8g}. The cockpit's per-sample quantities need loss = mean(individual_losses) over this "
        f"backward pass's rows.{_scaled_loss_hint(loss_value, mean, detached.numel())}{named} "
        f"{'Other causes' if named else 'Common causes'}: {_MEAN_CAUSES}"
    )


def _graph_hint(loss, losses) -> str:
    """Where the graph of ``info["loss"]`` weighs the rows, or the graphs of ``info["loss"]`` and the rows hold
    torch's cross-entropy with and without class weights or with different label smoothing: that cause, first
    (outside trials 34 and 43: they were named only in the list of causes)."""
    if not isinstance(loss, torch.Tensor):
        return ""
    if loss.grad_fn is not None and weighs_rows([loss.grad_fn], losses):
        return (
            " info['loss'] multiplies (or divides) the rows of info['individual_losses'] by a tensor without "
            "gradient in its graph: row weights or a mask. Pass the weighted rows, rows * w (times B / w.sum() for "
            "a weighted mean), as info['individual_losses']."
        )
    weights = class_weights_mismatch(loss, losses)
    if weights is not None:
        where = "info['loss'] and not info['individual_losses']" if weights[0] else (
            "info['individual_losses'] and not info['loss']")
        return (
            f" Their graphs hold torch's cross-entropy with class weights (weight=) in {where}. The rows of a "
            "weighted mean are rows = F.cross_entropy(out, y, weight=W, reduction='none') * B / W[y].sum(), and "
            "info['loss'] the weighted mean."
        )
    mismatch = smoothing_mismatch(loss, losses)
    if mismatch is None:
        return ""
    in_loss, in_rows = mismatch
    return (
        f" Their graphs hold torch's cross-entropy with different label smoothing: label_smoothing={in_loss:g} in "
        f"info['loss'], {in_rows:g} in info['individual_losses']. Compute the rows with the loss's own options, "
        f"F.cross_entropy(out, y, label_smoothing={in_loss:g}, reduction='none')."
    )


#: why ``info["loss"]`` is not the mean of ``info["individual_losses"]``, the most common first (both errors above)
_MEAN_CAUSES = (
    "a loss averaged over all tokens of a padded batch while each row's "
    "loss is its own token mean (give each row its token sum divided by the batch's mean number of tokens, "
    "or average the loss over rows); the loss and the rows computed with different options (label_smoothing, "
    "weight=, ignore_index, a temperature: compute the rows with the loss's own function and options, "
    "reduction='none', e.g. F.cross_entropy(out, y, label_smoothing=0.1, reduction='none')); "
    "a loss with an extra term: a per-row auxiliary loss (add each row's "
    "term to that row's loss), a penalty on the parameters such as weight decay (use the optimizer's "
    "weight_decay instead: a term on the parameters has no rows, and added to every row's loss it fails the "
    "gradient check), a loss over the whole batch (it has no per-row form: leave the per-sample quantities "
    "out); a sum-reduced loss (use reduction='mean', or divide by the batch size); a weighted mean, such as "
    "cross_entropy(weight=W), ignore_index or a loss over the labelled rows only, which divides by the weights' "
    "or counted rows' sum where the rows' mean divides by B (rows = F.cross_entropy(out, y, weight=W, "
    "reduction='none') * B / W[y].sum(), an unlabelled row's loss 0); losses of another batch than the loss."
)


def _rounding_level(relative: float, eps: float) -> str | None:
    """``"float32"`` or ``"half-precision"`` where a relative difference that the check at precision ``eps``
    refuses is what one rounding of a lower precision makes (a few units in its last place), else ``None``."""
    for name, lower, units in (("float32", torch.finfo(torch.float32).eps, 16),
                               ("half-precision (float16)", torch.finfo(torch.float16).eps, 1)):  # fmt: skip
        if lower > eps and relative <= units * lower:
            return name
    return None


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _scaled_loss_hint(loss_value: float, mean: float, rows: int = 0) -> str:
    """Where ``info["loss"]`` is a round multiple (``S``, ``K``) or fraction (``1/K``) of the rows' mean: what
    that usually means (the scaled or divided tensor passed instead of the loss; ``rows`` times it: a sum over
    the rows)."""
    if mean == 0.0 or loss_value == 0.0:
        return ""
    ratio = loss_value / mean
    if rows >= 2 and abs(ratio - rows) <= 1e-6 * rows:
        # (outside trial 39: an extended CrossEntropyLoss(reduction='sum') was told first to pass the mean as
        # info['loss'], "the cockpit sees that factor on its own"; it cannot inside a BackPACK-extended loss module,
        # and every step then failed the backpropagated-loss check)
        return (
            f" info['loss'] is {rows} x that mean, the number of rows: a sum over the rows (reduction='sum'). Use "
            "reduction='mean' (with a loss module extended by BackPACK the one fix: its extensions expect the mean, "
            "and the cockpit cannot see a factor inside the module), or backpropagate the mean and pass it as "
            "info['loss']."
        )
    for factor, shown in ((ratio, f"{round(ratio):d}"), (1.0 / ratio, f"1/{round(1.0 / ratio):d}")):
        # (round(factor), not factor, at least 2: a float32 loss / 2 against the rows' float64 mean is 1.99999992)
        if round(factor) >= 2 and abs(factor - round(factor)) <= 1e-6 * factor:
            return (
                f" info['loss'] is {shown} x that mean: pass as info['loss'] the mean loss itself, not the tensor "
                "you call backward() on after scaling or dividing it (scaler.scale(loss), loss / K); the cockpit "
                "sees that factor on its own (docs/your_training_loop.md, 'The loss factor')."
            )
    return ""


def _has_gradient_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` carries hooks of its own on its gradient (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    return bool(getattr(param, "_backward_hooks", None)) or bool(getattr(param, "_post_accumulate_grad_hooks", None))


def notable(record: dict[str, Any]) -> bool:
    """Whether a step's checks say anything beyond "valid as declared" (then they are streamed and shown)."""
    if not record.get("valid", True) or record.get("notes") or record.get("frozen") or record.get("no_gradient"):
        return True
    if record.get("standard_errors"):  # estimated values: their error bars go into the log beside them
        return True
    factor, assumed = record.get("loss_factor"), record.get("assumed_factor", 1.0)
    if isinstance(factor, list) or (factor is not None and abs(factor - assumed) > 1e-9 * max(abs(assumed), 1e-300)):
        return True
    return record.get("backward_passes", 1) != record.get("declared_passes", 1)


class StepChecks:
    """The self-checks of one tracked optimizer step, gathered over its backward passes."""

    def __init__(self, step: int):
        self.step = step
        self.failed: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.factors: list[float | None] = []
        #: backward passes beyond one per block, seen where a block ran several that were not merged
        #: (the ``backward_passes`` check): counted in the record's ``backward_passes``
        self.extra_passes: int = 0
        #: backward passes beyond one per block that the rows summed (declared with ``info["backward_passes"]`` or
        #: learned): counted in ``backward_passes`` (before, merged steps said 1)
        self.merged_passes: int = 0
        #: ``info["backward_passes"]`` as declared (1: none): with ``declared``, the record's ``declared_passes``
        self.declared_in_block: int = 1
        self.assumed: float = 1.0
        #: ``info["micro_batches"]`` as declared (1: none)
        self.declared: int = 1
        self.gradient: dict[str, Any] | None = None
        self.no_gradient: list[str] = []
        self.frozen: list[str] = []
        #: ``{index: projection}`` of the gradients p.grad held before the step's first backward pass (a
        #: :class:`~cockpit_like.checks.prints.NonFinitePrint` for one with NaN or infinite entries)
        self.stale: dict[int, float | NonFinitePrint] = {}
        #: indices of the parameters whose gradient the probe saw non-finite (the step's note counts their entries)
        self.nonfinite_gradients: list[int] = []
        #: ``{quantity: {"standard_error", "estimator", "samples", "reliable"}}`` of the step's estimated values
        self.standard_errors: dict[str, dict[str, Any]] = {}
        #: ``info["loss"]``, a tensor with its graph, got no gradient from the step's backward pass
        self.loss_unreached = False

    @property
    def valid(self) -> bool:
        return not self.failed

    def fail(self, check: str, reason: str, **details: Any) -> None:
        self.failed.append({"check": check, "reason": reason, **details})

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # ---- the gradient check --------------------------------------------------------------
    def compare_probe(
        self,
        probe: dict[int, tuple[float, float]],
        seed: int,
        params: list[torch.Tensor],
        grad_of: Callable[[torch.Tensor], torch.Tensor | None],
        name_of: Callable[[int], str],
        stale_scale: float = 1.0,
    ) -> None:
        """Compare each layer's projected sum of per-sample rows with the projected step gradient (less what p.grad
        held before the step, :attr:`stale`, divided by ``stale_scale``, the factor of the gradients' view)."""
        worst, worst_at, tolerance_seen, offenders, unverified = 0.0, None, 0.0, [], []
        # a layer whose gradient cancels to rounding noise (a key bias under softmax: 1e-23 where the others are
        # 1e-1) is compared at a thousandth of the largest layer's scale, not at its own noise
        entries = list(probe.items())  # the probe's result holds floats (read from the device once)
        pairs = [float(value) for _, (total, absolute, *_) in entries for value in (total, absolute)]
        floor = 1e-3 * max((max(abs(pairs[2 * k]), pairs[2 * k + 1]) for k in range(len(entries))), default=0.0)
        grads = [grad_of(params[index]) for index, _ in entries]
        projected = project_all(seed, [(index, grad) for (index, _), grad in zip(entries, grads) if grad is not None])
        projected.reverse()
        # the typical size of a projection of the layer's gradient, ||G||_F (E[(u^T G v)^2] = ||G||_F^2 for the
        # Gaussian directions): one projection can be near 0 by chance, and then rounding alone would exceed a
        # tolerance relative to it (seen under bf16 autocast on LayerNorm, attention and convolution layers)
        sizes = _norms([grad for grad in grads if grad is not None])
        sizes.reverse()
        # rows made in half precision at one layer: the step ran under autocast (or with half parameters), and
        # every layer's gradient came from half-precision products, whatever dtype its rows reached the probe in
        # (a first layer's float32 input, a convolution's rows widened before the reducer)
        half_step = any(low and low[0] for _, (_, _, *low) in entries)
        for k, (index, (total, absolute, *low)) in enumerate(entries):
            half_sum = len(low) > 1 and low[1]
            low = bool(low and low[0])
            param, grad = params[index], grads[k]
            expected = 0.0 if grad is None else projected.pop()
            size = 0.0 if grad is None else sizes.pop()
            stale = self.stale.get(index, 0.0)
            expected -= (math.nan if isinstance(stale, NonFinitePrint) else stale) / stale_scale
            got, spread = pairs[2 * k], pairs[2 * k + 1]
            dtype = param.dtype if grad is None else grad.dtype
            tolerance = tolerance_for(torch.float16 if low or half_step else dtype)  # half precision: looser
            tolerance_seen = max(tolerance_seen, tolerance)
            scale = max(spread, abs(got), abs(expected), floor, size)
            if half_sum and grad is not None and grad.dtype in (torch.float16, torch.bfloat16):
                # a half-precision p.grad that autograd summed from the terms of every position of every row (a norm
                # layer's weight and bias, module_rules.sums_positions_in_half) is no reference: its
                # rounding was measured up to 38 units of the terms' absolute sums off on a ViT's LayerNorm, 22-73%
                # of the gradient on a ConvNeXt's (outside trials 14 and 17), and grows with the positions. It is
                # not compared (named in the record); the other layers are (a loop's error shows there)
                unverified.append(index)
                continue
            if not (math.isfinite(got) and math.isfinite(expected)):
                error = math.inf if math.isfinite(got) != math.isfinite(expected) or got != expected else 0.0
                if not math.isfinite(expected):
                    self.nonfinite_gradients.append(index)
                if not math.isfinite(got) and not math.isfinite(expected):
                    continue  # a non-finite gradient: the non-finite handling speaks for it (a note of the step)
            else:
                error = 0.0 if scale == 0.0 else abs(got - expected) / scale
            if error > worst:
                worst, worst_at = error, index
            if error > tolerance:
                offenders.append((index, got, expected, error))
        self.gradient = {"layers": len(probe), "worst": worst, "tolerance": tolerance_seen}
        if worst_at is not None:
            self.gradient["worst_at"] = name_of(worst_at)
        if unverified:  # (half-precision sums of many terms: see above)
            self.gradient["unverified"] = [name_of(i) for i in unverified]
        if offenders:
            shown = ", ".join(f"{name_of(i)} (rows {got:.6g}, gradient {want:.6g})" for i, got, want, _ in offenders[:3])
            more = f" and {len(offenders) - 3} more" if len(offenders) > 3 else ""
            half = (
                "The rows were made in half precision (autocast or half-precision parameters): where a layer's gradient is a small sum of large "
                "terms, rounding alone can put the two further apart than the tolerance (5e-2) while nothing is "
                "wrong with the loop; such a step stores no per-sample numbers. Otherwise: "
            ) if half_step else ""
            rowless = [name_of(i) for i, got, want, _ in offenders if got == 0.0 and want != 0.0]
            elsewhere = (
                "No parameter got per-sample rows, and info['loss'] got no gradient: the backward pass did not go "
                "through the forward call that info['loss'] and info['individual_losses'] came from (a second "
                "forward pass of the batch, such as a model's own .loss from another call, backpropagated). "
                "Compute the losses you declare and the one you backpropagate from one forward pass. Otherwise: "
            ) if self.loss_unreached and rowless and len(rowless) == len(probe) else ""
            legacy = [name for name in rowless if name.rsplit(".", 1)[-1] in ("weight_g", "weight_v", "weight_orig")]
            originals = [name for name in rowless if re.search(r"(^|\.)parametrizations\.[^.]+\.original\d*$", name)]
            unseen = ((
                f"{', '.join(legacy[:3])} {'is' if len(legacy) == 1 else 'are'} the parameters of the legacy "
                "torch.nn.utils.weight_norm or spectral_norm, which compute the weight in a forward pre-hook that the "
                "cockpit's re-runs of the layer do not run: use torch.nn.utils.parametrizations.weight_norm or "
                "spectral_norm (the cockpit re-runs parametrized layers). Otherwise: "
            ) if legacy else "") + ((
                f"{', '.join(originals[:3])} {'is' if len(originals) == 1 else 'are'} the original tensor of a "
                "torch.nn.utils.parametrize parametrization that got no rows: under parametrize.cached() the "
                "parametrized weight is computed once, before the layer's calls, and the cockpit cannot split it by "
                "rows (outside trial 32); run the tracked steps' forward pass outside cached(). Otherwise: "
            ) if originals else "") + (
                f"{', '.join(rowless[:3])}{' ...' if len(rowless) > 3 else ''} got no per-sample rows at all while "
                f"autograd gave {'it' if len(rowless) == 1 else 'them'} a gradient: most likely read outside any module call of the model (a learnable "
                "loss weight or temperature used only in the loss, a parameter used in the training loop), which "
                "the cockpit does not see: compute it inside a module of the model, or leave it out of "
                "Cockpit(params) (docs/your_model.md#limits). Otherwise: "
            ) if rowless else ""
            hooked = [name_of(i) for i, *_ in offenders if _has_gradient_hooks(params[i])]
            hooks = (
                f"{', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''} "
                f"{'carries' if len(hooked) == 1 else 'carry'} gradient hooks (p.register_hook, "
                "p.register_post_accumulate_grad_hook): one that scales or clips the gradient changes p.grad after "
                "the per-sample rows were taken (outside trial 10: rows -0.2796, gradient -0.1398 under a hook "
                "halving it). Scale or clip the gradients after the cockpit's block instead (p.grad.mul_(...), "
                "torch.nn.utils.clip_grad_value_ after `with cockpit(...)`). Otherwise: "
            ) if hooked else ""
            ratios = [want / got for _, got, want, _ in offenders if got != 0.0 and math.isfinite(want / got)]
            uniform = (
                f"The gradient is the rows' sum times one factor, {ratios[0]:.6g}, in every one of these parameters: "
                "the gradients were scaled in place before the step ended (torch.nn.utils.clip_grad_norm_, "
                "GradScaler.unscale_ or p.grad.mul_ inside `with cockpit(...)`, outside trial 34). Clip or unscale "
                "after the cockpit's block: the cockpit then sees the factor at the optimizer's step and says so. "
                "Otherwise: "
            ) if (len(ratios) == len(offenders) >= 2 and ratios[0] != 1.0
                  and max(abs(r - ratios[0]) for r in ratios) <= 10 * max(tolerance_seen, 1e-9) * abs(ratios[0])) else ""
            self.fail(
                "gradient",
                f"the per-sample gradients do not average to the gradient autograd accumulated for step {self.step} "
                f"in {len(offenders)} of {len(probe)} parameters: {shown}{more} (projections on a random direction). "
                + elsewhere + half + hooks + uniform + unseen + "Something reached the gradient that the per-sample hooks did not see: a second backward pass "
                "inside the step (two losses, retain_graph), a gradient penalty or other second-order term, a "
                "penalty on the parameters in the loss (weight decay: use the optimizer's weight_decay), a "
                "backward pass outside the cockpit's block, gradients left from an earlier step (a forgotten "
                "optimizer.zero_grad()), gradients changed in place before the step ended, a module's output changed "
                "in place after its call (h += y, h.mul_(...): compute out of place, h = h + y), a layer that mixes rows, or "
                "a parameter transformed before the layer uses it (torch.func.functional_call(model, {name: p * mask}), "
                "a weight computed by hand in the training loop: the layer's rows are the transformed tensor's, not "
                "the parameter's; use torch.nn.utils.parametrize or prune, whose parametrized layers the cockpit "
                "re-runs). Enter the cockpit around every backward pass of the step, or leave the "
                "per-sample quantities out for such steps (docs/your_training_loop.md#self-checks).",
                parameters=[name_of(i) for i, *_ in offenders],
            )

    # ---- the record ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        seen = [f for f in self.factors if f is not None]
        factor = None
        if seen and len(seen) == len(self.factors):
            factor = seen[0] if all(f == seen[0] for f in seen) else [float(f) for f in seen]
        record: dict[str, Any] = {
            "valid": self.valid,
            "failed": [dict(f) for f in self.failed],
            "backward_passes": len(self.factors) + self.extra_passes + self.merged_passes,
            "declared_passes": self.declared * self.declared_in_block,
            "loss_factor": factor,
            "assumed_factor": self.assumed,
            "no_gradient": list(self.no_gradient),
            "frozen": list(self.frozen),
            "notes": list(self.notes),
        }
        if self.gradient is not None:
            record["gradient"] = dict(self.gradient)
        if self.standard_errors:
            record["standard_errors"] = {name: dict(entry) for name, entry in self.standard_errors.items()}
        return record
