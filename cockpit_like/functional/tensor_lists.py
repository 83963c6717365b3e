"""Norms of lists of tensors (a model's parameters, gradients, updates) in a few kernel launches.

On an accelerator every small operation is a kernel launch of some microseconds, and a quantity
that takes the norm of each of a model's parameters one at a time pays one or more launches per
parameter (on an H200 the economy preset spent more of its 150 ms tracked step on such launches
than the 7 ms plain step of the resnet benchmark). Here tensors are taken in groups of one device
and dtype, of at most :data:`GROUP_BYTES` together, and each group's norms come from one
``torch._foreach_norm`` (one launch per group on CUDA; a loop in C++ on the CPU); differences of two
lists (``p - r``: a step, a distance) likewise come from one ``torch._foreach_sub`` per group. The
groups bound the memory of tensors made as they are read: at most a group is alive.

Pure tensor math: imports torch only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["GROUP_BYTES", "groups", "differences", "norms", "squared_norm", "norm"]

#: the most bytes of tensors taken together in one group
GROUP_BYTES = 64 << 20


def _plain(t: torch.Tensor) -> bool:
    """A dense strided tensor of a plain type (a ``DTensor`` or other subclass takes its own path)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _runs(items: Iterable, tensors_of, limit: int) -> Iterator[list]:
    """Consecutive runs of ``items`` whose tensors (``tensors_of(item)``, the first one's size counted) share
    devices and dtypes, of at most ``limit`` bytes together; an item with a tensor subclass is alone."""
    run: list = []
    size, key = 0, None
    for item in items:
        tensors = tensors_of(item)
        nbytes = tensors[0].numel() * tensors[0].element_size()
        here = tuple((t.device, t.dtype) for t in tensors) if all(_plain(t) for t in tensors) else None
        if run and (here is None or here != key or size + nbytes > limit):
            yield run
            run, size = [], 0
        run.append(item)
        size += nbytes
        key = here
    if run:
        yield run


def groups(tensors: Iterable[torch.Tensor], limit: int = GROUP_BYTES) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` on one device with one dtype and at most ``limit`` bytes together
    (a tensor larger than ``limit`` is a group of its own); a tensor subclass is always alone."""
    return _runs(tensors, lambda t: (t,), limit)


def differences(
    a: Iterable[torch.Tensor], b: Iterable[torch.Tensor], alpha: float = 1.0, limit: int = GROUP_BYTES
) -> Iterator[torch.Tensor]:
    """``a_k - alpha * b_k`` for the pairs of ``a`` and ``b`` (of one length), made a group of pairs at a time
    (one ``torch._foreach_sub`` per group): at most a group of differences is alive while they are read."""
    for run in _runs(zip(a, b, strict=True), lambda pair: pair, limit):
        if len(run) > 1 and all(_plain(x) and _plain(y) for x, y in run):
            yield from torch._foreach_sub([x.detach() for x, _ in run], [y.detach() for _, y in run], alpha=alpha)
        else:
            for x, y in run:
                yield torch.sub(x.detach(), y.detach(), alpha=alpha)


def _group_norms(group: list[torch.Tensor]) -> list[torch.Tensor]:
    if len(group) > 1 and all(_plain(t) for t in group):
        return list(torch._foreach_norm([t.detach() for t in group]))
    return [torch.linalg.vector_norm(t.detach()) for t in group]


def norms(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``[||t_1||, ..., ||t_k||]`` (L2 over all entries) as one 1-D tensor (``stack``'s type promotion)."""
    found = [n for group in groups(tensors) for n in _group_norms(group)]
    if not found:
        return torch.zeros(0)
    return torch.stack(found)


def squared_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum_k ||t_k||^2`` as a 0-dim tensor; ``tensors`` may be a generator: a group at a time is alive."""
    total = None
    for group in groups(tensors):
        part = torch.stack(_group_norms(group)).square().sum()
        total = part if total is None else total + part
    if total is None:
        raise ValueError("squared_norm of no tensors")
    return total


def norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sqrt(sum_k ||t_k||^2)``: the L2 norm of the tensors flattened and concatenated."""
    return torch.sqrt(squared_norm(tensors))
