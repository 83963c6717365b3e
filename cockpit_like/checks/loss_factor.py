"""The factor between what a backward pass propagated and ``info["loss"]``, seen exactly.

``scaler.scale(loss).backward()`` propagates ``S * loss``; ``(loss / K).backward()``
propagates ``loss / K``. A hook on the ``info["loss"]`` tensor receives
``d root / d loss``, which is that factor, before any layer's gradient is
computed (the loss lies after every layer in the graph). The cockpit reads
it there and scales the per-sample rows by its inverse, so that an
undeclared ``GradScaler`` or a divided loss still gives the numbers of the
plain mean loss; ``info["grad_scaler"]`` / ``info["micro_batches"]`` become
declarations it checks instead of assumptions it needs.

Where ``info["loss"]`` is not the tensor backpropagated (a loss computed
apart for logging), the factor is read at the model's output instead: the
gradient ``delta`` that reaches it is ``f`` times the gradient of
``mean(info["individual_losses"])`` there, which one small backward pass
through the loss function gives (only in that case, before any layer's
gradient); where ``delta`` is not a multiple of it (the backpropagated loss
has other terms), no factor is taken.

May import torch and :mod:`cockpit_like.backends.internal`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from cockpit_like.backends.internal import cockpit_work, in_cockpit_work

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

    def __init__(self, loss, on_factor: Callable[[float], None] | None = None, losses=None, outputs=()):
        self.factor: float | None = None
        #: where the factor was seen: ``"loss"`` (a hook on ``info["loss"]``) or ``"output"`` (the model's output)
        self.seen_at: str | None = None
        self.calls = 0
        #: the probe at the model's output is running (its backward pass from the rows is not the user's)
        self._probing = False
        self._on_factor = on_factor
        self._handles: list = []
        self.watched = isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1
        self._loss = loss if self.watched else None
        # where info["loss"] is not what is backpropagated: the gradient at the model's output against the
        # gradient of mean(individual_losses) there (one small backward pass through the loss function, only then)
        self._losses = losses if isinstance(losses, torch.Tensor) and losses.grad_fn is not None and losses.dim() == 1 else None
        self._output_node = None
        if self._losses is not None:
            for output in outputs:
                node = getattr(output, "grad_fn", None)
                # not at a module's full backward hook (BackPACK's extend): capturing there would run it again
                if node is not None and not type(node).__name__.startswith("BackwardHookFunction"):
                    self._output_node = (node, output.output_nr)
                    break
        #: the factor can be seen at all (a tensor loss, or per-row losses with their graph)
        self.seeable = self.watched or self._losses is not None

    def start(self) -> None:
        """Put the hooks on (before the backward pass; :meth:`remove` takes off those an interrupt let on)."""
        if self._loss is not None:
            self._handles.append(self._loss.register_hook(self._seen))
        if self._losses is not None:
            # the backpropagated loss computed from info["individual_losses"] (scaler.scale(losses.mean())): each
            # row's loss gets f / B
            self._handles.append(self._losses.register_hook(self._at_rows))
        if self._output_node is not None:
            node, output_nr = self._output_node
            self._handles.append(node.register_prehook(partial(self._at_output, node, output_nr)))

    def _seen(self, grad: torch.Tensor) -> None:
        if self._probing or in_cockpit_work():  # the cockpit's own backward pass, not the user's
            return
        self.calls += 1
        with cockpit_work():  # the cockpit's own work: not part of a recorded step
            value = float(grad.detach().reshape(-1)[0])
        if self.factor is None:
            self.factor, self.seen_at = value, "loss"
        else:  # a second pass through the same loss (retain_graph): the gradients add up
            self.factor += value
        if self._on_factor is not None and self.calls == 1:
            self._on_factor(value)

    def _at_rows(self, grad: torch.Tensor) -> None:
        """``info["individual_losses"]`` got its gradient: ``f / B`` on every row if the root is ``f`` times their mean."""
        if self.factor is not None or self.calls or self._probing or in_cockpit_work():
            # (the probe at the model's output runs a backward pass from these rows: that one is the cockpit's)
            return
        with cockpit_work():
            rows = grad.detach().to(torch.float64).reshape(-1)
            total = float(rows.sum())
            spread = float((rows - rows.mean()).abs().max()) if rows.numel() else 0.0
        if total != 0.0 and spread <= 1e-6 * abs(float(rows.mean())):
            self.factor, self.seen_at = total, "rows"
            if self._on_factor is not None:
                self._on_factor(total)

    def _at_output(self, node, output_nr: int, grad_outputs) -> None:
        """The model's output got its gradient ``delta``: if ``info["loss"]`` did not show the factor, it is
        ``f`` in ``delta = f * d mean(individual_losses) / d output`` where that holds (checked)."""
        if self.factor is not None or self.calls or self._losses is None or self._probing or in_cockpit_work():
            return
        delta = grad_outputs[output_nr]
        if delta is None:
            return
        from torch.autograd.graph import GradientEdge

        with cockpit_work(), torch.enable_grad():
            losses = self._losses
            self._probing = True  # (hooks may run on another thread of the autograd engine: marked here too)
            try:
                (expected,) = torch.autograd.grad(
                    losses, [GradientEdge(node, output_nr)], grad_outputs=torch.full_like(losses, 1.0 / losses.numel()),
                    retain_graph=True, allow_unused=True,
                )  # fmt: skip
            except RuntimeError:  # the losses' graph is gone or does not reach the output
                return
            finally:
                self._probing = False
            if expected is None:
                return
            delta, expected = delta.detach().to(torch.float64), expected.detach().to(torch.float64)
            norm = float((expected * expected).sum())
            if not norm > 0.0:
                return
            factor = float((delta * expected).sum()) / norm
            residual = float((delta - factor * expected).norm()) / max(float(delta.norm()), 1e-300)
            low = grad_outputs[output_nr].dtype
            tolerance = 1e-6 if low == torch.float64 else (1e-3 if low == torch.float32 else 5e-2)
            if factor != 0.0 and residual <= tolerance:
                self.factor, self.seen_at = factor, "output"
                if self._on_factor is not None:
                    self._on_factor(factor)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._loss = self._losses = self._output_node = None
