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
non-finite entries. Two kinds of value are made by the step's own code
although no recorded operation outputs them:

* a *constant*: the tensor ``torch.tensor(...)`` builds in Python, or the one a
  Python number becomes in ``x[:, 6:] = float("-inf")``, reaches the dispatcher
  only through ``aten.lift_fresh``; its value gets ``"source": "constant"``.
* a value written *through a view*: after ``pad[:, 6:].fill_(...)`` (or
  ``copy_``, or any in-place operation on a view) the base ``pad`` holds other
  numbers under the same tensor. A tensor read again after a recorded
  in-place operation changed its storage (its version counter moved) gets a
  new id with ``"alias_of"`` (the id it had) and ``"written_by"`` (the
  operation that wrote).

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

#: operations that lift a tensor made in Python (``torch.tensor(...)``, a number written into a slice) into
#: the dispatcher: their input is a constant of the program, not a value the step received
_LIFTS = {"aten::lift_fresh", "aten::lift_fresh_copy"}

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


def _version_of(tensor: torch.Tensor) -> int | None:
    """The version counter (moved by every in-place write, shared by a tensor and its views), or ``None``."""
    try:
        return tensor._version
    except (RuntimeError, AttributeError):  # inference tensors, some subclasses
        return None


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """Which memory a tensor lives in (shared by a tensor and its views), or ``None`` where it has none."""
    try:
        return str(tensor.device), tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


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
        #: value id -> the tensor's version counter when the id was given
        self._versions: dict[int, int | None] = {}
        #: storage -> (index of the last recorded operation that wrote into it, version counter after it)
        self._writes: dict[tuple[str, int], tuple[int, int | None]] = {}
        #: (index, tensor) written by the last recorded operation; autograd moves the version counter of an
        #: in-place operation's tensor after our mode returns, so it is read when the next operation comes
        self._pending: list[tuple[int, torch.Tensor]] = []
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
        self._pending = []
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
        self._versions[value_id] = _version_of(tensor)
        self.values[value_id] = info
        return value_id

    def _input_id(self, tensor: torch.Tensor, keep: bool, phase: str, constant: bool = False) -> int:
        """The id of an operation's input; a tensor not seen before is an external value (``constant``: one
        the step's code made in Python, the input of ``aten.lift_fresh``)."""
        value_id = self._ids.get(tensor)
        if value_id is not None:
            return self._rewritten_id(tensor, value_id)
        source = self.names.get(id(tensor))
        if constant:
            source = "constant"
        elif source is None:  # the batch, or in the backward pass a tensor autograd saved or made
            source = "autograd" if phase == "backward" else "input"
        info = summarize(tensor, self.summaries)
        info["source"] = source
        info["op"] = None
        value_id = self._new_id(tensor, info)
        if keep:
            self.tensors[value_id] = tensor.detach().clone()
        return value_id

    def _rewritten_id(self, tensor: torch.Tensor, value_id: int) -> int:
        """``value_id``, or a new id if a recorded in-place operation on a view of ``tensor`` (or on a tensor
        it is a view of) changed its numbers since ``value_id`` was given (see the module docstring)."""
        now = _version_of(tensor)
        if now is None or now == self._versions.get(value_id, now):
            return value_id
        key = _storage_key(tensor)
        write = self._writes.get(key) if key is not None else None
        if write is None or write[1] != now:  # changed by something the tape did not see: as before
            return value_id
        info = summarize(tensor, self.summaries)
        info.update({"source": None, "op": None, "alias_of": value_id, "written_by": write[0]})
        return self._new_id(tensor, info)

    def _note_writes(self, func, args, kwargs, index: int) -> None:
        """Remember the tensors an in-place (or ``out=``) operation wrote into, for :meth:`_settle_writes`."""
        for position, argument in enumerate(func._schema.arguments):
            alias = argument.alias_info
            if alias is None or not alias.is_write:
                continue
            value = kwargs.get(argument.name) if argument.kwarg_only or position >= len(args) else args[position]
            self._pending += [(index, leaf) for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]

    def _settle_writes(self) -> None:
        """The version counters the last recorded in-place operation left: of the storage it wrote into (for
        :meth:`_rewritten_id`), and of the value it gave a new id (which is then not "changed since")."""
        pending, self._pending = self._pending, []
        for index, tensor in pending:
            version = _version_of(tensor)
            key = _storage_key(tensor)
            if key is not None:
                self._writes[key] = (index, version)
            value_id = self._ids.get(tensor)
            if value_id is not None and self.values[value_id].get("op") == index:
                self._versions[value_id] = version

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
        if self._pending:
            self._settle_writes()
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
        schema_name = func._schema.name
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._input_id(leaf, keep=replay, phase=phase, constant=schema_name in _LIFTS)
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
        if func._schema.is_mutable:
            self._note_writes(func, args, kwargs, index)
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
