"""Histogram counting of per-sample gradients, bin for bin as the reference rules.

The counts are exactly those of :mod:`cockpit_like.functional.histograms`
(QUANTITIES.md §6):

- 1-D: ``torch.histc`` on data clamped to ``[lo, hi]``: bin
  ``trunc((x - lo) * bins / (hi - lo))`` computed in the data dtype with the
  edges ``lo``, ``hi`` rounded to it (as ``histc`` does), ``x = hi`` in the
  last bin, NaN not counted.
- 2-D: ``trunc((x - lo) / w)`` per axis on data clamped to the end-bin centres; a pair with a NaN (the
  gradient entry or the parameter's) is not counted either (:meth:`Hist2dCounter.dropped` counts them).

Instead of ``histc`` (slow on CPU) or whole-tensor temporaries (a large
allocation is paid in page faults), values are processed in chunks of about
:data:`CHUNK` entries through two reused buffers: one fused
scale/clamp/shift/scale pass in place, one truncation (through int32), one
``scatter_add_`` of ones into the int64 counts. Chunks come either from a ``grad_batch`` tensor or, for
a linear layer, from its factors (``delta_i x_i^T`` for a few samples at a
time, each entry a single product and hence bitwise equal to BackPACK's
``grad_batch``), so no ``[B, out, in]`` tensor is needed.

Sparse factors (ReLU networks): a product ``delta_ia x_ib`` with a zero
factor is exactly ``+-0`` (finite factors), and ``+0``/``-0`` share one bin
under both rules. So :meth:`Hist1dCounter.count_outer` and
:meth:`Hist2dCounter.count_outer` enumerate only, per sample, the nonzero
entries of ``delta_i`` times the nonzero entries of ``x_i`` (moved to the
front of each row by a stable sort, padded with zeros to the largest count
of the few samples of a chunk), and add every other entry to the bin of
``0`` analytically: the bin of a zero passed through the same binning code;
in 2-D the zero products of position ``(a, b)`` number
``B - (M_delta^T M_x)[a, b]`` (``M`` the 0/1 masks of enumerated positions)
and go to the column of ``theta_ab``. Counts are identical to the dense
path; 1-D uses it when all factors are finite, the layer has at least
:data:`SPARSE_MIN_ENTRIES` entries and the padded products are fewer than
:data:`SPARSE_SHARE` of all entries (2-D only on request, see
:meth:`Hist2dCounter.count_outer`).

Sorted blocks (1-D, :class:`_SortedBlocks`): for a fixed finite ``delta_ia``
the bin of ``B * delta_ia * x_ib`` is a monotone function of ``x_ib``:
rounding to nearest is monotone, and so is every step of the bin rule
(clamp, subtract, multiply and divide by positive numbers, truncate). With
each ``x_i`` sorted, the row ``b -> bin`` is monotone, so a block of
consecutive sorted entries whose first entry and the first entry after it
fall into the same bin lies in that bin as a whole and is counted with one
evaluation. Only blocks that straddle a bin edge are enumerated. Gradients
are usually small against the histogram range, so a row of ``in`` products
touches a few bins and costs about ``in / block`` evaluations instead of
``in``. The block size follows the expected number of edges per row,
estimated from ``|delta_ia| * (max x_i - min x_i)``, and the path is taken
where its estimated cost beats the dense and sparse enumerations. Counts are
identical to them.

Listing (2-D, :class:`_Dominant2d`): each position ``(a, b)`` has one
y-bin, so the products that fall into the x-bins next to zero need not be
enumerated: their number per y-bin follows from sign counts per position
(two matrix products of the sign patterns of ``delta`` and ``x``). Only the
products outside a band around zero (``|x_ib|`` beyond a cut per row, found
by a search in the sorted ``|x_i|``) are enumerated. The band's ends are
checked with the binning code itself, so the counts are identical too.

Which path runs (all give the same counts):

==========================  ==========================================================
1-D ``count_outer``         sorted blocks (CPU, >= :data:`SORTED_MIN_ENTRIES`, cheaper
                            by the estimate), else sparse (ReLU zeros), else dense
2-D ``count_outer``         listing (CPU, >= :data:`DOMINANT_MIN_ENTRIES`, at most
                            :data:`DOMINANT_SHARE` listed), else dense
``count_grad_batch``        dense chunks (conv layers, biases)
==========================  ==========================================================
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

__all__ = [
    "CHUNK",
    "DEVICE_CHUNK",
    "default_chunk",
    "SLICE",
    "SPARSE_SHARE",
    "SPARSE_MIN_ENTRIES",
    "SORTED_MIN_ENTRIES",
    "DOMINANT_MIN_ENTRIES",
    "DOMINANT_SHARE",
    "Hist1dCounter",
    "Hist2dCounter",
]

#: entries per chunk on the CPU (float + int64 buffers of this size stay in cache)
CHUNK = 1 << 16

#: entries per chunk on an accelerator (buffers of ~20 bytes per entry: 40 MB): there every chunk costs a
#: handful of kernel launches, and the CPU's chunk made ~550 chunks, ~5000 launches, of one economy step
#: of the resnet benchmark (batch 128) on an H200, where the plain step takes 7 ms
DEVICE_CHUNK = 1 << 21


def default_chunk(device: torch.device) -> int:
    """The chunk of :data:`CHUNK` entries on the CPU, :data:`DEVICE_CHUNK` on any other device."""
    return CHUNK if torch.device(device).type == "cpu" else DEVICE_CHUNK

#: a sample with more entries than a chunk is counted in slices of this many entries (or of the chunk,
#: if larger): buffers of ~20 bytes per entry, 20 MB, not one sample's size (a large embedding's row)
SLICE = 1 << 20

#: the sparse path runs if (max nnz of delta_i) * (max nnz of x_i) < SPARSE_SHARE * out * in
SPARSE_SHARE = 0.75

#: ... and the layer has at least this many per-sample gradient entries (B * out * in)
SPARSE_MIN_ENTRIES = 4 * CHUNK

#: the sorted-block path (1-D) is considered from this many per-sample gradient entries on
SORTED_MIN_ENTRIES = 4 * CHUNK

#: block sizes the automatic choice of the sorted-block path picks from
BLOCK_RANGE = (4, 64)

#: the 2-D path that lists only products outside the bins around zero is taken from this
#: many per-sample gradient entries on (CPU) ...
DOMINANT_MIN_ENTRIES = 1 << 22

#: ... where it lists at most this share of them (a listed product costs ~8 dense ones)
DOMINANT_SHARE = 0.08


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(float(value), dtype=dtype))


def _chunks_of_grad_batch(grad_batch: torch.Tensor, chunk: int) -> Iterator[tuple[torch.Tensor, int, int]]:
    """``(part, start, stop)``: views ``[rows, stop - start]`` of ``grad_batch`` reshaped ``[B, P]`` (columns
    ``start:stop``): a few whole rows of about ``chunk`` entries at a time, or a row longer than ``chunk``
    (e.g. one sample's gradient of a large embedding) in slices of :data:`SLICE` columns."""
    flat = grad_batch.detach().reshape(grad_batch.shape[0], -1)
    width = flat.shape[1]
    if width <= chunk:
        rows = max(1, chunk // max(1, width))
        for start in range(0, flat.shape[0], rows):
            yield flat[start : start + rows], 0, width
        return
    piece = max(chunk, SLICE)
    for row in range(flat.shape[0]):
        for start in range(0, width, piece):
            yield flat[row : row + 1, start : start + piece], start, min(start + piece, width)


class _Buffers:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.values = torch.empty(size, dtype=dtype, device=device)
        self.index = torch.empty(size, dtype=torch.int64, device=device)
        self._ones = torch.ones(size, dtype=torch.int64, device=device)

    def count(self, counts: torch.Tensor, index: torch.Tensor) -> None:
        """``counts[k] += #{index == k}`` (``scatter_add_``: about 3x faster than ``bincount`` on CPU)."""
        flat = index.reshape(-1)
        counts.scatter_add_(0, flat, self._ones[: flat.numel()])

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        n = 1
        for s in shape:
            n *= s
        return self.values[:n].view(shape), self.index[:n].view(shape)


def _outer_chunks(
    x: torch.Tensor, delta: torch.Tensor, chunk: int, buffers: _Buffers
) -> Iterator[tuple[torch.Tensor, int, int]]:
    """``(values, start, stop)``: ``delta_i x_i^T`` for a few samples at a time, or, where one sample has more
    than ``chunk`` entries, for rows ``a`` of one sample, :data:`SLICE` entries at a time, written into ``buffers.values``
    as ``[rows, stop - start]`` (``start:stop`` the entries of the flattened ``[out, in]``)."""
    batch, out = delta.shape
    width = x.shape[1]
    if out * width <= chunk:
        rows = max(1, chunk // max(1, out * width))
        for start in range(0, batch, rows):
            d, xs = delta[start : start + rows], x[start : start + rows]
            values, _ = buffers.take((d.shape[0], out, width))
            torch.mul(d.unsqueeze(2), xs.unsqueeze(1), out=values)
            yield values.view(d.shape[0], out * width), 0, out * width
        return
    rows = max(1, max(chunk, SLICE) // max(1, width))
    for i in range(batch):
        for a in range(0, out, rows):
            d = delta[i, a : a + rows]
            values, _ = buffers.take((d.shape[0], width))
            torch.mul(d.unsqueeze(1), x[i].unsqueeze(0), out=values)
            yield values.view(1, -1), a * width, (a + d.shape[0]) * width


def _outer_size(x: torch.Tensor, delta: torch.Tensor, chunk: int) -> int:
    """Entries of the largest block :func:`_outer_chunks` yields."""
    out, width = delta.shape[1], x.shape[1]
    if out * width <= chunk:
        return min(max(1, chunk // max(1, out * width)), delta.shape[0]) * out * width
    return min(max(1, max(chunk, SLICE) // max(1, width)), out) * width


def _truncate(values: torch.Tensor, index: torch.Tensor) -> None:
    """``index = trunc(values)`` (values clamped to a few bins), through int32: about 2x faster on CPU."""
    index.copy_(values.to(torch.int32))


class _SparseFactors:
    """Per sample, the nonzero entries of ``delta_i`` and ``x_i`` moved to the front of their rows.

    ``d[i, :nd[i]]`` are ``delta_i``'s nonzero entries in order, ``od[i]`` their
    positions; later columns hold zeros of ``delta_i`` (values ``+-0``) and
    their positions. Likewise ``xv``, ``ox``, ``nx`` for ``x``.
    """

    def __init__(self, x: torch.Tensor, delta: torch.Tensor):
        self.d, self.od, self.nd = self._compact(delta)
        self.xv, self.ox, self.nx = self._compact(x)
        self.batch, self.out = delta.shape
        self.width = x.shape[1]

    @staticmethod
    def _compact(v: torch.Tensor):
        nonzero = v != 0
        counts = nonzero.sum(1)
        width = int(counts.max()) if v.shape[0] else 0
        order = torch.sort((~nonzero).to(torch.uint8), dim=1, stable=True).indices[:, :width]
        return v.gather(1, order), order, counts.tolist()

    @staticmethod
    def plan(x: torch.Tensor, delta: torch.Tensor, share: float):
        """The compacted factors, or ``None`` where the dense path is due (non-finite, too dense)."""
        if delta.dim() != 2 or x.dim() != 2 or delta.shape[0] == 0 or delta.numel() == 0 or x.numel() == 0:
            return None
        if delta.numel() * x.shape[1] < SPARSE_MIN_ENTRIES:
            return None  # sort/gather overhead exceeds the saving on small layers
        if not (bool(torch.isfinite(delta).all()) and bool(torch.isfinite(x).all())):
            return None
        pd = int((delta != 0).sum(1).max())
        px = int((x != 0).sum(1).max())
        if pd * px >= share * delta.shape[1] * x.shape[1]:
            return None
        return _SparseFactors(x, delta)

    def chunks(self, chunk: int):
        """``(start, stop, pd, px)``: samples ``start:stop`` padded to their largest nonzero counts."""
        start = 0
        while start < self.batch:
            pd, px = max(self.nd[start], 0), max(self.nx[start], 0)
            stop = start + 1
            while stop < self.batch:
                npd, npx = max(pd, self.nd[stop]), max(px, self.nx[stop])
                if (stop + 1 - start) * npd * npx > chunk:
                    break
                pd, px, stop = npd, npx, stop + 1
            yield start, stop, pd, px
            start = stop

    def products(self, start, stop, pd, px, buffers: "_Buffers") -> torch.Tensor:
        """``[rows, pd * px]`` products ``d[i, p] * xv[i, q]`` in ``buffers.values``."""
        d, xs = self.d[start:stop, :pd], self.xv[start:stop, :px]
        values, _ = buffers.take((d.shape[0], pd, px))
        torch.mul(d.unsqueeze(2), xs.unsqueeze(1), out=values)
        return values.view(d.shape[0], pd * px)

    def buffer_size(self, chunk: int) -> int:
        return max(1, min(max(chunk, max(a * b for a, b in zip(self.nd, self.nx))), self.batch * self.d.shape[1] * self.xv.shape[1]))


def _plain_factors(x: torch.Tensor, delta: torch.Tensor) -> bool:
    """Whether ``x`` (``[B, in]``) and ``delta`` (``[B, out]``) are nonempty 2-D floating factors of one dtype."""
    return (
        x.dim() == 2 and delta.dim() == 2 and x.numel() > 0 and delta.numel() > 0 and delta.dtype.is_floating_point and delta.dtype == x.dtype
    )


def _sorted_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row of a 2-D tensor sorted ascending (NumPy's vectorised sort on CPU: ~30x ``torch.sort``)."""
    values = values.detach()
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(values.contiguous().numpy(), axis=1))
    return torch.sort(values, dim=1).values


class _SortedBlocks:
    """``x_i`` sorted and cut into blocks; ``delta_i``'s nonzero entries moved to the front.

    ``blocks[i, j]`` are the sorted entries ``j * block ... (j + 1) * block - 1``
    of ``x_i`` (the last block padded with copies of ``x_i``'s largest entry,
    ``pad`` of them); ``points[i, j]`` is the first entry of block ``j`` and
    ``points[i, nb]`` the largest entry, so block ``j`` lies in
    ``[points[i, j], points[i, j + 1]]``. ``d[i]`` holds ``delta_i``'s nonzero
    entries (any order: 1-D counts do not depend on positions), padded with
    zeros to the largest count ``pd``.
    """

    def __init__(self, x: torch.Tensor, delta: torch.Tensor, block: int, nonzero: torch.Tensor, pd: int):
        batch, width = x.shape
        self.batch, self.out, self.width, self.block = batch, delta.shape[1], width, block
        self.nb = -(-width // block)
        self.pad = self.nb * block - width
        xs = _sorted_rows(x)
        if self.pad:
            xs = torch.cat([xs, xs[:, width - 1 :].expand(batch, self.pad)], 1)
        self.blocks = xs.view(batch * self.nb, block)
        self.points = torch.cat([xs[:, 0:width:block], xs[:, width - 1 : width]], 1).contiguous()
        self.lengths = torch.full((self.nb,), block, dtype=torch.int64, device=x.device)
        self.lengths[-1] = width - (self.nb - 1) * block
        self.pd = pd
        key = _sorted_rows(torch.where(nonzero, delta.detach(), float("inf")))[:, : self.pd]
        self.d = torch.where(torch.isinf(key), 0.0, key).contiguous()  # inf only stands for a zero here

    @staticmethod
    def plan(counter: "Hist1dCounter", x: torch.Tensor, delta: torch.Tensor, block: int | None) -> "_SortedBlocks | None":
        """The sorted blocks, or ``None`` where another path is due.

        ``block``: ``None`` picks the block size and whether to sort at all
        from a cost estimate; a positive int forces that block size.
        """
        if not _plain_factors(x, delta):
            return None
        if block is None and (x.device.type != "cpu" or delta.numel() * x.shape[1] < SORTED_MIN_ENTRIES):
            return None
        if not (bool(torch.isfinite(delta).all()) and bool(torch.isfinite(x).all())):
            return None  # monotonicity needs finite factors (inf * 0 is NaN)
        nonzero = delta != 0
        pd = int(nonzero.sum(1).max())  # the most nonzero delta entries of a sample
        if pd == 0:
            return None  # all products are zeros: the sparse path counts them in one addition
        if block is None:
            block = _SortedBlocks.choose_block(counter, x, delta, pd)
            if block is None:
                return None
        return _SortedBlocks(x, delta, int(block), nonzero, pd)

    @staticmethod
    def choose_block(counter: "Hist1dCounter", x: torch.Tensor, delta: torch.Tensor, pd: int) -> int | None:
        """The block size minimising the estimated cost, or ``None`` if enumerating is cheaper.

        A row ``b -> B * delta_ia * x_ib`` spans ``|B delta_ia| (max x_i - min x_i)``
        (at most the histogram range), crossing about ``span * bins / (hi - lo)``
        bin edges; each costs at most one enumerated block. With ``c`` edges
        per row and ``W`` entries, a row costs about ``2 (W / s + 1) + c s``
        (two for an evaluated block end: binning plus the uniform test), least at
        ``s = sqrt(2 W / c)``. Enumerating costs ``W`` per row for every nonzero
        ``delta_ia`` (sparse, when ``x`` has zeros: the largest count of nonzero
        ``x_i`` entries).
        """
        batch, width = x.shape
        xd = x.detach()
        span_x = xd.amax(1).double() - xd.amin(1).double()  # max and min are exact in any dtype
        dd = delta.detach().double().abs()
        spans = (dd * span_x[:, None] * batch).clamp_(max=counter.hi - counter.lo)
        rows = batch * pd  # enumerated rows (i, a): the nonzero delta_ia, padded per sample
        # + 0.5: rows that reach 0 cross the edge there even when they span little
        edges = float(spans.sum()) * counter.bins / (counter.hi - counter.lo) / rows + 0.5
        lo, hi = BLOCK_RANGE
        block = int(min(hi, max(lo, round(math.sqrt(2 * width / max(edges, 1e-9))))))
        cost = rows * (2 * (width / block + 1) + edges * block)
        enumerate_cost = rows * int((x != 0).sum(1).max())  # sparse (at most dense: rows <= B * out)
        return block if cost < enumerate_cost else None

    def count(self, counter: "Hist1dCounter", counts: torch.Tensor, scale: float, chunk: int) -> None:
        pd, nb, block = self.pd, self.nb, self.block
        per = max(1, chunk // (pd * (nb + 1)))  # samples per chunk of block ends
        cap = max(1, chunk // block)  # straddling blocks enumerated at a time
        buffers = _Buffers(max(per * pd * (nb + 1), cap * block), self.d.dtype, self.d.device)
        # counts to add per block end: the block's length if uniform, else 0; 0 for the largest entry
        weights = torch.zeros(per * pd * (nb + 1), dtype=torch.int64, device=self.d.device)
        for start in range(0, self.batch, per):
            stop = min(self.batch, start + per)
            n = stop - start
            values, index = buffers.take((n, pd, nb + 1))
            torch.mul(self.d[start:stop, :, None], self.points[start:stop, None, :], out=values)
            counter.index_scaled(values, scale, index)
            first, after = index[:, :, :nb], index[:, :, 1:]
            uniform = first == after
            torch.mul(uniform, self.lengths, out=weights[: n * pd * (nb + 1)].view(n, pd, nb + 1)[:, :, :nb])
            counts.scatter_add_(0, index.reshape(-1), weights[: n * pd * (nb + 1)])
            straddling = (~uniform).view(n * pd, nb).nonzero()
            if straddling.shape[0] == 0:
                continue
            rows, cols = straddling[:, 0], straddling[:, 1]
            if self.pad:  # the padding copies of an enumerated last block are counted below: take them off
                last = rows[cols == nb - 1]
                top = index.view(n * pd, nb + 1)[last, nb]
                counts.scatter_add_(0, top, torch.full_like(top, -self.pad))
            factor = self.d.view(-1)[start * pd + rows]
            block_rows = (start + rows // pd) * nb + cols
            for k in range(0, rows.shape[0], cap):
                f, b = factor[k : k + cap], block_rows[k : k + cap]
                values, index = buffers.take((f.shape[0], block))
                torch.mul(f.unsqueeze(1), self.blocks.index_select(0, b), out=values)
                counter.index_scaled(values, scale, index)
                buffers.count(counts, index)
        zeros = self.batch * (self.out - pd) * self.width  # products with delta_ia = 0 not enumerated
        if zeros:
            counts[counter.zero_bin(scale, self.d.dtype, self.d.device)] += zeros


class Hist1dCounter:
    """Counts of ``scale * v`` over chunks ``v``, with ``torch.histc``'s bin rule (clamped data).

    Args:
        bins, range: as ``torch.histc(x.clamp(lo, hi), bins, lo, hi)``.
        dtype: the data dtype (edges are rounded to it, as ``histc`` does).
    """

    def __init__(self, bins: int, range: tuple[float, float], dtype: torch.dtype):
        self.bins = int(bins)
        self.lo, self.hi = float(range[0]), float(range[1])  # clamp bounds, as the reference
        lo_d = torch.tensor(self.lo, dtype=dtype)
        hi_d = torch.tensor(self.hi, dtype=dtype)
        self.edge = float(lo_d)
        self.width = float(hi_d - lo_d)

    def new_counts(self, device) -> torch.Tensor:
        """int64 ``[bins + 2]``: the bins, ``x = hi`` (folded into the last bin), NaN (dropped)."""
        return torch.zeros(self.bins + 2, dtype=torch.int64, device=device)

    def add(self, counts: torch.Tensor, chunk: torch.Tensor, scale: float, buffers: _Buffers) -> None:
        """Count ``scale * chunk`` into ``counts`` (``chunk`` may be ``buffers.values`` itself)."""
        values, index = buffers.take(tuple(chunk.shape))
        torch.mul(chunk, scale, out=values)
        self._index(values, index)
        buffers.count(counts, index)

    def index_scaled(self, values: torch.Tensor, scale: float, index: torch.Tensor) -> None:
        """``index`` = counts slots of ``scale * values`` (``values`` is overwritten)."""
        values.mul_(scale)
        self._index(values, index)

    def _index(self, values: torch.Tensor, index: torch.Tensor) -> None:
        values.clamp_(self.lo, self.hi).sub_(self.edge).mul_(self.bins).div_(self.width)
        values.nan_to_num_(nan=float(self.bins + 1))
        _truncate(values, index)

    def zero_bin(self, scale: float, dtype: torch.dtype, device) -> int:
        """The counts slot of ``scale * 0`` by the same code as every value."""
        values = torch.zeros(1, dtype=dtype, device=device)
        index = torch.empty(1, dtype=torch.int64, device=device)
        self._index(values.mul_(scale), index)
        return int(index[0])

    @staticmethod
    def finish(counts: torch.Tensor, bins: int, dtype: torch.dtype) -> torch.Tensor:
        """``[bins]`` counts in ``dtype`` (``histc`` returns the data dtype)."""
        result = counts[:bins].clone()
        result[bins - 1] += counts[bins]
        return result.to(dtype)

    def count_grad_batch(
        self, counts: torch.Tensor, grad_batch: torch.Tensor, chunk: int | None = None, scale: int | None = None
    ) -> None:
        """Count ``B * grad_batch`` (``B = scale``, by default its leading dimension; rows of a larger batch
        pass the whole batch's ``B``); ``chunk``: entries per chunk (:func:`default_chunk` by default)."""
        chunk = default_chunk(grad_batch.device) if chunk is None else chunk
        scale = grad_batch.shape[0] if scale is None else scale
        buffers = _Buffers(min(chunk_size(grad_batch, chunk), grad_batch.numel()), grad_batch.dtype, grad_batch.device)
        for part, _, _ in _chunks_of_grad_batch(grad_batch, chunk):
            self.add(counts, part, scale, buffers)

    def count_outer(
        self,
        counts: torch.Tensor,
        x: torch.Tensor,
        delta: torch.Tensor,
        chunk: int | None = None,
        sparse: float | None = SPARSE_SHARE,
        block: int | None = None,
    ) -> None:
        """Count ``B * delta_i x_i^T`` over all samples without a ``[B, out, in]`` tensor.

        ``sparse``: share of padded nonzero products below which only those are
        enumerated (module docstring); ``None``: always the dense path.
        ``block``: ``None`` lets a cost estimate pick the sorted-block path and
        its block size (CPU, large layers), a positive int forces that block
        size (finite factors), ``0`` turns the path off. ``sparse=None`` turns
        it off too. ``chunk``: entries per chunk (:func:`default_chunk` by default).
        """
        chunk = default_chunk(delta.device) if chunk is None else chunk
        if sparse is not None and block != 0:
            blocks = _SortedBlocks.plan(self, x, delta, block)
            if blocks is not None:
                return blocks.count(self, counts, delta.shape[0], chunk)
        factors = None if sparse is None else _SparseFactors.plan(x, delta, sparse)
        if factors is not None:
            return self._count_sparse(counts, factors, chunk, delta.dtype, delta.device)
        self.count_outer_dense(counts, x, delta, chunk)

    def _count_sparse(self, counts, factors: _SparseFactors, chunk: int, dtype, device) -> None:
        scale = factors.batch
        buffers = _Buffers(factors.buffer_size(chunk), dtype, device)
        enumerated = 0
        for start, stop, pd, px in factors.chunks(chunk):
            enumerated += (stop - start) * pd * px
            if pd * px:
                self.add(counts, factors.products(start, stop, pd, px, buffers), scale, buffers)
        counts[self.zero_bin(scale, dtype, device)] += factors.batch * factors.out * factors.width - enumerated

    def count_outer_dense(self, counts: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, chunk: int | None = None) -> None:
        """:meth:`count_outer` enumerating every product."""
        chunk = default_chunk(delta.device) if chunk is None else chunk
        scale = delta.shape[0]
        buffers = _Buffers(_outer_size(x, delta, chunk), delta.dtype, delta.device)
        for part, _, _ in _outer_chunks(x, delta, chunk, buffers):
            self.add(counts, part, scale, buffers)


def chunk_size(grad_batch: torch.Tensor, chunk: int) -> int:
    """Entries of the largest chunk :func:`_chunks_of_grad_batch` yields."""
    per_sample = max(1, grad_batch[0].numel()) if grad_batch.shape[0] else 1
    if per_sample > chunk:
        return min(per_sample, max(chunk, SLICE))
    return max(1, chunk // per_sample) * per_sample


def _sort_abs_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, sorted)``: per row, the positions of ``|x|`` in increasing order and the sorted ``|x|``.

    float32 on CPU: one NumPy sort of int64 keys ``bits(|x|) << 32 | position``
    (the bit patterns of non-negative floats sort as integers), about 8x
    faster than ``argsort``.
    """
    absx = x.abs()
    width = x.shape[1]
    if absx.device.type == "cpu" and absx.dtype == torch.float32 and width < 2**31:
        keys = absx.contiguous().numpy().view(np.int32).astype(np.int64)
        keys <<= 32
        keys |= np.arange(width, dtype=np.int64)
        keys.sort(axis=1)
        order = torch.from_numpy(keys & 0xFFFFFFFF)
        values = torch.from_numpy((keys >> 32).astype(np.int32).view(np.float32))
        return order, values
    if absx.device.type == "cpu" and absx.dtype == torch.float64:
        order = torch.from_numpy(np.argsort(absx.contiguous().numpy(), axis=1))
    else:
        order = torch.argsort(absx, dim=1)
    return order, absx.gather(1, order)


class _Dominant2d:
    """2-D counts that enumerate only the products far from, or very close to, zero.

    Gradients are usually small against the histogram range, so most products
    ``v = B * delta_ia * x_ib`` have ``vmin <= |v| <= vmax`` for a band in which
    every negative ``v`` falls into one x-bin ``zn`` and every positive one into
    ``zp`` (the bins just below and above zero; products closer to zero than
    ``vmin`` may round into the bin of zero instead, so they are left out of the
    band). Each ``(a, b)`` has one y-bin (``theta_ab``'s) for all samples, so
    the pairs in the band follow from counts per position:

    - ``neg[a, b]``, ``pos[a, b]``, ``zero[a, b]``: how many samples give a
      negative, positive or zero product, from two matrix products of the sign
      patterns (``|sign delta|^T |sign x|`` and ``sign(delta)^T sign(x)``);
    - with ``|x_i|`` sorted, the products outside the band are the entries
      ``|x_ib| >= c / |B delta_ia|`` (the largest ``L_ia``) and the nonzero
      entries ``|x_ib| < c_lo / |B delta_ia|`` (usually none): these are
      enumerated and binned as usual, and their signs counted per y-bin;
    - ``zn`` and ``zp`` receive, per y-bin, the negatives and positives not
      enumerated, the bin of zero the zero products.

    The band ends are checked with the binning code itself at the extreme
    values a product in the band can round to (bins are monotone in ``v``), so
    the counts are exact. Needs finite factors, no NaN parameter entry and no
    product of nonzero factors that underflows to zero (checked).
    """

    def __init__(self, counter: "Hist2dCounter", x, delta, theta, sorted_x, bins: tuple[int, int, int], cuts: tuple[float, float]):
        self.counter, (self.zn, self.z0, self.zp) = counter, bins
        self.batch, self.out = delta.shape
        self.width = x.shape[1]
        self.delta, self.x = delta.detach().contiguous(), x.detach().contiguous()
        self.theta = theta
        self.order, sorted_abs, zeros = sorted_x  # x_i by increasing |x_ib|; zero entries per row
        dd = self.delta.double().abs().mul_(self.batch)
        low, high = cuts
        # the band is low <= |B d x| < high; entries outside it are enumerated. The cuts on
        # |x| are rounded outwards (in x's dtype) so that the band only shrinks.
        dd = torch.where(dd > 0, dd, math.inf)  # zero products are never enumerated
        low_x = (low / dd * (1 + 1e-6)).to(sorted_abs.dtype)
        high_x = (high / dd * (1 - 1e-6)).to(sorted_abs.dtype)
        first = torch.searchsorted(sorted_abs, low_x, side="left")
        last = torch.searchsorted(sorted_abs, high_x, side="left")
        last.masked_fill_(self.delta == 0, self.width)
        # runs of sorted positions to enumerate per row (i, a): [zeros_i, first) and [last, width)
        self.starts = torch.stack([zeros.expand_as(first), last], 2).reshape(-1)
        self.lengths = torch.stack([(first - zeros).clamp_(min=0), self.width - last], 2).reshape(-1)

    @staticmethod
    def plan(counter: "Hist2dCounter", x, delta, theta, force: bool) -> "_Dominant2d | None":
        """The listing plan, or ``None`` where it would not be exact or (unless forced) not pay."""
        if not _plain_factors(x, delta) or theta.numel() != delta.shape[1] * x.shape[1]:
            return None
        if not force and (x.device.type != "cpu" or delta.numel() * x.shape[1] < DOMINANT_MIN_ENTRIES):
            return None
        band = counter.zero_band(delta.shape[0], delta.dtype, delta.device)
        if band is None or not bool(torch.isfinite(delta).all()) or bool(torch.isnan(theta).any()):
            return None
        order, sorted_abs = _sort_abs_rows(x.detach())
        if not bool(torch.isfinite(sorted_abs[:, -1]).all()):  # inf and NaN sort last
            return None
        zeros = torch.searchsorted(sorted_abs, sorted_abs.new_zeros(x.shape[0], 1), side="right")
        nonzero_rows = (zeros < x.shape[1]).squeeze(1)
        smallest_x = sorted_abs.gather(1, zeros.clamp(max=x.shape[1] - 1))[nonzero_rows]
        smallest_d = delta.detach().abs()[delta != 0]
        if smallest_x.numel() and smallest_d.numel() and float(smallest_d.min()) * float(smallest_x.min()) < torch.finfo(delta.dtype).tiny:
            return None  # a product of nonzero factors could round to zero and change bins
        plan = _Dominant2d(counter, x, delta, theta, (order, sorted_abs, zeros), *band)
        if not force and int(plan.lengths.sum()) > DOMINANT_SHARE * delta.numel() * x.shape[1]:
            return None
        return plan

    def count(self, counts: torch.Tensor, chunk: int) -> None:
        counter, batch, out, width = self.counter, self.batch, self.out, self.width
        xbins, ybins = counter.xbins, counter.ybins
        device = counts.device
        theta_index = counter.theta_index(self.theta)
        listed = counter.new_counts(device)
        negatives = torch.zeros(ybins, dtype=torch.int64, device=device)  # listed negative products per y-bin
        runs = self.lengths.nonzero().squeeze(1)  # run r: row (i, a) = r // 2, its small or its large entries
        lengths = self.lengths[runs]
        ends = torch.cumsum(lengths, 0)
        total = int(ends[-1]) if ends.numel() else 0
        if total:
            row = runs // 2
            sample = row // out
            first = sample * width + self.starts[runs] - (ends - lengths)  # flat sorted position minus the run's offset
            factor = self.delta.view(-1)[row]
            x_row, theta_row = sample * width, (row % out) * width
            order, x = self.order.view(-1), self.x.view(-1)
            steps = torch.arange(chunk, total, chunk, device=device) if total > chunk else ends[:0]
            bounds = [0, *torch.searchsorted(ends, steps, right=True).tolist(), runs.numel()]
            buffers = _Buffers(min(total, chunk + width), self.delta.dtype, self.delta.device)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                if lo == hi:
                    continue
                part = lengths[lo:hi]
                begin = int(ends[lo - 1]) if lo else 0
                size = int(ends[hi - 1]) - begin
                run_of = torch.repeat_interleave(part, output_size=size)  # element -> run (lo-based)

                def spread(per_run: torch.Tensor) -> torch.Tensor:
                    return per_run[lo:hi].index_select(0, run_of)

                position = spread(first).add_(torch.arange(begin, begin + size, device=device))
                b = order.index_select(0, position)
                theta = theta_index.index_select(0, spread(theta_row).add_(b))
                values, _ = buffers.take((size,))
                torch.mul(spread(factor), x.index_select(0, spread(x_row).add_(b)), out=values)
                negatives.scatter_add_(0, theta, (values < 0).long())
                counter.add(listed, values, batch, theta, buffers)
        # per position (a, b): samples with a nonzero product, and positive minus negative ones
        sign_d, sign_x = torch.sign(self.delta).float(), torch.sign(self.x).float()
        both = sign_d.abs().t() @ sign_x.abs()
        agree = sign_d.t() @ sign_x

        def per_ybin(per_position: torch.Tensor) -> torch.Tensor:
            """Sums over the positions of each y-bin (float64: exact for integers up to 2**53)."""
            sums = torch.zeros(ybins, dtype=torch.float64, device=device)
            return sums.index_add_(0, theta_index, per_position.reshape(-1).double()).round_().long()

        both, agree = per_ybin(both), per_ybin(agree)
        positions = torch.bincount(theta_index, minlength=ybins)
        listed_y = counter.finish(listed).sum(0)  # listed products are never zero
        fill = torch.zeros(xbins, ybins, dtype=torch.int64, device=device)
        fill[self.zn] += (both - agree) // 2 - negatives
        fill[self.zp] += (both + agree) // 2 - (listed_y - negatives)
        fill[self.z0] += batch * positions - both
        counts += listed
        counts[: counter.size] += fill.view(-1)


class Hist2dCounter:
    """int64 counts of pairs ``(scale * v, theta)`` with the 2-D rule of :func:`hist2d_counts`.

    ``theta`` (one parameter, broadcast over samples) is binned once.
    """

    def __init__(self, bins: tuple[int, int], range):
        self.xbins, self.ybins = int(bins[0]), int(bins[1])
        (self.xlo, xhi), (self.ylo, yhi) = (float(r) for r in range[0]), (float(r) for r in range[1])
        self.xw, self.yw = (xhi - self.xlo) / self.xbins, (yhi - self.ylo) / self.ybins
        self.xmin, self.xmax = self.xlo + self.xw / 2, xhi - self.xw / 2
        self.ymin, self.ymax = self.ylo + self.yw / 2, yhi - self.yw / 2

    @property
    def size(self) -> int:
        """``xbins * ybins``: the counts' slots of pairs that are counted; slots from here on hold the pairs
        with a NaN (:meth:`new_counts`)."""
        return self.xbins * self.ybins

    def theta_index(self, theta: torch.Tensor) -> torch.Tensor:
        """``trunc((clamp(theta) - lo) / w)`` flattened, as the reference; :attr:`size` (past every counted
        pair) for a NaN."""
        index = (theta.detach().clamp(self.ymin, self.ymax) - self.ylo) / self.yw
        return index.nan_to_num_(nan=float(self.size)).long().reshape(-1)

    def new_counts(self, device) -> torch.Tensor:
        """int64 ``[xbins * ybins + ybins]``: the pairs' counts, then a row of the pairs whose gradient entry is
        NaN (x-bin ``xbins``; those with a NaN parameter entry are folded into its first slot)."""
        return torch.zeros(self.size + self.ybins, dtype=torch.int64, device=device)

    def nan_theta(self, theta_index: torch.Tensor) -> bool:
        """Whether ``theta_index`` (:meth:`theta_index`) holds a NaN parameter entry (one read per layer)."""
        return bool(theta_index.numel()) and int(theta_index.max()) >= self.size

    def add(
        self, counts, chunk: torch.Tensor, scale: float, theta_index: torch.Tensor, buffers: _Buffers,
        nan_theta: bool = False,
    ) -> None:
        """Count pairs of ``scale * chunk`` (``[rows, P]``) with ``theta_index`` (``[P]``); ``nan_theta``: it
        holds a NaN parameter entry (:meth:`nan_theta`)."""
        values, index = buffers.take(tuple(chunk.shape))
        torch.mul(chunk, scale, out=values)
        values.clamp_(self.xmin, self.xmax).sub_(self.xlo).div_(self.xw)
        values.nan_to_num_(nan=float(self.xbins))  # a NaN entry: the row past the last x-bin (not counted)
        # bin arithmetic in int32 (half the memory traffic of int64; 2 * xbins * ybins fits)
        pairs = values.to(torch.int32).mul_(self.ybins).add_(theta_index.to(torch.int32))
        if nan_theta:  # a NaN parameter entry: not counted
            pairs.clamp_(max=self.size)
        index.copy_(pairs)
        buffers.count(counts, index)

    def _xindex(self, values: torch.Tensor, index: torch.Tensor) -> None:
        values.clamp_(self.xmin, self.xmax).sub_(self.xlo).div_(self.xw)
        values.nan_to_num_(nan=float(self.xbins))
        _truncate(values, index)

    def bins_of(self, values: list[float], dtype: torch.dtype, device) -> list[int]:
        """x-bins of ``values`` (already scaled) by the same code as every product."""
        v = torch.tensor(values, dtype=dtype, device=device)
        index = torch.empty(v.shape, dtype=torch.int64, device=device)
        self._xindex(v, index)
        return index.tolist()

    def zero_band(self, batch: int, dtype, device):
        """``((zn, z0, zp), (low, high))`` with every ``fl(B * fl(d * x))`` for ``low <= |B d x| < high``
        in ``zn`` (negative) or ``zp`` (positive), ``z0`` the bin of zero; ``None`` if none was found.

        ``high`` starts just inside the nearest bin edges around zero, ``low``
        just above where subtracting ``lo`` absorbs the value. Checked with the
        binning code at the extreme values such a product can round to,
        ``fl(B fl(low / B))`` and ``fl(B fl(high / B))``.
        """
        inner = [self.xlo + k * self.xw for k in range(1, self.xbins)]
        away = [abs(e) for e in inner if abs(e) > 1e-6 * self.xw]  # edges other than zero
        high = 0.99 * min(away) if away else float(torch.finfo(dtype).max) / 4
        low = high * float(torch.finfo(dtype).eps)
        for _ in range(12):
            high, low = _rounded(high, dtype), _rounded(low, dtype)
            if not 0 < low < high:
                return None
            ends = [float((torch.tensor(v, dtype=dtype, device=device) / batch) * batch) for v in (low, high)]
            zn_low, zn_high, z0, zp_low, zp_high = self.bins_of([-ends[0], -ends[1], 0.0, ends[0], ends[1]], dtype, device)
            if zn_low == zn_high and zp_low == zp_high:
                return (zn_low, z0, zp_low), (low, high)
            if zn_low != zn_high and zp_low == zp_high or zn_low == zn_high and zp_low != zp_high:
                low *= 16
            else:
                low, high = low * 16, high * 0.5
        return None

    def finish(self, counts: torch.Tensor) -> torch.Tensor:
        """The ``[xbins, ybins]`` counts of the counted pairs (a view of ``counts``)."""
        return counts[: self.size].view(self.xbins, self.ybins)

    def dropped(self, counts: torch.Tensor) -> torch.Tensor:
        """How many pairs ``counts`` left out (a NaN gradient or parameter entry), an int64 scalar tensor."""
        return counts[self.size :].sum()

    def count_grad_batch(self, counts, grad_batch, theta, chunk: int | None = None, scale: int | None = None) -> None:
        chunk = default_chunk(grad_batch.device) if chunk is None else chunk
        scale = grad_batch.shape[0] if scale is None else scale
        theta_index = self.theta_index(theta).to(torch.int32)
        nan_theta = self.nan_theta(theta_index)
        buffers = _Buffers(min(chunk_size(grad_batch, chunk), grad_batch.numel()), grad_batch.dtype, grad_batch.device)
        for part, start, stop in _chunks_of_grad_batch(grad_batch, chunk):
            self.add(counts, part, scale, theta_index.view(-1)[start:stop], buffers, nan_theta)

    def count_outer(self, counts, x, delta, theta, chunk: int | None = None, sparse: float | None = None, dominant: bool | None = None) -> None:
        """Count pairs ``(B * delta_i x_i^T, theta)``; ``sparse`` as :meth:`Hist1dCounter.count_outer`.

        ``dominant``: ``None`` lists only the products outside the bins around
        zero (:class:`_Dominant2d`) on large CPU layers where that is at most
        :data:`DOMINANT_SHARE` of them, ``True`` forces it where it is exact,
        ``False`` turns it off.
        Otherwise dense by default: the sparse enumeration is exact, but on CPU
        gathering ``theta``'s bin per enumerated pair costs more than it saves
        (784x128 layer, batch 128: 65 ms sparse vs 44 ms dense).
        """
        chunk = default_chunk(delta.device) if chunk is None else chunk
        if dominant is not False and sparse is None:
            plan = _Dominant2d.plan(self, x, delta, theta, force=bool(dominant))
            if plan is not None:
                return plan.count(counts, chunk)
        factors = None if sparse is None else _SparseFactors.plan(x, delta, sparse)
        if factors is None:
            return self.count_outer_dense(counts, x, delta, theta, chunk)
        scale = factors.batch
        theta_index = self.theta_index(theta)
        nan_theta = self.nan_theta(theta_index)
        grid = theta_index.view(factors.out, factors.width)
        buffers = _Buffers(factors.buffer_size(chunk), delta.dtype, delta.device)
        mask_d = torch.zeros(factors.batch, factors.out, dtype=torch.float64, device=delta.device)
        mask_x = torch.zeros(factors.batch, factors.width, dtype=torch.float64, device=delta.device)
        for start, stop, pd, px in factors.chunks(chunk):
            od, ox = factors.od[start:stop, :pd], factors.ox[start:stop, :px]
            mask_d[start:stop].scatter_(1, od, 1.0)
            mask_x[start:stop].scatter_(1, ox, 1.0)
            if pd * px:
                pairs = grid[od.unsqueeze(2), ox.unsqueeze(1)].view(stop - start, pd * px)
                self.add(counts, factors.products(start, stop, pd, px, buffers), scale, pairs, buffers, nan_theta)
        # positions (a, b) of sample i not enumerated hold exact zeros, paired with theta_ab
        zeros = (factors.batch - mask_d.t() @ mask_x).round_().long().reshape(-1)
        value = torch.zeros(1, dtype=delta.dtype, device=delta.device).mul_(scale)
        index = torch.empty(1, dtype=torch.int64, device=delta.device)
        self._xindex(value, index)
        start = int(index[0]) * self.ybins
        if nan_theta:  # the zeros paired with a NaN parameter entry are not counted
            nan = theta_index >= self.size
            counts[self.size] += zeros[nan].sum()
            theta_index, zeros = theta_index[~nan], zeros[~nan]
        counts[start : start + self.ybins].scatter_add_(0, theta_index, zeros)

    def count_outer_dense(self, counts, x, delta, theta, chunk: int | None = None) -> None:
        """:meth:`count_outer` enumerating every product."""
        chunk = default_chunk(delta.device) if chunk is None else chunk
        scale = delta.shape[0]
        theta_index = self.theta_index(theta).to(torch.int32)
        nan_theta = self.nan_theta(theta_index)
        buffers = _Buffers(_outer_size(x, delta, chunk), delta.dtype, delta.device)
        for part, start, stop in _outer_chunks(x, delta, chunk, buffers):
            self.add(counts, part, scale, theta_index.view(-1)[start:stop], buffers, nan_theta)
