"""What a tracked step's backward passes propagated: the value of their roots.

The per-sample rows come from the gradients that reach each layer, so they
are the rows of whatever tensor the user called ``backward()`` on; the
quantities that also read ``info["loss"]`` and ``info["individual_losses"]``
(the Loss, Alpha's fit of loss values and slopes) are right only where that
tensor is ``f * info["loss"]``, ``f`` the factor the loss hook saw
(:mod:`~cockpit_like.checks.loss_factor`). A loss with an undeclared term (an
auxiliary head's loss, a penalty on activations, a second loss backpropagated
in the same block) passes the gradient check, since the rows hold the term
too. Its value does not pass this one: while a tracked block is open,
:class:`BackwardRoots` reads ``sum_i <root_i, grad_i>`` of each
``torch.autograd.backward`` call the user's thread makes (``loss.backward()``
goes through it), before the call runs; the step compares the total with
``f * info["loss"]``.

The wrapper is installed while at least one block watches, and removed with
the last one (where nothing else replaced it since); the cockpit's own
backward passes (:func:`~cockpit_like.backends.internal.cockpit_work`) are
not counted. ``torch.autograd.grad`` is not a root: gradients set by hand
are not compared.

May import torch, :mod:`cockpit_like.backends.internal` and :mod:`cockpit_like.checks.graphs`.
"""

from __future__ import annotations

import functools
import math
import threading

import torch

from cockpit_like.backends.internal import cockpit_work, in_cockpit_work
from cockpit_like.checks.graphs import (
    batch_statistic_in,
    class_weights_mismatch,
    derivative_in,
    parameter_term_in,
    smoothing_mismatch,
    weighs_rows,
)

__all__ = ["BackwardRoots", "derivative_in", "roots_tolerance"]

_LOCK = threading.Lock()
_WATCHERS: list[BackwardRoots] = []
_ORIGINAL = None
_WRAPPER = None


def roots_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance between the propagated value and ``f * info["loss"]`` (rounding of the root's own sum,
    of a factor read from a half-precision gradient, of a loss computed apart in another order)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2
    if dtype == torch.float64:
        return 1e-9
    return 1e-4


class BackwardRoots:
    """Watches the ``torch.autograd.backward`` calls of the thread that created it from :meth:`start` until
    :meth:`remove`.

    Attributes:
        values: one 0-d float64 tensor per call, ``sum_i <root_i, grad_i>`` (``grad_i`` ones where not given).
        dtype: the roots' widest floating dtype seen (for the tolerance).
        unreadable: a call whose value could not be read (a root without a value, mismatched shapes).
    """

    def __init__(self):
        self.values: list[torch.Tensor] = []
        self.dtype: torch.dtype | None = None
        self.unreadable = False
        #: a root with more than one element was given its gradient (``features.backward(grad)``: not a loss)
        self.vector_roots = False
        #: called once, at the first call watched, before the backward pass runs (what p.grad holds then)
        self.on_first = None
        #: the roots' autograd nodes, read only to say why a check failed (:func:`derivative_in`); dropped with
        #: the block (the user's tensors hold them anyway)
        self.graphs: list = []
        self._thread = threading.get_ident()

    def start(self) -> None:
        """Watch from now on (:meth:`remove` undoes it, also where an interrupt cut this short)."""
        with _LOCK:
            _WATCHERS.append(self)
            _install()

    @property
    def calls(self) -> int:
        return len(self.values) + int(self.unreadable)

    def total(self) -> float | None:
        """The sum of the calls' values (``None``: no call seen, or one unreadable)."""
        if self.unreadable or not self.values:
            return None
        with cockpit_work():
            return float(torch.stack([v.to(self.values[0].device) for v in self.values]).sum())

    def _record(self, tensors, grad_tensors) -> None:
        if threading.get_ident() != self._thread:
            return
        if self.on_first is not None:
            first, self.on_first = self.on_first, None
            first()
        with cockpit_work(), torch.no_grad():
            try:
                roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
                if grad_tensors is None:
                    grads = [None] * len(roots)
                elif isinstance(grad_tensors, torch.Tensor):
                    grads = [grad_tensors]
                else:
                    grads = list(grad_tensors)
                value = None
                for root, grad in zip(roots, grads, strict=True):
                    if not isinstance(root, torch.Tensor) or is_nested_or_sparse(root):
                        raise TypeError("not a dense tensor")
                    if grad is not None and root.numel() > 1:
                        self.vector_roots = True
                    part = root.detach().to(torch.float64)
                    part = part.sum() if grad is None else (part * grad.detach().to(torch.float64)).sum()
                    value = part if value is None else value + part.to(value.device)
                    if root.grad_fn is not None:
                        self.graphs.append(root.grad_fn)
                    wider = root.dtype if root.is_floating_point() else None
                    if wider is not None and (self.dtype is None or _bits(wider) > _bits(self.dtype)):
                        self.dtype = wider
                if value is None:
                    raise TypeError("no roots")
                self.values.append(value)
            except (TypeError, ValueError, RuntimeError):
                self.unreadable = True

    def remove(self) -> None:
        with _LOCK:
            if self in _WATCHERS:
                _WATCHERS.remove(self)
            if not _WATCHERS:
                _uninstall()


def is_nested_or_sparse(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, "is_nested", False)) or tensor.is_sparse


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else 0


def _install() -> None:
    global _ORIGINAL, _WRAPPER
    if _WRAPPER is not None and torch.autograd.backward is _WRAPPER:
        return
    original = torch.autograd.backward

    @functools.wraps(original)
    def backward(tensors, grad_tensors=None, *args, **kwargs):
        # (not the cockpit's own passes, nor one run inside a backward pass: reentrant checkpointing's recomputation)
        if _WATCHERS and not in_cockpit_work() and torch._C._current_graph_task_id() == -1:
            for watcher in list(_WATCHERS):
                watcher._record(tensors, grad_tensors)
        return original(tensors, grad_tensors, *args, **kwargs)

    _ORIGINAL, _WRAPPER = original, backward
    torch.autograd.backward = backward


def _uninstall() -> None:
    global _ORIGINAL, _WRAPPER
    if _WRAPPER is not None and torch.autograd.backward is _WRAPPER:
        torch.autograd.backward = _ORIGINAL
    _ORIGINAL = _WRAPPER = None


def undeclared_terms(
    roots: BackwardRoots, loss, factor: float | None, seen: bool = True, rows=None
) -> str | None:
    """Why the propagated roots are not ``factor * info["loss"]`` (``None``: they are, or cannot be compared).

    Args:
        roots: the block's :class:`BackwardRoots` (removed).
        loss: ``info["loss"]`` (a one-element tensor or a number; anything else is not compared).
        factor: the factor seen by the loss hook, or the declared one where none was seen.
        seen: whether ``factor`` was seen (else declared), for the message.
        rows: ``info["individual_losses"]`` (read only to name row weights in the tensor backpropagated).
    """
    total = roots.total()
    if total is None or factor is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            return None
        with cockpit_work():
            value, dtype = float(loss.detach().reshape(-1)[0]), loss.dtype
    elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
        value, dtype = float(loss), None
    else:
        return None
    expected = factor * value
    if not (math.isfinite(total) and math.isfinite(expected)):
        return None  # a non-finite loss has its own warning
    widest = [d for d in (dtype, roots.dtype) if d is not None and d.is_floating_point]
    tolerance = max((roots_tolerance(d) for d in widest), default=roots_tolerance(torch.float32))
    if abs(total - expected) <= tolerance * max(abs(total), abs(expected)):
        return None
    passes = f"the {roots.calls} backward passes of this block propagated" if roots.calls > 1 else "the backward pass propagated"
    if roots.vector_roots:
        return (
            f"{passes} {total:.8g} (the sum of <tensor, gradient> over its roots), but info['loss'] is {value:.8g} "
            f"and the factor {'seen' if seen else 'declared'} at it is {factor:.6g}: a tensor with more than one element was backpropagated with a "
            "gradient of your own (features.backward(grad), a two-stage backward through detached features), which "
            "is not a loss, so the rows cannot be declared by info['loss'] and info['individual_losses']. Enter the "
            "cockpit around a backward pass of the loss itself (docs/your_training_loop.md#self-checks)"
        )
    ratio = total / expected if expected != 0 else 0.0
    # (within the rounding of a sum of ``ratio`` terms, with room: 1e3 times the roots' relative tolerance)
    if ratio > 1.5 and abs(ratio - round(ratio)) <= 1e3 * tolerance * ratio:
        # a whole multiple: a sum over rows of what info['loss'] averages (outside trial 12: an extended
        # CrossEntropyLoss(reduction="sum") with info['loss'] its mean; the general advice below contradicted the
        # ValueError for passing the sum)
        return (
            f"{passes} a loss of value {total:.8g}, {round(ratio)} x info['loss'] ({value:.8g}, the factor "
            f"{'seen' if seen else 'declared'} at it {factor:.6g}): a whole multiple of it, as a sum over the rows "
            "of what info['loss'] averages gives (a loss module with reduction='sum') or the loss scaled by hand, "
            "whose factor the cockpit could not see at this backward pass (the tensor backpropagated is not "
            "computed from info['loss'], or is a BackPACK-extended loss module's output, inside which it cannot "
            "look). Backpropagate info['loss'] itself (the mean: reduction='mean', as BackPACK's extensions "
            "expect), with info['individual_losses'] the per-row losses (docs/your_training_loop.md#self-checks)"
        )
    derivative = derivative_in(roots.graphs)
    declared = getattr(loss, "grad_fn", None)
    differs = (f"{passes} a loss of value {total:.8g}, but info['loss'] is {value:.8g} (the factor "
               f"{'seen' if seen else 'declared'} at it {factor:.6g})")
    if derivative is not None and (declared is None or derivative_in([declared]) is None):  # (outside trial 34: a gradient penalty got the generic list of causes)
        return (
            f"{differs}, and the tensor backpropagated holds a derivative "
            f"taken with create_graph ({derivative} in its graph) that info['loss'] does not: a gradient penalty (on "
            "the parameters or the inputs), a double-backward or input-gradient term from torch.autograd.grad(..., "
            "create_graph=True), backpropagated beside the declared loss. The per-sample rows would hold part of it "
            "and the declared losses none. Declare what you backpropagate: info['loss'] the whole value (loss + "
            "penalty) and info['individual_losses'] rows that average to it (each row's loss plus the penalty: "
            "rows + penalty); the cockpit then sees the derivative in info['loss'], leaves the per-sample "
            "quantities out with a note (such a term reaches the weights around the layers' outputs) and stores "
            "the rest (docs/your_model.md, 'A loss that reaches the parameters other than through the module calls')"
        )
    smoothing = smoothing_mismatch(roots.graphs, [declared]) if declared is not None else None
    if smoothing is not None:  # (outside trial 34: named only among the kinds of term it can be)
        backpropagated, given = smoothing
        return (
            f"{differs}, and their graphs hold torch's cross-entropy "
            f"with different label smoothing: label_smoothing={backpropagated:g} in the tensor backpropagated, "
            f"{given:g} in info['loss']. The per-sample rows hold the loss backpropagated and the declared losses "
            "another one. Compute info['loss'] and info['individual_losses'] with the loss's own options "
            f"(F.cross_entropy(out, y, label_smoothing={backpropagated:g}) and the same with reduction='none' for the "
            "rows), or backpropagate info['loss'] (docs/your_training_loop.md#self-checks)"
        )
    statistic = batch_statistic_in(roots.graphs, loss) if declared is not None else None
    if statistic is not None:  # (outside trial 34: logits centred over the batch, named among the kinds of term)
        return (
            f"{differs}, and inside the loss of the tensor backpropagated "
            f"a statistic over the batch ({statistic}: a mean or spread over dimension 0, such as logits centred or "
            "normalised by the batch's mean) feeds the loss, which info['loss'] does not hold: each row's loss then "
            "reads every row, so it has no per-sample form. Declare that loss as info['loss'] (per-sample quantities "
            "are then left out with a note: its rows are coupled), or compute the statistic without gradient "
            "(detached) or over each row's own values (docs/your_training_loop.md#self-checks)"
        )
    if declared is not None and parameter_term_in(roots.graphs, loss):  # (outside trial 34: an L2 term, generic)
        return (
            f"{differs}, and the tensor backpropagated holds a term on the "
            "parameters themselves (a term of it reads parameters only, not through the model's outputs: an L2, "
            "orthogonality or other penalty on the weights), which info['loss'] does not. Declare it: info['loss'] "
            "the whole value and info['individual_losses'] each row's loss plus the penalty (a term on the "
            "parameters has no rows: the per-sample quantities are then left out with a note, the rest stored); "
            "for an L2 penalty the optimizer's weight_decay keeps them (the same update for SGD, not for Adam's "
            "decoupled decay) (docs/your_training_loop.md#self-checks)"
        )
    weights = class_weights_mismatch(roots.graphs, [declared]) if declared is not None else None
    if weights is not None:  # (outside trial 43: class weights in the loss backpropagated only, generic)
        where, other = ("the tensor backpropagated", "info['loss'] has none") if weights[0] else (
            "info['loss']", "the tensor backpropagated has none")
        return (
            f"{differs}, and their graphs hold torch's cross-entropy with "
            f"class weights (weight=) in {where}, and {other}. Declare the loss you backpropagate with its weights: "
            "info['loss'] the weighted mean and info['individual_losses'] = F.cross_entropy(out, y, weight=W, "
            "reduction='none') * B / W[y].sum() (rows that average to it) (docs/your_training_loop.md#self-checks)"
        )
    if isinstance(rows, torch.Tensor) and weighs_rows(roots.graphs, rows) and not (
        declared is not None and weighs_rows([declared], rows)
    ):  # (outside trial 34: row weights in the loss backpropagated only were named among the kinds of term)
        return (
            f"{differs}, and the tensor backpropagated multiplies (or "
            "divides) the rows of info['individual_losses'] by a tensor without gradient before reducing them, which "
            "info['loss'] does not: row weights or a mask (importance weights, class-balanced rows; or a number). The "
            "per-sample "
            "rows hold the weighted losses and the declared ones the unweighted. Declare the weighted rows: "
            "info['individual_losses'] = rows * w (times B / w.sum() for a weighted mean, so that their mean is the "
            "loss), info['loss'] the loss backpropagated (docs/your_training_loop.md#self-checks)"
        )
    return (
        f"{passes} a loss of value {total:.8g}, but info['loss'] is {value:.8g} and the factor between them "
        f"{'seen' if seen else 'declared'} at info['loss'] is {factor:.6g} ({factor:.6g} x {value:.8g} = "
        f"{expected:.8g}): the tensor backpropagated has terms that info['loss'] and info['individual_losses'] do "
        "not hold, or it is another loss (an auxiliary loss, a second loss backpropagated in the same block, a "
        "penalty on activations or parameters; the same loss computed with other options than the declared one, "
        "such as label_smoothing or weight= in the loss backpropagated only). The per-sample rows hold those terms and the declared losses do not, so the quantities that "
        "read both (Alpha, the per-sample tests against the loss) would mix two losses. Declare the loss you "
        "backpropagate: info['loss'] its value, info['individual_losses'] each row's share of it (a per-row "
        "auxiliary loss added to its row's loss; the rows computed with the loss's own options, reduction='none'), "
        "or backpropagate info['loss'] alone "
        "(docs/your_training_loop.md#self-checks)"
    )
