"""Whether the loss's own second derivative is the cross-entropy's, where the Hessian-vector products go through it.

The curvature quantities that read Hessian-vector products (HessMaxEV,
HessEigenvalues, HessSpectralDensity, HessTraceEstimate, HessTrace and TIC
with ``curvature="hutchinson"`` / ``"hutch++"`` / ``"auto"`` on a model
BackPACK cannot handle) differentiate the backward pass again, the loss's
included. A loss whose backward is not twice differentiable but not marked
so (a hand-written cross-entropy ``torch.autograd.Function`` whose backward
returns ``(p - onehot(y)) / N`` with the softmax ``p`` saved in forward) has
a double backward without the loss's curvature ``diag(p) - p pᵀ`` in the
logits. The products stay symmetric, so the engine's symmetry checks cannot
see it, and the values are another operator's (outside trial 32: HessMaxEV
stored as converged with the wrong sign at 3 of 5 steps).

:class:`LossCurvatureCheck` is a step need (computed after each backward
pass of the step, merged across micro-batches and ranks) that every step
with Hessian-vector products asks for
(:meth:`~cockpit_like.quantities.needs.StepNeeds.collect`). Where
``info["outputs"]`` is given and ``info["loss"]`` is a mean cross-entropy of
them (:func:`~cockpit_like.backends.sampled.cross_entropy_verdict`, the check
TIC's GGN uses, on the same gradient), it compares, for one probe ``u``
(Gaussian, from the cockpit's generator: torch's RNG is not touched),
autograd's ``d/doutputs <dL/doutputs, u>`` with the known
``(diag(p) - p pᵀ) u / N`` over the counted positions
(:func:`~cockpit_like.functional.loss_hessian.cross_entropy_hessian_product`,
:func:`~cockpit_like.functional.loss_hessian.hessian_product_mismatch`). Where
they disagree the step stores no value for those quantities and its
``checks["notes"]`` say why (:meth:`LossCurvature.note`).

Cost, per backward pass of a step with Hessian-vector products and declared
outputs: one backward pass from the loss to the outputs with ``create_graph``
(the cross-entropy check reads that gradient), one double backward through
the loss's operations only, never the model's, and a few elementwise passes
over ``[N, C]`` tensors (one probe's worth of draws): the loss's cost, not the
model's (on a CPU thread, 0.1 s for float32 outputs of 2048 x 1000, twice the
cross-entropy check alone, next to Hessian-vector products through the whole
model, dozens per step). Where the check fails, the step's products are not
computed at all. Nothing is computed where the outputs are not given, and
nothing after the cross-entropy check where the loss is not a mean
cross-entropy of them (not checked): the step runs as before.

May import torch, :mod:`cockpit_like.functional` and :mod:`cockpit_like.backends`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cockpit_like.backends.randomness import generator
from cockpit_like.backends.sampled import cross_entropy_verdict, outputs_gradient
from cockpit_like.functional.loss_hessian import cross_entropy_hessian_product, hessian_product_mismatch

__all__ = ["LossCurvature", "LossCurvatureCheck"]


@dataclass(frozen=True)
class LossCurvature:
    """The verdict of :class:`LossCurvatureCheck` at a step (the worst of its backward passes).

    Attributes:
        checked: the loss's second derivative was compared (outputs given, the loss a mean cross-entropy of them).
        wrong: it disagreed with the cross-entropy's beyond the tolerance in some backward pass.
        error: ``||found - expected|| / ||expected||`` (the largest of the passes compared; ``inf`` where the
            cross-entropy's product is 0 and autograd's is not).
        tolerance: the rounding tolerance relative to ``||expected||`` (at the worst pass).
    """

    checked: bool = False
    wrong: bool = False
    error: float = 0.0
    tolerance: float = 0.0

    def note(self, step: int, names: list[str]) -> str:
        """What the step's ``checks["notes"]`` say where :attr:`wrong` (``names``: the quantities withheld)."""
        known = "the known (diag(p) - p p^T) u / N"
        off = f"is {self.error:.1%} off {known}" if math.isfinite(self.error) else f"is not 0 where {known} is"
        return (
            f"{', '.join(names)} at step {step}: no value stored: info['loss'] is a mean cross-entropy of "
            "info['outputs'] (its value and gradient say so), but its second derivative there is not the "
            f"cross-entropy's: for a random direction u, autograd's d/doutputs <dL/doutputs, u> {off} "
            f"(tolerance {self.tolerance:.2g} of its norm), so the Hessian-vector products "
            "miss the loss's curvature and no eigenvalue, trace or diagonal from them is the Hessian's (they stay "
            "symmetric: the symmetry checks cannot see it). The loss's backward is not twice differentiable: a "
            "custom torch.autograd.Function whose backward returns (p - onehot(y)) / N with the softmax p saved in "
            "forward has a double backward without the softmax's curvature. Compute the loss with "
            "torch.nn.functional.cross_entropy, or make the Function's backward differentiable (save the logits and "
            "compute the softmax from them in backward with torch operations)"
        )


@dataclass(frozen=True)
class LossCurvatureCheck:
    """Need: whether the loss's second derivative in ``info["outputs"]`` is the mean cross-entropy's
    (module docstring). Result: a :class:`LossCurvature`."""

    def compute(self, execution) -> LossCurvature:
        info = execution.info
        loss, outputs = info.get("loss"), info.get("outputs")
        if not (isinstance(outputs, torch.Tensor) and outputs.requires_grad and outputs.dim() >= 2):
            return LossCurvature()
        with torch.enable_grad():  # (the cockpit's work runs under no_grad; this gradient needs its graph)
            gradient = outputs_gradient(loss, outputs, create_graph=True)
        verdict, _, counted = cross_entropy_verdict(loss, outputs, info.get("individual_losses"), gradient)
        if verdict is not True:
            return LossCurvature()
        return self._compare(execution.step, outputs, gradient, counted)

    @staticmethod
    def _compare(step: int, outputs: torch.Tensor, gradient: torch.Tensor, counted) -> LossCurvature:
        from cockpit_like.backends.user_state import own_backward

        classes = outputs.shape[-1]
        draw_dtype = torch.promote_types(outputs.dtype, torch.float32)  # (half precision: drawn in float32)
        draws = generator(step, "loss curvature probe", outputs.device)
        probe = torch.randn(outputs.shape, dtype=draw_dtype, device=outputs.device, generator=draws).to(gradient.dtype)
        found = None
        if gradient.requires_grad:  # (no graph: the double backward is 0, as a backward from saved tensors gives)
            try:
                with own_backward():  # the user's hooks sit it out; the step's graph is kept for the products
                    (found,) = torch.autograd.grad(gradient, outputs, probe, retain_graph=True, allow_unused=True)
            except RuntimeError:  # (no second derivative at all: the products themselves raise, naming it)
                return LossCurvature()
        del gradient
        logits = outputs.detach().reshape(-1, classes)
        expected, rounding = cross_entropy_hessian_product(logits, probe.reshape(-1, classes), counted)
        found = torch.zeros_like(expected) if found is None else found.detach().reshape(-1, classes)
        # a row without gradient is left out of the mean's count N by the cross-entropy check, but one whose
        # softmax is one-hot to the dtype's rounding (a confident row, its gradient rounded to 0) may be counted
        # by the loss: N is then known only within a range, and the product up to the factor it makes
        counted_rows, confident = int(counted.sum()), 0
        if counted_rows < counted.numel():
            eps = torch.finfo(outputs.dtype).eps
            with torch.no_grad():
                rest = logits[~counted.to(logits.device)].to(torch.float64)
                confident = int((1 - torch.softmax(rest, dim=1).amax(1) <= 4 * eps).sum())
        factors = (counted_rows / (counted_rows + confident), 1.0)
        error, tolerance, factor = hessian_product_mismatch(found, expected, rounding, outputs.dtype, factors)
        size = factor * float(torch.linalg.vector_norm(expected))
        return LossCurvature(checked=True, wrong=error > tolerance, error=error / size if size > 0 else math.inf,
                             tolerance=tolerance / size if size > 0 else math.inf)

    def across_ranks(self, result: LossCurvature, reduction):
        """The step's verdict from its passes' (micro-batches, ranks): checked where one was, wrong where one
        was, the largest error (the tolerances are the same dtype's)."""
        part = reduction.max(torch.tensor([float(result.checked), float(result.wrong), result.error,
                                           result.tolerance], dtype=torch.float64,
                                          device=getattr(reduction, "_device", None) or "cpu"))  # (a few flags)

        def finish() -> LossCurvature:
            checked, wrong, error, tolerance = (float(x) for x in part.value)
            return LossCurvature(checked=checked > 0, wrong=wrong > 0, error=error, tolerance=tolerance)

        return finish
