"""Hugging Face: a cockpit around the backward pass that ``transformers.Trainer`` owns.

::

    from cockpit_like import Cockpit
    from cockpit_like.integrations.transformers import CockpitCallback, CockpitTrainer

    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    trainer = CockpitTrainer(model=model, args=args, train_dataset=train,
                             callbacks=[CockpitCallback(cockpit, logpath="runs/hf")])
    trainer.train()

Why two pieces: the ``Trainer`` computes the loss and calls ``backward`` inside
``Trainer.training_step``, and no ``TrainerCallback`` event sits between the
loss and the backward pass (``on_step_begin`` comes before the forward pass,
``on_pre_optimizer_step`` after gradient clipping). So
:class:`CockpitTrainerMixin` (``CockpitTrainer`` is ``Trainer`` with it)
overrides the two methods the ``Trainer`` documents for subclassing:

- ``compute_loss`` (during ``training_step`` only): calls the ``Trainer``'s own
  ``compute_loss`` for the loss and the outputs, computes the per-sample
  losses from them (:func:`individual_losses`), and opens the step:
  ``cockpit.begin(state.global_step, info={"loss", "individual_losses",
  "batch_size", "optimizer"})``; a ``"sample_ids"`` key of the batch (a data
  set column of row ids, kept with ``remove_unused_columns=False``) is taken
  out of the inputs before the model sees them and passed as
  ``info["sample_ids"]`` (the rows' ids of the loss-spike post-mortem,
  ``docs/spikes.md``);
- ``training_step``: runs the ``Trainer``'s step (forward, ``backward``) and
  closes the step with ``cockpit.end()`` (``end(error)`` if it failed). When
  the cockpit needs the graph at this step, the accelerator's ``backward`` is
  given ``create_graph=True`` for the duration of the call.

:class:`CockpitCallback` does the rest: ``cockpit.log`` with the evaluation
figures (``eval_loss``, ``eval_accuracy``) under the last trained step;
``cockpit_state.pt`` (the cockpit's ``state_dict()``) in every checkpoint
folder; ``trainer.train(resume_from_checkpoint=...)`` (a folder or ``True``)
restores it; the log is written to ``logpath`` when training ends.

Per-sample losses (:func:`individual_losses`), from ``outputs.logits`` and
``inputs["labels"]``, with the mean equal to the ``Trainer``'s loss (checked):

- logits ``[B, C]`` (sequence classification): cross-entropy per row scaled
  by ``B / N``, ``N`` the ``Trainer``'s ``num_items_in_batch`` if given, else
  the counted labels (``-100`` ignored); one output column: squared error
  (regression); float labels shaped like the logits: binary cross-entropy,
  averaged per row (multi-label);
- logits ``[B, T, V]`` (causal LM): the next-token losses of each row summed
  over its counted tokens (labels shifted by one, ``-100`` ignored) and scaled
  by ``B / N`` with ``N`` the counted tokens of the batch, as the ``Trainer``
  counts them (``num_items_in_batch``); or with the labels as they are (a
  seq2seq decoder), whichever matches the loss;
- with ``label_smoothing_factor`` (the ``Trainer``'s ``LabelSmoother``): the
  same with ``F.cross_entropy(..., label_smoothing=e)`` per token.

A model may accept ``num_items_in_batch`` and ignore it: where the rule with
it does not match the loss, the rule over the micro-batch's own count is
tried. Anything else: pass ``CockpitCallback(individual_losses=fn)`` with
``fn(outputs, inputs) -> [B]``.

Gradient accumulation (``gradient_accumulation_steps=K``): a tracked step is
one optimizer step. Each micro-batch's ``begin`` gets the same
``state.global_step`` and ``info["micro_batches"]`` = the backward passes of
the step (the ``Trainer``'s ``current_gradient_accumulation_steps``: ``K``,
fewer in an epoch's last step); the quantities are computed after the last
one and equal one pass over the step's rows. The cockpit's convention is
that each micro-batch backpropagates ``mean(individual_losses) / k``. The
``Trainer`` (transformers 5.23) divides the loss by ``k`` unless it counts as
scaled for accumulation (``Trainer.loss_is_scaled_for_ga``; by default when
``num_items_in_batch``, the labels counted over the whole step, reached a
model that accepts loss kwargs, or a ``compute_loss_func`` is given):

- divided: ``info["loss"]`` and the per-sample losses as they are (the
  micro-batches of a step must then have equal rows: a mean of their means
  is not the step's mean);
- not divided, and the loss normalised over the step: both times
  ``B_step / B_k`` (the step's rows over the micro-batch's, noted from the
  ``Trainer``'s ``get_batch_samples``; ``k`` for equal micro-batches), so
  that each micro-batch backpropagates its own mean loss weighted by its
  share of the step's rows, which the cockpit accepts for unequal
  micro-batches; the per-row losses are the rows' token sums times
  ``B_step / N``, so rows with different numbers of tokens are exact too;
- not divided, but the loss is the micro-batch's own mean (BERT's
  classifier ignores ``num_items_in_batch``): the accumulated gradient is
  ``k`` times the mean gradient, an error that says to set
  ``trainer.loss_is_scaled_for_ga = False``; divided *and* normalised over
  the step (``1 / k`` of it): an error too.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CockpitCallback", "CockpitTrainer", "CockpitTrainerMixin", "individual_losses", "STATE_FILE"]

#: The cockpit's state in a ``Trainer`` checkpoint folder.
STATE_FILE = "cockpit_state.pt"


def individual_losses(outputs: Any, inputs: dict[str, Any], num_items_in_batch: Any = None, smoothing: float = 0.0,
                      shift: bool = True) -> torch.Tensor:
    """One loss per row of the batch whose mean is the ``Trainer``'s loss (see the module docstring).

    ``smoothing``: the ``Trainer``'s ``label_smoothing_factor`` (its ``LabelSmoother``: ``(1 - e)`` times the
    token's negative log-likelihood plus ``e`` times the mean over the classes of ``-log p``, which is
    ``F.cross_entropy(..., label_smoothing=e)``). ``shift``: for logits ``[B, T, V]``, whether the labels are the
    next tokens (a causal LM), else aligned with the logits (a seq2seq decoder, token classification)."""
    logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else getattr(outputs, "logits", None)
    labels = inputs.get("labels")
    if logits is None or labels is None:
        raise ValueError(
            "CockpitCallback: cannot compute per-sample losses without outputs.logits and inputs['labels']; "
            "pass CockpitCallback(individual_losses=fn) with fn(outputs, inputs) -> one loss per row"
        )
    if logits.dim() == 2:
        if labels.is_floating_point() and labels.shape == logits.shape:
            return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(1)
        if logits.shape[1] == 1:
            return (logits.squeeze(1) - labels.to(logits.dtype)) ** 2
        per_row = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none", label_smoothing=smoothing)
        count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
        count = torch.as_tensor(count, dtype=per_row.dtype, device=per_row.device)
        return per_row * (labels.shape[0] / count)
    if logits.dim() == 3 and labels.dim() == 2:
        shifted, logits = (labels[:, 1:], logits[:, :-1]) if shift else (labels, logits)
        per_token = F.cross_entropy(logits.transpose(1, 2), shifted, ignore_index=-100, reduction="none",
                                    label_smoothing=smoothing)
        count = num_items_in_batch if num_items_in_batch is not None else (shifted != -100).sum()
        count = torch.as_tensor(count, dtype=per_token.dtype, device=per_token.device)
        return per_token.sum(1) * (labels.shape[0] / count)
    raise ValueError(
        f"CockpitCallback: no per-sample loss rule for logits of shape {list(logits.shape)} with labels of shape "
        f"{list(labels.shape)}; pass CockpitCallback(individual_losses=fn) with fn(outputs, inputs) -> [B]"
    )


class _CockpitCallbackBase:
    """The callback's logic; :data:`CockpitCallback` adds ``transformers.TrainerCallback`` as a base."""

    def __init__(
        self,
        cockpit: Any,
        logpath: str | os.PathLike | None = None,
        individual_losses: Callable[[Any, dict], torch.Tensor] | None = None,
    ):
        from cockpit_like import Cockpit

        if not isinstance(cockpit, Cockpit):
            raise ValueError(
                f"CockpitCallback(cockpit): pass a cockpit_like.Cockpit built on the model's parameters, "
                f"got {type(cockpit).__name__}"
            )
        self.cockpit = cockpit
        self.logpath = logpath
        self.individual_losses = individual_losses
        self.trainer: Any = None  # set by CockpitTrainerMixin
        self.resume_from: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise RuntimeError(
                "CockpitCallback needs a Trainer that opens the cockpit's step around its backward pass: use "
                "cockpit_like.integrations.transformers.CockpitTrainer instead of Trainer, or put "
                "CockpitTrainerMixin first among the bases of your Trainer subclass"
            )
        if self.resume_from is not None:
            path = Path(self.resume_from) / STATE_FILE
            if not path.is_file():
                raise FileNotFoundError(
                    f"CockpitCallback: {path} is missing: the checkpoint was saved without a CockpitCallback. "
                    "Resume from a checkpoint saved with it, or train without the callback."
                )
            self.cockpit.load_state_dict(torch.load(path, weights_only=True))
            self.resume_from = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the rate this optimizer step uses (the Trainer's scheduler changes it after the step)
        optimizer = kwargs.get("optimizer")
        self.step_learning_rate = optimizer.param_groups[0]["lr"] if optimizer is not None else None

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict | None = None, **kwargs: Any) -> None:
        if not metrics or state.global_step == 0:
            return
        figures = {"valid_loss": metrics.get("eval_loss"), "valid_accuracy": metrics.get("eval_accuracy")}
        # the rate of the last trained step (global_step - 1), not the one the scheduler set for the next
        learning_rate = getattr(self, "step_learning_rate", None)
        optimizer = kwargs.get("optimizer")
        if learning_rate is None and optimizer is not None:
            learning_rate = optimizer.param_groups[0]["lr"]
        self.cockpit.log(state.global_step - 1, epoch_count=state.epoch, learning_rate=learning_rate,
                         **{k: float(v) for k, v in figures.items() if v is not None})

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.cockpit.state_dict(), folder / STATE_FILE)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.logpath is not None and state.is_world_process_zero:
            self.cockpit.write(self.logpath)


class CockpitTrainerMixin:
    """Put first among the bases of a ``transformers.Trainer`` subclass (see the module docstring)."""

    def _cockpit_callback(self) -> Any:
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, _CockpitCallbackBase):
                return callback
        return None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        callback = self._cockpit_callback()
        if callback is not None:
            _check_overrides(type(self))
            callback.trainer = self
            path = resume_from_checkpoint
            if path is True:
                from transformers.trainer_utils import get_last_checkpoint

                path = get_last_checkpoint(self.args.output_dir)
            callback.resume_from = os.fspath(path) if path else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """The ``Trainer``'s micro-batches of one optimizer step; the cockpit notes their rows (see ``compute_loss``)."""
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._cockpit_step_rows = _rows_of(batches)
        return batches, count

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        callback = self._cockpit_callback()
        if callback is None:
            return super().training_step(model, inputs, num_items_in_batch)
        cockpit = callback.cockpit
        accelerator = self.accelerator
        wrapped = cockpit.create_graph(self.state.global_step)
        if wrapped:
            backward = accelerator.backward

            def backward_with_graph(loss: torch.Tensor, **backward_kwargs: Any) -> Any:
                backward_kwargs.setdefault("create_graph", True)
                return backward(loss, **backward_kwargs)

            accelerator.backward = backward_with_graph
        self._cockpit_training = True
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException as error:
            if cockpit.open_step is not None:
                cockpit.end(error)
            raise
        finally:
            self._cockpit_training = False
            if wrapped:
                del accelerator.backward  # the instance attribute; the class's method is back
        if cockpit.open_step is not None:
            with _unequal_micro_batches_told():
                cockpit.end()
        return loss

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        callback = self._cockpit_callback()
        # the rows' ids (a "sample_ids" column, with remove_unused_columns=False): the cockpit's, never the model's
        ids = inputs.pop("sample_ids", None) if isinstance(inputs, dict) else None
        if callback is None or not getattr(self, "_cockpit_training", False):
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        seen = dict(inputs)  # the Trainer may pop "labels" from inputs
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        # the backward passes of this optimizer step: gradient_accumulation_steps, fewer in an epoch's last step
        micro_batches = int(getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps))
        divides = self._cockpit_trainer_divides(num_items_in_batch)
        smoother = getattr(self, "label_smoother", None)
        smoothing = float(getattr(smoother, "epsilon", 0.0)) if getattr(self, "compute_loss_func", None) is None else 0.0
        losses, over_step = self._cockpit_individual_losses(callback, outputs, seen, loss, num_items_in_batch, divides,
                                                            smoothing)
        info_loss = loss
        if micro_batches > 1:
            if not divides and not over_step:
                raise ValueError(
                    f"CockpitCallback: step {self.state.global_step} accumulates {micro_batches} micro-batches, and "
                    "the Trainer does not divide their losses by that number (it passes num_items_in_batch to a model "
                    "that accepts loss kwargs, or has a compute_loss_func), but this model's loss is the mean over "
                    f"its own micro-batch: the accumulated gradient is {micro_batches} times the step's mean gradient. "
                    "Set trainer.loss_is_scaled_for_ga = False (the Trainer then divides each loss by the number of "
                    "micro-batches), or use a loss that honours num_items_in_batch."
                )
            if divides and over_step:
                raise ValueError(
                    f"CockpitCallback: step {self.state.global_step} accumulates {micro_batches} micro-batches; the "
                    "model's loss is already normalised over the whole step (num_items_in_batch), and the Trainer "
                    f"divides it by {micro_batches} again (loss_is_scaled_for_ga is False): the accumulated gradient "
                    f"is 1/{micro_batches} of the step's mean gradient. Leave loss_is_scaled_for_ga at None or True."
                )
            if over_step:
                # loss_k = S_k / N (this micro-batch's token sums over the step's N counted labels) is the step's
                # mean loss weighted by this micro-batch's share of the step's rows, B_k / B_step: the per-row
                # losses of the step (row sums times B_step / N) and their mean over this micro-batch are
                # loss_k's and losses' times B_step / B_k (K for equal micro-batches; unequal rows and tokens too)
                rows = getattr(self, "_cockpit_step_rows", None)
                share = rows / len(losses) if rows and rows >= len(losses) else micro_batches
                losses, info_loss = losses * share, loss * share
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper -> torch's
        info = {"loss": info_loss, "individual_losses": losses, "batch_size": len(losses), "optimizer": optimizer,
                "micro_batches": micro_batches}
        logits = _logits_of(outputs)
        if logits is not None:  # TIC's GGN diagonal reads them (and checks that the loss is their cross-entropy)
            info["outputs"] = logits
        if ids is not None:
            info["sample_ids"] = ids
        with _unequal_micro_batches_told():
            callback.cockpit.begin(self.state.global_step, info=info)
        return (loss, outputs) if return_outputs else loss

    def _cockpit_trainer_divides(self, num_items_in_batch: Any) -> bool:
        """Whether ``Trainer.training_step`` divides this loss by the step's micro-batches (transformers
        5.x: unless ``loss_is_scaled_for_ga``, by default ``True`` where ``num_items_in_batch`` reached the
        model's loss or a ``compute_loss_func`` computed it)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or (
                getattr(self, "compute_loss_func", None) is not None
            )
        return not scaled

    @staticmethod
    def _cockpit_individual_losses(callback: Any, outputs: Any, inputs: dict, loss: torch.Tensor,
                                   num_items_in_batch: Any, divides: bool,
                                   smoothing: float = 0.0) -> tuple[torch.Tensor, bool]:
        """Per-sample losses whose mean is ``loss``, and whether ``loss`` is normalised over the whole
        optimizer step (``num_items_in_batch``) rather than over this micro-batch.

        The built-in rules try the step's count first, then the micro-batch's own (a model that accepts
        ``num_items_in_batch`` need not use it), each with the labels as next tokens (a causal LM) and then as
        they are (a seq2seq decoder), with the ``Trainer``'s label smoothing (``smoothing``);
        ``individual_losses=fn`` follows the Trainer's convention.
        """
        if callback.individual_losses is not None:
            rules = [(lambda: callback.individual_losses(outputs, inputs), not divides)]
        else:
            counts = [num_items_in_batch, None] if num_items_in_batch is not None else [None]
            rules = [(functools.partial(individual_losses, outputs, inputs, count, smoothing, shift), count is not None)
                     for count in counts for shift in (True, False)]
        first = None
        for rule, over_step in rules:
            losses = rule()
            mean = losses.detach().mean()
            first = mean if first is None else first
            if torch.isclose(mean.to(loss.dtype), loss.detach(), rtol=1e-5, atol=1e-7):
                return losses, over_step
        raise ValueError(
            f"CockpitCallback: the per-sample losses average to {float(first):.6g}, but the Trainer's loss is "
            f"{float(loss.detach()):.6g}; the cockpit needs losses whose mean is the loss. Pass "
            "CockpitCallback(individual_losses=fn) with fn(outputs, inputs) -> [B] for this model's loss."
        )


def _logits_of(outputs: Any) -> torch.Tensor | None:
    """The model output's ``logits`` (a ``ModelOutput`` or a dict), else ``None``."""
    try:
        logits = outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else None
    except (KeyError, TypeError):
        logits = None
    logits = getattr(outputs, "logits", None) if logits is None else logits
    return logits if isinstance(logits, torch.Tensor) and logits.grad_fn is not None else None


def _check_overrides(cls: type) -> None:
    """The mixin's ``compute_loss`` and ``training_step`` open and close the cockpit's step: a class before the
    mixin in ``cls``'s bases that defines one of them bypasses it, and the cockpit would record nothing, with no
    error (outside trial 19: ``class T(CockpitTrainerMixin, Trainer)`` with its own ``compute_loss`` trained three
    steps and logged none)."""
    order = cls.__mro__
    mixin = order.index(CockpitTrainerMixin)
    for name in ("compute_loss", "training_step"):
        owners = [klass for klass in order[:mixin] if name in klass.__dict__]
        if owners:
            owner = owners[0]
            raise TypeError(
                f"CockpitTrainerMixin: {owner.__qualname__} defines {name}, which comes before the mixin's in "
                f"{cls.__qualname__}'s bases, so the cockpit's step is never opened around the backward pass and "
                f"nothing would be recorded. Define {name} in a Trainer subclass of your own and put the mixin "
                f"first among the bases of a class built on it: class MyTrainer(Trainer): def {name}(...): ...; "
                f"class TrackedTrainer(CockpitTrainerMixin, MyTrainer): pass (the mixin calls your {name} "
                "through super())."
            )


@contextlib.contextmanager
def _unequal_micro_batches_told():
    """A :class:`~cockpit_like.backends.partitions.PartitionError` (micro-batches of unequal rows in one step)
    with what to do under the ``Trainer``, whose loop the user does not write."""
    from cockpit_like.backends.partitions import PartitionError

    try:
        yield
    except PartitionError as error:
        raise PartitionError(
            f"{error} With the Trainer: where it divides each micro-batch's loss by the micro-batches (a model "
            "whose loss ignores num_items_in_batch, with loss_is_scaled_for_ga = False), a step of unequal "
            "micro-batches trains on a mean of their means: pass TrainingArguments(dataloader_drop_last=True) "
            "and a dataset whose size is a multiple of the batch size, or use a loss normalised over the step "
            "(num_items_in_batch), which may have unequal micro-batches."
        ) from error


def _rows_of(batches: list) -> int | None:
    """The rows of an optimizer step's micro-batches (each batch's ``labels``, else its first tensor, along
    dimension 0); ``None`` where a batch has none."""
    total = 0
    for batch in batches:
        if not isinstance(batch, dict):
            return None
        tensor = batch.get("labels")
        if not isinstance(tensor, torch.Tensor):
            tensor = next((value for value in batch.values() if isinstance(value, torch.Tensor) and value.dim()), None)
        if tensor is None or not tensor.dim():
            return None
        total += int(tensor.shape[0])
    return total or None


@functools.cache
def _classes() -> dict[str, type]:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("the Hugging Face integration needs transformers: pip install cockpit_like[transformers]") from error
    callback = type("CockpitCallback", (_CockpitCallbackBase, transformers.TrainerCallback), {
        "__doc__": """Cockpit events of a ``transformers.Trainer`` run (see the module docstring).

    Args:
        cockpit: the :class:`~cockpit_like.Cockpit` on the model's parameters.
        logpath: write the log there (``logpath + ".json"``) when training ends.
        individual_losses: ``fn(outputs, inputs) -> [B]`` per-sample losses whose
            mean is the loss (default: :func:`individual_losses`).
    """,
        "__module__": __name__,
    })
    trainer = type("CockpitTrainer", (CockpitTrainerMixin, transformers.Trainer), {
        "__doc__": "``transformers.Trainer`` with :class:`CockpitTrainerMixin`.",
        "__module__": __name__,
    })
    return {"CockpitCallback": callback, "CockpitTrainer": trainer}


def __getattr__(name: str) -> Any:
    if name in ("CockpitCallback", "CockpitTrainer"):  # built on first use: importing this module imports no transformers
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
