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

The same hook at the model's output checks what the value check on the roots
(:mod:`cockpit_like.checks.roots`) cannot see: a term whose value is 0 but
whose gradient is not (``a - a.detach()``, a stop-gradient surrogate) leaves
the value backpropagated equal to ``f`` times ``info["loss"]``, yet the
gradient at the output is not ``f`` times the declared loss's there, and the
rows would mix one loss's values with another's slopes. The declared
gradient comes from the row check's backward pass before the user's
(:func:`~cockpit_like.checks.rows.coupled_rows`), kept as projections on
random directions (:class:`OutputReference`), never as a copy of the output.

May import torch, :mod:`cockpit_like.backends.internal` and :mod:`cockpit_like.backends.user_state` (the
cockpit's own backward passes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from cockpit_like.backends.internal import cockpit_work, in_cockpit_work
from cockpit_like.backends.user_state import own_backward

__all__ = ["LossFactor", "OutputReference"]


def _key(output) -> tuple | None:
    node = getattr(output, "grad_fn", None)
    return None if node is None else (node, int(getattr(output, "output_nr", 0)))


class OutputReference:
    """The declared losses' gradient at the model's outputs, as projections: for each output ``Y`` (the sum of
    the rows' losses' gradient ``G``), ``P[k] = <G[k], R[k]>`` for every slice ``k`` along the first dimension,
    ``R`` Gaussian from the cockpit's own generator (made again for the gradient to compare, never kept), and
    ``||G||``.

    Args:
        seed: the seed of the directions (one per step and pass).
        batch: the number of declared rows (``info["individual_losses"]``'s): the declared loss is their mean.
    """

    def __init__(self, seed: int, batch: int):
        self.seed, self.batch = int(seed), int(batch)
        self._kept: dict[tuple, tuple[torch.Tensor, float]] = {}  # (projections, norm) per output
        #: the user's gradient at one output, projected alike: ``[projections, norm, dtype]``, summed over the
        #: block's backward passes (the norm only where there was one)
        self.seen: list | None = None
        self._seen_key: tuple | None = None

    def keep(self, pairs) -> None:
        """``pairs``: ``[(output, G)]`` from the row check's backward pass."""
        with cockpit_work():
            for output, gradient in pairs:
                key = _key(output)
                if key is not None and gradient.dim() > 0 and gradient.dtype.is_floating_point:
                    self._kept[key] = self._project(gradient)

    #: entries per piece of the directions (made piece by piece, the same way for both gradients: a language
    #: model's logits, [8, 256, 50257] for GPT-2 small, would otherwise take another 411 MB twice)
    PIECE = 1 << 20

    def _project(self, gradient: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The projections and the float64 norm of ``gradient``, a piece at a time (no float64 copy of it)."""
        generator = torch.Generator(device=gradient.device).manual_seed(self.seed)
        flat = gradient.reshape(-1)
        width = max(flat.numel() // max(gradient.shape[0], 1), 1)
        projections = torch.zeros(gradient.shape[0], dtype=torch.float64, device=gradient.device)
        squares = torch.zeros((), dtype=torch.float64, device=gradient.device)
        for start in range(0, flat.numel(), self.PIECE):
            piece = flat[start:start + self.PIECE]
            directions = torch.randn(piece.shape, generator=generator, device=piece.device, dtype=piece.dtype)
            rows = torch.arange(start, start + piece.numel(), device=piece.device) // width
            projections.index_add_(0, rows, (piece * directions).to(torch.float64))
            squares += piece.to(torch.float64).square().sum()
        return projections, float(squares.sqrt())

    def wants(self, node, output_nr: int) -> bool:
        key = (node, int(output_nr))
        return key in self._kept and (self.seen is None or self._seen_key == key)

    def see(self, node, output_nr: int, gradient: torch.Tensor) -> None:
        """A backward pass of the user's brought ``gradient`` to the output ``(node, output_nr)``."""
        with cockpit_work():
            gradient = gradient.detach()
            projections, norm = self._project(gradient)
            if self.seen is None:
                self.seen = [projections, norm, gradient.dtype]
                self._seen_key = (node, int(output_nr))
            else:  # another pass in the block (retain_graph): the gradients add up
                self.seen[0] = self.seen[0] + projections
                self.seen[1] = None

    def mismatch(self, factor: float, tolerance_for) -> float | None:
        """The relative distance between the gradient seen at the output and ``factor`` times the declared
        loss's (the mean of the rows: ``factor / batch`` times ``G``) where it is beyond the dtype's tolerance;
        else (or where nothing was seen, or it is not finite) ``None``."""
        if self.seen is None or self._seen_key not in self._kept:
            return None
        projections, norm, dtype = self.seen
        reference, reference_norm = self._kept[self._seen_key]
        scale = factor / self.batch
        if norm is None:  # several passes: the projections' norm stands for the gradient's
            norm = float(projections.norm())
        if not (math.isfinite(norm) and math.isfinite(reference_norm) and math.isfinite(scale)):
            return None
        size = max(norm, abs(scale) * reference_norm)
        if not size > 0.0:
            return None
        # (E <x, R>^2 = ||x||^2: the projections' distance is about the gradients' distance; the norms' difference
        # where one projection happens to be small)
        error = float((projections - scale * reference).norm())
        if self.seen[1] is not None:
            error = max(error, abs(norm - abs(scale) * reference_norm))
        error /= size
        if not math.isfinite(error):
            return None
        return error if error > tolerance_for(dtype) else None


def _before_casts(node, output_nr: int) -> tuple:
    """The node (and its output) that a dtype cast of the model's output reads: accelerate's autocast wrapper
    returns ``logits.float()``, while the model's own loss reads the half-precision logits, so the backward pass
    never reaches the cast (outside trial 19: the Trainer with ``bf16=True`` noted "loss factor not verified" at
    every step with accumulation). The gradient of the per-row losses reaches the node before the cast too."""
    while type(node).__name__ == "ToCopyBackward0" and node.next_functions and node.next_functions[0][0] is not None:
        node, output_nr = node.next_functions[0]
    return node, output_nr


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

    def __init__(self, loss, on_factor: Callable[[float], None] | None = None, losses=None, outputs=(),
                 reference: OutputReference | None = None):
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
        #: the declared loss's gradient at the outputs (projected), compared with the user's at the hooked one
        self.reference = reference
        if self._losses is not None:
            for output in outputs:
                node = getattr(output, "grad_fn", None)
                # not at a module's full backward hook (BackPACK's extend): capturing there would run it again
                if node is not None and not type(node).__name__.startswith("BackwardHookFunction"):
                    self._output_node = _before_casts(node, output.output_nr)
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
        if self._on_factor is not None:  # the sum so far: passes merged in one block are reduced at its end
            self._on_factor(self.factor)

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
        ``f`` in ``delta = f * d mean(individual_losses) / d output`` where that holds (checked). The first
        ``delta`` of the user's backward pass is also handed to :attr:`reference`, to compare at the pass's end."""
        if self._probing or in_cockpit_work():
            return
        delta = grad_outputs[output_nr]
        if delta is None:
            return
        if self.reference is not None and self.reference.wants(node, output_nr):
            self.reference.see(node, output_nr, delta)
        if self.factor is not None or self.calls or self._losses is None:
            return
        from torch.autograd.graph import GradientEdge

        with cockpit_work(), own_backward(), torch.enable_grad():
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
