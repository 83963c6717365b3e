"""Chunked histogram counting of per-sample gradients, bin for bin as the reference rules.

The counts are exactly those of :mod:`cockpit_like.functional.histograms`
(QUANTITIES.md §6):

- 1-D: ``torch.histc`` on data clamped to ``[lo, hi]``: bin
  ``trunc((x - lo) * bins / (hi - lo))`` computed in the data dtype with the
  edges ``lo``, ``hi`` rounded to it (as ``histc`` does), ``x = hi`` in the
  last bin, NaN not counted.
- 2-D: ``trunc((x - lo) / w)`` per axis on data clamped to the end-bin centres.

Instead of ``histc`` (slow on CPU) or whole-tensor temporaries (a large
allocation is paid in page faults), values are processed in chunks of about
:data:`CHUNK` entries through two reused buffers: one fused
scale/clamp/shift/scale pass in place, one float->int64 truncation, one
``scatter_add_`` of ones into the int64 counts. Chunks come either from a ``grad_batch`` tensor or, for
a linear layer, from its factors (``delta_i x_i^T`` for a few samples at a
time, each entry a single product and hence bitwise equal to BackPACK's
``grad_batch``), so no ``[B, out, in]`` tensor is needed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["CHUNK", "Hist1dCounter", "Hist2dCounter"]

#: entries per chunk (float + int64 buffers of this size stay in cache)
CHUNK = 1 << 16


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(float(value), dtype=dtype))


def _chunks_of_grad_batch(grad_batch: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """``[rows, P]`` views of ``grad_batch`` reshaped ``[B, P]``, about ``chunk`` entries each."""
    flat = grad_batch.detach().reshape(grad_batch.shape[0], -1)
    rows = max(1, chunk // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], rows):
        yield flat[start : start + rows]


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


def _outer_chunks(x: torch.Tensor, delta: torch.Tensor, chunk: int, buffers: _Buffers) -> Iterator[torch.Tensor]:
    """``delta_i x_i^T`` for a few samples at a time, written into ``buffers.values``."""
    batch, out = delta.shape
    width = x.shape[1]
    rows = max(1, chunk // max(1, out * width))
    for start in range(0, batch, rows):
        d, xs = delta[start : start + rows], x[start : start + rows]
        values, _ = buffers.take((d.shape[0], out, width))
        torch.mul(d.unsqueeze(2), xs.unsqueeze(1), out=values)
        yield values.view(d.shape[0], out * width)


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
        values.clamp_(self.lo, self.hi).sub_(self.edge).mul_(self.bins).div_(self.width)
        values.nan_to_num_(nan=float(self.bins + 1))
        index.copy_(values)
        buffers.count(counts, index)

    @staticmethod
    def finish(counts: torch.Tensor, bins: int, dtype: torch.dtype) -> torch.Tensor:
        """``[bins]`` counts in ``dtype`` (``histc`` returns the data dtype)."""
        result = counts[:bins].clone()
        result[bins - 1] += counts[bins]
        return result.to(dtype)

    def count_grad_batch(self, counts: torch.Tensor, grad_batch: torch.Tensor, chunk: int = CHUNK) -> None:
        """Count ``B * grad_batch`` (``B`` its leading dimension)."""
        scale = grad_batch.shape[0]
        buffers = _Buffers(min(chunk_size(grad_batch, chunk), grad_batch.numel()), grad_batch.dtype, grad_batch.device)
        for part in _chunks_of_grad_batch(grad_batch, chunk):
            self.add(counts, part, scale, buffers)

    def count_outer(self, counts: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, chunk: int = CHUNK) -> None:
        """Count ``B * delta_i x_i^T`` over all samples without a ``[B, out, in]`` tensor."""
        scale = delta.shape[0]
        size = max(1, chunk // (delta.shape[1] * x.shape[1])) * delta.shape[1] * x.shape[1]
        buffers = _Buffers(min(size, delta.numel() * x.shape[1]), delta.dtype, delta.device)
        for part in _outer_chunks(x, delta, chunk, buffers):
            self.add(counts, part, scale, buffers)


def chunk_size(grad_batch: torch.Tensor, chunk: int) -> int:
    """Entries of the largest chunk :func:`_chunks_of_grad_batch` yields."""
    per_sample = max(1, grad_batch[0].numel()) if grad_batch.shape[0] else 1
    return max(1, chunk // per_sample) * per_sample


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

    def theta_index(self, theta: torch.Tensor) -> torch.Tensor:
        """``trunc((clamp(theta) - lo) / w)`` flattened, as the reference."""
        return ((theta.detach().clamp(self.ymin, self.ymax) - self.ylo) / self.yw).long().reshape(-1)

    def new_counts(self, device) -> torch.Tensor:
        return torch.zeros(self.xbins * self.ybins, dtype=torch.int64, device=device)

    def add(self, counts, chunk: torch.Tensor, scale: float, theta_index: torch.Tensor, buffers: _Buffers) -> None:
        """Count pairs of ``scale * chunk`` (``[rows, P]``) with ``theta_index`` (``[P]``)."""
        values, index = buffers.take(tuple(chunk.shape))
        torch.mul(chunk, scale, out=values)
        values.clamp_(self.xmin, self.xmax).sub_(self.xlo).div_(self.xw)
        index.copy_(values)
        index.mul_(self.ybins).add_(theta_index)
        buffers.count(counts, index)

    def finish(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.view(self.xbins, self.ybins)

    def count_grad_batch(self, counts, grad_batch, theta, chunk: int = CHUNK) -> None:
        scale = grad_batch.shape[0]
        theta_index = self.theta_index(theta)
        buffers = _Buffers(min(chunk_size(grad_batch, chunk), grad_batch.numel()), grad_batch.dtype, grad_batch.device)
        for part in _chunks_of_grad_batch(grad_batch, chunk):
            self.add(counts, part, scale, theta_index, buffers)

    def count_outer(self, counts, x, delta, theta, chunk: int = CHUNK) -> None:
        scale = delta.shape[0]
        theta_index = self.theta_index(theta)
        size = max(1, chunk // (delta.shape[1] * x.shape[1])) * delta.shape[1] * x.shape[1]
        buffers = _Buffers(min(size, delta.numel() * x.shape[1]), delta.dtype, delta.device)
        for part in _outer_chunks(x, delta, chunk, buffers):
            self.add(counts, part, scale, theta_index, buffers)
