"""Lightning: a cockpit around the backward pass that ``lightning.Trainer`` owns.

::

    import lightning as L
    from cockpit_like import Cockpit
    from cockpit_like.integrations.lightning import CockpitCallback, CockpitModule

    class Net(CockpitModule, L.LightningModule):          # the mixin first
        def training_step(self, batch, batch_idx):
            x, y = batch
            losses = F.cross_entropy(self.model(x), y, reduction="none")
            return {"loss": losses.mean(), "individual_losses": losses}

    net = Net()
    cockpit = Cockpit(net.parameters(), quantities=configuration("full"), model=net)
    trainer = L.Trainer(callbacks=[CockpitCallback(cockpit, logpath="runs/net")])

How it works:

- ``on_before_backward`` opens the step (``cockpit.begin(trainer.global_step,
  info=...)``), ``on_after_backward`` closes it (``cockpit.end()``); an
  exception in between closes it as failed (``on_exception``).
- ``info``: ``"loss"`` (the tensor Lightning backpropagates), ``"optimizer"``
  (the trainer's optimizer), ``"batch_size"`` (the length of
  ``individual_losses``, else of the batch's first tensor), and every other
  ``info`` key (``"individual_losses"``, ``"outputs"``, ``"sample_ids"``: the
  rows' ids for the loss-spike post-mortem, e.g. the indices a data set
  yields, ``docs/spikes.md``) of the dict that ``training_step`` returns. Lightning hands the callback only the loss, so
  :class:`CockpitModule` notes the returned dict before Lightning sees it
  (or call ``self.cockpit_info(individual_losses=...)`` inside
  ``training_step``). Without the mixin, only quantities that need no
  per-sample losses can be tracked (Loss, GradNorm, Distance, UpdateSize, ...).
- ``create_graph``: Lightning calls ``LightningModule.backward(loss)``; the
  mixin's ``backward`` adds ``create_graph=cockpit.create_graph(step)``. With a
  ``backward`` of your own, pass it yourself. A step that needed the graph
  and did not get it is an error that says so.
- ``cockpit.log`` at the end of every validation epoch (not the sanity check)
  with the figures found in ``trainer.callback_metrics`` (``val_loss`` /
  ``valid_loss``, ``val_acc`` / ``val_accuracy``, ``train_loss``, ... see
  ``CockpitCallback(metrics=...)``), the epoch and the learning rate, under the
  last trained step.
- Checkpoints: the cockpit's ``state_dict()`` is saved in every Lightning
  checkpoint under ``"cockpit_like"`` and loaded back with
  ``trainer.fit(..., ckpt_path=...)``.
- ``logpath``: the log is written there at the end of ``fit``.

- Gradient accumulation (``accumulate_grad_batches=K``): a tracked step is
  one *optimizer* step. The cockpit is entered around each micro-batch's
  backward pass with the same ``trainer.global_step`` and
  ``info["micro_batches"]`` = the backward passes of that optimizer step
  (``K``, or fewer for the last step of an epoch whose batches do not divide
  by ``K``: Lightning steps there too); the quantities are computed after the
  last one and equal one backward pass over the step's concatenated rows.
  Lightning divides every micro-batch's loss by ``K``, also in a shorter last
  step of ``k < K`` micro-batches, whose accumulated gradient is then
  ``k / K`` times the mean gradient of its rows: the callback passes
  ``info["loss"]`` = the loss ``training_step`` returned (``K`` times the one
  Lightning backpropagates) and, for such a step, the factor ``k / K`` as
  ``info["loss_scale"]``, so the quantities describe the mean
  loss of the step's rows. Micro-batches must have equal rows
  (``drop_last=True`` where the dataset does not divide by the batch size);
  a loader without a length must give a multiple of ``K`` batches per epoch.

Works with ``lightning`` (``lightning.Trainer``) and with the older package
name ``pytorch_lightning``: ``CockpitCallback`` subclasses the ``Callback`` of
each that is installed.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from typing import Any

import torch

from cockpit_like.context import MissingInfoError
from cockpit_like.run_output import StepAlreadyTrackedError

__all__ = ["CockpitCallback", "CockpitModule", "CHECKPOINT_KEY", "DEFAULT_METRICS"]

#: The key of the cockpit's state in a Lightning checkpoint.
CHECKPOINT_KEY = "cockpit_like"

#: ``cockpit.log`` argument -> names looked up in ``trainer.callback_metrics`` (first found wins).
DEFAULT_METRICS = {
    "train_loss": ("train_loss", "train/loss"),
    "valid_loss": ("val_loss", "valid_loss", "val/loss", "validation_loss"),
    "test_loss": ("test_loss", "test/loss"),
    "train_accuracy": ("train_acc", "train_accuracy", "train/acc"),
    "valid_accuracy": ("val_acc", "val_accuracy", "valid_accuracy", "val/acc"),
    "test_accuracy": ("test_acc", "test_accuracy", "test/acc"),
}

_INFO_KEYS = ("individual_losses", "outputs", "batch_size", "sample_ids")


@contextlib.contextmanager
def _unequal_micro_batches_told():
    """A :class:`~cockpit_like.backends.partitions.PartitionError` (micro-batches of unequal rows in one step)
    with what to do under Lightning, whose loop the user does not write."""
    from cockpit_like.backends.partitions import PartitionError

    try:
        yield
    except PartitionError as error:
        raise PartitionError(
            f"{error} With Lightning (which divides each micro-batch's loss by accumulate_grad_batches, so a "
            "step of unequal micro-batches trains on a mean of their means, not on the step's mean): give the "
            "training DataLoader drop_last=True and a dataset whose size is a multiple of the batch size, or "
            "set accumulate_grad_batches=1."
        ) from error


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` (``self.optimizers()``), else ``optimizer``.

    The wrapper is an instance of the wrapped optimizer's class too (Lightning makes a subclass of both), so
    an ``isinstance`` test does not tell it; and its ``step`` counts an optimizer step (``global_step``): the
    cockpit's look-ahead through it trained every other step of a manual-optimization loop (outside trial
    19: 3 of 5 steps trained with ``max_steps=5``, a GAN 4 of 8)."""
    inner = getattr(optimizer, "_optimizer", None)
    if (isinstance(inner, torch.optim.Optimizer) and inner is not optimizer
            and type(optimizer).__module__.split(".")[0] in ("lightning", "pytorch_lightning")):
        return inner
    return optimizer


def _holds_any(optimizer: Any, params: Any) -> bool:
    """Whether ``optimizer`` steps any of ``params`` (True where it has no ``param_groups`` to tell)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return True
    held = {id(p) for group in groups for p in group.get("params", ())}
    return any(id(p) in held for p in params)


def _find_callback(trainer: Any) -> Any:
    for callback in getattr(trainer, "callbacks", None) or []:
        if isinstance(callback, _CockpitCallbackBase):
            return callback
    return None


class CockpitModule:
    """Mixin for a ``LightningModule`` (list it first among the bases).

    - Notes the info keys (``"individual_losses"``, ``"outputs"``) of the dict
      your ``training_step`` returns, for :class:`CockpitCallback`.
    - ``backward`` passes ``create_graph`` when the cockpit needs the graph.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the class's own training_step, or one it inherits from a base after the mixin (class
        # Tracked(CockpitModule, MyNet): pass, outside trial 19: the dict it returned was not seen)
        owner = next((klass for klass in cls.__mro__ if "training_step" in klass.__dict__), None)
        if owner is None or owner.__module__.split(".")[0] in ("lightning", "pytorch_lightning"):
            return  # (Lightning's own, which raises that it must be implemented)
        step = owner.__dict__["training_step"]
        if getattr(step, "_cockpit_noted", False):
            return

        @functools.wraps(step)
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            output = step(self, *args, **kwargs)
            self.cockpit_info(**{k: v for k, v in output.items() if k in _INFO_KEYS} if isinstance(output, Mapping) else {})
            # the loss as returned, before Lightning divides it by accumulate_grad_batches (and a GradScaler
            # scales it): the tensor the backpropagated one is computed from, so the cockpit can see the factor
            loss = output.get("loss") if isinstance(output, Mapping) else output
            self.__dict__["_cockpit_step_loss"] = loss if isinstance(loss, torch.Tensor) else None
            return output

        training_step._cockpit_noted = True
        cls.training_step = training_step

    def cockpit_info(self, **info: Any) -> None:
        """Give the cockpit ``info`` keys for the step being trained (e.g.
        ``individual_losses=``) from inside ``training_step``."""
        self.__dict__["_cockpit_pending_info"] = info

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        callback = _find_callback(getattr(self, "_trainer", None))
        if callback is not None and "create_graph" not in kwargs:
            kwargs["create_graph"] = callback.create_graph()
        super().backward(loss, *args, **kwargs)


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size is not None:
                return size
    return None


class _CockpitCallbackBase:
    """The callback's logic; :data:`CockpitCallback` adds the installed ``Callback`` bases."""

    def __init__(
        self,
        cockpit: Any,
        logpath: str | os.PathLike | None = None,
        metrics: Mapping[str, str | tuple[str, ...]] | None = None,
    ):
        from cockpit_like import Cockpit

        if not isinstance(cockpit, Cockpit):
            raise ValueError(
                f"CockpitCallback(cockpit): pass a cockpit_like.Cockpit built on the module's parameters, "
                f"got {type(cockpit).__name__}"
            )
        super().__init__()
        self.cockpit = cockpit
        self.logpath = logpath
        self.metrics = dict(DEFAULT_METRICS)
        for key, names in (metrics or {}).items():
            if key not in DEFAULT_METRICS:
                raise ValueError(f"CockpitCallback(metrics=...): {key!r} is not a cockpit.log figure; "
                                 f"use one of {', '.join(DEFAULT_METRICS)}")
            self.metrics[key] = (names,) if isinstance(names, str) else tuple(names)
        self._batch_size: int | None = None
        self._step: int | None = None
        self._micro_batches = (1, 1)  # (backward passes of the current optimizer step, accumulate_grad_batches)

    # ---- the step -----------------------------------------------------------------------
    def create_graph(self) -> bool:
        """Whether the step being trained needs ``loss.backward(create_graph=True)``."""
        return self._step is not None and self.cockpit.create_graph(self._step)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer, "accumulate_grad_batches", 1) != 1 and trainer.strategy.handles_gradient_accumulation:
            raise ValueError(
                f"CockpitCallback: accumulate_grad_batches={trainer.accumulate_grad_batches} with "
                f"{type(trainer.strategy).__name__}, which accumulates gradients itself: the callback cannot tell "
                "where its optimizer steps begin and end. Use a strategy that leaves accumulation to Lightning."
            )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # the rate this batch's optimizer step uses (a scheduler with interval "step" changes it after the step)
        self._step_learning_rate = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        self._batch_size = _batch_size(batch)
        self._step = trainer.global_step
        self._micro_batches = self._micro_batches_of_step(trainer, batch_idx)
        pl_module.__dict__.pop("_cockpit_pending_info", None)
        pl_module.__dict__.pop("_cockpit_step_loss", None)

    @staticmethod
    def _micro_batches_of_step(trainer: Any, batch_idx: int) -> tuple[int, int]:
        """``(k, K)``: the backward passes of the optimizer step that ``batch_idx`` belongs to, and
        ``accumulate_grad_batches`` (Lightning steps after ``K`` batches and after an epoch's last one)."""
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1))
        if accumulate == 1:
            return 1, 1
        first = batch_idx - batch_idx % accumulate  # the step's first batch in this epoch
        total = trainer.num_training_batches
        if total != float("inf"):
            return min(accumulate, int(total) - first), accumulate
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if progress.is_last_batch and batch_idx - first + 1 < accumulate:
            raise ValueError(
                f"CockpitCallback: the epoch ended after {batch_idx - first + 1} of the accumulate_grad_batches="
                f"{accumulate} batches of step {trainer.global_step}, and the training loader has no length, so the "
                "cockpit could not be told at the step's first batch. Give the loader a length (__len__), or make "
                "every epoch a multiple of accumulate_grad_batches batches."
            )
        return accumulate, accumulate

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        step = self._step = trainer.global_step
        micro_batches, accumulate = self._micro_batches
        # Lightning backpropagates the loss of training_step divided by accumulate_grad_batches
        info: dict[str, Any] = {"loss": loss * accumulate if accumulate != 1 else loss}
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if scaler is not None and scaler.is_enabled():  # precision="16-mixed": the loss here is scaled already
            info["grad_scaler"] = scaler
            info["loss"] = info["loss"] / scaler.get_scale()
        returned = pl_module.__dict__.pop("_cockpit_step_loss", None)
        if (
            returned is not None and returned is not loss and returned.grad_fn is not None
            and returned.shape == info["loss"].shape
            and torch.allclose(returned.detach(), info["loss"].detach().to(returned.dtype), rtol=1e-4, atol=1e-7)
        ):
            info["loss"] = returned  # upstream of the tensor Lightning backpropagates: the factor is seen
        if accumulate != 1:
            info["micro_batches"] = micro_batches
        if micro_batches != accumulate:  # a shorter last step: its gradient is k/K of its rows' mean gradient
            info["loss_scale"] = micro_batches / accumulate
        if self._batch_size is not None:
            info["batch_size"] = self._batch_size
        pending = pl_module.__dict__.pop("_cockpit_pending_info", None) or {}
        if len(trainer.optimizers) > 1 and "optimizer" not in pending:
            raise ValueError(
                f"CockpitCallback: the trainer has {len(trainer.optimizers)} optimizers, and the cockpit cannot tell "
                f"which one steps after the backward pass of step {step} (it checks that the gradients it reads are "
                "that step's, and its two-step quantities follow that optimizer's update). Say so in training_step, "
                "before self.manual_backward(loss): self.cockpit_info(optimizer=opt, ...) with opt from "
                "self.optimizers()."
            )
        if trainer.optimizers:
            info["optimizer"] = trainer.optimizers[0]
        info.update(pending)
        if "optimizer" in info:
            info["optimizer"] = _unwrapped(info["optimizer"])
            if not _holds_any(info["optimizer"], self.cockpit.params):
                # another network's step (a GAN's generator where the cockpit watches the discriminator): not
                # the cockpit's to track (outside trial 19: it stopped training, naming parameters without gradient)
                return
        losses = info.get("individual_losses")
        if isinstance(losses, torch.Tensor) and losses.dim() == 1:
            info["batch_size"] = len(losses)
        manual = not getattr(pl_module, "automatic_optimization", True)
        try:
            with _unequal_micro_batches_told():
                self.cockpit.begin(step, info=info)
        except MissingInfoError as error:
            if manual:  # the backward pass runs inside training_step: what it returns comes too late
                raise ValueError(
                    f"CockpitCallback: {error}. With Lightning's manual optimization the backward pass runs inside "
                    "training_step, before it returns: call self.cockpit_info("
                    f"{error.key}=...) in training_step before self.manual_backward(loss) (with the CockpitModule "
                    "mixin first among your LightningModule's bases)."
                ) from error
            raise ValueError(
                f"CockpitCallback: {error}. With Lightning: return {{'loss': ..., '{error.key}': ...}} from "
                "training_step and put the CockpitModule mixin first among your LightningModule's bases "
                f"(or call self.cockpit_info({error.key}=...) in training_step)."
            ) from error
        except StepAlreadyTrackedError as error:  # (a ValueError: before the one below)
            raise StepAlreadyTrackedError(
                f"{error} With Lightning: a second trainer.fit() with a new Trainer counts global_step from 0 "
                "again; to go on with this run, resume it (trainer.fit(module, ckpt_path=...) from a checkpoint "
                "saved with the CockpitCallback, whose step numbers go on), or fit again with the same Trainer; for "
                "a new run, give the new Trainer a new Cockpit and CockpitCallback."
            ) from error
        except ValueError as error:
            if manual and "x that mean" in str(error) and "loss" not in pending:
                raise ValueError(
                    f"CockpitCallback: {error} With Lightning's manual optimization the cockpit takes the tensor "
                    "given to self.manual_backward as info['loss']: where you accumulate K micro-batches with "
                    "self.manual_backward(loss / K), declare the mean loss and the micro-batches before it: "
                    "self.cockpit_info(loss=loss, micro_batches=K, individual_losses=losses, optimizer=opt)."
                ) from error
            raise

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        step = self.cockpit.open_step
        if step is None:
            return
        if self.cockpit.create_graph(step) and not any(
            p.grad is not None and p.grad.requires_grad for p in self.cockpit.params
        ):
            error = RuntimeError(
                f"CockpitCallback: step {step} needs loss.backward(create_graph=True) (a quantity uses the "
                "graph) but Lightning's backward pass did not keep it. Put the CockpitModule mixin first "
                "among your LightningModule's bases, or pass create_graph=callback.create_graph() in your "
                "own backward()."
            )
            self.cockpit.end(error)
            raise error
        with _unequal_micro_batches_told():
            self.cockpit.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.cockpit.open_step is not None:
            self.cockpit.end(exception)

    # ---- epoch figures ---------------------------------------------------------------------
    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or trainer.global_step == 0:
            return
        found = {}
        metrics = trainer.callback_metrics
        for key, names in self.metrics.items():
            for name in names:
                if name in metrics:
                    value = metrics[name]
                    found[key] = float(value.item() if isinstance(value, torch.Tensor) else value)
                    break
        # the rate of the last trained step (global_step - 1), not the one the scheduler set for the next
        learning_rate = getattr(self, "_step_learning_rate", None)
        if learning_rate is None and trainer.optimizers:
            learning_rate = trainer.optimizers[0].param_groups[0]["lr"]
        self.cockpit.log(trainer.global_step - 1, epoch_count=trainer.current_epoch, learning_rate=learning_rate, **found)

    # ---- checkpoints and the end -----------------------------------------------------------
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = self.cockpit.state_dict()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if CHECKPOINT_KEY not in checkpoint:
            raise ValueError(
                f"CockpitCallback: the checkpoint has no {CHECKPOINT_KEY!r} entry (it was saved without a "
                "CockpitCallback); resume without the callback, or from a checkpoint saved with it."
            )
        self.cockpit.load_state_dict(checkpoint[CHECKPOINT_KEY])

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.logpath is not None:
            self.cockpit.write(self.logpath)


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for package in ("lightning.pytorch", "pytorch_lightning"):
        try:
            module = __import__(package, fromlist=["Callback"])
        except ImportError:
            continue
        bases.append(module.Callback)
    if not bases:
        raise ImportError("CockpitCallback needs Lightning: pip install cockpit_like[lightning]")
    return tuple(bases)


@functools.cache
def _callback_class() -> type:
    return type(
        "CockpitCallback",
        (_CockpitCallbackBase, *_callback_bases()),
        {"__doc__": _CALLBACK_DOC, "__module__": __name__},
    )


_CALLBACK_DOC = """Tracks a cockpit around Lightning's backward pass (see the module docstring).

    Args:
        cockpit: the :class:`~cockpit_like.Cockpit` on the module's parameters.
        logpath: write the log there (``logpath + ".json"``) when ``fit`` ends.
        metrics: ``{cockpit.log figure: name or names in trainer.callback_metrics}``,
            replacing entries of :data:`DEFAULT_METRICS`.
    """


def __getattr__(name: str) -> Any:
    if name == "CockpitCallback":  # built on first use: importing this module does not import Lightning
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
