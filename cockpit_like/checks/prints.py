"""Prints of tensors that may hold NaN or infinite entries: is a tensor still the one it was?

The cockpit tells whether the gradients or the parameters changed between the
backward pass and the optimizer's step from one random projection per tensor
(:func:`~cockpit_like.checks.probe.project`). A tensor with a NaN entry
projects to NaN, and NaN compares unequal to itself: an untouched NaN
gradient would read as changed (the notes then blamed SAM or clipping by value
at every step of a run that went non-finite). Where the projection is not
finite, the print of a tensor is a :class:`NonFinitePrint` instead:

    finite = < where(isfinite(t), t, 0), u v^T >   (float64)
    where  = < c(t), u v^T >,  c = 1 at NaN, 2 at +inf, 3 at -inf, 0 elsewhere

Two tensors have the same ``where`` exactly when their non-finite entries are
the same ones, of the same kind (up to a projection's chance of ``0``): such
entries compare as unchanged, and the finite entries are compared as before.
The extra work is paid only by tensors whose projection is not finite.

Example:
    >>> from cockpit_like.checks.probe import probe_directions
    >>> t = torch.tensor([1.0, float("nan"), 2.0])
    >>> dirs = probe_directions(0, 0, t.shape, t.device)
    >>> a, b = print_of(t, dirs), print_of(t.clone(), dirs)
    >>> isinstance(a, NonFinitePrint) and parts(a) == parts(b)
    True

May import torch and :mod:`cockpit_like.checks.probe`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cockpit_like.checks.probe import project

__all__ = ["NonFinitePrint", "print_of", "finite_print", "parts", "any_nonfinite", "nonfinite_counts"]


@dataclass(frozen=True)
class NonFinitePrint:
    """The print of a tensor with NaN or infinite entries: the projection of its finite entries and of where
    its non-finite entries are (module docstring)."""

    finite: float
    where: float


def finite_print(tensor: torch.Tensor, directions: tuple[torch.Tensor, ...]) -> NonFinitePrint:
    """The :class:`NonFinitePrint` of ``tensor`` (float64: finite entries near the dtype's largest do not
    overflow the projection)."""
    with torch.no_grad():
        t = tensor.detach()
        if t.is_sparse:
            t = t.to_dense()
        t = t.to(torch.float64)
        finite = torch.isfinite(t)
        codes = torch.isnan(t).to(torch.float64) + 2.0 * (t == math.inf) + 3.0 * (t == -math.inf)
        directions = tuple(d.to(device=t.device, dtype=torch.float64) for d in directions)
        return NonFinitePrint(float(project(torch.where(finite, t, 0.0), directions)), float(project(codes, directions)))


def print_of(tensor: torch.Tensor, directions: tuple[torch.Tensor, ...]) -> float | NonFinitePrint:
    """``project(tensor, directions)`` as a float where it is finite, else the tensor's :class:`NonFinitePrint`."""
    with torch.no_grad():
        value = float(project(tensor, directions))
    return value if math.isfinite(value) else finite_print(tensor, directions)


def parts(value: float | NonFinitePrint) -> tuple[float, float]:
    """``(projection of the finite entries, where the others are)``; ``where`` is ``0.0`` for a finite tensor."""
    if isinstance(value, NonFinitePrint):
        return value.finite, value.where
    return float(value), 0.0


def any_nonfinite(prints) -> bool:
    """Whether one of ``prints`` (a dict's values or a list; ``None`` entries allowed) is a :class:`NonFinitePrint`."""
    values = prints.values() if isinstance(prints, dict) else (prints or ())
    return any(isinstance(value, NonFinitePrint) for value in values)


def nonfinite_counts(tensors: list[tuple[str, torch.Tensor | None]]) -> list[tuple[str, int, int, int]]:
    """``(name, NaN entries, infinite entries, entries)`` of each named tensor with a non-finite entry (one read
    per tensor: for a step known to have some)."""
    counts = []
    with torch.no_grad():
        for name, tensor in tensors:
            if tensor is None:
                continue
            t = tensor.detach()
            if t.is_sparse:
                t = t.coalesce().values()
            if not (t.is_floating_point() or t.is_complex()):
                continue
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if nan or inf:
                counts.append((name, nan, inf, tensor.numel()))
    return counts
