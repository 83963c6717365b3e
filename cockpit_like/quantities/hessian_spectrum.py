"""Curvature from the step's shared Lanczos decomposition: extreme eigenvalues, spectral density, trace.

Every quantity here (and :class:`~cockpit_like.quantities.HessMaxEV`) asks
for one :class:`~cockpit_like.backends.curvature_engine.LanczosNeed`; equal
arguments give equal needs, so the quantities tracked at one step share one
set of Hessian-vector products and read the same decomposition: the numbers
of each are the same alone and together. Each keeps the top and bottom Ritz
vectors as the next tracked step's warm start (saved by ``state_dict``, so a
resumed run continues as the original would) and the products used and
whether the stop rule held at each step (:attr:`KrylovQuantity.hvp_counts`,
:attr:`KrylovQuantity.converged`).

All need ``loss.backward(create_graph=cockpit.create_graph(step))``; the
Hessian is that of the mean loss ``L`` w.r.t. all tracked parameters (under
DDP, of the global batch's mean loss). Where the products are not symmetric
(:meth:`~cockpit_like.functional.krylov.KrylovDecomposition.asymmetry` above
``rtol * max|theta|`` and above rounding: a wrong double backward, such as
PyTorch's fused ``weight_norm``) they are not the Hessian's: no value is
stored, and the step's ``checks["notes"]`` say why. The same where the
loss's own second derivative in ``info["outputs"]`` is not the cross-entropy's
(symmetric products that miss the loss's curvature: the step, not the
quantity, checks it, :mod:`cockpit_like.backends.loss_curvature`).
"""

from __future__ import annotations

import math

import torch

from cockpit_like.backends.curvature_engine import DEFAULT_PROBES, DEFAULT_RTOL, KrylovTrace, LanczosNeed, WarmStart
from cockpit_like.backends.hvp import curvature_params, fused_weight_norms, product_standard_errors
from cockpit_like.context import get_record
from cockpit_like.functional.krylov import KrylovDecomposition
from cockpit_like.quantities.curvature import RELIABLE_SE
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["KrylovQuantity", "HessEigenvalues", "HessSpectralDensity", "HessTraceEstimate"]


def _positive_int(value, name: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}=...) needs a positive int, got {value!r}")
    return value


class KrylovQuantity(SingleStepQuantity):
    """Base: a quantity computed from the step's shared Lanczos decomposition.

    Args:
        track_schedule: when to compute.
        verbose: print each value.
        max_products: most Hessian-vector products per step.
        rtol: stop once the largest and smallest Ritz values have residuals
            ``r <= rtol * max|theta|`` (``r = ||H x - theta x||``; an eigenvalue
            always lies within ``r``), as they had one product per start vector before, the ends moving by
            less than that in between.
        probes: random start vectors of the block (density, trace; random signs times random magnitudes:
            :func:`~cockpit_like.backends.curvature_engine.start_vectors`). Two by default: with one, a start
            vector nearly orthogonal to the top eigenvector (a few percent of draws) lets Lanczos converge to
            the second eigenvalue of a near-tied or clustered end first, with a small residual; two random
            starts make that rare (``benchmarks/stop_rule.py``, docs/curvature.md).
        warm_start: also start from the previous tracked step's top and bottom Ritz vectors
            (block Lanczos: the probe's Krylov space grows at full rate, so a warm start cannot make
            the result worse, but each degree costs a product per start vector; measured on the
            benchmark's MLP it costs more products than it saves, hence off by default).

    Attributes:
        hvp_counts: ``{step: Hessian-vector products of the decomposition}``.
        converged: ``{step: whether the residual stop rule held}``.
    """

    def __init__(
        self,
        track_schedule,
        verbose: bool = False,
        max_products: int = 100,
        rtol: float = DEFAULT_RTOL,
        probes: int = DEFAULT_PROBES,
        warm_start: bool = False,
    ):
        super().__init__(track_schedule, verbose=verbose)
        owner = type(self).__name__
        self._max_products = _positive_int(max_products, "max_products", owner)
        self._probes = _positive_int(probes, "probes", owner)
        if not (isinstance(rtol, (int, float)) and rtol > 0):
            raise ValueError(f"{owner}(rtol=...) must be > 0, got {rtol!r}")
        self._krylov_rtol = float(rtol)
        self._warm_start = bool(warm_start)
        self._warm: list[torch.Tensor] | None = None
        self.hvp_counts: dict[int, int] = {}
        self.converged: dict[int, bool] = {}
        self._weight_norms: list[str] = []  # the models' fused weight norms: named where products are not symmetric

    def adapt_to_models(self, models: list) -> None:
        self._weight_norms = fused_weight_norms(models)

    def lanczos_need(self) -> LanczosNeed:
        """The decomposition this quantity reads (equal for quantities with equal arguments and history)."""
        warm = WarmStart(tuple(self._warm)) if self._warm_start and self._warm else None
        return LanczosNeed(self._max_products, self._krylov_rtol, self._probes, warm)

    def _step_need(self):
        return self.lanczos_need()

    def curvature_needs(self, global_step: int) -> list:
        return [self._step_need()] if self.should_compute(global_step) else []

    def create_graph(self, global_step: int) -> bool:
        return self.should_compute(global_step)

    def hessian_products(self, global_step: int) -> bool:
        return self.should_compute(global_step)

    def settings(self) -> dict:
        return {
            "max_products": self._max_products,
            "rtol": self._krylov_rtol,
            "probes": self._probes,
            "warm_start": self._warm_start,
        }

    def decomposition(self, global_step: int) -> KrylovDecomposition:
        """The step's decomposition; records its cost and keeps the warm start for the next step."""
        result: KrylovDecomposition = get_record(global_step).stat(self.lanczos_need())
        self.hvp_counts[global_step] = result.num_products
        self.converged[global_step] = result.converged
        if self._warm_start and result.num_products > 0:
            top, bottom = result.ritz_vector(-1).detach(), result.ritz_vector(0).detach()
            self._warm = [top] if result.num_products == 1 else [top, bottom]
        return result

    def not_a_hessian(self, global_step: int, result: KrylovDecomposition) -> bool:
        """Whether the step's products are not a symmetric operator's (then a note says why; store no value).

        :meth:`~cockpit_like.functional.krylov.KrylovDecomposition.asymmetry` ``delta`` above the tolerance
        ``max(rtol, eps^(1/3)) * max|theta|``: the products differ from the Hessian's by at least ``delta`` (a
        wrong double backward), so no Ritz value, quadrature or trace from them is the Hessian's.
        """
        if not result.finite:
            record = get_record(global_step)
            why = (
                "The step's loss is not finite (NaN or inf: a NaN input row, an overflow; the step's other notes "
                "and cockpit.records say where it came from), and the products through its graph are not either."
                if not record.loss_is_finite else  # (outside trial 36: a NaN row in float64 got the advice below)
                "A graph kept in half precision (autocast with float16) overflows in the second backward pass, most "
                "of all for a loss a GradScaler multiplied by its scale: run the forward pass of the steps these "
                "quantities track without autocast, or in bfloat16."
            )
            record.note(
                f"{type(self).__name__} at step {global_step}: no value stored: Hessian-vector product "
                f"{result.num_products + 1} was not finite (inf or NaN), so the solve stopped there "
                f"(converged[{global_step}] is False). {why}"
            )
            return True
        if result.symmetric(self._krylov_rtol):
            return False
        scale = float(result.ritz_values().abs().max())
        tolerance, asymmetry = result.symmetry_tolerance(self._krylov_rtol), result.asymmetry()
        hooked = get_record(global_step).hooked_gradient_cause()
        if hooked is not None:
            cause = hooked
        elif self._weight_norms:
            cause = (
                f"Here PyTorch's fused weight norm computes {', '.join(self._weight_norms)} "
                "(torch.nn.utils.parametrizations.weight_norm or torch.nn.utils.weight_norm with dim 0 or the "
                "last dimension): its double backward treats the norms ||v|| as constants. Compute the weight "
                "with differentiable operations instead, the formula PyTorch uses where it does not fuse "
                "(the same values to rounding): a parametrization whose forward(g, v) returns "
                "v * (g / torch.norm_except_dim(v, 2, dim)) and whose right_inverse(w) returns "
                "(torch.norm_except_dim(w, 2, dim), w), dim as in weight_norm (0 by default)"
            )
        else:
            cause = (
                "An operation of the model has a wrong second derivative (PyTorch's fused weight norm is a known "
                "one: its double backward treats the norms as constants)"
            )
        get_record(global_step).note(
            f"{type(self).__name__} at step {global_step}: no value stored: the Hessian-vector products are not "
            f"symmetric. On the Lanczos space of {result.num_products} products they differ from any symmetric "
            f"operator's, the Hessian's included, by at least {asymmetry:.3g} ({asymmetry / scale:.1%} of "
            f"max|theta|), more than the tolerance {tolerance:.3g} (max(rtol, eps^(1/3)) * max|theta|), so no "
            f"eigenvalue, density or trace from them is the Hessian's (converged[{global_step}] is False). {cause}."
        )
        return True


class HessEigenvalues(KrylovQuantity):
    """The largest and the smallest eigenvalue of the Hessian ``∇²L`` of the mean loss.

    Extreme Ritz values of the shared Lanczos decomposition; each is within
    its residual of an eigenvalue, and where ``converged`` that residual is at
    most ``rtol * max|theta|``. A negative ``smallest`` shows directions of negative curvature.

    Stored value: ``{"largest": float, "smallest": float, "products": int, "converged": bool}``.

    Example:
        >>> q = HessEigenvalues(linear(10))
    """

    def _compute(self, global_step, params, batch_loss):
        result = self.decomposition(global_step)
        if self.not_a_hessian(global_step, result):
            return None
        values = result.ritz_values()
        return {
            "largest": float(values[-1]),
            "smallest": float(values[0]),
            "products": result.num_products,
            "converged": result.converged,
        }


class HessSpectralDensity(KrylovQuantity):
    """Spectral density of the Hessian by stochastic Lanczos quadrature (SLQ).

    The density ``phi(lambda) = (1/D) sum_j delta(lambda - lambda_j)`` of the
    ``D`` eigenvalues is approximated by Gauss quadrature: for unit probes
    ``u = r / sqrt(D)`` (``r`` the engine's start vectors, of squared norm ``D``), nodes ``theta_i`` (Ritz values) and
    weights ``w_i = (y_i^T Q^T u)^2`` averaged over the probes, so that
    ``sum_i w_i theta_i^k = u^T H^k u`` (exact for ``k < 2 x`` the probe's Krylov
    steps), whose expectation is the ``k``-th moment ``tr(H^k) / D``. The
    decomposition is the one shared with the other curvature quantities, so it
    runs until the extreme eigenvalues have converged; a larger ``probes``
    (averaging more probes) or smaller ``rtol`` (more nodes) refine the density
    at the cost of a decomposition of its own.

    ``D`` counts the trainable parameters' entries: the Hessian is taken with respect to them (frozen
    parameters are left out, :func:`~cockpit_like.backends.hvp.curvature_params`).

    Stored value: ``{"nodes": [float], "weights": [float], "dimension": D,
    "products": int}``; smooth it with
    :func:`cockpit_like.functional.krylov.gaussian_density` (the dashboard's
    ``spectral_density`` instrument does).
    """

    def _compute(self, global_step, params, batch_loss):
        result = self.decomposition(global_step)
        if self.not_a_hessian(global_step, result):
            return None
        nodes, weights = result.quadrature()
        return {
            "nodes": nodes.tolist(),
            "weights": weights.mean(0).tolist(),
            "dimension": curvature_dimension(params),
            "products": result.num_products,
        }


class HessTraceEstimate(KrylovQuantity):
    """Trace of the Hessian ``tr ∇²L`` of the mean loss from the shared decomposition.

    - ``method="hutch++"`` (default): ``tr(Q^T H Q) + mean_k g_k'^T H g_k'``,
      the exact trace on the Lanczos space (which holds the dominant
      eigendirections) plus Hutchinson's estimate on the rest with ``samples``
      fresh Rademacher vectors projected off the space (``samples`` more
      products; :class:`~cockpit_like.backends.curvature_engine.KrylovTrace`).
      Unbiased; far less noisy than Hutchinson when a few eigenvalues dominate.
    - ``method="hutchinson"``: ``D * mean_k u_k^T H u_k`` of the decomposition's
      own probes (no extra product; unbiased, noisy: ``probes`` samples).

    Unlike :class:`HessTrace` this is one number for all parameters.

    Stored value: ``{"trace": float, "standard_error": float, "products": int}``
    (``products``: all Hessian-vector products the estimate used, the
    decomposition's included). The standard error is HessTrace's
    (docs/curvature.md, "Error bars of the Hessian's trace"): the larger of the
    samples' standard deviation over ``sqrt(samples)`` and the bound
    ``sqrt(2 mean_k ||A v_k||^2 / samples)`` from the products' squared norms
    (:func:`~cockpit_like.backends.hvp.product_standard_errors`; ``A`` the
    Hessian for ``"hutchinson"``, whose norms the decomposition's coefficients
    give without a product, the deflated Hessian ``(I - P) H (I - P)`` for
    ``"hutch++"``). The samples' spread alone, from 2 or 4 numbers, put the
    exact trace up to 190 errors away. ``reliable[step]`` is
    ``|trace| > 2`` errors, beside the error in the step's
    ``checks["standard_errors"]``; where it is False the step's notes say so.
    """

    METHODS = ("hutch++", "hutchinson")

    def __init__(self, track_schedule, verbose: bool = False, method: str = "hutch++", samples: int = 4, **kwargs):
        super().__init__(track_schedule, verbose=verbose, **kwargs)
        if method not in self.METHODS:
            raise ValueError(f"HessTraceEstimate(method={method!r}): choose one of {list(self.METHODS)}")
        self._method = method
        self._samples = _positive_int(samples, "samples", "HessTraceEstimate")
        self.reliable: dict[int, bool] = {}

    def _step_need(self):
        return KrylovTrace(self._samples, self.lanczos_need()) if self._method == "hutch++" else self.lanczos_need()

    def settings(self) -> dict:
        return {**super().settings(), "method": self._method, "samples": self._samples}

    def _compute(self, global_step, params, batch_loss):
        need = self._step_need()
        result = self.decomposition(global_step)
        if self.not_a_hessian(global_step, result):
            return None
        if self._method == "hutch++":
            trace = get_record(global_step).stat(need)
            value, error, count = trace["estimate"], trace["standard_error"], self._samples
            products = result.num_products + trace["products"]
        else:
            size = curvature_dimension(params)
            samples = size * result.probe_traces()
            energies = size * result.probe_energies()
            count = samples.numel()
            error = product_standard_errors(samples.reshape(-1, 1), energies.reshape(-1, 1))["trace_error"]
            value, products = float(samples.mean()), result.num_products
        self._keep_error(global_step, value, error, count)
        return {"trace": value, "standard_error": error, "products": products}

    def _keep_error(self, global_step: int, value: float, error: float, count: int) -> None:
        """``reliable[step]`` and the step's ``checks["standard_errors"]`` entry, as HessTrace keeps them."""
        record = get_record(global_step)
        self.reliable[global_step] = bool(abs(value) > RELIABLE_SE * error)
        record.standard_error(error, self._method, count, self.reliable[global_step], type(self).__name__)
        if not self.reliable[global_step]:
            record.note(
                f"{type(self).__name__} at step {global_step}: the trace {value:.4g} has a standard error of "
                f"{error:.2g} ({self._method}, {count} samples): |trace| is below {RELIABLE_SE:g} standard errors, "
                f"so not even its sign is certain (reliable[{global_step}] is False; more samples narrow it)"
            )


def curvature_dimension(params: list[torch.Tensor]) -> int:
    """The dimension of the Hessian the curvature engine decomposes: the trainable parameters' entries."""
    return sum(params[i].numel() for i in curvature_params(params))
