"""The model tracer: notes the forward calls that the hook backend needs.

:class:`ModelTracer` is installed once on the model (``Cockpit(model=...)``,
or found at the model's first forward pass with PyTorch's global module
hooks). During *every* forward pass with gradients enabled it notes the
calls of modules with tracked parameters in their subtree (and of batch
norms, which couple the samples): a pre-hook notes where the call began, a
forward hook appends it (two small list operations). The list is handed over
or dropped whenever the cockpit is entered, so a step that tracks nothing
costs that append and nothing else. On steps that need the graph (e.g.
Hessian-vector products) the model's forward runs with PyTorch's math
attention kernel and without cuDNN (whose recurrent layers have no double
backward), so that the backward pass is twice differentiable
(``_graph_kernels``). The cockpit never changes what the model computes:
outputs are returned as they are (the forward hook returns ``None``).

Here also live what a noted call is made of (:class:`Call`, :class:`Shell`
for an output kept without its values) and the walks of the autograd graph
from a call's outputs (``_flat_outputs``, ``_call_nodes``, ``_graph_nodes``)
that the hook backend and the re-run share.

May import torch, :mod:`cockpit_like.backends.module_rules`, :mod:`~cockpit_like.backends.partitions` and
:mod:`~cockpit_like.backends.user_state` only; never
:mod:`~cockpit_like.backends.hooks` or :mod:`~cockpit_like.backends.rerun`
(they import this module).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from cockpit_like.backends.module_rules import RECOMPUTE_RULES
from cockpit_like.backends.partitions import is_dtensor
from cockpit_like.backends.user_state import _MODULE_INTERNALS, held_modules  # (_MODULE_INTERNALS: nn.Module's own)

__all__ = ["ModelTracer", "Call", "Shell", "stateful_parts", "snapshot_state"]


# ---- the tracer ---------------------------------------------------------------------
#: tracer id -> a weak reference to it. A plain dict of references without callbacks, not a WeakValueDictionary:
#: the hooks below read it inside a torch.compile'd forward pass, where dynamo iterates the dict to guard on it, and
#: a WeakValueDictionary's entry removed by the garbage collector in the middle raised "dictionary changed size
#: during iteration" (a fresh-clone CI run, 2026-11-29). Dead references are swept when a tracer is made.
_TRACERS: "dict[int, weakref.ref[ModelTracer]]" = {}
_IDS = itertools.count()


def _tracer_of(tracer_id: int) -> "ModelTracer | None":
    """The live tracer of ``tracer_id``, else ``None``."""
    ref = _TRACERS.get(tracer_id)
    return None if ref is None else ref()


def autocast_state() -> tuple[str, torch.dtype] | None:
    """``(device type, dtype)`` of the autocast active now (CPU or CUDA), or ``None``."""
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            return device, torch.get_autocast_dtype(device)
    return None


def _record(tracer_id: int, module, args, kwargs, output) -> None:
    # a module-level function bound by functools.partial to an int: a pickled model carries no
    # tracer; a deep copy's hooks report to the same tracer, whose step ignores calls that are not
    # part of its backward pass
    tracer = _tracer_of(tracer_id)
    if tracer is None or tracer.paused or not torch.is_grad_enabled():
        return
    calls = tracer.calls
    if len(calls) >= tracer.MAX_CALLS:  # forward passes never backpropagated inside the cockpit
        calls.clear()
    if tracer.batch == 0 and tracer.in_forward():  # found by the global hook, which sees no keyword inputs
        tracer.batch = _leading_dim(args, kwargs)
    node = output.grad_fn if isinstance(output, torch.Tensor) else None
    view = _view_base(output) if node is not None else None
    # where the call began: the calls noted since then are the calls it made (its descendants)
    opened = tracer.opened.get(id(module))
    start = opened.pop() if opened else len(calls)
    states = tracer.states.get(id(module))
    state = states.pop() if states else None
    if start == len(calls) and not module._parameters and not module._modules:
        return  # a leaf without parameters (activations, dropout, pooling): nothing to compute, nothing kept
    if type(module) not in RECOMPUTE_RULES:
        # the outputs' shapes and graph nodes, not their values: autograd keeps what the backward pass needs,
        # and holding the rest (a norm's output before its activation, a block's sum) would raise the peak
        output = tree_map(_shell, output)
    # the output is returned unchanged: the cockpit never changes what the model computes
    # a parameter slot holding a plain tensor during the call: torch.func.functional_call's (or stateless) swap
    swapped = frozenset(
        name for name, value in module._parameters.items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    ) if module._parameters else frozenset()
    noted = (module, args, kwargs, output, node, tracer.batch, min(start, len(calls)), state, autocast_state(),
             view, swapped)
    if tracer.live is not None:  # during a backward pass: a recomputation (activation checkpointing)
        tracer.live.adopt(Call(*noted))
        return
    if not tracer.in_forward():
        tracer.stray = True  # a call outside the model's forward pass (its original module under torch.compile)
    calls.append(noted)  # a Call only at tracked steps


def _view_base(output) -> tuple | None:
    """``(node, output_nr, shape)`` of the tensor that a call's output is a reshaped view of, all of it (``nn.Linear``
    on ``[B, T, D]`` returns a view of its ``[B*T, D]`` product), else ``None``. An in-place operation on such an
    output after the call (``x += self.pos``, ``nn.ReLU(inplace=True)``) takes the view's node out of the graph:
    the gradient then reaches the call only through the base's node (:meth:`HookBackend._register`)."""
    if not output._is_view():
        return None
    base = output._base
    if (
        base.grad_fn is None or base.numel() != output.numel() or not base.is_contiguous()
        or not output.is_contiguous() or output.data_ptr() != base.data_ptr()
    ):
        return None
    return base.grad_fn, base.output_nr, output.shape


class Shell:
    """A recorded output without its values: shape, dtype, device and graph node (see :func:`_record`)."""

    __slots__ = ("shape", "dtype", "device", "grad_fn", "output_nr", "ref", "version")

    def __init__(self, shape, dtype, device, grad_fn, output_nr, ref=None, version=None):
        self.shape, self.dtype, self.device, self.grad_fn, self.output_nr = torch.Size(shape), dtype, device, grad_fn, output_nr
        #: a weak reference to the recorded tensor (``None``: not kept): whether another holder's tensor is it
        self.ref = ref
        #: the tensor's version counter when the call returned (:meth:`values`)
        self.version = version

    def is_tensor(self, value) -> bool:
        """Whether ``value`` is the recorded tensor (still alive)."""
        return self.ref is not None and self.ref() is value

    def values(self) -> torch.Tensor | None:
        """The recorded tensor where another holder kept it alive (the model's output the loss read, a block's
        output a later layer saved) and nothing wrote it in place since the call returned, else ``None``."""
        value = self.ref() if self.ref is not None else None
        if value is None or value._version != self.version:
            return None
        return value

    def dim(self) -> int:
        return len(self.shape)

    def expand(self, *shape) -> "Shell":
        return Shell(shape, self.dtype, self.device, self.grad_fn, self.output_nr)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


def _shell(value):
    if isinstance(value, torch.Tensor):
        return Shell(value.shape, value.dtype, value.device, value.grad_fn, value.output_nr, weakref.ref(value),
                     value._version)
    return value


def _open(tracer_id: int, module, args) -> None:
    tracer = _tracer_of(tracer_id)
    if tracer is None or tracer.paused or not torch.is_grad_enabled():
        return
    if not tracer.in_forward() and any(ref() is module for ref in tracer.roots):
        # (a root's pre-hooks: this one before the one that begins its forward pass)
        if tracer._tracking():
            tracer.parameters_begin(module)
        else:
            tracer.changed_start = None
    tracer.opened.setdefault(id(module), []).append(len(tracer.calls))
    tracer.states.setdefault(id(module), []).append(_state_at_start(tracer, module))


def _state_at_start(tracer, module: nn.Module) -> list:
    """What a re-run of this call starts from (``Call.state``): copies of the buffers of the module's stateful parts
    (:func:`snapshot_state`), and references to the module's own tensor and ``None`` attributes and buffers as the
    call begins (:func:`start_references`)."""
    stateful = tracer.stateful.get(id(module))
    state = (snapshot_state(stateful) if stateful else []) + start_references(module)
    if tracer.changed_start:
        state.append(ChangedStart(tracer.changed_start))
    return state


class ChangedStart(dict):
    """``id(parameter) -> copy``: the parameters that a forward pass of the model was seen changing (a momentum
    encoder or mean teacher updated in place in ``forward``, as ALBEF's and BLIP's), as they were when
    the model's forward pass began: a re-run starts from them (:meth:`~cockpit_like.backends.rerun._Rerun.rewind`),
    so it computes what the call computed."""


#: ``id(parameter) -> weak reference``: the parameters a forward pass of a model was seen changing (their
#: version counter or storage moved between the model's forward pre-hook and its forward hook)
_CHANGED_IN_FORWARD: dict[int, weakref.ref] = {}


def _mark(param: torch.Tensor) -> tuple[int | None, int | None]:
    """``(version counter, storage pointer)`` of ``param``; ``None`` where it has none (a tensor without storage:
    ``torch.func``'s functional or batched tensors, swapped in by a look-ahead)."""
    try:
        return param._version, param.data_ptr()
    except RuntimeError:
        return None, None


def changed_in_forward(param: torch.Tensor) -> bool:
    """Whether a forward pass of a model was seen changing ``param`` (:meth:`ModelTracer.parameters_end`)."""
    seen = _CHANGED_IN_FORWARD.get(id(param))
    return seen is not None and seen() is param


def start_references(module: nn.Module) -> list[tuple[nn.Module, str, Any, str]]:
    """``(module, name, value, kind)`` of the module's own attributes that hold a tensor (not a parameter) or
    ``None`` (``kind`` "attribute") and of its buffers (``kind`` "buffer"), as they are now: references, no copies.
    A forward pass that keeps a state there (``self.state = h``, a buffer registered as ``None`` and filled: Hugging
    Face RecurrentGemma's RG-LRU keeps its recurrent state so, also without a cache) changed them by the time the
    cockpit re-runs the call; each re-run starts from these (outside trial 10: the re-run read the batch's final
    state, and every step raised)."""
    references = [
        (module, name, value, "attribute") for name, value in module.__dict__.items()
        if name not in _MODULE_INTERNALS
        and (value is None or (isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)))
    ]
    references += [(module, name, value, "buffer") for name, value in module._buffers.items()]
    return references


#: the most buffer entries of a module of the user's own that its calls copy (:func:`stateful_parts`)
_STATE_COPY_LIMIT = 1 << 20


def stateful_parts(module: nn.Module) -> list[nn.Module]:
    """The modules inside ``module`` whose buffers a forward pass may update in place: those of parametrizations
    (``torch.nn.utils.parametrize``; ``spectral_norm``'s power iteration vectors ``_u``, ``_v`` in training mode),
    which run whenever the parametrized tensor is read, and a module of the user's own with parameters and
    floating-point buffers of its own (a running normaliser, an annealing counter that ``forward`` updates after
    using them: the re-runs start from the values the call began with; outside trial 8)."""
    from torch.nn.utils.parametrize import ParametrizationList

    parts: list[nn.Module] = []
    for child in module.modules():
        if isinstance(child, ParametrizationList):
            parts.extend(part for part in child.modules() if part._buffers)
        elif type(child).__module__.split(".")[0] not in ("torch", "transformers") and child._parameters:
            floating = [b for b in child._buffers.values() if isinstance(b, torch.Tensor) and b.is_floating_point()]
            # (copied at each of its calls at tracked steps: not a large table, such as a causal mask, kept fixed)
            if floating and sum(b.numel() for b in floating) <= _STATE_COPY_LIMIT:
                parts.append(child)
    return parts


def snapshot_state(parts: list[nn.Module]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, buffer name, copy)`` of every buffer of ``parts`` as it is now (:func:`stateful_parts`)."""
    return [
        (part, name, value.detach().clone())
        for part in parts
        for name, value in part._buffers.items()
        if isinstance(value, torch.Tensor)
    ]


def _leading_dim(args, kwargs) -> int:
    for value in itertools.chain(args, (kwargs or {}).values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return 0


def _before_root(tracer_id: int, module, args, kwargs) -> None:
    tracer = _tracer_of(tracer_id)
    if tracer is not None and not tracer.paused:
        tracer.enter_forward(args, kwargs, module)


def _after_root(tracer_id: int, held: list, module, args, output) -> None:
    tracer = _tracer_of(tracer_id)
    if tracer is not None:
        tracer.exit_forward()
        if not tracer.in_forward():
            tracer.parameters_end()
    else:  # the tracer was collected during the forward pass: put back the kernels it took
        _put_back(held, 1)


def _put_back(held: list, count: int | None = None) -> None:
    """Pop ``count`` (all: ``None``) entries of a tracer's kernel stack, releasing the graph kernels
    of those that hold them. The stack is shared with the root's forward hooks, so the kernels go
    back even when the tracer itself is gone or removed before its forward pass ended."""
    while held and (count is None or count > 0):
        if held.pop():
            _graph_kernels.release()
        if count is not None:
            count -= 1


class Call:
    """One recorded forward call of a module."""

    __slots__ = (
        "module", "args", "kwargs", "output", "node", "params", "grads", "waiting", "entries", "want", "done", "batch",
        "start", "position", "climbed", "consumer", "flat", "state", "autocast", "view_base", "view_fired",
        "swapped",
    )

    def __init__(self, module, args, kwargs, output, node, batch: int = 0, start: int = 0, state=None, autocast=None,
                 view_base=None, swapped=frozenset()):
        self.module, self.args, self.kwargs, self.output, self.node = module, args, kwargs, output, node
        #: names of the module's own parameters that held other tensors during the call (``torch.func.functional_call``
        #: with tensors of its own): the call did not use those parameters, and computes no rows for them
        self.swapped = swapped
        #: where the output is a reshaped view of a whole tensor: that tensor's ``(node, output_nr, shape)``
        #: (:func:`_view_base`); ``view_fired``: the view's own node ran in the backward pass
        self.view_base, self.view_fired = view_base, False
        #: ``(device type, dtype)`` of the autocast the call ran under (``None``: none): a re-run runs under it too
        self.autocast = autocast
        #: the buffers of the module's parametrizations as they were when the call began
        #: (:func:`snapshot_state`; ``None``: none): a re-run of the call starts from them
        self.state = state
        #: rows of the forward pass that made the call (0: unknown)
        self.batch = batch
        #: index of the first call noted after this one began: calls ``start ..`` before it are its descendants
        self.start = start
        #: index of this call among the calls noted since the last step (set by ``take_calls``)
        self.position = -1
        #: parameters of descendants that climbed here (their own calls cannot tell the rows apart)
        self.climbed = False
        #: for an output shared by the rows (leading 1) that is added to a batched tensor: that addition's
        #: node, whose output gradient holds each row's gradient of the shared output
        self.consumer = None
        #: the call ran on rows flattened to ``[B*k, ...]`` (sample-major): its rule sees ``[B, k, ...]``
        self.flat = False
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor | None] = []
        self.waiting = 0
        self.entries: list[torch.Tensor] = []
        self.want: list[int] = []
        self.done = False

    def fresh(self) -> "Call":
        """The same recorded call with no backward state (for another backward pass)."""
        call = Call(self.module, self.args, self.kwargs, self.output, self.node, self.batch, self.start, self.state,
                    self.autocast, self.view_base, self.swapped)
        call.position = self.position
        return call

    def release(self) -> None:
        """Drop the inputs, outputs and gradients once the call's per-sample gradients are out."""
        self.args = self.kwargs = self.output = self.node = self.state = None
        self.entries, self.grads = [], []


def _refuse_scripted(root: nn.Module, tracked: set[int]) -> None:
    """A TorchScript module (``torch.jit.script``) that holds tracked parameters takes no hooks: the cockpit cannot
    see its calls, so it is refused with the fix (outside trial 9: PyTorch's own "register_forward_pre_hook is not
    supported on ScriptModules"). One without tracked parameters (a scripted activation) is left alone."""
    scripted = getattr(torch.jit, "ScriptModule", ())
    for name, module in root.named_modules():
        if isinstance(module, scripted) and any(id(p) in tracked for p in module.parameters()):
            where = f"'{name}'" if name else "the model"
            raise TypeError(
                f"Cockpit: {where} is a TorchScript module (torch.jit.script / torch.jit.trace) holding tracked "
                "parameters; the cockpit records a model's calls with forward hooks, which TorchScript modules do "
                "not take. Train the module unscripted (script it for deployment, after training), or leave its "
                "parameters out of Cockpit(params)."
            )


class ModelTracer:
    """Notes the forward calls the hook backend needs (see the module docstring).

    Args:
        params: the tracked parameters.
        wants_graph: ``() -> bool``, whether the coming backward pass will need
            the graph (then the forward pass uses the math attention kernel).
        on_attach: ``() -> None``, called after a model was attached.
        on_forward: ``(root, args, kwargs) -> None``, called when an outermost
            forward pass of an attached model begins (with gradients enabled and
            the tracer not paused), e.g. to start recording a step.
    """

    #: calls kept at most between two cockpit steps (older ones are dropped)
    MAX_CALLS = 200_000

    def __init__(
        self, params: list[torch.Tensor], wants_graph=lambda: False, on_attach=lambda: None, on_forward=None,
        tracking=lambda: True,
    ):
        self.id = next(_IDS)
        for dead in [key for key, ref in _TRACERS.items() if ref() is None]:
            del _TRACERS[dead]
        _TRACERS[self.id] = weakref.ref(self)
        self._tracked = {id(p) for p in params}
        self._wants_graph = wants_graph
        #: whether the forward pass about to run belongs to a tracked step (the cockpit's schedule): the parameters
        #: a forward pass changes are looked for there only (:meth:`parameters_begin`; 0.26 ms per gpt forward pass)
        self._tracking = tracking
        self._on_attach = on_attach
        self._on_forward = on_forward
        #: ``(module, args, kwargs, output, node, batch, start)`` of each noted call since the last step
        self.calls: list[tuple] = []
        #: ``id(module) -> [len(calls) when each of its running calls began]``
        self.opened: dict[int, list[int]] = {}
        #: ``id(module) -> its parametrizations' modules with buffers`` (:func:`stateful_parts`), for
        #: the hooked modules that have some
        self.stateful: dict[int, list[nn.Module]] = {}
        #: ``id(module) -> [the state of its parametrizations when each of its running calls began]``
        self.states: dict[int, list] = {}
        self.paused = False
        self.roots: list[weakref.ref] = []
        #: the parameters of the model whose forward pass runs, as it began (:meth:`parameters_begin`)
        self._parameter_marks: list[tuple[torch.Tensor, int, int]] = []
        self.changed_start: ChangedStart | None = None
        self._covered: set[int] = set()
        #: ``id(module) -> {name: parameter}`` as attached: the parameters a module owns even while a
        #: wrapper swaps other tensors in (``fully_shard`` gathers whole parameters for the passes)
        self._named: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}  # (all, direct)
        #: the hook backend of the backward pass under way (it adopts calls made during it): a
        #: :class:`~cockpit_like.backends.hooks.HookBackend`, not imported here (hooks imports this module)
        self.live: Any = None
        self._handles: list[Any] = []
        self._global_handle = None
        self._kernel_stack: list[bool] = []  # per forward pass: it holds the graph kernels
        #: per forward pass: the attention count when it took the graph kernels (None: it did not)
        self._attention_marks: list[int | None] = []
        #: a forward pass since the calls were last taken ran attention with the math kernel (the step says so)
        self.math_attention = False
        weakref.finalize(self, _put_back, self._kernel_stack)  # collected mid-pass: put them back
        self._batches: list[int] = []
        #: per forward pass running: ``id`` of its root model (``None``: not known)
        self._forward_roots: list[int | None] = []
        #: rows of the model's current forward pass (0 outside one)
        self.batch = 0
        #: forward passes of the models since the calls were last taken
        self.passes = 0
        #: a call was noted outside the roots' forward passes since the last step (see take_calls)
        self.stray = False
        #: modules whose calls ran in the last step's forward passes but were left out as unreachable from its loss
        #: (:meth:`take_calls`): they were called (their parameters get no gradient from it, not one through an
        #: enclosing call)
        self.unreached: set[int] = set()

    # ---- installing ---------------------------------------------------------------
    def attach(self, root: nn.Module) -> None:
        """Install the recording hooks on ``root`` and its submodules."""
        if any(ref() is root for ref in self.roots):
            return
        if not isinstance(root, nn.Module):
            raise TypeError(f"Cockpit(model=...) takes an nn.Module, got {type(root).__name__}")
        _refuse_scripted(root, self._tracked)
        for module in root.modules():
            # every module with tracked parameters in its subtree: the ones that own them, and the
            # enclosing modules that per-sample gradients may climb to (see the module docstring)
            if any(id(p) in self._tracked for p in module.parameters()) or isinstance(
                module, nn.modules.batchnorm._BatchNorm
            ):
                self._handles.append(module.register_forward_pre_hook(partial(_open, self.id)))
                self._handles.append(module.register_forward_hook(partial(_record, self.id), with_kwargs=True))
                named = dict(module.named_parameters())
                direct = {name: p for name, p in named.items() if "." not in name}
                self._named[id(module)] = (named, direct)
                parts = stateful_parts(module)
                if parts:
                    self.stateful[id(module)] = parts
        self._handles.append(root.register_forward_pre_hook(partial(_before_root, self.id), with_kwargs=True))
        self._handles.append(root.register_forward_hook(partial(_after_root, self.id, self._kernel_stack), always_call=True))
        self._covered |= {id(p) for p in root.parameters()}
        self.roots.append(weakref.ref(root))
        self._on_attach()

    def discover(self) -> None:
        """Attach to the model at its first forward pass (PyTorch's global module pre-hook)."""
        if self._global_handle is None and not self.covers_all():
            self._global_handle = nn.modules.module.register_module_forward_pre_hook(partial(_discover, self.id))

    def covers_all(self) -> bool:
        return self._tracked <= self._covered

    def named_params(self, module: nn.Module, recurse: bool = True) -> dict[str, torch.Tensor]:
        """``module``'s parameters by name as they are now, except that a sharded parameter (FSDP2's DTensor, what
        the cockpit tracks) stands for the whole one the module holds while it runs. A parameter replaced since the
        cockpit attached (``layer.weight = nn.Parameter(...)``, ``prune`` moving it to ``weight_orig``) is found
        under its current name: rows are never credited to a tracked parameter the module no longer uses."""
        current = dict(module.named_parameters(recurse=recurse))
        kept = self._named.get(id(module))
        if kept is None:
            return current
        kept = kept[0] if recurse else kept[1]
        for name, param in current.items():
            old = kept.get(name)
            if old is not None and old is not param and is_dtensor(old):
                current[name] = old
        return current

    def _found(self, module: nn.Module, args: tuple) -> None:
        if self.paused or not torch.is_grad_enabled():
            return
        if not any(id(p) in self._tracked and id(p) not in self._covered for p in module.parameters()):
            return
        self.attach(module)
        self.enter_forward(args, {}, module)  # this call's pre-hooks were registered too late for this call
        self.opened.setdefault(id(module), []).append(len(self.calls))
        self.states.setdefault(id(module), []).append(_state_at_start(self, module))
        if self.covers_all() and self._global_handle is not None:
            self._global_handle.remove()
            self._global_handle = None

    def remove(self) -> None:
        """Remove every hook (and put back the graph kernels of a forward pass still running)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._global_handle is not None:
            self._global_handle.remove()
            self._global_handle = None
        _put_back(self._kernel_stack)
        self._attention_marks.clear()

    # ---- the model's forward pass ------------------------------------------------------
    def parameters_begin(self, root: nn.Module) -> None:
        """As a model's forward pass begins: note the version counters and storage of its parameters (and of
        those of modules it holds unregistered: one pass over them), and copy those seen changing in an earlier
        forward pass (:class:`ChangedStart`)."""
        params = [p for owner in held_modules(root) for p in owner.parameters(recurse=False)]
        self._parameter_marks = [(p, *_mark(p)) for p in params]
        changed = [p for p in params if changed_in_forward(p)]
        self.changed_start = ChangedStart({id(p): p.detach().clone() for p in changed}) if changed else None

    def parameters_end(self) -> None:
        """As the model's forward pass ends: its parameters whose version counter or storage moved are
        noted as changing in forward passes (copied as the next passes begin)."""
        for p, version, pointer in self._parameter_marks:
            if (version, pointer) != _mark(p):
                _CHANGED_IN_FORWARD[id(p)] = weakref.ref(p, lambda _, key=id(p): _CHANGED_IN_FORWARD.pop(key, None))
        self._parameter_marks = []

    def enter_forward(self, args: tuple, kwargs: dict, root: nn.Module | None = None) -> None:
        """Note the batch size (the leading dim of the first tensor input) and pick the attention kernel."""
        if root is not None and id(root) in self._forward_roots:
            # a forward pass of this model is noted as running: it ended by an exception its forward hooks did not
            # see (a KeyboardInterrupt: PyTorch calls an always_call forward hook after an Exception only)
            while id(root) in self._forward_roots:
                self.exit_forward()
        if not self._batches:
            self.passes += 1
            if self._on_forward is not None and root is not None and torch.is_grad_enabled():
                self._on_forward(root, args, kwargs)
        self._forward_roots.append(None if root is None else id(root))
        self._batches.append(self.batch)
        self.batch = _leading_dim(args, kwargs)
        wants = self._wants_graph()
        if wants:
            _graph_kernels.acquire()
        self._kernel_stack.append(wants)
        self._attention_marks.append(_graph_kernels.attention_calls if wants else None)

    def in_forward(self) -> bool:
        return bool(self._batches)

    def exit_forward(self) -> None:
        if self._attention_marks:
            mark = self._attention_marks.pop()
            if mark is not None and _graph_kernels.attention_calls > mark:
                self.math_attention = True
        _put_back(self._kernel_stack, 1)
        if self._batches:
            self.batch = self._batches.pop()
        if self._forward_roots:  # last: a pass whose end is cut short is still noted, and ended again
            self._forward_roots.pop()

    # ---- per step -----------------------------------------------------------------------
    def take_calls(self, loss: torch.Tensor | None = None) -> list[Call]:
        """The calls noted since the last step (the list is emptied).

        With several forward passes since then and the step's ``loss``, only
        the calls whose outputs the loss depends on (graph reachability).
        """
        calls, passes = [Call(*noted) for noted in self.calls], self.passes
        for position, call in enumerate(calls):
            call.position = position
        stray = self.stray
        self.drop_calls()
        self.unreached = set()
        if (passes > 1 or stray) and isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            reachable = _graph_nodes(loss.grad_fn)
            kept = [call for call in calls if any(id(node) in reachable for node in _call_nodes(call))]
            self.unreached = {id(call.module) for call in calls} - {id(call.module) for call in kept}
            calls = kept
        return calls

    def drop_calls(self) -> None:
        """Forget the calls noted since the last step (a step that tracks nothing)."""
        self.calls, self.passes, self.opened, self.stray = [], 0, {}, False
        self.states = {}
        self.math_attention = False

    @contextlib.contextmanager
    def pause(self):
        """No recording (the fallback re-runs modules)."""
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous


class _GraphKernels:
    """Kernels with a second derivative for forward passes whose step needs the graph: the math
    attention kernel, recurrent layers without cuDNN. Process-wide and counted: the first forward pass
    that needs them sets them, the last one that ends puts back what was there before, whichever
    tracers (several cockpits on one model) enter and leave in whichever order."""

    def __init__(self) -> None:
        self.depth = 0
        self._context: contextlib.ExitStack | None = None
        #: calls of ``torch.nn.functional.scaled_dot_product_attention`` made while the kernels were held
        #: (process-wide; a tracer compares it before and after its forward pass: the step says so)
        self.attention_calls = 0

    def acquire(self) -> None:
        if self.depth == 0:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            context = contextlib.ExitStack()
            context.enter_context(sdpa_kernel([SDPBackend.MATH]))
            context.enter_context(torch.backends.cudnn.flags(enabled=False))
            self._count_attention(context)
            self._context = context
        self.depth += 1

    def _count_attention(self, context: contextlib.ExitStack) -> None:
        """Count the attention calls while the kernels are held: ``scaled_dot_product_attention`` looked up in
        ``torch.nn.functional`` at call time (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``,
        Hugging Face's "sdpa" attention) goes through a counting wrapper, put back on release. The values are
        the function's own."""
        functional = torch.nn.functional
        original = functional.scaled_dot_product_attention
        kernels = self

        def scaled_dot_product_attention(*args, **kwargs):
            kernels.attention_calls += 1
            return original(*args, **kwargs)

        scaled_dot_product_attention.__wrapped__ = original
        scaled_dot_product_attention.__doc__ = original.__doc__
        functional.scaled_dot_product_attention = scaled_dot_product_attention
        context.callback(setattr, functional, "scaled_dot_product_attention", original)

    def release(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self._context is not None:
            context, self._context = self._context, None
            context.close()


_graph_kernels = _GraphKernels()


@contextlib.contextmanager
def graph_kernels(held: bool = True):
    """The kernels of a forward pass whose step needs the graph, held while the cockpit (or the user's backward
    pass of such a step) runs autograd through that step's graph: non-reentrant activation checkpointing
    recomputes its forward there, and a recomputation with another attention kernel saves other tensors
    (``CheckpointError``: "different metadata"). ``held=False``: nothing."""
    if not held:
        yield
        return
    _graph_kernels.acquire()
    try:
        yield
    finally:
        _graph_kernels.release()


def _graph_nodes(root) -> dict[int, object]:
    """``{id: node}`` of every autograd node the backward pass from ``root`` visits.

    The nodes are kept (the values): autograd's Python objects for graph nodes
    exist only while referenced, and a freed one's ``id`` can be reused by the
    object of another node, which would then look visited.
    """
    seen, stack = {id(root): root}, [root]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and id(child) not in seen:
                seen[id(child)] = child
                stack.append(child)
    return seen


def _call_nodes(call: "Call") -> list:
    if call.node is not None:
        return [call.node]
    return [t.grad_fn for t in _flat_outputs(call.output) if t.grad_fn is not None]


def _discover(tracer_id: int, module, args) -> None:
    tracer = _tracer_of(tracer_id)
    if tracer is not None:
        tracer._found(module, args)


def _flat_outputs(output) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    return [leaf for leaf in leaves if isinstance(leaf, (torch.Tensor, Shell))]
