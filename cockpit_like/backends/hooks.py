"""The hook backend: per-sample gradients of any module, without BackPACK.

Two pieces:

- :class:`ModelTracer`, installed once on the model (``Cockpit(model=...)``,
  or found at the model's first forward pass with PyTorch's global module
  hooks). During *every* forward pass with gradients enabled it notes the
  calls of modules with tracked parameters in their subtree (and of batch
  norms, which couple the samples): a pre-hook notes where the call began, a
  forward hook appends it (two small list operations). The list is handed over
  or dropped whenever the cockpit is entered, so a step that tracks nothing
  costs that append and nothing else. On steps that need the graph (e.g.
  Hessian-vector products) the model's forward runs with PyTorch's math
  attention kernel and without cuDNN (whose recurrent layers have no double
  backward), so that the backward pass is twice differentiable.
- :class:`HookBackend`, built for one tracked step from the noted calls. It
  registers a pre-hook on the autograd node of each call's outputs, so it
  receives the gradient of the loss w.r.t. the outputs during the backward
  pass, and turns (inputs, output gradients) into per-sample gradients:
  by a per-layer rule (:mod:`cockpit_like.backends.module_rules`) while the
  backward pass runs, layer by layer, or, for any other module that owns
  parameters, by ``torch.func`` (``functional_call`` + ``vmap`` of ``vjp``,
  one sample per row; a loop over samples where ``vmap`` cannot run, e.g.
  recurrent layers) right after the backward pass. The results go to the
  same :class:`~cockpit_like.backends.per_sample.PerSampleReducer` that
  BackPACK's path feeds, so every statistic is written once.

A parameter used by several calls (weight tying: GPT-2's input embedding is
its output layer; a module applied twice) gets the sum of its calls'
per-sample gradients, reduced once the last call's gradient has arrived.
A parameter whose own module never runs (``nn.MultiheadAttention`` calls
``out_proj``'s weight directly) is handled by the nearest calling ancestor's
fallback; for an ancestor that owns no parameters itself (a container), only
a parameter that its forward pass reads (its autograd graph accumulates into
it) and that no called module owns (DeBERTa's relative embeddings, read as
a weight; not BART's shared embedding, which its embedding layers own).
A fallback call computes its parameters through every use inside it, so the
calls it made do not compute them again (RoBERTa's LM head owns the bias its
decoder layer adds).

A sample is one row of the batch (one sequence for language models): every
tensor argument whose leading dimension is the batch size is split along it
(``nn.RNNBase`` without ``batch_first``: along dimension 1, and its hidden
state always along dimension 1).

Where the rows can be told apart
--------------------------------
A parameter's per-sample gradient can be computed at the smallest enclosing
module whose inputs and outputs carry the batch dimension. The tracer notes
the calls of every module with tracked parameters in its subtree and where
each call began, so the calls made inside a call are known. Before the
backward pass, each call that owns parameters is checked (``_carries_batch``,
from the shapes and the autograd graph of the forward pass):

- **rows**: outputs with gradients have the batch dimension ``B`` (and a
  rule's input has it, or a leading 1): the call's own rule or fallback;
- **shared output added to the rows**: a single output of leading dimension
  1 (positions looked up from ``[1, T]`` ids: GPT-2, BERT, BART) whose only
  use is ``shared + batched`` giving ``[B, ...]``: the pre-hook sits on that
  addition's node, whose output gradient row ``b`` is row ``b``'s gradient of
  the shared output. Nothing is expanded or re-run (a module without a rule
  is re-run once, unsplit, with those rows' cotangents);
- **rows flattened sample-major** to ``[B*k, ...]`` (OPT's MLP) in a layer
  whose rule treats all leading dimensions alike (linear, embedding, layer
  norm, RMS norm): when the input is a view of a contiguous ``[B, ...]``
  tensor, or the output of such a call through shape-keeping single-input
  steps (activations, dropout, casts), the rule sees ``[B, k, ...]``;
- **anything else climbs**: the outputs have no batch dimension (T5's
  relative position bias ``[T, T, heads]``, a table read by every layer), the
  input is a parameter (DeBERTa's layer norm of its relative embeddings), ids
  that could be a table's (``[T]``, or ``[T, T]`` when ``T = B``) and are not
  the model's input, rows flattened in an unknown order, or a module that
  receives tokens routed from every row (Mixtral's experts and router). Its
  parameters move to the smallest enclosing call that carries the batch, and
  that call's ``torch.func`` fallback computes them through every use inside
  it (per-row gradients through the routing: the re-run routes each row's
  tokens as the batch did). Calls inside it no longer compute those
  parameters (its vjp covers them). A call does not qualify if one of its
  outputs was computed from another (BART's model returns the encoder's
  output, which its decoder reads: the gradient at that output would count
  the inner use twice), nor if an output has no batch dimension; with no
  qualifying call (a model that returns its loss) the step raises
  :class:`UncoveredParameterError` naming the layer and the parameters.

Every fallback re-run must reproduce the recorded outputs of the forward pass
(a key/value cache argument, filled by the call itself, is left out); if it
does not (state, a coupled batch), :class:`UncoveredParameterError` says so.
The cockpit never changes what the model computes: outputs are returned as
they are (the forward hook returns ``None``).

May import torch and :mod:`cockpit_like.backends` only.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import defaultdict
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from cockpit_like.backends.module_rules import RECOMPUTE_RULES, Dense, Lazy, is_hf_conv1d, rule_for, summed
from cockpit_like.backends.per_sample import LazyRows

__all__ = [
    "ModelTracer",
    "HookBackend",
    "BatchNormInTrainingError",
    "UncoveredParameterError",
    "couples_samples",
]


class BatchNormInTrainingError(RuntimeError):
    """A batch norm in training mode mixes the samples: per-sample quantities are undefined."""


class UncoveredParameterError(RuntimeError):
    """A tracked parameter got no per-sample gradient from any backend."""


def couples_samples(module: nn.Module) -> bool:
    """Whether ``module`` normalises with statistics of the current batch (batch norm in training mode)."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return False
    return module.training or not module.track_running_stats


# ---- the tracer ---------------------------------------------------------------------
_TRACERS: "weakref.WeakValueDictionary[int, ModelTracer]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


def _record(tracer_id: int, module, args, kwargs, output) -> None:
    # a module-level function bound by functools.partial to an int: a pickled model carries no
    # tracer; a deep copy's hooks report to the same tracer, whose step ignores calls that are not
    # part of its backward pass
    tracer = _TRACERS.get(tracer_id)
    if tracer is None or tracer.paused or not torch.is_grad_enabled():
        return
    calls = tracer.calls
    if len(calls) >= tracer.MAX_CALLS:  # forward passes never backpropagated inside the cockpit
        calls.clear()
    if tracer.batch == 0 and tracer.in_forward():  # found by the global hook, which sees no keyword inputs
        tracer.batch = _leading_dim(args, kwargs)
    node = output.grad_fn if isinstance(output, torch.Tensor) else None
    # where the call began: the calls noted since then are the calls it made (its descendants)
    opened = tracer.opened.get(id(module))
    start = opened.pop() if opened else len(calls)
    if start == len(calls) and not module._parameters and not module._modules:
        return  # a leaf without parameters (activations, dropout, pooling): nothing to compute, nothing kept
    if type(module) not in RECOMPUTE_RULES:
        # the outputs' shapes and graph nodes, not their values: autograd keeps what the backward pass needs,
        # and holding the rest (a norm's output before its activation, a block's sum) would raise the peak
        output = tree_map(_shell, output)
    # the output is returned unchanged: the cockpit never changes what the model computes
    noted = (module, args, kwargs, output, node, tracer.batch, min(start, len(calls)))
    if tracer.live is not None:  # during a backward pass: a recomputation (activation checkpointing)
        tracer.live.adopt(Call(*noted))
        return
    if not tracer.in_forward():
        tracer.stray = True  # a call outside the model's forward pass (its original module under torch.compile)
    calls.append(noted)  # a Call only at tracked steps


class Shell:
    """A recorded output without its values: shape, dtype, device and graph node (see :func:`_record`)."""

    __slots__ = ("shape", "dtype", "device", "grad_fn", "output_nr")

    def __init__(self, shape, dtype, device, grad_fn, output_nr):
        self.shape, self.dtype, self.device, self.grad_fn, self.output_nr = torch.Size(shape), dtype, device, grad_fn, output_nr

    def dim(self) -> int:
        return len(self.shape)

    def expand(self, *shape) -> "Shell":
        return Shell(shape, self.dtype, self.device, self.grad_fn, self.output_nr)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)


def _shell(value):
    if isinstance(value, torch.Tensor):
        return Shell(value.shape, value.dtype, value.device, value.grad_fn, value.output_nr)
    return value


def _open(tracer_id: int, module, args) -> None:
    tracer = _TRACERS.get(tracer_id)
    if tracer is None or tracer.paused or not torch.is_grad_enabled():
        return
    tracer.opened.setdefault(id(module), []).append(len(tracer.calls))


def _leading_dim(args, kwargs) -> int:
    for value in itertools.chain(args, (kwargs or {}).values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return 0


def _before_root(tracer_id: int, module, args, kwargs) -> None:
    tracer = _TRACERS.get(tracer_id)
    if tracer is not None and not tracer.paused:
        tracer.enter_forward(args, kwargs, module)


def _after_root(tracer_id: int, held: list, module, args, output) -> None:
    tracer = _TRACERS.get(tracer_id)
    if tracer is not None:
        tracer.exit_forward()
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
        "start", "position", "climbed", "consumer", "flat",
    )

    def __init__(self, module, args, kwargs, output, node, batch: int = 0, start: int = 0):
        self.module, self.args, self.kwargs, self.output, self.node = module, args, kwargs, output, node
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
        call = Call(self.module, self.args, self.kwargs, self.output, self.node, self.batch, self.start)
        call.position = self.position
        return call

    def release(self) -> None:
        """Drop the inputs, outputs and gradients once the call's per-sample gradients are out."""
        self.args = self.kwargs = self.output = self.node = None
        self.entries, self.grads = [], []


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
        self, params: list[torch.Tensor], wants_graph=lambda: False, on_attach=lambda: None, on_forward=None
    ):
        self.id = next(_IDS)
        _TRACERS[self.id] = self
        self._tracked = {id(p) for p in params}
        self._wants_graph = wants_graph
        self._on_attach = on_attach
        self._on_forward = on_forward
        #: ``(module, args, kwargs, output, node, batch, start)`` of each noted call since the last step
        self.calls: list[tuple] = []
        #: ``id(module) -> [len(calls) when each of its running calls began]``
        self.opened: dict[int, list[int]] = {}
        self.paused = False
        self.roots: list[weakref.ref] = []
        self._covered: set[int] = set()
        #: ``id(module) -> {name: parameter}`` as attached: the parameters a module owns even while a
        #: wrapper swaps other tensors in (``fully_shard`` gathers whole parameters for the passes)
        self._named: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}  # (all, direct)
        #: the hook backend of the backward pass under way (it adopts calls made during it)
        self.live: HookBackend | None = None
        self._handles: list[Any] = []
        self._global_handle = None
        self._kernel_stack: list[bool] = []  # per forward pass: it holds the graph kernels
        weakref.finalize(self, _put_back, self._kernel_stack)  # collected mid-pass: put them back
        self._batches: list[int] = []
        #: rows of the model's current forward pass (0 outside one)
        self.batch = 0
        #: forward passes of the models since the calls were last taken
        self.passes = 0
        #: a call was noted outside the roots' forward passes since the last step (see take_calls)
        self.stray = False

    # ---- installing ---------------------------------------------------------------
    def attach(self, root: nn.Module) -> None:
        """Install the recording hooks on ``root`` and its submodules."""
        if any(ref() is root for ref in self.roots):
            return
        if not isinstance(root, nn.Module):
            raise TypeError(f"Cockpit(model=...) takes an nn.Module, got {type(root).__name__}")
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
        """``module``'s parameters by name as the cockpit attached it (else as it is now)."""
        kept = self._named.get(id(module))
        if kept is None:
            return dict(module.named_parameters(recurse=recurse))
        return kept[0] if recurse else kept[1]

    def _found(self, module: nn.Module, args: tuple) -> None:
        if self.paused or not torch.is_grad_enabled():
            return
        if not any(id(p) in self._tracked and id(p) not in self._covered for p in module.parameters()):
            return
        self.attach(module)
        self.enter_forward(args, {}, module)  # this call's pre-hooks were registered too late for this call
        self.opened.setdefault(id(module), []).append(len(self.calls))
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

    # ---- the model's forward pass ------------------------------------------------------
    def enter_forward(self, args: tuple, kwargs: dict, root: nn.Module | None = None) -> None:
        """Note the batch size (the leading dim of the first tensor input) and pick the attention kernel."""
        if not self._batches:
            self.passes += 1
            if self._on_forward is not None and root is not None and torch.is_grad_enabled():
                self._on_forward(root, args, kwargs)
        self._batches.append(self.batch)
        self.batch = _leading_dim(args, kwargs)
        wants = self._wants_graph()
        if wants:
            _graph_kernels.acquire()
        self._kernel_stack.append(wants)

    def in_forward(self) -> bool:
        return bool(self._batches)

    def exit_forward(self) -> None:
        _put_back(self._kernel_stack, 1)
        if self._batches:
            self.batch = self._batches.pop()

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
        if (passes > 1 or stray) and isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            reachable = _graph_nodes(loss.grad_fn)
            calls = [call for call in calls if any(id(node) in reachable for node in _call_nodes(call))]
        return calls

    def drop_calls(self) -> None:
        """Forget the calls noted since the last step (a step that tracks nothing)."""
        self.calls, self.passes, self.opened, self.stray = [], 0, {}, False

    @contextlib.contextmanager
    def pause(self):
        """No recording (the fallback re-runs modules)."""
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous


@contextlib.contextmanager
def _whole_parameters(module: nn.Module):
    """Sharded (``fully_shard``, FSDP2) parameters of ``module`` as whole plain tensors while a
    recomputation after the backward pass runs (a collective per parameter, in the same order on
    every rank); put back afterwards. Nothing changes for other parameters."""
    from cockpit_like.backends.partitions import is_dtensor

    swapped = []
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is not None and is_dtensor(param):
                owner._parameters[name] = nn.Parameter(param.detach().full_tensor(), requires_grad=param.requires_grad)
                swapped.append((owner, name, param))
    try:
        yield
    finally:
        for owner, name, param in swapped:
            owner._parameters[name] = param


class _GraphKernels:
    """Kernels with a second derivative for forward passes whose step needs the graph: the math
    attention kernel, recurrent layers without cuDNN. Process-wide and counted: the first forward pass
    that needs them sets them, the last one that ends puts back what was there before, whichever
    tracers (several cockpits on one model) enter and leave in whichever order."""

    def __init__(self) -> None:
        self.depth = 0
        self._context: contextlib.ExitStack | None = None

    def acquire(self) -> None:
        if self.depth == 0:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            context = contextlib.ExitStack()
            context.enter_context(sdpa_kernel([SDPBackend.MATH]))
            context.enter_context(torch.backends.cudnn.flags(enabled=False))
            self._context = context
        self.depth += 1

    def release(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self._context is not None:
            context, self._context = self._context, None
            context.close()


_graph_kernels = _GraphKernels()


def _uncalled_descendant_params(module, called, handled_elsewhere, tracked) -> list[torch.Tensor]:
    found = []
    for child in module.children():
        if id(child) in called or handled_elsewhere(child):
            continue
        found += [p for p in child.parameters(recurse=False) if id(p) in tracked]
        found += _uncalled_descendant_params(child, called, handled_elsewhere, tracked)
    return found


def _row_wise(module: nn.Module) -> bool:
    """Layers whose rule treats every leading dimension alike (rows flattened into the batch are fine)."""
    row_wise = (nn.Linear, nn.Embedding, nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
    return type(module) in row_wise or is_hf_conv1d(module)


def _output_used_inside(call: "Call", outputs: list[torch.Tensor]) -> bool:
    """Whether one output of ``call`` was computed from another (BART's model returns the encoder's
    output, which its decoder reads): the gradient that arrives at that output's node then includes
    the call's own use of it, and a vjp of the call would count that use twice.

    Walks the call's part of the graph only: from its outputs down to the nodes of its inputs.
    """
    nodes = {id(t.grad_fn): t.grad_fn for t in outputs}
    if len(nodes) < 2:
        return False
    inputs = {id(t.grad_fn) for t in _flat_outputs((call.args, call.kwargs)) if t.grad_fn is not None}
    for start in nodes.values():
        seen, stack = set(), [child for child, _ in start.next_functions if child is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen or id(node) in inputs:
                continue
            if id(node) in nodes and node is not start:
                return True
            seen.add(id(node))
            stack.extend(child for child, _ in node.next_functions if child is not None)
    return False


def _used_params(roots: list) -> set[int]:
    """``id`` of every leaf tensor whose gradient the backward pass from ``roots`` accumulates."""
    used: set[int] = set()
    for root in roots:
        for node in _graph_nodes(root).values():
            variable = getattr(node, "variable", None)
            if variable is not None:
                used.add(id(variable))
    return used


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


#: a watched node that has not run yet (:meth:`HookBackend._watch_sums`)
_WAITING = object()


def _call_nodes(call: "Call") -> list:
    if call.node is not None:
        return [call.node]
    return [t.grad_fn for t in _flat_outputs(call.output) if t.grad_fn is not None]


def _discover(tracer_id: int, module, args) -> None:
    tracer = _TRACERS.get(tracer_id)
    if tracer is not None:
        tracer._found(module, args)


# ---- the backend of one step ------------------------------------------------------------
def _flat_outputs(output) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    return [leaf for leaf in leaves if isinstance(leaf, (torch.Tensor, Shell))]


class HookBackend:
    """Per-sample gradients of the recorded calls for one step (see the module docstring).

    Args:
        calls: the tracer's calls of this step's forward pass.
        params: the tracked parameters.
        reducer: receives every per-sample gradient.
        handled_elsewhere: ``module -> bool``, whether another backend (BackPACK)
            computes this module's per-sample gradients.
        tracer: paused while the fallback re-runs modules.
        batch_size: rows of the batch (``info["batch_size"]``), or ``None`` to take
            the leading dimension of each call's first input.
    """

    def __init__(self, calls, params, reducer, handled_elsewhere, tracer, batch_size=None):
        self.reducer = reducer
        self.tracer = tracer
        self.batch_size = batch_size
        self._handles: list[Any] = []
        self._deferred: list[Call] = []
        self._uses: dict[int, int] = defaultdict(int)
        self._partial: dict[int, list] = {}
        self._params = {id(p): p for p in params if p.requires_grad}  # a frozen parameter has no rows
        self._handled = handled_elsewhere
        self._errors: list[UncoveredParameterError] = []
        self._consumers: dict[int, list] | None = None
        #: ``(id(call), id(param))`` -> autograd's gradient of that use (``_WAITING``: its node has not run)
        self._sums: dict[tuple[int, int], Any] = {}
        #: forms waiting for their use's sum: ``(id(call), id(param))`` -> ``(param, form)``
        self._parked: dict[tuple[int, int], tuple] = {}
        self._flat_nodes: set[int] = set()
        self._all_calls = calls
        self.calls = self._assign(calls, handled_elsewhere)
        self._all_calls = []
        #: parameters a call of the step's forward pass computes (a recomputation does not compute them again)
        self._assigned = {id(p) for call in self.calls for p in call.params}

    # ---- which call computes which parameter -------------------------------------------
    def _assign(self, calls: list[Call], handled_elsewhere) -> list[Call]:
        tracked = self._params
        called = {id(call.module) for call in calls}
        owned = {id(p) for call in calls for p in call.module.parameters(recurse=False)}
        roots = {id(ref()) for ref in self.tracer.roots}
        self._model_inputs = {
            t.untyped_storage().data_ptr()
            for call in calls
            if id(call.module) in roots
            for t in _flat_outputs((call.args, call.kwargs))
        }
        if any(call.position < 0 for call in calls):
            for position, call in enumerate(calls):
                call.position = position
        for index, call in enumerate(calls):
            module = call.module
            if couples_samples(module):
                raise BatchNormInTrainingError(
                    f"{type(module).__name__} layer {self._module_name(module)} is in training mode: it "
                    "normalises with statistics of the whole batch, so every sample's gradient depends "
                    "on the other samples and per-sample quantities (gradient tests, histograms, Alpha, "
                    "TIC, ...) are undefined. Fixes: call model.eval() on the batch norms during the "
                    "cockpit's steps (running statistics), replace them by nn.GroupNorm / nn.LayerNorm, "
                    "or track only quantities without per-sample statistics (Loss, GradNorm, Distance, "
                    "UpdateSize, HessMaxEV)."
                )
            if handled_elsewhere(module):
                call.params = []
                continue
            params = [p for p in self.tracer.named_params(module, recurse=False).values() if id(p) in tracked]
            if rule_for(module) is None:
                # parameters of submodules whose own forward did not run (MultiheadAttention's out_proj,
                # DeBERTa's relative position table read as a weight), down to (not into) the submodules
                # that ran: those claim their own subtrees
                uncalled = _uncalled_descendant_params(module, called, handled_elsewhere, tracked)
                if uncalled and not params:
                    # a container: only the tables its forward pass reads as weights, not the ones a called
                    # module owns too (BART's shared embedding, which its encoder's embedding layer computes)
                    uncalled = [p for p in uncalled if id(p) not in owned]
                    used = _used_params(_call_nodes(call)) if uncalled else set()
                    uncalled = [p for p in uncalled if id(p) in used]
                params += uncalled
            seen: set[int] = set()
            call.params = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
        for index, call in enumerate(calls):  # inner calls first: a climbed parameter may climb on
            if call.params and not self._carries_batch(call):
                self._climb(calls, index)
        for outer, call in enumerate(calls):
            if call.params and rule_for(call.module) is None and type(call.module) not in RECOMPUTE_RULES:
                # the fallback's vjp covers every use inside the call (RoBERTa's LM head owns the bias
                # that its decoder layer adds): calls nested in it do not compute those parameters again
                self._claim_nested(calls, outer, {id(p) for p in call.params})
        assigned = []
        for call in calls:
            if not call.params:
                continue
            for param in call.params:
                self._uses[id(param)] += 1
            assigned.append(call)
        return assigned

    def _call_batch(self, call: Call) -> int:
        return int(self.batch_size) if self.batch_size is not None else call.batch

    def _carries_batch(self, call: Call) -> bool:
        """Whether each row's gradient can be told apart at ``call``: its outputs that carry gradients
        have the batch dimension (and, for a per-layer rule, its input has it or is shared, leading 1)."""
        batch = self._call_batch(call)
        if batch <= 1:
            return True  # one row (or unknown rows): nothing to tell apart
        outputs = _flat_outputs(call.output)
        with_grad = [(i, t) for i, t in enumerate(outputs) if t.grad_fn is not None]
        if not with_grad or type(call.module) in RECOMPUTE_RULES:
            return True  # nothing flows back through this call; a recompute rule checks its own layout
        if rule_for(call.module) is not None:
            x = call.args[0] if call.args else None
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return False
            if x.shape[0] not in (1, batch):
                call.flat = self._flattened(call, x, batch) and all(t.shape[0] == x.shape[0] for _, t in with_grad)
                if call.flat:
                    self._flat_nodes.update(id(t.grad_fn) for _, t in with_grad)
                return call.flat
            if isinstance(x, nn.Parameter):
                return False  # a parameter as input (DeBERTa's layer norm of its relative position table)
            output = call.output
            if isinstance(output, (torch.Tensor, Shell)) and output.dim() > 0 and output.shape[0] == 1:
                call.consumer = self._broadcast_add(output, batch)
                return call.consumer is not None
            if isinstance(call.module, nn.Embedding) and (x.dim() == 1 or batch in x.shape[1:]):
                # ids whose shape could be a table's ([T, T] buckets with T = B, positions [T]): per row only
                # if they are (a view of) an input of the model
                return x.untyped_storage().data_ptr() in self._model_inputs
        output = call.output
        if isinstance(output, (torch.Tensor, Shell)) and output.dim() > 0 and output.shape[0] == 1:
            if not isinstance(call.module, nn.RNNBase):  # a shared output (BART's positions): as above
                call.consumer = self._broadcast_add(output, batch)
                return call.consumer is not None
        if not all(_batched(call.module, 0 if i == 0 else 1, t, batch) is not None for i, t in with_grad):
            return False
        return not _output_used_inside(call, [t for _, t in with_grad])

    def _climb(self, calls: list[Call], index: int) -> None:
        """Move ``calls[index]``'s parameters to the smallest enclosing call that carries the batch.

        The enclosing call's ``torch.func`` fallback then computes their per-sample gradients
        (through every use inside it: a table read by several layers, tokens routed from every row).
        """
        call = calls[index]
        for outer in range(index + 1, len(calls)):
            candidate = calls[outer]
            if not candidate.start <= call.position or rule_for(candidate.module) is not None:
                continue  # not an enclosing call, or a layer with a rule (it computes only its own parameters)
            if not self._carries_batch(candidate):
                continue
            climbing = list(call.params)
            self._claim_nested(calls, outer, {id(p) for p in climbing})
            known = {id(p) for p in candidate.params}
            candidate.params = candidate.params + [p for p in climbing if id(p) not in known]
            candidate.climbed = True
            return
        names = [self._param_name(p) for p in call.params]
        shapes = [list(t.shape) for t in _flat_outputs(call.output) if t.grad_fn is not None]
        call.params = []
        batch = self._call_batch(call)
        sizes = [c.batch for c in calls if c.module is call.module]
        if len(sizes) > 1 and sum(sizes) == batch:  # one module on several parts of the rows (a GAN's D)
            self._errors.append(UncoveredParameterError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)} was called {len(sizes)} times "
                f"in this step's forward pass, on {' + '.join(str(n) for n in sizes)} = {batch} rows: one module on "
                "different rows of the batch (a GAN discriminator on real and on fake rows) gives no call whose "
                f"outputs carry all {batch} rows, so the rows' gradients of {names} cannot be told apart. Call it "
                "once on the concatenated rows (torch.cat([real, fake])) and split its output, or track the "
                "per-sample quantities at the steps that call it once."
            ))
            return
        # raised by finish(), after the backward pass, where the step adds the quantities that need it
        self._errors.append(UncoveredParameterError(
            f"{type(call.module).__name__} layer {self._module_name(call.module)}: its outputs (shapes {shapes}) or "
            f"inputs have no batch dimension of size {self._call_batch(call)}, so the cockpit cannot tell the "
            f"rows' gradients of {names} apart, and no enclosing module's call has the batch dimension in its "
            "inputs and outputs (the outermost one may return a loss, a scalar). Call the model so that "
            "some module around this layer takes and returns tensors whose leading dimension is the batch "
            "(e.g. compute the loss outside the model), or leave these parameters out of Cockpit(params)."
        ))

    def _flattened(self, call: Call, x: torch.Tensor, batch: int) -> bool:
        """Whether ``x`` holds the rows of the batch flattened sample-major (``[B*k, ...]``, OPT's MLP):
        a view of a contiguous ``[B, ...]`` tensor, or the output of a call on such rows through
        shape-keeping single-input steps (activations, dropout, casts)."""
        if not _row_wise(call.module) or x.shape[0] % batch:
            return False
        base = x._base
        if (
            base is not None and base.dim() > 0 and base.shape[0] == batch and base.is_contiguous()
            and x.is_contiguous() and x.data_ptr() == base.data_ptr() and x.numel() == base.numel()
        ):
            return True
        node, shape = x.grad_fn, list(x.shape)
        for _ in range(6):
            if node is None:
                return False
            if id(node) in self._flat_nodes:
                return True
            inputs = [(child, nr) for child, nr in node.next_functions if child is not None]
            inputs = [(child, nr) for child, nr in inputs if type(child).__name__ != "AccumulateGrad"]
            if len(inputs) != 1 or not hasattr(inputs[0][0], "_input_metadata"):
                return False
            node, nr = inputs[0]
            metadata = node._input_metadata
            if nr >= len(metadata) or list(metadata[nr].shape) != shape:
                return False
        return False

    def _broadcast_add(self, output: torch.Tensor, batch: int):
        """The node of ``shared + batched`` if that addition is the one use of ``output`` (``[1, ...]``) and
        gives ``[batch, ...]`` (GPT-2's and BERT's position embeddings), else ``None``.

        Row ``b`` of that sum's gradient is row ``b``'s gradient of ``output``: the hooks read it there,
        so the output keeps its shape (nothing is expanded) and nothing is re-run.
        """
        users = self._consumer_map(self._all_calls).get(id(output.grad_fn), [])
        if len(users) != 1 or type(users[0]).__name__ != "AddBackward0" or getattr(users[0], "_saved_alpha", 1) != 1:
            return None
        add = users[0]
        edges = [child for child, _ in add.next_functions if child is output.grad_fn]
        shape = list(add._input_metadata[0].shape) if hasattr(add, "_input_metadata") else None
        if len(edges) != 1 or shape != [batch, *output.shape[1:]]:
            return None
        return add

    def _consumer_map(self, calls: list[Call]) -> dict[int, list]:
        """``{id(node): nodes that read its output}`` in the graph below ``calls``' outputs (made once)."""
        if self._consumers is None:
            self._consumers = defaultdict(list)
            starts = [node for call in calls for node in _call_nodes(call)]
            seen = {id(node) for node in starts}
            while starts:
                node = starts.pop()
                for child, _ in node.next_functions:
                    if child is None:
                        continue
                    self._consumers[id(child)].append(node)
                    if id(child) not in seen:
                        seen.add(id(child))
                        starts.append(child)
        return self._consumers

    @staticmethod
    def _claim_nested(calls: list[Call], outer: int, claimed: set[int]) -> None:
        """Drop ``claimed`` parameters from the calls made inside ``calls[outer]``."""
        for inner in calls[:outer]:
            if inner.position >= calls[outer].start:
                inner.params = [p for p in inner.params if id(p) not in claimed]

    def _param_name(self, param: torch.Tensor) -> str:
        for ref in self.tracer.roots:
            root = ref()
            if root is None:
                continue
            for name, candidate in root.named_parameters():
                if candidate is param:
                    return name
        return f"parameter of shape {list(param.shape)}"

    def _module_name(self, module: nn.Module) -> str:
        for ref in self.tracer.roots:
            root = ref()
            if root is None:
                continue
            for name, candidate in root.named_modules():
                if candidate is module:
                    return f"'{name}'" if name else "(the model itself)"
        return f"({type(module).__name__})"

    # ---- the backward pass --------------------------------------------------------------
    def enter(self) -> None:
        """Register the output-gradient pre-hooks (before ``loss.backward()``)."""
        for call in self.calls:
            self._register(call)
        self._watch_sums()
        self.tracer.live = self

    def adopt(self, call: Call) -> None:
        """A forward call made while this backend is live, i.e. during the backward pass.

        A reentrant activation checkpoint (``torch.utils.checkpoint(..., use_reentrant=True)``)
        runs its segment without gradients in the forward pass and again, with gradients,
        inside the backward pass: the parameters of that segment get their per-sample
        gradients from the second run. A call whose parameters a call of the forward pass
        covers already (a non-reentrant checkpoint's recomputation, which only restores
        saved tensors) is ignored.
        """
        own = [p for p in self.tracer.named_params(call.module, recurse=False).values() if id(p) in self._params]
        if not own or any(id(p) in self._assigned for p in own):
            return
        for adopted in self._assign([call], self._handled):
            self._assigned.update(id(p) for p in adopted.params)
            self.calls.append(adopted)
            self._register(adopted)

    def _register(self, call: Call) -> None:
        if call.consumer is not None:  # a shared output: its rows' gradients at the addition (one output)
            shared = call.output
            call.want, call.entries = [0], [shared.expand(self._call_batch(call), *shared.shape[1:])]
            call.grads, call.waiting = [None], 1
            self._handles.append(call.consumer.register_prehook(partial(self._on_grads, call, [(0, 0)])))
            return
        if call.node is not None:  # a tensor output: its node as the forward pass made it
            flat, nodes = [call.output], [call.node]
        else:
            flat = _flat_outputs(call.output)
            nodes = [t.grad_fn for t in flat]
        want, seen = [], set()
        for i, node in enumerate(nodes):
            # the same tensor returned twice (DeBERTa's encoder: its last hidden state also ends the tuple of hidden
            # states) is one output: a cotangent for each copy would count its gradient twice in the re-run's vjp
            if node is not None and (id(node), flat[i].output_nr) not in seen:
                seen.add((id(node), flat[i].output_nr))
                want.append(i)
        call.want = want
        call.entries = [flat[i] for i in want]
        call.grads = [None] * len(want)
        call.waiting = len(want)
        by_node: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
        for slot, i in enumerate(want):
            by_node.setdefault(id(nodes[i]), (nodes[i], []))[1].append((flat[i].output_nr, slot))
        for node, entries in by_node.values():
            self._handles.append(node.register_prehook(partial(self._on_grads, call, entries)))

    # ---- batch sums that the backward pass computes anyway -----------------------------------
    def _watch_sums(self) -> None:
        """Where a parameter's batch sum of rows will be needed, take it from the backward pass.

        A tied parameter's rows are the sum of its uses' rows, and a layer over the reducer's memory
        budget is made a block of rows at a time; statistics such as the Gram row sums read the
        batch sum of those rows before the first block. For a use whose rule covers the whole
        gradient that its call passes to the parameter, that sum is the gradient autograd computes
        for the use (GPT-2's output layer: a 50257 x 768 x 2048 product, not made twice): a hook
        on the node of the call's own graph that passes it to the parameter reads it, and the
        use's rows are handed on when it has run. A use gets none (and its sum is made from the
        rows) unless that node is unambiguous: reached from the call's outputs without leaving the
        call (no node made before its inputs, e.g. a weight cast cached by autocast for several
        calls), read by no node outside the call, and the one edge of the call to the parameter.
        """
        budget = getattr(self.reducer, "budget_bytes", None)
        for call in self.calls:
            if rule_for(call.module) is None or call.consumer is not None:
                continue
            params = [
                p for p in call.params
                if p.dim() >= 2 and p.dtype in (torch.float32, torch.float64) and p.is_leaf and p.requires_grad
                and type(p) in (torch.Tensor, nn.Parameter)
                and (self._uses[id(p)] > 1 or (budget is not None and self._call_batch(call) * p.numel() * 4 > budget))
            ]  # fmt: skip
            if not params:
                continue
            for key, (node, index) in self._own_edges(call, params).items():
                self._sums[(id(call), key)] = _WAITING
                self._handles.append(node.register_hook(partial(self._on_sum, (id(call), key), index)))

    def _own_edges(self, call: Call, params: list[torch.Tensor]) -> dict[int, tuple[Any, int]]:
        """``{id(param): (node, index)}``: the one edge of ``call``'s own graph into each parameter
        (see :meth:`_watch_sums`); parameters without one are left out."""
        inputs = [t for t in _flat_outputs((call.args, call.kwargs)) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not inputs:
            return {}
        floor = max(t.grad_fn._sequence_nr() for t in inputs)  # nodes made before the call began
        stops = {id(t.grad_fn) for t in inputs}
        roots = _call_nodes(call)
        inside = {id(node): node for node in roots}
        stack, wanted = list(roots), {id(p) for p in params}
        edges: dict[int, list] = defaultdict(list)
        while stack:
            node = stack.pop()
            for index, (child, _) in enumerate(node.next_functions):
                if child is None or id(child) in stops:
                    continue
                variable = getattr(child, "variable", None)  # an AccumulateGrad node
                if variable is not None:
                    if id(variable) in wanted:
                        edges[id(variable)].append((node, index))
                    continue
                if id(child) in inside:
                    continue
                if child._sequence_nr() <= floor or len(inside) >= 32:
                    return {}  # the graph leaves the call: not its own
                inside[id(child)] = child
                stack.append(child)
        users = self._consumer_map(self.calls)
        root_ids = {id(node) for node in roots}
        for key in inside:
            if key not in root_ids and any(id(user) not in inside for user in users.get(key, ())):
                return {}  # a node of the call that something else reads too
        return {key: found[0] for key, found in edges.items() if len(found) == 1}

    def _on_sum(self, key: tuple[int, int], index: int, grad_inputs, grad_outputs) -> None:
        """A watched node ran: its gradient for the parameter is the use's batch sum (:meth:`_watch_sums`)."""
        if key not in self._sums:
            return
        grad = grad_inputs[index]
        with self.tracer.pause():
            self._sums[key] = None if grad is None else grad.detach()
            parked = self._parked.pop(key, None)
            if parked is not None:
                param, form = parked
                form.known_sum = self._sums.pop(key)
                self._deliver(param, form)

    def _on_grads(self, call: Call, entries: list[tuple[int, int]], grad_outputs) -> None:
        if call.waiting <= 0:
            return
        with self.tracer.pause():  # the cockpit's own work: not part of a recorded step
            for nr, slot in entries:
                grad = grad_outputs[nr]
                if call.grads[slot] is None:
                    call.waiting -= 1
                    call.grads[slot] = None if grad is None else grad.detach()
            if call.waiting == 0:
                self._process(call)

    def finish(self) -> None:
        """After ``loss.backward()``: the calls still waiting (outputs that got no gradient) and the fallbacks."""
        self.remove_hooks()
        if self._errors:
            raise self._errors[0]
        # watched nodes that did not run: those uses' sums are made from their rows
        self._sums = {key: value for key, value in self._sums.items() if value is not _WAITING}
        parked, self._parked = self._parked, {}
        for param, form in parked.values():
            self._deliver(param, form)
        for call in self.calls:
            if call.done:
                continue
            if call.waiting < len(call.want):  # part of this backward pass: missing gradients are zero
                self._process(call)
            else:  # no output got a gradient: a forward pass that this backward pass does not contain
                call.release()
        deferred, self._deferred = self._deferred, []
        for call in deferred:
            with _whole_parameters(call.module):
                self._fallback(call)
        for key in list(self._partial):  # a tied parameter whose other uses got no gradient
            self._deliver_sum(key)
        self._sums.clear()

    def remove_hooks(self) -> None:
        if getattr(self.tracer, "live", None) is self:
            self.tracer.live = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- per call -------------------------------------------------------------------------
    def _grads(self, call: Call) -> list[torch.Tensor]:
        return [(t.zeros() if isinstance(t, Shell) else torch.zeros_like(t)) if g is None else g
                for t, g in zip(call.entries, call.grads)]  # fmt: skip

    def _process(self, call: Call) -> None:
        call.done, call.waiting = True, -1
        rule = rule_for(call.module)
        forms = None
        if rule is not None and len(call.want) == 1 and call.want[0] == 0 and call.args:
            x, grad = call.args[0], self._grads(call)[0]
            if not call.flat:
                self._check_rows(call, grad)
            if isinstance(x, torch.Tensor) and x.dim() > 0 and grad.dim() > 0:
                if x.shape[0] == 1 and grad.shape[0] > 1:  # an input shared by the batch
                    x = x.expand(grad.shape[0], *x.shape[1:])
                if call.flat:  # rows flattened sample-major: [B*k, ...] -> [B, k, ...]
                    batch = self._call_batch(call)
                    x = x.reshape(batch, -1, *x.shape[1:])
                    grad = grad.reshape(batch, -1, *grad.shape[1:])
                with torch.no_grad():
                    forms = rule(call.module, x.detach(), grad)
                    if forms is not None and getattr(self.reducer, "module_stats", None):
                        self.reducer.observe_module(call.module, x.detach(), grad)
        if forms is None:
            self._deferred.append(call)
            return
        self._deliver_forms(call, forms)

    def _deliver_forms(self, call: Call, forms: dict) -> None:
        """Deliver a rule's ``{parameter name: form}`` for the parameters this call computes, then free the call."""
        owned = {id(p) for p in call.params}
        named = self.tracer.named_params(call.module)  # a rule may name a parameter the layer lacks (bias=False)
        for name, form in forms.items():
            param = named.get(name)
            if param is not None and id(param) in owned:
                key = (id(call), id(param))
                if self._sums.get(key) is _WAITING:  # handed on once autograd's sum for this use is made
                    self._parked[key] = (param, form)
                    continue
                if key in self._sums:
                    form.known_sum = self._sums.pop(key)
                self._deliver(param, form)
        call.release()

    def _check_rows(self, call: Call, grad: torch.Tensor) -> None:
        batch = int(self.batch_size) if self.batch_size is not None else call.batch
        if batch and (grad.dim() == 0 or grad.shape[0] != batch):
            raise UncoveredParameterError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)}: its output (shape "
                f"{list(grad.shape)}) has no batch dimension of size {batch}, so the cockpit cannot tell the "
                "rows' gradients apart (an output shared by all rows, e.g. embeddings of torch.arange(T)). "
                "Give it a batch dimension of 1 or of the batch size (e.g. positions of shape [1, T], or "
                "`.expand(batch_size, ...)` of the input)."
            )

    def _deliver(self, param: torch.Tensor, form) -> None:
        key = id(param)
        if self._uses[key] == 1 and key not in self._partial:
            self._uses[key] = 0
            form.feed(self.reducer, param)
            return
        self._partial.setdefault(key, []).append(form)  # the uses' forms, summed a block of rows at a time
        self._uses[key] -= 1
        if self._uses[key] == 0:
            self._deliver_sum(key)

    def _deliver_sum(self, key: int) -> None:
        self._uses[key] = 0
        param = self._params[key]
        summed(self._partial.pop(key), param.shape).feed(self.reducer, param)

    # ---- the torch.func fallback ------------------------------------------------------------
    def _fallback(self, call: Call) -> None:
        random = _random_submodule(call.module)
        if random is not None and call.climbed:
            names = [self._param_name(p) for p in call.params]
            raise UncoveredParameterError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)} computes the per-sample "
                f"gradients of {names}, whose own layers cannot tell the rows apart (an output without batch "
                "dimension, e.g. a relative position bias shared by all rows, or tokens routed from every row), "
                "by re-running it row by row, but it draws random numbers in training mode "
                f"({random}): the re-run would use other dropout masks than the training step. Set its dropout "
                "to 0 or call .eval() on it during the cockpit's steps, or leave these parameters out of "
                "Cockpit(params)."
            )
        if random is not None:
            raise UncoveredParameterError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)} has no per-layer rule, "
                "so its per-sample gradients are recomputed row by row, but it draws random numbers in "
                f"training mode ({random}): the recomputation would use other dropout masks than the "
                "training step. Set its dropout to 0 (nn.TransformerEncoderLayer / DecoderLayer: "
                "`layer.self_attn.dropout = 0.0` keeps the other dropouts), or call .eval() on it during "
                "the cockpit's steps. Hugging Face attention layers are not affected (their projections "
                "have per-layer rules). If the module is the model itself because it owns a parameter "
                "(e.g. a class token), move that parameter into a small submodule of its own."
            )
        recompute = None if call.climbed else RECOMPUTE_RULES.get(type(call.module))
        if recompute is not None:
            with torch.no_grad(), self.tracer.pause():
                forms = recompute(call.module, call.args, call.kwargs, call.output, self._grads(call))
            if forms is not None:
                self._deliver_forms(call, forms)
                return
        batch = self._batch(call)
        arguments = (call.module, call.params, call.args, call.kwargs, call.want, self._grads(call), batch, self.tracer)
        options = {"recorded": call.entries, "shared": call.consumer is not None}
        budget = getattr(self.reducer, "budget_bytes", None)
        row_bytes = sum(p.numel() * max(4, p.element_size()) for p in call.params)
        if budget is not None and batch > 1 and batch * row_bytes > budget:
            # over the memory budget: each parameter's rows re-run a block at a time as the reducer takes them
            for param, lazy in zip(call.params, per_sample_grad_rows(*arguments, **options)):
                self._deliver(param, Lazy(lazy))
        else:
            for param, grad_batch in zip(call.params, per_sample_grads(*arguments, **options)):
                self._deliver(param, Dense(grad_batch))
        call.release()

    def _batch(self, call: Call) -> int:
        if self.batch_size is not None:
            return int(self.batch_size)
        slots = list(enumerate(call.args)) + list((call.kwargs or {}).items())
        for position, value in slots:
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return value.shape[_batch_dim(call.module, position, value)]
        raise UncoveredParameterError(
            f"cannot tell the batch size of a call of {type(call.module).__name__}: pass "
            "info['batch_size'] to the cockpit"
        )


def _random_submodule(module: nn.Module) -> str | None:
    """A description of dropout that ``module`` would apply in its forward pass (training mode), else ``None``."""
    for name, child in module.named_modules():
        if not child.training:
            continue
        where = f"'{name}'" if name else "itself"
        if isinstance(child, nn.modules.dropout._DropoutNd) and child.p > 0:
            return f"{type(child).__name__}(p={child.p}) {where}"
        if isinstance(child, (nn.MultiheadAttention, nn.RNNBase)) and getattr(child, "dropout", 0) > 0:
            return f"{type(child).__name__}(dropout={child.dropout}) {where}"
    return None


def _batch_dim(module: nn.Module, position: int | str, tensor: torch.Tensor) -> int:
    """The dimension that indexes samples in an argument of ``module`` (0 but for recurrent layers)."""
    if isinstance(module, nn.RNNBase):
        if position in (0, "input"):
            return 0 if module.batch_first else 1
        return 1  # hidden states: [layers * directions, B, H]
    return 0


def _batched(module, position, tensor, batch) -> int | None:
    if not isinstance(tensor, (torch.Tensor, Shell)) or tensor.dim() == 0:
        return None
    dim = _batch_dim(module, position, tensor)
    if dim < tensor.dim() and tensor.shape[dim] == batch:
        return dim
    return None


def per_sample_grads(
    module, params, args, kwargs, want, grads, batch, tracer, recorded: list[torch.Tensor] | None = None,
    shared: bool = False,
) -> list[torch.Tensor]:
    """``[B, *p.shape]`` per parameter of ``params``: per row, the gradient of ``sum_k <out_k, grads_k>``.

    ``out_k`` are the module's flattened tensor outputs at the indices ``want``
    and ``grads`` their gradients. ``torch.func``: ``vmap`` over the rows of
    ``vjp`` of ``functional_call`` (each row run as a batch of one); where
    ``vmap`` cannot run the module (recurrent layers, routing), a loop over the rows
    with ``torch.autograd.grad``. Tensors inside tuples, lists and dicts of the
    arguments are split too. ``shared``: the module computed one output shared by
    all rows (leading 1), whose rows' gradients ``grads`` come from where it was
    added to the batch; its inputs are not split. ``recorded``: the outputs of the
    forward pass, which the re-run must reproduce (else an error says why not).
    """
    rerun = _Rerun(module, params, args, kwargs, want, grads, batch, tracer, shared)
    results, outputs = rerun.rows(0, batch)
    rerun.check(outputs, recorded, 0, batch)
    return results


def per_sample_grad_rows(
    module, params, args, kwargs, want, grads, batch, tracer, recorded: list[torch.Tensor] | None = None,
    shared: bool = False,
) -> list[LazyRows]:
    """:func:`per_sample_grads` a block of rows at a time: per parameter a
    :class:`~cockpit_like.backends.per_sample.LazyRows` whose ``make(start, stop)``
    re-runs rows ``start:stop`` for that parameter alone (each block's outputs
    checked against ``recorded`` once), so that no ``[B, *p.shape]`` exists when
    the reducer takes blocks under its budget. A parameter's blocks re-run the
    module's rows once each: ``len(params)`` re-runs of the batch in all."""
    rerun = _Rerun(module, params, args, kwargs, want, grads, batch, tracer, shared)
    checked: set[tuple[int, int]] = set()

    def maker(index: int):
        def make(start: int, stop: int) -> torch.Tensor:
            results, outputs = rerun.rows(start, stop, only=index)
            if (start, stop) not in checked:
                rerun.check(outputs, recorded, start, stop)
                checked.add((start, stop))
            return results[0]

        return make

    return [LazyRows(batch, p.shape, maker(k), max(4, p.element_size())) for k, p in enumerate(params)]


class _Rerun:
    """A module call prepared for re-running rows (:func:`per_sample_grads`)."""

    def __init__(self, module, params, args, kwargs, want, grads, batch, tracer, shared):
        names: dict[int, str] = {}
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
        self.module, self.params, self.tracer, self.batch = module, list(params), tracer, batch
        self.param_names = [names[id(p)] for p in params]
        args, kwargs = list(args or ()), dict(kwargs or {})
        # every tensor in the arguments, also inside tuples, lists and dicts (Llama's rotary (cos, sin))
        slots = [(i, value) for i, value in enumerate(args)] + list(kwargs.items())
        structure, values, dims = [], [], []
        for position, value in slots:
            leaves, spec = tree_flatten(value)
            structure.append((len(leaves), spec))
            for leaf in leaves:
                values.append(leaf.detach() if isinstance(leaf, torch.Tensor) else _replayable(leaf))
                dims.append(None if shared else _batched(module, position, leaf, batch))
        out_dims = [_batched(module, 0 if index == 0 else 1, g, batch) for index, g in zip(want, grads)]
        if any(d is None for d in out_dims):
            raise UncoveredParameterError(
                f"{type(module).__name__}: an output has no batch dimension of size {batch} (shapes "
                f"{[list(g.shape) for g in grads]}), so the cockpit cannot tell the rows' gradients apart. If "
                "the output is shared by all rows (e.g. a table broadcast over the batch), return it with a "
                "batch dimension (`table.expand(batch_size, *table.shape)`) or with a leading dimension of 1."
            )
        self.values, self.dims, self.out_dims, self.grads = values, dims, out_dims, list(grads)
        self.batched = [k for k, d in enumerate(dims) if d is not None]
        self._vmap = True  # until vmap fails on this module once (then every block takes the loop)
        self._whole = None  # the whole batch's outputs re-run, where the forward pass's were not kept

        def run(p: dict, rows: list) -> tuple:
            current = list(values)
            for k, row in zip(self.batched, rows):
                current[k] = row
            rebuilt, offset = [], 0
            for count, spec in structure:
                rebuilt.append(tree_unflatten(current[offset : offset + count], spec))
                offset += count
            call_args = rebuilt[: len(args)]
            call_kwargs = dict(zip(kwargs, rebuilt[len(args):]))
            out = _flat_outputs(functional_call(module, p, tuple(call_args), call_kwargs))
            return tuple(out[i] for i in want)

        self.run = run

    def rows(self, start: int, stop: int, only: int | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``([stop - start, *p.shape] per parameter (or for ``params[only]``), the re-run's outputs)``."""
        count = stop - start
        whole = start == 0 and stop == self.batch
        values = list(self.values)
        if not whole:
            for k in self.batched:
                values[k] = values[k].narrow(self.dims[k], start, count)
        grads = self.grads if whole else [g.narrow(d, start, count) for g, d in zip(self.grads, self.out_dims)]
        chosen = range(len(self.params)) if only is None else [only]
        names = [self.param_names[k] for k in chosen]
        with self.tracer.pause():
            if self._vmap:
                try:
                    detached = {name: p.detach() for name, p in zip(self.param_names, self.params)}
                    return _vmapped(self.run, detached, names, values, self.batched, self.dims, grads, self.out_dims)
                except Exception:  # noqa: BLE001 - vmap has no batching rule (RNNs, custom autograd, routing)
                    self._vmap = False
            live = dict(zip(self.param_names, self.params))
            params = [self.params[k] for k in chosen]
            return _looped(self.run, live, params, values, self.batched, self.dims, grads, self.out_dims, count)

    def check(self, outputs: list[torch.Tensor], recorded: list[torch.Tensor] | None, start: int, stop: int) -> None:
        """The re-run's outputs of rows ``start:stop`` must be the forward pass's (``recorded``)."""
        if recorded is None:
            return
        if any(isinstance(t, Shell) for t in recorded):
            # the forward pass's values were not kept (Shell): the row-by-row re-run must agree with a re-run
            # of the whole batch, i.e. the rows are independent (dropout is refused before); made once
            if self._whole is None:
                with self.tracer.pause(), torch.no_grad():
                    self._whole = self.run(
                        {name: p.detach() for name, p in zip(self.param_names, self.params)},
                        [self.values[k] for k in self.batched],
                    )
            # a shared output (leading 1) was recorded as its expansion over the rows
            recorded = [
                o.expand(t.shape) if o.shape != t.shape and o.dim() == t.dim() else o for o, t in zip(self._whole, recorded)
            ]
        if not (start == 0 and stop == self.batch):
            recorded = [o.narrow(d, start, stop - start) for o, d in zip(recorded, self.out_dims)]
        if not _same_outputs(outputs, recorded):
            raise UncoveredParameterError(
                f"{type(self.module).__name__}: re-running it row by row to get per-sample gradients did not "
                "reproduce the outputs of the training step's forward pass, so its rows are not independent or "
                "its forward pass depends on state (a key/value cache filled by earlier forward passes: pass "
                "use_cache=False while training; random numbers: set dropout to 0 or call .eval(); a loss or "
                "statistic over the whole batch computed inside it)."
            )


def _vmapped(run, detached, names, values, batched, dims, grads, out_dims):
    """``([B, *p.shape] per name in ``names``, the re-run's outputs)``; the other parameters are constants."""
    count = len(batched)
    constants = {name: value for name, value in detached.items() if name not in names}
    variables = {name: detached[name] for name in names}

    def one(*sample):
        rows = [row.unsqueeze(dims[k]) for k, row in zip(batched, sample[:count])]
        cotangents = tuple(g.unsqueeze(d) for g, d in zip(sample[count:], out_dims))
        out, back = vjp(lambda p: run({**constants, **p}, rows), variables)
        return tuple(o.squeeze(d) for o, d in zip(out, out_dims)), back(cotangents)[0]

    in_dims = tuple(dims[k] for k in batched) + tuple(out_dims)
    with torch.enable_grad():
        outputs, result = vmap(one, in_dims=in_dims, out_dims=(tuple(out_dims), 0))(
            *[values[k] for k in batched], *grads
        )
    return [result[name].detach() for name in names], [o.detach() for o in outputs]


def _looped(run, live, params, values, batched, dims, grads, out_dims, batch):
    """The same as :func:`_vmapped` by a loop over the rows (gradients of ``params`` only)."""
    per_param: list[list[torch.Tensor]] = [[] for _ in params]
    per_output: list[list[torch.Tensor]] = [[] for _ in grads]
    for row in range(batch):
        rows = [values[k].narrow(dims[k], row, 1) for k in batched]
        cotangents = [g.narrow(d, row, 1) for g, d in zip(grads, out_dims)]
        with torch.enable_grad():
            out = run(live, rows)
            results = torch.autograd.grad(out, params, cotangents, allow_unused=True)
        for k, (p, g) in enumerate(zip(params, results)):
            per_param[k].append(torch.zeros_like(p) if g is None else g.detach())
        for k, o in enumerate(out):
            per_output[k].append(o.detach())
    outputs = [torch.cat(rows, d) for rows, d in zip(per_output, out_dims)]
    return [torch.stack(rows) for rows in per_param], outputs


def _replayable(value):
    """An argument as the re-run may see it: a key/value cache (Hugging Face's ``Cache``, filled by this
    very call) is left out, since re-running would append to it; the output check catches the rest."""
    if hasattr(value, "get_seq_length") and hasattr(value, "update"):
        return None
    return value


def _same_outputs(recomputed: list[torch.Tensor], recorded: list[torch.Tensor]) -> bool:
    """Equal up to rounding: the largest difference within ``tolerance * (1 + largest |value|)``, with a
    tolerance by precision (a re-run of a whole stack row by row rounds differently from the batch)."""
    for new, old in zip(recomputed, recorded):
        old = old.detach()
        if new.shape != old.shape:
            return False
        if not old.numel():
            continue
        tolerance = {torch.float64: 1e-7, torch.float32: 1e-3}.get(old.dtype, 2e-2)
        scale = 1 + float(old.abs().max())
        if not float((new.to(old.dtype) - old).abs().max()) <= tolerance * scale:  # NaN fails too
            return False
    return True
