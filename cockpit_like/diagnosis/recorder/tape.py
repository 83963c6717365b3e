"""The tape: a ``TorchDispatchMode`` that notes every aten operation of one step.

While active it sees each operation below autograd (PyTorch's own tracing,
no tensor wrappers): the operation's name and overload, its arguments
(tensors by value id, constants as they are), its outputs, the innermost
``nn.Module`` running (PyTorch's global module hooks, installed only while
the tape runs), and the phase: ``forward`` (inside the model's forward
pass), ``loss`` (after it, before the backward pass: the loss and whatever
the training loop computes there), ``backward`` (inside the autograd
engine; the module is the one whose forward operation created the autograd
node, found by the node's sequence number) and ``after-backward``.

Each tensor gets an integer value id the first time it is seen; an in-place
operation gives its result a new id (one id per value, so a record reads as
``v7 = aten.mul.Tensor(v3, v5)``). A tensor first seen as an input of the
forward pass or the loss (parameters, the batch, buffers) is an *external*
value: a copy is kept so that the record can be replayed. So are the
outputs of random operations (dropout masks). Each output gets summary
values: min and max of its finite entries, the count of NaN and of all
non-finite entries.

May import torch and :mod:`cockpit_like.diagnosis.recorder` only.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Tape", "summarize", "encode_argument"]

PHASES = ("forward", "loss", "backward", "after-backward")

#: operations whose outputs hold uninitialised memory (no summary: it would be garbage)
_UNINITIALISED = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}

#: operations that hand tensor values to Python or give data-dependent shapes: the code around
#: them may branch on the data, so the record holds only the path taken at this step
DATA_DEPENDENT = {
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_dim",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::allclose",
}

#: autograd nodes that run module backward hooks (BackPACK's extensions), not the model's math
_HOOK_NODES = {"BackwardHookFunctionBackward"}


def summarize(tensor: torch.Tensor, values: bool = True) -> dict[str, Any]:
    """Shape, dtype, device and (``values``) the summary of a tensor, JSON-ready.

    ``min``/``max`` are over the finite entries (``None`` if there are none),
    ``nonfinite`` counts NaN and ±inf entries, ``nan`` the NaN entries.
    """
    info: dict[str, Any] = {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device": str(tensor.device),
    }
    if (
        not values
        or tensor.numel() == 0
        or tensor.layout != torch.strided
        or tensor.device.type == "meta"
        or tensor.is_complex()
    ):
        return info
    with torch.no_grad():
        data = tensor.detach()
        if data.is_floating_point():
            finite = torch.isfinite(data)
            low = torch.where(finite, data, math.inf).amin().double()
            high = torch.where(finite, data, -math.inf).amax().double()
            numbers = torch.stack(
                [low, high, torch.isnan(data).sum().double(), (data.numel() - finite.sum()).double()]
            ).tolist()
            low, high, nan, nonfinite = numbers
            if nonfinite == data.numel():
                low = high = None
        else:
            as_number = data.to(torch.int64)
            low, high = torch.stack([as_number.amin(), as_number.amax()]).tolist()
            nan = nonfinite = 0
    info.update({"min": low, "max": high, "nonfinite": int(nonfinite), "nan": int(nan)})
    return info


def encode_argument(value: Any, tensor_id: Callable[[torch.Tensor], int]) -> Any:
    """A JSON-ready form of an operation's argument; tensors become ``{"t": id}``.

    Constants keep their type: floats that are not finite become
    ``{"float": "nan"}``, dtypes ``{"dtype": "float32"}``, devices, layouts and
    memory formats alike; anything else ``{"repr": ...}`` (not replayable).
    """
    if isinstance(value, torch.Tensor):
        return {"t": tensor_id(value)}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):  # torch.Size too
        return [encode_argument(v, tensor_id) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    return {"repr": repr(value)}


def user_name(name: str) -> str:
    """A module path as the user wrote it: ``torch.compile`` wraps the model in an ``OptimizedModule``
    whose submodules are found under ``_orig_mod.`` (``_orig_mod.0`` is the user's ``0``)."""
    parts = [part for part in name.split(".") if part != "_orig_mod"]
    return ".".join(parts) if parts else name


class Tape(TorchDispatchMode):
    """Notes the aten operations of one step (see the module docstring).

    Args:
        root: the model; its forward pass is the ``forward`` phase.
        names: ``id(module or tensor) -> name`` for modules, parameters and buffers.
        paused: ``() -> bool``; while true, operations are run but not noted
            (the cockpit's own per-sample computations during the backward pass).
        max_ops: operations noted at most; further ones are counted only.
        summaries: compute summary values of every output (one device sync per operation).
    """

    def __init__(
        self,
        root: nn.Module,
        names: dict[int, str],
        paused: Callable[[], bool] = lambda: False,
        max_ops: int = 50_000,
        summaries: bool = True,
    ):
        super().__init__()
        self.root = root
        self.names = {key: user_name(name) for key, name in names.items()}
        self.paused = paused
        self.max_ops = max_ops
        self.summaries = summaries
        self.ops: list[dict[str, Any]] = []
        self.values: dict[int, dict[str, Any]] = {}
        #: copies of external values of the forward pass and the loss, and outputs of random operations
        self.tensors: dict[int, torch.Tensor] = {}
        self.dropped = 0
        self.data_dependent: list[int] = []
        self.not_replayable: list[int] = []
        self.root_outputs: list[int] = []
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next_id = 0
        self._stack: list[nn.Module] = []
        self._root_depth = 0
        self._backward_seen = False
        self._node_op: dict[int, int] = {}
        self._peek = torch._C._autograd._get_sequence_nr()
        self._handles: list[Any] = []
        self._phase = "forward"
        self._active = False
        self._busy = False

    # ---- starting and stopping ------------------------------------------------------
    def start(self, inside_root: bool) -> None:
        """Enter the mode and the module hooks; ``inside_root``: the model's forward has begun."""
        if inside_root:
            self._push(self.root)
        hooks = nn.modules.module
        self._handles = [
            hooks.register_module_forward_pre_hook(self._module_enters),
            hooks.register_module_forward_hook(self._module_exits, always_call=True),
        ]
        self._peek = torch._C._autograd._get_sequence_nr()
        self.__enter__()
        self._active = True

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        self.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack = []

    # ---- modules ----------------------------------------------------------------------
    def _push(self, module: nn.Module) -> None:
        self._stack.append(module)
        if module is self.root:
            self._root_depth += 1

    def _module_enters(self, module, args) -> None:
        self._push(module)

    def _module_exits(self, module, args, output) -> None:
        for index in range(len(self._stack) - 1, -1, -1):
            if self._stack[index] is module:
                del self._stack[index:]
                break
        if module is self.root:
            self._root_depth = max(0, self._root_depth - 1)
            if self._root_depth == 0:
                self.root_outputs = [
                    self._ids[t] for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t in self._ids
                ]
                self._busy = True  # our own copies are not operations of the step
                try:
                    self.mark_expected(self.root_outputs)
                finally:
                    self._busy = False

    def module_name(self, module: nn.Module | None) -> str:
        if module is None:
            return ""
        name = self.names.get(id(module))
        return name if name is not None else f"<{type(module).__name__}>"

    # ---- values -----------------------------------------------------------------------
    def id_of(self, tensor: torch.Tensor) -> int | None:
        return self._ids.get(tensor)

    def mark_expected(self, ids: list[int]) -> None:
        """Keep copies of these values (the outputs a replay must reproduce)."""
        for value_id in ids:
            tensor = self._tensor_of(value_id)
            if tensor is not None and value_id not in self.tensors:
                self.values[value_id]["expected"] = True
                self.tensors[value_id] = tensor.detach().clone()

    def _tensor_of(self, value_id: int) -> torch.Tensor | None:
        for tensor, known in self._ids.items():
            if known == value_id:
                return tensor
        return None

    def _new_id(self, tensor: torch.Tensor, info: dict[str, Any]) -> int:
        value_id = self._next_id
        self._next_id += 1
        self._ids[tensor] = value_id
        self.values[value_id] = info
        return value_id

    def _input_id(self, tensor: torch.Tensor, keep: bool, phase: str) -> int:
        value_id = self._ids.get(tensor)
        if value_id is not None:
            return value_id
        source = self.names.get(id(tensor))
        if source is None:  # the batch, or in the backward pass a tensor autograd saved or made
            source = "autograd" if phase == "backward" else "input"
        info = summarize(tensor, self.summaries)
        info["source"] = source
        info["op"] = None
        value_id = self._new_id(tensor, info)
        if keep:
            self.tensors[value_id] = tensor.detach().clone()
        return value_id

    # ---- the operations ---------------------------------------------------------------
    def _current_phase(self, node) -> str:
        if node is not None:
            self._backward_seen = True
            return "backward"
        if self._root_depth > 0:
            return "forward"
        return "after-backward" if self._backward_seen else "loss"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        node = torch._C._current_autograd_node()
        if self._busy or self.paused() or (node is not None and node.name() in _HOOK_NODES):
            return func(*args, **kwargs)
        if len(self.ops) >= self.max_ops:
            self.dropped += 1
            return func(*args, **kwargs)
        peek = torch._C._autograd._get_sequence_nr()
        phase = self._current_phase(node)
        replay = phase in ("forward", "loss")
        leaves, _ = tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._input_id(leaf, keep=replay, phase=phase)
        schema_name = func._schema.name
        encoded_args = encode_argument(list(args), self._ids.__getitem__)
        encoded_kwargs = {k: encode_argument(v, self._ids.__getitem__) for k, v in kwargs.items()}
        inputs = [self._ids[leaf] for leaf in leaves if isinstance(leaf, torch.Tensor)]

        output = func(*args, **kwargs)

        index = len(self.ops)
        module = self._stack[-1] if self._stack and phase in ("forward", "loss") else None
        entry: dict[str, Any] = {
            "index": index,
            "op": f"{schema_name.replace('::', '.')}.{func._overloadname}",
            "phase": phase,
            "module": self.module_name(module),
            "module_type": type(module).__name__ if module is not None else "",
            "args": encoded_args,
            "kwargs": encoded_kwargs,
            "inputs": inputs,
        }
        if phase == "backward":
            entry.update(self._backward_origin(node))
        elif peek != self._peek:  # the autograd node of this operation was created just before it ran
            self._node_op[peek - 1] = index
        self._peek = peek if phase != "backward" else self._peek
        random = torch.Tag.nondeterministic_seeded in func.tags
        summaries = self.summaries and schema_name not in _UNINITIALISED
        outputs = []
        for leaf in tree_leaves(output):
            if not isinstance(leaf, torch.Tensor):
                outputs.append(None)
                continue
            info = summarize(leaf, summaries)
            info["source"] = None
            info["op"] = index
            value_id = self._new_id(leaf, info)
            outputs.append(value_id)
            if random and replay:
                self.tensors[value_id] = leaf.detach().clone()
        entry["outputs"] = outputs
        entry["single"] = isinstance(output, torch.Tensor)
        if random:
            entry["random"] = True
        if schema_name in DATA_DEPENDENT and (phase == "forward" or (replay and module is not None)):
            self.data_dependent.append(index)  # not a training loop's loss.item() outside any module
        if replay and (not schema_name.startswith("aten::") or _has_repr(encoded_args) or _has_repr(encoded_kwargs)):
            self.not_replayable.append(index)
        self.ops.append(entry)
        return output

    def _backward_origin(self, node) -> dict[str, Any]:
        """For an operation of the backward pass: its autograd node and the forward operation behind it."""
        found: dict[str, Any] = {"node": node.name()}
        forward = self._node_op.get(node._sequence_nr())
        if forward is not None:
            found["forward_op"] = forward
            found["module"] = self.ops[forward]["module"]
            found["module_type"] = self.ops[forward]["module_type"]
        else:
            variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter
            if isinstance(variable, torch.Tensor) and id(variable) in self.names:
                found["module"] = self.names[id(variable)]
        return found


def _has_repr(encoded: Any) -> bool:
    if isinstance(encoded, dict):
        return "repr" in encoded or any(_has_repr(v) for v in encoded.values())
    if isinstance(encoded, list):
        return any(_has_repr(v) for v in encoded)
    return False
