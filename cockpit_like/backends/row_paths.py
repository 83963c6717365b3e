"""Where the rows of a call's outputs go: the autograd graph from a module call to the model's outputs.

The hook backend computes a call's per-sample gradients from the rows of its
outputs' gradient: row ``n`` of a linear layer's output gradient times row
``n`` of its input is taken for sample ``n``'s gradient (a re-run of a module
without a rule splits its inputs and outputs the same way). That is exact
only if row ``n`` of the call's outputs reaches the loss of sample ``n`` alone.
A leading dimension equal to the batch size does not say so: in a mixture of
experts whose tokens are gathered per expert by index (``expert(tokens[idx])``,
then ``index_add`` back), an expert that gets exactly ``B`` tokens has outputs
of shape ``[B, d]`` whose row ``r`` belongs to token ``idx[r]``, and the sum
over its rows (the batch gradient, which the self-check compares) is the same
whichever sample each row is credited to.

:class:`RowPaths` follows the graph from a call's outputs towards the model's
outputs (the consumers of each autograd node) and keeps track of where the
rows lie: along which dimension, with how many consecutive entries per
sample (``[B, T, d]``: dimension 0, 1 each; flattened sample-major to
``[B*T, d]``: dimension 0, ``T`` each; ``[T, B, d]``: dimension 1). Each
operation either keeps them (element-wise operations and broadcasting,
operations along other dimensions, the kept operands of a matrix product,
transposes and permutations, which move them, reshapes that keep whole
samples together, ``x[:n]``, ``cat`` at offset 0, ``x[torch.arange(B), ...]``)
or breaks them (indexing, gathering and scattering along them, the sources of
``index_add`` / ``index_put``, ``cat`` at another offset, ``split`` parts
after the first, flips, rolls, sorting, cumulative sums and softmax along
them, pooling and resampling windows over them (``F.avg_pool1d`` of a
tensor whose last dimension is the batch), normalisations whose statistics
run over them (BatchNorm with the batch's statistics, a layer or group norm
over the batch dimension, ``torch.renorm`` of slices along another one) and
matrix functions of them (QR, inverses, solves: :data:`MIXES_ROWS`, which
leaves the per-sample quantities out rather than moving the parameters on),
reductions over them that do not end in a single number, the
contracted operand of a matrix product, reshapes that split samples). The
walk checks the model's outputs, where the rows must lie along the outputs'
batch dimension (:func:`rows_dim`: the first dimension whose size is a
multiple of the batch size, so ``[B, T, V]`` and ``[B*T, V]`` along 0, an
RNN's ``h_n`` ``[layers, B, H]`` and ``[T, B, V]`` along 1), unless the loss
does not read that output at all (a recurrent model that returns its hidden
state for the next step of truncated BPTT): from there the step's row check
at the loss takes over (:mod:`cockpit_like.checks.rows`); it goes on through
what the model itself computes from an output it returns. It ends at a
single number (the loss), and it
jumps over *boxes*: module calls that the cockpit re-runs row by row (their
re-run must reproduce the recorded outputs, which checks that they keep the
rows) and ``nn.MultiheadAttention``. Operations it does not know keep the
rows where their outputs keep the dimensions up to the rows' and add none.

A call whose rows do not reach the model's outputs row for row has no
per-row gradients of its own: the hook backend moves its parameters to the
smallest enclosing call that carries the batch (the re-run computes them
through the routing, exactly), as it does for calls without a batch
dimension.

May import torch only.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

__all__ = ["RowPaths", "ACCEPT", "MIXES_ROWS", "rows_dim"]

#: the state of an output whose rows need no further check (a single number; an output that carries no rows)
ACCEPT = -1
#: the state of an output whose rows no longer lie sample by sample along one dimension
BROKEN = 0
# any other state: ``(dimension, rows per sample)``, the rows lying sample-major along that dimension

_VIEWS = {"ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "SqueezeBackward", "UnsqueezeBackward",
          "AliasBackward", "ExpandBackward"}  # fmt: skip
#: matrix products: ``{position: the dimensions of that input that stay apart in the output}`` (the others are summed over)
_PRODUCTS = {
    "MmBackward": {0: (0,), 1: (1,)}, "AddmmBackward": {1: (0,), 2: (1,)},
    "BmmBackward": {0: (0, 1), 1: (0, 2)}, "BaddbmmBackward": {1: (0, 1), 2: (0, 2)},
    "MvBackward": {0: (0,)}, "AddmvBackward": {1: (0,)}, "AddrBackward": {1: (0,), 2: (1,)},
    "AddbmmBackward": {1: (1,), 2: (2,)}, "CdistBackward": {0: (-2,), 1: ()}, "LinearBackward": {0: None},
    "ConvolutionBackward": {0: (0,)}, "ConvolutionBackwardOverrideable": {0: (0,)}, "EmbeddingBackward": {},
    "EmbeddingBagBackward": {}, "KronBackward": {},
}  # fmt: skip
#: products whose first input is added to the product (broadcast like an element-wise operation)
_ADDED = {"AddmmBackward", "BaddbmmBackward", "AddmvBackward", "AddrBackward", "AddbmmBackward"}
#: operations that write their second input into places of the first, chosen by index (the first keeps its rows)
_WRITES = {"IndexAddBackward", "IndexCopyBackward", "IndexFillBackward", "IndexPutBackward", "ScatterBackward",
           "ScatterAddBackward", "ScatterReduceBackward", "IndexReduceBackward", "MaskedScatterBackward",
           "PutBackward", "CopySlices"}  # fmt: skip
#: operations that pick entries by position in an arbitrary order
_PICKS = {"MaskedSelectBackward", "TakeBackward", "AsStridedBackward", "AsStridedScatterBackward"}
#: element-wise operations: inputs broadcast from the right
_ELEMENTWISE = {"AddBackward", "SubBackward", "RsubBackward", "MulBackward", "DivBackward", "WhereBackward",
                "PowBackward", "MaximumBackward", "MinimumBackward", "LerpBackward", "AddcmulBackward",
                "AddcdivBackward", "Atan2Backward", "HypotBackward", "FmaxBackward", "FminBackward",
                "MaskedFillBackward", "XlogyBackward", "CopysignBackward", "FmodBackward", "RemainderBackward"}  # fmt: skip
#: what a walk's reason says for an operation whose result at each row reads every row (a normalisation over
#: the rows, a matrix function of them): the per-sample quantities are undefined, not moved to another call
MIXES_ROWS = "an operation whose result at each row takes in every row"
#: normalisations: ``(node, ndim) -> the dimensions of the input their statistics run over`` (BatchNorm with the
#: batch's statistics: all but the channels, ``F.batch_norm(..., training=True)`` written by hand as well as
#: ``nn.BatchNorm``'s; GroupNorm: all but the first; LayerNorm: the normalised trailing ones)
def _batch_statistics(node, ndim: int) -> list[int]:
    """BatchNorm: with the batch's statistics (training), every dimension but the channels'; else none."""
    return [d for d in range(ndim) if d != 1] if getattr(node, "_saved_training", True) else []


_NORMS = {
    "NativeBatchNormBackward": _batch_statistics, "CudnnBatchNormBackward": _batch_statistics,
    "MiopenBatchNormBackward": _batch_statistics,
    "NativeGroupNormBackward": lambda node, ndim: list(range(1, ndim)),
    "NativeLayerNormBackward": lambda node, ndim: list(range(ndim - len(getattr(node, "_saved_normalized_shape", ())),
                                                            ndim)),
}  # fmt: skip
#: functions of whole matrices (the last two dimensions of their first input): decompositions, inverses, solves
_MATRIX_FUNCTIONS = {"LinalgQrBackward", "LinalgInvExBackward", "LinalgSvdBackward", "LinalgEighBackward",
                     "LinalgCholeskyExBackward", "LinalgSolveExBackward", "LinalgDetBackward", "LinalgSlogdetBackward",
                     "LinalgPinvBackward", "LinalgMatrixExpBackward", "LinalgLstsqBackward",
                     "LinalgSolveTriangularBackward", "LinalgLuBackward", "LinalgLuFactorExBackward",
                     "LinalgEigBackward", "LogdetBackward", "CholeskyInverseBackward", "CholeskySolveBackward",
                     "TriangularSolveBackward", "LuSolveBackward"}  # fmt: skip
#: pooling, resampling and padding by reflection or replication over the trailing (spatial) dimensions of their
#: input, 1, 2 or 3 of them by the name (1-D pooling runs as 2-D pooling on an unsqueezed input); a window (or a
#: copied border) there that holds the rows mixes them (outside
#: trial 12: ``F.avg_pool1d(h.T[None], 3)`` over the batch kept the shape and stored NormTest 7% off as valid)
_POOLS = {"AvgPool2DBackward", "AvgPool3DBackward", "MaxPool2DWithIndicesBackward", "MaxPool3DWithIndicesBackward",
          "AdaptiveAvgPool2DBackward", "AdaptiveAvgPool3DBackward", "AdaptiveMaxPool2DBackward",
          "AdaptiveMaxPool3DBackward", "FractionalMaxPool2DBackward", "FractionalMaxPool3DBackward",
          "MaxUnpool2DBackward", "MaxUnpool3DBackward", "ReflectionPad1DBackward", "ReflectionPad2DBackward",
          "ReflectionPad3DBackward", "ReplicationPad1DBackward", "ReplicationPad2DBackward",
          "ReplicationPad3DBackward", "UpsampleNearest1DBackward", "UpsampleNearest2DBackward",
          "UpsampleNearest3DBackward", "UpsampleLinear1DBackward", "UpsampleBilinear2DBackward",
          "UpsampleBicubic2DBackward", "UpsampleTrilinear3DBackward", "UpsampleNearestExact1DBackward",
          "UpsampleNearestExact2DBackward", "UpsampleNearestExact3DBackward", "Im2ColBackward", "Col2ImBackward"}  # fmt: skip
_MISSING = object()
_KINDS: dict[type, str] = {}


def _kind(node_type: type) -> str:
    """The operation of a graph node's class, without its overload number (``AddBackward0`` -> ``AddBackward``)."""
    kind = _KINDS.get(node_type)
    if kind is None:
        kind = _KINDS[node_type] = re.sub(r"\d+$", "", node_type.__name__)
    return kind


def _dims(value, ndim: int) -> list[int] | None:
    """Saved dimension argument(s) as non-negative ints (``None``: all dimensions)."""
    if value is None:
        return None
    values = value if isinstance(value, (tuple, list)) else (value,)
    dims = []
    for dim in values:
        dim = int(dim)
        if dim >= 2**63:  # saved as an unsigned 64-bit int
            dim -= 2**64
        dims.append(dim + ndim if dim < 0 else dim)
    return dims


def _identity(index, size: int) -> bool:
    """Whether an index along dimension 0 picks rows ``0, 1, ..., size - 1`` in order (``x[torch.arange(B)]``)."""
    if not isinstance(index, torch.Tensor) or index.dim() == 0 or index.shape[0] != size:
        return False
    if index.dtype == torch.bool:
        return index.dim() == 1 and bool(index.all())
    if index.is_floating_point() or index.is_complex():
        return False
    expected = torch.arange(size, device=index.device).reshape(-1, *([1] * (index.dim() - 1)))
    return bool((index == expected).all())


class RowPaths:
    """The graph below the recorded calls, with the boxes that keep the rows (see the module docstring).

    Args:
        edges: ``{id(node): [(consumer, position, output_nr)]}``: the nodes that read each output of a node
            (``position``: the input of ``consumer`` it is; ``output_nr``: which output of ``node``).
        ends: ``{id(node): {output_nr: batch dimension or None}}`` of the graph nodes of the model's outputs:
            the rows must lie along the output's batch dimension there (``None``: :func:`rows_dim` of its shape,
            e.g. 0 for logits flattened to ``[B*T, V]``, 1 for an RNN's ``h_n`` ``[layers, B, H]``).
        reads: ``(node, output_nr) -> bool``: whether the loss reads that output of the model (``None``: it
            may). The rows of an output the loss does not read (a hidden state returned for the next step)
            may lie anywhere: no gradient comes back through it.
        feeds: ``node -> bool``: whether the loss depends on the node at all (``None``: every node may); the
            walk skips consumers it does not depend on (what the model computes only for an output the loss
            does not read, e.g. its own loss from reordered logits).
    """

    def __init__(self, edges: dict[int, list[tuple[Any, int, int]]], ends: dict[int, dict[int, int | None]], reads=None,
                 feeds=None):
        self.edges = edges
        self.ends = ends
        self.reads = reads
        #: ``node -> bool``: whether the loss depends on the node (``None``: every node may feed it); the walk does
        #: not follow consumers the loss does not depend on (no gradient comes back through them)
        self.feeds = feeds
        #: the last :meth:`broken` found the rows along another dimension of a model output the loss reads (an
        #: enclosing call's rows end there the same way: climbing cannot help)
        self.misplaced = False
        self._boxes: dict[int, "_Box"] = {}
        self._inside: dict[int, list["_Box"]] = {}
        #: ``(id(node), states)`` whose walk to the model's outputs kept the rows
        self._good: set[tuple[int, tuple]] = set()
        self._shapes: dict[int, list[tuple[int, ...]]] = {}

    # ---- boxes -------------------------------------------------------------------------
    def add_box(self, key: int, name: str, outputs: list[tuple[Any, int, int]], inputs: list[tuple[Any, int, int | None]]) -> None:
        """A module call whose rows go from its inputs to its outputs row for row.

        Args:
            key: the call's identity (``id(call)``), for :meth:`remove_box`.
            name: the module, as messages name it.
            outputs: ``(node, output_nr, state)`` of its outputs (``state``: ``(dimension, rows per sample)``,
                or :data:`ACCEPT`).
            inputs: ``(node, output_nr, batch dimension or None)`` of its tensor arguments that have a graph node.
        """
        if key in self._boxes:
            return
        floor = max((node._sequence_nr() for node, _, _ in inputs), default=-1)
        stops = {id(node) for node, _, _ in inputs}
        inside: dict[int, Any] = {}
        stack = [node for node, _, _ in outputs]
        while stack:  # the nodes the call made: from its outputs down to its inputs (nothing made before them)
            node = stack.pop()
            if id(node) in inside or id(node) in stops or node._sequence_nr() <= floor:
                continue
            inside[id(node)] = node
            stack.extend(child for child, _ in node.next_functions if child is not None)
        box = _Box(name, inside, {(id(node), nr): dim for node, nr, dim in inputs}, self.starts(outputs))
        self._boxes[key] = box
        for node_id in inside:
            self._inside.setdefault(node_id, []).append(box)

    def starts(self, outputs: list[tuple[Any, int, int]]) -> list[tuple[Any, tuple[int, ...]]]:
        """``(node, output_nr, state)`` grouped by node: ``(node, the state of each of its outputs)``; outputs not
        named are :data:`ACCEPT` (another output of the same operation, not the call's)."""
        grouped: dict[int, list] = {}
        for node, nr, state in outputs:
            entry = grouped.setdefault(id(node), [node, [ACCEPT] * max(len(self._outputs(node)), nr + 1)])
            entry[1][nr] = state
        return [(node, tuple(states)) for node, states in grouped.values()]

    def remove_box(self, key: int) -> None:
        """The call is no longer re-run (its parameters moved on): walks go through it again."""
        box = self._boxes.pop(key, None)
        if box is None:
            return
        for node_id in box.inside:
            boxes = self._inside.get(node_id)
            if boxes is not None:
                boxes[:] = [other for other in boxes if other is not box]
        self._good.clear()

    def is_box(self, key: int) -> bool:
        return key in self._boxes

    def _entered(self, node, consumer) -> "_Box | None":
        """The outermost box that ``consumer`` is in and ``node`` is not (``None``: no box is entered)."""
        boxes = self._inside.get(id(consumer))
        if not boxes:
            return None
        around = self._inside.get(id(node), ())
        entered = [box for box in boxes if all(box is not other for other in around)]
        return max(entered, key=lambda box: len(box.inside), default=None)

    # ---- the walk ----------------------------------------------------------------------
    def broken(self, outputs: list[tuple[Any, int, int]]) -> str | None:
        """``None`` if the rows of ``outputs`` (``(node, output_nr, (dimension, rows per sample))``) reach the
        model's outputs row for row; else the operation that breaks them, in words."""
        stack, seen = self.starts(outputs), set()
        self.misplaced = False
        while stack:
            node, states = stack.pop()
            key = (id(node), states)
            if key in seen or key in self._good:
                continue
            seen.add(key)
            end = self.ends.get(id(node))
            if end is not None:  # the model's outputs; then on through what the model computes from them
                for nr, state in enumerate(states):
                    if nr in end and state != ACCEPT:
                        wrong = self._ends_wrong(node, nr, state, end[nr])
                        if wrong is not None:
                            return wrong
            for consumer, position, nr in self.edges.get(id(node), ()):
                state = states[nr] if nr < len(states) else ACCEPT
                if state == ACCEPT or (self.feeds is not None and not self.feeds(consumer)):
                    continue
                if state == BROKEN:
                    return f"{type(node).__name__} (a part of the rows other than the first, or rows reordered)"
                box = self._entered(node, consumer)
                if box is not None:
                    dim = box.entries.get((id(node), nr))
                    if dim is None or state != (dim, 1):
                        return f"{box.name} (reads the rows other than as a batched argument)"
                    stack.extend(box.exits)
                    continue
                after = self._through(consumer, position, self._outputs(node)[nr], state)
                if isinstance(after, str):
                    return after
                stack.append((consumer, after))
        self._good |= seen
        return None

    def _ends_wrong(self, node, nr: int, state, dim: int | None) -> str | None:
        """``None`` if rows in ``state`` end well at output ``nr`` of the model's output ``node`` (batch dimension
        ``dim``; ``None``: :func:`rows_dim` of its shape): along its batch dimension, or at an output the loss
        does not read; else what is wrong, in words."""
        shapes = self._outputs(node)
        shape = list(shapes[nr]) if nr < len(shapes) else None
        if state != BROKEN:
            along, k = state
            if dim is None and shape is not None and along < len(shape):
                dim = rows_dim(shape, shape[along] // k)
            if along == (0 if dim is None else dim):
                return None
        if self.reads is not None and not self.reads(node, nr):
            return None  # no gradient comes back through it
        name, of = type(node).__name__, f"the model's output of shape {shape}" if shape is not None else "a model output"
        if state == BROKEN:
            return f"{name} (the rows are reordered or mixed before {of}, which the loss reads)"
        self.misplaced = True
        return (
            f"{name} (the rows end along dimension {state[0]} of {of}, which the loss reads, but its batch "
            f"dimension is {0 if dim is None else dim})"
        )

    def _outputs(self, node) -> list[tuple[int, ...]]:
        shapes = self._shapes.get(id(node))
        if shapes is None:
            try:
                shapes = [tuple(meta.shape) for meta in node._input_metadata]
            except Exception:  # a node without metadata: its outputs' shapes are unknown
                shapes = []
            self._shapes[id(node)] = shapes
        return shapes

    def _through(self, consumer, position: int, shape: tuple[int, ...], state: tuple[int, int]) -> tuple | str:
        """The state of each output of ``consumer`` whose input ``position`` (of ``shape``) has its rows in
        ``state`` (``(dimension, rows per sample)``); a string: the operation breaks them (what it is)."""
        name = type(consumer).__name__
        outputs = self._outputs(consumer)
        if not outputs:
            return f"{name} (an operation whose outputs are unknown)"
        if all(len(out) == 0 for out in outputs):
            return tuple(ACCEPT for _ in outputs)  # a single number: the loss (or a sum over everything)
        dim, k = state
        ndim = len(shape)
        if dim >= ndim or shape[dim] == 0:
            return tuple(ACCEPT for _ in outputs)
        rows = shape[dim]
        kind = _kind(type(consumer))
        along = f"{name} along the batch dimension"
        moved = f"{name} (the rows moved to another dimension)"

        def at(new_dim: int) -> tuple:
            return tuple((new_dim, k) if len(out) > new_dim else ACCEPT if not out else BROKEN for out in outputs)

        keep = at(dim)
        if kind in _ELEMENTWISE:
            return self._generic(kind, outputs, shape, dim, k, name)
        if kind in _VIEWS:  # the same order of elements: whole samples must stay together
            return self._view(kind, shape, outputs[0], dim, k) or f"{name} (a reshape that splits the samples)"
        if kind in _PRODUCTS and not (kind in _ADDED and position == 0):
            allowed = _PRODUCTS[kind].get(position, ())
            if allowed is None:  # F.linear's input: every dimension but the last stays
                allowed = tuple(range(ndim - 1))
            return at(dim) if dim in [d % ndim for d in allowed] else f"{name} (the rows are contracted or looked up)"
        if kind in _ADDED:
            kind = "AddBackward"  # the added input: broadcast like a sum
        if kind in _PICKS:
            return along
        if kind == "IndexBackward":
            return self._index(consumer, shape, dim, k, outputs) or along
        if kind in _WRITES:
            if position == 0:
                return keep  # the tensor written into keeps its rows
            if kind in ("CopySlices", "MaskedScatterBackward", "PutBackward"):
                return f"{name} (rows written into places of another tensor)"
            if kind == "IndexPutBackward":
                indices = list(getattr(consumer, "_saved_indices", None) or ())
                aligned = ndim == len(outputs[0]) and all(index is None for index in indices[: dim + 1])
                return keep if aligned else along  # values of the written tensor's rank, indexed after the rows
            written = _dims(getattr(consumer, "_saved_dim", 0), ndim)
            if written and written[0] == dim:
                index = getattr(consumer, "_saved_index", None)
                return keep if kind == "IndexAddBackward" and _identity(index, rows) else along
            return keep
        if kind == "CatBackward":
            joined = _dims(getattr(consumer, "_saved_dim", 0), ndim)
            return along if joined == [dim] and position != 0 else keep
        if kind == "StackBackward":
            stacked = _dims(getattr(consumer, "_saved_dim", 0), ndim + 1)[0]
            return at(dim + 1) if stacked <= dim else keep
        if kind == "SliceBackward":
            if _dims(getattr(consumer, "_saved_dim", 0), ndim) != [dim]:
                return keep
            start, step = getattr(consumer, "_saved_start", 0), getattr(consumer, "_saved_step", 1)
            start = 0 if start is None else int(start)
            if start < 0:
                start = max(start + rows, 0)
            return keep if start == 0 and (step is None or int(step) == 1) else along
        if kind in ("SplitBackward", "SplitWithSizesBackward", "UnsafeSplitBackward", "UnsafeSplitWithSizesBackward"):
            if _dims(getattr(consumer, "_saved_dim", 0), ndim) != [dim]:
                return keep
            return (keep[0],) + tuple(BROKEN for _ in outputs[1:])
        if kind in ("SelectBackward", "UnbindBackward"):
            picked = _dims(getattr(consumer, "_saved_dim", 0), ndim)[0]
            if picked == dim:
                return along
            return at(dim - 1 if picked < dim else dim)
        if kind == "PermuteBackward":
            order = _dims(getattr(consumer, "_saved_dims", ()), ndim) or list(range(ndim))
            return at(order.index(dim)) if dim in order else moved
        if kind == "TransposeBackward":
            first, second = _dims((getattr(consumer, "_saved_dim0", 0), getattr(consumer, "_saved_dim1", 0)), ndim)
            return at(second if dim == first else first if dim == second else dim)
        if kind == "TBackward":
            return at(1 - dim) if ndim == 2 else keep
        if kind == "DiagonalBackward":
            pair = _dims((getattr(consumer, "_saved_dim1", 0), getattr(consumer, "_saved_dim2", 1)), ndim)
            return along if dim in pair else at(dim - sum(d < dim for d in pair))
        if kind == "RepeatBackward":
            repeats = [int(r) for r in (getattr(consumer, "_saved_repeats", ()) or ())]
            shift = len(repeats) - ndim
            return at(dim + shift) if shift >= 0 and repeats[dim + shift] == 1 else along
        if kind == "ConstantPadNdBackward":
            pad = [int(p) for p in (getattr(consumer, "_saved_pad", ()) or ())]
            slot = 2 * (ndim - 1 - dim)
            return along if slot < len(pad) and pad[slot] != 0 else keep
        if kind == "UnfoldBackward":
            return along if _dims(getattr(consumer, "_saved_dimension", 0), ndim) == [dim] else keep
        if kind in _NORMS and position == 0:  # normalisations: statistics over some dimensions of their input
            over = _NORMS[kind](consumer, ndim)
            if dim in over:
                return f"{name} ({MIXES_ROWS}: a normalisation's statistics)"
            return keep
        if kind in _POOLS and position == 0:  # pooling and resampling: windows over the trailing dimensions
            spatial = 3 if "3D" in kind else 1 if "1D" in kind else 2
            return along if dim >= ndim - spatial else keep
        if kind == "RenormBackward" and position == 0:  # each slice along ``dim`` renormed over all the others
            if _dims(getattr(consumer, "_saved_dim", 0), ndim) != [dim]:
                return f"{name} ({MIXES_ROWS}: a norm over the rows)"
            return keep
        if kind in _MATRIX_FUNCTIONS and position == 0:  # functions of the matrices in the last two dimensions
            if dim >= ndim - 2:
                return f"{name} ({MIXES_ROWS}: a matrix function of the rows)"
            return keep
        for attribute in ("_saved_dim", "_saved_dims"):  # softmax, cumsum, sort, topk, flip, roll, reductions, ...
            value = getattr(consumer, attribute, _MISSING)
            if value is _MISSING:
                continue
            dims = _dims(value, ndim)
            if dims is None or dim in dims:
                return along
            if getattr(consumer, "_saved_keepdim", True) is False:  # a reduction that drops its dimensions
                return at(dim - sum(d < dim for d in dims))
            return keep
        return self._generic(kind, outputs, shape, dim, k, name)

    @staticmethod
    def _generic(kind: str, outputs, shape, dim: int, k: int, name: str) -> tuple | str:
        """Any other operation: the rows stay where its outputs keep the dimensions up to theirs and add none
        (element-wise operations broadcast from the right: the dimensions they add come first)."""
        ndim, rows = len(shape), shape[dim]
        after = []
        for out in outputs:
            if len(out) == 0:
                after.append(ACCEPT)
            elif kind in _ELEMENTWISE:
                new = dim + len(out) - ndim
                after.append((new, k) if 0 <= new < len(out) and out[new] == rows else BROKEN)
            elif dim < len(out) <= ndim and tuple(out[: dim + 1]) == tuple(shape[: dim + 1]):
                after.append((dim, k))
            else:
                after.append(BROKEN)
        if all(state == BROKEN for state in after):
            return f"{name} (its outputs do not keep the batch dimension where it was)"
        return tuple(after)

    @staticmethod
    def _view(kind: str, shape, out, dim: int, k: int) -> tuple | None:
        """A reshape keeps the rows if the dimensions before theirs keep their product and whole samples stay
        together after them: ``k * out[new] / rows`` rows per sample along the new dimension."""
        if kind == "ExpandBackward":  # dimensions added in front
            shift = len(out) - len(shape)
            return ((dim + shift, k),) if shift >= 0 and out[dim + shift] == shape[dim] else None
        if len(out) == 0:
            return (ACCEPT,)
        rows, before = shape[dim], math.prod(shape[:dim])
        for new in range(len(out)):
            product = math.prod(out[:new])
            if product > before:
                break
            if product == before and (k * out[new]) % rows == 0:
                return ((new, (k * out[new]) // rows),)
        return None

    @staticmethod
    def _index(consumer, shape, dim: int, k: int, outputs) -> tuple | None:
        """``x[...]`` with tensors as indices: where the rows end up, or ``None`` (picked in another order)."""
        indices = list(getattr(consumer, "_saved_indices", None) or ())
        used = [i for i, index in enumerate(indices) if index is not None]
        if not used:
            return tuple((dim, k) for _ in outputs)
        if any(indices[i].dtype == torch.bool for i in used):  # a mask: rows kept only if it keeps them all
            if used == [dim] and _identity(indices[dim], shape[dim]):
                return tuple((dim, k) for _ in outputs)
            if dim < used[0] and len(used) == 1:  # a mask over later dimensions
                return tuple((dim, k) for _ in outputs)
            return None
        try:
            picked = torch.broadcast_tensors(*(indices[i] for i in used))
        except RuntimeError:
            return None
        together = used == list(range(used[0], used[0] + len(used)))
        width = picked[0].dim()
        if dim in used:
            if dim != used[0] or width == 0 or not _identity(picked[0], shape[dim]):
                return None
            new = used[0] if together else 0
        elif together:
            new = dim if dim < used[0] else dim - len(used) + width
        else:
            rest = [d for d in range(len(shape)) if d not in used]
            new = width + rest.index(dim)
        return tuple((new, k) for _ in outputs)


def rows_dim(shape, batch: int) -> int | None:
    """The dimension along which a model's output of ``shape`` holds the batch's ``batch`` rows: the first whose
    size is a multiple of ``batch`` (``[B, T, V]``, ``[B*T, V]``: 0; an RNN's ``h_n`` ``[layers, B, H]`` with
    ``layers`` not a multiple of ``B``, ``[T, B, V]``: 1); ``None``: none."""
    if batch <= 0:
        return None
    return next((dim for dim, size in enumerate(shape) if size and size % batch == 0), None)


class _Box:
    __slots__ = ("name", "inside", "entries", "exits")

    def __init__(self, name: str, inside: dict[int, Any], entries: dict[tuple[int, int], int], exits: list):
        self.name, self.inside, self.entries, self.exits = name, inside, entries, exits
