"""How far the parameters move: from the start (Distance) and per update (UpdateSize)."""

from __future__ import annotations

import torch

from cockpit_like.functional.tensor_lists import differences, norms
from cockpit_like.quantities.quantity import TwoStepQuantity, parameter_snapshot

__all__ = ["Distance", "UpdateSize"]


def _block_norms(params: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    return norms(differences(params, reference)).tolist()  # a group of differences at a time


class Distance(TwoStepQuantity):
    """Per-parameter L2 distance to the initial parameters, ``[||theta_t,p - theta_0,p|| for p]``.

    The reference ``theta_0`` is taken at the first step the cockpit is entered
    (Cockpit insists on step 0; starting later is not an error here), and kept
    for the whole run, also where that step failed a self-check and stores
    nothing (its parameters are right). Stored under every scheduled step.
    """

    SAVE_SHIFT = 0
    reads_parameters = True
    starts_on_parameters = True

    def __init__(self, track_schedule, verbose: bool = False):
        super().__init__(track_schedule, verbose=verbose)
        self._reference_step: int | None = None

    def withdraw(self, global_step: int, ends: bool = True) -> list[int]:
        """As for any quantity of two steps; where ``global_step`` gave the reference, the next tracked step
        gives it instead (its parameters were not the optimizer's)."""
        removed = super().withdraw(global_step, ends)
        self._skipped_starts.discard(global_step)
        if self._reference_step == global_step:
            self._reference_step = None
        return removed

    def forget(self, global_step: int) -> None:
        super().forget(global_step)
        if self._reference_step == global_step:  # the next tracked step gives the reference
            self._reference_step = None

    def is_start(self, global_step: int) -> bool:
        return self._reference_step is None

    def is_end(self, global_step: int) -> bool:
        return self.should_compute(global_step)

    def _compute_start(self, global_step, params, batch_loss):
        self._reference_step = global_step
        self.save_to_cache(global_step, "params", parameter_snapshot(params), block_fn=lambda _: True)

    def _compute_end(self, global_step, params, batch_loss):
        return _block_norms(params, self.load_from_cache(self._reference_step, "params"))


class UpdateSize(TwoStepQuantity):
    """Per-parameter L2 norm of the update, ``[||theta_{t+1},p - theta_t,p|| for p]``.

    Stored under the start step ``t`` (``SAVE_SHIFT = 1``), when the cockpit is
    entered at step ``t + 1`` (which need not be scheduled itself).
    """

    SAVE_SHIFT = 1
    reads_parameters = True
    ends_on_parameters = True  # a step a GradScaler skipped still ends it: the update before it was made

    def _compute_start(self, global_step, params, batch_loss):
        self.save_to_cache(
            global_step, "params", parameter_snapshot(params), block_fn=lambda step, t=global_step: step <= t
        )

    def _compute_end(self, global_step, params, batch_loss):
        start = global_step - self.SAVE_SHIFT
        if not self.is_cached(start, "params"):
            return None
        return _block_norms(params, self.load_from_cache(start, "params"))
