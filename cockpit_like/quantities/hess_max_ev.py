"""Largest Hessian eigenvalue from the step's shared Lanczos decomposition."""

from __future__ import annotations

import warnings

import torch

from cockpit_like.backends.curvature_engine import DEFAULT_RTOL
from cockpit_like.backends.randomness import generator
from cockpit_like.backends.hvp import MissingGraphError, curvature_params, hessian_vector_product, operator_dtype
from cockpit_like.functional.eigen import power_iteration
from cockpit_like.quantities.hessian_spectrum import KrylovQuantity

__all__ = ["HessMaxEV", "MissingGraphError"]


class HessMaxEV(KrylovQuantity):
    """Top eigenvalue of the Hessian ``∇²L`` of the mean loss w.r.t. all tracked params.

    The Hessian is never formed: ``H v`` is computed by double backprop,
    ``H v = ∇_θ <∇_θ L, v>`` through ``p.grad``, so the backward pass must keep
    the graph. The quantity declares this through :meth:`create_graph`; call
    ``loss.backward(create_graph=cockpit.create_graph(step))``.

    The value is read from the step's shared Lanczos decomposition
    (:class:`~cockpit_like.backends.curvature_engine.LanczosNeed`, block
    Lanczos with full re-orthogonalisation from two random probes (random signs times random magnitudes) and the
    previous step's top and bottom Ritz vectors with ``warm_start=True``), whose products every
    curvature quantity tracked at the step shares (:class:`HessEigenvalues`,
    :class:`HessSpectralDensity`, :class:`HessTraceEstimate`). It stops on
    residuals: once the largest and the smallest Ritz values have the residual
    ``r <= rtol * max|theta|`` (``r = ||H x - theta x||``,
    default ``rtol=1e-2``), and had so one product per start vector before, both ends moving by less than
    the tolerance in between (a cluster's second eigenvalue can have a small residual while the first is
    still hidden); an eigenvalue always lies within ``r`` of the value. Never
    on two consecutive estimates agreeing alone, which can stop
    before the iteration found the eigenvalue.

    Which eigenvalue (Cockpit's numbers kept):

    - ``use_power=True`` (default): the target of Cockpit's power iteration,
      the eigenvalue of largest *magnitude* (negative if ``|lambda_min| > lambda_max``);
    - ``use_power=False``: the largest *algebraic* eigenvalue, like Cockpit's
      ``eigsh(k=1, which="LA")``.

    ``accelerate=False`` runs Cockpit's plain power iteration instead, with
    products of its own (from ``U[0, 1)`` entries per parameter, drawn by the cockpit's generator, stop rule
    ``|lambda_prev - lambda| <= atol + rtol |lambda|``, default ``rtol=1e-3``),
    for bit-for-bit comparisons with Cockpit; ``atol`` only matters there. Its values are Cockpit's and are
    not certified: ``converged[step]`` is False at every step (on 6 small float64 models x 12 seeds x 5
    starts, 44 of 358 stops of Cockpit's rule were more than 1% off the eigenvalue of largest magnitude, 7
    more than 10%, and the last iterate's residual does not tell which: docs/curvature.md).

    Under DistributedDataParallel the Hessian is that of the global batch's
    mean loss: every product is the mean of the ranks' products and the start
    vectors are rank 0's, so every rank stores the same value.

    Differences to Cockpit 1.0.2: works on float64 models, Lanczos with a
    residual stop instead of the power iteration (the value is the
    eigenvalue's to ``rtol``, where Cockpit's may be far off), optional warm
    starts (``warm_start=True``), random-sign probes
    (drawn from the cockpit's own generator, seeded by a fixed seed and the step:
    :mod:`cockpit_like.backends.randomness`; torch's RNG is not touched) instead of ``U[0, 1)`` entries, and a zero ``H v`` gives 0.

    Args:
        track_schedule: when to compute.
        verbose: print each value.
        use_power: the eigenvalue of largest magnitude (True) or the largest (False).
        warm_start: also start from the previous tracked step's Ritz vectors (default off since the
            Lanczos engine, see :class:`~cockpit_like.quantities.hessian_spectrum.KrylovQuantity`).
        accelerate: False: Cockpit's plain power iteration (products of its own).
        max_iter: most Hessian-vector products per step.
        rtol: tolerance of the Lanczos residuals (``None``: 1e-2; the power iteration's stop tolerance with
            ``accelerate=False``, ``None``: 1e-3).
        atol: absolute tolerance of the plain power iteration only.

    Attributes:
        hvp_counts: ``{global_step: number of Hessian-vector products}``.
        converged: ``{global_step: whether the stop rule was met}``: the Lanczos residuals certify the value
            (always False with ``accelerate=False``, whose rule certifies nothing; ``hvp_counts[step] < max_iter``
            says that Cockpit's rule stopped it).

    Stored value: the eigenvalue, a Python float; none where the products are not symmetric (a wrong
    double backward, such as PyTorch's fused ``weight_norm``: the step's ``checks["notes"]`` say so), and
    none where the loss's own second derivative in ``info["outputs"]`` is not the mean cross-entropy's that
    its value and gradient declare (a hand-written cross-entropy whose backward reuses the saved softmax:
    :mod:`cockpit_like.backends.loss_curvature`; the notes say so too).
    """

    def __init__(
        self,
        track_schedule,
        verbose: bool = False,
        use_power: bool = True,
        warm_start: bool = False,
        accelerate: bool = True,
        max_iter: int = 100,
        rtol: float | None = None,
        atol: float = 1e-6,
    ):
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"HessMaxEV(max_iter=...) needs a positive int, got {max_iter!r}")
        if rtol is not None and not rtol > 0:
            raise ValueError(f"HessMaxEV(rtol=...) must be > 0, got {rtol!r}")
        plain = not accelerate
        if not plain and atol != 1e-6:
            warnings.warn(
                "HessMaxEV(atol=...) only applies to Cockpit's plain power iteration (accelerate=False); "
                "the Lanczos solver stops on residuals (rtol) and ignores it. Drop atol= (use rtol=), or pass "
                "accelerate=False for the plain power iteration",
                FutureWarning,
                stacklevel=2,
            )
        engine_rtol = DEFAULT_RTOL if plain or rtol is None else rtol
        super().__init__(track_schedule, verbose=verbose, max_products=max_iter, rtol=engine_rtol,
                         warm_start=warm_start)
        self._use_power = bool(use_power)
        self._accelerate = bool(accelerate)
        self._max_iter = max_iter
        self._rtol = rtol if rtol is not None else (1e-3 if plain else DEFAULT_RTOL)
        self._atol = atol
        self._previous: torch.Tensor | None = None

    def curvature_needs(self, global_step: int) -> list:
        return super().curvature_needs(global_step) if self._accelerate else []

    def settings(self) -> dict:
        return {
            "use_power": self._use_power,
            "warm_start": self._warm_start,
            "accelerate": self._accelerate,
            "max_iter": self._max_iter,
            "rtol": self._rtol,
            "atol": self._atol,
            "solver": "lanczos" if self._accelerate else "power_iteration",
        }

    def _compute(self, global_step, params, batch_loss):
        if not self._accelerate:
            return self._plain_power_iteration(global_step, params)
        decomposition = self.decomposition(global_step)
        if self.not_a_hessian(global_step, decomposition):
            return None  # products that are not the Hessian's (PyTorch's fused weight_norm): the note says why
        values = decomposition.ritz_values()
        top = not self._use_power or abs(float(values[-1])) >= abs(float(values[0]))
        if not decomposition.converged:
            residual = float(decomposition.error_bounds()[-1 if top else 0])
            warnings.warn(
                f"HessMaxEV: step {global_step}: Lanczos did not converge in {decomposition.num_products} "
                f"Hessian-vector products (max_iter={self._max_iter}); the stored value is within {residual:.3g} "
                "of an eigenvalue but may not be the extreme one (converged[step] is False). Raise max_iter.",
                RuntimeWarning,
                stacklevel=2,
            )
        return float(values[-1] if top else values[0])

    def _plain_power_iteration(self, global_step, params) -> float:
        """Cockpit's algorithm: power iteration from ``U[0, 1)`` entries per parameter (or the last vector)."""
        matvec = hessian_vector_product(params, "HessMaxEV")
        result = power_iteration(matvec, self._start_vector(params, global_step), max_iter=self._max_iter, rtol=self._rtol,
                                 atol=self._atol)
        self._previous = result.vector.detach()
        self.hvp_counts[global_step] = result.num_matvecs
        # Cockpit's rule stops when two consecutive estimates agree, which certifies nothing (they agree by chance,
        # or the iteration crawls where the two largest magnitudes nearly tie): never stored as converged
        self.converged[global_step] = False
        return float(result.value)

    def _start_vector(self, params: list[torch.Tensor], global_step: int) -> torch.Tensor:
        params = [params[i] for i in curvature_params(params)]  # the operator's space (frozen ones left out)
        size = sum(p.numel() for p in params)
        previous = self._previous
        if (
            self._warm_start
            and previous is not None
            and previous.numel() == size
            and previous.dtype == operator_dtype(params)
            and bool(torch.isfinite(previous).all())
            and previous.norm() > 0
        ):
            return previous.to(params[0].device)
        # under DDP every rank starts from rank 0's draw (cockpit_like.backends.distributed)
        # the cockpit's generator (torch's RNG untouched), seeded by the step: the same draw on every rank
        draws = generator(global_step, "power iteration start", params[0].device)
        return torch.cat([torch.rand(p.shape, dtype=p.dtype, device=p.device, generator=draws).reshape(-1)
                          for p in params])
