"""The logs of the exact type-2 Fisher (the GGN): one backward pass per column of the loss Hessian's root.

For a loss that is the mean over ``N`` rows ``f_n`` of the model outputs
(``info["outputs"]`` reshaped to ``[N, C]``, outputs last), the GGN is
``Σ_n J_nᵀ (H_n / N) J_n`` with ``H_n = ∇²_f ℓ(f_n)``. With a root
``S_n S_nᵀ = H_n`` (:func:`cockpit_like.functional.loss_hessian.loss_hessian_sqrt`)
it is ``Σ_c Σ_n (J_nᵀ s_nc)(J_nᵀ s_nc)ᵀ / N``, and ``J_nᵀ s_nc / N`` is the
gradient of the surrogate ``(outputs * S[:, :, c] / N).sum()``. So for each
of the ``C`` columns a hook-only backward pass of the surrogate through the
step's kept graph (:meth:`~cockpit_like.backends.step.StepExecution.per_sample_pass`)
fills the logs, and the columns' logs are summed:

- ``forward``: the inputs, from the first pass only (they do not depend on ``c``);
- ``backward``: the output gradients' statistics summed over ``c``, the
  sample count once, so ``Covariance`` is KFAC's ``G`` of the GGN;
- ``grad``: the per-sample gradients' statistics summed over ``c`` (count
  once). EK-FAC's :class:`~cockpit_like.statistics.logs.KroneckerEigenvalues`
  needs the eigenbasis of ``G`` summed over every column, which is known
  only after the ``C`` passes: a second round of ``C`` passes rotates the
  per-sample gradients ``g_nc`` into it, ``(1/B) Σ_n Σ_c (Q_Gᵀ g_nc Q_A)²``
  (curvlinops' ``EKFACLinearOperator`` with ``FisherType.TYPE2`` does the
  same, in its own second pass over the data).

``Log`` keeps the rows of every column, one pass after the other.

Cost: ``C`` extra backward passes (``2 C`` with EK-FAC) on a tracked step;
``fisher="mc"`` (:mod:`cockpit_like.statistics.sampled`) is the one-pass estimate.

May import torch, :mod:`cockpit_like.functional` and this package.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from cockpit_like.functional.loss_hessian import LOSSES, loss_hessian_sqrt
from cockpit_like.statistics.base import Log, Statistic
from cockpit_like.statistics.collect import LayerLogs, StatisticsPlan, _Step

__all__ = ["Type2LayerLogs", "check_loss", "type2_outputs"]


def check_loss(owner: str, loss) -> str:
    """``loss`` if the type-2 Fisher knows its Hessian, else a clear error."""
    if loss not in LOSSES:
        raise ValueError(
            f"{owner}(loss={loss!r}): fisher='type-2' needs the loss whose Hessian it uses: 'cross_entropy' "
            "(logits, classes last, mean over rows) or 'mse' (torch's MSELoss(reduction='mean'), the mean over "
            "every entry)"
        )
    return loss


def type2_outputs(info: dict, loss: str) -> torch.Tensor:
    """``info["outputs"]`` as ``[N, C]`` rows (outputs last), or a clear error saying what is wrong."""
    outputs = info.get("outputs")
    what = "the logits the cross-entropy loss is computed from, classes in the last dimension" if loss == "cross_entropy" \
        else "the predictions MSELoss compares with the targets, outputs in the last dimension"  # fmt: skip
    got = type(outputs).__name__ + ("" if not isinstance(outputs, torch.Tensor) else f" of shape {list(outputs.shape)}")
    if not isinstance(outputs, torch.Tensor) or not outputs.requires_grad:
        raise ValueError(f"fisher='type-2' needs info['outputs']: {what}, with their graph (got {got})")
    if outputs.dim() < 2:
        fix = ("a model with one output per sample gives [B]: pass outputs of shape [B, 1] (e.g. "
               "model(x).reshape(-1, 1)) and compute MSELoss on the same shape as the targets") if loss == "mse" \
            else "the logits need a class dimension, [B, C]"  # fmt: skip
        raise ValueError(f"fisher='type-2' with loss={loss!r}: info['outputs'] has shape {list(outputs.shape)}; {fix}")
    batch = info.get("batch_size")
    if isinstance(batch, int) and not isinstance(batch, bool) and outputs.shape[0] != batch:
        raise ValueError(
            f"fisher='type-2' with loss={loss!r}: info['outputs'] has shape {list(outputs.shape)} but "
            f"info['batch_size'] is {batch}; pass the outputs of the whole batch, samples in the first dimension"
        )
    return outputs.reshape(-1, outputs.shape[-1])


def _view(plan: StatisticsPlan, **stats) -> StatisticsPlan:
    """The plan with some logs' statistics replaced (layers, names and running logs shared)."""
    view = copy.copy(plan)
    view.stats = {**plan.stats, **stats}
    return view


def _combine(stat: Statistic, states: list[dict]) -> dict:
    """One statistic's states of the ``C`` passes summed, with the sample count of one pass."""
    first = states[0]
    if isinstance(stat, Log):
        rows = [s["values"] for s in states if s["values"] is not None]
        return {"values": torch.cat(rows) if rows else None, "count": first["count"]}
    if "sum" in first and "count" in first:
        sums = [s["sum"] for s in states if s["sum"] is not None]
        total = None
        for part in sums:
            total = part.clone() if total is None else total.add_(part)
        return {"sum": total, "count": first["count"]}
    raise TypeError(
        f"fisher='type-2' sums each statistic over the loss Hessian's columns; {type(stat).__name__}'s state "
        "has no 'sum' and 'count' (derive it from Statistic and sum with add_sum)"
    )


def _sum_passes(stats: dict, passes: list[dict], logs=("forward", "backward")) -> dict:
    """``{"layers", "grad"}`` of the passes: ``forward`` from the first, ``backward`` and ``grad`` summed."""
    layers = {}
    for name, first in passes[0]["layers"].items():
        layers[name] = {}
        for log in logs:
            if log == "forward":
                layers[name][log] = first[log]
            else:
                layers[name][log] = {s.name: _combine(s, [p["layers"][name][log][s.name] for p in passes]) for s in stats[log]}
    grad = {}
    for name in passes[0]["grad"]:
        grad[name] = {s.name: _combine(s, [p["grad"][name][s.name] for p in passes]) for s in stats["grad"]}
    return {"layers": layers, "grad": grad}


def _passes(execution, rows, columns, first, later, stats: dict, logs) -> dict:
    """One hook-only backward pass of ``(rows * column).sum()`` per column (``first``, then ``later``
    statistics), their logs summed as they come (:func:`_sum_passes`)."""
    total = None
    for position, column in enumerate(columns):
        stat = first if position == 0 else later
        result = execution.per_sample_pass((rows * column).sum(), [stat])[stat]
        total = result if total is None else _sum_passes(stats, [total, result], logs)
    return total


def _bases(plan: StatisticsPlan, layers: dict) -> dict:
    """``{layer: (Q_G, Q_A)}``: eigenvectors of the factors accumulated up to and including this step
    (the empirical logs' own rule, :meth:`_Step.basis`, on the factors summed over the columns)."""
    summed = _Step(plan, [])
    summed.layers = layers
    for spec in plan.layers.values():
        if spec.name in layers:
            summed.basis(spec)
    return summed.bases


@dataclass(frozen=True)
class _InBasis(LayerLogs):
    """:class:`LayerLogs` whose EK-FAC rotation uses given eigenbases (the step's summed factors')."""

    bases: dict = field(compare=False, hash=False, repr=False, default=None)

    def init(self, params):
        step = super().init(params)
        step.bases.update(self.bases)
        return step


@dataclass(frozen=True)
class Type2LayerLogs:
    """Need: one step's logs of the exact type-2 Fisher of a ``loss`` (``C`` hook-only backward passes)."""

    key: str
    loss: str = "cross_entropy"
    plan: StatisticsPlan = field(compare=False, hash=False, repr=False, default=None)

    def compute(self, execution) -> dict:
        rows = type2_outputs(execution.info, self.loss)
        plan = self.plan
        roots = loss_hessian_sqrt(rows, self.loss) / rows.shape[0]  # the mean over the rows
        columns = [roots[:, :, c] for c in range(rows.shape[1])]
        eigen = tuple(s for s in plan.stats["grad"] if getattr(s, "eigenbasis", False))
        plain = tuple(s for s in plan.stats["grad"] if not getattr(s, "eigenbasis", False))
        first = LayerLogs(self.key, _view(plan, grad=plain))
        later = LayerLogs(self.key, _view(plan, forward=(), grad=plain))  # the inputs are logged once
        step = _passes(execution, rows, columns, first, later, first.plan.stats, ("forward", "backward"))
        step["bases"] = {}
        if eigen:
            bases = _bases(plan, step["layers"])
            rotate = _InBasis(self.key, _view(plan, forward=(), backward=(), grad=eigen), bases=bases)
            summed = _passes(execution, rows, columns, rotate, rotate, {"grad": eigen}, ())["grad"]
            for name, states in summed.items():
                step["grad"].setdefault(name, {}).update(states)
            step["bases"] = bases
        for states in step["grad"].values():  # every statistic present, as in the empirical logs
            for stat in plan.stats["grad"]:
                states.setdefault(stat.name, stat.init())
        return step

    def across_ranks(self, result, reduction):
        """Under DDP: as the empirical logs (:meth:`LayerLogs.across_ranks`): the rows are scale-free, so
        the ranks' sums and counts add up to the global batch's (EK-FAC is refused there too)."""
        return LayerLogs(self.key, self.plan).across_ranks(result, reduction)
