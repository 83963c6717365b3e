"""The factor between what a backward pass propagated and ``info["loss"]``, seen exactly.

``scaler.scale(loss).backward()`` propagates ``S * loss``; ``(loss / K).backward()``
propagates ``loss / K``. A hook on the ``info["loss"]`` tensor receives
``d root / d loss``, which is that factor, before any layer's gradient is
computed (the loss lies after every layer in the graph). The cockpit reads
it there and scales the per-sample rows by its inverse, so that an
undeclared ``GradScaler`` or a divided loss still gives the numbers of the
plain mean loss; ``info["grad_scaler"]`` / ``info["micro_batches"]`` become
declarations it checks instead of assumptions it needs.

May import torch and :mod:`cockpit_like.backends.internal`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cockpit_like.backends.internal import cockpit_work

__all__ = ["LossFactor"]


class LossFactor:
    """Watches one backward pass's ``info["loss"]``.

    Args:
        loss: ``info["loss"]`` (anything: only a tensor in the graph can be watched).
        on_factor: called with the factor (a float) when the loss tensor gets its gradient, before any
            layer's (the per-sample reducer rescales its rows there).

    Attributes:
        watched: whether the loss is a tensor that requires a gradient (else the factor is unknown).
        factor: the factor seen, ``None`` until the loss got its gradient.
        calls: how many times the loss got a gradient (more than once: several backward passes through it).
    """

    def __init__(self, loss, on_factor: Callable[[float], None] | None = None):
        self.factor: float | None = None
        self.calls = 0
        self._on_factor = on_factor
        self._handle = None
        self.watched = isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1
        if self.watched:
            self._handle = loss.register_hook(self._seen)

    def _seen(self, grad: torch.Tensor) -> None:
        self.calls += 1
        with cockpit_work():  # the cockpit's own work: not part of a recorded step
            value = float(grad.detach().reshape(-1)[0])
        if self.factor is None:
            self.factor = value
        else:  # a second pass through the same loss (retain_graph): the gradients add up
            self.factor += value
        if self._on_factor is not None and self.calls == 1:
            self._on_factor(value)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
