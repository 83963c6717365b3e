"""Largest Hessian eigenvalue from Hessian-vector products."""

from __future__ import annotations

import warnings

import torch

from cockpit_like.backends.distributed import same_on_all_ranks
from cockpit_like.backends.hvp import MissingGraphError, hessian_vector_product
from cockpit_like.functional.eigen import EigenResult, accelerated_power_iteration, lanczos, power_iteration
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["HessMaxEV", "MissingGraphError"]


class HessMaxEV(SingleStepQuantity):
    """Top eigenvalue of the Hessian ``∇²L`` of the mean loss w.r.t. all tracked params.

    The Hessian is never formed: ``H v`` is computed by double backprop,
    ``H v = ∇_θ <∇_θ L, v>`` through ``p.grad``, so the backward pass must keep
    the graph. The quantity declares this through :meth:`create_graph`; call
    ``loss.backward(create_graph=cockpit.create_graph(step))``. The products
    run after BackPACK's pass (no extension is active then).

    Solvers:

    - ``use_power=True``: the power iteration's target, the eigenvalue of
      largest *magnitude* (negative if ``|lambda_min| > lambda_max``), and
      Cockpit's stop rule ``|lambda_prev - lambda| <= atol + rtol |lambda|``
      on consecutive estimates (``rtol=1e-3``, ``atol=1e-6``, at most
      ``max_iter=100`` products).
      With ``accelerate=True`` (default) each estimate is the Ritz value of
      largest magnitude on the Krylov space of all products so far
      (:func:`cockpit_like.functional.eigen.accelerated_power_iteration`):
      after as many products it is never further from the eigenvalue than the
      power iteration's Rayleigh quotient, and on the benchmark's MLP it stops
      after 11 instead of 16 products (7 instead of 11 warm) with a 6x smaller
      error. It keeps one vector per product (``max_iter`` at most).
      ``accelerate=False`` is Cockpit's plain power iteration, whose Rayleigh
      quotient stops slightly below the eigenvalue.
    - ``use_power=False``: Lanczos (:func:`cockpit_like.functional.eigen.lanczos`,
      in torch, no scipy) for the largest *algebraic* eigenvalue, like
      Cockpit's ``eigsh(k=1, which="LA")``; stops at relative residual
      ``||H x - theta x|| <= rtol |theta|`` (default ``1e-4``; the eigenvalue
      error is then typically ``~ rtol^2 |theta|^2 / gap``, around 1e-7).

    Cost: with ``warm_start=True`` (default) each solve starts from the
    previous tracked step's eigenvector, which typically cuts the number of
    products several-fold; the first solve (and every one with
    ``warm_start=False``) starts, like Cockpit, from i.i.d. ``U[0, 1)``
    entries (``torch.rand_like`` per parameter, drawing from the torch RNG).
    The products used at each tracked step are in :attr:`hvp_counts`.

    Under DistributedDataParallel the Hessian is that of the global batch's
    mean loss: every product is the mean of the ranks' products (one
    all-reduce each) and a cold start uses rank 0's random vector, so every
    rank runs the same iteration and stores the same value
    (``docs/distributed.md``).

    Differences to Cockpit 1.0.2: works on float64 models (Cockpit crashes),
    Rayleigh-Ritz acceleration (``accelerate=False`` with ``warm_start=False``
    is Cockpit's algorithm exactly; the defaults agree with it within its own
    accuracy, typically 1e-3 relative, and are closer to the true
    eigenvalue), warm start, Lanczos instead of scipy, and a zero ``H v``
    returns 0 instead of NaN.

    Args:
        track_schedule: when to compute.
        verbose: print each value.
        use_power: the power iteration's target and stop rule (True) or Lanczos (False).
        accelerate: with ``use_power``, Rayleigh-Ritz accelerated (True) or plain (False).
        warm_start: start from the previous step's eigenvector.
        max_iter: most Hessian-vector products per step.
        rtol: relative tolerance; ``None`` means 1e-3 (power) or 1e-4 (Lanczos).
        atol: absolute tolerance of the power iteration.

    Attributes:
        hvp_counts: ``{global_step: number of Hessian-vector products}``.
        converged: ``{global_step: whether the stop rule was met}``.

    Stored value: the eigenvalue, a Python float.
    """

    def __init__(
        self,
        track_schedule,
        verbose: bool = False,
        use_power: bool = True,
        warm_start: bool = True,
        accelerate: bool = True,
        max_iter: int = 100,
        rtol: float | None = None,
        atol: float = 1e-6,
    ):
        super().__init__(track_schedule, verbose=verbose)
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"HessMaxEV(max_iter=...) needs a positive int, got {max_iter!r}")
        if rtol is not None and not rtol > 0:
            raise ValueError(f"HessMaxEV(rtol=...) must be > 0, got {rtol!r}")
        self._use_power = bool(use_power)
        self._warm_start = bool(warm_start)
        self._accelerate = bool(accelerate)
        self._max_iter = max_iter
        self._rtol = rtol if rtol is not None else (1e-3 if use_power else 1e-4)
        self._atol = atol
        self._previous: torch.Tensor | None = None
        self.hvp_counts: dict[int, int] = {}
        self.converged: dict[int, bool] = {}

    def create_graph(self, global_step: int) -> bool:
        return self.should_compute(global_step)

    def settings(self) -> dict:
        return {
            "use_power": self._use_power,
            "warm_start": self._warm_start,
            "accelerate": self._accelerate,
            "max_iter": self._max_iter,
            "rtol": self._rtol,
            "atol": self._atol,
        }

    def _compute(self, global_step, params, batch_loss):
        matvec = hessian_vector_product(params, "HessMaxEV")
        start = self._start_vector(params)
        if self._use_power:
            solver = accelerated_power_iteration if self._accelerate else power_iteration
            result: EigenResult = solver(
                matvec, start, max_iter=self._max_iter, rtol=self._rtol, atol=self._atol
            )
        else:
            result = lanczos(matvec, start, max_iter=self._max_iter, rtol=self._rtol)
        self._previous = result.vector.detach()
        self.hvp_counts[global_step] = result.num_matvecs
        self.converged[global_step] = result.converged
        return float(result.value)

    def _start_vector(self, params: list[torch.Tensor]) -> torch.Tensor:
        size = sum(p.numel() for p in params)
        previous = self._previous
        if (
            self._warm_start
            and previous is not None
            and previous.numel() == size
            and previous.dtype == params[0].dtype
            and bool(torch.isfinite(previous).all())
            and previous.norm() > 0
        ):
            return previous.to(params[0].device)
        # under DDP every rank starts from rank 0's draw (cockpit_like.backends.distributed)
        return same_on_all_ranks(torch.cat([torch.rand_like(p).reshape(-1) for p in params]))
