"""The statistic contract and the built-in statistics ``Mean``, ``Covariance``, ``Log``.

A statistic is a small stateless class; its accumulated state is a plain
dict of tensors and Python numbers (so a quantity can save it with its
``state_dict``, and two runs' states can be merged). The contract:

- ``init() -> state``: the empty state;
- ``update(state, values, count) -> state``: fold in the rows of one step,
  ``values`` ``[rows, d]`` standing for ``count`` samples (``count`` is what
  the running mean divides by, see the logs in :mod:`cockpit_like.statistics.logs`);
- ``merge(state, other) -> state``: the state of both (two halves of a data
  set, two runs); states of different shapes raise :class:`StatisticsMergeError`;
- ``finalize(state) -> result``: the value (``None`` for an empty state).

Sums and counts, never means, are kept: a later all-reduce of ``"sum"`` and
``"count"`` over processes gives the statistic of all of them.

Example (a statistic of your own: the diagonal of the uncentered covariance)::

    class MeanOfSquares(Statistic):
        name = "mean_of_squares"

        def update(self, state, values, count):
            return self.add_sum(state, (values * values).sum(0), count)

    Statistic.finalize (sum / count) does the rest.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

__all__ = ["Statistic", "Mean", "Covariance", "Log", "StatisticsMergeError"]


class StatisticsMergeError(ValueError):
    """Two statistics states that cannot be merged (different statistics or shapes)."""


class Statistic:
    """Base class: a running mean ``sum / count`` (override :meth:`update` for what is summed).

    Subclasses set :attr:`name` (the key in results) and implement
    :meth:`update`, usually with :meth:`add_sum`; :meth:`merge` and
    :meth:`finalize` of the base class fit every "sum and count" statistic.
    """

    #: the key of the statistic in results (``{"forward": {"covariance": ...}}``)
    name: ClassVar[str] = "statistic"

    def init(self) -> dict[str, Any]:
        """The empty state ``{"sum": None, "count": 0}``."""
        return {"sum": None, "count": 0}

    def wants(self, dim: int) -> bool:
        """Whether rows of length ``dim`` are folded in (``False``: that parameter is left out, nothing computed)."""
        return True

    def update(self, state: dict[str, Any], values: torch.Tensor, count: int) -> dict[str, Any]:
        """Fold in one step's rows ``values`` ``[rows, d]`` standing for ``count`` samples."""
        raise NotImplementedError(f"{type(self).__name__} must implement update(state, values, count)")

    @staticmethod
    def add_sum(state: dict[str, Any], summed: torch.Tensor, count: int) -> dict[str, Any]:
        """``state["sum"] += summed``, ``state["count"] += count`` (checks the shape)."""
        summed = summed.detach()
        if state["sum"] is None:
            return {"sum": summed.clone(), "count": int(count)}
        if state["sum"].shape != summed.shape:
            raise StatisticsMergeError(
                f"cannot add a sum of shape {list(summed.shape)} to a statistic of shape "
                f"{list(state['sum'].shape)}: the layer changed size between steps; reset the statistics "
                "(a new quantity) after changing the model"
            )
        return {"sum": state["sum"].add_(summed.to(state["sum"].dtype)), "count": state["count"] + int(count)}

    def merge(self, state: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
        """Sums and counts added (an empty side is the other side)."""
        if other["sum"] is None:
            return state
        if state["sum"] is None:
            return {"sum": other["sum"].clone(), "count": other["count"]}
        if state["sum"].shape != other["sum"].shape:
            raise StatisticsMergeError(
                f"{type(self).__name__}: cannot merge statistics of shapes {list(state['sum'].shape)} and "
                f"{list(other['sum'].shape)}; only statistics of the same layers (same sizes) can be merged"
            )
        return {"sum": state["sum"] + other["sum"].to(state["sum"].dtype), "count": state["count"] + other["count"]}

    def finalize(self, state: dict[str, Any]) -> torch.Tensor | None:
        """``sum / count`` (``None`` while empty)."""
        if state["sum"] is None or state["count"] == 0:
            return None
        return state["sum"] / state["count"]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class Mean(Statistic):
    """``mean = (1/count) sum_rows values`` (a ``[d]`` vector)."""

    name = "mean"

    def update(self, state, values, count):
        return self.add_sum(state, values.sum(0), count)


class Covariance(Statistic):
    """Uncentered covariance ``C = (1/count) sum_rows v v^T`` (a ``[d, d]`` matrix).

    Args:
        max_dim: refuse rows longer than this (a ``d x d`` matrix of a large
            layer's per-sample gradients would not fit).
        skip_longer: leave rows longer than ``max_dim`` out instead (the
            statistic of that parameter stays empty: ``None``; :meth:`wants`
            tells the collector before it builds them).
    """

    name = "covariance"

    def __init__(self, max_dim: int = 8192, skip_longer: bool = False):
        self.max_dim = int(max_dim)
        self.skip_longer = bool(skip_longer)

    def wants(self, dim):
        return dim <= self.max_dim or not self.skip_longer

    def update(self, state, values, count):
        if values.shape[1] > self.max_dim:
            if self.skip_longer:
                return state
            raise ValueError(
                f"Covariance: rows of length {values.shape[1]} exceed max_dim={self.max_dim} (a "
                f"{values.shape[1]} x {values.shape[1]} matrix); use Mean / a statistic of your own, or "
                "Covariance(max_dim=...) if it fits in memory"
            )
        return self.add_sum(state, values.T @ values, count)

    def __eq__(self, other):
        return type(self) is type(other) and (self.max_dim, self.skip_longer) == (other.max_dim, other.skip_longer)

    def __hash__(self):
        return hash((type(self), self.max_dim, self.skip_longer))

    def __repr__(self):
        return f"Covariance(max_dim={self.max_dim}, skip_longer={self.skip_longer})"


class Log(Statistic):
    """The raw rows of the last step (``[rows, d]``): ``merge`` keeps the later side's rows."""

    name = "log"

    def init(self):
        return {"values": None, "count": 0}

    def update(self, state, values, count):
        values = values.detach().clone()
        if state["values"] is None:
            return {"values": values, "count": int(count)}
        return {"values": torch.cat([state["values"], values.to(state["values"].dtype)]), "count": state["count"] + int(count)}

    def merge(self, state, other):
        return state if other["values"] is None else {"values": other["values"].clone(), "count": other["count"]}

    def finalize(self, state):
        return state["values"]
