"""The cockpit under ``torch.distributed`` / ``DistributedDataParallel`` (DDP).

What lives here:

- :class:`RankGroup`: the ranks as the cockpit sees them (rank, world size,
  which rank keeps the output, its own process group for its collectives,
  so that they never pair with DDP's gradient all-reduces). The group is
  created at the first collective (the header of the first tracked step),
  not in ``Cockpit(...)``: the constructor runs no collective, so a cockpit
  created on some ranks only cannot hang there; the first tracked step then
  ends with :class:`DistributedStepError` after ``distributed_timeout``
  (the other ranks never join the group's creation);
- the per-step protocol (:meth:`RankGroup.synchronise`), run only at
  tracked steps, after the step's last backward pass:

  1. a *header* all-reduce of ``2 W`` numbers (``W`` ranks): an error flag
     and the local batch size of every rank (plus the local gradients on
     steps whose forward pass the cockpit ran without DDP's synchronisation,
     see below). A rank that raised inside the context sets its flag, so
     every other rank raises :class:`DistributedStepError` at once;
  2. each rank finalises its per-sample statistics and step needs locally;
  3. *one* flattened all-reduce (:class:`~cockpit_like.backends.partitions.Reduction`,
     after this rank's micro-batches are merged) of every per-step
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

from cockpit_like.backends.partitions import MEAN_FIELDS, Reduction, StepPartitions

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
    "is_sharded",
]


class DistributedStepError(RuntimeError):
    """Another rank failed inside the cockpit context at this step (or a collective of the cockpit failed)."""


class UnequalBatchError(ValueError):
    """The ranks have different local batch sizes at a tracked step."""



#: the rank group of the step whose quantities are being tracked (for Hessian-vector products)
_ACTIVE: RankGroup | None = None


def _is_ddp(module: Any) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def is_sharded(module: Any) -> bool:
    """Whether ``module`` is a ``torch.distributed.fsdp.fully_shard`` (FSDP2) module."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a ``DistributedDataParallel`` wrapper (else ``model``), so that module
    paths read the same in one process and under DDP (``"fc1"``, not ``"module.fc1"``)."""
    return model.module if _is_ddp(model) else model


class RankGroup:
    """The ranks of a distributed run (see the module docstring).

    Args:
        rank: this process's rank.
        world: the number of ranks.
        log_rank: the rank that keeps the output and writes logs (``None``: every rank).
        timeout: how long a rank waits in one of the cockpit's collectives, and for the
            other ranks when the cockpit's process group is created (``None``: torch's default).
    """

    def __init__(self, rank: int, world: int, log_rank: int | None, timeout: datetime.timedelta | None = None):
        self.rank, self.world, self.log_rank, self.timeout = rank, world, log_rank, timeout
        self._group = None  # created at the first collective (:meth:`process_group`)
        self._group_error: str | None = None
        #: the forward pass of the coming step ran without DDP's synchronisation (the cockpit averages)
        self.forward_unsynced = False
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._graph_grads: list[torch.Tensor] | None = None
        self.collectives = 0

    @classmethod
    def detect(cls, log_rank: int | None = 0, timeout: float | datetime.timedelta | None = None) -> RankGroup | None:
        """The ranks of the current ``torch.distributed`` run, or ``None`` for one process.

        Runs no collective (the cockpit's process group is created at its first
        collective, :meth:`process_group`). ``timeout`` (seconds) bounds how long
        a rank waits in a cockpit collective.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        world, rank = dist.get_world_size(), dist.get_rank()
        if log_rank is not None and not (isinstance(log_rank, int) and 0 <= log_rank < world):
            raise ValueError(f"Cockpit(log_rank=...) must be a rank in 0..{world - 1} or None, got {log_rank!r}")
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        return cls(rank, world, log_rank, timeout)

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
        module._cockpit_unsynced = False
        # (not with static_graph=True: its reducer writes the gradients in place even unsynchronised, which a
        # backward pass with create_graph=True refuses; check_step says so before the backward pass)
        if (torch.is_grad_enabled() and module.require_backward_grad_sync and wants_graph()
                and not getattr(module, "static_graph", False)):
            module.require_backward_grad_sync = False
            module._cockpit_unsynced = True
            self.forward_unsynced = True

    @staticmethod
    def _after_forward(module) -> None:
        module.require_backward_grad_sync = getattr(module, "_cockpit_sync", True)
        if getattr(module, "_cockpit_unsynced", False):
            # DDP's forward pass without sync leaves require_forward_param_sync False, and its next forward pass
            # then skips the broadcast of rank 0's buffers (outside trial 21: BatchNorm's running statistics
            # on the other ranks followed their own batches after every graph step): as the synced pass leaves it
            module.require_forward_param_sync = True
            module._cockpit_unsynced = False

    def check_step(
        self,
        step: int,
        models: list[torch.nn.Module],
        info: dict,
        create_graph: bool,
        last: bool = True,
        graph_owners: tuple = (),
    ) -> None:
        """Before a tracked step's backward pass: a clear error for what cannot work (same on every rank).

        ``last``: this is the step's last backward pass (micro-batches before it may run in ``no_sync()``);
        ``graph_owners``: names of the quantities that need the graph (for messages)."""
        ddp = [model for model in models if _is_ddp(model)]
        if any(is_sharded(model) for model in models):
            if create_graph:
                raise NotImplementedError(
                    f"cockpit step {step}: {list(graph_owners) or 'a quantity'} need(s) Hessian-vector products "
                    "(loss.backward(create_graph=True)), which a fully_shard (FSDP2) model cannot backpropagate: "
                    "its gradients are reduce-scattered without a graph. Leave these quantities out under FSDP "
                    "(e.g. configuration('economy')), or use KFACTrace(curvature='empirical') / "
                    "CurvatureStatistics for curvature, or track them with DistributedDataParallel "
                    "(docs/distributed.md)."
                )
        elif not ddp:
            raise RuntimeError(
                f"cockpit step {step}: torch.distributed runs {self.world} ranks, but the cockpit knows no "
                "DistributedDataParallel or fully_shard (FSDP2) model. Pass the wrapped model, Cockpit(params, "
                "quantities, model=ddp_model), and create the cockpit before the first forward pass."
            )
        syncing = all(model.require_backward_grad_sync for model in ddp)
        if last and not syncing:
            raise RuntimeError(
                f"cockpit step {step}: its last backward pass runs inside DistributedDataParallel.no_sync(): "
                "the gradients are not synchronised, so no quantity can describe the global batch. With "
                "gradient accumulation pass info['micro_batches'] = K on each of the K micro-steps and run "
                "only the last one outside no_sync() (docs/distributed.md, gradient accumulation)."
            )
        static = [model for model in ddp if getattr(model, "static_graph", False)]
        if create_graph and static:
            raise RuntimeError(
                f"cockpit step {step}: {list(graph_owners) or 'a quantity'} need(s) Hessian-vector products "
                "(loss.backward(create_graph=True)), which DistributedDataParallel(static_graph=True) cannot "
                "backpropagate: its reducer writes the gradients in place even where the cockpit turns its "
                "synchronisation off (PyTorch: 'a leaf Variable that requires grad is being used in an in-place "
                "operation'). This step's forward pass ran synchronised, so a loop that catches this error and "
                "calls loss.backward() trains as without the cockpit. Construct DistributedDataParallel without "
                "static_graph for these quantities, or leave them out (e.g. configuration('economy'), which "
                "works with static_graph=True)."
            )
        if create_graph and syncing and not self.forward_unsynced:
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
    def process_group(self, step: int):
        """The cockpit's own process group, created at its first collective (``step``: for messages).

        ``new_group`` needs every rank: a rank without a cockpit, or one that
        does not track this step, never joins, and this rank raises
        :class:`DistributedStepError` after the timeout (and at once at every
        later step: the group cannot be created any more in step with the others).
        """
        if self._group is not None:
            return self._group
        if self._group_error is not None:
            raise DistributedStepError(f"cockpit step {step}: {self._group_error}.")
        import torch.distributed as dist

        try:
            self._group = dist.new_group(timeout=self.timeout) if self.timeout is not None else dist.new_group()
        except Exception as error:  # noqa: BLE001 - gloo raises DistStoreError (a RuntimeError) on a timeout
            waited = "the timeout" if self.timeout is None else f"{self.timeout.total_seconds():g} s"
            self._group_error = (
                f"rank {self.rank} waited {waited} for the other {self.world - 1} rank(s) to create the "
                f"cockpit's process group with it at its first tracked step (step {step}) ({type(error).__name__}: "
                f"{error}). Likely cause: a rank has no cockpit (create Cockpit(...) on every rank, e.g. not "
                "under `if rank == 0`), or a rank does not track this step (the same quantities, schedules "
                "and step numbers on every rank), or a rank stopped before it (an error). The cockpit makes "
                "no further collective"
            )
            raise DistributedStepError(f"cockpit step {step}: {self._group_error}.") from error
        return self._group

    def _all_reduce(self, buffer: torch.Tensor, step: int, what: str) -> None:
        import torch.distributed as dist

        group = self.process_group(step)
        self.collectives += 1
        try:
            dist.all_reduce(buffer, group=group)
        except Exception as error:  # noqa: BLE001 - gloo/nccl raise RuntimeError subclasses
            raise DistributedStepError(
                f"cockpit step {step}: the {what} all-reduce across {self.world} ranks failed on rank "
                f"{self.rank} ({type(error).__name__}: {error}). Another rank probably stopped (an error "
                "outside the cockpit context), did not enter this step (no cockpit there, or another "
                "schedule) or did not reach the end of the step within the timeout (Cockpit(..., "
                "distributed_timeout=...) and the timeout= of torch.distributed.init_process_group)."
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

    def synchronise(self, step: int, params: list[torch.Tensor], partitions: StepPartitions) -> Reduction:
        """After a tracked step's last backward pass: the header (errors, batch sizes, unsynchronised
        gradients, see the module docstring), then the :class:`Reduction` of this rank's partitions."""
        batch = partitions.rows
        grads = self._unsynced_grads(params)
        self.forward_unsynced = False
        header = self._header(step, False, batch, grads, params[0].device)
        flags = header[: self.world].tolist()
        batches = [int(b) for b in header[self.world : 2 * self.world].tolist()]
        failed = [rank for rank, flag in enumerate(flags) if flag]
        if failed:
            raise DistributedStepError(
                f"cockpit step {step}: rank(s) {failed} raised inside the cockpit context (see their own "
                f"tracebacks); rank {self.rank} stops too."
            )
        if grads is not None:
            # DDP's average, which the cockpit took over for this step (its forward pass ran unsynchronised): made
            # before anything else can stop the step, so the run stays a DDP run whatever the loop does with the
            # error below (outside trial 21: an UnequalBatchError caught by the loop left every rank stepping with
            # its own gradient, and the replicas drifted apart)
            self._graph_grads = grads
            offset = 2 * self.world
            for param in params:
                size = param.numel()
                param.grad = (header[offset : offset + size] / self.world).to(param.dtype).view_as(param).clone()
                offset += size
        if len(set(batches)) > 1:
            raise UnequalBatchError(
                f"cockpit step {step}: the ranks have different local batch sizes {batches}. "
                "DistributedDataParallel averages the ranks' gradients, which is the gradient of the global "
                "batch only when every rank has the same number of samples; use equal local batches (e.g. "
                "DistributedSampler with drop_last=True for the data loader), or leave this step untracked."
            )
        global _ACTIVE
        _ACTIVE = self
        return Reduction([p.rows for p in partitions.partitions], sum(batches), self, step, params[0].device)

    def unscale_graph_grads(self, unscaled) -> None:
        """The local gradients kept for Hessian-vector products, divided by a ``GradScaler``'s scale."""
        if self._graph_grads is not None:
            self._graph_grads = unscaled.unscale(self._graph_grads)

    def end_step(self) -> None:
        """After the step's quantities ran: forget the local gradients' graph."""
        global _ACTIVE
        _ACTIVE = None
        self._graph_grads = None


class RankReduction(Reduction):
    """:class:`~cockpit_like.backends.partitions.Reduction` of one backward pass per rank (DDP without accumulation)."""

    def __init__(self, ranks: RankGroup, local_batch: int, batch: int, step: int, device):
        super().__init__([local_batch], batch, ranks, step, device)


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

    group = ranks.process_group(-1)
    ranks.collectives += 1
    tensor = tensor.detach().clone()
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return tensor
