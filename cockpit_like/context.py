"""What the cockpit knows about the step being tracked.

The cockpit builds one :class:`StepRecord` per tracked step and hands it to
the quantities. The module-level getters (``get_batch_size`` and friends) are
the view that Cockpit-style plugins use; they are valid only while the
quantities of that step are tracked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "StepRecord",
    "MissingInfoError",
    "get_record",
    "get_batch_size",
    "get_individual_losses",
    "get_loss",
    "get_optimizer",
]

#: The info keys the cockpit knows, with what each holds.
INFO_KEYS = {
    "batch_size": "int, the number of samples in the mini-batch",
    "individual_losses": "1-D tensor of the per-sample losses",
    "loss": "the mini-batch loss tensor (mean reduction)",
    "optimizer": "the torch.optim.Optimizer that updates the parameters",
    "sample_ids": "optional, one id per row of this backward pass (a 1-D int tensor such as the dataset "
    "indices, or a list of ints or strings); concatenated over micro-batches and ranks like individual_losses",
    "micro_batches": "int, the number of backward passes (micro-batches) of this optimizer step "
    "(gradient accumulation, docs/your_training_loop.md; default 1)",
    "backward_passes": "int, the backward calls inside one cockpit block (two losses backpropagated one after "
    "the other with retain_graph=True: 2); their rows are summed from the first step on (default 1)",
    "grad_scaler": "the torch.amp.GradScaler whose scaled loss is backpropagated (mixed precision)",
    "loss_scale": "a constant factor on the backpropagated loss besides the division by micro_batches (default 1)",
    "outputs": "the tensor the cross-entropy loss is computed from (logits, classes in the last "
    "dimension, with the graph), e.g. outputs.logits[:, :-1] for a causal language model; with "
    "fisher='type-2', loss='mse': the predictions MSELoss compares with the targets",
}


class MissingInfoError(KeyError):
    """A quantity needs an ``info`` key that was not passed to the cockpit."""

    def __init__(self, key: str, needed_by: str, global_step: int | None = None):
        self.key = key
        self.needed_by = needed_by
        self.global_step = global_step
        super().__init__(key)

    def __str__(self) -> str:
        what = INFO_KEYS.get(self.key, "")
        at = f" at step {self.global_step}" if self.global_step is not None else ""
        return (
            f"{self.needed_by} needs info[{self.key!r}]{at} ({what}), but it was not given. "
            f"Pass it via info=, e.g. `with cockpit(step, info={{{self.key!r}: ...}}):`"
        )


_REQUIRED = object()  # no default: a missing statistic is an error


@dataclass
class StepRecord:
    """Everything a quantity may read about one tracked step.

    Attributes:
        global_step: the step.
        info: the ``info`` dict given to the cockpit.
        params: the tracked parameters, in the order given to the cockpit.
        stats: results of per-sample statistics, keyed by the statistic.
        loss_is_finite: False when ``info["loss"]`` is NaN or infinite.
        live_params: the cockpit's own parameter tensors (``params`` may be whole stand-ins of
            sharded ones, FSDP2); a quantity that keeps parameters to read them at a later step keeps these.
    """

    global_step: int
    info: dict[str, Any]
    params: list[torch.Tensor]
    stats: dict[Any, Any] = field(default_factory=dict)
    loss_is_finite: bool = True
    live_params: list[torch.Tensor] | None = None
    #: what the quantities say about their numbers at this step (the step's ``checks["notes"]``)
    notes: list[str] = field(default_factory=list)
    #: the name (in the cockpit) of the quantity being computed
    quantity: str | None = None
    #: ``{quantity name: {"standard_error", "estimator", "samples", "reliable"}}`` of the estimated values (the
    #: step's ``checks["standard_errors"]``)
    standard_errors: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the step finished when ``info["optimizer"]`` began its step: ``p.grad`` is what it steps with
    at_optimizer_step: bool = False
    #: how far (relative) the gradient self-check let the per-sample rows be from ``p.grad`` at this step (0: not
    #: checked): 5e-2 where the rows came in half precision (autocast), the float32 or float64 tolerance otherwise
    rows_tolerance: float = 0.0
    #: the block ran inside ``info["optimizer"]``'s ``step(closure)`` (Lightning's automatic optimization), or the
    #: optimizer needs a closure: a quantity cannot wait for its step there
    inside_optimizer_step: bool = False
    #: the name of a backward hook of the user's that returned a new gradient in this step's backward pass (the
    #: gradients and the curvature's products hold what it did), else ``None``
    gradient_hook: str | None = None

    def hooked_gradient_cause(self) -> str | None:
        """Where :attr:`gradient_hook` is set: the sentence that names it as the cause of products that are not
        the loss's Hessian's (outside trial 34: a hook doubling an activation's gradient left HessTrace and
        HessMaxEV out with a reason that named fused weight norms and LayerNorm, which the model did not have)."""
        if self.gradient_hook is None:
            return None
        return (
            f"A backward hook of yours ({self.gradient_hook}) returned a new gradient in this step's backward pass "
            "(see the step's notes): the products differentiate the gradients' graph, which holds what the hook "
            "did, so they are not the loss's Hessian's. Change the gradients after the cockpit's block (on p.grad, "
            "before the optimizer's step) instead of in a hook"
        )

    def note(self, text: str) -> None:
        """Say something about this step's numbers in its ``checks["notes"]`` (where a quantity cannot be
        sure its number is right)."""
        if text not in self.notes:
            self.notes.append(text)

    def standard_error(self, error: float, estimator: str, samples: int, reliable: bool, owner: str) -> None:
        """Keep the standard error of the value the current quantity stores at this step (its step's
        ``checks["standard_errors"]``, in the log beside the value); ``owner`` names the quantity where the
        cockpit does not (outside tracking by a cockpit)."""
        self.standard_errors[self.quantity or owner] = {
            "standard_error": float(error), "estimator": estimator, "samples": int(samples), "reliable": bool(reliable),
        }

    def require(self, key: str, needed_by: str) -> Any:
        """``info[key]``, or a :class:`MissingInfoError` naming ``needed_by``."""
        try:
            return self.info[key]
        except KeyError:
            raise MissingInfoError(key, needed_by, self.global_step) from None

    def stat(self, spec: Any, default: Any = _REQUIRED) -> Any:
        """The result of a per-sample statistic requested for this step; ``default`` (if given) where the
        step left it out (``Quantity.works_without_per_sample_stats``)."""
        try:
            return self.stats[spec]
        except KeyError:
            if default is not _REQUIRED:
                return default
            raise KeyError(
                f"per-sample statistic {spec!r} was not computed at step {self.global_step}; "
                "return it from the quantity's per_sample_stats(global_step)"
            ) from None


_ACTIVE: StepRecord | None = None


def _activate(record: StepRecord | None) -> None:
    global _ACTIVE
    _ACTIVE = record


def get_record(global_step: int) -> StepRecord:
    """The record of the step being tracked.

    Raises:
        RuntimeError: called outside tracking, or for another step.
    """
    if _ACTIVE is None:
        raise RuntimeError(
            "step information is only available while a cockpit tracks quantities "
            "(inside the exit of `with cockpit(step, info=...)`)"
        )
    if _ACTIVE.global_step != global_step:
        raise RuntimeError(
            f"asked for step {global_step}, but the cockpit is tracking step "
            f"{_ACTIVE.global_step}"
        )
    return _ACTIVE


def _get(global_step: int, key: str) -> Any:
    return get_record(global_step).require(key, "this quantity")


def get_batch_size(global_step: int) -> int:
    """``info["batch_size"]`` of the tracked step."""
    return _get(global_step, "batch_size")


def get_individual_losses(global_step: int) -> torch.Tensor:
    """``info["individual_losses"]`` of the tracked step."""
    return _get(global_step, "individual_losses")


def get_loss(global_step: int) -> torch.Tensor:
    """``info["loss"]`` of the tracked step."""
    return _get(global_step, "loss")


def get_optimizer(global_step: int) -> torch.optim.Optimizer:
    """``info["optimizer"]`` of the tracked step."""
    return _get(global_step, "optimizer")
