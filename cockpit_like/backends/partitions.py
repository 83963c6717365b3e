"""The optimizer step as partitions of its rows, merged by one mechanism.

A tracked step is one *optimizer* step. Its rows may come from several
backward passes: the micro-batches of gradient accumulation, on each rank of
a data-parallel job (DDP, FSDP). Each backward pass is a *partition*:

- during its backward pass the per-sample statistics see the partition as a
  plain mean-loss pass over its own ``B_p`` rows (the reducer rescales the
  per-row contributions by ``row_scale``: ``K`` for ``K`` micro-batches whose
  losses are divided by ``K``, ``1 / S`` under a ``GradScaler`` of scale
  ``S``; see :class:`~cockpit_like.backends.per_sample.PerSampleReducer`);
- nothing per sample survives its backward pass except the statistics'
  states; statistics whose result needs the step's gradient (the "synced"
  forms of :meth:`~cockpit_like.backends.per_sample.PerSampleStat.for_ranks`:
  the gradient tests' row sums, Alpha's slopes) keep compact per-sample
  factors and finish once the step's gradient is complete;
- :class:`Reduction` merges the partitions' results: every statistic says
  how with its ``across_ranks(result, reduction)`` method (a sum, a
  concatenation of per-sample values, a maximum, a row-weighted mean), first
  over this process's partitions, then, under ``torch.distributed``, over the
  ranks in one flattened all-reduce
  (:mod:`cockpit_like.backends.distributed`).

One backward pass in one process is the identity of all this: the cockpit
then reads the results as they are (no merge, no copy).

May import torch and :mod:`cockpit_like.backends`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "Reduction",
    "Partition",
    "StepPartitions",
    "MEAN_FIELDS",
    "StepGradients",
    "step_grad",
    "step_memo",
    "is_dtensor",
    "whole",
    "PartitionError",
    "grad_scale",
    "loss_scale",
    "micro_batches_of",
]

#: BackPACK savefields whose buffers are linear in the (mean) loss: the step's buffer is the
#: row-weighted mean of the partitions' buffers (curvature diagonals, Kronecker factors)
MEAN_FIELDS = frozenset({"diag_h", "diag_ggn_exact", "diag_ggn_mc", "kfac", "kflr", "kfra"})


class PartitionError(RuntimeError):
    """The backward passes of one optimizer step do not fit together (see the message)."""


class _Part:
    __slots__ = ("kind", "tensor", "value")

    def __init__(self, kind: str, tensor: torch.Tensor):
        self.kind, self.tensor, self.value = kind, tensor, None


class Reduction:
    """One merge of a step's results: parts register here, :meth:`run` merges them all.

    ``sum(t)``, ``cat(t)`` (concatenated along the first dimension, partitions
    in order, then ranks in order) and ``max(t)`` return a part whose
    ``value`` is set by :meth:`run` (in ``t``'s dtype and device); ``mean(t)``
    returns a function of the row-weighted mean ``sum_p (B_p / B) t_p``.

    Each partition registers its parts in the same order (:meth:`partition`
    selects the one registering); parts registered :meth:`for_process`
    belong to the whole process (a step need computed once, after every
    backward pass). Under ``torch.distributed`` (``ranks``) the merged parts of
    every rank travel in one float64 all-reduce.

    Attributes:
        local_batch: the rows ``B_p`` of the partition registering (the
            process's rows in :meth:`for_process`).
        batch: the step's rows ``B`` over every partition and rank.
        world: the number of ranks (1 in one process).
    """

    def __init__(self, rows: list[int], batch: int, ranks=None, step: int = 0, device=None):
        self.rows = list(rows)
        self.batch = batch
        self.ranks = ranks
        self.world = 1 if ranks is None else ranks.world
        self.local_batch = self.rows[0]
        self._step, self._device = step, device
        self._slots: list[list[_Part]] = []
        self._process: list[_Part] = []
        self._current: int | None = 0
        self._count = [0] * len(self.rows)
        #: lists of Python objects (string sample ids) concatenated in partition order, never across ranks
        self._objects: list[list[_Part]] = []
        self._object_count = [0] * len(self.rows)

    @property
    def parts(self) -> str:
        """What the step is split into, for an error message: ranks, micro-batches, or both."""
        if self.ranks is None:
            return "micro-batches (info['micro_batches'] or several backward passes in one step)"
        if len(self.rows) > 1:
            return "micro-batches on ranks under DistributedDataParallel"
        return "ranks under DistributedDataParallel"

    # ---- registration ----------------------------------------------------------------------
    def partition(self, index: int) -> Reduction:
        """Parts registered next belong to partition ``index`` (``local_batch`` is its rows)."""
        self._current, self.local_batch = index, self.rows[index]
        return self

    def for_process(self) -> Reduction:
        """Parts registered next belong to the whole process (``local_batch``: its rows)."""
        self._current, self.local_batch = None, sum(self.rows)
        return self

    def _add(self, kind: str, tensor) -> _Part:
        part = _Part(kind, torch.as_tensor(tensor).detach())
        if self._current is None:
            self._process.append(part)
            return part
        slot = self._count[self._current]
        self._count[self._current] += 1
        if self._current == 0:
            self._slots.append([part])
        elif slot >= len(self._slots) or self._slots[slot][0].kind != kind:
            raise PartitionError(
                f"cockpit step {self._step}: micro-batch {self._current} produced other per-step results than "
                "micro-batch 0 (a statistic or parameter present in one backward pass and not in another). "
                "Every micro-batch of an accumulated step must use the same parameters and quantities."
            )
        else:
            self._slots[slot].append(part)
        return part

    def sum(self, tensor) -> _Part:
        return self._add("sum", tensor)

    def cat(self, tensor) -> _Part:
        return self._add("cat", tensor)

    def max(self, tensor) -> _Part:
        return self._add("max", tensor)

    def cat_objects(self, items: list) -> _Part:
        """A list of Python objects (string ids) concatenated over this process's partitions, in order.

        Objects do not travel between ranks: under ``torch.distributed`` this raises (pass integer ids,
        which :meth:`cat` merges across ranks)."""
        if self.ranks is not None:
            raise PartitionError(
                f"cockpit step {self._step}: string info['sample_ids'] cannot be gathered across ranks; pass integer "
                "ids (e.g. the dataset indices, a 1-D int tensor) under torch.distributed"
            )
        part = _Part("objects", torch.empty(0))
        part.value = list(items)
        index = 0 if self._current is None else self._current
        slot = self._object_count[index]
        self._object_count[index] += 1
        if index == 0:
            self._objects.append([part])
        elif slot >= len(self._objects):
            raise PartitionError(
                f"cockpit step {self._step}: micro-batch {index} passed info['sample_ids'] and micro-batch 0 did not; "
                "pass sample ids with every micro-batch of a step or with none"
            )
        else:
            self._objects[slot].append(part)
        return part

    def mean(self, tensor) -> Callable[[], torch.Tensor]:
        """The row-weighted mean ``sum_p (B_p / B) t_p`` (a mean-loss quantity of the whole step)."""
        part = self.sum(tensor * self.local_batch)
        return lambda: part.value / self.batch

    # ---- the merge ---------------------------------------------------------------------------
    def run(self) -> None:
        """Merge the partitions' parts in this process, then (under ``torch.distributed``) across ranks."""
        if any(count != len(self._slots) for count in self._count[1:]):
            raise PartitionError(
                f"cockpit step {self._step}: the micro-batches produced different numbers of per-step results "
                f"({[len(self._slots)] + self._count[1:]}); every micro-batch must use the same parameters"
            )
        for slot in self._objects:
            merged_objects = [item for part in slot for item in part.value]
            for part in slot:
                part.value = merged_objects
        slots = [(slot[0].kind, _merge_local(slot), slot) for slot in self._slots]
        slots += [(part.kind, part.tensor, [part]) for part in self._process]
        if self.ranks is not None:
            merged = self._across_ranks([(kind, value) for kind, value, _ in slots])
        else:
            merged = [value for _, value, _ in slots]
        for (_, _, parts), value in zip(slots, merged):
            for part in parts:
                part.value = value.to(dtype=part.tensor.dtype, device=part.tensor.device)

    def _across_ranks(self, slots: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        if not slots:
            return []
        world, rank = self.world, self.ranks.rank
        sizes = [value.numel() * (1 if kind == "sum" else world) for kind, value in slots]
        buffer = torch.zeros(sum(sizes), dtype=torch.float64, device=self._device)
        offset = 0
        for (kind, value), size in zip(slots, sizes):
            flat = value.reshape(-1).to(device=self._device, dtype=torch.float64)
            start = offset if kind == "sum" else offset + rank * flat.numel()
            buffer[start : start + flat.numel()] = flat
            offset += size
        self.ranks._all_reduce(buffer, self._step, "statistics")
        merged, offset = [], 0
        for (kind, like), size in zip(slots, sizes):
            chunk = buffer[offset : offset + size]
            if kind == "sum":
                value = chunk.view(like.shape)
            else:
                slots_of = chunk.view(world, *like.shape)
                if kind == "max":
                    value = slots_of.amax(0)
                else:
                    value = slots_of.reshape(world * like.shape[0], *like.shape[1:]) if like.dim() else slots_of
            merged.append(value)
            offset += size
        return merged


def _merge_local(parts: list[_Part]) -> torch.Tensor:
    """One slot's parts of this process's partitions, merged (the identity for one partition)."""
    if len(parts) == 1:
        return parts[0].tensor
    kind = parts[0].kind
    tensors = [part.tensor for part in parts]
    if kind == "sum":
        wide = torch.float64 if tensors[0].is_floating_point() else tensors[0].dtype
        total = tensors[0].to(wide).clone()
        for tensor in tensors[1:]:
            total.add_(tensor.to(wide))
        return total
    if kind == "max":
        return torch.stack(tensors).amax(0)
    if tensors[0].dim() == 0:
        return torch.stack(tensors)
    return torch.cat(tensors)


class Partition:
    """What one backward pass of a step leaves for the step's end.

    Attributes:
        rows: its rows ``B_p``.
        finish: ``() -> {statistic or need: result}``, called once the step's gradient is complete.
        fields: ``{(parameter index, savefield): buffer}`` of BackPACK buffers linear in the mean loss.
        info: its ``info`` dict (``loss``, ``individual_losses``).
    """

    __slots__ = ("rows", "finish", "fields", "info", "factor", "left_out", "rows_lost", "drop_rows")

    def __init__(self, rows: int, finish: Callable[[], dict], fields: dict, info: dict):
        self.rows, self.finish, self.fields, self.info = rows, finish, fields, info
        #: the factor between the root it propagated and its ``info["loss"]`` (None: not seen)
        self.factor: float | None = None
        #: the quantities this pass left out of the step (their per-sample statistics could not be had)
        self.left_out: set[str] = set()
        #: this pass lost its per-sample statistics (a re-run of non-finite outputs): the step's other passes
        #: drop theirs (``drop_rows``: their ``finish`` without them), so that the passes merge
        self.rows_lost = False
        self.drop_rows: Callable[[], None] = lambda: None


class StepPartitions:
    """The partitions of one tracked optimizer step on this process, and their merge.

    Args:
        step: the global step.
        scale: the factor the backpropagated losses carry on top of the division by the micro-batches:
            a ``GradScaler``'s scale times ``info["loss_scale"]`` (1: none).
        skippable: a ``GradScaler`` is in play, so a step with non-finite gradients is one it skips.
    """

    def __init__(self, step: int, scale: float = 1.0, skippable: bool = False, grad_scaler: float = 1.0):
        self.step, self.scale, self.skippable = step, float(scale), bool(skippable)
        #: the scale of the declared ``GradScaler`` (1: none), part of :attr:`scale`: it unscales the gradients
        #: before the optimizer steps
        self.grad_scaler = float(grad_scaler)
        self.partitions: list[Partition] = []
        #: the step's self-checks (:class:`~cockpit_like.checks.StepChecks`), set by the tracked step
        self.checks = None
        #: the warning of a non-finite loss, held back while the step may be one the ``GradScaler`` skips
        #: (given when the step is tracked; a skipped step stores no value, so it would be false there)
        self.loss_warning: str | None = None

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.partitions)

    def add(self, partition: Partition) -> None:
        """Keep one backward pass of the step. Its rows may differ from the first pass's only where both factors were
        seen and are the passes' shares of the step's rows (``f_k / B_k`` the same for every pass: each micro-batch's
        mean loss times ``B_k / B``), so that the accumulated gradient is a multiple of the step's mean-loss gradient."""
        if self.partitions and partition.rows != self.partitions[0].rows:
            first, k = self.partitions[0], len(self.partitions)
            f0, fk = first.factor, partition.factor
            if f0 is None or fk is None or not _proportional(f0, first.rows, fk, partition.rows):
                seen = (
                    f"the factors seen between each backpropagated loss and its info['loss'] were {f0:.6g} and {fk:.6g}"
                    if f0 is not None and fk is not None else
                    "the factor between a backpropagated loss and its info['loss'] could not be seen (the tensor "
                    "backpropagated is not computed from info['loss'])"
                )  # fmt: skip
                raise PartitionError(
                    f"cockpit step {self.step}: micro-batch {k} has {partition.rows} rows, micro-batch 0 had "
                    f"{first.rows}, and {seen}. With unequal micro-batches the accumulated gradient is the gradient of "
                    "the step's mean loss only when each micro-batch's mean loss is weighted by its share of the "
                    "step's rows: backpropagate (loss * B_k / B_step) computed from info['loss'] (B_k the micro-batch's "
                    "rows, B_step the step's; info['loss'] and info['individual_losses'] the micro-batch's own), not "
                    "loss / K. Or use equal micro-batches (drop_last=True), or leave this step untracked "
                    "(docs/your_training_loop.md#gradient-accumulation)."
                )
        self.partitions.append(partition)

    def gradient_scale(self) -> float | None:
        """The factor between the accumulated gradient and the step's mean-loss gradient where every pass's factor
        was seen and they are the passes' shares of the rows (``f_0 B / B_0``: ``K f`` for ``K`` equal passes);
        ``None`` where a factor was not seen or they are not (the caller says why)."""
        factors = [p.factor for p in self.partitions]
        if not factors or any(f is None for f in factors):
            return None
        first = self.partitions[0]
        if any(not _proportional(factors[0], first.rows, p.factor, p.rows) for p in self.partitions):
            return None
        if all(p.rows == first.rows for p in self.partitions):  # equal passes (rows unknown, 0, included): K f
            return factors[0] * len(self.partitions)
        return factors[0] * (self.rows / first.rows)

    def merge(self, params: list[torch.Tensor], whole: dict, reduction: Reduction | None) -> tuple[dict, dict]:
        """The step's statistics and ``info`` from its partitions' (and, with ``reduction``, the ranks').

        ``whole``: results of needs computed once for the process (after every backward pass).
        Without ``reduction`` and with one partition, the results are taken as they are.
        """
        first = self.partitions[0]
        if reduction is None and len(self.partitions) == 1:
            results = first.finish()
            results.update(whole)
            for (index, field), value in first.fields.items():
                setattr(params[index], field, value)
            return results, first.info
        if any(partition.rows_lost for partition in self.partitions):
            for partition in self.partitions:
                partition.drop_rows()
        if reduction is None:
            reduction = Reduction([p.rows for p in self.partitions], self.rows, step=self.step)
        finishers, fields, infos = None, None, None
        for index, partition in enumerate(self.partitions):
            reduction.partition(index)
            results = partition.finish()
            these = {key: across(key, value, reduction) for key, value in results.items()}
            these_fields = {key: _mean_of(value, reduction) for key, value in partition.fields.items()}
            this_info = _merged_info(partition.info, reduction)
            if index == 0:
                finishers, fields, infos = these, these_fields, this_info
        reduction.for_process()
        finishers.update({key: across(key, value, reduction) for key, value in whole.items()})
        reduction.run()
        stats = {key: finish() for key, finish in finishers.items()}
        for (index, field), finish in fields.items():
            setattr(params[index], field, finish())
        return stats, infos()


    def merge_whole(self, whole: dict) -> dict:
        """The results of needs computed once for the process (after every backward pass) in one process, merged
        as :meth:`merge` merges them when they are passed to it (where the step's checks must come first)."""
        if len(self.partitions) == 1 or not whole:
            return dict(whole)
        reduction = Reduction([p.rows for p in self.partitions], self.rows, step=self.step).for_process()
        finishers = {key: across(key, value, reduction) for key, value in whole.items()}
        reduction.run()
        return {key: finish() for key, finish in finishers.items()}


def _proportional(f0: float, rows0: int, f: float, rows: int) -> bool:
    """Whether ``f0 / rows0 == f / rows`` (to the factors' rounding)."""
    return abs(f * rows0 - f0 * rows) <= 1e-6 * abs(f0 * rows)


def across(key, value, reduction: Reduction) -> Callable[[], Any]:
    """``key.across_ranks(value, reduction)``: how a statistic's or need's result merges, or a clear error."""
    combine = getattr(key, "across_ranks", None)
    if combine is None:
        raise NotImplementedError(
            f"{key!r} does not say how its per-step result merges across micro-batches and ranks; give it an "
            "across_ranks(result, reduction) method (see cockpit_like.backends.partitions)"
        )
    return combine(value, reduction)


def _mean_of(value, reduction: Reduction) -> Callable[[], Any]:
    if isinstance(value, torch.Tensor):
        return reduction.mean(value)
    parts = [reduction.mean(v) for v in value]
    return lambda: [part() for part in parts]


def take_mean_fields(params: list[torch.Tensor], extensions) -> dict:
    """Remove the BackPACK buffers linear in the mean loss from ``params``: ``{(index, field): buffer}``."""
    fields = sorted({getattr(ext, "savefield", None) for ext in extensions} & MEAN_FIELDS)
    taken = {}
    for field in fields:
        for index, param in enumerate(params):
            value = getattr(param, field, None)
            if isinstance(value, (torch.Tensor, list, tuple)):
                taken[(index, field)] = value
                delattr(param, field)
    return taken


def _merged_info(info: dict, reduction: Reduction) -> Callable[[], dict]:
    """``info`` of the step: ``batch_size`` summed, ``loss`` row-weighted, ``individual_losses`` and
    ``sample_ids`` concatenated (micro-batches in order, then ranks in order)."""
    loss, losses = info.get("loss"), info.get("individual_losses")
    ids = info.get("sample_ids")
    ids_part = None
    if isinstance(ids, torch.Tensor):
        ids_part = reduction.cat(ids.detach().reshape(-1))
    elif isinstance(ids, (list, tuple)):
        if all(isinstance(item, int) and not isinstance(item, bool) for item in ids):
            ids_part = reduction.cat(torch.tensor(list(ids), dtype=torch.int64))
        else:
            ids_part = reduction.cat_objects(list(ids))
    loss_part = None
    if isinstance(loss, (torch.Tensor, int, float)):
        loss_part = reduction.mean(torch.as_tensor(loss).detach().to(torch.float64))
    losses_part = None
    if isinstance(losses, torch.Tensor):
        losses_part = reduction.cat(losses.detach().reshape(-1))

    def finish() -> dict:
        result = dict(info)
        result["batch_size"] = reduction.batch
        if loss_part is not None:
            value = loss_part()
            result["loss"] = value.to(loss.dtype) if isinstance(loss, torch.Tensor) else float(value)
        if losses_part is not None:
            result["individual_losses"] = losses_part.value
        if ids_part is not None:
            result["sample_ids"] = ids_part.value
        return result

    return finish


def _count_of(info: dict, key: str, step: int, meaning: str) -> int:
    """``info[key]`` (default 1) as a positive int, or a ValueError that says what it counts (``meaning``)."""
    count = info.get(key, 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"cockpit step {step}: info[{key!r}] must be a positive int ({meaning}), got {count!r}")
    return count


def micro_batches_of(info: dict, step: int) -> int:
    """``info["micro_batches"]`` (default 1): the number of backward passes of this optimizer step."""
    return _count_of(info, "micro_batches", step,
                     "the number of micro-batches whose backward passes make this optimizer step")


def passes_in_block_of(info: dict, step: int) -> int:
    """``info["backward_passes"]`` (default 1): the backward calls inside one cockpit block (several losses
    backpropagated one after the other with ``retain_graph=True``), declared so that their rows are summed from
    the first step on, not learned at the first such step (which then stores nothing)."""
    return _count_of(info, "backward_passes", step,
                     "the backward calls inside this block, such as l1.backward(retain_graph=True); l2.backward() for 2")


def grad_scale(info: dict, step: int) -> float:
    """The scale of ``info["grad_scaler"]`` (a ``torch.amp.GradScaler``), or 1 without one (or disabled)."""
    scaler = info.get("grad_scaler")
    if scaler is None:
        return 1.0
    if not (callable(getattr(scaler, "get_scale", None)) and callable(getattr(scaler, "is_enabled", None))):
        raise ValueError(
            f"cockpit step {step}: info['grad_scaler'] must be the torch.amp.GradScaler whose scaled loss "
            f"is backpropagated (scaler.scale(loss).backward()), got {type(scaler).__name__}"
        )
    if not scaler.is_enabled():
        return 1.0
    scale = float(scaler.get_scale())
    if not (scale > 0.0 and scale < float("inf")):
        raise ValueError(f"cockpit step {step}: the GradScaler's scale is {scale}; expected a positive finite number")
    return scale


def loss_scale(info: dict, step: int) -> float:
    """``info["loss_scale"]`` (default 1): a constant factor on each backpropagated loss besides the division
    by ``info["micro_batches"]`` (e.g. ``k / K`` when a framework divides the ``k`` losses of a short last
    step by the usual ``K``); the quantities describe the loss without it."""
    factor = info.get("loss_scale", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0.0 < float(factor) < float("inf"):
        raise ValueError(f"cockpit step {step}: info['loss_scale'] must be a positive finite number, got {factor!r}")
    return float(factor)


class StepGradients:
    """The parameters and gradients the step's quantities read, then put back as they were.

    - Under a ``GradScaler`` of scale ``S``: ``p.grad / S`` (new tensors, with the
      graph of ``p.grad`` where it has one, so Hessian-vector products are those
      of the unscaled loss); the user's gradient tensors are restored bit for bit.
    - Sharded parameters (``fully_shard``, FSDP2: DTensors): whole plain
      stand-ins, their values and gradients gathered once per tracked step
      (``D`` numbers, as every rank of a DDP job holds; nothing per sample).

    :attr:`params` is what the quantities get; :func:`step_grad` is how the
    per-sample statistics read a parameter's gradient of the step.
    """

    def __init__(
        self, params: list[torch.Tensor], scale: float, unscaled_later: float = 1.0, zeros: Iterable[int] = (),
        kept: list[torch.Tensor | None] | None = None, graph_scale: float | None = None,
    ):
        self.params, self.scale = list(params), float(scale)
        #: where the loop scaled the gradients in place after the backward pass (``clip_grad_norm_``,
        #: ``GradScaler.unscale_``, under ``no_grad``): their values changed, not their graph, which is still
        #: ``graph_scale`` times the step's mean-loss gradient (``None``: the graph scales with the values)
        self.graph_scale = None if graph_scale is None or graph_scale == scale else float(graph_scale)
        #: the gradients as the backward passes left them, where the loop changed them since, and not by one factor
        #: (clipping by value before a step that waited for the optimizer): the quantities read these, the
        #: optimizer (and a look-ahead, :meth:`optimizer_gradients`) the user's
        self.kept = kept
        #: indices of parameters whose p.grad holds only earlier steps' gradients: zero at this step
        self.zeros = set(zeros)
        #: the part of ``scale`` taken off the gradients before the optimizer steps (a declared GradScaler's
        #: scale, where the step finishes before its ``unscale_``)
        self.unscaled_later = float(unscaled_later)
        self._originals = list(params)
        #: ``id`` of the parameters without a gradient as the loop leaves them (``p.grad`` None: not in the step's
        #: graph): the quantities count their gradient as zero, the optimizer skips them (no decay, no momentum)
        self._gradless = {id(p) for p in params if p.grad is None}
        self._saved: list[torch.Tensor | None] | None = None
        self._stand_ins: dict[int, torch.Tensor] = {}
        self._memo: dict[Any, Any] = {}

    def apply(self) -> None:
        global _VIEW
        if self._saved is not None or self._stand_ins:
            return
        inverse = 1.0 / self.scale
        if any(is_dtensor(p) for p in self._originals):
            for index, param in enumerate(self._originals):
                grad = param.grad
                value = whole(param.detach())
                stand_in = torch.nn.Parameter(value.clone(), requires_grad=param.requires_grad)
                if grad is not None and index not in self.zeros:
                    grad = whole(grad.detach())
                    stand_in.grad = grad if self.scale == 1.0 else grad * inverse
                else:  # frozen, unused or replaced: a zero gradient, as for plain parameters below
                    stand_in.grad = torch.zeros_like(stand_in)
                self._stand_ins[id(param)] = stand_in
                self.params[index] = stand_in
        elif self.kept is not None or self.scale != 1.0 or self.graph_scale is not None or self.zeros or any(
            p.grad is None or p.grad.is_sparse for p in self._originals
        ):
            self._saved = [p.grad for p in self._originals]
            read = self._saved if self.kept is None else self.kept
            for index, (param, grad) in enumerate(zip(self._originals, read)):
                if grad is None or index in self.zeros:  # not in the step's graph (unused, frozen, replaced): zero
                    param.grad = torch.zeros_like(param)
                elif grad.is_sparse:  # an embedding's sparse gradient (``sparse=True``): the quantities read it dense
                    param.grad = grad.to_dense() if self.scale == 1.0 else grad.to_dense() * inverse
                elif self.graph_scale is not None and grad.requires_grad:
                    # the values divided by the whole scale, the graph (Hessian-vector products through p.grad)
                    # by the graph's own: the in-place change is not in the graph
                    through = grad / self.graph_scale
                    param.grad = (grad * inverse).detach() + (through - through.detach())
                elif self.scale != 1.0:
                    param.grad = grad * inverse
                elif self.kept is not None:
                    param.grad = grad
        _VIEW = self

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per step for ``key`` (e.g. the optimizer's look-ahead, the same for every partition)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def grad_of(self, param: torch.Tensor) -> torch.Tensor | None:
        stand_in = self._stand_ins.get(id(param))
        return param.grad if stand_in is None else stand_in.grad

    def optimizer_gradients(self, params: list[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor | None] | None:
        """``{param: gradient}`` as the optimizer gets it where the quantities see it divided by the scale (a loss
        factor, micro-batches not divided by their number, clipping or unscaling before the optimizer's step):
        the user's own gradient tensors; ``None`` where the two are the same. A parameter without a gradient
        (``p.grad`` None, which the quantities count as zero) maps to ``None``: the optimizer skips it, and so
        does a look-ahead (:func:`cockpit_like.utils.optim.lookahead_update`)."""
        differ = self._saved is not None and (self.kept is not None or self.scale != self.unscaled_later)
        if not differ and not self._gradless:
            return None
        divisor = self.unscaled_later
        saved = {} if self._saved is None else dict(zip(map(id, self._originals), self._saved))
        gradients: dict[torch.Tensor, torch.Tensor | None] = {}
        for param in params:
            if id(param) in self._gradless:
                gradients[param] = None
            elif differ and saved.get(id(param)) is not None:
                gradients[param] = saved[id(param)] if divisor == 1.0 else saved[id(param)] / divisor
        return gradients

    def gradless(self, params: list[torch.Tensor]) -> set[int]:
        """Indices of ``params`` without a gradient as the loop leaves them (the optimizer skips them)."""
        return {index for index, param in enumerate(params) if id(param) in self._gradless}

    def unscale(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Other gradients of the step (a rank's local ones with their graph) divided by the scale."""
        if self.scale == 1.0:
            return tensors
        return [None if t is None else t * (1.0 / self.scale) for t in tensors]

    def restore(self) -> None:
        global _VIEW
        if _VIEW is self:
            _VIEW = None
        self._stand_ins, self._memo, self.kept = {}, {}, None
        self.params = list(self._originals)
        if self._saved is None:
            return
        for param, grad in zip(self._originals, self._saved):
            param.grad = grad
        self._saved = None


#: the gradient view of the step being finished (:class:`StepGradients`), if any
_VIEW: StepGradients | None = None


def step_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s gradient of the step as the quantities see it (unscaled, whole; see :class:`StepGradients`)."""
    return param.grad if _VIEW is None else _VIEW.grad_of(param)


def optimizer_gradients(params: list[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor] | None:
    """The gradients ``params``' optimizer steps with, where they differ from :func:`step_grad`'s (for a
    look-ahead of its update: :func:`cockpit_like.utils.optim.lookahead_update`'s ``gradients``)."""
    return None if _VIEW is None else _VIEW.optimizer_gradients(params)


def gradless(params: list[torch.Tensor]) -> set[int]:
    """Indices of ``params`` whose ``p.grad`` the loop left None at the finishing step (the quantities count it as
    zero; the optimizer skips the parameter): empty outside a finishing step."""
    return set() if _VIEW is None else _VIEW.gradless(params)


def step_memo(key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, once per finishing step for ``key`` (every partition's statistic asks the same)."""
    return compute() if _VIEW is None else _VIEW.memo(key, compute)


@functools.cache
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed`` DTensor (a sharded parameter or gradient)."""
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective every rank makes), else ``tensor``."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor
