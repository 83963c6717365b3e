"""The ``torch.func`` re-run: per-sample gradients of a recorded call by re-running it row by row.

For a module without a per-layer rule, the hook backend hands the recorded
call (inputs, output gradients) to :func:`per_sample_grads` (or, over the
memory budget, :func:`per_sample_grad_rows`, a block of rows at a time):
``functional_call`` + ``vmap`` of ``vjp``, one sample per row; a loop over
samples with ``torch.autograd.grad`` where ``vmap`` cannot run (recurrent
layers, routing). A sample is one row of the batch: every tensor argument
whose leading dimension is the batch size is split along it (``nn.RNNBase``
without ``batch_first``: along dimension 1, and its hidden state always along
dimension 1; ``_batch_dim``, ``_batched``).

Every re-run must reproduce the recorded outputs of the forward pass (a
key/value cache argument, filled by the call itself, is left out); if it does
not (state, a coupled batch), :class:`UncoveredParameterError` says so.

A re-run leaves the model as it was: it runs on copies of the re-run module's
buffers (all of them, its parametrizations' included) and of the parameters it
does not differentiate that are frozen, not the cockpit's or changed by forward,
and the user's tensors are bound again afterwards, untouched; torch's random
number generators and those the re-run can reach are put back
(:func:`_model_kept`). The buffers of its parametrizations (``spectral_norm``'s
power iteration vectors, updated in place by each read of the weight in
training mode), and the parameters a forward pass was seen changing
(a momentum encoder), are set, before each re-run, to what they were when the
recorded call (or the model's forward pass) began (``Call.state``, noted by the
tracer), so the re-run computes what the forward pass computed.

May import torch, :mod:`cockpit_like.backends.tracer`,
:mod:`cockpit_like.backends.per_sample`, :mod:`~cockpit_like.backends.module_rules` and
:mod:`~cockpit_like.backends.user_state` only; never
:mod:`~cockpit_like.backends.hooks` (which imports this module).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import sys
import warnings
import weakref

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from cockpit_like.backends.module_rules import BasePruningMethod, finite_parts
from cockpit_like.backends.per_sample import LazyRows
from cockpit_like.backends.tracer import ChangedStart, Shell, _flat_outputs, changed_in_forward, stateful_parts
from cockpit_like.backends.user_state import (
    held_modules, held_tensor_hooks, kept_generators, kept_module_attributes, rerunning,
)

__all__ = ["NonFiniteOutputsError", "RowsNotReproducedError", "UncoveredParameterError", "per_sample_grads",
           "per_sample_grad_rows"]


class UncoveredParameterError(RuntimeError):
    """A tracked parameter got no per-sample gradient from any backend."""


class NonFiniteOutputsError(UncoveredParameterError):
    """A re-run did not reproduce a forward pass whose outputs (or the re-run's) were not finite: nothing to check
    the per-sample gradients against. The step goes on without its per-sample values, with a note
    (:meth:`~cockpit_like.backends.step.StepExecution.exit`); the non-finite loss or gradient has its own warning."""


class RowsNotReproducedError(UncoveredParameterError):
    """A module re-run row by row would not (or did not) reproduce the training step's forward pass: random
    numbers drawn inside it, state it keeps across calls, a statistic over the batch computed inside it. Its
    per-sample gradients are undefined for this step, not the loop wrong: the step goes on without its per-sample
    values, with a note (:meth:`~cockpit_like.backends.step.StepExecution.exit`; since 2026-11-29: the training
    run stopped before, outside trial 20's hard-concrete gate and AlphaDropout)."""


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


def _argument_dims(module, args, kwargs, batch: int) -> list[int | None]:
    """The batch dimension (or ``None``) of every tensor in the arguments of a call of ``module``, also inside
    tuples, lists and dicts, in the order of :func:`~torch.utils._pytree.tree_flatten` over ``args`` then
    ``kwargs``: the tensors a re-run splits into rows."""
    slots = list(enumerate(args or ())) + list((kwargs or {}).items())
    return [_batched(module, position, leaf, batch) for position, value in slots for leaf in tree_flatten(value)[0]]


def rows_in_arguments(module, args, kwargs, batch: int) -> bool:
    """Whether some tensor argument of the call has the batch dimension: the rows reach a call only through
    its arguments, so a call without one (a parametrization computing a weight from its own parameters,
    ``weight_norm``'s ``[out, in]`` where ``out`` equals the batch size) computes the same outputs for every
    row, whatever their leading dimension, and cannot tell the rows' gradients apart."""
    return any(dim is not None for dim in _argument_dims(module, args, kwargs, batch))


def per_sample_grads(
    module, params, args, kwargs, want, grads, batch, tracer, recorded: list[torch.Tensor] | None = None,
    shared: bool = False, state: list | None = None, autocast: tuple | None = None,
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
    forward pass, which the re-run must reproduce (else an error says why not). ``state``: the buffers of
    the module's parametrizations when the call began (``Call.state``), which each re-run starts from;
    ``autocast``: the autocast the call ran under (``Call.autocast``), which each re-run runs under.
    The model's buffers and torch's random number generators are left as they were.
    """
    rerun = _Rerun(module, params, args, kwargs, want, grads, batch, tracer, shared, state, autocast)
    with _model_kept(module, rerun):
        results, _ = rerun.checked_rows(recorded, 0, batch)
    return results


def per_sample_grad_rows(
    module, params, args, kwargs, want, grads, batch, tracer, recorded: list[torch.Tensor] | None = None,
    shared: bool = False, state: list | None = None, autocast: tuple | None = None,
) -> list[LazyRows]:
    """:func:`per_sample_grads` a block of rows at a time: per parameter a
    :class:`~cockpit_like.backends.per_sample.LazyRows` whose ``make(start, stop)``
    re-runs rows ``start:stop`` for that parameter alone (each block's outputs
    checked against ``recorded`` once), so that no ``[B, *p.shape]`` exists when
    the reducer takes blocks under its budget. A parameter's blocks re-run the
    module's rows once each: ``len(params)`` re-runs of the batch in all."""
    rerun = _Rerun(module, params, args, kwargs, want, grads, batch, tracer, shared, state, autocast)
    checked: set[tuple[int, int]] = set()

    def maker(index: int):
        def make(start: int, stop: int) -> torch.Tensor:
            with _model_kept(module, rerun):
                if (start, stop) in checked:
                    results, _ = rerun.rows(start, stop, only=index)
                else:
                    results, _ = rerun.checked_rows(recorded, start, stop, only=index)
                    checked.add((start, stop))
            return results[0]

        return make

    return [LazyRows(batch, p.shape, maker(k), max(4, p.element_size())) for k, p in enumerate(params)]


#: per module, the positions (in the flattened arguments) of tensors whose leading dimension has the batch size
#: by coincidence and that a re-run passes whole (a ``[T, T]`` attention bias where ``T`` equals the batch size):
#: found where slicing them did not reproduce the forward pass (:meth:`_Rerun.checked_rows`), kept for later steps
_WHOLE_ARGUMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: how many other readings of the arguments a re-run that does not reproduce the forward pass tries
_READINGS = 8

#: the modules on which ``vmap`` failed once (an RNN, custom autograd, routing): later steps loop over the rows
#: at once, instead of trying ``vmap`` and failing again at every tracked step
_NO_VMAP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Rerun:
    """A module call prepared for re-running rows (:func:`per_sample_grads`)."""

    def __init__(self, module, params, args, kwargs, want, grads, batch, tracer, shared, state=None, autocast=None):
        names: dict[int, str] = {}
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
        self.module, self.params, self.tracer, self.batch = module, list(params), tracer, batch
        self.state = state or []
        self.autocast = autocast
        #: the user's buffers' and untracked parameters' ids -> the copies the re-runs run on (:func:`_model_kept`)
        self.copies: dict[int, torch.Tensor] = {}
        self.param_names = [names[id(p)] for p in params]
        args, kwargs = list(args or ()), dict(kwargs or {})
        # every tensor in the arguments, also inside tuples, lists and dicts (Llama's rotary (cos, sin))
        slots = [(i, value) for i, value in enumerate(args)] + list(kwargs.items())
        structure, values = [], []
        for position, value in slots:
            leaves, spec = tree_flatten(value)
            structure.append((len(leaves), spec))
            values += [leaf.detach() if isinstance(leaf, torch.Tensor) else _replayable(leaf) for leaf in leaves]
        dims = [None] * len(values) if shared else _argument_dims(module, args, kwargs, batch)
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
        whole = _WHOLE_ARGUMENTS.get(module)
        if whole and whole[0] == len(values) and len(whole[1]) < len(self.batched):
            self.batched = [k for k in self.batched if k not in whole[1]]
        # until vmap fails on this module once: then every block, at this step and later ones, takes the loop
        self._vmap = module not in _NO_VMAP
        self._whole = None  # the whole batch's outputs re-run, where the forward pass's were not kept

        def run(p: dict, rows: list) -> tuple:
            self.rewind()
            current = list(values)
            for k, row in zip(self.batched, rows):
                current[k] = row
            rebuilt, offset = [], 0
            for count, spec in structure:
                rebuilt.append(tree_unflatten(current[offset : offset + count], spec))
                offset += count
            call_args = rebuilt[: len(args)]
            call_kwargs = dict(zip(kwargs, rebuilt[len(args):]))
            # the precision the recorded call ran in (autocast), else none; no `.data` assignment (_DataKept)
            with _autocast_as(autocast), _DataKept(module):
                out = _flat_outputs(functional_call(module, p, tuple(call_args), call_kwargs))
            return tuple(out[i] for i in want)

        self.run = run

    def rewind(self) -> None:
        """The module's parametrizations' buffers as they were when the recorded call began, and its own tensor and
        ``None`` attributes and buffers (:func:`~cockpit_like.backends.tracer.start_references`): the re-run starts
        where the call started (what it changes is put back afterwards: :func:`_model_kept`)."""
        with torch.no_grad():
            for entry in self.state:
                if isinstance(entry, ChangedStart):  # parameters a forward pass changes: as it began
                    for key, start in entry.items():
                        copy = self.copies.get(key)
                        if copy is not None and not torch.equal(copy, start):
                            copy.copy_(start)
                    continue
                if len(entry) == 4:  # a reference: bound again where the call (or a re-run) rebound it
                    owner, name, value, kind = entry
                    value = self.copies.get(id(value), value)  # a buffer of the user's: its copy (_model_kept)
                    table = owner._buffers if kind == "buffer" else owner.__dict__
                    if kind == "attribute" and name in owner._buffers:
                        continue  # (now a buffer: the buffer's reference decides)
                    if table.get(name, value) is not value or name not in table:
                        table[name] = value
                    continue
                owner, name, value = entry
                current = owner._buffers.get(name)
                if isinstance(current, torch.Tensor) and current.shape == value.shape:
                    if not torch.equal(current, value):
                        current.copy_(value)
                else:
                    owner._buffers[name] = value.clone()

    def _own(self, param: torch.Tensor, live: bool) -> torch.Tensor:
        """What the re-run reads for one of its parameters: ``param`` itself (``live``: the loop over the rows) or
        detached (``vmap``); a copy of it where a forward pass was seen changing it (an EMA copy that requires
        gradients, read by no module call of its own: outside trial 33), so that the re-run's update lands there
        (:meth:`rewind` starts it from the pass's start)."""
        if not changed_in_forward(param):
            return param if live else param.detach()
        copy = param.detach().clone().requires_grad_(live and param.requires_grad)
        self.copies[id(param)] = copy
        return copy

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
        if _under_cached_parametrizations(self.module):  # (before running: a re-run would free the cached graph)
            raise RowsNotReproducedError(
                f"{type(self.module).__name__}: its parametrized weights come from "
                "torch.nn.utils.parametrize.cached(), computed once for the whole batch before the call, so a "
                "re-run of single rows cannot compute them again (outside trial 33: training stopped here); run the "
                "tracked steps' forward pass outside cached() for per-sample values"
            )
        with self.tracer.pause():
            if self._vmap:
                try:
                    detached = {name: self._own(p, False) for name, p in zip(self.param_names, self.params)}
                    with _batching_rules_told(self.module):
                        return _vmapped(self.run, detached, names, values, self.batched, self.dims, grads, self.out_dims)
                except UncoveredParameterError:
                    raise
                except Exception:  # noqa: BLE001 - vmap has no batching rule (RNNs, custom autograd, routing)
                    self._vmap = False
                    _NO_VMAP[self.module] = True
            live = {name: self._own(p, True) for name, p in zip(self.param_names, self.params)}
            params = [live[self.param_names[k]] for k in chosen]
            try:
                return _looped(self.run, live, params, values, self.batched, self.dims, grads, self.out_dims, count)
            except UncoveredParameterError:
                raise
            except Exception as error:  # noqa: BLE001 - the user's forward pass on a part of the batch
                coupled = self._columns_of_rows()
                if coupled is not None:
                    raise RowsNotReproducedError(
                        f"{type(self.module).__name__}: its output {coupled} has a dimension of the batch's size "
                        f"({self.batch}) besides the rows (an in-batch similarity such as `p @ z.T`, as BYOL, SimCLR "
                        "or CLIP compute it), and a re-run of single rows could not reproduce it: each row's output "
                        "depends on the other rows, so per-sample gradients are undefined (found on a model the "
                        f"team had not built; the re-run's error: {type(error).__name__}: {str(error)[:160]})"
                    ) from error
                raise UncoveredParameterError(self._failed_message(error)) from error

    def _columns_of_rows(self) -> int | None:
        """The index of an output whose gradient has another dimension of the batch's size beside its rows'
        (``[B, B]`` scores of every row against every row), else ``None``."""
        for index, (grad, dim) in enumerate(zip(self.grads, self.out_dims)):
            if self.batch > 1 and any(size == self.batch for d, size in enumerate(grad.shape) if d != dim):
                return index
        return None

    def checked_rows(self, recorded, start: int, stop: int, only: int | None = None):
        """:meth:`rows` checked against the forward pass (:meth:`check`). Where the re-run fails or does not
        reproduce it and several arguments have a dimension of the batch size, some of them may have it by
        coincidence (a ``[T, T]`` mask or bias where ``T`` equals the batch size, passed to every row whole):
        the re-run is tried with them whole, a few readings, and the first that reproduces the forward pass
        is used (and kept for the module's later calls); else the first reading's error is raised."""
        if recorded is not None:  # the forward pass's own values where they are still alive and unchanged
            recorded = [_alive(t) for t in recorded]
        try:
            self._rerun_whole(recorded)
            results, outputs = self.rows(start, stop, only)
            self.check(outputs, recorded, start, stop)
            return results, outputs
        except NonFiniteOutputsError:
            raise
        except UncoveredParameterError as error:
            first = error
        if recorded is None or len(self.batched) < 2:
            raise self._rows_related(first)
        batched, vmap = list(self.batched), self._vmap
        readings = (
            set(whole) for size in range(1, len(batched)) for whole in itertools.combinations(batched, size)
        )
        for whole in itertools.islice(readings, _READINGS):
            self.batched = [k for k in batched if k not in whole]
            self._vmap = vmap  # vmap may have failed on the sliced argument, not on the module
            try:
                results, outputs = self.rows(start, stop, only)
                self.check(outputs, recorded, start, stop)
            except UncoveredParameterError:
                continue
            _WHOLE_ARGUMENTS[self.module] = (len(self.values), frozenset(whole))
            if self._vmap:
                _NO_VMAP.pop(self.module, None)
            return results, outputs
        self.batched = batched
        raise self._rows_related(first)

    def _rows_related(self, error: UncoveredParameterError) -> UncoveredParameterError:
        """``error``, or where an argument is ``[B, B, ...]`` (a matrix that relates the batch's rows to each other:
        a node-level graph network's adjacency, attention over the batch) a :class:`RowsNotReproducedError`: the
        rows are not independent samples, per-sample gradients are undefined, the step goes on without them
        (outside trial 25: a GCN's ``A @ H`` stopped training with advice about a graph's ``batch`` vector)."""
        if isinstance(error, RowsNotReproducedError):
            return error
        # (a [B, B] argument beside the rows' own: one argument whose features equal the batch size by chance
        # stays the error)
        square = [list(v.shape) for v in self.values
                  if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] == v.shape[1] == self.batch]
        if not square or self.batch < 2 or len(self.values) < 2:
            return self._reads_other_rows(error) or error
        related = RowsNotReproducedError(
            f"{type(self.module).__name__} takes {square[0]}, a matrix over the batch's {self.batch} rows (an "
            "adjacency over a graph's nodes, attention across the batch): each row's output reads other rows, so "
            "the rows are not independent samples and their per-sample gradients are not defined (re-running the "
            f"module on single rows failed: {_head(error)}). Per-sample quantities need the "
            "samples as rows (a graph-level loss on pooled graphs, each graph its own row)"
        )
        related.__cause__ = error
        return related

    def _reads_other_rows(self, error: UncoveredParameterError) -> RowsNotReproducedError | None:
        """Where re-running single rows failed: whether the whole batch's outputs show that a row's output reads
        other rows of an argument (one backward pass of the whole batch's re-run from one row's outputs to its
        floating-point arguments, for up to three rows: a gradient outside the row is a dependence, never
        rounding), as a :class:`RowsNotReproducedError` (the step goes on without per-sample values, with a note;
        outside trial 35: manifold mixup with its permutation passed to ``forward`` stopped training), else
        ``None`` (no such argument, or the pass cannot tell)."""
        floating = {k for k in self.batched if self.values[k].is_floating_point()}
        if not floating or self.batch < 2 or _layout_hint(self.module):  # (a layout of the user's to fix: raised)
            return None
        try:
            found = self._rows_read(floating)
        except Exception:  # noqa: BLE001 - the pass cannot tell: the error stands
            return None
        if found is None:
            return None
        row, k, others = found
        shown = ", ".join(map(str, others[:4])) + (" ..." if len(others) > 4 else "")
        related = RowsNotReproducedError(
            f"{type(self.module).__name__}: the output of row {row} of the batch reads rows {shown} of its argument "
            f"of shape {list(self.values[k].shape)} (one backward pass of the whole batch from that row's outputs "
            "reached them): the rows are not independent samples (mixup or manifold mixup inside the model, h = lam "
            "* h + (1 - lam) * h[perm]; a statistic over the batch; attention or an adjacency across the batch), so "
            f"per-sample gradients are not defined (re-running single rows failed: {_head(error)}). Mix the inputs "
            "before the model (mixup of x and y) for per-sample values; the other quantities are stored"
        )
        related.__cause__ = error
        return related

    def _rows_read(self, floating: set[int]) -> tuple[int, int, list[int]] | None:
        """``(row, argument, other rows)`` for the first of up to three rows whose outputs, in the whole batch's
        re-run, have a gradient on other rows of a floating-point argument ``k in floating``, else ``None``."""
        with self.tracer.pause(), torch.enable_grad():
            rows = [self.values[k].detach().clone().requires_grad_(k in floating) for k in self.batched]
            inputs = [(k, row) for k, row in zip(self.batched, rows) if k in floating]
            params = {name: self._own(p, False) for name, p in zip(self.param_names, self.params)}
            outputs = [(o, d) for o, d in zip(self.run(params, rows), self.out_dims)
                       if isinstance(o, torch.Tensor) and o.requires_grad]  # fmt: skip
            for row in sorted({0, self.batch // 2, self.batch - 1}):
                seeds = []
                for output, dim in outputs:
                    seed = torch.zeros_like(output)
                    seed.narrow(dim, row, 1).fill_(1)
                    seeds.append(seed)
                grads = torch.autograd.grad([o for o, _ in outputs], [t for _, t in inputs], seeds,
                                            retain_graph=True, allow_unused=True)  # fmt: skip
                for (k, _), grad in zip(inputs, grads):
                    if grad is not None:
                        reach = grad.abs().movedim(self.dims[k], 0).reshape(self.batch, -1).sum(1)
                        others = [int(i) for i in reach.nonzero().flatten() if int(i) != row]
                        if others:
                            return row, k, others
        return None

    def _failed_message(self, error: Exception) -> str:
        """Why re-running the module on some rows failed, where its forward pass on the whole batch ran."""
        sliced = [list(self.values[k].shape) for k in self.batched]
        whole = [list(v.shape) for k, v in enumerate(self.values) if isinstance(v, torch.Tensor) and k not in self.batched]
        return (
            f"{type(self.module).__name__}: re-running it on single rows of the batch to get per-sample gradients "
            f"failed inside its forward pass ({type(error).__name__}: {error}), though the training step's forward "
            f"pass on the whole batch ran. The cockpit slices the arguments whose dimension of size {self.batch} "
            f"is the batch (shapes {sliced}) and passes the others whole ({whole}); a forward pass whose other "
            "arguments also hold the samples in another layout (the nodes of a batch of graphs with a `batch` "
            "vector, rows flattened with their positions) cannot run on one row that way; nor can a forward pass "
            "that changes one of its inputs in place (x.add_(b), x += b inside forward: the input the cockpit "
            "recorded is then not the one the call received; compute out of place, x = x + b). Put the per-sample "
            "layers in a module whose arguments carry the batch in their first dimension (the graph-level head "
            "after pooling), leave the other parameters out of Cockpit(params), or leave out the per-sample "
            "quantities."
        ) + (_INDEX_HINT if isinstance(error, IndexError) else "") + _parametrization_hint(self.module)

    def _rerun_whole(self, recorded) -> None:
        """The whole batch re-run once, where the forward pass's values were not kept (``recorded`` holds a
        :class:`~cockpit_like.backends.tracer.Shell`): before the rows, so that it starts from the state the rows'
        re-runs start from. At a module's first tracked step the state its forward pass changes has no start
        value yet, so each re-run moves it on; made after the rows, the whole batch's re-run read what they left
        (outside trial 33: a running variance updated with h.var(0), NaN on one row, made both NaN, the comparison
        passed and the step failed the gradient check with causes that did not apply)."""
        if self._whole is None and recorded is not None and any(isinstance(t, Shell) for t in recorded):
            with self.tracer.pause(), torch.no_grad():
                self._whole = self.run(
                    {name: self._own(p, False) for name, p in zip(self.param_names, self.params)},
                    [self.values[k] for k in self.batched],
                )

    def check(self, outputs: list[torch.Tensor], recorded: list[torch.Tensor] | None, start: int, stop: int) -> None:
        """The re-run's outputs of rows ``start:stop`` must be the forward pass's (``recorded``)."""
        if recorded is None:
            return
        if any(isinstance(t, Shell) for t in recorded):
            # the forward pass's values were not kept (Shell): the row-by-row re-run must agree with the re-run
            # of the whole batch made before the rows (checked_rows), i.e. the rows are independent (dropout is
            # refused before)
            # a shared output (leading 1) was recorded as its expansion over the rows
            recorded = [
                o.expand(t.shape) if o.shape != t.shape and o.dim() == t.dim() else o for o, t in zip(self._whole, recorded)
            ]
        if not (start == 0 and stop == self.batch):
            recorded = [o.narrow(d, start, stop - start) for o, d in zip(recorded, self.out_dims)]
        if not _same_outputs(outputs, recorded, half=self.autocast is not None):
            nonfinite = _nonfinite_count(recorded)
            if nonfinite:
                raise NonFiniteOutputsError(
                    f"the outputs of {type(self.module).__name__} were not finite ({nonfinite} entries inf or NaN in "
                    "the training step's forward pass): its per-sample gradients come from re-running it row by "
                    "row, and a re-run of non-finite values (an overflow rounds otherwise row by row than in the "
                    "batch) cannot be checked against the forward pass"
                )
            rerun_nonfinite = _nonfinite_count(outputs)
            if rerun_nonfinite:
                # finite in the batch, not on single rows: a statistic over the rows (h.var(0) of one row is NaN)
                raise NonFiniteOutputsError(
                    f"re-running {type(self.module).__name__} row by row gave {rerun_nonfinite} entries inf "
                    "or NaN where the training step's forward pass on the batch was finite: its rows depend on each "
                    "other (a statistic over the batch, such as x.var(0) or x.std(0), is NaN or inf for one row), "
                    "so its per-sample gradients are undefined"
                )
            layout = _layout_hint(self.module)  # the batch in another dimension than the layer reads: the user's to fix
            raise (UncoveredParameterError if layout else RowsNotReproducedError)(
                f"{type(self.module).__name__}: re-running it row by row to get per-sample gradients did not "
                "reproduce the outputs of the training step's forward pass, so its rows are not independent or "
                "its forward pass depends on state; to have them, remove what makes the difference (a key/value "
                "cache filled by earlier forward passes: pass "
                "use_cache=False while training; random numbers: set dropout and drop-path (stochastic depth) rates to 0 "
                "or call .eval(), and where the forward pass draws in eval mode too (random masking: ViTMAE's), pass "
                "the randomness as an argument (ViTMAE: noise=); a loss or statistic over the whole batch computed "
                "inside it; rows mixed by state set around the call, which the re-run does not see: manifold mixup's "
                "permutation set on the model before the forward pass and cleared after it, whose rows depend on "
                "other rows: mix the inputs before the model instead)." + layout + _parametrization_hint(self.module)
            )


_DATA = torch._C.TensorBase.data  # the `.data` property, whose setter a TorchFunctionMode sees as its `__set__`


class _DataKept(TorchFunctionMode):
    """No tensor's ``.data`` is replaced during a re-run of ``module``.

    A forward pass that converts a submodule (``self.classifier = self.classifier.to(self.dtype)``, as Hugging
    Face's SwitchTransformers router does: ``Module.to`` assigns each parameter's ``.data``) or assigns
    ``param.data = ...`` itself crashes the process inside ``vmap(vjp(...))`` where the tensor is one of the
    re-run's constant parameters (a segmentation fault in the next operation that reads it), and torch.func
    refuses it where the tensor is a variable. An assignment that changes nothing (the tensor itself, as
    ``Module.to`` assigns where the dtype and device are already right, or an equal tensor of the same dtype,
    device and shape) is skipped, so the re-run computes what the forward pass computed; any other raises
    :class:`RowsNotReproducedError` naming the submodule (the step goes on without per-sample values, with a
    note; training stopped before outside trial 33). The check is one identity test per operation."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", "") == "__set__":
            tensor, value = args[0], args[1]
            if value is tensor or _equal(tensor, value):
                return None
            # (before the assignment: nothing changed) the step goes on without per-sample values, with a note
            # (outside trial 33: MoCo's `param_k.data = ...` momentum update stopped training at step 0)
            raise RowsNotReproducedError(_data_message(self.module))
        return func(*args, **(kwargs or {}))


def _equal(tensor, value) -> bool:
    """``value`` is ``tensor``'s dtype, device, shape and values (``False`` where that cannot be told, as
    for a value that differs by row inside ``vmap``)."""
    if not isinstance(value, torch.Tensor) or (value.dtype, value.device, value.shape) != (
        tensor.dtype, tensor.device, tensor.shape
    ):
        return False
    try:
        return bool(torch.equal(tensor, value))
    except Exception:  # noqa: BLE001 - a batched value (data-dependent control flow under vmap)
        return False


def _data_message(module: nn.Module) -> str:
    """Why a re-run of ``module`` was refused: a ``.data`` assignment, in the submodule whose forward pass
    made it (the innermost ``self`` on the stack that is part of ``module``; looked up on this error only)."""
    names = {id(child): name for name, child in module.named_modules()}
    where = ""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            name = names[id(owner)]
            where = f" (in {'itself' if not name else repr(name)}, a {type(owner).__name__})"
            break
        frame = frame.f_back
    return (
        f"{type(module).__name__}: its forward pass replaces a tensor's `.data`{where}, as `Module.to`, "
        "`.float()` or `.half()` called inside a forward pass does (`self.layer = self.layer.to(dtype)`) where "
        "the parameters change dtype or device, or as `param.data = ...` does. The cockpit gets per-sample "
        "gradients of this module by re-running it row by row with torch.func, which cannot run such an "
        "assignment (the process would crash). Convert the module once before training (`model.to(dtype)`, "
        "or the submodule to the dtype its forward pass asks for) so that the assignment changes nothing, "
        "move the assignment out of the forward pass, leave this module's parameters out of "
        "Cockpit(params), or leave out the per-sample quantities."
    )


#: torch.func's warning where ``vmap`` has no batching rule for an operation (it loops over the rows there)
_NO_BATCHING_RULE = re.compile(r"There is a performance drop because we have not yet implemented the batching rule for ([\w:.]+?)\.? ")
#: the operations whose missing batching rule the cockpit has told of (once per process)
_TOLD: set[str] = set()


@contextlib.contextmanager
def _batching_rules_told(module: nn.Module):
    """torch.func's "performance drop ... batching rule for aten::op" warnings of a ``vmap`` re-run, told once
    per operation and process in the cockpit's words: they concern the cockpit's own re-run (exact either way,
    only slower), and the cockpit's steps reset the warnings registry, so torch's own message came back at every
    tracked step (an LSTM fed a ``pack_padded_sequence``). Every other warning is passed on as it was."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    finally:
        _tell(caught, module)


def _tell(caught: list, module: nn.Module) -> None:
    """The warnings ``caught`` in a re-run of ``module``: see :func:`_batching_rules_told`."""
    for warning in caught:
        found = _NO_BATCHING_RULE.search(str(warning.message)) if issubclass(warning.category, UserWarning) else None
        if found is None:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno, source=warning.source)
            continue
        operation = found.group(1)
        if operation in _TOLD:
            continue
        _TOLD.add(operation)
        warnings.warn(
            f"[cockpit_like] {type(module).__name__}: the cockpit's per-row re-run (torch.func vmap) runs {operation}, "
            "which has no batching rule in torch.func (torch.func loops over the rows there, or the cockpit re-runs "
            "the module row by row): slower, the per-sample gradients are the same. Told once per operation "
            "(torch.func's own 'performance drop' warning is not repeated at every tracked step).",
            UserWarning,
            stacklevel=2,
        )


def _under_cached_parametrizations(module: nn.Module) -> bool:
    """Whether ``torch.nn.utils.parametrize.cached()`` is on and ``module`` holds parametrized tensors."""
    from torch.nn.utils import parametrize

    return bool(getattr(parametrize, "_cache_enabled", 0)) and any(
        parametrize.is_parametrized(owner) for owner in module.modules()
    )


def _autocast_as(state: tuple | None):
    """``torch.autocast`` as a recorded call ran under it (``(device type, dtype)``), or nothing."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(state[0], dtype=state[1])


@contextlib.contextmanager
def _model_kept(module: nn.Module, rerun: "_Rerun | None" = None):
    """Re-runs of ``module`` inside leave the user's run as it was. They run on copies: every buffer of
    ``module`` (its parametrizations' included, and those of modules it holds unregistered: a mean teacher in a
    plain list) and every parameter :func:`_copied_parameter` names (frozen, not the cockpit's, or changed by a
    forward pass: a momentum encoder or mean teacher that ``forward`` updates in place, as ALBEF's and BLIP's do;
    a frozen base layer costs one copy of its weights per re-run) is replaced by a copy for the re-runs and the user's own tensor is bound again afterwards,
    untouched: neither its values nor its version counter change (outside trial 32: a momentum encoder updated
    again by each re-run ended 0.015-0.066 off; a parametrization's running buffer written back in place made
    the step's graph, which saved it, fail at TIC's next pass). A buffer a forward pass replaces is put back
    too, and the states of torch's random number generators (CPU, and the CUDA devices of the module's
    tensors) and those the module holds or reads (:func:`~cockpit_like.backends.user_state.kept_generators`)."""
    differentiated = {id(p) for p in (rerun.params if rerun is not None else ())}
    tracked = getattr(getattr(rerun, "tracer", None), "_tracked", None)  # the cockpit's parameters (ids)
    copies: dict[int, torch.Tensor] = {}  # the user's tensor's id -> its copy (a tensor held twice: one copy)
    swapped = []  # (table, name, the user's tensor)
    with torch.no_grad():
        for owner in held_modules(module):
            for table, parameters in ((owner._buffers, False), (owner._parameters, True)):
                for name, value in table.items():
                    if not isinstance(value, torch.Tensor) or (
                        parameters and not _copied_parameter(value, differentiated, tracked)
                    ):
                        continue
                    if id(value) not in copies:
                        copy = value.detach().clone()
                        if isinstance(value, nn.Parameter):
                            copy = nn.Parameter(copy, requires_grad=False)
                        copies[id(value)] = copy
                    swapped.append((table, name, value))
    # buffers registered as None (a state a forward pass fills): None again afterwards
    empty = [(owner, name) for owner in module.modules() for name, value in owner._buffers.items() if value is None]
    # ``prune``'s forward pre-hook sets the computed ``weight`` as a plain attribute: the re-run's goes, the user's stays
    computed = [
        (owner, hook._tensor_name, owner.__dict__[hook._tensor_name])
        for owner in module.modules() if owner._forward_pre_hooks
        for hook in owner._forward_pre_hooks.values()
        if isinstance(hook, BasePruningMethod) and hook._tensor_name in owner.__dict__
    ]  # fmt: skip
    # tensors a forward pass keeps as plain attributes (a recurrent state, ``self.state = h``): a re-run's would be
    # its rows' (under vmap, a tensor escaped from it, which fails at the user's next read): the user's stay
    attributes = [
        (owner, name, value) for owner in module.modules() for name, value in list(owner.__dict__.items())
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    ]  # fmt: skip
    devices = sorted({t.device.index or 0 for t in [*module.parameters(), *module.buffers()] if t.device.type == "cuda"})
    for table, name, value in swapped:
        table[name] = copies[id(value)]
    if rerun is not None:
        rerun.copies = copies
    try:
        with torch.random.fork_rng(devices=devices), kept_generators(module, rerun.values if rerun else ()), \
                rerunning(), kept_module_attributes(module):
            yield
    finally:
        if rerun is not None:
            rerun.copies = {}
        for owner, name in empty:
            owner._buffers[name] = None
        for owner, name, value in attributes:
            owner.__dict__[name] = value
        for owner, name, value in computed:
            owner.__dict__[name] = value
        for table, name, value in swapped:
            table[name] = value


def _copied_parameter(param: torch.Tensor, differentiated: set[int], tracked: set[int] | None) -> bool:
    """Whether a re-run reads a copy of ``param`` (:func:`_model_kept`): not where the re-run differentiates it
    (:meth:`_Rerun._own` decides there), but where it is frozen, not the cockpit's (``tracked``: the ids of its
    parameters), or seen changing in a forward pass (an EMA copy that timm's ``ModelEmaV2`` or torch's
    ``AveragedModel`` leave requiring gradients: outside trial 33)."""
    if id(param) in differentiated:
        return False
    return not param.requires_grad or (tracked is not None and id(param) not in tracked) or changed_in_forward(param)


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
        with torch.enable_grad(), held_tensor_hooks(params):
            out = run(live, rows)
            results = torch.autograd.grad(out, params, cotangents, allow_unused=True)
        for k, (p, g) in enumerate(zip(params, results)):
            per_param[k].append(torch.zeros_like(p) if g is None else g.detach())
        for k, o in enumerate(out):
            per_output[k].append(o.detach())
    outputs = [torch.cat(rows, d) for rows, d in zip(per_output, out_dims)]
    return [torch.stack(rows) for rows in per_param], outputs


#: why a re-run on single rows can index out of range: the forward pass picks rows of the batch by index
def _head(error: Exception) -> str:
    """The first clause of a failed re-run's message (up to "though the training step's forward pass ran")."""
    return str(error).split(" though ")[0].rstrip(", ")


_INDEX_HINT = (
    " An index out of range on one row often means the forward pass picks rows of the batch by index (mixup or "
    "manifold mixup inside the model, h = lam * h + (1 - lam) * h[perm]): a row's output then depends on other "
    "rows, and its per-sample gradient is undefined; mix the inputs before the model (mixup of x and y), or leave "
    "out the per-sample quantities."
)


def _submodules_where(module: nn.Module, chosen, describe=lambda child: type(child).__name__) -> list[str]:
    """``"name (what)"`` of the modules in ``module`` (itself included) that ``chosen`` picks."""
    return [f"{name or 'itself'} ({describe(child)})" for name, child in module.named_modules() if chosen(child)]


def _layout_hint(module: nn.Module) -> str:
    """A sentence naming attention layers of ``module`` that read dimension 1 as the batch, or ``""``."""
    attention = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    found = _submodules_where(module, lambda child: isinstance(child, attention) and not getattr(child, "batch_first", True))
    if not found:
        return ""
    return (
        f" Its attention layers {'; '.join(found)} have batch_first=False: they read dimension 1 of their inputs as "
        "the batch; fed [batch, time, features] they attend across the samples of the batch. Pass "
        "batch_first=True, or give them [time, batch, features]."
    )


def _parametrization_hint(module: nn.Module) -> str:
    """A sentence naming ``module``'s parametrizations, the likely cause of a re-run that differs, or ``""``."""
    from torch.nn.utils.parametrize import ParametrizationList

    found = _submodules_where(module, lambda child: isinstance(child, ParametrizationList),
                              lambda child: ", ".join(type(p).__name__ for p in child))
    if not found:
        return ""
    stateful = " with state (buffers: " + ", ".join(
        f"{type(part).__name__}: {', '.join(part._buffers)}" for part in stateful_parts(module)
    ) + ")" if stateful_parts(module) else ""
    return (
        f" It has parametrizations (torch.nn.utils.parametrize) at {'; '.join(found)}{stateful}: a parametrization "
        "that updates its state whenever the parametrized tensor is read (as spectral_norm's power iteration "
        "does in training mode), or that reads it outside this call, makes a re-run compute another tensor. "
        "The cockpit re-runs from the state the call began with; a parametrization whose forward depends on "
        "anything else (random numbers, a counter) cannot be re-run: compute the tensor once per step "
        "outside the module, or leave its parameters out of Cockpit(params)."
    )


def _replayable(value):
    """An argument as the re-run may see it: a key/value cache (Hugging Face's ``Cache``, filled by this
    very call) is left out, since re-running would append to it; the output check catches the rest."""
    if hasattr(value, "get_seq_length") and hasattr(value, "update"):
        return None
    return value


def _nonfinite_count(tensors: list[torch.Tensor]) -> int:
    """The number of inf or NaN entries in the floating-point tensors of ``tensors``."""
    return sum(
        int((~torch.isfinite(t.detach())).sum()) for t in tensors
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )  # fmt: skip


def _alive(recorded):
    """A recorded output's values: a :class:`~cockpit_like.backends.tracer.Shell`'s tensor where it is still alive and
    unwritten (:meth:`~cockpit_like.backends.tracer.Shell.values`), else the entry as it is. Compared with the
    forward pass's own values, a re-run that reads state its forward pass changed is seen at the first tracked step
    (outside trial 33: a counter buffer read as 2, 3, ... by the rows' re-runs and 1 by the forward pass reloaded a
    teacher every other row, the whole batch's re-run as well, so they agreed with each other but not with it)."""
    if isinstance(recorded, Shell):
        values = recorded.values()
        return recorded if values is None else values
    return recorded


def _same_outputs(recomputed: list[torch.Tensor], recorded: list[torch.Tensor], half: bool = False) -> bool:
    """Equal up to rounding: the largest difference within ``tolerance * (1 + largest |value|)``, with a
    tolerance by precision (a re-run of a whole stack row by row rounds differently from the batch; ``half``:
    the call ran under autocast, which computes in half precision whatever dtype it returns)."""
    for new, old in zip(recomputed, recorded):
        old = old.detach()
        if new.shape != old.shape:
            return False
        new = new.detach().to(old.dtype)
        parts = finite_parts(new, old)  # a non-finite step (a NaN row in the batch): the same entries non-finite
        if parts is None:
            return False
        new, old = parts
        if not old.numel():
            continue
        tolerance = 2e-2 if half else {torch.float64: 1e-7, torch.float32: 1e-3}.get(old.dtype, 2e-2)
        scale = 1 + float(old.abs().max())
        if not float((new - old).abs().max()) <= tolerance * scale:  # a NaN where the step had a number fails too
            return False
    return True
