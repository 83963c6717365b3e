"""Quantities on logged curvature statistics: KFAC / EK-FAC you can compute with (new).

Each quantity here logs statistics of its layers during the cockpit's
backward pass (:mod:`cockpit_like.statistics`: layer inputs, output
gradients, per-sample gradients), keeps them as running sums and counts over
the steps its schedule selects (``window="run"``) or per step
(``window="step"``), and offers them as an operator
(:meth:`CurvatureStatistics.curvature_operator`, which
:meth:`cockpit_like.Cockpit.curvature` finds):

- :class:`CurvatureStatistics`: only logs (stores the sample counts per layer);
- :class:`EKFACSpectrum`: histogram of EK-FAC eigenvalues, per layer and overall;
- :class:`PreconditionedGradNorm`: ``gᵀ (F + λI)^{-1} g`` with KFAC or EK-FAC;
- :class:`SelfInfluence`: ``g_iᵀ (F + λI)^{-1} g_i`` per sample of the batch.

``F`` is the empirical Fisher of the mean loss, ``F = (1/B) sum_n g_n g_n^T``
with ``g_n`` sample ``n``'s loss gradient, in Kronecker form ``G ⊗ A`` per
layer (docs/curvature_statistics.md); with ``fisher="mc"`` a one-sample
estimate of the type-2 Fisher, with ``fisher="type-2"`` (and ``loss=``) the
exact type-2 Fisher (GGN) in that form. Covered parameters: the weights (and
biases) of ``nn.Linear``, ``nn.Conv2d`` and Hugging Face ``Conv1D`` layers
that the cockpit tracks and no other module uses; the others are left out of
every sum here. Cross-step state: :attr:`CurvatureStatistics.plan` (its
``state_dict()`` is the running logs, plain dicts of tensors and ints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cockpit_like.backends.per_sample import materialize_linear, materialize_sequence
from cockpit_like.backends.per_sample_stats import RetainedDense, RetainedFactors, RetainedGradBatch, RetainedSequence
from cockpit_like.context import get_record
from cockpit_like.ihvp import ihvp_ekfac, ihvp_kfac
from cockpit_like.quantities.quantity import SingleStepQuantity
from cockpit_like.functional.kronecker_quadratic import (
    quadratic_forms_dense,
    quadratic_forms_factors,
    quadratic_forms_sequence,
)
from cockpit_like.statistics import LayerLogs, StatisticsPlan, curvature_operator, layer_curvatures, layer_eigen
from cockpit_like.statistics.sampled import SampledLayerLogs
from cockpit_like.statistics.type2 import Type2LayerLogs, check_loss

__all__ = ["CurvatureStatistics", "EKFACSpectrum", "PreconditionedGradNorm", "SelfInfluence"]

_KINDS = ("kfac", "ekfac")


def _check_damping(owner: str, damping: Any) -> float:
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not damping >= 0 or not math.isfinite(damping):
        raise ValueError(
            f"{owner}(damping={damping!r}): need a float >= 0 (the inverse is of F + damping * I; 0 needs "
            "invertible factors, e.g. more samples than the layer's inputs)"
        )
    return float(damping)


def _check_strategy(owner: str, strategy: Any) -> str:
    if strategy not in ("exact", "heuristic"):
        raise ValueError(f"{owner}(strategy={strategy!r}): choose 'exact' or 'heuristic'")
    return strategy


def _check_kind(owner: str, curvature: Any) -> str:
    if curvature not in _KINDS:
        raise ValueError(f"{owner}(curvature={curvature!r}): choose 'kfac' or 'ekfac'")
    return curvature


class CurvatureStatistics(SingleStepQuantity):
    """Logs layer statistics (default KFAC's factors) and offers them as an operator.

    Stored value: ``{"layers": {name: {"forward": rows, "backward": samples}}}``,
    what each layer's running statistics count so far (``forward`` counts
    positions, ``B T``; ``backward`` samples, ``B``). The statistics themselves:
    :meth:`statistics` (values) and :attr:`plan` ``.running`` (sums and counts).

    Args:
        track_schedule: the steps whose statistics are logged.
        verbose: print each value.
        statistics: ``"kfac"``, ``"ekfac"`` or ``{"forward": [...], "backward": [...], "grad": [...]}``
            (:func:`cockpit_like.statistics.parse_statistics`).
        window: ``"run"``: running statistics over the tracked steps; ``"step"``: each step's own.
        fisher: ``"empirical"`` (the gradients of your loss, in the same backward pass), ``"mc"``
            (the Monte-Carlo / type-2 Fisher of a cross-entropy loss: labels sampled from the model, a
            second backward pass through the kept graph; needs ``info["outputs"]`` and
            ``loss.backward(create_graph=cockpit.create_graph(step))``, :mod:`cockpit_like.statistics.sampled`)
            or ``"type-2"`` (the exact type-2 Fisher = GGN of ``loss``: one backward pass per output dimension
            through the kept graph, ``C`` extra passes on a tracked step, ``2 C`` for EK-FAC; needs
            ``info["outputs"]``, ``create_graph`` as for ``"mc"`` and ``loss``; :mod:`cockpit_like.statistics.type2`).
            Every quantity here takes it.
        loss: with ``fisher="type-2"`` (required there, refused otherwise): ``"cross_entropy"`` (logits,
            classes last, the mean over rows) or ``"mse"`` (``MSELoss(reduction="mean")``, the mean over every
            entry of ``info["outputs"]``: ``(1/(N C)) Σ (f - y)²``, Hessian ``2/(N C) I``, as curvlinops).
            Every quantity here takes it.

    Example:
        >>> from cockpit_like.statistics import Covariance, Mean
        >>> q = CurvatureStatistics(linear(10), statistics={"forward": [Covariance, Mean], "backward": [Covariance]})
    """

    def __init__(self, track_schedule, verbose: bool = False, statistics: str | dict = "kfac", window: str = "run",
                 fisher: str = "empirical", loss: str | None = None):  # fmt: skip
        super().__init__(track_schedule, verbose=verbose)
        if fisher not in ("empirical", "mc", "type-2"):
            raise ValueError(
                f"{type(self).__name__}(fisher={fisher!r}): 'empirical' (the gradients of your loss, same backward "
                "pass), 'mc' (labels sampled from the model, a second backward pass; needs info['outputs']) or "
                "'type-2' (the exact GGN, one backward pass per output dimension; needs info['outputs'] and loss=)"
            )
        if fisher == "type-2":
            loss = check_loss(type(self).__name__, loss)
        elif loss is not None:
            raise ValueError(
                f"{type(self).__name__}(loss={loss!r}, fisher={fisher!r}): loss= is read by fisher='type-2' only "
                "(the empirical Fisher uses your loss's gradients; 'mc' samples cross-entropy labels)"
            )
        self._fisher = fisher
        self._loss = loss
        self._statistics_config = statistics
        self.plan = StatisticsPlan(statistics, window=window)
        self.last_step: int | None = None
        self._key = f"{type(self).__name__}@{id(self)}"

    # ---- needs -----------------------------------------------------------------
    def adapt_to_models(self, models: list) -> None:
        self.plan.set_models(models)

    def per_sample_stats(self, global_step: int) -> list:
        if not self.should_compute(global_step) or self._fisher != "empirical":
            return []
        return [LayerLogs(self._key, self.plan)]

    def curvature_needs(self, global_step: int) -> list:
        if not self.should_compute(global_step) or self._fisher == "empirical":
            return []
        if self._fisher == "type-2":
            return [Type2LayerLogs(self._key, self._loss, self.plan)]
        return [SampledLayerLogs(self._key, self.plan)]

    def required_info(self, global_step: int) -> set[str]:
        return {"outputs"} if self._fisher != "empirical" and self.should_compute(global_step) else set()

    def create_graph(self, global_step: int) -> bool:
        return self._fisher != "empirical" and self.should_compute(global_step)

    def settings(self) -> dict:
        config = self._statistics_config
        if isinstance(config, dict):
            config = {log: [type(s).__name__ if not isinstance(s, type) else s.__name__ for s in stats] for log, stats in config.items()}
        settings = {"statistics": config, "window": self.plan.window, "fisher": self._fisher}
        if self._fisher == "type-2":
            settings["loss"] = self._loss
        return settings

    # ---- computing -----------------------------------------------------------------
    def _absorb(self, global_step: int) -> None:
        """Merge this step's logs into the running ones."""
        if self._fisher == "type-2":
            need = Type2LayerLogs(self._key, self._loss)
        else:
            need = LayerLogs(self._key) if self._fisher == "empirical" else SampledLayerLogs(self._key)
        self.plan.absorb(get_record(global_step).stat(need))
        self.last_step = global_step

    def _compute(self, global_step, params, batch_loss):
        self._absorb(global_step)
        counts = {}
        for name, logs in self.plan.running["layers"].items():
            counts[name] = {log: next(iter(states.values()))["count"] for log, states in logs.items() if states}
        return {"layers": counts}

    def statistics(self) -> dict:
        """``{"layers": {name: {log: {stat: value}}}, "grad": {param: {stat: value}}}`` of the running logs."""
        return self.plan.finalized()

    def curvature_operator(self, params: list[torch.Tensor], kind: str = "kfac", damping: float | None = None, layers=None):
        """``(operator, covered params)``: KFAC / EK-FAC (``+ damping I``) of the logged layers.

        The operator is a :class:`~cockpit_like.operators.BlockDiagonal` with
        one block per covered parameter (named ``"<layer>.weight"`` /
        ``"<layer>.bias"``) in the order of ``params``; ``layers`` keeps only
        the named layers.
        """
        return curvature_operator(self.plan, params, kind=kind, damping=damping, layers=layers)

    def curvature_kind(self) -> str:
        """The richest curvature the logs offer (``"ekfac"`` when EK-FAC eigenvalues are logged)."""
        return "ekfac" if any(getattr(s, "eigenbasis", False) for s in self.plan.stats["grad"]) else "kfac"

    def _inverse(self, params, kind: str, damping: float, strategy: str = "exact"):
        """``(v -> (F + λI)^{-1} v, covered params)`` (``strategy``: :meth:`~cockpit_like.operators.LinearOperator.inverse`'s)."""
        records, covered = layer_curvatures(self.plan, params, kind)
        if not covered:
            raise RuntimeError(
                f"{type(self).__name__}: no tracked parameter belongs to a logged layer (nn.Linear, nn.Conv2d, "
                "Hugging Face Conv1D); pass Cockpit(..., model=model)"
            )
        build = ihvp_ekfac if kind == "ekfac" else ihvp_kfac
        return build(records, damping, params=covered, strategy=strategy), covered


def _statistics_for(curvature: str) -> str:
    return "ekfac" if curvature == "ekfac" else "kfac"


class EKFACSpectrum(CurvatureStatistics):
    """Distribution of EK-FAC's (corrected) eigenvalues, per layer and overall.

    At each tracked step the eigenvalues of every covered block (the weight's
    ``out x in`` corrected eigenvalues and the bias's ``out``) are counted
    in ``bins`` log-spaced bins between the smallest positive and the largest
    eigenvalue of the step (``range`` fixes them); eigenvalues ``<= 0`` are
    counted as ``zeros``. The eigendecomposition of the factors runs only at
    the steps the schedule selects.

    Stored value (JSON-friendly)::

        {"edges": [bins + 1 floats], "counts": [bins ints], "zeros": int, "num": int,
         "min": float, "max": float, "median": float,
         "layers": {name: {"counts": [...], "zeros": int, "num": int, "min": ..., "max": ..., "mean": ...}}}

    Args:
        track_schedule: when to compute.
        verbose: print each value.
        bins: number of log-spaced bins.
        range: ``(low, high) > 0`` fixed bin range (default: the step's positive eigenvalues).
        window: ``"run"`` (factors over all tracked steps) or ``"step"``.
        fisher: ``"empirical"``, ``"mc"`` or ``"type-2"``; loss: with ``"type-2"``, ``"cross_entropy"`` or
            ``"mse"`` (see :class:`CurvatureStatistics`).
    """

    def __init__(self, track_schedule, verbose: bool = False, bins: int = 40, range: tuple[float, float] | None = None,
                 window: str = "run", fisher: str = "empirical", loss: str | None = None):  # fmt: skip
        super().__init__(track_schedule, verbose=verbose, statistics="ekfac", window=window, fisher=fisher, loss=loss)
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"EKFACSpectrum(bins={bins!r}): need a positive int")
        if range is not None and not (len(range) == 2 and 0 < range[0] < range[1]):
            raise ValueError(f"EKFACSpectrum(range={range!r}): need (low, high) with 0 < low < high")
        self._bins = bins
        self._range = None if range is None else (float(range[0]), float(range[1]))

    def settings(self) -> dict:
        return {**super().settings(), "bins": self._bins, "range": self._range}

    def _compute(self, global_step, params, batch_loss):
        self._absorb(global_step)
        records, _ = layer_curvatures(self.plan, params, "ekfac")
        per_layer: dict[str, np.ndarray] = {}
        for record in records:
            if record.name.endswith("(bias)"):  # an HF Conv1D bias: part of its layer
                name = record.name[: -len("(bias)")]
                values = [record.bias_eigenvalues]
            else:
                name, values = record.name, [record.eigenvalues, record.bias_eigenvalues]
            found = [v.detach().reshape(-1).cpu().double().numpy() for v in values if v is not None]
            per_layer[name] = np.concatenate([per_layer.get(name, np.zeros(0))] + found)
        if not per_layer:
            return None
        every = np.concatenate(list(per_layer.values()))
        positive = every[every > 0]
        if self._range is not None:
            low, high = self._range
        elif positive.size:
            low, high = float(positive.min()), float(positive.max())
            if high <= low:
                low, high = low / 2, high * 2
        else:
            low, high = 1e-12, 1.0
        edges = np.logspace(math.log10(low), math.log10(high), self._bins + 1)

        def counts(values: np.ndarray) -> tuple[list[int], int]:
            inside = np.clip(values[values > 0], edges[0], edges[-1])
            return np.histogram(inside, bins=edges)[0].astype(int).tolist(), int((values <= 0).sum())

        total, zeros = counts(every)
        layers = {}
        for name, values in per_layer.items():
            layer_counts, layer_zeros = counts(values)
            layers[name] = {"counts": layer_counts, "zeros": layer_zeros, "num": int(values.size),
                            "min": float(values.min()), "max": float(values.max()), "mean": float(values.mean())}  # fmt: skip
        return {"edges": edges.tolist(), "counts": total, "zeros": zeros, "num": int(every.size),
                "min": float(every.min()), "max": float(every.max()), "median": float(np.median(every)), "layers": layers}  # fmt: skip


class PreconditionedGradNorm(CurvatureStatistics):
    """``gᵀ (F + λI)^{-1} g``: the gradient's norm in the metric of the inverse curvature.

    ``g`` is the mini-batch gradient (``p.grad`` of the covered parameters)
    and ``F`` KFAC or EK-FAC of the logged statistics (this step included).
    It is the squared length of the natural-gradient step ``(F + λI)^{-1} g``
    measured by ``F + λI``, i.e. the decrease a damped natural-gradient step
    of size 1 predicts twice over; compared with ``gᵀg / λ`` (stored as
    ``"grad_norm_squared"``) it shows how far the curvature reshapes the step.

    Stored value: ``{"value": float, "grad_norm_squared": float, "layers": {name: float}}``
    (the per-layer terms, which add up to ``value`` since ``F`` is block-diagonal).

    Args:
        track_schedule: when to compute.
        verbose: print each value.
        curvature: ``"kfac"`` or ``"ekfac"``.
        damping: ``λ >= 0``.
        window: ``"run"`` or ``"step"``.
        strategy: ``"exact"`` (``(G ⊗ A + λI)^{-1}`` through the factors' eigendecompositions) or
            ``"heuristic"`` (KFAC only: π-damped factors inverted, no eigendecomposition; an approximation,
            docs/operators.md).
        fisher: ``"empirical"``, ``"mc"`` or ``"type-2"``; loss: with ``"type-2"``, ``"cross_entropy"`` or
            ``"mse"`` (see :class:`CurvatureStatistics`).
    """

    def __init__(self, track_schedule, verbose: bool = False, curvature: str = "kfac", damping: float = 1e-3,
                 window: str = "run", strategy: str = "exact", fisher: str = "empirical",
                 loss: str | None = None):  # fmt: skip
        self._curvature = _check_kind("PreconditionedGradNorm", curvature)
        self._damping = _check_damping("PreconditionedGradNorm", damping)
        self._strategy = _check_strategy("PreconditionedGradNorm", strategy)
        super().__init__(track_schedule, verbose=verbose, statistics=_statistics_for(curvature), window=window,
                         fisher=fisher, loss=loss)  # fmt: skip

    def settings(self) -> dict:
        return {**super().settings(), "curvature": self._curvature, "damping": self._damping, "strategy": self._strategy}

    def _compute(self, global_step, params, batch_loss):
        self._absorb(global_step)
        inverse, covered = self._inverse(params, self._curvature, self._damping, self._strategy)
        grads = []
        for param in covered:
            if param.grad is None:
                raise RuntimeError(
                    f"PreconditionedGradNorm: parameter {self.plan.param_names.get(id(param), list(param.shape))} "
                    "has no .grad after the backward pass"
                )
            grads.append(param.grad.detach())
        solved = inverse(grads)
        terms: dict[str, float] = {}
        for name, g, s in zip(inverse.names, grads, solved):
            layer = name.rsplit(".", 1)[0].removesuffix("(bias)")
            terms[layer] = terms.get(layer, 0.0) + float((g * s).sum())
        return {
            "value": math.fsum(terms.values()),
            "grad_norm_squared": math.fsum(float((g * g).sum()) for g in grads),
            "layers": terms,
        }


@dataclass(frozen=True)
class RetainedForInfluence(RetainedGradBatch):
    """:class:`RetainedGradBatch` of one :class:`SelfInfluence` (``key``; it clears the list, others keep theirs)."""

    key: str = ""

    def across_ranks(self, result, reduction):
        raise NotImplementedError(
            f"SelfInfluence on a step split into {reduction.parts}: it scores each sample from its per-sample "
            "gradient, which stays with its part. Track SelfInfluence on steps of one backward pass in one "
            "process (e.g. a separate evaluation pass over the data), and PreconditionedGradNorm / KFAC "
            "statistics on the split steps."
        )


def _per_sample_rows(entry, param: torch.Tensor) -> torch.Tensor:
    """``[B, *param.shape]`` per-sample loss gradients (``B grad_batch``) of a retained entry."""
    if isinstance(entry, RetainedDense):
        grad_batch = entry.grad_batch
    elif isinstance(entry, RetainedFactors):
        grad_batch = materialize_linear(entry.kind, entry.x, entry.delta)
    elif isinstance(entry, RetainedSequence):
        grad_batch = materialize_sequence(entry.a, entry.b, entry.shape)
    else:
        raise RuntimeError(f"SelfInfluence: no per-sample gradients retained for a parameter of shape {list(param.shape)}")
    batch = grad_batch.shape[0]
    return grad_batch.reshape(batch, *param.shape) * batch


class SelfInfluence(CurvatureStatistics):
    """Per-sample self-influence ``s_i = g_iᵀ (F + λI)^{-1} g_i`` of the batch.

    ``g_i`` is sample ``i``'s loss gradient (covered parameters) and ``F``
    KFAC / EK-FAC of the logged statistics (this step included). A large
    ``s_i`` marks a sample the model fits against the rest of the data: the
    usual sign of a mislabeled or unusual example (influence functions,
    Koh & Liang 2017; TracIn-style self-influence).

    Stored value::

        {"mean", "std", "min", "max", "median": floats over the batch, "batch": B,
         "top": [{"id": sample id, "position": row in the batch, "value": s_i}, ...]}  # k largest, descending

    ``id`` is ``info["sample_ids"][position]`` when the step's ``info`` has
    ``"sample_ids"`` (a list or tensor of ``B`` ids: dataset indices, file
    names), else the position. ``cockpit-like influence LOG`` lists them.

    Args:
        track_schedule: when to compute.
        verbose: print each value.
        curvature: ``"kfac"`` or ``"ekfac"``.
        damping: ``λ >= 0``.
        k: how many of the most influential samples to keep per step.
        window: ``"run"`` or ``"step"``.
        strategy: ``"exact"`` or ``"heuristic"`` (see :class:`PreconditionedGradNorm`).
        fisher: ``"empirical"``, ``"mc"`` or ``"type-2"`` (the curvature ``F``; ``g_i`` stays the gradient of
            sample ``i``'s own loss); loss: with ``"type-2"``, ``"cross_entropy"`` or ``"mse"``
            (see :class:`CurvatureStatistics`).
    """

    def __init__(self, track_schedule, verbose: bool = False, curvature: str = "kfac", damping: float = 1e-3,
                 k: int = 5, window: str = "run", strategy: str = "exact", fisher: str = "empirical",
                 loss: str | None = None):  # fmt: skip
        self._curvature = _check_kind("SelfInfluence", curvature)
        self._damping = _check_damping("SelfInfluence", damping)
        self._strategy = _check_strategy("SelfInfluence", strategy)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"SelfInfluence(k={k!r}): need a positive int")
        self._k = k
        super().__init__(track_schedule, verbose=verbose, statistics=_statistics_for(curvature), window=window,
                         fisher=fisher, loss=loss)  # fmt: skip
        #: the last step's per-sample values ``[B]`` (not stored in the log)
        self.last_values: torch.Tensor | None = None

    def settings(self) -> dict:
        return {**super().settings(), "curvature": self._curvature, "damping": self._damping, "k": self._k,
                "strategy": self._strategy}  # fmt: skip

    def per_sample_stats(self, global_step: int) -> list:
        if not self.should_compute(global_step):
            return []
        return super().per_sample_stats(global_step) + [RetainedForInfluence(self._key)]

    def _compute(self, global_step, params, batch_loss):
        self._absorb(global_step)
        record = get_record(global_step)
        retained = record.stat(RetainedForInfluence(self._key))
        index = {id(p): i for i, p in enumerate(params)}
        try:
            if self._strategy == "exact":
                values = self._in_eigenbasis(params, retained, index)
            else:  # the π-damped inverse has no common eigenbasis: inverse-Hessian-vector products
                inverse, covered = self._inverse(params, self._curvature, self._damping, self._strategy)
                grads = [_per_sample_rows(retained[index[id(p)]], p) for p in covered]
                solved = inverse(grads)
                values = sum((g * s).reshape(g.shape[0], -1).sum(1) for g, s in zip(grads, solved))
        finally:
            retained.clear()
        self.last_values = values.detach()
        return summarize_influence(values, record.info.get("sample_ids"), self._k)

    def _in_eigenbasis(self, params, retained, index) -> torch.Tensor:
        """``s_i = sum_layers sum (Q_Gᵀ g_i Q_A)² / (λ + damping)``: one rotation per per-sample gradient
        (:mod:`cockpit_like.functional.kronecker_quadratic`), factors never materialised."""
        entries = layer_eigen(self.plan, params, self._curvature)
        if not entries:
            raise RuntimeError(
                "SelfInfluence: no tracked parameter belongs to a logged layer (nn.Linear, nn.Conv2d, Hugging Face "
                "Conv1D); pass Cockpit(..., model=model)"
            )
        total = None
        for entry in entries:
            spec, q_g, q_a = entry["spec"], entry["q_g"], entry["q_a"]
            weights = self._weights(spec.name, entry["values"])
            kept = retained[index[id(entry["weight"])]]
            swapped = spec.kind == "hf_conv1d"  # weight [in, out]: its factors have the roles swapped
            if isinstance(kept, RetainedFactors):
                delta, x = (kept.x, kept.delta) if swapped else (kept.delta, kept.x)
                part = quadratic_forms_factors(delta * delta.shape[0], x, q_g, q_a, weights)
            elif isinstance(kept, RetainedSequence):
                a, b = (kept.b, kept.a) if swapped else (kept.a, kept.b)
                part = quadratic_forms_sequence(a * a.shape[0], b, q_g, q_a, weights)
            else:
                grads = _per_sample_rows(kept, entry["weight"])
                part = quadratic_forms_dense(spec.weight_matrix(grads), q_g, q_a, weights)
            if entry["bias"] is not None:
                grads = _per_sample_rows(retained[index[id(entry["bias"])]], entry["bias"])
                one = torch.ones(1, 1, dtype=q_g.dtype, device=q_g.device)
                bias_weights = self._weights(spec.name, entry["bias_values"].reshape(-1, 1))
                part = part + quadratic_forms_dense(grads.reshape(len(grads), -1, 1), q_g, one, bias_weights)
            total = part if total is None else total + part
        return total

    def _weights(self, layer: str, values: torch.Tensor) -> torch.Tensor:
        """``1 / (max(λ, 0) + damping)``: eigenvalues clipped at zero before damping.

        KFAC / EK-FAC eigenvalues are those of a positive semi-definite matrix;
        a zero or slightly negative one (round-off of a rank-deficient factor:
        more features than samples) is a zero. With ``damping > 0`` the weights
        are then at most ``1 / damping``; with ``damping = 0`` a zero eigenvalue
        makes ``F`` singular, a clear error.
        """
        clipped = values.clamp(min=0)
        if self._damping > 0:
            return 1.0 / (clipped + self._damping)
        tolerance = sum(values.shape) * torch.finfo(values.dtype).eps * float(values.abs().max())
        if bool((clipped <= tolerance).any()):
            raise ValueError(
                f"SelfInfluence: layer '{layer}' has curvature eigenvalue 0 and damping=0, so F is singular; "
                "use damping > 0"
            )
        return 1.0 / clipped


def summarize_influence(values: torch.Tensor, sample_ids: Any, k: int) -> dict:
    """Summary statistics of per-sample values and the ``k`` largest with their ids (see :class:`SelfInfluence`)."""
    values = values.detach().double().cpu()
    batch = values.numel()
    if sample_ids is not None:
        if isinstance(sample_ids, torch.Tensor):
            sample_ids = sample_ids.tolist()
        sample_ids = list(sample_ids)
        if len(sample_ids) != batch:
            raise ValueError(
                f"SelfInfluence: info['sample_ids'] has {len(sample_ids)} entries for a batch of {batch}; give one id "
                "per row of the batch"
            )
    order = torch.argsort(values, descending=True)[:k].tolist()
    top = []
    for position in order:
        sample = position if sample_ids is None else sample_ids[position]
        if not isinstance(sample, (int, float, str, bool)) and sample is not None:
            sample = str(sample)
        top.append({"id": sample, "position": position, "value": float(values[position])})
    return {
        "mean": float(values.mean()),
        "std": float(values.std()) if batch > 1 else 0.0,
        "min": float(values.min()),
        "max": float(values.max()),
        "median": float(values.median()),
        "batch": batch,
        "top": top,
    }


def influence_rows(steps: dict, step: int | None = None, top: int = 20, name: str | None = None) -> list[tuple]:
    """``(value, step, id, position, quantity)`` of the most influential samples stored in a log, largest first.

    ``steps`` is a log's ``{step: {quantity: value}}``; every quantity whose
    value has SelfInfluence's form (``"top"`` entries) is read, or only ``name``;
    ``step`` keeps one step. ``cockpit-like influence LOG`` prints these rows.
    """
    rows = []
    for at, values in steps.items():
        if step is not None and int(at) != step:
            continue
        for key, value in values.items():
            if name is not None and key != name:
                continue
            if isinstance(value, dict) and isinstance(value.get("top"), list):
                for entry in value["top"]:
                    rows.append((float(entry["value"]), int(at), entry["id"], entry["position"], key))
    rows.sort(key=lambda row: (-row[0], row[1]))
    return rows[:top]
