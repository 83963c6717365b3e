"""What a loss tensor's autograd graph holds, read to say why a check failed.

A failed check that compares two losses (``info["loss"]`` with the mean of
``info["individual_losses"]``, or with what the backward pass propagated)
can name its cause where the two tensors' graphs differ in a known way:
:func:`derivative_in`, a node of a backward pass made with ``create_graph``
(a gradient penalty); :func:`label_smoothing_in`, the label smoothing of
torch's cross-entropy; :func:`weighs_rows`, the rows of
``info["individual_losses"]`` multiplied by a tensor without gradient;
:func:`batch_statistic_in`, a statistic over the batch inside the loss;
:func:`parameter_term_in`, a term on the parameters themselves (an L2
penalty); :func:`class_weights_in`, a cross-entropy's class weights. Only
autograd nodes are read (their types and saved scalars), never a tensor;
the walks stop after ``limit`` nodes.

May import torch.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "batch_statistic_in", "class_weights_in", "class_weights_mismatch", "derivative_in", "label_smoothing_in",
    "parameter_term_in", "smoothing_mismatch", "weighs_rows",
]


def _nodes(graphs: list, limit: int) -> Iterator:
    """The nodes reachable from ``graphs`` (autograd nodes; ``None`` skipped), each once, at most ``limit``."""
    seen = {id(node) for node in graphs if node is not None}
    stack = [node for node in graphs if node is not None]
    while stack and len(seen) <= limit:
        node = stack.pop()
        yield node
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)


def derivative_in(graphs: list, limit: int = 20_000) -> str | None:
    """The name of a node of a backward pass made with ``create_graph`` in the graphs of ``graphs`` (autograd
    nodes), the first one a walk from them meets (``None``: none within ``limit`` nodes). Such a node (its type's
    name holds ``BackwardBackward``: the derivative of an operation's backward formula) is how a gradient penalty,
    an input-gradient term or another ``torch.autograd.grad(..., create_graph=True)`` shows in the tensor
    backpropagated."""
    for node in _nodes(graphs, limit):
        name = type(node).__name__
        if "BackwardBackward" in name:
            return name
    return None


def _children(node) -> list:
    return [child for child, _ in getattr(node, "next_functions", ()) if child is not None]


def _below_views(node):
    """``node``, or the first node under its chain of views and reshapes."""
    while type(node).__name__ in ("ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"):
        children = _children(node)
        if len(children) != 1:
            return node
        node = children[0]
    return node


def _smoothing_at(node) -> float | None:
    """``epsilon`` where ``node`` is torch's label-smoothed cross-entropy (class-index targets): the sum of
    ``(1 - epsilon) x`` the NLL of a log-softmax and a multiple of the same log-softmax summed over its classes
    (what ``F.cross_entropy(..., label_smoothing=epsilon)`` records), else ``None``."""
    if type(node).__name__ != "AddBackward0":
        return None
    children = _children(node)
    if len(children) != 2 or any(type(child).__name__ != "MulBackward1" for child in children):
        return None
    for nll_side, smooth_side in (children, children[::-1]):
        nll = [_below_views(c) for c in _children(nll_side)]
        nll = [c for c in nll if type(c).__name__.startswith("NllLoss")]
        if len(nll) != 1:
            continue
        log_softmax = [_below_views(c) for c in _children(nll[0])]
        if len(log_softmax) != 1 or type(log_softmax[0]).__name__ != "LogSoftmaxBackward0":
            continue
        # the other term sums the same log-softmax over its classes, a few nodes down (negated, masked, divided)
        for other in _nodes([smooth_side], 12):
            if type(other).__name__ == "SumBackward1" and any(
                _below_views(c) is log_softmax[0] for c in _children(other)
            ):
                keep = getattr(nll_side, "_saved_other", None)
                try:
                    return round(1.0 - float(keep), 12)
                except (TypeError, ValueError):
                    return None
    return None


def label_smoothing_in(graphs: list, limit: int = 20_000) -> float | None:
    """The label smoothing of torch's cross-entropy in the graphs of ``graphs`` (autograd nodes): ``epsilon``
    of the first smoothed one a walk meets, ``0.0`` where it meets a cross-entropy's NLL without smoothing only,
    ``None`` where it meets neither within ``limit`` nodes (another loss, or soft targets, whose smoothing is in
    the targets, not the graph)."""
    plain = False
    for node in _nodes(graphs, limit):
        epsilon = _smoothing_at(node)
        if epsilon is not None:
            return epsilon
        plain = plain or type(node).__name__.startswith("NllLoss")
    return 0.0 if plain else None


def _mismatch(first, second, read):
    """``(read(first), read(second))`` where both read something (not ``None``) and the two differ, else ``None``;
    ``first`` and ``second`` are loss tensors or lists of autograd nodes."""
    found = []
    for side in (first, second):
        graphs = side if isinstance(side, list) else [getattr(side, "grad_fn", None)]
        graphs = [g for g in graphs if g is not None]
        found.append(read(graphs) if graphs else None)
    if None in found or found[0] == found[1]:
        return None
    return found[0], found[1]


def smoothing_mismatch(first, second) -> tuple[float, float] | None:
    """``(epsilon_first, epsilon_second)`` where the graphs of two loss tensors (or ``grad_fn`` lists) both hold
    torch's cross-entropy with different label smoothing, else ``None``."""
    return _mismatch(first, second, label_smoothing_in)


#: nodes of ``a * b``, ``a / b`` and ``<a, b>``, whose two inputs are their two children
_PRODUCTS = ("MulBackward0", "DivBackward0", "DotBackward0")


#: nodes that reduce or scale what they read without adding another term: row weights are found below these only
_REDUCING = ("MeanBackward0", "MeanBackward1", "SumBackward0", "SumBackward1", "DivBackward0", "DivBackward1",
             "MulBackward1", "NegBackward0", "ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0")  # fmt: skip


def weighs_rows(graphs: list, rows, limit: int = 20_000) -> bool:
    """Whether the graphs of ``graphs`` (autograd nodes) are a reduction of the tensor ``rows`` (``info[
    "individual_losses"]``, its own node) multiplied or divided by a tensor without gradient: row weights, or a
    mask, on the rows before they are reduced (``(rows * w).mean()``, ``rows @ w / B``). Only reductions and
    scalings are followed from the top: a loss that adds another term to the weighted rows (a distillation term
    beside ``0.5 * rows``: outside trial 43) has more than row weights."""
    target = getattr(rows, "grad_fn", None)
    if target is None:
        return False
    stack = [node for node in graphs if node is not None]
    seen = {id(node) for node in stack}
    while stack and len(seen) <= limit:
        node = stack.pop()
        name = type(node).__name__
        inputs = [child for child, _ in getattr(node, "next_functions", ())]
        if name in _PRODUCTS and len(inputs) == 2 and None in inputs and any(
            child is not None and _below_views(child) is target for child in inputs
        ) and _weights_saved(node):
            return True
        if name in _REDUCING or (name in _PRODUCTS and None in inputs):
            for child in inputs:
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)
    return False


def _weights_saved(node) -> bool:
    """Whether the constant operand ``node`` saved has more than one entry (a number times the rows is a factor
    on the loss, which the loss-factor checks name, not a weight per row). After a backward pass has freed the
    saved tensors this cannot be read: then ``True`` (the callers' words cover a number too)."""
    for name in ("_saved_other", "_saved_self", "_saved_tensor"):
        try:
            saved = getattr(node, name, None)
        except RuntimeError:  # (freed by a backward pass without retain_graph)
            return True
        if hasattr(saved, "numel") and not saved.requires_grad and saved.numel() > 1:
            return True
    return False


#: the nodes of torch's losses and of the log-softmax a cross-entropy starts with
_LOSS_NODES = ("NllLoss", "LogSoftmax", "MseLoss", "BinaryCrossEntropy", "SmoothL1Loss", "HuberLoss", "L1Loss",
               "SoftMarginLoss", "KlDiv", "PoissonNllLoss")  # fmt: skip
#: reductions whose saved ``dim`` says which dimensions they reduce
_REDUCTIONS = ("MeanBackward1", "SumBackward1", "StdBackward0", "VarBackward0", "StdMeanBackward0", "VarMeanBackward0")


def _over_the_batch(node) -> bool:
    """Whether ``node`` reduces over dimension 0 (a mean of every entry included)."""
    name = type(node).__name__
    if name == "MeanBackward0":
        sizes = getattr(node, "_saved_self_sym_sizes", ())
        return len(sizes) >= 1 and sizes[0] > 1
    if name in _REDUCTIONS:
        dims = getattr(node, "_saved_dim", None)
        sizes = getattr(node, "_saved_self_sym_sizes", None) or ()
        if dims is None:
            return True  # (std / var over every entry)
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        return any(d in (0, -len(sizes)) for d in dims) and (not sizes or sizes[0] > 1)
    return False


def batch_statistic_in(graphs: list, declared, limit: int = 20_000) -> str | None:
    """The name of a reduction over the batch (dimension 0) that feeds a loss operation in the graphs of ``graphs``
    and is not in the graph of ``declared`` (``info["loss"]``): logits centred or normalised by the batch's mean or
    spread inside the loss (outside trial 34). Only the part of the graph that ``declared`` does not share is read
    (the model's own graph is in both); ``None`` where there is none."""
    shared = {id(node) for node in _nodes([getattr(declared, "grad_fn", None)], limit)}
    stack = [(node, False) for node in graphs if node is not None and id(node) not in shared]
    seen = {id(node) for node, _ in stack}
    while stack and len(seen) <= limit:
        node, below_loss = stack.pop()
        name = type(node).__name__
        if below_loss and _over_the_batch(node):
            return name
        below = below_loss or name.startswith(_LOSS_NODES)
        for child in _children(node):
            if id(child) not in seen and id(child) not in shared:
                seen.add(id(child))
                stack.append((child, below))
    return None


#: nodes that add terms, or scale one by a number or a tensor without gradient: a loss's terms are below them
_SUMS = ("AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0", "MulBackward1",
         "DivBackward0", "DivBackward1", "NegBackward0", "SumBackward0", "MeanBackward0")  # fmt: skip


def parameter_term_in(graphs: list, declared, limit: int = 20_000) -> bool:
    """Whether the tensor backpropagated (``graphs``) adds a term on the parameters alone that ``declared``'s graph
    (``info["loss"]``) does not hold: an L2 penalty or weight decay written into the loss (outside trial 34). A
    term is what sums and scalings at the top of the graph combine; it is on the parameters alone where its graph
    reaches parameters (leaves) and nothing of ``declared``'s graph (a second head's loss reaches the trunk's
    activations, which the declared loss shares)."""
    shared = {id(node) for node in _nodes([getattr(declared, "grad_fn", None)], limit)}
    terms, seen = [node for node in graphs if node is not None], set()
    while terms and len(seen) <= limit:
        node = terms.pop()
        if id(node) in seen or id(node) in shared:
            continue
        seen.add(id(node))
        inputs = [child for child, _ in getattr(node, "next_functions", ())]
        if type(node).__name__ in _SUMS and (
            not type(node).__name__.startswith(("Mul", "Div")) or None in inputs or len(inputs) == 1
        ):
            terms.extend(child for child in inputs if child is not None)
            continue
        if _on_parameters_alone(node, shared, limit):
            return True
    return False


def _on_parameters_alone(node, shared: set, limit: int) -> bool:
    """Whether every path down from ``node`` ends at a parameter (a leaf) without meeting ``shared``."""
    leaves = 0
    for below in _nodes([node], limit):
        if type(below).__name__ == "AccumulateGrad":  # (a parameter's leaf is in every graph that reads it)
            leaves += 1
        elif id(below) in shared:
            return False
        elif not _children(below) and below is not node:
            return False  # (a node without inputs that is not a leaf: nothing known of it)
    return leaves > 0


def class_weights_in(graphs: list, limit: int = 20_000) -> bool | None:
    """Whether torch's cross-entropy (its NLL) in the graphs of ``graphs`` has class weights (``weight=``):
    ``True`` where one has, ``False`` where one was met without, ``None`` where none was met (the weight is read
    from the node's saved ``weight``, which a backward pass frees: a freed one was a tensor)."""
    found = None
    for node in _nodes(graphs, limit):
        if type(node).__name__.startswith("NllLoss"):
            try:
                weighted = getattr(node, "_saved_weight", None) is not None
            except RuntimeError:  # (freed by a backward pass: there was a tensor)
                weighted = True
            if weighted:
                return True
            found = False
    return found


def class_weights_mismatch(first, second) -> tuple[bool, bool] | None:
    """``(weighted_first, weighted_second)`` where the graphs of two loss tensors (or ``grad_fn`` lists) both hold
    torch's cross-entropy, one with class weights and one without, else ``None``."""
    return _mismatch(first, second, class_weights_in)
