"""Block Lanczos on a symmetric operator, and what its Krylov space tells: Ritz pairs, quadrature, traces.

One decomposition, many readers. :func:`lanczos_decomposition` builds an
orthonormal basis ``Q`` of the block Krylov space of a symmetric ``A`` (given
only as ``v -> A v``) from a block of start vectors, with full
re-orthogonalisation, and the projection ``T = Q_m^T A Q_m`` on the ``m``
vectors multiplied so far. From it:

- Ritz pairs ``(theta_i, Q_m y_i)`` with ``T y_i = theta_i y_i``; the residual
  of each is exactly ``||A Q_m y - theta Q_m y|| = ||E y||`` with
  ``E = Q_rest^T A Q_m`` (the coefficients on basis vectors not yet
  multiplied), and every eigenvalue of ``A`` nearest ``theta`` lies within
  that residual (``|lambda - theta| <= ||r||``); the error is typically
  ``||r||^2 / gap``.
- Gauss quadrature of a probe ``u`` (unit, in the space): nodes ``theta_i``,
  weights ``(y_i^T c)^2`` with ``c = Q_m^T u``; then
  ``sum_i w_i f(theta_i) = u^T f(A) u`` exactly for polynomials ``f`` of
  degree up to ``2k - 1`` when the space holds ``K_k(A, u)``. Averaged over
  random unit probes this is stochastic Lanczos quadrature (SLQ) of the
  spectral density ``(1/n) sum_j delta(lambda - lambda_j)``.
- Hutchinson's trace ``n u^T A u`` of a probe ``u = r / sqrt(n)`` with
  Rademacher ``r``, and a Krylov-deflated Hutch++ trace
  ``tr(T) + tr((I - P) A (I - P))``, the second term by Hutchinson on fresh
  probes projected off the space (:func:`deflated_trace`).

The stop rule is on residuals: the largest and the smallest Ritz values both
have ``||r|| + delta <= rtol * max |theta|`` (:meth:`KrylovDecomposition.error_bounds`:
an eigenvalue lies within ``||r||`` where ``A`` is symmetric), and had so one
product per start vector before, the two ends moving by at most the tolerance in
between (``confirm``: a cluster's second eigenvalue can have a small residual
while the first is still hidden), or the space is invariant; never two
consecutive estimates agreeing alone, and never the gap estimate
``||r||^2 / gap`` (:meth:`KrylovDecomposition.error_estimates`), whose gap comes
from the Ritz values found so far and can be optimistic on clustered or near-tied
spectra. ``delta`` (:meth:`KrylovDecomposition.asymmetry`) is how far the products
are from a symmetric operator's on the space: 0 to rounding for a Hessian, but not
where a double backward is wrong (PyTorch's fused ``weight_norm`` treats the norms
as constants); where ``delta`` alone exceeds the tolerance the solve stops
unconverged, since nothing about the eigenvalues can be certified.

Example:
    >>> A = torch.diag(torch.tensor([3.0, 1.0, -2.0, 0.5], dtype=torch.float64))
    >>> K = lanczos_decomposition(lambda v: A @ v, torch.ones(1, 4, dtype=torch.float64), rtol=1e-12)
    >>> [round(x, 8) for x in K.ritz_values().tolist()], K.num_products
    ([-2.0, 0.5, 1.0, 3.0], 4)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "KrylovDecomposition",
    "lanczos_decomposition",
    "gaussian_density",
    "quadrature_moments",
    "deflated_trace",
    "deflated_trace_samples",
    "deflated_diagonal",
    "complement_rows",
    "probe_asymmetry",
]

MatVec = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class KrylovDecomposition:
    """The block Krylov space of one solve.

    Attributes:
        basis: ``[b, n]`` orthonormal rows; the first ``num_products`` were multiplied by ``A``.
        coefficients: ``[b, m]`` float64, column ``j`` the coordinates of ``A q_j`` on the basis
            (``m = num_products``; entries on vectors added later are zero in exact arithmetic).
        probes: ``[p, m]`` float64 coordinates ``Q_m^T u`` of the unit probes (the first ``p``
            start vectors, normalised) in the multiplied space.
        num_products: products ``A v`` evaluated (and kept).
        converged: the stop rule held (or the space became invariant).
        finite: every product was finite; where one was not (inf or NaN: a half-precision graph that
            overflows), the solve stopped before it, unconverged, and the space is that of the products before.
    """

    basis: torch.Tensor
    coefficients: torch.Tensor
    probes: torch.Tensor
    num_products: int
    converged: bool
    finite: bool = True

    @property
    def projection(self) -> torch.Tensor:
        """``T = Q_m^T A Q_m`` (float64, symmetrised)."""
        m = self.num_products
        square = self.coefficients[:m, :m]
        return (square + square.T) / 2

    def _eigh(self) -> tuple[torch.Tensor, torch.Tensor]:
        cache = getattr(self, "_cache", None)
        if cache is None:
            cache = _ritz_pairs(self.coefficients, self.num_products)
            self._cache = cache
        return cache

    def ritz_values(self) -> torch.Tensor:
        """Ritz values, ascending (float64)."""
        return self._eigh()[0]

    def residuals(self) -> torch.Tensor:
        """``||A x_i - theta_i x_i||`` of each Ritz pair, in the order of :meth:`ritz_values`."""
        _, vectors = self._eigh()
        return _residual_norms(self.coefficients[self.num_products :], vectors)

    def asymmetry(self) -> float:
        """``delta = ||(C - C^T) / 2||_2`` of ``C = Q_m^T A Q_m`` as multiplied (:attr:`projection` symmetrises it).

        Every symmetric ``S`` has ``||A - S|| >= delta``: the products differ from those of any symmetric
        operator, the Hessian included, by at least ``delta``. A Hessian's products are symmetric to rounding
        (at most ``2e-6 max|theta|`` in float32 and ``5e-8`` in float64 on the models of
        ``benchmarks/stop_rule.py``, wav2vec2's weight-normed convolution aside); where a double backward is
        wrong they are not (PyTorch's fused ``weight_norm``: ``0.04-0.3 max|theta|`` on a small MLP), and then
        neither the residuals nor the Ritz values say anything about the Hessian.
        """
        return _asymmetry(self.coefficients, self.num_products)

    def _scale(self) -> float:
        values = self.ritz_values()
        return float(values.abs().max()) if values.numel() else 0.0

    def symmetry_tolerance(self, rtol: float) -> float:
        """``max(rtol, eps^(1/3)) * max|theta|`` (``eps`` of the basis' dtype): the largest :meth:`asymmetry` of
        products taken as a symmetric operator's (rounding stays far below ``eps^(1/3)``: 6e-6 in float64,
        5e-3 in float32)."""
        return _symmetry_tolerance(rtol, self._scale(), self.basis.dtype)

    def symmetric(self, rtol: float) -> bool:
        """Whether :meth:`asymmetry` is within :meth:`symmetry_tolerance`: else the products are not a symmetric
        operator's (the solve stopped unconverged) and nothing about the Hessian is certified."""
        return self.asymmetry() <= self.symmetry_tolerance(rtol)

    def error_bounds(self) -> torch.Tensor:
        """``r_i + delta`` per Ritz pair: the residual plus :meth:`asymmetry` where it is above rounding.

        The residual is a rigorous bound for a symmetric operator: an eigenvalue lies within ``r_i`` of
        ``theta_i``. ``delta`` (counted above ``eps^(1/3) max|theta|`` only, so that rounding never
        changes a stop) is added so that products which differ from any symmetric operator's by more than
        the tolerance never pass the stop rule.
        This is what the stop rule uses. It does not say *which* eigenvalue
        that is; the extreme Ritz values approach the extreme eigenvalues from
        inside (``theta_min >= lambda_min``, ``theta_max <= lambda_max``), and
        with random start vectors a small residual at the end of the Ritz
        spectrum means, with high probability, that the extreme eigenvalue was
        found (``benchmarks/stop_rule.py`` measures how often on real models).
        """
        return self.residuals() + _counted_asymmetry(self.asymmetry(), self._scale(), self.basis.dtype)

    def error_estimates(self) -> torch.Tensor:
        """``min(r_i, r_i^2 / gap_i)`` per Ritz value: the typical error, NOT a bound (never used to stop).

        ``gap_i = min_j (|theta_i - theta_j| - r_j)``, the distance to the other
        Ritz values less their own residuals (the Kato-Temple form ``r^2 / gap``).
        The gap is known only to the eigenvalues found so far: an eigenvalue the
        space has not seen yet can lie in between, so the estimate can be far too
        small early in the iteration (the old stop rule stored a wav2vec2 value
        8% low as converged after 4 products this way).
        """
        values, residuals = self.ritz_values(), self.residuals()
        if values.numel() < 2:
            return residuals
        distance = (values.reshape(-1, 1) - values.reshape(1, -1)).abs() - residuals.reshape(1, -1)
        distance.fill_diagonal_(float("inf"))
        gaps = distance.min(dim=1).values
        bounds = residuals**2 / gaps.clamp(min=1e-300)
        return torch.where(gaps > 0, torch.minimum(residuals, bounds), residuals)

    def ritz_vector(self, index: int) -> torch.Tensor:
        """The unit Ritz vector ``Q_m y_index`` (flat, the basis' dtype and device)."""
        _, vectors = self._eigh()
        y = vectors[:, index].to(device=self.basis.device, dtype=self.basis.dtype)
        x = self.basis[: self.num_products].T @ y
        return x / x.norm()

    def quadrature(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Gauss nodes ``[m]`` and weights ``[p, m]`` of each probe (each row sums to ``||Q_m^T u||^2 = 1``)."""
        values, vectors = self._eigh()
        return values, (self.probes @ vectors) ** 2

    def probe_traces(self) -> torch.Tensor:
        """``u^T A u`` of each unit probe ``u`` (exact from ``T``: the probes lie in the multiplied space)."""
        return torch.einsum("pi,ij,pj->p", self.probes, self.projection, self.probes)

    def probe_energies(self) -> torch.Tensor:
        """``||A u||^2`` of each unit probe ``u`` (from the coefficients, no product: ``A u = Q^T C c`` with
        ``c = Q_m^T u`` and ``C`` the coefficients' multiplied columns, up to what the solve found negligible)."""
        m = self.num_products
        products = self.probes @ self.coefficients[:, :m].T.to(self.probes.dtype)
        return products.square().sum(1)


def lanczos_decomposition(
    matvec: MatVec,
    starts: torch.Tensor,
    max_products: int = 100,
    rtol: float = 1e-3,
    probes: int | None = None,
    passes: int = 2,
    restart: Callable[[int], torch.Tensor] | None = None,
    confirm: int | None = None,
) -> KrylovDecomposition:
    """Block Lanczos with full re-orthogonalisation from the rows of ``starts``.

    The start rows are orthonormalised in order (a row already in the span of
    the earlier ones is dropped), then the basis vectors are multiplied in
    order: ``w = A q_j`` is orthogonalised against the basis vectors of the
    band of ``T`` (the block's three-term recurrence), then against the whole
    basis, a second time only where that pass left less than ``1/sqrt(2)`` of
    the norm (Kahan and Parlett's "twice is enough": the basis stays
    orthonormal to working precision); its coordinates are column ``j`` of
    :attr:`KrylovDecomposition.coefficients`, and what is left, if not
    negligible, becomes the next basis vector. With one start row this is
    Lanczos; with ``b`` rows, block Lanczos (the spaces of all rows grow together).

    Stops after a product once every probe was multiplied and both the largest
    and the smallest Ritz value have ``r + delta <= rtol * max |theta|``
    (residual plus asymmetry, the numbers of
    :meth:`KrylovDecomposition.error_bounds`, from the small float64 ``T`` and
    ``E`` kept as the solve goes) and the residuals were within the tolerance
    ``confirm`` products before too, the largest and the smallest Ritz value
    having moved by at most the tolerance since; when the space is the whole
    space (exact), or after ``max_products``. The confirmation is for ends that
    are clusters: the residual says an eigenvalue lies near the extreme Ritz
    value, not that it is the extreme one, and a Ritz value can sit on a
    cluster's second eigenvalue with a small residual while the first is still
    hidden (outside trial 11's medium MLP and CNN, 2,225 and 1,145 parameters,
    4 steps each, 50 draws: an end up to 1.4% off, the CNN's 4.1%, for the 1%
    claimed on 43 of 400 solves without it, 2 with it; 10% more products).
    A space that becomes invariant before it is the
    whole space holds exact eigenpairs, but not necessarily the extreme ones
    (start vectors orthogonal to the extreme eigenvectors: Rademacher starts on
    a Hessian whose top eigenvectors have entries of equal size are so with
    probability ``2^-k``): before 4 products per start vector the solve then
    goes on from a fresh vector of ``restart(m)`` (default: Gaussian, from a
    generator of its own seeded by ``m``) orthogonalised against the space,
    and stops as above (a multiple of the identity: after those products,
    converged). The residual rule waits for 4 products per start vector too: an extreme eigenvalue whose
    eigenvector the starts barely touch is invisible to the first products
    while the residuals of what they found are already small (outside trial
    10: a 6-parameter model with eigenvalues -3.002 and +3.004 stored a
    largest eigenvalue of 0.0022 as converged after 3 products; the starts'
    components on the top eigenvector were 3e-3 and 7e-6). Unconverged where
    ``delta`` (:meth:`KrylovDecomposition.asymmetry`) alone exceeds the
    tolerance (at least ``eps^(1/3) * max|theta|``) when the residuals are within
    it, or the space is invariant: the products are not a symmetric operator's,
    so more of them cannot help (:meth:`KrylovDecomposition.symmetric` is False).

    Memory: the basis takes ``min(n, max_products + b)`` rows of ``n`` at most,
    in blocks of rows that are never copied while it grows (on the CPU one
    block of up to 1 GiB, reserved at once: rows never written take no memory;
    64 MiB blocks elsewhere, allocated as needed), joined once at the end where
    there are several.

    Args:
        matvec: ``v -> A v`` for a symmetric ``A``.
        starts: ``[b, n]`` start vectors (probes first, then e.g. warm starts).
        max_products: most products (capped at ``n``).
        rtol: tolerance of the error estimates, relative to the spectral scale.
        probes: how many leading rows are probes (quadrature, traces); default all.
        passes: most re-orthogonalisation passes over the whole basis per vector (two: twice is enough).
        restart: ``m -> [n]`` a fresh vector where the space became invariant after ``m`` products before it
            was the whole space (default: Gaussian entries from a generator seeded by ``m``, on ``starts``' device).
        confirm: products between the two checks of the residual rule (default: the start vectors that stayed,
            one product each; 0: stop at the first product where the residuals are within the tolerance).
    """
    if starts.dim() != 2:
        raise ValueError(f"starts must be [b, n], got shape {list(starts.shape)}")
    if max_products < 1:
        raise ValueError(f"max_products must be >= 1, got {max_products}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    count_probes = starts.shape[0] if probes is None else probes
    n = starts.shape[1]
    eps = torch.finfo(starts.dtype).eps
    limit = min(max_products, n)
    capacity = min(n, limit + starts.shape[0])  # most basis vectors this solve can hold
    basis = _Basis(starts, capacity)
    unit_probes = []
    for index, row in enumerate(starts):
        norm = _norm(row)
        if not torch.isfinite(norm) or norm == 0:
            if index < count_probes:
                raise ValueError("probe start vectors must be finite and non-zero")
            continue
        unit = row / norm
        if index < count_probes:
            unit_probes.append(unit)
        w = unit.clone()
        for _ in range(passes):
            if basis.size:
                basis.subtract_(w, basis.project(w))
        kept = _norm(w)
        if kept > math.sqrt(eps) and basis.size < capacity:
            basis.append(w, kept)
    if basis.size == 0:
        raise ValueError("the start vectors are all zero")
    band = basis.size  # T is banded: A q_j has coordinates on q_{j-band} .. q_{j+band} only
    # at least 4 products per start vector before the residual rule may stop: an extreme eigenvalue whose
    # eigenvector the starts barely touch (a component of 3e-3) is invisible to the first products, while the
    # residuals of what they found can be within the tolerance already; a few more products make it grow by
    # its gap each (outside trial 10: 0.0022 stored as the converged largest eigenvalue, 3.004, after 3)
    least = _LEAST_PER_START * band
    # the residual rule must hold ``confirm`` products apart (one more product per start vector by default), the
    # ends moving by less than the tolerance in between: where an end is a cluster, the Ritz value can sit on its
    # second eigenvalue with a small residual while the first is still hidden (a medium MLP and CNN at rtol 1e-2:
    # 43 of 400 solves outside the tolerance without it, 2 with it, for 10% more products)
    confirm = band if confirm is None else confirm
    if confirm < 0:
        raise ValueError(f"confirm must be >= 0, got {confirm}")
    held: dict[int, tuple[float, float]] = {}  # m -> (largest, smallest) Ritz value where the residual rule held
    # column j: the coordinates of A q_j on the basis (float64, on the CPU: T on top, E below)
    coefficients = torch.zeros(capacity, limit, dtype=torch.float64, device="cpu")
    converged, finite = False, True
    m = 0
    while m < limit and m < basis.size:
        size = basis.size
        w = matvec(basis.row(m))
        initial = _norm(w)
        low = max(0, m - band)
        coords = basis.project(w, low)  # the recurrence's coordinates: most of A q_j's norm
        w = basis.minus(w, coords, low)  # a new vector: matvec's result is left as it is
        coords = torch.cat([coords.new_zeros(low), coords]).to(torch.float64)
        before = _norm(w)
        for index in range(passes):
            c = basis.project(w)
            basis.subtract_(w, c)
            coords = coords + c.to(torch.float64)
            after = _norm(w)
            # one host transfer per pass: the column and the norms that decide what follows
            column = torch.cat([coords, torch.stack([initial, before, after]).to(torch.float64)]).cpu()
            if index + 1 == passes or float(column[-1]) >= _ENOUGH * float(column[-2]):
                break
            before = after
        if not bool(torch.isfinite(column).all()):  # an inf / NaN product: nothing after it can be trusted
            finite = False
            break
        coefficients[:size, m] = column[:size]
        start_norm, beta = float(column[-3]), float(column[-1])
        if size < capacity and beta > 10 * eps * start_norm:
            basis.append(w, beta)
            coefficients[size, m] = beta
        m += 1
        if m < count_probes:
            continue
        if m < min(least, limit) - confirm and m < basis.size:
            continue  # (see ``least`` above)
        if m >= basis.size and basis.size < n and m < min(least, limit) and basis.size < capacity:
            # invariant, but not the whole space: its eigenpairs need not be the extreme ones; go on from a
            # fresh vector orthogonal to it (the matrix of the space stays block diagonal)
            w = (restart or _gaussian_restart(starts))(m).to(device=starts.device, dtype=starts.dtype).reshape(n)
            norm = _norm(w)
            if torch.isfinite(norm) and norm > 0:
                w = w / norm
                for _ in range(passes):
                    basis.subtract_(w, basis.project(w))
                kept = _norm(w)
                if kept > math.sqrt(eps):
                    basis.append(w, kept)
                    continue
        if m >= basis.size:  # nothing left to multiply: the space is invariant, the Ritz pairs exact
            # (where the products are a symmetric operator's)
            scale = float(_ritz_pairs(coefficients, m)[0].abs().max())
            converged = _asymmetry(coefficients, m) <= _symmetry_tolerance(rtol, scale, starts.dtype)
            break
        values, vectors = _ritz_pairs(coefficients, m)  # what error_bounds() of the result would give
        errors = _residual_norms(coefficients[m : basis.size, :m], vectors)
        tolerance = rtol * float(values.abs().max())
        within = float(errors[0]) <= tolerance and float(errors[-1]) <= tolerance
        if within:
            held[m] = (float(values[-1]), float(values[0]))
        if m < min(least, limit) and m < basis.size:
            continue
        if within:  # and it held ``confirm`` products before, the ends moving by at most the tolerance since
            before = held.get(m - confirm)
            within = before is not None and max(abs(before[0] - held[m][0]), abs(before[1] - held[m][1])) <= tolerance
        if within:
            asymmetry = _asymmetry(coefficients, m)  # (only here: it decides nothing while a residual is larger)
            scale = float(values.abs().max())
            if asymmetry > _symmetry_tolerance(rtol, scale, starts.dtype):
                break  # not a symmetric operator's products (a wrong double backward): nothing to certify
            asymmetry = _counted_asymmetry(asymmetry, scale, starts.dtype)
            if float(errors[0]) + asymmetry <= tolerance and float(errors[-1]) + asymmetry <= tolerance:
                converged = True
                break
    Q = basis.tensor()
    if unit_probes:
        probe_coordinates = (Q[:m] @ torch.stack(unit_probes).T).T.to(torch.float64).cpu()
    else:
        probe_coordinates = torch.zeros(0, m, dtype=torch.float64, device="cpu")
    return KrylovDecomposition(Q, coefficients[: basis.size, :m].clone(), probe_coordinates, m, converged, finite)


#: products per start vector before the residual rule may stop (:func:`lanczos_decomposition`)
_LEAST_PER_START = 4


def _gaussian_restart(starts: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """``m -> [n]`` Gaussian entries from a generator of its own seeded by ``m`` (torch's global one untouched)."""

    def draw(m: int) -> torch.Tensor:
        generator = torch.Generator(device=starts.device)
        generator.manual_seed(0x5EED + m)
        return torch.randn(starts.shape[1], generator=generator, device=starts.device, dtype=starts.dtype)

    return draw


#: a second re-orthogonalisation pass where the first left less than this share of the norm (1/sqrt(2))
_ENOUGH = 1 / math.sqrt(2)

#: bytes per block of basis rows: on the CPU a reservation (rows never written take no memory), elsewhere allocated
_RESERVE_BYTES = 2**30
_BLOCK_BYTES = 64 * 2**20
#: rows per block at least
_BLOCK_ROWS = 8


class _Basis:
    """Orthonormal rows ``[size, n]`` in blocks of rows that are never copied while the basis grows.

    A block holds ``min(capacity, max(8, bytes / row))`` rows, allocated when the basis reaches it
    (``torch.empty``). On the CPU ``bytes`` is 1 GiB: the pages of rows never written are never touched
    and take no memory, so a solve on a model up to ``2**28 / capacity`` parameters (float32) has one
    block, resident as far as it is filled; elsewhere 64 MiB.
    """

    def __init__(self, like: torch.Tensor, capacity: int):
        self.like, self.capacity, self.size = like, capacity, 0
        budget = _RESERVE_BYTES if like.device.type == "cpu" else _BLOCK_BYTES
        row_bytes = max(1, like.shape[1] * like.element_size())
        self.rows_per_block = min(capacity, max(_BLOCK_ROWS, budget // row_bytes))
        self.blocks: list[torch.Tensor] = []

    def _pieces(self, low: int):
        """``(rows, offset)``: views of the rows ``low .. size``, offset of each from ``low``."""
        if len(self.blocks) == 1:
            yield self.blocks[0][low : self.size], 0
            return
        for number, block in enumerate(self.blocks):
            first = number * self.rows_per_block
            begin, end = max(low, first), min(self.size, first + block.shape[0])
            if begin < end:
                yield block[begin - first : end - first], begin - low

    def row(self, index: int) -> torch.Tensor:
        block = self.blocks[index // self.rows_per_block]
        return block[index % self.rows_per_block]

    def append(self, vector: torch.Tensor, norm) -> None:
        """Add the row ``vector / norm``."""
        if self.size == len(self.blocks) * self.rows_per_block:
            rows = min(self.rows_per_block, self.capacity - self.size)
            self.blocks.append(self.like.new_empty(rows, self.like.shape[1]))
        torch.div(vector, norm, out=self.row(self.size))
        self.size += 1

    def project(self, w: torch.Tensor, low: int = 0) -> torch.Tensor:
        """``Q[low:] w``: the coordinates of ``w`` on the rows ``low .. size``."""
        parts = [rows @ w for rows, _ in self._pieces(low)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else w.new_zeros(0)

    def subtract_(self, w: torch.Tensor, c: torch.Tensor, low: int = 0) -> torch.Tensor:
        """``w -= Q[low:]^T c`` in place (no temporary of ``n`` entries)."""
        for rows, offset in self._pieces(low):
            w.addmv_(rows.T, c[offset : offset + rows.shape[0]], alpha=-1)
        return w

    def minus(self, w: torch.Tensor, c: torch.Tensor, low: int = 0) -> torch.Tensor:
        """``w - Q[low:]^T c`` as a new vector, written once (``w`` is left as it is)."""
        pieces = list(self._pieces(low))
        if not pieces:
            return w.clone()
        (rows, offset), rest = pieces[0], pieces[1:]
        result = torch.addmv(w, rows.T, c[offset : offset + rows.shape[0]], alpha=-1)
        for rows, offset in rest:
            result.addmv_(rows.T, c[offset : offset + rows.shape[0]], alpha=-1)
        return result

    def tensor(self) -> torch.Tensor:
        """The ``[size, n]`` basis (a view where it is one block)."""
        if len(self.blocks) == 1:
            return self.blocks[0][: self.size]
        return torch.cat([rows for rows, _ in self._pieces(0)])


def _norm(v: torch.Tensor) -> torch.Tensor:
    """``||v||`` to float64 accuracy: a float32 norm of a million entries can be off by 1e-4 (measured 6.5e-5 on
    3.3M normal entries), which would leave the basis that far from unit length. Converting all of ``v`` to
    float64 costs 12x a float32 norm (5.7 ms on 3.3M entries, three per product), so pieces of
    :data:`_NORM_PIECE` entries are normed in ``v``'s dtype and their squares summed in float64 (0.5 ms; the
    squares' sum 1e-9 off on normal entries, 7e-7 where all entries are equal, a Rademacher start: a float32
    norm accumulates each piece in order, so its error grows with the piece, 2e-5 at 16384 entries)."""
    flat = v.reshape(-1)
    pieces = flat.numel() // _NORM_PIECE
    if flat.dtype == torch.float64 or pieces < 2:
        return torch.linalg.vector_norm(flat, dtype=torch.float64)
    head = flat[: pieces * _NORM_PIECE].view(pieces, _NORM_PIECE)
    squares = torch.linalg.vector_norm(head, dim=1).to(torch.float64).square().sum()
    tail = flat[pieces * _NORM_PIECE :]
    if tail.numel():
        squares = squares + torch.linalg.vector_norm(tail, dtype=torch.float64).square()
    return squares.sqrt()


#: entries per piece of :func:`_norm`
_NORM_PIECE = 1 << 10


def _ritz_pairs(coefficients: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of ``T = (C + C^T) / 2``, ``C`` the top ``m x m`` block of the coefficients."""
    square = coefficients[:m, :m]
    return torch.linalg.eigh((square + square.T) / 2)


def _asymmetry(coefficients: torch.Tensor, m: int) -> float:
    """``||(C - C^T) / 2||_2`` of the top ``m x m`` block of the coefficients (:meth:`KrylovDecomposition.asymmetry`)."""
    square = coefficients[:m, :m]
    if m < 2:
        return 0.0
    return float(torch.linalg.matrix_norm((square - square.T) / 2, ord=2))


def _rounding_asymmetry(dtype: torch.dtype) -> float:
    """``eps^(1/3)``: :meth:`KrylovDecomposition.asymmetry` up to this share of ``max|theta|`` is taken as rounding."""
    return torch.finfo(dtype).eps ** (1 / 3)


def _symmetry_tolerance(rtol: float, scale: float, dtype: torch.dtype) -> float:
    """:meth:`KrylovDecomposition.symmetry_tolerance` of Ritz values up to ``scale`` in magnitude."""
    return max(rtol, _rounding_asymmetry(dtype)) * scale


def _counted_asymmetry(asymmetry: float, scale: float, dtype: torch.dtype) -> float:
    """The asymmetry that :meth:`KrylovDecomposition.error_bounds` adds: 0 where it is rounding."""
    return asymmetry if asymmetry > _rounding_asymmetry(dtype) * scale else 0.0


def _residual_norms(rest: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``||E y_i||`` for each Ritz vector ``y_i`` (``E``: the coordinates on vectors not yet multiplied)."""
    if rest.numel() == 0:
        return vectors.new_zeros(vectors.shape[1])
    return (rest @ vectors).norm(dim=0)


def gaussian_density(
    nodes: torch.Tensor, weights: torch.Tensor, grid: torch.Tensor, width: float
) -> torch.Tensor:
    """``sum_i w_i N(x; theta_i, width^2)`` on ``grid``: a quadrature (SLQ) smoothed into a density.

    ``weights`` may be ``[m]`` or ``[p, m]`` (averaged over the probes).
    """
    if width <= 0:
        raise ValueError(f"width must be > 0, got {width}")
    w = weights.reshape(-1, nodes.numel()).mean(0).to(torch.float64)
    x = grid.to(torch.float64).reshape(-1, 1)
    kernel = torch.exp(-0.5 * ((x - nodes.to(torch.float64).reshape(1, -1)) / width) ** 2)
    return kernel @ w / (width * math.sqrt(2 * math.pi))


def quadrature_moments(nodes: torch.Tensor, weights: torch.Tensor, orders: int) -> torch.Tensor:
    """``[sum_i w_i theta_i^k for k = 0..orders]``, averaged over probes (``weights`` ``[m]`` or ``[p, m]``).

    For a unit probe ``u`` whose Krylov space has ``k`` vectors these equal
    ``u^T A^j u`` for ``j <= 2k - 1``; with ``u = r / sqrt(n)`` (``r`` of i.i.d.
    symmetric entries rescaled to norm ``sqrt(n)``: Rademacher, or the engine's
    start vectors) their expectation is ``tr(A^j) / n``, the moments of the
    spectral density.
    """
    w = weights.reshape(-1, nodes.numel()).mean(0).to(torch.float64)
    powers = nodes.to(torch.float64).reshape(1, -1) ** torch.arange(orders + 1, dtype=torch.float64, device=nodes.device).reshape(-1, 1)
    return powers @ w


def deflated_trace(
    matvec: MatVec, decomposition: KrylovDecomposition, samples: torch.Tensor
) -> tuple[float, float]:
    """Hutch++ on a Krylov space: ``tr(A) ~ tr(T) + mean_k g_k'^T A g_k'`` with ``g' = (I - P) g``.

    ``P = Q_m Q_m^T`` projects on the multiplied space, whose part of the
    trace, ``tr(Q_m^T A Q_m) = tr(T)``, is exact; the rest,
    ``tr((I - P) A (I - P))``, is estimated by Hutchinson on the rows of
    ``samples`` (Rademacher, drawn independently of the space), one product
    each. Unbiased for ``tr(A)`` given the space; its variance is that of
    Hutchinson on ``A`` with the dominant (converged) directions removed.

    Returns:
        ``(estimate, the samples' standard error)`` (NaN for one sample; the cockpit's error bar also
        bounds it by the products' norms: :func:`deflated_trace_samples`).
    """
    inside, values, _ = deflated_trace_samples(matvec, decomposition, samples)
    if not values.numel():
        return inside, math.nan
    spread = float(values.std() / math.sqrt(values.numel())) if values.numel() > 1 else math.nan
    return inside + float(values.mean()), spread


def deflated_trace_samples(
    matvec: MatVec, decomposition: KrylovDecomposition, samples: torch.Tensor
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The pieces of :func:`deflated_trace`: ``(tr(T), [k] samples g_k^T B g_k, [k] squared norms ||B g_k||^2)``.

    ``B = (I - P) A (I - P)`` and ``g_k`` the rows of ``samples`` (Rademacher). The squared norms are what
    :func:`~cockpit_like.backends.hvp.product_standard_errors` bounds the samples' variance with
    (``Var(g^T B g) <= 2 ||B||_F^2 = 2 E ||B g||^2``); they cost no product (``B g = (I - P) A g'``).
    """
    m = decomposition.num_products
    Q = decomposition.basis[:m]
    inside = float(torch.trace(decomposition.projection)) if m else 0.0
    values, energies = [], []
    for g in samples:
        g = g.to(Q.dtype)
        if m:
            g = g - Q.T @ (Q @ g)
            g = g - Q.T @ (Q @ g)
        w = matvec(g)
        if m:
            w = w - Q.T @ (Q @ w)
            w = w - Q.T @ (Q @ w)
        values.append(float(torch.dot(g, w)))
        energies.append(float(torch.dot(w, w)))
    cpu = dict(dtype=torch.float64, device="cpu")  # host numbers (one per sample)
    return inside, torch.tensor(values, **cpu), torch.tensor(energies, **cpu)


def complement_rows(decomposition: KrylovDecomposition, limit: int) -> torch.Tensor | None:
    """``[r, n]`` orthonormal rows spanning what the multiplied space leaves out, where ``r = n - m <= limit``
    (``m`` multiplied basis vectors of ``n``), else ``None``.

    With them the rest of the operator is exact rather than sampled: ``B = (I - P) A (I - P) = C^T M C`` with
    ``M = C A C^T``, ``r`` products ``A c``, no more than Hutchinson's samples when ``limit`` is their number
    (and a few more than them up to ``2x``). A few Rademacher samples of a remainder of a few dimensions can all
    miss its largest direction, and their spread and the products' norms then vanish together: a Hutch++ trace
    of a 12-parameter regression was stored 12.5 standard errors off as reliable (outside trial 28), where 11
    of the 15 products had spanned all but one direction.
    """
    n = decomposition.basis.shape[1]
    m = decomposition.num_products
    if not 0 < n - m <= limit:
        return None
    Q = decomposition.basis[:m].to(torch.float64)
    # the eigenvectors of Q^T Q with eigenvalue 0 (1 on the space): n x n, with n <= m + limit
    values, vectors = torch.linalg.eigh(Q.T @ Q)
    rows = vectors[:, values < 0.5].T
    return rows.to(decomposition.basis.dtype) if rows.shape[0] == n - m else None


#: entries of the basis that :func:`deflated_diagonal` reads per block of columns (16 MiB of float32)
_DIAGONAL_BLOCK = 1 << 22


def deflated_diagonal(
    matvec: MatVec, decomposition: KrylovDecomposition, samples: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The diagonal of ``A``: exact on the Krylov space, Hutchinson on the rest (Hutch++ for the diagonal).

    With ``Q`` the ``m`` multiplied basis vectors (rows), ``P = Q^T Q``, and
    ``A Q^T = Q^T T + R^T E`` (``R`` the basis vectors not yet multiplied,
    ``E`` their coefficients; both in the decomposition, no product):

        diag(A) = diag(Q^T T Q) + 2 diag(Q^T E^T R) + diag((I - P) A (I - P)),

    the last term by Hutchinson, ``g * ((I - P) A (I - P) g)`` for each row
    ``g`` of ``samples`` (Rademacher; one product each). Unbiased for
    ``diag(A)`` given the space; exact when the space is invariant.

    Returns:
        ``(diagonal estimate, [k, n] the samples' estimates of diag((I - P) A (I - P)))``.
    """
    m = decomposition.num_products
    Q = decomposition.basis[:m]
    dtype, device = Q.dtype, Q.device
    n = decomposition.basis.shape[1]
    exact = torch.zeros(n, dtype=dtype, device=device)
    if m:
        T = decomposition.projection.to(dtype=dtype, device=device)
        rest = decomposition.basis[m:]
        E = decomposition.coefficients[m : m + rest.shape[0], :m].to(dtype=dtype, device=device)
        # in blocks of columns: the temporaries are m x width, not two more copies of the basis
        width = max(1024, _DIAGONAL_BLOCK // m)
        for start in range(0, n, width):
            columns = slice(start, start + width)
            mixed = T @ Q[:, columns]
            if rest.shape[0]:
                mixed.addmm_(E.T, rest[:, columns], alpha=2)
            exact[columns] = (Q[:, columns] * mixed).sum(0)

    def deflate_(rows: torch.Tensor) -> torch.Tensor:
        """``rows <- rows (I - P)`` in place, every row at once (a pass reads the basis twice whatever the number
        of rows); a second pass where the first left less than ``1/sqrt(2)`` of a row (what rounding left then
        matters)."""
        if m:
            before = rows.norm(dim=1)
            rows.addmm_(rows @ Q.T, Q, alpha=-1)
            if bool((rows.norm(dim=1) < before / 2**0.5).any()):
                rows.addmm_(rows @ Q.T, Q, alpha=-1)
        return rows

    signs = samples.to(dtype)
    if not signs.shape[0]:
        return exact, torch.zeros(0, n, dtype=dtype, device=device)
    # one k x n buffer: the deflated signs, then (row by row) their products, deflated, times the signs
    work = deflate_(signs.clone())
    for row in work:
        row.copy_(matvec(row))
    estimates = deflate_(work).mul_(signs)
    return exact + estimates.mean(0), estimates


def probe_asymmetry(
    probes: torch.Tensor, products: torch.Tensor, rtol: float, scale: float = 0.0
) -> tuple[float, float]:
    """``(delta, tolerance)`` of the products of a few probes: ``C_ij = p_i^T (A p_j) / (||p_i|| ||p_j||)``,
    ``delta = ||(C - C^T) / 2||_2``, and the tolerance :func:`_symmetry_tolerance` of the larger of
    ``||(C + C^T) / 2||_2`` and ``scale`` (``max(rtol, eps^(1/3))`` of it). ``A`` symmetric gives ``delta`` at
    rounding; more says the products are not a symmetric operator's (a wrong double backward), whatever estimator
    reads them. Fewer than two probes: ``(0, 0)``.

    Args:
        probes: ``[k, n]`` (rows).
        products: ``[k, n]``, row ``i`` the operator applied to probe ``i``.
        scale: the size of the operator the products' rounding is relative to, where ``A`` is a part of it (the
            Hessian deflated by a Krylov space that holds nearly all of it: its products are rounding, ``C``'s
            symmetric part is no scale then; ``max|theta|`` of the space is).
    """
    if probes.shape[0] < 2:
        return 0.0, 0.0
    p = probes.to(torch.float64)
    norms = p.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    C = (p @ products.to(torch.float64).T) / (norms[:, None] * norms[None, :])
    if not bool(torch.isfinite(C).all()):
        return 0.0, 0.0  # (the estimators' own checks speak for products that are not finite)
    delta = float(torch.linalg.matrix_norm((C - C.T) / 2, ord=2))
    scale = max(float(torch.linalg.matrix_norm((C + C.T) / 2, ord=2)), float(scale))
    return delta, _symmetry_tolerance(rtol, scale, products.dtype)
