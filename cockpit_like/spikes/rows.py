"""Rows with an identity: each tracked step's per-row summary and a bounded buffer of the last steps.

Per row ``i`` of the optimizer step (every micro-batch and rank, in order):
its loss ``info["individual_losses"][i]``, its gradient norm ``||g_i||`` and
its share of the step's gradient ``s_i = <g_i / B, G> / ||G||^2`` (shares sum
to 1; :mod:`cockpit_like.functional.row_summaries`), all exact from
:class:`~cockpit_like.backends.per_sample_stats.GramSummary` (reduced from the
per-sample factors in the backward pass; no per-sample gradient is kept).
Ids come from ``info["sample_ids"]`` (ints or strings), else ``None``.

:class:`RowBuffer` keeps, for each of the last ``keep_steps`` tracked steps,
the union of the ``top_k`` rows by share and the ``top_k`` rows by loss
(at most ``2 top_k`` rows) in fixed-size arrays, plus the step's loss,
gradient norm and the median and spread of its rows' losses. Its memory is
``keep_steps x (2 top_k x 40 + 64)`` bytes of arrays for integer ids
(``RowBuffer.nbytes`` counts what it holds, string ids by their UTF-8 length):
32 steps x 5 rows is about 15 KB, whatever the batch or the model.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from cockpit_like import context
from cockpit_like.backends.per_sample_stats import GramSummary
from cockpit_like.functional.row_summaries import row_norms, row_shares, top_rows
from cockpit_like.functional.spikes import MAD_TO_STD
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["row_summary", "RowBuffer", "RowSummaries", "ids_of"]

#: bytes per kept row in :class:`RowBuffer` (row index, integer id, loss, gradient norm, share: 5 x 8)
ROW_BYTES = 40
#: bytes per kept step besides its rows (step, batch, loss, gradient norm, row-loss median and scale, 2 counts)
STEP_BYTES = 64


def ids_of(info: dict, batch: int, owner: str) -> list:
    """``info["sample_ids"]`` of the whole step as a list of ints or strings (``[None] * batch`` without them)."""
    ids = info.get("sample_ids")
    if ids is None:
        return [None] * batch
    listed = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if len(listed) != batch:
        raise ValueError(
            f"{owner}: info['sample_ids'] has {len(listed)} entries but the step has {batch} rows; pass one id "
            "per row of each backward pass (micro-batches are concatenated in order)"
        )
    return [item if isinstance(item, str) else int(item) for item in listed]


def row_summary(step: int, losses: torch.Tensor, diag: torch.Tensor, row_sums: torch.Tensor, ids: list,
                top_k: int) -> dict[str, Any]:
    """The summary of one step: its scalars and its ``top_k`` rows by share and by loss (JSON-ready).

    ``rows`` lists each kept row once as ``{"row", "id", "loss", "grad_norm", "share"}`` (``row``: its
    index in the step); ``by_share`` and ``by_loss`` are positions in ``rows``, best first."""
    losses = losses.detach().to(torch.float64).reshape(-1)
    diag, row_sums = diag.detach().to(torch.float64), row_sums.detach().to(torch.float64)
    batch = diag.shape[0]
    if losses.shape[0] != batch:
        raise ValueError(
            f"step {step}: info['individual_losses'] has {losses.shape[0]} entries but the per-sample gradients "
            f"have {batch} rows; pass one loss per row of the step (all its micro-batches)"
        )
    norms, shares = row_norms(diag), row_shares(row_sums)
    by_share, by_loss = top_rows(shares, top_k), top_rows(losses, top_k)
    kept = list(dict.fromkeys(by_share + by_loss))
    finite = losses[torch.isfinite(losses)]
    median = float(finite.median()) if finite.numel() else math.nan
    spread = float(MAD_TO_STD * (finite - median).abs().median()) if finite.numel() else math.nan
    return {
        "step": int(step),
        "batch": int(batch),
        "loss": float(losses.mean()),
        "grad_norm": math.sqrt(max(float(row_sums.sum()), 0.0)),
        "row_loss_median": median,
        "row_loss_scale": spread,
        "rows": [{"row": i, "id": ids[i], "loss": float(losses[i]), "grad_norm": float(norms[i]),
                  "share": float(shares[i])} for i in kept],
        "by_share": [kept.index(i) for i in by_share],
        "by_loss": [kept.index(i) for i in by_loss],
    }


class RowBuffer:
    """The last ``keep_steps`` step summaries (:func:`row_summary`), oldest dropped first.

    Args:
        keep_steps: how many tracked steps to keep (N).
        top_k: rows kept per step by share and by loss (k; at most ``2 k`` rows per step).

    Attributes:
        steps: the kept summaries, oldest first.
    """

    def __init__(self, keep_steps: int = 32, top_k: int = 5):
        for name, value in (("keep_steps", keep_steps), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RowBuffer: {name} must be a positive int, got {value!r}")
        self.keep_steps, self.top_k = keep_steps, top_k
        self.steps: list[dict[str, Any]] = []

    def add(self, summary: dict[str, Any]) -> None:
        self.steps.append(summary)
        del self.steps[: max(0, len(self.steps) - self.keep_steps)]

    @property
    def bound_bytes(self) -> int:
        """The most the buffer holds with integer ids: ``keep_steps x (2 top_k x 40 + 64)`` bytes."""
        return self.keep_steps * (2 * self.top_k * ROW_BYTES + STEP_BYTES)

    @property
    def nbytes(self) -> int:
        """What the buffer holds now: 40 bytes per kept row (64 per step), plus the UTF-8 length of string ids."""
        total = 0
        for summary in self.steps:
            total += STEP_BYTES + ROW_BYTES * len(summary["rows"])
            total += sum(len(row["id"].encode()) for row in summary["rows"] if isinstance(row["id"], str))
        return total

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The kept rows as flat arrays (``step``, ``row``, ``loss``, ``grad_norm``, ``share``), for analysis."""
        rows = [(s["step"], r["row"], r["loss"], r["grad_norm"], r["share"]) for s in self.steps for r in s["rows"]]
        table = np.asarray(rows, dtype=np.float64).reshape(-1, 5)
        return {name: table[:, i] for i, name in enumerate(("step", "row", "loss", "grad_norm", "share"))}

    def state_dict(self) -> dict[str, Any]:
        return {"keep_steps": self.keep_steps, "top_k": self.top_k, "steps": [dict(s) for s in self.steps]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keep_steps, self.top_k, self.steps = state["keep_steps"], state["top_k"], list(state["steps"])


class RowSummaries(SingleStepQuantity):
    """Each tracked step's rows: loss, gradient norm ``||g_i||`` and share ``<g_i / B, G> / ||G||^2``.

    Stores per step :func:`row_summary` of the ``top_k`` rows by share and by
    loss, with their ids (``info["sample_ids"]``, optional), and keeps the last
    ``keep_steps`` of them in :attr:`buffer` (a :class:`RowBuffer`; its memory:
    :attr:`nbytes`, at most ``keep_steps x (2 top_k x 40 + 64)`` bytes with
    integer ids). Needs ``info["individual_losses"]`` (mean loss; micro-batches
    concatenated in order) and the per-sample statistic ``GramSummary``
    (shared with NormTest, InnerTest, OrthoTest).

    Example::

        rows = RowSummaries(every(1), keep_steps=32, top_k=5)
        with cockpit(step, info={..., "individual_losses": losses, "sample_ids": indices}): ...
        cockpit.get_output()[step]["RowSummaries"]["rows"][0]  # {"row", "id", "loss", "grad_norm", "share"}
    """

    def __init__(self, track_schedule, keep_steps: int = 32, top_k: int = 5, verbose: bool = False):
        super().__init__(track_schedule, verbose=verbose)
        self.buffer = RowBuffer(keep_steps, top_k)

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now (see :class:`RowBuffer`)."""
        return self.buffer.nbytes

    def settings(self) -> dict[str, Any]:
        return {"keep_steps": self.buffer.keep_steps, "top_k": self.buffer.top_k}

    def per_sample_stats(self, global_step: int) -> list:
        return [GramSummary()] if self.should_compute(global_step) else []

    def required_info(self, global_step: int) -> set[str]:
        return {"individual_losses"} if self.should_compute(global_step) else set()

    def _compute(self, global_step, params, batch_loss):
        summary = summarize_step(global_step, type(self).__name__, self.buffer.top_k)
        self.buffer.add(summary)
        return summary


def summarize_step(step: int, owner: str, top_k: int) -> dict[str, Any]:
    """:func:`row_summary` of the step being tracked, from its record."""
    record = context.get_record(step)
    diag, row_sums = record.stat(GramSummary())
    losses = record.require("individual_losses", owner)
    if not isinstance(losses, torch.Tensor):
        losses = torch.as_tensor(losses, dtype=torch.float64)
    return row_summary(step, losses, diag, row_sums, ids_of(record.info, diag.shape[0], owner), top_k)
