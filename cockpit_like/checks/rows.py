"""Each row's loss reads its own row of the model's output only: the premise of every per-sample quantity.

Per-sample gradients, and with them the gradient tests, histograms, Alpha's
noise and TIC, describe ``loss = mean_n l_n`` where ``l_n`` depends on the
``n``-th row alone. A loss over the batch (InfoNCE or another contrastive
loss, in-batch hard negatives, a loss centred on the batch mean) breaks it
silently: the gradient still averages right (the gradient check passes), but
the rows are not the rows' gradients. So are rows declared in
``info["individual_losses"]`` that are not what each row contributed.

The check, at the loss: with ``G = d sum_n l_n / d Y`` and
``G_w = d sum_n w_n l_n / d Y`` at the model's output ``Y`` (random signs
``w`` from the cockpit's own generator), separable losses give
``G_w[n] = w_n G[n]`` for every row ``n`` exactly (up to rounding). Two small
backward passes through the loss function only (from the losses to ``Y``'s
graph node), before the user's backward pass; nothing is kept. BackPACK's hooks
on the outputs may fire there: its stored inputs are kept for the step's
backward pass.

May import torch, BackPACK's context and :mod:`cockpit_like.backends.internal` (the cockpit's own work).
"""

from __future__ import annotations

import contextlib

import torch

from cockpit_like.backends.internal import cockpit_work

__all__ = ["coupled_rows"]


@contextlib.contextmanager
def _backpack_keeps_its_inputs():
    """BackPACK's hook on a module's output (lean, or a full hook on a module whose inputs need no gradient) may
    fire at the check's capture; outside ``with backpack(...)`` it runs no extension but frees the module's stored
    input and output, which the step's own backward pass needs. Its ``retain_graph`` flag keeps them."""
    from backpack.context import CTX

    kept = CTX.retain_graph
    CTX.retain_graph = True
    try:
        yield
    finally:
        CTX.retain_graph = kept


def coupled_rows(losses, outputs, batch: int, seed: int, tolerance_for, on_gradients=None) -> dict | None:
    """``None`` where every row's loss reads only its own row of ``outputs`` (or where that cannot be seen:
    losses without a graph, outputs the losses do not reach); else ``{"error", "tolerance", "output"}``.

    Args:
        losses: ``info["individual_losses"]`` (``[batch]``, with its graph).
        outputs: the model's outputs whose leading dimension is the batch's rows (tensors, or anything with
            ``shape``, ``grad_fn`` and ``output_nr``: the tracer's shells).
        batch: the rows.
        seed: the seed of the signs (the cockpit's own generator: no user stream moves).
        tolerance_for: ``dtype -> relative tolerance`` (the gradient check's).
        on_gradients: called with ``[(output, d sum_n l_n / d output)]`` (detached), the plain sum's gradients,
            where they were computed (:class:`~cockpit_like.checks.loss_factor.OutputReference` keeps projections).

    A tensor whose rows lie along another dimension of size ``batch`` (sequence-first ``[T, B, ...]``
    outputs with ``T == B``) passes where the signs along that dimension fit.
    """
    if not isinstance(losses, torch.Tensor) or losses.grad_fn is None or losses.dim() != 1:
        return None
    if losses.numel() != batch or batch < 2 or not losses.dtype.is_floating_point:
        return None
    from torch.autograd.graph import GradientEdge

    # the outputs as recorded (tensors, or shells without values: their graph node and shape)
    def leaf(o) -> bool:
        return isinstance(o, torch.Tensor) and o.grad_fn is None and o.requires_grad

    outputs = [o for o in outputs if (getattr(o, "grad_fn", None) is not None or leaf(o)) and len(o.shape) > 0]
    if not outputs:
        return None
    edges = [o if leaf(o) else GradientEdge(o.grad_fn, o.output_nr) for o in outputs]
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    signs = (torch.randint(0, 2, (batch,), generator=generator) * 2 - 1).to(device=losses.device, dtype=losses.dtype)
    with torch.enable_grad(), cockpit_work(), _backpack_keeps_its_inputs():
        try:
            plain = torch.autograd.grad(losses, edges, torch.ones_like(losses), retain_graph=True, allow_unused=True)
            signed = torch.autograd.grad(losses, edges, signs, retain_graph=True, allow_unused=True)
        except RuntimeError:  # the losses' graph does not reach (or no longer holds) the outputs
            return None
    if on_gradients is not None:
        on_gradients([(output, g.detach()) for output, g in zip(outputs, plain) if g is not None])
    worst = None
    for index, (output, g, g_signed) in enumerate(zip(outputs, plain, signed)):
        if g is None or g_signed is None:
            continue
        g, g_signed = g.detach(), g_signed.detach()
        scale = max(float(g.norm()), float(g_signed.norm()))
        if not scale > 0.0:
            continue
        errors = []
        for dim in (d for d in range(g.dim()) if g.shape[d] == batch):
            shape = [1] * g.dim()
            shape[dim] = batch
            errors.append(float((g_signed - signs.to(g.dtype).reshape(shape) * g).norm()) / scale)
        if not errors:
            continue
        error, tolerance = min(errors), tolerance_for(g.dtype)
        if error > tolerance and (worst is None or error / tolerance > worst["error"] / worst["tolerance"]):
            worst = {"error": error, "tolerance": tolerance, "output": index}
    return worst
