"""A random rank-one projection of each layer's sum of per-sample gradients.

:class:`GradientProbe` is a per-sample statistic like the others: it sees
every layer's rows in whatever form the backend offers them (factors,
sequence factors, ``grad_batch``, blocks of rows) *after* the reducer scaled
them, and keeps, per parameter, the projection

    c_p = < sum_i grad_batch_p[i], u_p v_p^T >  (float64)

with ``u_p, v_p`` standard normal vectors (``p`` viewed as a
``shape[0] x rest`` matrix; a 1-D parameter gets one dense vector). Since
``sum_i grad_batch[i]`` is the gradient of the pass's mean loss, ``c_p``
equals ``<p.grad / scale, u v^T>`` when the decomposition is right; a
backward pass the hooks did not see, a second-order term, a wrong loss
factor or a layer computed twice all make them differ. ``u^T G v`` has
standard deviation ``||G||_F``, so one projection per layer catches any
error of the size of the tolerance with probability close to one. The cost
is ``O(B (out + in))`` per linear layer in factor form, and ``O(numel)`` where
another statistic of the step reads the layer's sum of rows anyway (the
gradient tests: the reducer makes that sum once and the probe projects it,
:attr:`~cockpit_like.backends.per_sample.PerSampleStat.sum_form`).

The directions come from the cockpit's own generator, seeded by ``(seed,
parameter index)``: the user's random streams are untouched, and every rank
and micro-batch draws the same ones.

May import torch and :mod:`cockpit_like.backends.per_sample`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cockpit_like.backends.per_sample import PerSampleStat, sequence_sum

__all__ = ["GradientProbe", "probe_directions", "project", "project_all"]

_MASK = (1 << 62) - 1
_HALF = (torch.float16, torch.bfloat16)


_DIRECTIONS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def probe_directions(
    seed: int, index: int, shape: torch.Size, device, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, ...]:
    """The probe of parameter ``index``: ``(u, v)`` for a parameter of two or more dimensions, else ``(r,)``.

    Drawn in float64 and kept for the seed in use (a few vectors of each parameter's side lengths), also in
    ``dtype`` (the rows' own, for products without a copy of the rows), so that a step's probe, its gradient
    check and the next steps with the same seed draw and convert nothing again."""
    key = (seed, index, shape, device, dtype)  # torch.Size and torch.device hash as their values
    found = _DIRECTIONS.get(key)
    if found is None:
        if len(_DIRECTIONS) >= 4096:
            _DIRECTIONS.clear()  # bounded: earlier seeds' directions are not needed any more
        if dtype == torch.float64:
            found = _draw(seed, index, torch.Size(shape), device)
        else:
            found = tuple(d.to(dtype) for d in probe_directions(seed, index, shape, device))
        _DIRECTIONS[key] = found
    return found


def _draw(seed: int, index: int, shape: torch.Size, device) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + index * 7919 + 17) & _MASK)
    if len(shape) >= 2:
        rows = shape[0]
        rest = shape.numel() // max(rows, 1)
        u = torch.randn(rows, generator=generator, dtype=torch.float64, device="cpu")
        v = torch.randn(rest, generator=generator, dtype=torch.float64, device="cpu")
        return u.to(device), v.to(device)
    return (torch.randn(max(shape.numel(), 1), generator=generator, dtype=torch.float64, device="cpu").to(device),)


def project(tensor: torch.Tensor, directions: tuple[torch.Tensor, ...], spread: bool = False):
    """``<tensor, u v^T>`` (or ``<tensor, r>``) as a float64 scalar; ``tensor`` is shaped like the parameter
    and read in its own dtype (float32 or better: matrix-vector products, no copy of it).

    ``spread=True``: ``(projection, spread)``, where ``spread`` is the projection's standard deviation over the
    first direction given the others (``||tensor v||``, or ``||tensor||`` for one direction), from the same
    product: the scale of its rounding error. A projection drawn near 0 carries the rounding of terms of that
    size, so a relative comparison of two projections must be made against it, not against the projection."""
    flat = tensor.detach()
    if flat.is_sparse:  # an embedding's sparse gradient (``sparse=True``)
        flat = flat.to_dense()
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    if directions[0].dtype != flat.dtype:
        directions = tuple(d.to(flat.dtype) for d in directions)
    if flat.numel() == 0:  # a parameter with no entries (an adapter of rank 0): nothing to project
        zero = torch.zeros((), dtype=torch.float64, device=flat.device)
        return (zero, zero) if spread else zero
    if len(directions) == 2:
        u, v = directions
        inner = flat.reshape(u.shape[0], -1) @ v
        value = (u @ inner).to(torch.float64)
        return (value, torch.linalg.vector_norm(inner).to(torch.float64)) if spread else value
    (r,) = directions
    value = (flat.reshape(-1) @ r).to(torch.float64)
    return (value, torch.linalg.vector_norm(flat).to(torch.float64)) if spread else value


def project_all(seed: int, items: list[tuple[int, torch.Tensor]]) -> list[float]:
    """``[project(tensor, probe_directions(seed, index, ...)) for index, tensor in items]`` as Python floats, read from
    the device at once. (Stacking the tensors of one shape into batched products was measured slower on the CPU:
    the copy costs more than the calls it saves.)"""
    values = []
    for index, tensor in items:
        dtype = tensor.dtype if tensor.dtype in (torch.float32, torch.float64) else torch.float32
        values.append(project(tensor, probe_directions(seed, index, tensor.shape, tensor.device, dtype)))
    if not values:
        return []
    return torch.stack([v.to(values[0].device) for v in values]).tolist()


@dataclass(frozen=True)
class GradientProbe(PerSampleStat):
    """Per parameter index: ``(c_p, a_p)``, the projection of the sum of the (scaled) rows and the sum of
    the rows' absolute projections (the scale of float rounding when rows cancel; ``c_p`` alone where
    the rows come only as their sum)."""

    seed: int = 0
    factor_form: ClassVar[bool] = True
    sequence_form: ClassVar[bool] = True
    #: reads only the batch sum of a layer given in blocks of rows (``LazyRows.batch_sum``) where no other
    #: statistic makes its rows; reads the blocks the others make otherwise
    sum_form: ClassVar[bool] = True
    row_form: ClassVar[bool] = True

    def init(self, params: list[torch.Tensor]) -> Any:
        # the parts as they come (float64 scalars), added per parameter once, at finalize: a layer costs its two
        # products and an append, not a handful of small tensor operations more
        return {"index": [], "total": [], "absolute": {}, "low": set(), "half_sums": set()}

    def note_half_precision(self, state, index: int) -> None:
        """The reducer saw half-precision rows (autocast) before handing them on in float32: a looser tolerance."""
        state["low"].add(index)

    def note_half_sum(self, state, index: int) -> None:
        """Autograd sums the parameter's gradient over every position in half precision: it is not compared."""
        state["half_sums"].add(index)

    def _dirs(self, state, index: int, param: torch.Tensor, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
        """The parameter's directions in ``dtype`` (the rows' own: no copy of the rows in another dtype)."""
        return probe_directions(self.seed, index, param.shape, param.device, dtype)

    @staticmethod
    def _add(state, index: int, total: torch.Tensor, absolute: torch.Tensor | None) -> Any:
        """Add a part ``(total, absolute)`` (``absolute``: ``|total|`` when None) of the parameter's float64 pair."""
        if absolute is not None:
            state["absolute"][len(state["index"])] = absolute.reshape(()).to(torch.float64)
        state["index"].append(index)
        state["total"].append(total.reshape(()).to(torch.float64))
        return state

    def _add_rows(self, state, index: int, per_row: torch.Tensor) -> Any:
        """Fold in the rows' projections ``per_row`` ``[B]``: their sum and the sum of their absolute values."""
        return self._add(state, index, per_row.sum(), per_row.abs().sum())

    @staticmethod
    def _wide(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` detached, in float32 if it is in half precision (products accumulate in float32 or better)."""
        tensor = tensor.detach()
        return tensor.float() if tensor.dtype in _HALF else tensor

    def borrows(self, state, nbytes) -> bool:
        return True  # reads a grad_batch during the call only

    def accumulate(self, state, index, param, grad_batch):
        rows = self._wide(grad_batch)
        dirs = self._dirs(state, index, param, rows.dtype)
        batch = rows.shape[0]
        if len(dirs) == 2:
            u, v = dirs
            per_row = (rows.reshape(batch * u.shape[0], -1) @ v).reshape(batch, -1) @ u  # two matrix-vector products
        else:
            per_row = rows.reshape(batch, -1) @ dirs[0]
        return self._add_rows(state, index, per_row)

    def accumulate_factors(self, state, index, param, kind, x, delta):
        delta = self._wide(delta)
        dirs = self._dirs(state, index, param, delta.dtype)
        if kind == "bias":
            per_row = delta @ dirs[0]
        else:
            u, v = dirs
            per_row = (delta @ u) * (self._wide(x).to(delta.dtype) @ v)
        return self._add_rows(state, index, per_row)

    #: with ``grad_batch`` materialised for other statistics, the sequence factors are still cheaper to read:
    #: ``O(B T (R + C))`` against ``O(B R C)``
    prefers_factors: ClassVar[bool] = True

    def accumulate_sequence(self, state, index, param, a, b):
        a, b = self._wide(a), self._wide(b)
        b = b.to(a.dtype)
        dirs = self._dirs(state, index, param, a.dtype)
        if len(dirs) == 2 and a.shape[-1] == dirs[0].shape[0] and b.shape[-1] == dirs[1].shape[0]:
            u, v = dirs
            per_row = ((a @ u) * (b @ v)).sum(1)
            return self._add_rows(state, index, per_row)
        total = sequence_sum(a, b).reshape(param.shape)
        return self._add(state, index, project(total, self._dirs(state, index, param)), None)

    def accumulate_rows(self, state, index, param, grad_batch, rows):
        """A block of a layer's rows (the blocks add up)."""
        return self.accumulate(state, index, param, grad_batch)

    def accumulate_sum(self, state, index, param, batch_sum: torch.Tensor):
        """A layer given as the sum of its (scaled) rows: in blocks of rows that no other statistic makes, or
        where another statistic reads that sum anyway (the reducer makes it once: ``O(numel)`` here instead
        of reading the rows once more)."""
        wide = self._wide(batch_sum)
        return self._add(state, index, project(wide, self._dirs(state, index, param, wide.dtype)), None)

    def finalize(self, state):
        """``{index: (c_p, a_p)}``; a third entry ``True`` where the rows came in half precision, and after it a
        fourth, ``True``, where autograd sums the gradient over every position in half precision
        (:meth:`note_half_sum`)."""
        indices = state["index"]
        if not indices:
            return {}
        totals = torch.stack(state["total"])
        absolutes = totals.abs()
        if state["absolute"]:
            at = list(state["absolute"])
            absolutes[at] = torch.stack([state["absolute"][k] for k in at])
        where = torch.tensor(indices, device=totals.device)
        size = max(indices) + 1
        total = totals.new_zeros(size).index_add_(0, where, totals).tolist()  # one read from the device
        absolute = absolutes.new_zeros(size).index_add_(0, where, absolutes).tolist()
        low, half_sums = state["low"], state["half_sums"]
        return {index: (total[index], absolute[index])
                + ((index in low, True) if index in half_sums else (True,) if index in low else ())
                for index in sorted(set(indices))}  # fmt: skip

    def across_ranks(self, result, reduction):
        indices = list(result)
        if not indices:
            return lambda: {}
        pairs = reduction.mean(torch.tensor([[result[i][0], result[i][1]] for i in indices], dtype=torch.float64, device="cpu"))

        def merged():
            values = pairs().tolist()
            return {index: (values[k][0], values[k][1]) + tuple(result[index][2:]) for k, index in enumerate(indices)}

        return merged
