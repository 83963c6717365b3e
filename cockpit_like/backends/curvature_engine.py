"""One Lanczos decomposition of the Hessian per step, shared by every curvature quantity tracked there.

:class:`LanczosNeed` is a step need (merged by value, computed once after the
step's last backward pass, read with ``record.stat(need)``): block Lanczos
with full re-orthogonalisation
(:func:`cockpit_like.functional.krylov.lanczos_decomposition`) on the
Hessian-vector products of the mean loss through the graph of ``p.grad``
(:func:`~cockpit_like.backends.hvp.hessian_vector_product`), with respect to
the trainable parameters (frozen ones are left out of the operator:
:func:`~cockpit_like.backends.hvp.curvature_params`). Its start block is
``probes`` random vectors (:func:`start_vectors`: random signs times random
magnitudes; unbiased probes for spectral density and trace, the same draw on
every rank; see :func:`step_generator`: the cockpit's own generator, seeded
per step; torch's RNG is never read or advanced) followed by the warm
start: the previous tracked step's top and bottom Ritz vectors, which the
quantities keep and hand back in :class:`WarmStart`. The result, a
:class:`~cockpit_like.functional.krylov.KrylovDecomposition`, gives the
extreme eigenvalues (HessMaxEV, HessEigenvalues), the Gauss quadrature of the
probes (HessSpectralDensity) and Hutchinson's trace of the probes.

:class:`KrylovTrace` builds on it: Hutch++ on the Krylov space (exact trace
of the projection plus Hutchinson on the rest, ``samples`` more products);
:class:`DeflatedDiagonal` the same for the diagonal, and
:class:`SharedSpaceDiagonal` (``curvature="auto"``'s Hessian diagonal where
BackPACK cannot run) Hutch++ at the steps that compute the decomposition for
another quantity anyway, Hutchinson's diagonal at the others.

Under DDP every product is already the global one (``global_product``) and the
start vectors are the same on every rank, so the result is identical on all
ranks and :meth:`LanczosNeed.across_ranks` keeps it as it is.

May import torch and :mod:`cockpit_like.functional`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cockpit_like.backends.distributed import same_on_all_ranks
from cockpit_like.backends.hvp import (
    SYMMETRY_PROBES, HutchinsonDiagonal, curvature_params, hessian_vector_product, operator_dtype,
    product_standard_errors, scatter_blocks,
)
from cockpit_like.backends.randomness import generator
from cockpit_like.functional.krylov import (
    KrylovDecomposition,
    complement_rows,
    deflated_diagonal,
    deflated_trace_samples,
    lanczos_decomposition,
    probe_asymmetry,
)

__all__ = ["WarmStart", "LanczosNeed", "KrylovTrace", "DeflatedDiagonal", "SharedSpaceDiagonal", "DEFAULT_RTOL", "DEFAULT_PROBES", "rademacher", "start_vectors", "step_generator"]

#: tolerance of the shared decomposition: the extreme Ritz values' residuals are then ``<= rtol * max|theta|``
DEFAULT_RTOL = 1e-2

#: start vectors of the block (:func:`start_vectors`): with one, a draw nearly orthogonal to the top
#: eigenvector lets Lanczos converge to the second of a near-tied end first (measured in benchmarks/stop_rule.py)
DEFAULT_PROBES = 2

_OWNER = "the curvature engine (HessMaxEV, HessEigenvalues, HessSpectralDensity, HessTraceEstimate)"


@dataclass(frozen=True, eq=False)
class WarmStart:
    """Start vectors kept from an earlier step, compared by value (equal tensors: equal warm starts)."""

    vectors: tuple

    def __eq__(self, other) -> bool:
        if not isinstance(other, WarmStart) or len(other.vectors) != len(self.vectors):
            return False
        return all(
            a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
            for a, b in zip(self.vectors, other.vectors)
        )

    def __hash__(self) -> int:
        return hash(tuple((tuple(v.shape), str(v.dtype)) for v in self.vectors))


def _dimension(params: list[torch.Tensor]) -> int:
    """The size of the Hessian-vector products' vectors: the trainable parameters' entries."""
    return sum(params[i].numel() for i in curvature_params(params))


def step_generator(step: int, purpose: str, device="cpu") -> torch.Generator:
    """The cockpit's generator for ``purpose`` at ``step`` (:func:`cockpit_like.backends.randomness.generator`).

    Seeded from the cockpit's fixed seed, the step and ``purpose`` only: the
    draws of the engine do not depend on how many other draws happened at the
    step or before (a quantity gives the same numbers alone and with others),
    and torch's own generators are neither read nor advanced, so the
    training's random stream (dropout, shuffling) is the same with and without
    the cockpit.
    """
    return generator(step, purpose, device)


def rademacher(count: int, size: int, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """``[count, size]`` i.i.d. entries ``+-1`` from ``generator``, rank 0's draw on every rank."""
    return same_on_all_ranks(_signs(count, size, dtype, device, generator))


def _signs(count: int, size: int, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """``[count, size]`` i.i.d. entries ``+-1`` from ``generator`` (this rank's draw)."""
    return torch.randint(0, 2, (count, size), device=device, generator=generator).to(dtype).mul_(2).sub_(1)


#: the magnitudes of the start vectors' entries are uniform on ``[1 - spread, 1 + spread]`` (:func:`start_vectors`)
MAGNITUDE_SPREAD = 0.5


def start_vectors(count: int, size: int, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """``[count, size]`` start vectors of the engine's block: random signs times random magnitudes.

    Entry ``i`` of a row is ``s_i * m_i`` with ``s_i = +-1`` and ``m_i`` uniform on ``[1 - MAGNITUDE_SPREAD,
    1 + MAGNITUDE_SPREAD]``, all independent; each row is rescaled to squared norm ``size``. So
    ``u = row / sqrt(size)`` is a unit probe with ``E[u u^T] = I / size`` (the signs make the cross terms vanish,
    exchangeability the diagonal): unbiased traces and spectral densities. Why not plain Rademacher rows (``m_i = 1``):
    a +-1 vector is *exactly* orthogonal, with probability 1/2, to an eigenvector such as ``(e_i - e_j) / sqrt(2)``
    (two units a model's symmetry makes interchangeable), and with two such starts a whole end of the spectrum was
    missed and stored as converged (outside trial 10: 73 of 200 draws on a 12-parameter quadratic; none with random
    magnitudes). Why not Gaussian rows: their component on an eigenvector concentrated on a few coordinates can be
    small, where a sign vector's is never below ``1 / sqrt(size)`` per coordinate, and this keeps that within a factor
    of 1 - MAGNITUDE_SPREAD (a Gaussian second start took 6% more products on gpt over 7 tracked steps, these 2%
    more; 3c3d 2% fewer). Rank 0's draw on every rank.
    """
    wide = torch.float32 if dtype.itemsize < 4 else dtype  # (half precision: drawn and scaled in float32)
    signs = _signs(count, size, wide, device, generator)
    rows = torch.rand(count, size, device=device, generator=generator, dtype=wide)
    rows = rows.mul_(2 * MAGNITUDE_SPREAD).add_(1 - MAGNITUDE_SPREAD).mul_(signs)
    rows = rows.mul_(math.sqrt(size) / rows.norm(dim=1, keepdim=True))
    return same_on_all_ranks(rows.to(dtype))


@dataclass(frozen=True)
class LanczosNeed:
    """Need: the step's block Lanczos decomposition of the Hessian of the mean loss (all tracked params).

    Args:
        max_products: most Hessian-vector products.
        rtol: stop once the largest and the smallest Ritz values have residuals ``<= rtol * max|theta|``.
        probes: start vectors (spectral density and trace probes; :func:`start_vectors`).
        warm: the previous step's Ritz vectors, multiplied after the probes (``None``: a cold start).
    """

    max_products: int = 100
    rtol: float = DEFAULT_RTOL
    probes: int = DEFAULT_PROBES
    warm: WarmStart | None = field(default=None)

    #: computed once per optimizer step, after its last backward pass (through the accumulated p.grad)
    whole_step = True

    def compute(self, execution) -> KrylovDecomposition:
        params = execution.params
        matvec = hessian_vector_product(params, _OWNER)
        size = _dimension(params)  # the trainable parameters (frozen ones are left out of the operator)
        dtype, device = operator_dtype(params), params[0].device
        generator = step_generator(execution.step, "lanczos probes", device)
        rows = list(start_vectors(self.probes, size, dtype, device, generator))
        if self.warm is not None:
            rows += [
                v.to(device) for v in self.warm.vectors
                if v.numel() == size and v.dtype == dtype and bool(torch.isfinite(v).all()) and v.norm() > 0
            ]
        # where the space becomes invariant early, a fresh vector of the same kind, from the step's own generator
        # (a purpose of its own: the probes are the same whether or not a restart happens)
        restarts = step_generator(execution.step, "lanczos restarts", device)
        return lanczos_decomposition(
            matvec, torch.stack(rows), max_products=self.max_products, rtol=self.rtol, probes=self.probes,
            restart=lambda m: start_vectors(1, size, dtype, device, restarts)[0],
        )

    def across_ranks(self, result, reduction):
        """Under DDP: the same on every rank already (global products, rank 0's probes)."""
        return lambda: result


def _rounding(params, size: int, terms: float) -> float:
    """The rounding of a sum over ``size`` entries whose terms add up to ``terms`` in magnitude (``eps sqrt(D)``)."""
    return float(torch.finfo(operator_dtype(params)).eps) * math.sqrt(max(size, 1)) * terms


def _exact_rest(matvec, decomposition, rows: torch.Tensor, keep: bool = False):
    """``(tr(T), M)`` with ``M = C H C^T`` (float64, symmetrised) for the rows ``C`` of
    :func:`~cockpit_like.functional.krylov.complement_rows`: ``tr(H) = tr(T) + tr(M)`` exactly, one product per
    row (``keep``: the products ``H c`` too, as a third element)."""
    products = torch.stack([matvec(row) for row in rows])
    square = rows.to(torch.float64) @ products.to(torch.float64).T
    inside = float(torch.trace(decomposition.projection)) if decomposition.num_products else 0.0
    rest = (square + square.T) / 2
    return (inside, rest, products) if keep else (inside, rest)


@dataclass(frozen=True)
class KrylovTrace:
    """Need: Hutch++ trace of the Hessian on the step's Lanczos space, ``samples`` more products.

    Result: ``{"estimate", "standard_error", "sample_error", "product_error", "projected", "products"}`` with
    ``estimate = tr(T) + mean_k g_k'^T H g_k'`` (:func:`~cockpit_like.functional.krylov.deflated_trace`).
    The standard error is the larger of the samples' and the bound from the products' squared norms on the
    deflated operator (:func:`~cockpit_like.backends.hvp.product_standard_errors`, as for HessTrace): the
    samples' spread alone, from 4 numbers, was far too small at times (the exact trace 20 errors away).
    """

    samples: int = 4
    lanczos: LanczosNeed = field(default_factory=LanczosNeed)

    whole_step = True

    def compute(self, execution) -> dict:
        decomposition = execution.whole_step_result(self.lanczos)  # first: its probes are drawn first
        params = execution.params
        matvec = hessian_vector_product(params, _OWNER)
        size = _dimension(params)
        device = params[0].device
        rows = complement_rows(decomposition, 2 * self.samples) if self.samples else None
        if rows is not None:  # a few directions left: the rest exact from as many products (no more than 2x)
            inside, rest = _exact_rest(matvec, decomposition, rows)
            terms = float(decomposition.ritz_values().abs().sum()) + float(rest.diagonal().abs().sum())
            floor = _rounding(params, size, terms)
            return {"estimate": inside + float(rest.trace()), "standard_error": floor, "sample_error": 0.0,
                    "product_error": 0.0, "projected": inside, "products": rows.shape[0], "exact": True}
        samples = rademacher(self.samples, size, operator_dtype(params), device, step_generator(execution.step, "hutch++", device))
        inside, values, energies = deflated_trace_samples(matvec, decomposition, samples)
        errors = product_standard_errors(values.reshape(-1, 1), energies.reshape(-1, 1))
        # never below the rounding of the sums (eps x sqrt(D) x the sum of |terms|, as HessTrace's): on a space
        # that holds the whole operator the samples' part is rounding, and its spread (1e-62 in float64 next to
        # a trace 1e-16 off, outside trials 9 and 10) no error bar
        terms = float(decomposition.ritz_values().abs().sum()) + (float(values.abs().mean()) if values.numel() else 0.0)
        floor = _rounding(params, size, terms)
        return {
            "estimate": inside + float(values.mean()) if values.numel() else inside,
            "standard_error": max(float(errors["trace_error"]), floor) if values.numel() else math.nan,
            "sample_error": errors["sample_errors"]["trace_error"],
            "product_error": errors["product_errors"]["trace_error"],
            "projected": float(torch.trace(decomposition.projection)),
            "products": self.samples,
        }

    def across_ranks(self, result, reduction):
        """Under DDP: the same on every rank already."""
        return lambda: result


@dataclass(frozen=True)
class DeflatedDiagonal:
    """Need: the Hessian diagonal, exact on the step's Lanczos space, Hutchinson on the rest (``samples`` products).

    With ``Q`` the ``m`` multiplied basis vectors of the decomposition
    (:class:`LanczosNeed`, rows), ``P = Q^T Q`` and ``H Q^T = Q^T T + R^T E``
    (``R`` the basis vectors not yet multiplied, ``E`` their coefficients: all
    known from the decomposition, no product),

        diag(H) = diag(Q^T T Q) + 2 diag(Q^T (E^T R)) + diag((I - P) H (I - P)),

    the first two terms exact, the last by Hutchinson,
    ``(1/K) sum_k g_k * ((I - P) H (I - P) g_k)`` with Rademacher ``g_k`` from
    the cockpit's generator (one product each): unbiased for ``diag(H)``, with
    the variance of Hutchinson on the Hessian less its dominant directions,
    which the Lanczos space holds. Summed over a parameter's entries it is an
    unbiased estimate of that block's trace. Its standard error (the exact
    part has none) is the larger of the ``K`` samples' and the conservative
    bound from the products' squared norms
    (:func:`~cockpit_like.backends.hvp.product_standard_errors`, on the
    deflated operator ``(I - P) H (I - P)``).

    The math is :func:`~cockpit_like.functional.krylov.deflated_diagonal`.

    Result: ``{"diagonal": [tensor per param], "block_errors": [float per param],
    "trace_error": float, "sample_errors", "product_errors", "products": K}`` (the two
    ``{"block_errors", "trace_error"}`` that the errors are the larger of).
    """

    samples: int = 4
    lanczos: LanczosNeed = field(default_factory=LanczosNeed)

    whole_step = True

    def compute(self, execution) -> dict:
        decomposition = execution.whole_step_result(self.lanczos)
        params = execution.params
        matvec = hessian_vector_product(params, _OWNER)
        indices = curvature_params(params)  # the trainable parameters; frozen ones get zeros
        sizes = [params[i].numel() for i in indices]
        dtype, device = operator_dtype(params), params[0].device
        rows = complement_rows(decomposition, 2 * self.samples) if self.samples else None
        if rows is not None:  # a few directions left: the rest exact from as many products (no more than 2x)
            return self._exact(matvec, decomposition, rows, params, indices, sizes)
        draws = rademacher(self.samples, sum(sizes), dtype, device, step_generator(execution.step, "deflated diagonal", device))
        diagonal, estimates = deflated_diagonal(matvec, decomposition, draws)
        pieces = estimates.split(sizes, dim=1)
        blocks = torch.stack([piece.sum(1) for piece in pieces], dim=1).to(torch.float64).cpu()
        # the exact part has no error; the samples' block sums are i.i.d., and the rows of ``estimates`` are
        # g * (B g) with B = (I - P) H (I - P) and g = +-1, so their squares are those of the products B g
        energies = torch.stack([piece.square().sum(1) for piece in pieces], dim=1).cpu()
        errors = product_standard_errors(blocks, energies)

        def spread(found: dict) -> dict:  # per trainable block -> per parameter (a frozen one's block is 0, exactly)
            block_errors = [0.0] * len(params)
            for index, error in zip(indices, found["block_errors"]):
                block_errors[index] = error
            return {"block_errors": block_errors, "trace_error": found["trace_error"]}

        # the products are a symmetric operator's, or nothing from them is the Hessian's: the decomposition's own
        # check, and the probes' (outside trial 27: a LayerNorm's wrong third derivative under a gradient penalty
        # withheld HessMaxEV, and this trace was stored 0.7-2.8 errors high)
        # (the deflated products B g_k are the samples' rows times the signs g_k = +-1, and g_i^T B g_j is their
        # bilinear form: B = (I - P) H (I - P) is symmetric where H is)
        asymmetry = (decomposition.asymmetry(), decomposition.symmetry_tolerance(self.lanczos.rtol))
        if asymmetry[0] <= asymmetry[1] and self.samples > 1:
            probes = draws[:SYMMETRY_PROBES].to(estimates.dtype)
            theta = decomposition.ritz_values() if decomposition.num_products else None
            scale = float(theta.abs().max()) if theta is not None and theta.numel() else 0.0
            asymmetry = probe_asymmetry(probes, estimates[:SYMMETRY_PROBES] * probes, self.lanczos.rtol, scale)
        return {
            "diagonal": scatter_blocks(list(diagonal.split(sizes)), indices, params),
            **spread(errors),
            "sample_errors": spread(errors["sample_errors"]),
            "product_errors": spread(errors["product_errors"]),
            "products": self.samples,
            "asymmetry": asymmetry,
        }

    def _exact(self, matvec, decomposition, rows, params, indices, sizes) -> dict:
        """The diagonal where :func:`~cockpit_like.functional.krylov.complement_rows` leaves ``r`` directions:
        ``diag(H) = exact part + diag(C^T M C)``, ``M = C H C^T`` from ``r`` products; errors at rounding."""
        exact, _ = deflated_diagonal(matvec, decomposition, decomposition.basis.new_zeros(0, sum(sizes)))
        _, rest, products = _exact_rest(matvec, decomposition, rows, keep=True)
        rows64 = rows.to(torch.float64)
        diagonal = exact + ((rows64.T @ rest) * rows64.T).sum(1).to(exact.dtype)
        eps = float(torch.finfo(exact.dtype).eps) * math.sqrt(max(exact.numel(), 1))
        blocks = [eps * (float(piece.abs().sum()) + float(rest.diagonal().abs().sum())) for piece in diagonal.split(sizes)]
        block_errors = [0.0] * len(params)
        for index, error in zip(indices, blocks):
            block_errors[index] = error
        errors = {"block_errors": block_errors, "trace_error": sum(blocks)}
        theta = decomposition.ritz_values()
        scale = float(theta.abs().max()) if theta.numel() else 0.0
        asymmetry = (decomposition.asymmetry(), decomposition.symmetry_tolerance(self.lanczos.rtol))
        if asymmetry[0] <= asymmetry[1] and rows.shape[0] > 1:
            asymmetry = probe_asymmetry(rows[:SYMMETRY_PROBES], products[:SYMMETRY_PROBES], self.lanczos.rtol, scale)
        return {
            "diagonal": scatter_blocks(list(diagonal.split(sizes)), indices, params),
            **errors,
            "sample_errors": dict(errors),
            "product_errors": dict(errors),
            "products": rows.shape[0],
            "asymmetry": asymmetry,
            "exact": True,
        }

    def across_ranks(self, result, reduction):
        """Under DDP: the same on every rank already (global products, the same draws)."""
        return lambda: result


@dataclass(frozen=True)
class SharedSpaceDiagonal:
    """Need: the Hessian diagonal from ``samples`` products, deflated by the step's Lanczos space where the step
    computes one anyway.

    It is never computed itself: it is met by another need of the step
    (:meth:`resolve`, ``StepNeeds.aliases``). Where another quantity of the
    step asked for a :class:`LanczosNeed` (HessMaxEV, HessEigenvalues, ... in
    the ``full`` preset), by :class:`DeflatedDiagonal` on that decomposition:
    exact on the Krylov space, Hutchinson on the rest, the same ``samples``
    products and so the same cost but for two reads of the basis per pass; on
    12 models BackPACK cannot handle it lowered the trace's median error from
    70% to 52% of the value (``benchmarks/trace_estimators.py``). At the other
    steps by :class:`~cockpit_like.backends.hvp.HutchinsonDiagonal` (no
    decomposition is computed for it). Both are unbiased; the result says
    which: a :class:`DeflatedDiagonal` result dict (Hutch++) or a
    :class:`~cockpit_like.backends.hvp.DiagonalEstimate` (Hutchinson). A
    quantity that asked for either explicitly shares its products.
    """

    samples: int = 4

    def resolve(self, needs: tuple) -> DeflatedDiagonal | HutchinsonDiagonal:
        """The need of the step that meets this one, given every need asked for at the step."""
        space = next((need for need in needs if isinstance(need, LanczosNeed)), None)
        return HutchinsonDiagonal(self.samples) if space is None else DeflatedDiagonal(self.samples, space)
