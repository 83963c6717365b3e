"""What the optimizer step used: :class:`LearningRate`, :class:`Momentum`, :class:`BatchSize`."""

from __future__ import annotations

from cockpit_like.quantities.quantity import ByproductQuantity

__all__ = ["LearningRate", "Momentum", "BatchSize"]


class LearningRate(ByproductQuantity):
    """The learning rate of ``info["optimizer"]`` at the tracked step: ``param_groups[g]["lr"]``.

    Stored as a float when every parameter group has the same learning
    rate, else as the list of the groups' rates. Read before the optimizer
    step, so it is the rate of the update that starts at this step (what a
    scheduler set). Nothing is stored at steps whose ``info`` has no
    ``optimizer`` (it is optional here), so the quantity is free to add to
    any run; the diagnosis rules read it like ``cockpit.log(learning_rate=...)``.

    Example::

        cockpit = Cockpit(params, quantities=[LearningRate(linear(1)), ...])
        with cockpit(step, info={"optimizer": optimizer, ...}): ...
        cockpit.get_output()[step]["LearningRate"]   # 0.1
    """

    def _compute(self, global_step, params, batch_loss):
        from cockpit_like import context

        optimizer = context.get_record(global_step).info.get("optimizer")
        groups = getattr(optimizer, "param_groups", None)
        if not groups:
            return None
        rates = [float(group["lr"]) for group in groups if "lr" in group]
        if not rates:
            return None
        return rates[0] if len(set(rates)) == 1 else rates


class Momentum(ByproductQuantity):
    """The heavy-ball momentum ``beta`` of ``info["optimizer"]`` at the tracked step, for the stability
    bound ``learning_rate * HessMaxEV < 2 (1 + beta)`` of ``sharpness-above-stability``.

    Stored as a float: ``param_groups[g]["momentum"]`` of SGD-like optimizers
    (0 without momentum; the largest over the groups), NaN for adaptive
    optimizers (Adam, AdamW, RMSprop, Adagrad: they precondition the
    curvature, so the bound does not apply as such). Nothing is stored
    without an optimizer in ``info``.
    """

    _ADAPTIVE = ("betas", "alpha", "lr_decay", "rho")

    def _compute(self, global_step, params, batch_loss):
        from cockpit_like import context

        optimizer = context.get_record(global_step).info.get("optimizer")
        groups = getattr(optimizer, "param_groups", None)
        if not groups:
            return None
        if any(key in group for group in groups for key in self._ADAPTIVE):
            return float("nan")
        return max(float(group.get("momentum", 0.0) or 0.0) for group in groups)


class BatchSize(ByproductQuantity):
    """The number of samples of the tracked optimizer step: ``info["batch_size"]``.

    Under gradient accumulation and on several ranks this is the step's whole
    batch (every micro-batch and rank; see ``docs/your_training_loop.md`` and
    ``docs/distributed.md``), the batch the update averages over. Stored as an
    int; nothing is stored at steps whose ``info`` has no ``batch_size`` (it is
    optional here; a value that is not a positive whole number is an error when the
    step opens). The ``small-batch`` diagnosis rule reads it.

    Example::

        cockpit = Cockpit(params, quantities=[BatchSize(linear(1)), ...])
        with cockpit(step, info={"batch_size": len(x), ...}): ...
        cockpit.get_output()[step]["BatchSize"]   # 32
    """

    def _compute(self, global_step, params, batch_loss):
        from cockpit_like import context

        value = context.get_record(global_step).info.get("batch_size")  # checked when the step opened
        return None if value is None else int(value)
