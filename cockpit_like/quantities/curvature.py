"""Curvature diagonals: Hessian trace and the Takeuchi information criterion.

All three quantities read a diagonal ``c`` of the curvature of the
**mean** loss ``L = (1/B) sum_i l_i``, chosen by ``curvature``. From BackPACK
(the model and the loss extended, built of supported layers in
``nn.Sequential`` containers):

- ``"diag_h"``: :class:`backpack.extensions.DiagHessian`, the exact
  ``diag(∇²L)`` (may have negative entries; used as they are);
- ``"diag_ggn_exact"``: :class:`backpack.extensions.DiagGGNExact`, the
  diagonal of the generalized Gauss-Newton ``(1/B) sum_i J_i^T ∇²_f l_i J_i``;
- ``"diag_ggn_mc"``: :class:`backpack.extensions.DiagGGNMC` with one sample,
  the same with ``∇²_f l_i`` replaced by a Monte-Carlo estimate (random: it
  draws in BackPACK's hook, from torch's generator seeded by the cockpit per
  step and restored after: :mod:`cockpit_like.backends.randomness`).

On any model (no BackPACK needed):

- ``"hutchinson"``: Hutchinson's estimate ``(1/m) sum_k v_k * (H v_k)`` of
  ``diag(∇²L)`` from ``m = hutchinson_samples`` Hessian-vector products with
  Rademacher vectors (unbiased, random: the cockpit's generator; noisy per entry, of
  the size of the entry's whole row of the Hessian, while traces average the noise
  out: ``TICDiag``, which divides entry by entry, refuses it and ``"hutch++"`` when
  constructed, with the alternatives);
  needs ``loss.backward(create_graph=cockpit.create_graph(step))``, and the
  quantities of one step share one estimate
  (:class:`~cockpit_like.backends.hvp.HutchinsonDiagonal`);
- ``"diag_ggn_mc"`` on a model BackPACK cannot handle: the same one-sample
  Monte-Carlo GGN diagonal from labels sampled from the model's predictions
  (:class:`~cockpit_like.backends.sampled.SampledGGNDiagonal`), by a second
  backward pass through the step's graph; needs ``info["outputs"]`` (the
  logits of the mean cross-entropy loss, classes last) and
  ``create_graph=cockpit.create_graph(step)``; logged as
  ``computed_with: "sampled_ggn_mc"``;
- ``"hutch++"``: the diagonal exact on the step's Lanczos space (the engine's
  decomposition that HessMaxEV reads, shared with it) plus Hutchinson's
  estimate on the rest from ``hutchinson_samples`` more products
  (:class:`~cockpit_like.backends.curvature_engine.DeflatedDiagonal`):
  unbiased like ``"hutchinson"``, with the variance of the Hessian less its
  dominant directions: on 12 models it lowered the median error of the
  trace from 70% to 52% of the value (``benchmarks/trace_estimators.py``,
  docs/curvature.md). Asked for explicitly it computes the decomposition
  where no other quantity does; ``"auto"`` uses it only where one does;
- ``"ggn"``: the GGN diagonal of the mean cross-entropy of ``info["outputs"]``
  (the logits, classes last) on any model
  (:class:`~cockpit_like.backends.sampled.GGNDiagonal`): exact, one
  hook-only backward pass per class, where the outputs are ``[B, C]`` with
  ``C <= 10``; else the mean of ``hutchinson_samples`` sketched draws
  ``s_n = S_n xi_n`` (Rademacher ``xi_n``, ``S_n S_n^T`` the loss Hessian in
  the logits), unbiased and ``>= 0`` at every draw. Positive (up to
  parameters the outputs do not depend on); needs ``info["outputs"]`` and
  ``create_graph=cockpit.create_graph(step)``;
- ``"auto"`` (the default, and what the presets use): ``"diag_h"`` where BackPACK can compute
  it on the model (:func:`~cockpit_like.backends.step.backpack_curvature_compatible`),
  else ``"hutchinson"`` for HessTrace (and ``"hutch++"``, from the same
  products, at the steps where the Lanczos engine runs for another quantity
  anyway, as HessMaxEV in the ``full`` preset:
  :class:`~cockpit_like.backends.curvature_engine.SharedSpaceDiagonal`;
  ``estimators[step]`` says which) and ``"ggn"`` for TICDiag and TICTrace
  (their denominator must be positive: with the Hessian's indefinite, noisy
  estimate TIC came out as +-5e4 and negative). TIC with the GGN is the TIC
  of the GGN, as Cockpit's ``curvature="diag_ggn_exact"`` is, and positive.
  Where a step gives no ``info["outputs"]``, ``"auto"``'s TICTrace takes
  ``"hutchinson"`` at that step (with its error bar) and TICDiag stores no
  value (it divides entry by entry by an indefinite, noisy estimate); the
  step's ``checks["notes"]`` say so. Decided
  when the cockpit learns the model, and written to the log metadata
  (``settings()["computed_with"]``). Without a known model, ``"diag_h"``.

The estimators keep each step's standard error beside the stored value, in
``standard_errors[step]`` (0.0 where ``"ggn"`` is exact): per parameter block
for HessTrace (the total's in ``total_errors[step]``; with ``"hutchinson"``
and ``"hutch++"`` the larger of the samples' standard deviation over
``sqrt(m)`` and the conservative bound ``sqrt(2 mean_k ||(A v_k)_p||^2 / m)``
from the squared norms of the same products, ``A`` the Hessian or its
deflated part: :func:`~cockpit_like.backends.hvp.product_standard_errors`;
from 4 samples the first alone is too noisy to be an honest error bar), of
the value for TICTrace (first order in the
trace's error, ``N / t^2 * se(t)``) and, with the ``"ggn"`` draws, for
TICDiag (first order in the draws' deviations from their mean); the sketched
GGN's errors are widened by the Student-t factor of ``draws - 1`` degrees of
freedom, the trace's bounded by the rows' pooled variance too
(:func:`~cockpit_like.backends.sampled.sketch_standard_errors`); none for
the BackPACK diagonals (exact, or one Monte-Carlo sample). With draws, TICDiag applies the second-order correction of
``1 / c̄`` (``E[1/c̄] ≈ 1/c + Var(c̄)/c^3``): ``sum_j a_j / c̄_j (1 - Var̂(c̄_j)/c̄_j^2)``,
each factor clamped at 0. ``reliable[step]`` is ``|value| > 2`` standard errors
(:data:`RELIABLE_SE`); where it is False (the sign itself is uncertain) the
step's ``checks["notes"]`` say so.

TIC also needs ``s_j = sum_i grad_batch_ij^2 = (1/B^2) sum_i g_ij^2``
(``grad_batch[i] = g_i / B`` for a mean loss), read from the shared
per-sample statistic :class:`~cockpit_like.backends.per_sample_stats.SumOfSquares`
(the one MeanGSNR, CABS and EarlyStopping use, computed once per step, from
the outer-product factors on linear layers), and ``B = info["batch_size"]``.

Where the diagonal comes from Hessian-vector products (``"hutchinson"``,
``"hutch++"``), no value is stored at a step whose products are not
symmetric, nor at one whose loss's second derivative in ``info["outputs"]``
is not the mean cross-entropy's its value and gradient declare
(:mod:`cockpit_like.backends.loss_curvature`, a check of the step); the
step's ``checks["notes"]`` say why.

Difference to Cockpit: an unknown ``curvature`` fails when the quantity is
constructed (a :class:`UnknownCurvatureError`, both a ``ValueError`` and a
``KeyError``), not later when the extensions are requested.
"""

from __future__ import annotations

import math

import torch

from cockpit_like.backends.conv_diagonals import diag_ggn_exact, diag_ggn_mc, diag_hessian
from cockpit_like.backends.curvature_engine import DeflatedDiagonal, SharedSpaceDiagonal
from cockpit_like.backends.hvp import HutchinsonDiagonal
from cockpit_like.backends.per_sample_stats import SumOfSquares
from cockpit_like.backends.sampled import CLASSES_IN_DIM_1, GGNDiagonal, SampledGGNDiagonal

from cockpit_like.context import get_record
from cockpit_like.functional.student_t import student_t_factor
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["HessTrace", "TICDiag", "TICTrace", "UnknownCurvatureError", "CURVATURES", "ESTIMATORS", "RELIABLE_SE"]

#: curvature name -> BackPACK extension factory (its savefield is the name)
CURVATURES = {
    "diag_h": diag_hessian,
    "diag_ggn_exact": diag_ggn_exact,
    "diag_ggn_mc": lambda: diag_ggn_mc(mc_samples=1),
}


#: curvature choices that need no BackPACK extension
ESTIMATORS = ("hutchinson", "hutch++", "ggn", "auto")

#: an estimate is ``reliable[step]`` when ``|value| > RELIABLE_SE * standard error`` (its sign is known at
#: about 95%); else the step's ``checks["notes"]`` say so
RELIABLE_SE = 2.0


class UnknownCurvatureError(ValueError, KeyError):
    """``curvature`` is not one of :data:`CURVATURES`."""

    def __str__(self) -> str:
        return str(self.args[0])


#: TICDiag's words where it is asked for an estimate of the Hessian diagonal from Hessian-vector products
_TICDIAG_NOT_FROM_PRODUCTS = (
    "TICDiag divides entry by entry by the curvature diagonal, and an estimate of the Hessian's diagonal from "
    "Hessian-vector products cannot carry that: the noise of each entry is of the size of that entry's whole row of "
    "the Hessian, larger than the entry itself almost everywhere (small MLPs: the sign of 0 of 71-93 entries known "
    "at 4 samples, 5-25% of them at 64), so 1 / c_j and the value are noise of any size and sign (outside trial 35: "
    "20 of 20 values of five losses more than 50% off the exact TICDiag, up to 500x, some of the other sign; no error "
    "bar can be given). Use TICTrace(curvature='hutchinson') (a ratio of sums, stored with its error bar) for a loss "
    "that is not a cross-entropy, TICDiag(curvature='ggn') with info['outputs'] for a cross-entropy (the default "
    "'auto' does so), or BackPACK's exact 'diag_h' on an extended model"
)


def _check_curvature(curvature: str, owner: str, refused: dict | None = None) -> str:
    if refused and curvature in refused:
        raise ValueError(f"{owner}(curvature={curvature!r}) is not offered: {refused[curvature]}.")
    if curvature not in CURVATURES and curvature not in ESTIMATORS:
        raise UnknownCurvatureError(
            f"{owner}(curvature={curvature!r}): unknown curvature; choose one of "
            f"{list(CURVATURES) + list(ESTIMATORS)} (BackPACK's Hessian diagonal, exact GGN diagonal, "
            "Monte-Carlo GGN diagonal; Hutchinson's estimate from Hessian-vector products on any "
            "model; 'hutch++': exact on the Lanczos space, Hutchinson on the rest; 'ggn': the GGN diagonal of "
            "the cross-entropy of info['outputs'] on any model; 'auto': the exact Hessian diagonal where BackPACK "
            "can, else 'hutchinson' (HessTrace) or 'ggn' (TIC))"
        )
    return curvature


def _diagonals(params: list[torch.Tensor], field: str, owner: str) -> list[torch.Tensor]:
    diagonals = []
    for index, param in enumerate(params):
        value = getattr(param, field, None)
        if value is None:
            raise RuntimeError(
                f"{owner}: BackPACK stored no '{field}' on parameter #{index} "
                f"(shape {list(param.shape)}); extend the model and the loss function with "
                "backpack.extend and call backward inside the cockpit context"
            )
        diagonals.append(value.detach())
    return diagonals


class _DiagCurvatureQuantity(SingleStepQuantity):
    """Shared glue: the ``curvature`` argument and reading its diagonal."""

    #: curvature choices the quantity cannot give a meaningful value with -> why (raised when it is constructed)
    _refused: dict = {}

    #: what a step's note advises for a loss whose curvature is not the cross-entropy of info['outputs']
    _other_loss_advice = "pass an explicit curvature ('hutchinson': unbiased, with its error bar)"

    def __init__(
        self, track_schedule, verbose: bool = False, curvature: str = "auto", hutchinson_samples: int = 4
    ):
        super().__init__(track_schedule, verbose=verbose)
        self._requested = _check_curvature(curvature, type(self).__name__, self._refused)
        if isinstance(hutchinson_samples, bool) or not isinstance(hutchinson_samples, int) or hutchinson_samples < 1:
            raise ValueError(
                f"{type(self).__name__}(hutchinson_samples=...) needs a positive int, got {hutchinson_samples!r}"
            )
        self._samples = hutchinson_samples
        self._method: str | None = None if curvature == "auto" else curvature
        #: ``{step: standard error}`` of the estimators, beside each stored value (0.0: exact)
        self.standard_errors: dict = {}
        #: ``{step: bool}`` where there is a standard error: ``|value| > RELIABLE_SE * standard error``
        self.reliable: dict = {}
        #: HessTrace: ``{step: standard error of the total}`` (``standard_errors`` holds the blocks')
        self.total_errors: dict = {}
        #: ``{step: how that step's diagonal was computed}`` where an estimator ran (``"auto"`` on a model
        #: BackPACK cannot handle: ``"hutch++"`` at the steps that run the Lanczos engine, else ``"hutchinson"``)
        self.estimators: dict = {}
        self._errors: dict | None = None
        self._draws: list | None = None
        #: steps at which ``"auto"`` wanted the GGN diagonal but ``info["outputs"]`` was not given
        self._without_outputs: set[int] = set()
        #: of those, ``{step: what was given instead}`` (a tensor of another shape, or without a graph)
        self._outputs_given: dict[int, str] = {}

    @property
    def curvature(self) -> str:
        """The ``curvature`` argument as given (``"auto"`` stays ``"auto"``)."""
        return self._requested

    @property
    def _curvature(self) -> str:
        """Cockpit's attribute: the curvature by Cockpit's name, ``"auto"`` resolved.

        Subclasses written for Cockpit read ``self._curvature`` (Cockpit's own
        tests compare it with ``"diag_h"``, the default there). ``"auto"`` reads
        as what it chose: ``"diag_h"`` where BackPACK computes the diagonal (and
        before the model is known), else ``"hutchinson"``; an explicit choice
        reads as given. Assigning it sets the curvature anew.
        """
        if self._requested == "auto":
            return self.method
        return self._requested

    @_curvature.setter
    def _curvature(self, curvature: str) -> None:
        self._requested = _check_curvature(curvature, type(self).__name__, self._refused)
        self._method = None if curvature == "auto" else curvature

    @property
    def method(self) -> str:
        """How the diagonal is computed: a BackPACK field name, ``"hutchinson"``, ``"hutch++"``, ``"ggn"`` or
        ``"sampled_ggn_mc"``."""
        return self._method or "diag_h"

    def _step_method(self, global_step: int) -> str:
        """:attr:`method` at ``global_step``: ``"auto"``'s GGN falls back to ``"hutchinson"`` without outputs."""
        return "hutchinson" if global_step in self._without_outputs else self.method

    def observe_info(self, global_step: int, info: dict) -> None:
        if self._requested == "auto" and self.method == "ggn":
            outputs = info.get("outputs")
            self._outputs_given.pop(global_step, None)
            if isinstance(outputs, torch.Tensor) and outputs.requires_grad and outputs.dim() >= 2:
                self._without_outputs.discard(global_step)
            else:
                self._without_outputs.add(global_step)
                if isinstance(outputs, torch.Tensor):  # (outside trial 35: a [B] prediction read as "not given")
                    self._outputs_given[global_step] = (
                        f"info['outputs'] has shape {list(outputs.shape)}, not logits with classes last ([B, C] or "
                        "[B, T, C]): one value per row (a regression's prediction, a binary logit) has no softmax "
                        "cross-entropy over classes, whose GGN this is"
                        if outputs.dim() < 2 else
                        "info['outputs'] has no graph (detached, or computed under no_grad)"
                    )

    def _outputs_missing(self, global_step: int) -> str:
        """What the step gave instead of the logits ``"auto"``'s GGN needs (for its notes)."""
        given = self._outputs_given.pop(global_step, None)
        return f"but {given}" if given else "which this step did not give"

    #: curvature -> (BackPACK's field where the models allow it, the estimator on any other model)
    _CHOICE_BY_MODEL = {"auto": ("diag_h", "hutchinson"), "diag_ggn_mc": ("diag_ggn_mc", "sampled_ggn_mc")}

    def adapt_to_models(self, models: list) -> None:
        from cockpit_like.backends.step import backpack_curvature_compatible

        choice = self._CHOICE_BY_MODEL.get(self._requested)
        if choice is not None:
            exact, estimator = choice
            self._method = exact if backpack_curvature_compatible(models, CURVATURES[exact]()) else estimator

    #: without ``info["outputs"]``, ``"auto"``'s GGN falls back to an estimate of the Hessian diagonal (TICTrace, a
    #: sum, keeps an honest error bar); TICDiag divides entry by entry and stores nothing instead
    _falls_back = True

    def _need(self, global_step: int):
        if global_step in self._without_outputs and not self._falls_back:
            return None
        method = self._step_method(global_step)
        if method == "hutchinson":
            # "auto" deflates by the step's Lanczos space where another quantity computes it anyway
            return SharedSpaceDiagonal(self._samples) if self._requested == "auto" else HutchinsonDiagonal(self._samples)
        if method == "hutch++":
            return DeflatedDiagonal(self._samples)
        if method == "sampled_ggn_mc":
            return SampledGGNDiagonal(1)
        if method == "ggn":
            return GGNDiagonal(self._samples)
        return None

    def required_info(self, global_step: int) -> set[str]:
        if self.method == "sampled_ggn_mc" or (self.method == "ggn" and self._requested == "ggn"):
            return {"outputs"} if self.should_compute(global_step) else set()
        return set()

    def extensions(self, global_step: int) -> list:
        if not self.should_compute(global_step) or self.method not in CURVATURES:
            return []
        return [CURVATURES[self.method]()]

    def curvature_needs(self, global_step: int) -> list:
        need = self._need(global_step)
        return [need] if need is not None and self.should_compute(global_step) else []

    def create_graph(self, global_step: int) -> bool:
        return self._need(global_step) is not None and self.should_compute(global_step)

    def hessian_products(self, global_step: int) -> bool:
        # (TICDiag without info['outputs'] computes nothing: outside trial 35 found it named among the quantities
        # that need Hessian-vector products)
        return (self._step_method(global_step) in ("hutchinson", "hutch++") and self._need(global_step) is not None
                and self.should_compute(global_step))  # fmt: skip

    def settings(self) -> dict:
        settings = {"curvature": self._requested}
        if self._requested in ESTIMATORS or self.method != self._requested:
            settings["computed_with"] = self.method
            if self.method in ("hutchinson", "hutch++"):
                settings["hutchinson_samples"] = self._samples
            if self.method == "ggn":
                # exact for outputs [B, C] with C <= 10 (outside trial 13: "ggn_samples: 4" read as a sketch there)
                settings["ggn_sketch_samples"] = self._samples
                settings["ggn_exact_up_to_classes"] = GGNDiagonal.max_classes
        return settings

    def _curvature_diagonals(self, global_step: int, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        need = self._need(global_step)
        self._errors, self._draws = None, None
        self._used = self._step_method(global_step)  # how this step's diagonal was computed (for the notes)
        if need is not None:
            result = get_record(global_step).stat(need)
            if isinstance(result, dict):  # Hutch++ (DeflatedDiagonal's result; "auto" where the engine runs)
                self._used = "hutch++"
            self.estimators[global_step] = self._used
            asymmetry = result.get("asymmetry") if isinstance(result, dict) else getattr(result, "asymmetry", None)
            if asymmetry is not None and asymmetry[0] > asymmetry[1]:
                record = get_record(global_step)
                hooked = record.hooked_gradient_cause()
                cause = hooked[0].lower() + hooked[1:] if hooked else (
                    "an operation of the model has a wrong higher derivative (PyTorch's fused weight norm treats its "
                    "norms as constants; a LayerNorm's third derivative under a loss that holds a gradient, such as a "
                    "gradient penalty)"
                )
                record.note(
                    f"{type(self).__name__} at step {global_step}: no value stored: the Hessian-vector products are "
                    f"not symmetric (their probes' bilinear forms differ from any symmetric operator's by "
                    f"{asymmetry[0]:.3g}, more than the tolerance {asymmetry[1]:.3g}, max(rtol, eps^(1/3)) of their "
                    f"symmetric part), so a trace or diagonal from them is not the Hessian's: {cause}"
                )
                return None
            if isinstance(result, dict):
                self._errors = result
                return self._finite_or_none(global_step, result["diagonal"])
            self._errors = getattr(result, "errors", None)
            self._draws = getattr(result, "draws", None)
            outside = getattr(result, "outside", None)
            if outside:
                shown = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
                get_record(global_step).note(
                    f"{type(self).__name__} at step {global_step}: no value stored: the GGN diagonal is the "
                    f"cross-entropy's of info['outputs'], but {shown} got a gradient from terms of the loss that "
                    "do not pass through info['outputs'] (an auxiliary head or loss, a penalty), so it would not be "
                    "this loss's curvature (0 there: TIC would divide by epsilon). Pass as info['outputs'] logits "
                    f"that every term of the loss goes through, or {self._other_loss_advice}"
                )
                return None
            if getattr(result, "cross_entropy", None) is False:
                why = getattr(result, "not_cross_entropy", None) or (
                    "its gradient in the outputs is not (softmax - labels) / N for any labels, soft labels included"
                )
                if why.startswith(CLASSES_IN_DIM_1):
                    get_record(global_step).note(
                        f"{type(self).__name__} at step {global_step}: no value stored: in info['outputs'] {why}."
                    )
                    return None
                get_record(global_step).note(
                    f"{type(self).__name__} at step {global_step}: no value stored: the GGN diagonal is the plain "
                    "cross-entropy's of info['outputs'], but info['loss'] is not a mean cross-entropy of them: "
                    f"{why}. A weighted cross-entropy (class weights, a factor such as 0.5 * CE), distillation or a "
                    "focal loss has another curvature, so the value would not be this loss's. For a plain "
                    "cross-entropy (hard or soft labels, label smoothing, ignored positions) pass its logits (classes "
                    "last) as info['outputs'] and the rows' losses as info['individual_losses']; for another loss "
                    f"{self._other_loss_advice}"
                )
                return None
            return self._finite_or_none(global_step, list(result))
        return _diagonals(params, self.method, type(self).__name__)

    def _finite_or_none(self, global_step: int, diagonals: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The estimated diagonals, or ``None`` and a note where they are not finite at a step whose loss is (the
        Hessian-vector products of a half-precision graph overflow): never a NaN stored as the curvature."""
        record = get_record(global_step)
        if not record.loss_is_finite or all(bool(torch.isfinite(c).all()) for c in diagonals):
            return diagonals
        record.note(
            f"{type(self).__name__} at step {global_step}: no value stored: the Hessian-vector products of its "
            f"{self._used} estimate were not finite (inf or NaN) where the loss and gradients are. A graph kept in "
            "half precision (autocast with float16) overflows in the second backward pass, most of all for a loss a "
            "GradScaler multiplied by its scale: run the forward pass of the steps these quantities track without "
            "autocast, or in bfloat16"
        )
        self._errors = None
        return None

    def _keep_error(self, global_step: int, value: float, error: float) -> None:
        """Store the standard error beside the value; where it leaves the sign unknown, the step says so."""
        self.standard_errors[global_step] = error
        self.reliable[global_step] = bool(abs(value) > RELIABLE_SE * error)
        get_record(global_step).standard_error(error, self._used, self._samples, self.reliable[global_step],
                                               type(self).__name__)  # fmt: skip
        if not self.reliable[global_step]:
            get_record(global_step).note(
                f"{type(self).__name__} at step {global_step}: the estimate {value:.4g} has a standard error of "
                f"{error:.2g} ({self._used}, {self._samples} samples): |value| is below "
                f"{RELIABLE_SE:g} standard errors, so not even its sign is certain (reliable[{global_step}] is False)"
            )


class HessTrace(_DiagCurvatureQuantity):
    """Per-parameter trace of the curvature diagonal, ``[sum_j c_{p,j} for p]``.

    ``c`` is the diagonal of the mean loss's Hessian (``"diag_h"``), exact GGN
    (``"diag_ggn_exact"``) or one-sample Monte-Carlo GGN (``"diag_ggn_mc"``);
    see the module docstring. Stored as a list of floats, one per parameter
    tensor in params order.

    Example:
        >>> q = HessTrace(linear(1), curvature="diag_ggn_exact")
    """

    def _compute(self, global_step, params, batch_loss):
        diagonals = self._curvature_diagonals(global_step, params)
        if diagonals is None:  # not this loss's curvature: no value (the step's notes say why)
            return None
        traces = [float(c.sum()) for c in diagonals]
        if self._errors is not None:
            # never below the rounding of the sums themselves (eps x sqrt(D) x sum |c|): on a space the products
            # leave invariant the estimate is exact up to rounding, and the spread of the samples was 1e-33
            floors = [float(torch.finfo(c.dtype).eps * math.sqrt(max(c.numel(), 1)) * c.abs().sum()) for c in diagonals]
            self.standard_errors[global_step] = [max(float(e), f) for e, f in zip(self._errors["block_errors"], floors)]
            total_error = max(float(self._errors["trace_error"]), math.sqrt(sum(f * f for f in floors)))
            self.total_errors[global_step] = total_error
            self.reliable[global_step] = bool(abs(sum(traces)) > RELIABLE_SE * total_error)
            # the log keeps the total's (the value a reader sums; the blocks' stay in standard_errors[step])
            get_record(global_step).standard_error(total_error, self._used, self._samples, self.reliable[global_step],
                                                   "HessTrace")  # fmt: skip
            if not self.reliable[global_step]:
                get_record(global_step).note(
                    f"HessTrace at step {global_step}: the total {sum(traces):.4g} has a standard error of "
                    f"{total_error:.2g} ({self._used}, {self._samples} samples): |total| is below "
                    f"{RELIABLE_SE:g} standard errors, so not even its sign is certain (reliable[{global_step}] is "
                    "False; the Hessian's trace is a sum over a bulk of eigenvalues of both signs)"
                )
        return traces


class _TIC(_DiagCurvatureQuantity):
    def __init__(
        self,
        track_schedule,
        verbose: bool = False,
        curvature: str = "auto",
        epsilon: float = 1e-7,
        hutchinson_samples: int = 4,
    ):
        super().__init__(track_schedule, verbose=verbose, curvature=curvature, hutchinson_samples=hutchinson_samples)
        self._epsilon = epsilon

    #: where BackPACK cannot run, ``"auto"`` divides by the GGN diagonal (positive), not a Hessian estimate
    _CHOICE_BY_MODEL = {"auto": ("diag_h", "ggn"), "diag_ggn_mc": ("diag_ggn_mc", "sampled_ggn_mc")}

    def per_sample_stats(self, global_step: int) -> list:
        return [SumOfSquares()] if self.should_compute(global_step) else []

    def required_info(self, global_step: int) -> set[str]:
        own = {"batch_size"} if self.should_compute(global_step) else set()
        return own | super().required_info(global_step)

    def settings(self) -> dict:
        return {**super().settings(), "epsilon": self._epsilon}

    def _inputs(self, global_step, params):
        name = type(self).__name__
        batch_size = get_record(global_step).require("batch_size", name)
        squares = get_record(global_step).stat(SumOfSquares())
        diagonals = self._curvature_diagonals(global_step, params)
        if global_step in self._without_outputs:
            get_record(global_step).note(
                f"{name} at step {global_step}: curvature='auto' divides by the GGN diagonal (positive) of the "
                f"cross-entropy of info['outputs'], {self._outputs_missing(global_step)}; computed with an estimate "
                f"of the Hessian diagonal instead ({self._used}, with its error bar: indefinite and noisy, the value "
                "may be far off, even negative). For a cross-entropy pass info['outputs'] (its logits, classes "
                "last); for another loss curvature='hutchinson' says so from the start"
            )
            self._without_outputs.discard(global_step)  # read: the set holds only steps under way
        return batch_size, squares, diagonals


class TICDiag(_TIC):
    """Takeuchi information criterion with a diagonal curvature.

    ``TICDiag = sum_j (B s_j) / (c_j + epsilon) = sum_j ((1/B) sum_i g_ij^2) / (c_j + epsilon)``

    over all entries ``j`` of all parameters: the *uncentered* second moment
    of the per-sample gradients ``g_i`` against the curvature diagonal ``c``
    (see the module docstring). ``B = info["batch_size"]``, ``s_j`` from
    the shared ``SumOfSquares`` statistic. Stored as a float. Entries with ``c_j ≈ 0``
    dominate; ``"diag_h"`` may even have ``c_j + epsilon <= 0``, as in Cockpit.
    ``curvature="hutchinson"`` and ``"hutch++"`` raise a ``ValueError`` when
    constructed: an estimate of the Hessian's diagonal from Hessian-vector
    products is too noisy entry by entry for ``1 / c_j`` (its message gives the
    alternatives: TICTrace with its error bar, the GGN for a cross-entropy).
    """

    #: an estimate of the Hessian's diagonal is indefinite and noisy entry by entry: ``1 / (c_j + epsilon)`` of it
    #: means nothing (values of +-5e4, negative), so ``"auto"`` without ``info["outputs"]`` stores no value, and
    #: asked for explicitly it is refused (outside trial 35: 20 of 20 values off, without an error bar)
    _falls_back = False
    _refused = {"hutchinson": _TICDIAG_NOT_FROM_PRODUCTS, "hutch++": _TICDIAG_NOT_FROM_PRODUCTS}
    _other_loss_advice = (
        "use TICTrace(curvature='hutchinson') (a ratio of sums, stored with its error bar): TICDiag divides entry by "
        "entry, which an estimate of the Hessian's diagonal from Hessian-vector products cannot carry"
    )

    def _compute(self, global_step, params, batch_loss):
        if global_step in self._without_outputs:
            self._without_outputs.discard(global_step)
            get_record(global_step).note(
                f"TICDiag at step {global_step}: no value stored: curvature='auto' divides by the GGN diagonal "
                f"(positive) of the cross-entropy of info['outputs'], {self._outputs_missing(global_step)}, and an "
                "estimate of the Hessian's diagonal is indefinite and noisy entry by entry (1 / (c_j + epsilon) of it "
                "can be huge or negative). For a cross-entropy pass info['outputs'] (its logits, classes last); for "
                "another loss TICTrace gives the trace version with an error bar (TICTrace(curvature='hutchinson'))"
            )
            return None
        batch_size, squares, diagonals = self._inputs(global_step, params)
        if diagonals is None:  # not this loss's curvature: no value (the step's notes say why)
            return None
        if self._draws and len(self._draws) > 1:
            # 1/c of an estimated c is biased upward (E[1/c̄] ≈ 1/c + Var(c̄)/c³): the second-order correction
            # a / c̄ · (1 - Var̂(c̄)/c̄²), each entry's factor clamped at 0 so the value stays positive
            total = 0.0
            for index, (s, c) in enumerate(zip(squares, diagonals)):
                spread = torch.stack([draw[index] for draw in self._draws]).var(0) / len(self._draws)
                shifted = c + self._epsilon
                total += float((batch_size * s / shifted * (1 - spread / shifted**2).clamp(min=0)).sum())
        else:
            total = float(sum((batch_size * s / (c + self._epsilon)).sum() for s, c in zip(squares, diagonals)))
        if self._draws:  # first order in the draws' deviations from their mean (delta method)
            deviations = torch.tensor(
                [
                    float(sum((batch_size * s * (c - d) / (c + self._epsilon) ** 2).sum()
                              for s, c, d in zip(squares, diagonals, draw)))
                    for draw in self._draws
                ],
                dtype=torch.float64,
            )
            # widened by the Student-t factor of len(draws) - 1 degrees of freedom: the spread of 4 draws is
            # itself noisy (backends/sampled.py: sketch_standard_errors)
            count = len(self._draws)
            error = float(deviations.std() / count**0.5) * student_t_factor(count) if count > 1 else float("nan")
            self._keep_error(global_step, total, error)
        elif self._errors is not None and self._draws is not None:  # exact (no draws)
            self._keep_error(global_step, total, 0.0)
        return total


class TICTrace(_TIC):
    """Takeuchi information criterion with the curvature trace.

    ``TICTrace = (B sum_j s_j) / (sum_j c_j + epsilon) = ((1/B) sum_i ||g_i||^2) / (tr c + epsilon)``

    with sums over all entries of all parameters (see :class:`TICDiag`).
    Stored as a float.
    """

    def _compute(self, global_step, params, batch_loss):
        batch_size, squares, diagonals = self._inputs(global_step, params)
        if diagonals is None:  # not this loss's curvature: no value (the step's notes say why)
            return None
        numerator = batch_size * sum(s.sum() for s in squares)
        denominator = sum(c.sum() for c in diagonals) + self._epsilon
        value = float(numerator / denominator)
        if self._errors is not None:  # first order in the trace's error: N / t^2 * se(t)
            spread, size = float(self._errors["trace_error"]), abs(float(denominator))
            error = float(abs(numerator)) / size**2 * spread
            if self._used in ("hutchinson", "hutch++") and size > RELIABLE_SE * spread > 0:
                # a Hessian trace estimated from few products: N / t is skewed, and the first order missed the
                # exact value by up to 31 of its errors (seventh round of outside trials). The interval
                # t +- 2 se maps to [N / (|t| + 2 se), N / (|t| - 2 se)], wider above N / |t|: half the upper
                # side (at least the first order) is the error, so that +-2 errors hold the whole interval.
                # (Where the interval holds 0 the value's sign is unknown: reliable is False, as before.)
                upper = float(abs(numerator)) * (1 / (size - RELIABLE_SE * spread) - 1 / size)
                error = max(error, upper / RELIABLE_SE)
            self._keep_error(global_step, value, error)
            if self._used in ("hutchinson", "hutch++") and 0 < spread and size <= RELIABLE_SE * spread:
                # the interval t +- 2 se holds 0: N / t takes every value beyond N / (|t| + 2 se), of either sign, and
                # no error bar holds it (outside trial 41: -0.127 +- 0.070 stored for -3.229, 44.6 of its
                # first-order errors off; reliable False, as here)
                get_record(global_step).note(
                    f"TICTrace at step {global_step}: its standard error {error:.2g} is first order and does not "
                    f"bound it: the Hessian's trace, estimated as {float(denominator):.4g} +- {spread:.2g}, is "
                    f"within {RELIABLE_SE:g} standard errors of 0, so N tr(C) / trace can be anything beyond "
                    f"{float(abs(numerator)) / (size + RELIABLE_SE * spread):.3g} in size, of either sign. More "
                    "samples (hutchinson_samples=) or the GGN (curvature='ggn' with info['outputs'], for a "
                    "cross-entropy) bound it"
                )
        return value
