"""BackPACK's curvature diagonals under the memory budget: the backpropagated factors a block of columns at a time.

``DiagHessian`` and ``DiagGGNExact`` backpropagate *factors* ``[V, B, *features]``
through every layer: ``V`` columns of the loss Hessian's square root (``C``,
or ``C - 1`` for the cross-entropy, :func:`~cockpit_like.backends.conv_diagonals.reduced_sqrt_hessian`),
and for ``DiagHessian`` also, from every activation with a nonzero second
derivative (Tanh, Sigmoid, ELU, ...), the square roots of its positive and
negative residual, with as many columns as the activation has features. In
one backward pass all columns travel at once, so the transient grows with
``V x B x`` (the largest feature map): on DeepOBS 3c3d one ``[9, 128, 64, 28, 28]``
factor is 231 MB and two exist at once; behind a Tanh layer of 1024 features
a residual is ``1024 x B x 1024`` numbers.

Every diagonal is a sum over columns (``sign * (J^T m_v)^2`` per column ``m_v``),
so the columns can be taken a few at a time. :func:`column_blocks` gives an
extension a *recording twin* (same class and settings, by
:func:`~cockpit_like.backends.no_grad.twin_class`, as ``without_autograd`` does): during the
backward pass it only records each module's call (its stored inputs and
output, which BackPACK would free after the module's hook, and the output
gradient where a rule reads it: the loss and the curved activations).
:meth:`ColumnReplay.run`, right after the backward pass, replays the modules
in the order their hooks ran, once per block of columns: from the loss for
its factor and from each curved activation for its residual. The columns of
a block are chosen so that the factors on both sides of any module take at
most the budget (``Cockpit(memory_budget=...)``, default 256 MB; at least one
column). Each block's parameter diagonals are added up; the result is
BackPACK's up to the order of the sums (``tests/test_column_blocks.py``).

What stays whole: the loss's own factor ``[V, B, C]`` (made once, then cut
into blocks), and the temporaries inside one module's Jacobian product.

May import torch, BackPACK and :mod:`cockpit_like.backends`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from backpack.extensions import DiagGGNExact, DiagHessian
from backpack.extensions.mat_to_mat_jac_base import MatToJacMat
from backpack.extensions.secondorder.diag_hessian.diag_h_base import DiagHBaseModule
from backpack.utils.module_classification import is_loss

from cockpit_like.backends.no_grad import twin_class

__all__ = ["ColumnReplay", "column_blocks", "BLOCKED_TYPES"]

#: the extension types whose factors are taken in blocks of columns (exact types: a subclass may keep
#: backpropagated quantities that a replay would not reproduce)
BLOCKED_TYPES = (DiagHessian, DiagGGNExact)


def _reads_inside(waiting: dict, output: torch.Tensor) -> bool:
    """Whether a quantity waits for a tensor that starts inside ``output``'s memory after its first element (a
    view of a part of it: ``out[:, k:]``)."""
    start = output.data_ptr()
    end = start + output.numel() * output.element_size()
    return any(start < key < end for key in waiting)


def _key(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape)


def _in_data_order(calls: list) -> list:
    """The recorded calls with every consumer before the call that made what it reads (backward order).

    Modules that pass their input through as the same memory (``nn.Identity``, ``nn.Dropout(p=0)``, a second
    ``nn.Flatten``) have their backward hooks fire at one autograd node, in an order that changed from one step
    to the next (outside trial 39: ``Flatten`` then ``Dropout(p=0)`` at step 0, the other way round at step 1,
    which the replay read as a later module reading a part of an output). Among calls whose outputs share
    memory, a call recorded before one that reads what it wrote (same memory and shape), where that one's output
    is not also what it reads (two pass-throughs of one tensor: either order), moves after it; every other order
    is kept.
    """
    order = list(calls)
    keys = {id(call): (_key(call.io["output"]), {_key(t) for t in call.inputs}) for call in order}
    for _ in range(len(order)):
        groups: dict[int, list[int]] = {}  # output memory -> positions of the calls that returned it
        for position, call in enumerate(order):
            groups.setdefault(keys[id(call)][0][0], []).append(position)
        misplaced = next(
            ((i, j) for group in groups.values() if len(group) > 1 for a, i in enumerate(group) for j in group[a + 1:]
             if keys[id(order[i])][0] in keys[id(order[j])][1] and keys[id(order[j])][0] not in keys[id(order[i])][1]),
            None,
        )  # fmt: skip
        if misplaced is None:
            break
        i, j = misplaced
        order.insert(i, order.pop(j))  # the consumer first
    return order
    keys = {id(call): (_key(call.io["output"]), {_key(t) for t in call.inputs}) for call in order}
    for _ in range(len(order)):
        misplaced = next(
            ((i, j) for i in range(len(order)) for j in range(i + 1, len(order))
             if keys[id(order[i])][0][0] == keys[id(order[j])][0][0]
             and keys[id(order[i])][0] in keys[id(order[j])][1]
             and keys[id(order[j])][0] not in keys[id(order[i])][1]),
            None,
        )  # fmt: skip
        if misplaced is None:
            break
        i, j = misplaced
        order.insert(i, order.pop(j))  # the consumer first
    return order


@dataclass
class _Call:
    """One module's hook call of the backward pass, as the replay needs it."""

    module: torch.nn.Module
    extension: object  # the module extension
    io: dict  # "output", "input0", ...: what BackPACK's forward hook stored on the module
    g_inp: tuple
    g_out: tuple
    curved: bool  # DiagHessian: an activation with a nonzero second derivative (a residual starts here)

    @property
    def inputs(self) -> list[torch.Tensor]:
        return [value for name, value in self.io.items() if name != "output" and value.requires_grad]

    @contextmanager
    def restored(self):
        """The module's stored inputs and output put back for BackPACK's rules, removed again after."""
        module, saved = self.module, {}
        for name, value in self.io.items():
            if name in vars(module):
                saved[name] = vars(module)[name]
            setattr(module, name, value)
        try:
            yield
        finally:
            for name in self.io:
                if name in saved:
                    setattr(module, name, saved[name])
                elif hasattr(module, name):
                    delattr(module, name)


def _columns_buffer(output: torch.Tensor) -> bool:
    """Whether a transposed convolution on ``output``'s device and dtype goes through ATen's own
    ``slow_conv_transpose``, which unfolds the whole batch into a columns buffer (float64 on the CPU;
    float32 uses oneDNN there, which does not)."""
    return output.device.type == "cpu" and (output.dtype == torch.float64 or not torch.backends.mkldnn.is_available())


def _recording_call(_original):
    def __call__(self, module, g_inp, g_out):
        self._cockpit_column_replay.record(module, g_inp, g_out)

    return __call__


def column_blocks(extension, budget_bytes: int) -> tuple[object, "ColumnReplay"]:
    """``(twin, replay)``: a twin of ``extension`` that records the backward pass, and its replay.

    ``isinstance(twin, type(extension))`` holds and the twin has the
    extension's settings; pass it to ``backpack(...)`` in the extension's
    place and call ``replay.run()`` after ``loss.backward()``: the parameters
    then hold ``p.<savefield>`` as the extension itself would have written it.
    """
    if type(extension) not in BLOCKED_TYPES:
        raise TypeError(f"column_blocks: expected one of {[t.__name__ for t in BLOCKED_TYPES]}, got {type(extension).__name__}")
    replay = ColumnReplay(extension, budget_bytes)
    twin = object.__new__(twin_class(type(extension), "record", _recording_call))
    twin.__dict__ = dict(vars(extension), _cockpit_column_replay=replay)
    return twin, replay


class ColumnReplay:
    """The recorded calls of one backward pass, replayed a block of columns at a time (module docstring)."""

    def __init__(self, extension, budget_bytes: int):
        self.extension = extension
        self.budget_bytes = max(1, int(budget_bytes))
        self._hessian = isinstance(extension, DiagHessian)
        self._calls: list[_Call] = []
        #: the passes of the last :meth:`run`: per pass its ``(source, first column, end column)``,
        #: the source ``"loss"`` or the activation's class name
        self.blocks: list[list[tuple[str, int, int]]] = []

    # ---- during the backward pass ----------------------------------------------------------
    def record(self, module: torch.nn.Module, g_inp, g_out) -> None:
        # BackPACK's own lookup: an unsupported layer raises here, inside backward, as without blocks
        module_extension = self.extension._BackpropExtension__get_module_extension(module)
        if module_extension is None:
            return
        if is_loss(module):
            earlier = [type(call.module).__name__ for call in self._calls if is_loss(call.module)]
            if earlier:  # (outside trial 42: BackPACK's "No accumulation rule", or a raw shape error from its GGN)
                raise NotImplementedError(
                    f"two extended loss modules ran in this backward pass ({earlier[0]} and {type(module).__name__}): "
                    "BackPACK's curvature starts from one loss module's output; a sum of two has no factor it can "
                    "backpropagate"
                )
        io = {"output": module.output}
        index = 0
        while hasattr(module, f"input{index}"):
            io[f"input{index}"] = getattr(module, f"input{index}")
            index += 1
        curved = self._curved(module_extension, module)
        keep = curved or is_loss(module)
        nothing = lambda grads: tuple(None for _ in grads)  # noqa: E731 - no other rule reads them
        g_out = tuple(g_out) if keep else nothing(g_out)
        self._calls.append(_Call(module, module_extension, io, nothing(g_inp), g_out, curved))

    def _curved(self, module_extension, module) -> bool:
        """Whether the module adds a residual (``DiagHessian``: an activation with a nonzero second derivative)."""
        if not (self._hessian and isinstance(module_extension, DiagHBaseModule)) or is_loss(module):
            return False
        return not module_extension.derivatives.hessian_is_zero(module)

    # ---- after the backward pass -----------------------------------------------------------
    def run(self) -> None:
        """Compute and store ``p.<savefield>`` for every recorded module's parameters; forget the calls."""
        calls, self._calls = _in_data_order(self._calls), []
        self.blocks = []
        if not calls:
            return
        totals: dict[tuple[int, str], torch.Tensor] = {}
        with torch.no_grad():
            width = max(self._column_bytes(call) for call in calls)
            per_pass = max(1, self.budget_bytes // max(1, width))
            sources = [(index, *source) for index, call in enumerate(calls) for source in self._sources(call)]
            for pieces in self._passes(sources, per_pass):
                self.blocks.append([(label, a, b) for _, label, _, a, b in pieces])
                self._propagate(calls, pieces, totals)
        for (index, name), value in totals.items():
            setattr(getattr(calls[index].module, name), self.extension.savefield, value)

    @staticmethod
    def _passes(sources: list, per_pass: int) -> list[list]:
        """The sources' columns packed in order into passes of at most ``per_pass`` columns (at least one):
        each pass a list of ``(call index, label, block, start, stop)``, at most one piece per source. With
        everything in one pass this is BackPACK's own pass (the residuals join the loss's factor)."""
        passes: list[list] = [[]]
        room = per_pass
        for index, label, columns, block in sources:
            start = 0
            while start < columns:
                if room == 0:
                    passes.append([])
                    room = per_pass
                stop = min(columns, start + room)
                passes[-1].append((index, label, block, start, stop))
                room -= stop - start
                start = stop
        return [pieces for pieces in passes if pieces]

    @staticmethod
    def _column_bytes(call: _Call) -> int:
        """Bytes that one column adds while the module's Jacobian is applied: the factors at its output and
        its largest input (the output alone where no input needs one), and for a convolution on the CPU
        without oneDNN (float64) the columns buffer of the transposed convolution that applies it (``C_in k^2``
        numbers per output position: 9-25x the factor for a 3x3-5x5 kernel over few channels)."""
        output = call.io["output"]
        numbers = output.numel()
        if not call.inputs:  # nothing is passed on (a first layer): only its parameters' diagonals
            return numbers * output.element_size()
        numbers += max(v.numel() for v in call.inputs)
        module = call.module
        if isinstance(module, torch.nn.modules.conv._ConvNd) and output.dim() > 2 and _columns_buffer(output):
            spatial = max(
                math.prod(output.shape[2:]),
                max((math.prod(v.shape[2:]) for n, v in call.io.items() if n != "output" and v.dim() > 2), default=0),
            )
            numbers += output.shape[0] * module.weight[0].numel() * module.groups * spatial
        return numbers * output.element_size()

    def _sources(self, call: _Call):
        """``(label, columns, block(start, stop))`` of the factors that start at this call's inputs."""
        ext, module = self.extension, call.module
        if is_loss(module):
            with call.restored():
                factor = call.extension.backpropagate(ext, module, call.g_inp, call.g_out, None)
            if isinstance(factor, dict):  # DiagHessian: {"matrices": [F], "signs": [+1]}
                matrices, signs = factor["matrices"], factor["signs"]
                for matrix, sign in zip(matrices, signs):
                    yield "loss", matrix.shape[0], lambda a, b, m=matrix, s=sign: {"matrices": [m[a:b]], "signs": [s]}
            else:
                yield "loss", factor.shape[0], lambda a, b, m=factor: m[a:b]
            return
        if not call.curved:
            return
        if not call.extension.derivatives.hessian_is_diagonal(module):
            raise NotImplementedError(f"DiagHessian: the second derivative of {type(module).__name__} is not diagonal")
        with call.restored():
            curvature = call.extension.derivatives.hessian_diagonal(module, call.g_inp, call.g_out)
        batch, shape = curvature.shape[0], curvature.shape[1:]
        flat = curvature.reshape(batch, -1)
        for sign in (DiagHBaseModule.PLUS, DiagHBaseModule.MINUS):
            root = torch.clamp(sign * flat, min=0).sqrt_()  # [B, F]: BackPACK's positive / negative part
            columns = root.ne(0).any(0).nonzero().flatten()  # a zero column adds nothing
            if columns.numel() == 0:
                continue

            def block(a, b, root=root, columns=columns, sign=sign):
                chosen = columns[a:b]
                matrix = root.new_zeros(chosen.numel(), batch, root.shape[1])
                matrix[torch.arange(chosen.numel(), device=root.device), :, chosen] = root[:, chosen].t()
                return {"matrices": [matrix.view(chosen.numel(), batch, *shape)], "signs": [sign]}

            yield type(module).__name__, columns.numel(), block

    def _propagate(self, calls: list[_Call], pieces: list, totals: dict) -> None:
        """One pass: each piece's columns join at the inputs of its source's call and go down the later calls."""
        ext = self.extension
        joining: dict[int, list] = {}
        for index, _, block, start, stop in pieces:
            joining.setdefault(index, []).append(block(start, stop))
        waiting: dict[int, object] = {}
        shapes: dict[int, tuple] = {}  # the shape of the tensor each waiting quantity was handed down for
        readers: dict[int, tuple] = {}  # the call that handed a quantity down to each tensor, and its shape
        for index in range(min(joining), len(calls)):
            call = calls[index]
            output = call.io["output"]
            quantity = waiting.pop(output.data_ptr(), None)
            read = shapes.pop(output.data_ptr(), None) if quantity is not None else None
            if quantity is not None and read != tuple(output.shape):
                # a later call read a part of this output that starts where it does (a loss on out[:, :4] of a
                # layer whose output has 6 columns: outside trial 12, a raw shape error from BackPACK), or all of it
                # in another shape (out.squeeze(1): outside trial 42)
                raise self._partial_output(call, read)
            if quantity is None and _reads_inside(waiting, output):
                # ... or a part that starts after it (out[:, 2:]): nothing would reach the layer (it was refused as
                # "not extended")
                raise self._partial_output(call)
            if quantity is not None:
                module, module_extension = call.module, call.extension
                with call.restored():
                    for name in module_extension._ModuleExtension__params:
                        param = getattr(module, name, None)
                        if param is None or not param.requires_grad:
                            continue
                        value = getattr(module_extension, name)(ext, module, call.g_inp, call.g_out, quantity)
                        key = (index, name)
                        totals[key] = value if key not in totals else totals[key].add_(value)
                    if call.inputs:
                        quantity = self._backpropagate(call, quantity)
                    else:
                        quantity = None
            for joined in joining.get(index, ()):
                quantity = self._join(quantity, joined)
            if quantity is not None and call.inputs:
                self._hand_down(call, quantity, waiting, shapes)
                readers.update({t.data_ptr(): (call, tuple(t.shape)) for t in call.inputs})
        # the loss's factor handed down to a tensor that no recorded module returned: an operation between the model
        # and the loss that BackPACK does not see (outside trial 43: an extended loss on model(x) / T, told that the
        # layers were "not extended, not supported, or not used in the loss"). (A tensor a first layer reads that
        # requires grad, an input being perturbed, is no such case: only the loss's own input is asked about.)
        for key in waiting:
            reader, shape = readers[key]
            if is_loss(reader.module):
                raise self._outside_modules(reader, shape)

    def _outside_modules(self, reader: _Call, shape: tuple):
        """The error for a module (often the extended loss) reading a tensor that no extended module returned."""
        from cockpit_like.backends.step import HUTCHINSON_SCOPE, UnsupportedLayerError

        return UnsupportedLayerError(
            f"{type(reader.module).__name__}: it reads a tensor of shape {list(shape)} that no extended module of the "
            "model returned: an operation outside the model's modules comes between them (model(x) / T for a "
            "temperature, a scale, a mask, out + bias), through which BackPACK's "
            f"{type(self.extension).__name__} cannot pass, so the layers before it got nothing. Do that operation "
            "inside the model in a module BackPACK supports, or fold it into the layer before it (a temperature: "
            "divide that layer's weight and bias by T), or track the curvature with curvature='hutchinson' "
            f"(Hessian-vector products{HUTCHINSON_SCOPE}), or leave out the quantities that need it (HessTrace, "
            "TICDiag)."
        )

    def _partial_output(self, call: _Call, read: tuple | None = None):
        """The error for a layer whose output a later module (an extended loss) reads only a part of, or all of it
        reshaped (``read``: the shape it was read in, where known)."""
        from cockpit_like.backends.step import HUTCHINSON_SCOPE, UnsupportedLayerError

        output = call.io["output"]
        if read is not None and math.prod(read) == output.numel():
            return UnsupportedLayerError(
                f"{type(call.module).__name__} layer: the extended loss reads its whole output (shape "
                f"{list(output.shape)}) reshaped outside the model (out.squeeze(1), out.view(...), out.flatten()): "
                f"BackPACK's {type(self.extension).__name__} propagates curvature only through the model's modules. "
                "Reshape inside the model (nn.Flatten(0) as its last module for outputs [B, 1] -> [B], nn.Unflatten), "
                f"or track the curvature with curvature='hutchinson' (Hessian-vector products{HUTCHINSON_SCOPE}), or "
                "leave out the quantities that need it (HessTrace, TICDiag)."
            )
        return UnsupportedLayerError(
            f"{type(call.module).__name__} layer: a later module (an extended loss) reads a part of its "
            f"output (shape {list(output.shape)}), such as a loss on out[:, :k] or out[:, k:] of a model with two "
            f"heads: BackPACK's {type(self.extension).__name__} propagates curvature through whole outputs only. "
            "Give each head its own output layer, or track the curvature with curvature='hutchinson' "
            f"(Hessian-vector products{HUTCHINSON_SCOPE}), or leave out the quantities that need it (HessTrace, "
            "TICDiag)."
        )

    def _join(self, quantity, joined):
        """``joined`` (a source's block) added to the factors passing the same point (BackPACK appends
        an activation's residual to the factors it passes on)."""
        if quantity is None:
            return joined
        if not self._hessian:  # one source (the loss): never two in one pass
            raise AssertionError("column_blocks: two factors of one extension without residuals met")
        return {"matrices": quantity["matrices"] + joined["matrices"], "signs": quantity["signs"] + joined["signs"]}

    def _backpropagate(self, call: _Call, quantity):
        ext, module = self.extension, call.module
        if self._hessian and isinstance(call.extension, DiagHBaseModule):
            # the factors only: each residual is a source of its own (_sources)
            matrices = MatToJacMat.backpropagate(call.extension, ext, module, call.g_inp, call.g_out, quantity["matrices"])
            return {"matrices": matrices, "signs": list(quantity["signs"])}
        return call.extension.backpropagate(ext, module, call.g_inp, call.g_out, quantity)

    def _hand_down(self, call: _Call, quantity, waiting: dict, shapes: dict) -> None:
        for tensor in call.inputs:
            key = tensor.data_ptr()
            shape = tuple(tensor.shape)
            # (read by several calls in different shapes: no output has the shape None, so its pop above refuses)
            shapes[key] = shape if shapes.get(key, shape) == shape else None
            if key in waiting:  # a tensor read by several modules: BackPACK's rule (DiagHessian has none)
                waiting[key] = self.extension.accumulate_backpropagated_quantities(waiting[key], quantity)
            else:
                waiting[key] = quantity
