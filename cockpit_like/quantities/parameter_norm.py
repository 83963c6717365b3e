"""How large the parameters are: :class:`ParamNorm`."""

from __future__ import annotations

from cockpit_like.functional.tensor_lists import norms
from cockpit_like.quantities.quantity import ByproductQuantity

__all__ = ["ParamNorm"]


class ParamNorm(ByproductQuantity):
    """Per-parameter L2 norm ``[||theta_t,p||_2 for p]`` at the tracked step.

    Read before the optimizer step (the cockpit tracks on exit of the
    backward pass), so ``UpdateSize[t] / ParamNorm[t]`` is the relative size
    of the update that starts at step ``t`` (the diagnosis rules
    ``update-ratio-too-small`` / ``-too-large`` read it that way). One
    reduction per parameter, no extra memory.
    """

    def _compute(self, global_step, params, batch_loss):
        return norms(params).tolist()
