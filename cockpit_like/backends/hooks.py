"""The hook backend: per-sample gradients of any module, without BackPACK.

Three modules, from the bottom up:

- :mod:`cockpit_like.backends.tracer`: :class:`~cockpit_like.backends.tracer.ModelTracer`,
  installed once on the model, notes the forward calls of the modules with
  tracked parameters in their subtree during every forward pass.
- :mod:`cockpit_like.backends.rerun`: the ``torch.func`` re-run
  (``functional_call`` + ``vmap`` of ``vjp``, a loop over rows where ``vmap``
  cannot run) for modules without a per-layer rule.
- this module: :class:`HookBackend`, built for one tracked step from the noted
  calls. It registers a pre-hook on the autograd node of each call's outputs,
  so it receives the gradient of the loss w.r.t. the outputs during the
  backward pass, and turns (inputs, output gradients) into per-sample
  gradients: by a per-layer rule (:mod:`cockpit_like.backends.module_rules`)
  while the backward pass runs, layer by layer, or, for any other module that
  owns parameters, by the re-run right after the backward pass. The results
  go to the same :class:`~cockpit_like.backends.per_sample.PerSampleReducer`
  that BackPACK's path feeds, so every statistic is written once.

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
  :class:`UncoveredParameterError` naming the layer and the parameters;
- **the batch's shape, other rows**: then every call that computes
  parameters (and every call they climb to) is checked on the graph from its
  outputs to the model's outputs (:mod:`cockpit_like.backends.row_paths`,
  ``_route_rows``, from the last call to the first): its row ``n`` must reach
  the model's outputs as row ``n`` (an expert that gets ``B`` tokens gathered
  by index has the batch's shape, but its row ``r`` is token ``idx[r]``'s).
  Where it does not, the call climbs as above. The walk jumps over the calls
  re-run row by row (their re-run checks that they keep the rows) and over
  ``nn.MultiheadAttention``.

May import torch and :mod:`cockpit_like.backends` (the tracer and the re-run
included). ``ModelTracer`` and ``UncoveredParameterError`` are re-exported
from here; the re-run's ``per_sample_grads`` is called through this module's
name for it (so ``monkeypatch.setattr(hooks, "per_sample_grads", ...)`` works).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from functools import partial
from typing import Any

import torch
from torch import nn

from cockpit_like.backends.module_rules import RECOMPUTE_RULES, Dense, Lazy, is_hf_conv1d, rule_for, summed, sums_positions_in_half
from cockpit_like.backends.rerun import (
    RowsNotReproducedError,
    UncoveredParameterError,
    _batch_dim,
    _batched,
    _random_submodule,
    per_sample_grad_rows,
    per_sample_grads,
    rows_in_arguments,
)
from cockpit_like.backends.row_paths import ACCEPT, MIXES_ROWS, RowPaths
from cockpit_like.backends.tracer import Call, ModelTracer, Shell, _call_nodes, _flat_outputs, _graph_nodes

__all__ = [
    "ModelTracer",  # re-exported from cockpit_like.backends.tracer
    "HookBackend",
    "BatchNormInTrainingError",
    "BatchSizeMismatchError",
    "RowsNotSamplesError",
    "UncoveredParameterError",  # re-exported from cockpit_like.backends.rerun
    "coupling_reason",
]


class BatchSizeMismatchError(UncoveredParameterError):
    """``info["batch_size"]`` is not the number of rows of the step's forward pass (it names both)."""


class RowsNotSamplesError(UncoveredParameterError):
    """The model ran several times in the step's forward pass and none of its calls has ``info["batch_size"]`` rows:
    the declared rows are not the rows of one model call (MAML: one loss per task, each task its own forward
    passes), so per-sample gradients are not defined. The step goes on without its per-sample values, with a note
    (:meth:`~cockpit_like.backends.step.StepExecution.exit`)."""


class BatchNormInTrainingError(RuntimeError):
    """A batch norm in training mode mixes the samples: per-sample quantities are undefined."""


def coupling_reason(module: nn.Module) -> str | None:
    """Why a row's gradient through ``module`` depends on the other rows of the batch, for the step's note: batch
    norm in training mode (statistics of the current batch), an embedding with ``scale_grad_by_freq`` (each id's
    gradient divided by its count in the whole batch); ``None`` if it does not."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and (module.training or not module.track_running_stats):
        return (f"{type(module).__name__} in training mode normalises with the whole batch's statistics "
                "(model.eval() on the norms, or GroupNorm / LayerNorm, gives the rows back)")
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.scale_grad_by_freq:
        return (f"{type(module).__name__}(scale_grad_by_freq=True) divides each id's gradient by its count in the "
                "whole batch (scale_grad_by_freq=False gives the rows back)")
    observing = _observing_fake_quant(module)
    if observing:
        return (f"{type(module).__name__} quantizes its activations with a scale its FakeQuantize observer "
                f"({observing}: quantization-aware training) takes from the whole batch's range, so a row's output "
                "depends on the other rows (torch.ao.quantization.disable_observer on the model, once the observers "
                "have settled, fixes the scales and gives the rows back)")
    return None


def _observing_fake_quant(module: nn.Module) -> str | None:
    """The names of the fake-quantize modules (``torch.ao.quantization.FakeQuantize``: ``observer_enabled`` and
    ``fake_quant_enabled`` buffers) that are ``module`` or its children and observe in training mode (a weight's
    observer, ``weight_fake_quant``, sees the weight only; others are named whatever they see); ``None`` if there
    is none. Children only, not the whole subtree: this runs for every call of a tracked step, and a deeper
    observer's own parent is a call too (a QAT layer holds its ``activation_post_process``)."""
    found = []
    for name, child in [("", module), *module.named_children()]:
        enabled = getattr(child, "observer_enabled", None)
        if not (isinstance(enabled, torch.Tensor) and hasattr(child, "fake_quant_enabled")):
            continue
        if name.rsplit(".", 1)[-1] == "weight_fake_quant":
            continue
        quantizing = getattr(child, "fake_quant_enabled")
        if child.training and bool(enabled.reshape(-1)[0]) and bool(quantizing.reshape(-1)[0]):
            found.append(name or type(child).__name__)
    return ", ".join(found) or None


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


#: a watched node that has not run yet (:meth:`HookBackend._watch_sums`)
_WAITING = object()


# ---- the backend of one step ------------------------------------------------------------
def _window(call: Call) -> tuple[int, int]:
    """``(low, high)``: the autograd nodes made while ``call`` ran have sequence numbers in ``(low, high]``
    (``low`` that of its latest input's node, ``-1`` without one; ``high`` that of its latest output's node)."""
    inputs = [t.grad_fn._sequence_nr() for t in _flat_outputs((call.args, call.kwargs))
              if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    outputs = [node._sequence_nr() for node in _call_nodes(call)]
    return (max(inputs) if inputs else -1), (max(outputs) if outputs else -1)


def _sequence_first_hint(shapes: list[list[int]], batch: int) -> str:
    """A sentence where every output shape has the batch size in a later dimension and not in the first
    (a sequence-first ``[T, B, ...]`` layout), else ``""``."""
    if batch <= 1 or not shapes or not all(len(s) > 1 and s[0] != batch and batch in s[1:] for s in shapes):
        return ""
    return (
        f" The batch ({batch} rows) seems to lie in dimension {shapes[0][1:].index(batch) + 1} of these outputs: a "
        f"sequence-first layout ([T, B, ...]). {_SEQUENCE_FIRST_FIX}"
    )


#: what to do with a model run sequence-first (:func:`_sequence_first_hint`, :meth:`HookBackend._wrong_batch_size`)
_SEQUENCE_FIRST_FIX = (
    "The cockpit finds the rows in the first dimension of a module's inputs and outputs (only nn.RNN / nn.LSTM / "
    "nn.GRU without batch_first and nn.MultiheadAttention are read sequence-first): feed the model [B, T, ...] "
    "(ids.t()) and build its layers with batch_first=True (nn.TransformerEncoderLayer(..., batch_first=True), "
    "nn.Transformer(..., batch_first=True)), or leave the per-sample quantities out."
)


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
        accumulate_passes: several backward passes run through this forward pass (two losses,
            ``retain_graph=True``): each call's output gradients are summed over the passes and its
            per-sample gradients made after them (exact: a row's gradient is linear in them).

    Attributes:
        repeated: a call got output gradients after it was processed (a second backward pass through the
            same forward pass, which the statistics then did not see).
    """

    def __init__(
        self, calls, params, reducer, handled_elsewhere, tracer, batch_size=None, accumulate_passes=False, losses=(),
    ):
        self.reducer = reducer
        #: the step's loss tensors (``info["loss"]``, ``info["individual_losses"]``): which model outputs they read
        self._losses = [t for t in losses if isinstance(t, torch.Tensor)]
        self.accumulate_passes = bool(accumulate_passes)
        self.repeated = False
        #: the backward passes seen through one call's output (more than one: :attr:`repeated`)
        self.passes = 1
        self._arrivals: dict[tuple[int, int], int] = {}
        self.tracer = tracer
        self.batch_size = batch_size
        self._handles: list[Any] = []
        self._deferred: list[Call] = []
        #: ``{id(call): (inner call, where)}``: calls that the parameters of a call with misplaced rows climbed to;
        #: where their re-run cannot split the rows either, the misplaced rows' error is raised (:meth:`_fallback`)
        self._misplaced_at: dict[int, tuple[Call, str]] = {}
        self._uses: dict[int, int] = defaultdict(int)
        self._partial: dict[int, list] = {}
        #: ``(rows, parameter name)`` of the first parameter delivered: every other must have as many rows
        self._rows_seen: tuple[int, str] | None = None
        self._params = {id(p): p for p in params if p.requires_grad}  # a frozen parameter has no rows
        self._handled = handled_elsewhere
        self._errors: list[UncoveredParameterError] = []
        self._consumers: dict[int, list] | None = None
        #: ``{id(node): [(consumer, position, output_nr)]}``, made with ``_consumers``
        self._edges: dict[int, list] = {}
        #: ``{id(param): [nodes that read it]}``: the consumers of the tracked parameters' accumulation nodes in
        #: the graph below the calls' outputs, made with ``_consumers``
        self._readers: dict[int, list] = defaultdict(list)
        #: where the rows of the calls' outputs go (:mod:`cockpit_like.backends.row_paths`; ``None``: not checked)
        self._paths: RowPaths | None = None
        self._root_modules: set[int] = set()
        #: ``(id(call), id(param))`` -> autograd's gradient of that use (``_WAITING``: its node has not run)
        self._sums: dict[tuple[int, int], Any] = {}
        #: forms waiting for their use's sum: ``(id(call), id(param))`` -> ``(param, form)``
        self._parked: dict[tuple[int, int], tuple] = {}
        self._flat_nodes: set[int] = set()
        self._all_calls = calls
        #: the leading sizes (other than 1) of every tensor the step's calls took and returned: where none is
        #: ``batch_size`` and they agree on another, ``info["batch_size"]`` is likely wrong (:meth:`_wrong_batch_size`)
        self._leading = {
            int(t.shape[0]) for call in calls for t in _flat_outputs((call.args, call.kwargs, call.output))
            if t.dim() > 0 and t.shape[0] != 1
        }  # fmt: skip
        roots = {id(ref()) for ref in tracer.roots}
        #: the rows of each call of the model itself in this step's forward pass (several: it ran several times)
        self._model_rows = [call.batch for call in calls if id(call.module) in roots]
        self.calls = self._assign(calls, handled_elsewhere)
        self._all_calls = []
        self._paths, self._edges = None, {}  # decided: the walks' bookkeeping is not needed any more
        #: parameters a call of the step's forward pass computes (a recomputation does not compute them again)
        self._assigned = {id(p) for call in self.calls for p in call.params}

    # ---- which call computes which parameter -------------------------------------------
    def _assign(self, calls: list[Call], handled_elsewhere, route: bool = True) -> list[Call]:
        tracked = self._params
        # (with the modules whose calls the loss does not reach: BertModel's pooler, called twice and read by
        # neither loss, went to the model's own call, which could not split it: outside trial 16)
        called = {id(call.module) for call in calls} | self.tracer.unreached
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
            reason = coupling_reason(module)
            if reason is not None:
                raise BatchNormInTrainingError(
                    f"layer {self._module_name(module)}: {reason}, so every sample's gradient depends on the other "
                    "samples and per-sample quantities (gradient tests, histograms, Alpha, TIC, ...) are undefined. "
                    "Fix the layer as said, or track only quantities without per-sample statistics (Loss, GradNorm, "
                    "Distance, UpdateSize, HessMaxEV)."
                )
            if handled_elsewhere(module):
                call.params = []
                continue
            params = [p for name, p in self.tracer.named_params(module, recurse=False).items()
                      if id(p) in tracked and name not in call.swapped]
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
        if route:
            self._route_rows(calls)
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
        if any(t.dim() > 0 for _, t in with_grad):
            # a scalar beside the batch's outputs (a mixture of experts' load-balancing loss, `return logits,
            # aux`) carries no rows: whether the loss reads it is known once the backward pass has run
            # (:meth:`_without_scalar_outputs`)
            with_grad = [(i, t) for i, t in with_grad if t.dim() > 0]
        if not with_grad or type(call.module) is nn.MultiheadAttention:
            return True  # nothing flows back through this call; the attention rule checks its own layout
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
        rerun = type(call.module) not in RECOMPUTE_RULES
        if rerun and not rows_in_arguments(call.module, call.args, call.kwargs, batch):
            # the re-run splits the arguments only: outputs of the batch's size computed from no row
            # (weight_norm's [B, in] weight) are not the rows' (a recompute rule reads its own layout:
            # EmbeddingBag's 1-D ids with B + 1 offsets)
            return False
        return not _output_used_inside(call, [t for _, t in with_grad])

    def _enclosing(self, calls: list[Call], index: int) -> int | None:
        """The index of the smallest call enclosing ``calls[index]`` that carries the batch and whose rows reach
        the model's outputs as the samples' (not a layer with a rule: it computes only its own parameters)."""
        call = calls[index]
        misplaced = self._paths.misplaced if self._paths is not None else False
        try:
            for outer in range(index + 1, len(calls)):
                candidate = calls[outer]
                if not candidate.start <= call.position or rule_for(candidate.module) is not None:
                    continue  # not an enclosing call, or a layer with a rule
                if not self._carries_batch(candidate):
                    continue
                if self._paths is not None and self._broken_rows(candidate) is not None:
                    continue  # its rows are not the samples' either
                return outer
            return None
        finally:
            if self._paths is not None:
                self._paths.misplaced = misplaced

    def _climb(self, calls: list[Call], index: int, broken: str | None = None) -> None:
        """Move ``calls[index]``'s parameters to the smallest enclosing call that carries the batch.

        The enclosing call's ``torch.func`` fallback then computes their per-sample gradients
        (through every use inside it: a table read by several layers, tokens routed from every row).
        ``broken``: the call has the batch's shape, but its rows do not reach the model's outputs row
        for row (what breaks them, :meth:`_route_rows`).
        """
        call = calls[index]
        outer = self._enclosing(calls, index)
        if outer is not None:
            candidate = calls[outer]
            climbing = list(call.params)
            self._note_climbed_half_sums(call)
            self._claim_nested(calls, outer, {id(p) for p in climbing})
            known = {id(p) for p in candidate.params}
            candidate.params = candidate.params + [p for p in climbing if id(p) not in known]
            candidate.climbed = True
            if self._paths is not None:
                self._add_box(candidate)
            return
        names = [self._param_name(p) for p in call.params]
        if broken is not None:
            call.params = []
            self._errors.append(UncoveredParameterError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)}: its outputs have the batch "
                f"dimension, but their rows do not reach the model's outputs row for row ({broken}: e.g. tokens "
                "gathered by index for an expert and added back with index_add), so the rows' gradients of "
                f"{names} cannot be told apart, and no enclosing module's call has the batch dimension in its "
                "inputs and outputs. Call the model so that some module around this layer takes and returns "
                "tensors whose rows are the samples (it is then re-run row by row), or leave these parameters "
                "out of Cockpit(params)."
            ))
            return
        shapes = [list(t.shape) for t in _flat_outputs(call.output) if t.grad_fn is not None]
        call.params = []
        batch = self._call_batch(call)
        sizes = [c.batch for c in calls if c.module is call.module]
        if len(sizes) > 1 and sum(sizes) == batch:  # one module on several parts of the rows (a GAN's D)
            # a note, not an error (since 2026-11-29): the step's other quantities are defined and the run goes on
            self._errors.append(RowsNotSamplesError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)} was called {len(sizes)} times "
                f"in this step's forward pass, on {' + '.join(str(n) for n in sizes)} = {batch} rows: one module on "
                "different rows of the batch (a GAN discriminator on real and on fake rows, a forward pass in "
                "chunks such as torch.cat([model(x[:k]), model(x[k:])])) gives no call whose outputs carry all "
                f"{batch} rows, and the cockpit does not pair the calls' rows with the rows of "
                f"info['individual_losses'], so the rows' gradients of {names} cannot be told apart: the per-sample "
                "quantities (NormTest, InnerTest, OrthoTest, GradHist1d/2d, Alpha's noise, TIC) are left out of "
                "this step, the others (Loss, GradNorm, Distance, UpdateSize, HessMaxEV, ...) are stored. To have "
                "them, call it once on the concatenated rows (torch.cat([real, fake])) and split its output "
                "(docs/your_model.md#limits)."
            ))
            return
        # raised by finish(), after the backward pass, where the step adds the quantities that need it
        wrong = self._wrong_batch_size()
        if wrong is not None:
            error, why = wrong
            self._errors.append(error(
                f"{type(call.module).__name__} layer {self._module_name(call.module)}: the rows' gradients of {names} "
                f"cannot be told apart because {why}"
            ))
            return
        with_grad = [t for t in _flat_outputs(call.output) if t.grad_fn is not None]
        if with_grad and all(t.dim() > 0 and t.shape[0] == batch for t in with_grad) and _output_used_inside(
                call, with_grad):
            self._errors.append(UncoveredParameterError(
                f"{type(call.module).__name__} {self._module_name(call.module)}: one of its outputs (shapes "
                f"{shapes}) is computed from another of them (e.g. `return features, self.head(features)`, or a "
                "Hugging Face model with output_hidden_states / output_attentions), so a re-run of this call row "
                "by row would count the inner use of that output twice, and no enclosing call can take its "
                f"parameters {names}. Return only the outputs the loss reads (the logits; output_hidden_states="
                "False), or compute the other output outside this module, or move these parameters into a "
                "submodule (their own nn.Module), or leave them out of Cockpit(params)."
            ))
            return
        self._errors.append(UncoveredParameterError(
            f"{type(call.module).__name__} layer {self._module_name(call.module)}: its outputs (shapes {shapes}) or "
            f"inputs have no batch dimension of size {self._call_batch(call)}, so the cockpit cannot tell the "
            f"rows' gradients of {names} apart, and no enclosing module's call has the batch dimension in its "
            "inputs and outputs (the outermost one may return a loss, a scalar). Call the model so that "
            "some module around this layer takes and returns tensors whose leading dimension is the batch "
            "(e.g. compute the loss outside the model; where the samples are packed along one dimension in pieces "
            "of different sizes, as graphs flattened into their nodes in PyTorch Geometric's layout, give the model "
            "a dense layout with a batch dimension, [B, N, d] padded, with a mask), or leave these parameters out "
            "of Cockpit(params)."
            + _sequence_first_hint(shapes, batch)
        ))

    def _wrong_batch_size(self) -> tuple[type, str] | None:
        """``(error type, why)`` where no call has ``info["batch_size"]`` rows and that says why, else ``None``:

        - the model ran several times and none of its calls has that many rows: the declared rows are not a model
          call's rows (MAML with one loss per task), or ``batch_size`` is wrong: :class:`RowsNotSamplesError`
          (the step goes on without per-sample values, with a note);
        - every tensor of the step's calls has the same other number of rows: fewer (a short last batch passed
          with the loader's nominal size), ``k`` times as many (one loss per group of ``k`` rows) or otherwise
          more: :class:`BatchSizeMismatchError`.
        """
        if self.batch_size is None:
            return None
        batch, calls = int(self.batch_size), self._model_rows
        if len(calls) > 1 and batch not in calls:
            sizes = sorted(set(calls))
            each = f"on {sizes[0]} rows each" if len(sizes) == 1 else f"on {' / '.join(map(str, sizes))} rows"
            return RowsNotSamplesError, (
                f"info['batch_size'] is {batch}, but the model ran {len(calls)} times in this step's forward pass, "
                f"{each}, and none of its calls has {batch} rows: the {batch} per-sample losses are not the rows of a "
                "model call (a meta-learning loop such as MAML with one loss per task, each task's forward passes "
                "on its own rows; a loss per group of rows), so per-sample gradients (and the quantities built on "
                "them: NormTest, InnerTest, OrthoTest, GradHist1d/2d, Alpha's noise, TIC) are not defined for this "
                "loop; the others (Loss, GradNorm, Distance, UpdateSize, HessMaxEV, ...) are. Leave the per-sample "
                "quantities out at these steps; if instead each call's rows are the samples, run the model once on "
                "all of them with one loss per row and 'batch_size' = those rows; if this is a short last batch, "
                "pass its rows ('batch_size': len(targets))."
            )
        if len(calls) > 1 and batch in calls and len(set(calls)) > 1:
            others = " / ".join(str(n) for n in sorted(set(calls) - {batch}))
            return RowsNotSamplesError, (
                f"info['batch_size'] is {batch}, and the model ran {len(calls)} times in this step's forward pass, on "
                f"{batch} rows and on {others}: the {batch} per-sample losses read the outputs of a call on other rows "
                "(a support set whose prototypes every query reads, negatives or a memory bank computed with the "
                "model in the step), so a row's gradient is not its own call's row: per-sample gradients (and the "
                "quantities built on them: NormTest, InnerTest, OrthoTest, GradHist1d/2d, Alpha's noise, TIC) are not "
                "defined for this loop; the others (Loss, GradNorm, Distance, UpdateSize, HessMaxEV, ...) are. Leave "
                "the per-sample quantities out at these steps, or compute the other rows without a gradient "
                "(torch.no_grad(), detach()) where the loss should not train through them."
            )
        if len(self._leading) != 1 or batch in self._leading:
            return None
        (rows,) = self._leading
        seen = (
            f"info['batch_size'] is {batch}, but every tensor the modules of this step's forward pass took and "
            f"returned has {rows} rows (leading dimension {rows}; none has {batch})"
        )
        error, why = self._batch_size_advice(batch, rows, seen)
        tensors = [t for call in self._all_calls for t in _flat_outputs((call.args, call.kwargs, call.output))
                   if t.dim() > 1]
        if tensors and all(t.shape[1] == batch for t in tensors):
            # as likely: the batch is where it should be, in a sequence-first layout
            why += (
                f" Or, since every tensor of more than one dimension has {batch} in its dimension 1, the model may "
                f"run sequence-first ([T, B, ...], T = {rows}). {_SEQUENCE_FIRST_FIX}"
            )
        return error, why

    @staticmethod
    def _batch_size_advice(batch: int, rows: int, seen: str) -> tuple[type, str]:
        """What a declared ``batch`` against ``rows`` in every tensor likely means (see :meth:`_wrong_batch_size`)."""
        if rows > batch and rows % batch == 0:
            k = rows // batch
            return BatchSizeMismatchError, (
                f"{seen}, {batch} x {k}: if each of the {batch} per-sample losses is the loss of {k} rows of the "
                f"model's input, call the model on them shaped [{batch}, {k}, ...], one sample per entry of the first "
                f"dimension (torch.stack([x1, x2], 1) for two views x1, x2 of the {batch} samples; x.reshape({batch}, "
                f"{k}, -1) only where a sample's {k} rows are next to each other, not for torch.cat([x1, x2])); if each row is a sample, pass 'batch_size': {rows} with "
                "one loss per row (where only some rows have a loss, such as the labelled rows of a semi-supervised "
                f"batch: give the others a loss of 0 and scale the rows so that their mean is the loss, rows * {rows} "
                "/ n for a mean over n labelled rows). If instead every loss reads rows that are no sample's own "
                "(a support set whose prototypes every query reads, shared negatives), per-sample gradients are not "
                "defined for this loop: leave the per-sample quantities out (Loss, GradNorm, HessMaxEV need none)."
            )
        if rows > batch:
            # (outside trial 25: a node-level GNN with the loss on 6 labelled nodes of 10, a TD critic called once on
            # T + 1 states for T losses: each declared the losses' rows, and was told that was likely wrong)
            return BatchSizeMismatchError, (
                f"{seen}: more rows than declared. If info['batch_size'] is not the number of rows of this batch, "
                "pass it (`'batch_size': len(targets)`). If it is the number of losses, and the model's call has rows "
                "that are not one loss's each: where only some rows have a loss (the labelled nodes of a graph, the "
                f"labelled rows of a semi-supervised batch), give every row a loss, 0 for the others, scaled so "
                f"that their mean is the loss (rows * {rows} / n for a mean over n labelled rows), with "
                f"'batch_size': {rows}; where a loss reads two rows of one call (a TD target from v(s_t) and "
                "v(s_t+1) of one call on T + 1 states), call the model once per role (model(s[:-1]), model(s[1:])), "
                "each on the batch's rows; where every loss reads rows that are no sample's own, per-sample "
                "gradients are not defined for this loop: leave the per-sample quantities out (Loss, GradNorm, "
                "HessMaxEV need none)."
            )
        return BatchSizeMismatchError, (
            f"{seen}: info['batch_size'] is likely wrong, e.g. the loader's nominal batch size on a short last batch. "
            "Pass the number of rows of this batch (`'batch_size': len(targets)`)."
        )

    # ---- where the rows go ---------------------------------------------------------------
    def _route_rows(self, calls: list[Call]) -> None:
        """The calls whose rows do not reach the model's outputs row for row climb (see
        :mod:`cockpit_like.backends.row_paths`): an expert that gets ``B`` tokens gathered by index has the
        batch's shape, but its row ``r`` belongs to whichever sample its token came from.

        Later calls first: the calls re-run row by row (fallbacks, climbed calls) keep the rows from their
        inputs to their outputs (their re-run checks it), so a walk from an earlier call jumps over them,
        and a call that climbs here (an expert) makes its target such a call before the walks from the
        calls before it (the layers before a mixture-of-experts block) reach it.
        """
        if not any(call.params and self._call_batch(call) > 1 for call in calls):
            return
        self._consumer_map(calls)
        self._climb_outside_reads(calls)
        roots = {id(ref()) for ref in self.tracer.roots}
        self._root_modules = roots
        ends: dict[int, dict[int, int | None]] = {}
        for call in calls:
            if id(call.module) in roots:
                for node, nr, state in self._output_rows(call):
                    ends.setdefault(id(node), {})[nr] = state[0] if state != ACCEPT else None
        self._paths = RowPaths(self._edges, ends, *self._loss_graph(ends))
        for call in calls:
            if self._keeps_rows(call):
                self._add_box(call)
        for index in reversed(range(len(calls))):
            call = calls[index]
            if not call.params:
                continue
            broken = self._broken_rows(call)
            if broken is None:
                continue
            if MIXES_ROWS in broken:  # no call's rows are the samples' (re-runs of one row cannot normalise)
                raise RowsNotSamplesError(
                    f"the outputs of {type(call.module).__name__} layer {self._module_name(call.module)} reach the "
                    f"model's outputs through {broken}: a normalisation over the batch in training mode, such as "
                    "F.batch_norm(x, ..., training=True) written by hand (as nn.BatchNorm in training mode does), "
                    "a layer or group norm over the batch dimension, or a matrix function of the rows (QR, an "
                    "inverse) makes every sample's gradient depend on the other samples, so per-sample quantities "
                    "are undefined (docs/your_model.md#limits). Normalise with running statistics (eval mode) or "
                    "per sample, or track only quantities without per-sample statistics (Loss, GradNorm, Distance, "
                    "UpdateSize, HessMaxEV)"
                )
            if type(call.module) is not nn.MultiheadAttention:
                self._paths.remove_box(id(call))  # its parameters move on: it is not re-run
            if self._paths.misplaced:
                outer = self._enclosing(calls, index)
                if outer is None:
                    self._misplaced(call, broken)
                    continue
                # misplaced rows climb where an enclosing call carries the batch (a table of C class embeddings
                # with C = B by chance, read as `img(x) @ txt(classes).T`: outside trial 15); where its re-run
                # cannot split the rows either (an RNN's h_n [layers, B, H] with layers = B), their error is raised
                self._misplaced_at[id(calls[outer])] = (call, broken)
            self._climb(calls, index, broken)

    def _climb_outside_reads(self, calls: list[Call]) -> None:
        """A parameter that the graph reads outside the calls that compute it (a tied output layer written
        ``h @ self.emb.weight.t()`` after ``self.emb(ids)``, a tied autoencoder's ``F.linear(h, self.enc.weight.t())``):
        those calls' rows miss that use. It moves to the smallest enclosing call, not a layer with a rule, that
        carries the batch and made every such read (by autograd's sequence numbers: a node made while a call
        ran belongs to it), whose re-run computes it through every use. Where none did, nothing moves (the
        step's gradient check then names the parameter)."""
        holders: dict[int, list[int]] = defaultdict(list)
        for index, call in enumerate(calls):
            for param in call.params:
                holders[id(param)].append(index)
        for key, indices in holders.items():
            readers = self._readers.get(key, ())
            if len(readers) <= len(indices):
                continue  # a read per call that computes it (or fewer: autocast's cached cast): nothing outside
            windows = [_window(calls[index]) for index in indices]
            outside = [
                node._sequence_nr() for node in readers
                if not any(low < node._sequence_nr() <= high for low, high in windows)
            ]
            if not outside:
                continue
            param = self._params[key]
            for outer in range(max(indices) + 1, len(calls)):
                candidate = calls[outer]
                low, high = _window(candidate)
                if (
                    rule_for(candidate.module) is not None
                    or not all(candidate.start <= calls[i].position for i in indices)
                    or not all(low < seq <= high for seq in outside)
                    or not self._carries_batch(candidate)
                ):
                    continue
                self._claim_nested(calls, outer, {key})
                if all(p is not param for p in candidate.params):
                    candidate.params = candidate.params + [param]
                candidate.climbed = True
                break

    def _misplaced(self, call: Call, where: str) -> None:
        """The error for a call whose rows end along another dimension of a model output the loss reads than
        that output's batch dimension (an RNN's ``h_n`` ``[layers, B, H]`` with ``layers`` a multiple of ``B``,
        penalised by the loss), where no enclosing call helps (its rows end there the same way)."""
        self._errors.append(self._misplaced_error(call, where))
        call.params = []

    def _misplaced_error(self, call: Call, where: str, names: list[str] | None = None) -> UncoveredParameterError:
        names = [self._param_name(p) for p in call.params] if names is None else names
        return (UncoveredParameterError(
            f"{type(call.module).__name__} layer {self._module_name(call.module)}: the rows of its outputs end along "
            f"another dimension of a model output that the loss reads than that output's batch dimension ({where}; "
            "the batch dimension of a model output is the first whose size is a multiple of the batch size), so "
            f"the cockpit cannot tell which of that output's rows are which sample's, nor the rows' gradients of "
            f"{names}. Return that output with the batch first (an RNN's hidden state: h_n.transpose(0, 1), "
            "[B, layers, H]), or compute what the loss reads of it inside the model, one value per row ([B]), "
            "or leave these parameters out of Cockpit(params)."
        ))

    def _loss_graph(self, ends: dict[int, dict]):
        """``(reads, feeds)`` from one walk of the step's loss graph (``losses``), made at the first question;
        ``(None, None)`` where no loss with a graph was given (every output may be read, every node may feed it).

        ``reads(node, output_nr)``: whether the loss reads that output of the model (an edge into it from a node
        of the loss's own graph, outside the model's). ``feeds(node)``: whether the loss depends on the node at
        all; what it does not depend on sends no gradient back, so rows may go anywhere there (outside trial 9:
        ProphetNet called with labels= returns its own loss, computed from the logits through a transpose and a
        view, which the user's loss does not read; the walk took that view for a reshape that splits the
        samples)."""
        roots = [t.grad_fn for t in self._losses if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not roots:
            return None, None
        graph: dict[str, Any] = {}

        def walk() -> dict[str, Any]:
            if not graph:
                read, nodes, stack = set(), {}, list(roots)
                while stack:
                    parent = stack.pop()
                    if id(parent) in nodes:
                        continue
                    nodes[id(parent)] = parent  # (kept: a freed node's id may be another's)
                    outside = id(parent) not in ends and id(parent) not in self._edges  # the loss's own graph
                    for child, child_nr in parent.next_functions:
                        if child is not None:
                            if outside:
                                read.add((id(child), child_nr))
                            stack.append(child)
                graph.update(read=read, nodes=nodes)
            return graph

        return (lambda node, nr: (id(node), nr) in walk()["read"]), (lambda node: id(node) in walk()["nodes"])

    def _keeps_rows(self, call: Call) -> bool:
        """Whether ``call`` takes its rows from its inputs to its outputs row for row for certain: it is re-run
        row by row (a fallback or a climbed call; the re-run reproduces the recorded outputs or fails), or it is
        ``nn.MultiheadAttention`` (rows along dimension 0, or 1 without ``batch_first``)."""
        if id(call.module) in self._root_modules:
            return False  # nothing enters the model from outside its own calls
        if type(call.module) is nn.MultiheadAttention:
            return True
        if not call.params or call.consumer is not None:
            return False
        return call.climbed or (rule_for(call.module) is None and type(call.module) not in RECOMPUTE_RULES)

    def _output_rows(self, call: Call) -> list[tuple[Any, int, Any]]:
        """``(node, output_nr, state)`` of ``call``'s outputs with gradients: ``(dimension, rows per sample)``
        of their rows, or ``ACCEPT`` (no rows)."""
        module, batch = call.module, self._call_batch(call)
        if call.consumer is not None:  # a shared output: its rows are those of the addition to the batch
            return [(call.consumer, 0, (0, 1))]
        if call.node is not None:
            output = call.output
            nr = output.output_nr if getattr(output, "grad_fn", None) is call.node else 0
            outputs = [(0, call.node, nr, output)]
        else:
            outputs = [(i, t.grad_fn, t.output_nr, t) for i, t in enumerate(_flat_outputs(call.output)) if t.grad_fn is not None]
        found = []
        for i, node, nr, t in outputs:
            if isinstance(module, nn.MultiheadAttention):
                dim = 0 if module.batch_first or i > 0 else 1  # [T, B, E] without batch_first; weights [B, T, S]
            elif rule_for(module) is not None:
                dim = 0
            else:
                dim = _batched(module, 0 if i == 0 else 1, t, batch)
            shape = tuple(t.shape)
            if dim is None or dim >= len(shape) or not shape[dim] or shape[dim] % batch:
                found.append((node, nr, ACCEPT))
            else:
                found.append((node, nr, (dim, shape[dim] // batch)))
        return found

    def _broken_rows(self, call: Call) -> str | None:
        """What keeps ``call``'s output rows from reaching the model's outputs row for row (``None``: nothing)."""
        if self._paths is None or self._call_batch(call) <= 1:
            return None
        return self._paths.broken(self._output_rows(call))

    def _add_box(self, call: Call) -> None:
        if not self._keeps_rows(call):
            return
        module, batch = call.module, self._call_batch(call)
        inputs = []
        slots = list(enumerate(call.args or ())) + list((call.kwargs or {}).items())
        for position, value in slots:
            for leaf in _flat_outputs(value):
                if not isinstance(leaf, torch.Tensor) or leaf.grad_fn is None:
                    continue
                if isinstance(module, nn.MultiheadAttention):
                    dim = 0 if module.batch_first else 1
                else:
                    dim = _batched(module, position, leaf, batch)
                inputs.append((leaf.grad_fn, leaf.output_nr, dim))
        self._paths.add_box(id(call), f"{type(module).__name__} layer {self._module_name(module)}", self._output_rows(call), inputs)

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
            edges: dict[int, list] = defaultdict(list)
            self._edges = edges
            starts = [node for call in calls for node in _call_nodes(call)]
            seen = {id(node) for node in starts}
            while starts:
                node = starts.pop()
                for position, (child, nr) in enumerate(node.next_functions):
                    if child is None:
                        continue
                    self._consumers[id(child)].append(node)
                    edges[id(child)].append((node, position, nr))
                    variable = getattr(child, "variable", None)  # an AccumulateGrad node: a parameter read here
                    if variable is not None and id(variable) in self._params:
                        self._readers[id(variable)].append(node)
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
        if not self.accumulate_passes:  # a use's sum of one pass is not the sum over the passes
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
        for adopted in self._assign([call], self._handled, route=False):
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
        if call.view_base is not None:  # the view's node, and the base's where an in-place op bypassed the view
            node, entries = next(iter(by_node.values()))
            base, nr, shape = call.view_base
            self._handles.append(node.register_prehook(partial(self._on_view_grads, call, entries)))
            self._handles.append(base.register_prehook(partial(self._on_base_grads, call, nr, shape)))
            return
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

    def _on_view_grads(self, call: Call, entries: list[tuple[int, int]], grad_outputs) -> None:
        call.view_fired = True
        self._on_grads(call, entries, grad_outputs)

    def _on_base_grads(self, call: Call, nr: int, shape, grad_outputs) -> None:
        """The gradient of an output that is a whole view of another tensor, taken at that tensor's node where
        the view's node did not run: an in-place operation after the call (``x += self.pos`` on ``nn.Linear``'s
        ``[B, T, D]`` output, ``nn.ReLU(inplace=True)``) replaced it in the graph, and the gradient that reaches
        the base is the one of the output's value as the call made it. Where the view's node ran, nothing."""
        grad = grad_outputs[nr]
        if call.view_fired or grad is None:
            return
        self._on_grads(call, [(0, 0)], (grad.reshape(shape),))

    def _on_grads(self, call: Call, entries: list[tuple[int, int]], grad_outputs) -> None:
        if self.accumulate_passes:  # summed over the backward passes; processed in finish()
            with self.tracer.pause():
                for nr, slot in entries:
                    grad = grad_outputs[nr]
                    if grad is None:
                        continue
                    key = (id(call), slot)  # the passes through each output: the block's passes, at least
                    self._arrivals[key] = self._arrivals.get(key, 0) + 1
                    self.passes = max(self.passes, self._arrivals[key])
                    if call.grads[slot] is None:
                        call.waiting -= 1
                        call.grads[slot] = grad.detach()
                    else:
                        call.grads[slot] = call.grads[slot] + grad.detach()
            return
        if call.waiting <= 0:
            if call.done and any(grad_outputs[nr] is not None for nr, _ in entries):
                self.repeated = True  # another backward pass through a call already processed
                for nr, slot in entries:  # the passes through each output: the block's passes, at least
                    if grad_outputs[nr] is not None:
                        key = (id(call), slot)
                        self._arrivals[key] = self._arrivals.get(key, 1) + 1
                        self.passes = max(self.passes, self._arrivals[key])
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
    def _without_scalar_outputs(self, call: Call) -> None:
        """Leave out of ``call``'s re-run its scalar outputs beside outputs of the batch (a mixture of experts'
        ``return logits, aux``) that the loss did not read (no gradient reached them): they carry no rows (outside
        trial 32: such a model stopped training whether the loss read ``aux`` or not). Where the loss reads one,
        every row's gradient goes through a number of the whole batch, and the rows' gradients cannot be told apart:
        :class:`~cockpit_like.backends.rerun.RowsNotReproducedError` (the step goes on without per-sample values,
        with a note)."""
        scalars = [slot for slot, t in enumerate(call.entries) if t.dim() == 0]
        if not scalars or len(scalars) == len(call.entries):
            return
        read = [slot for slot in scalars if call.grads[slot] is not None and bool(call.grads[slot].ne(0).any())]
        if read:
            raise RowsNotReproducedError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)} returns a scalar beside the "
                f"batch's outputs (output {call.want[read[0]]}: a number of the whole batch, such as a "
                "load-balancing loss) and the loss reads it, so every row's gradient goes through it and the rows' "
                "gradients cannot be told apart (per-sample values are defined for a loss that is a mean over the "
                "rows: track the auxiliary loss with cockpit.log, or leave it out of the loss at the tracked steps)"
            )
        keep = [slot for slot in range(len(call.entries)) if slot not in scalars]
        call.want = [call.want[slot] for slot in keep]
        call.entries = [call.entries[slot] for slot in keep]
        call.grads = [call.grads[slot] for slot in keep]

    def _grads(self, call: Call) -> list[torch.Tensor]:
        return [(t.zeros() if isinstance(t, Shell) else torch.zeros_like(t)) if g is None else g
                for t, g in zip(call.entries, call.grads)]  # fmt: skip

    def _process(self, call: Call) -> None:
        call.done, call.waiting = True, -1
        rule = rule_for(call.module)
        forms, half_sums = None, False
        if rule is not None and len(call.want) == 1 and call.want[0] == 0 and call.args:
            x, grad = call.args[0], self._grads(call)[0]
            if not call.flat and self._call_batch(call) == 1 and grad.dim() > 0 and grad.shape[0] != 1:
                # one row: the whole output is that row's, also where it has no batch dimension (shared by all
                # rows: T5's relative position bias; outside trial 14 saw T5 refused at batch 1 only)
                grad = grad.unsqueeze(0)
                x = x.unsqueeze(0) if isinstance(x, torch.Tensor) else x
            elif not call.flat:
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
                if forms is not None and sums_positions_in_half(call.module, x, grad):
                    half_sums = True  # (p.grad is no reference for these rows: outside trials 14 and 17)
        if forms is None:
            self._deferred.append(call)
            return
        self._deliver_forms(call, forms, half_sums)

    def _deliver_forms(self, call: Call, forms: dict, half_sums: bool = False) -> None:
        """Deliver a rule's ``{parameter name: form}`` for the parameters this call computes, then free the call
        (``half_sums``: autograd sums their gradients over the positions in half precision, the reducer is told)."""
        owned = {id(p) for p in call.params}
        named = self.tracer.named_params(call.module)  # a rule may name a parameter the layer lacks (bias=False)
        for name, form in forms.items():
            param = named.get(name)
            if param is not None and id(param) in owned:
                if half_sums and hasattr(self.reducer, "note_half_sum"):
                    self.reducer.note_half_sum(param)
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
        rows = int(form.batch)
        if self._rows_seen is None:
            self._rows_seen = (rows, self._param_name(param))
        elif rows != self._rows_seen[0]:
            # two layers read different dimensions as the batch (outside trial 12: nn.TransformerEncoderLayer
            # without batch_first fed [B, T, d] gave its layers T rows, others B; the sums crashed on the shapes)
            raise UncoveredParameterError(
                f"the per-sample gradients of {self._rows_seen[1]} have {self._rows_seen[0]} rows, those of "
                f"{self._param_name(param)} {rows}: the layers of the model do not agree on which dimension is the "
                "batch (an attention layer with batch_first=False fed [batch, time, features] reads dimension 1 as "
                "the batch: pass batch_first=True, or give it [time, batch, features]); leave these parameters out "
                "of Cockpit(params), or leave out the per-sample quantities."
            )
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
            raise RowsNotReproducedError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)} computes the per-sample "
                f"gradients of {names}, whose own layers cannot tell the rows apart (an output without batch "
                "dimension, e.g. a relative position bias shared by all rows, or tokens routed from every row), "
                "by re-running it row by row, but it draws random numbers in training mode "
                f"({random}): the re-run would use other dropout masks than the training step. To have them, set its dropout "
                "to 0 or call .eval() on it during the cockpit's steps, or leave these parameters out of "
                "Cockpit(params)."
            )
        if random is not None:
            raise RowsNotReproducedError(
                f"{type(call.module).__name__} layer {self._module_name(call.module)} has no per-layer rule, "
                "so its per-sample gradients are recomputed row by row, but it draws random numbers in "
                f"training mode ({random}): the recomputation would use other dropout masks than the "
                "training step. To have them, set its dropout to 0 (nn.TransformerEncoderLayer / DecoderLayer: "
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
        self._refuse_unsplittable(call)
        self._without_scalar_outputs(call)
        batch = self._batch(call)
        arguments = (call.module, call.params, call.args, call.kwargs, call.want, self._grads(call), batch, self.tracer)
        options = {"recorded": call.entries, "shared": call.consumer is not None, "state": call.state,
                   "autocast": call.autocast}
        budget = getattr(self.reducer, "budget_bytes", None)
        row_bytes = sum(p.numel() * max(4, p.element_size()) for p in call.params)
        if budget is not None and batch > 1 and batch * row_bytes > budget:
            # over the memory budget: each parameter's rows re-run a block at a time as the reducer takes them
            for param, lazy in zip(call.params, per_sample_grad_rows(*arguments, **options)):
                self._deliver(param, Lazy(lazy))
        else:
            try:
                grad_batches = per_sample_grads(*arguments, **options)
            except Exception as error:
                held = self._misplaced_at.get(id(call))
                if held is None:
                    raise
                inner, where = held
                raise self._misplaced_error(inner, where, [self._param_name(p) for p in call.params]) from error
            for param, grad_batch in zip(call.params, grad_batches):
                self._deliver(param, Dense(grad_batch))
        call.release()

    def _note_climbed_half_sums(self, call: Call) -> None:
        """A layer with a rule whose parameters climb keeps autograd's way of summing their gradient: where
        that sum runs over the call's positions in half precision (T5's relative position bias, an embedding
        of 32 buckets called on the ``q x k`` table, in fp16: ``p.grad`` off by up to 4x on a random
        direction, outside trial 17), the reducer is told, as for the rows the layer's own rule makes."""
        if rule_for(call.module) is None or not call.args or not call.params or not hasattr(self.reducer, "note_half_sum"):
            return
        x = call.args[0]
        # (a climbing call's output gradient is not kept: the parameters' precision is that of autograd's sum)
        precision = torch.empty(0, dtype=call.params[0].dtype)
        if isinstance(x, torch.Tensor) and sums_positions_in_half(call.module, x, precision):
            for param in call.params:
                self.reducer.note_half_sum(param)

    def _refuse_unsplittable(self, call: Call) -> None:
        """Calls whose rows the re-run cannot split (it splits each argument along its batch dimension)."""
        module = call.module
        ids = call.args[0] if call.args else (call.kwargs or {}).get("input")
        if isinstance(module, nn.EmbeddingBag) and isinstance(ids, torch.Tensor) and ids.dim() == 1:
            raise UncoveredParameterError(
                f"EmbeddingBag layer {self._module_name(module)} (mode={module.mode!r}, max_norm={module.max_norm}, "
                f"scale_grad_by_freq={module.scale_grad_by_freq}) was called with 1-D ids and offsets: its "
                "per-sample gradients need the row-by-row re-run in this configuration (the cockpit's own rule "
                "covers mode 'sum' and 'mean' without max_norm or scale_grad_by_freq), and the re-run cannot "
                "split bags of different lengths. Use mode 'sum' or 'mean' without max_norm or "
                "scale_grad_by_freq, or pass the ids as a 2-D tensor [batch, bag size] (pad short bags with "
                "padding_idx), or leave its weight out of Cockpit(params)."
            )

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
