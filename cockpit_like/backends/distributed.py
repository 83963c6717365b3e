"""The cockpit under ``torch.distributed`` / ``DistributedDataParallel`` (DDP).

What lives here:

- :class:`RankGroup`: the ranks as the cockpit sees them (rank, world size,
  which rank keeps the output, its own process group for its collectives,
  so that they never pair with DDP's gradient all-reduces);
- the per-step protocol (:meth:`RankGroup.finish_step`), run only at
  tracked steps, after the backward pass:

  1. a *header* all-reduce of ``2 W`` numbers (``W`` ranks): an error flag
     and the local batch size of every rank (plus the local gradients on
     steps whose forward pass the cockpit ran without DDP's synchronisation,
     see below). A rank that raised inside the context sets its flag, so
     every other rank raises :class:`DistributedStepError` at once;
  2. each rank finalises its per-sample statistics and step needs locally;
  3. *one* flattened all-reduce (:class:`RankReduction`) of every per-step
     result: statistics, BackPACK curvature buffers, the loss and the
     per-sample losses. Each statistic says how it combines
     (``across_ranks``): a sum, a concatenation of per-sample values (rank
     order), or a maximum, in scale-free units (``B_r grad_batch`` is the
     per-sample gradient ``g_i`` whatever the local batch ``B_r``);
- the global view of ``info`` that quantities read (``batch_size``,
  ``loss``, ``individual_losses`` of the global batch; the user's dict is
  not changed);
- Hessian-vector products of the global loss (:func:`global_product`,
  :func:`graph_grads`, :func:`same_on_all_ranks`);
- steps that need the graph: DDP cannot backpropagate with
  ``create_graph=True`` (its reducer writes the gradients in place), so the
  cockpit runs the forward pass of such a step with DDP's gradient
  synchronisation off (as ``no_sync()`` does) and averages the gradients
  itself in the header; the local gradients, with their graph, stay
  available for Hessian-vector products until the step's quantities ran.

Steps that track nothing call none of this (no collective).

May import torch and :mod:`cockpit_like.backends`.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "RankGroup",
    "RankReduction",
    "DistributedStepError",
    "UnequalBatchError",
    "graph_grads",
    "global_product",
    "same_on_all_ranks",
    "MEAN_FIELDS",
    "unwrap",
]


class DistributedStepError(RuntimeError):
    """Another rank failed inside the cockpit context at this step (or a collective of the cockpit failed)."""


class UnequalBatchError(ValueError):
    """The ranks have different local batch sizes at a tracked step."""


#: BackPACK savefields whose buffers are linear in the (mean) loss: the global buffer is the
#: batch-weighted mean of the ranks' buffers (curvature diagonals, Kronecker factors)
MEAN_FIELDS = frozenset({"diag_h", "diag_ggn_exact", "diag_ggn_mc", "kfac", "kflr", "kfra"})

#: the rank group of the step whose quantities are being tracked (for Hessian-vector products)
_ACTIVE: RankGroup | None = None


def _is_ddp(module: Any) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a ``DistributedDataParallel`` wrapper (else ``model``), so that module
    paths read the same in one process and under DDP (``"fc1"``, not ``"module.fc1"``)."""
    return model.module if _is_ddp(model) else model


class RankGroup:
    """The ranks of a distributed run (see the module docstring).

    Args:
        group: the process group of the cockpit's collectives.
        rank: this process's rank.
        world: the number of ranks.
        log_rank: the rank that keeps the output and writes logs (``None``: every rank).
    """

    def __init__(self, group, rank: int, world: int, log_rank: int | None):
        self.group, self.rank, self.world, self.log_rank = group, rank, world, log_rank
        #: the forward pass of the coming step ran without DDP's synchronisation (the cockpit averages)
        self.forward_unsynced = False
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._graph_grads: list[torch.Tensor] | None = None
        self.collectives = 0

    @classmethod
    def detect(cls, log_rank: int | None = 0, timeout: float | datetime.timedelta | None = None) -> RankGroup | None:
        """The ranks of the current ``torch.distributed`` run, or ``None`` for one process.

        Creates the cockpit's own process group (a collective call of
        ``new_group``: every rank must create its cockpit at the same point).
        ``timeout`` bounds how long a rank waits in a cockpit collective.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        world, rank = dist.get_world_size(), dist.get_rank()
        if log_rank is not None and not (isinstance(log_rank, int) and 0 <= log_rank < world):
            raise ValueError(f"Cockpit(log_rank=...) must be a rank in 0..{world - 1} or None, got {log_rank!r}")
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        group = dist.new_group(timeout=timeout) if timeout is not None else dist.new_group()
        return cls(group, rank, world, log_rank)

    @property
    def keeps_output(self) -> bool:
        """Whether this rank keeps the output, streams and writes logs."""
        return self.log_rank is None or self.rank == self.log_rank

    # ---- DDP's forward pass -----------------------------------------------------------------
    def watch(self, models: list[torch.nn.Module], wants_graph: Callable[[], bool]) -> None:
        """Run the forward passes of DDP modules in ``models`` unsynchronised before steps that need the graph."""
        for model in models:
            if _is_ddp(model) and model not in self._watched:
                self._watched.add(model)
                model.register_forward_pre_hook(lambda module, args: self._before_forward(module, wants_graph))
                model.register_forward_hook(lambda module, args, output: self._after_forward(module), always_call=True)

    def _before_forward(self, module, wants_graph) -> None:
        module._cockpit_sync = module.require_backward_grad_sync
        if torch.is_grad_enabled() and module.require_backward_grad_sync and wants_graph():
            module.require_backward_grad_sync = False
            self.forward_unsynced = True

    @staticmethod
    def _after_forward(module) -> None:
        module.require_backward_grad_sync = getattr(module, "_cockpit_sync", True)

    def check_step(self, step: int, models: list[torch.nn.Module], info: dict, create_graph: bool) -> None:
        """Before a tracked step's backward pass: a clear error for what cannot work (same on every rank)."""
        ddp = [model for model in models if _is_ddp(model)]
        if not ddp:
            raise RuntimeError(
                f"cockpit step {step}: torch.distributed runs {self.world} ranks, but the cockpit knows no "
                "DistributedDataParallel model. Pass the wrapped model, Cockpit(params, quantities, "
                "model=ddp_model), and create the cockpit before the first forward pass."
            )
        if any(not model.require_backward_grad_sync for model in ddp):
            raise RuntimeError(
                f"cockpit step {step} is tracked inside DistributedDataParallel.no_sync(): the gradients "
                "are not synchronised, so no quantity can describe the global batch. With gradient "
                "accumulation, enter the cockpit only on the synchronising micro-step (the last one, "
                "outside no_sync()), or schedule the quantities so that no tracked step falls inside no_sync()."
            )
        if create_graph and not self.forward_unsynced:
            raise RuntimeError(
                f"cockpit step {step} needs the graph (loss.backward(create_graph=True)), which "
                "DistributedDataParallel cannot backpropagate unless the forward pass ran without its "
                "synchronisation. The cockpit does that itself for the DDP model it knows: create the "
                "cockpit with Cockpit(..., model=ddp_model) before the first forward pass and number the "
                "steps 0, 1, 2, ... (the forward pass of step s follows step s - 1)."
            )
        if "batch_size" not in info:
            raise RuntimeError(
                f"cockpit step {step}: under torch.distributed the cockpit needs info['batch_size'] (the "
                "local batch size of this rank) at every tracked step"
            )

    # ---- collectives ------------------------------------------------------------------------
    def _all_reduce(self, buffer: torch.Tensor, step: int, what: str) -> None:
        import torch.distributed as dist

        self.collectives += 1
        try:
            dist.all_reduce(buffer, group=self.group)
        except Exception as error:  # noqa: BLE001 - gloo/nccl raise RuntimeError subclasses
            raise DistributedStepError(
                f"cockpit step {step}: the {what} all-reduce across {self.world} ranks failed on rank "
                f"{self.rank} ({type(error).__name__}: {error}). Another rank probably stopped (an error "
                "outside the cockpit context, or it did not enter this step) or did not reach the end of "
                "the step within the timeout (Cockpit(..., distributed_timeout=...) and the timeout= of "
                "torch.distributed.init_process_group)."
            ) from error

    def _header(self, step: int, failed: bool, batch: int, grads: list[torch.Tensor] | None, device) -> torch.Tensor:
        size = 2 * self.world + sum(g.numel() for g in grads or [])
        buffer = torch.zeros(size, dtype=torch.float64, device=device)
        buffer[self.rank] = float(failed)
        buffer[self.world + self.rank] = float(batch)
        if grads and not failed:
            torch.cat([g.detach().reshape(-1).to(torch.float64) for g in grads], out=buffer[2 * self.world :])
        self._all_reduce(buffer, step, "header")
        return buffer

    def _unsynced_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor] | None:
        if not self.forward_unsynced:
            return None
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def abandon_step(self, step: int, params: list[torch.Tensor], batch: int) -> None:
        """This rank failed inside the context: tell the others (header with the error flag), never raise."""
        grads = self._unsynced_grads(params)
        self.forward_unsynced = False
        try:
            self._header(step, True, batch, grads, params[0].device)
        except DistributedStepError:
            pass  # the others are gone already; this rank's own error is the one to show

    def finish_step(self, step: int, execution, info: dict) -> tuple[dict, dict]:
        """The global statistics and the global ``info`` of a tracked step (see the module docstring)."""
        params = execution.params
        batch = int(info["batch_size"])
        grads = self._unsynced_grads(params)
        self.forward_unsynced = False
        try:
            execution.check()
        except BaseException:
            self._header(step, True, batch, grads, params[0].device)
            raise
        header = self._header(step, False, batch, grads, params[0].device)
        flags = header[: self.world].tolist()
        batches = [int(b) for b in header[self.world : 2 * self.world].tolist()]
        failed = [rank for rank, flag in enumerate(flags) if flag]
        if failed:
            raise DistributedStepError(
                f"cockpit step {step}: rank(s) {failed} raised inside the cockpit context (see their own "
                f"tracebacks); rank {self.rank} stops too."
            )
        if len(set(batches)) > 1:
            raise UnequalBatchError(
                f"cockpit step {step}: the ranks have different local batch sizes {batches}. "
                "DistributedDataParallel averages the ranks' gradients, which is the gradient of the global "
                "batch only when every rank has the same number of samples; use equal local batches (e.g. "
                "DistributedSampler with drop_last=True for the data loader), or leave this step untracked."
            )
        if grads is not None:
            self._graph_grads = grads
            offset = 2 * self.world
            for param in params:
                size = param.numel()
                param.grad = (header[offset : offset + size] / self.world).to(param.dtype).view_as(param).clone()
                offset += size
        reduction = RankReduction(self, batch, sum(batches), step, params[0].device)
        global _ACTIVE
        _ACTIVE = self
        local = execution.results()
        finishers = {key: _across_ranks(key, value, reduction) for key, value in local.items()}
        fields = _combine_fields(execution, params, reduction)
        global_info = _global_info(info, reduction)
        reduction.run()
        stats = {key: finish() for key, finish in finishers.items()}
        fields()
        return stats, global_info()

    def end_step(self) -> None:
        """After the step's quantities ran: forget the local gradients' graph."""
        global _ACTIVE
        _ACTIVE = None
        self._graph_grads = None


class _Part:
    __slots__ = ("kind", "tensor", "value")

    def __init__(self, kind: str, tensor: torch.Tensor):
        self.kind, self.tensor, self.value = kind, tensor, None


class RankReduction:
    """One flattened all-reduce of a step's results: parts register here, :meth:`run` reduces them all.

    ``sum(t)``, ``cat(t)`` (concatenated along the first dimension in rank
    order; every rank has the same shape) and ``max(t)`` return a part whose
    ``value`` is set by :meth:`run` (in ``t``'s dtype and device). All parts
    travel in one float64 buffer (integer counts below ``2**53`` exactly).

    Attributes:
        local_batch: this rank's batch size ``B_r``; batch: the global ``B``; world: ``W``.
    """

    def __init__(self, ranks: RankGroup, local_batch: int, batch: int, step: int, device):
        self.ranks, self.local_batch, self.batch, self.world = ranks, local_batch, batch, ranks.world
        self._step, self._device = step, device
        self._parts: list[_Part] = []

    def _add(self, kind: str, tensor) -> _Part:
        part = _Part(kind, torch.as_tensor(tensor).detach())
        self._parts.append(part)
        return part

    def sum(self, tensor) -> _Part:
        return self._add("sum", tensor)

    def cat(self, tensor) -> _Part:
        return self._add("cat", tensor)

    def max(self, tensor) -> _Part:
        return self._add("max", tensor)

    def run(self) -> None:
        if not self._parts:
            return
        world, rank = self.world, self.ranks.rank
        sizes = [p.tensor.numel() * (1 if p.kind == "sum" else world) for p in self._parts]
        buffer = torch.zeros(sum(sizes), dtype=torch.float64, device=self._device)
        offset = 0
        for part, size in zip(self._parts, sizes):
            flat = part.tensor.reshape(-1).to(device=self._device, dtype=torch.float64)
            start = offset if part.kind == "sum" else offset + rank * flat.numel()
            buffer[start : start + flat.numel()] = flat
            offset += size
        self.ranks._all_reduce(buffer, self._step, "statistics")
        offset = 0
        for part, size in zip(self._parts, sizes):
            chunk, like = buffer[offset : offset + size], part.tensor
            if part.kind == "sum":
                value = chunk.view(like.shape)
            else:
                slots = chunk.view(world, *like.shape)
                if part.kind == "max":
                    value = slots.amax(0)
                else:
                    value = slots.reshape(world * like.shape[0], *like.shape[1:]) if like.dim() else slots
            part.value = value.to(dtype=like.dtype, device=like.device)
            offset += size

    def mean(self, tensor) -> Callable[[], torch.Tensor]:
        """The batch-weighted mean ``sum_r (B_r / B) t_r`` (a mean-loss quantity of the global batch)."""
        part = self.sum(tensor * self.local_batch)
        return lambda: part.value / self.batch


def _across_ranks(key, value, reduction: RankReduction) -> Callable[[], Any]:
    combine = getattr(key, "across_ranks", None)
    if combine is None:
        raise NotImplementedError(
            f"{key!r} does not say how its per-step result combines across DistributedDataParallel ranks; "
            "give it an across_ranks(result, reduction) method (see cockpit_like.backends.distributed)"
        )
    return combine(value, reduction)


def _combine_fields(execution, params: list[torch.Tensor], reduction: RankReduction) -> Callable[[], None]:
    """BackPACK buffers linear in the mean loss (:data:`MEAN_FIELDS`) become the global batch's; others stay local."""
    fields = sorted({getattr(ext, "savefield", None) for ext in execution.extensions} & MEAN_FIELDS)
    pending = []
    for field in fields:
        for param in params:
            value = getattr(param, field, None)
            if isinstance(value, torch.Tensor):
                pending.append((param, field, None, reduction.mean(value)))
            elif isinstance(value, (list, tuple)):
                pending.append((param, field, [reduction.mean(v) for v in value], None))

    def finish() -> None:
        for param, field, many, one in pending:
            setattr(param, field, one() if one is not None else [f() for f in many])

    return finish


def _global_info(info: dict, reduction: RankReduction) -> Callable[[], dict]:
    """``info`` of the global batch: ``batch_size`` summed, ``loss`` batch-weighted, ``individual_losses`` concatenated."""
    loss, losses = info.get("loss"), info.get("individual_losses")
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
        return result

    return finish


# ---- Hessian-vector products of the global loss ----------------------------------------------
def graph_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients whose graph gives Hessian-vector products: the local ones of this rank under DDP."""
    if _ACTIVE is not None and _ACTIVE._graph_grads is not None:
        return _ACTIVE._graph_grads
    return [p.grad for p in params]


def global_product(product: torch.Tensor) -> torch.Tensor:
    """``H v`` of the global mean loss from this rank's ``H_r v`` (equal batches: the mean over ranks).

    The identity in one process. Every rank must call it for the same ``v``
    (see :func:`same_on_all_ranks`).
    """
    ranks = _ACTIVE
    if ranks is None:
        return product
    buffer = product.detach().to(torch.float64).clone()
    ranks._all_reduce(buffer, -1, "Hessian-vector product")
    return (buffer / ranks.world).to(product.dtype)


def same_on_all_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (a random start vector); the identity in one process."""
    ranks = _ACTIVE
    if ranks is None:
        return tensor
    import torch.distributed as dist

    ranks.collectives += 1
    tensor = tensor.detach().clone()
    dist.broadcast(tensor, src=dist.get_global_rank(ranks.group, 0), group=ranks.group)
    return tensor
