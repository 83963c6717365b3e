"""Statistics of per-sample gradients, reduced layer by layer during backward.

A :class:`PerSampleStat` is a frozen dataclass: equal statistics (same type,
same fields) are one need, computed once per step however many quantities
ask for it. During BackPACK's backward pass, after a module's per-sample
gradients are computed, :class:`PerSampleReducer` hands each parameter's
``grad_batch`` to every requested statistic and then frees it (unless a
quantity or the user asked for the raw ``grad_batch``), so the ``N x D``
per-sample gradient of the whole network never exists at once.

Scaling: the loss is the *mean* over the batch of ``B`` samples, so
BackPACK's ``grad_batch[i] = g_i / B`` where ``g_i`` is the gradient of the
``i``-th sample's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PerSampleStat", "PerSampleReducer"]


@dataclass(frozen=True)
class PerSampleStat:
    """Base class: a reduction of per-sample gradients to a small result.

    Subclasses implement :meth:`init`, :meth:`accumulate` and :meth:`finalize`.
    """

    def init(self, params: list[torch.Tensor]) -> Any:
        """Fresh accumulator state for one step."""
        raise NotImplementedError

    def accumulate(self, state: Any, index: int, param: torch.Tensor, grad_batch: torch.Tensor) -> Any:
        """Fold in parameter ``index``'s ``grad_batch`` ``[B, *param.shape]``; return the state."""
        raise NotImplementedError

    def finalize(self, state: Any) -> Any:
        """The result quantities read with ``record.stat(self)``."""
        return state


class PerSampleReducer:
    """The BackPACK extension hook that feeds per-sample gradients to statistics.

    Args:
        stats: distinct statistics to compute.
        params: the tracked parameters (others are ignored).
        keep_grad_batch: leave ``grad_batch`` on the parameters (someone asked for it).
    """

    def __init__(self, stats: list[PerSampleStat], params: list[torch.Tensor], keep_grad_batch: bool):
        self.stats = stats
        self.keep_grad_batch = keep_grad_batch
        self._index = {id(p): i for i, p in enumerate(params)}
        self._states = [stat.init(params) for stat in stats]
        self.seen: set[int] = set()

    def __call__(self, module: torch.nn.Module) -> None:
        for param in module.parameters(recurse=False):
            index = self._index.get(id(param))
            grad_batch = getattr(param, "grad_batch", None)
            if index is None or grad_batch is None:
                continue
            self.seen.add(index)
            for k, stat in enumerate(self.stats):
                self._states[k] = stat.accumulate(self._states[k], index, param, grad_batch)
            if not self.keep_grad_batch:
                del param.grad_batch

    def results(self) -> dict[PerSampleStat, Any]:
        return {stat: stat.finalize(state) for stat, state in zip(self.stats, self._states)}
