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

May import torch, BackPACK's context, :mod:`cockpit_like.backends.internal` (the cockpit's own work) and
:mod:`cockpit_like.backends.user_state` (its own backward passes).
"""

from __future__ import annotations

import contextlib

import torch

from cockpit_like.backends.internal import cockpit_work
from cockpit_like.backends.user_state import own_backward

__all__ = ["coupled_rows", "declared_output_gradients", "paths_around_the_calls"]


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


def coupled_rows(
    losses, outputs, batch: int, seed: int, tolerance_for, on_gradients=None, scalars=(), row_nodes=frozenset()
) -> dict | None:
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

    ``scalars``: the model's outputs without rows (``return logits, {"z_loss": z}``), and ``row_nodes`` the graph
    nodes of the module calls' outputs that have the batch's rows: a scalar that the losses read and that is
    computed from those rows (a router z-loss, a load-balancing loss: a number of the whole batch added to every
    row's loss) couples the rows as well, while the signs at the outputs see nothing (outside trial 33: NormTest
    9.6-13% off, stored as valid); then ``{"scalar": its index among scalars}``. A scalar computed from the
    parameters alone (a temperature) does not couple them.
    """
    if not isinstance(losses, torch.Tensor) or losses.grad_fn is None or losses.dim() != 1:
        return None
    if losses.numel() != batch or batch < 2 or not losses.dtype.is_floating_point:
        return None
    outputs, edges = _output_edges(outputs)
    if not outputs:
        return None
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    signs = (torch.randint(0, 2, (batch,), generator=generator) * 2 - 1).to(device=losses.device, dtype=losses.dtype)
    plain, signed = _weighted_gradients(losses, edges, torch.ones_like(losses)), _weighted_gradients(losses, edges, signs)
    if plain is None or signed is None:
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
    if worst is None and scalars and row_nodes:
        worst = _coupling_scalar(losses, scalars, row_nodes)
    return worst


def _output_edges(outputs) -> tuple[list, list]:
    """The model's outputs as recorded (tensors, or shells without values: their graph node and shape) that a
    backward pass can reach, and the edges to ask ``torch.autograd.grad`` for."""
    from torch.autograd.graph import GradientEdge

    def leaf(o) -> bool:
        return isinstance(o, torch.Tensor) and o.grad_fn is None and o.requires_grad

    outputs = [o for o in outputs if (getattr(o, "grad_fn", None) is not None or leaf(o)) and len(o.shape) > 0]
    return outputs, [o if leaf(o) else GradientEdge(o.grad_fn, o.output_nr) for o in outputs]


def declared_output_gradients(losses, outputs, *_, on_gradients) -> None:
    """At a step without per-sample statistics whose quantities read the loss's derivatives (curvature, Alpha):
    ``d sum_n l_n / d Y`` at the model's outputs, handed to ``on_gradients`` as in :func:`coupled_rows` (one small
    backward pass through the loss function only, before the user's), so that the gradient the user's backward
    pass brings there is checked against the declared loss's even where no row is (outside trial 34: a term of
    value 0 with a gradient, ``z - z.detach()``, gave HessMaxEV alone the Hessian of another loss, 1.70 for the
    declared loss's 0.606, stored as valid). Always ``None``: the rows are not checked here."""
    if not isinstance(losses, torch.Tensor) or losses.grad_fn is None or not losses.dtype.is_floating_point:
        return None
    outputs, edges = _output_edges(outputs)
    plain = _weighted_gradients(losses, edges, torch.ones_like(losses)) if outputs else None
    if plain is not None:
        on_gradients([(output, g.detach()) for output, g in zip(outputs, plain) if g is not None])
    return None


def _weighted_gradients(losses, edges, weights):
    """``d sum_n w_n l_n / d`` each edge (the cockpit's own backward pass through the loss function only, the graph
    kept), or ``None`` where the losses' graph does not reach (or no longer holds) the outputs."""
    with torch.enable_grad(), cockpit_work(), own_backward(), _backpack_keeps_its_inputs():
        try:
            return torch.autograd.grad(losses, edges, weights, retain_graph=True, allow_unused=True)
        except RuntimeError:
            return None


def _coupling_scalar(losses, scalars, row_nodes) -> dict | None:
    """``{"scalar": index}`` of the first of ``scalars`` (recorded 0-dim outputs) that ``losses`` read (a gradient
    other than zero) and whose graph reaches one of ``row_nodes`` (ids of autograd nodes); else ``None``."""
    from torch.autograd.graph import GradientEdge

    for index, scalar in enumerate(scalars):
        node = getattr(scalar, "grad_fn", None)
        if node is None or not _reaches(node, row_nodes):
            continue
        with torch.enable_grad(), cockpit_work(), own_backward(), _backpack_keeps_its_inputs():
            try:
                (read,) = torch.autograd.grad(losses, [GradientEdge(node, scalar.output_nr)], torch.ones_like(losses),
                                              retain_graph=True, allow_unused=True)  # fmt: skip
            except RuntimeError:
                continue
        if read is not None and bool(read.detach().ne(0).any()):
            return {"scalar": index}
    return None


def _reaches(node, targets, limit: int = 20_000) -> bool:
    """Whether the autograd graph below ``node`` holds a node whose id is in ``targets`` (at most ``limit`` nodes
    visited: beyond, ``False``)."""
    stack, seen = [node], {id(node)}
    while stack and len(seen) <= limit:
        current = stack.pop()
        if id(current) in targets:
            return True
        for following, _ in getattr(current, "next_functions", ()):
            if following is not None and id(following) not in seen:
                seen.add(id(following))
                stack.append(following)
    return False


#: the most autograd nodes :func:`paths_around_the_calls` visits (beyond: it says nothing)
PATH_NODES = 20_000


def paths_around_the_calls(loss, stops: list, covered: dict, limit: int = PATH_NODES) -> dict | None:
    """Where ``loss`` reaches tracked parameters other than through the module calls that use them.

    The hooks take a parameter's per-sample gradients at the outputs of its module's calls (``stops``: their
    autograd nodes, and the model's own outputs). A path from the loss to the parameter's gradient accumulator that
    passes through none of them goes around the hooks: a derivative of the model's outputs inside the loss
    (``torch.autograd.grad(..., create_graph=True)``: a physics-informed residual, a gradient penalty, Sobolev
    training, whose graph multiplies by the weights again), or the parameter read in the loss itself (a penalty on
    the parameters, a learnable loss weight). The rows then miss that part of each row's gradient, whatever the
    loss; the gradient check would fail at every such step. Walks the loss's graph up to those nodes only: a few
    nodes for a loss on the outputs.

    Args:
        loss: ``info["loss"]``.
        stops: autograd nodes of the step's module calls' outputs.
        covered: ``{id(parameter): name}`` of the tracked parameters whose modules' calls were recorded.

    Returns:
        ``None`` where every path goes through the calls (or the graph is larger than ``limit`` nodes), else
        ``{"parameters": [names], "derivatives": bool}`` (``derivatives``: the walk passed a node of a backward pass
        made with ``create_graph``).
    """
    root = getattr(loss, "grad_fn", None)
    if root is None or not covered:
        return None
    stop = {id(node) for node in stops if node is not None}
    if id(root) in stop:  # the loss is an output of a call (a model that computes its own loss)
        return None
    seen, stack, reached, derivatives = {id(root)}, [root], [], False
    while stack:
        node = stack.pop()
        if len(seen) > limit:
            return None
        variable = getattr(node, "variable", None)  # a gradient accumulator: a leaf
        if variable is not None:
            name = covered.get(id(variable))
            if name is not None and name not in reached:
                reached.append(name)
            continue
        derivatives = derivatives or "BackwardBackward" in type(node).__name__
        for child, _ in node.next_functions:
            if child is not None and id(child) not in seen and id(child) not in stop:
                seen.add(id(child))
                stack.append(child)
    return {"parameters": reached, "derivatives": derivatives} if reached else None
