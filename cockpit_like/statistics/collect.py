"""Filling the logs during the cockpit's backward pass, and merging steps into running statistics.

:class:`LayerLogs` is a per-sample statistic
(:class:`~cockpit_like.backends.per_sample.PerSampleStat`) of the existing
reducer: the hook backend hands it each call of a logged layer (its input
and output gradient, :meth:`LayerLogs.accumulate_module`) and, like every
per-sample statistic, each parameter's per-sample gradient in whatever form
it comes (factors, sequence factors, ``grad_batch``). Nothing is kept per
sample beyond one layer. :class:`StatisticsPlan` holds what a requester logs
and its running (merged) state, which is plain dicts of tensors and ints.

Where the ``forward`` and ``backward`` rows come from (``layers_from``):

- ``"modules"`` (the default): the calls of the logged modules
  (``nn.Linear``, ``nn.Conv2d``, Hugging Face ``Conv1D``) that the hook
  backend sees, one log per module;
- ``"factors"``: every weight whose per-sample gradient arrives as a sum of
  outer products, ``grad_batch[n] = sum_t a_{n,t} b_{n,t}^T`` (a linear
  map's weight, from any backend: the hook rules of ``nn.Linear`` and HF
  ``Conv1D``, ``nn.MultiheadAttention``'s projections, BackPACK's linear
  path), one log per weight named like the weight: ``backward`` holds the
  rows ``B a`` of the weight's first (row) dimension, ``forward`` the rows
  ``b`` of its second, so that ``G ⊗ A`` is the block in the weight's own
  row-major flattening (for HF ``Conv1D``, whose weight is ``[in, out]``,
  ``forward`` thus holds the output gradients; the row scale of micro-batches
  and a ``GradScaler`` sits on ``a``, exact in ``G ⊗ A``). The ``grad`` log
  then holds the other parameters (biases, convolutions given as
  ``grad_batch``, norms, embeddings, a weight whose calls were summed), each
  parameter in exactly one place. ``KFACTrace(curvature="empirical")`` reads
  such a plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cockpit_like.backends.distributed import unwrap
from cockpit_like.backends.per_sample import PerSampleStat, materialize_linear, materialize_sequence
from cockpit_like.functional.ekfac import ekfac_eigenvalues, ekfac_eigenvalues_sequence
from cockpit_like.statistics.base import Covariance, Statistic
from cockpit_like.statistics.logs import LOGS, LayerSpec, empty_states, find_layers, layer_rows, parse_statistics

__all__ = ["StatisticsPlan", "LayerLogs", "merge_logs", "finalize_logs"]


def merge_logs(stats: dict[str, tuple[Statistic, ...]], running: dict, step: dict) -> dict:
    """Running logs merged with one step's (``{"layers": {name: {log: {stat: state}}}, "grad": {param: {stat: state}}}``)."""
    merged = {
        "layers": dict(running.get("layers", {})),
        "grad": dict(running.get("grad", {})),
        "bases": {**running.get("bases", {}), **step.get("bases", {})},  # EK-FAC's: the latest
    }
    for name, logs in step.get("layers", {}).items():
        before = merged["layers"].get(name)
        merged["layers"][name] = logs if before is None else {
            log: {s.name: s.merge(before[log][s.name], logs[log][s.name]) for s in stats[log]} for log in ("forward", "backward")
        }
    for name, states in step.get("grad", {}).items():
        before = merged["grad"].get(name)
        merged["grad"][name] = states if before is None else {s.name: s.merge(before[s.name], states[s.name]) for s in stats["grad"]}
    return merged


def finalize_logs(stats: dict[str, tuple[Statistic, ...]], logs: dict) -> dict:
    """``{"layers": {name: {log: {stat: value}}}, "grad": {param: {stat: value}}}``."""
    return {
        "layers": {
            name: {log: {s.name: s.finalize(states[log][s.name]) for s in stats[log]} for log in ("forward", "backward")}
            for name, states in logs.get("layers", {}).items()
        },
        "grad": {name: {s.name: s.finalize(states[s.name]) for s in stats["grad"]} for name, states in logs.get("grad", {}).items()},
    }


class StatisticsPlan:
    """What one requester logs (parsed configuration, the logged layers) and its running logs.

    Args:
        config: ``"kfac"``, ``"ekfac"`` or ``{"forward": [...], "backward": [...], "grad": [...]}``
            (:func:`~cockpit_like.statistics.logs.parse_statistics`).
        window: ``"run"`` (running statistics over the tracked steps) or ``"step"``.
        layers_from: ``"modules"`` or ``"factors"`` (see the module docstring).

    Attributes:
        running: the merged logs of all steps so far (plain dicts; see :func:`merge_logs`).
    """

    def __init__(self, config: str | dict = "kfac", window: str = "run", layers_from: str = "modules"):
        if window not in ("run", "step"):
            raise ValueError(f"window={window!r}: 'run' (running statistics over the tracked steps) or 'step'")
        if layers_from not in ("modules", "factors"):
            raise ValueError(
                f"layers_from={layers_from!r}: 'modules' (the logged modules' calls) or 'factors' (every weight whose "
                "per-sample gradient arrives as a sum of outer products)"
            )
        self.stats = parse_statistics(config)
        if layers_from == "factors" and any(getattr(s, "eigenbasis", False) for s in self.stats["grad"]):
            raise ValueError(
                "layers_from='factors' logs a layer's weight in 'forward'/'backward' only, not in 'grad': EK-FAC's "
                "eigenvalues need layers_from='modules'"
            )
        self.window = window
        self.layers_from = layers_from
        self.layers: dict[int, LayerSpec] = {}
        self.param_names: dict[int, str] = {}
        #: ids of logged layers' parameters that other modules use too (tied weights): not covered
        self.shared: set[int] = set()
        self.running: dict = {"layers": {}, "grad": {}, "bases": {}}

    def absorb(self, step: dict) -> None:
        """Merge one step's logs into :attr:`running` (``window="step"``: replace them)."""
        empty = {"layers": {}, "grad": {}, "bases": {}}
        self.running = merge_logs(self.stats, empty if self.window == "step" else self.running, step)

    def state_dict(self) -> dict:
        """The running logs (plain dicts of tensors and ints), for resuming a run."""
        return {"running": self.running}

    def load_state_dict(self, state: dict) -> None:
        self.running = state["running"]

    def set_models(self, models: list[torch.nn.Module]) -> None:
        """Find the logged layers and name the parameters (``layer.weight``; others by their model path)."""
        self.layers = find_layers(models) if self.layers_from == "modules" else {}
        names: dict[int, str] = {}
        for spec in self.layers.values():
            names[id(spec.weight)] = f"{spec.name}.weight"
            if spec.bias is not None:
                names[id(spec.bias)] = f"{spec.name}.bias"
        for position, model in enumerate(models):
            for name, param in unwrap(model).named_parameters():
                names.setdefault(id(param), name if len(models) == 1 else f"{position}.{name}")
        self.param_names = names
        owners: dict[int, int] = {}
        for model in models:
            for module in model.modules():
                for param in module.parameters(recurse=False):
                    owners[id(param)] = owners.get(id(param), 0) + 1
        self.shared = {key for key, count in owners.items() if count > 1}
        self._roles = {}
        for spec in self.layers.values():
            self._roles[id(spec.weight)] = (spec, "weight")
            if spec.bias is not None:
                self._roles[id(spec.bias)] = (spec, "bias")

    def names(self, params: list[torch.Tensor]) -> list[str]:
        """The names the logs use for ``params`` (``param<index>`` for a parameter of no known model)."""
        return [self.param_names.get(id(p), f"param{index}") for index, p in enumerate(params)]

    def role(self, param: torch.Tensor) -> tuple[LayerSpec, str] | None:
        """``(layer, "weight" | "bias")`` of a logged layer's parameter, else ``None``."""
        return getattr(self, "_roles", {}).get(id(param))

    @property
    def wants_grads(self) -> bool:
        return bool(self.stats["grad"])

    def covariance(self, log: str) -> Statistic:
        """The ``Covariance`` statistic of ``log`` (KFAC's factor), or a clear error."""
        for stat in self.stats[log]:
            if isinstance(stat, Covariance):
                return stat
        raise ValueError(f"the statistics log no Covariance in {log!r}: KFAC needs it in 'forward' and 'backward'")

    def finalized(self, logs: dict | None = None) -> dict:
        return finalize_logs(self.stats, self.running if logs is None else logs)


class _Step:
    """One step's logs while the backward pass runs."""

    __slots__ = ("plan", "layers", "grad", "bases", "names")

    def __init__(self, plan: StatisticsPlan, params: list[torch.Tensor]):
        self.plan = plan
        self.layers: dict[str, dict] = {}
        self.grad: dict[str, dict] = {}
        self.bases: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.names = dict(enumerate(plan.names(params)))

    # ---- forward and backward logs ------------------------------------------------------
    def observe(self, module, x: torch.Tensor, delta: torch.Tensor) -> None:
        spec = self.plan.layers.get(id(module))
        if spec is None:
            return
        inputs, grads, batch = layer_rows(spec, x.detach(), delta.detach())
        self._log_rows(spec.name, inputs, grads, batch)

    def _log_rows(self, name: str, inputs: torch.Tensor, grads: torch.Tensor, batch: int) -> None:
        """Fold ``inputs`` ``[B T, in]`` (count ``B T``) and ``grads`` ``[B T, out]`` (count ``B``) into layer ``name``."""
        stats = self.plan.stats
        logs = self.layers.get(name)
        # a layer called several times in the pass (used twice, weight tying within a layer): its calls' rows are
        # positions of the same samples ("expand" over calls), so the inputs count B T per call, and the output
        # gradients count the B samples once
        samples = batch if logs is None else 0
        if logs is None:
            logs = self.layers[name] = {"forward": empty_states(stats["forward"]), "backward": empty_states(stats["backward"])}
        for stat in stats["forward"]:
            logs["forward"][stat.name] = stat.update(logs["forward"][stat.name], inputs, inputs.shape[0])
        for stat in stats["backward"]:
            logs["backward"][stat.name] = stat.update(logs["backward"][stat.name], grads, samples)

    def _log_factors(self, index: int, factors, sequence) -> bool:
        """``layers_from="factors"``: log a weight given as ``sum_t a_t b_t^T`` as a layer (``True`` if it was)."""
        if factors is not None:
            kind, x, delta = factors
            if kind != "weight":
                return False
            a, b = delta.detach(), x.detach()  # grad_batch[n] = delta_n x_n^T
        elif sequence is not None:
            a, b = sequence[0].detach(), sequence[1].detach()
        else:
            return False
        batch = a.shape[0]
        self._log_rows(self.names[index], b.reshape(-1, b.shape[-1]), a.reshape(-1, a.shape[-1]) * batch, batch)
        return True

    # ---- grad log -------------------------------------------------------------------------
    def basis(self, spec: LayerSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(Q_G, Q_A)``: eigenvectors of the layer's factors, accumulated up to and including this step
        (``None`` if the layer's inputs and output gradients were not logged at this step)."""
        if spec.name not in self.bases:
            if spec.name not in self.layers:  # not seen by the hook backend (BackPACK's BatchGrad): not logged
                return None
            vectors = []
            for log in ("backward", "forward"):
                stat = self.plan.covariance(log)
                state = self.layers[spec.name][log][stat.name]
                before = self.plan.running["layers"].get(spec.name) if self.plan.window == "run" else None
                if before is not None:
                    state = stat.merge(before[log][stat.name], state)
                vectors.append(torch.linalg.eigh(stat.finalize(state))[1])
            self.bases[spec.name] = (vectors[0], vectors[1])
        return self.bases[spec.name]

    def per_sample(self, index: int, param: torch.Tensor, dense=None, factors=None, sequence=None) -> None:
        if self.plan.layers_from == "factors" and self._log_factors(index, factors, sequence):
            return
        stats = [s for s in self.plan.stats["grad"] if s.wants(param.numel())]
        if not stats:
            return
        role = self.plan.role(param)
        if role is not None and any(getattr(s, "eigenbasis", False) for s in stats) and self.basis(role[0]) is None:
            role = None  # the layer was not logged at this step: no eigenbasis
        stats = [s for s in stats if role is not None or not getattr(s, "eigenbasis", False)]
        if not stats:
            return
        name = self.names[index]
        states = self.grad.get(name)
        if states is None:
            states = self.grad[name] = empty_states(self.plan.stats["grad"])
        flat = None
        for stat in stats:
            if getattr(stat, "eigenbasis", False):
                summed, batch = self._rotated_squares(role, dense, factors, sequence)
                states[stat.name] = stat.add_sum(states[stat.name], summed, batch)
                continue
            if flat is None:
                flat = self._dense(param, dense, factors, sequence)
            states[stat.name] = stat.update(states[stat.name], flat, flat.shape[0])

    @staticmethod
    def _dense(param, dense, factors, sequence) -> torch.Tensor:
        """Per-sample gradients of the per-sample losses, ``[B, D]`` (``B`` times ``grad_batch``)."""
        if factors is not None:
            grad_batch = materialize_linear(*factors)
        elif sequence is not None:
            grad_batch = materialize_sequence(sequence[0], sequence[1], param.shape)
        else:
            grad_batch = dense
        grad_batch = grad_batch.detach()
        return grad_batch.reshape(grad_batch.shape[0], -1) * grad_batch.shape[0]

    def _rotated_squares(self, role, dense, factors, sequence) -> tuple[torch.Tensor, int]:
        """``sum_n (Q_G^T g_n Q_A)^2`` (``[out, in]``; a bias ``sum_n (Q_G^T g_n)^2``) and ``B``.

        ``g_n = B grad_batch[n]``: :mod:`cockpit_like.functional.ekfac` with ``scale = B^2`` (a sum).
        """
        spec, kind = role
        q_g, q_a = self.basis(spec)
        if kind == "bias":
            grads = factors[2] if factors is not None else dense
            if grads is None:
                raise RuntimeError(f"EK-FAC: the bias of '{spec.name}' came as sequence factors")
            grads = grads.detach().reshape(grads.shape[0], -1, 1)
            batch = grads.shape[0]
            one = torch.ones(1, 1, dtype=q_g.dtype, device=q_g.device)
            return ekfac_eigenvalues(grads, q_g, one, scale=batch * batch)[:, 0], batch
        if factors is not None:  # weight[i] = delta_i x_i^T
            _, x, delta = factors
            if spec.kind == "hf_conv1d":  # its factors come with the roles swapped (weight [in, out])
                x, delta = delta, x
            batch = delta.shape[0]
            return ekfac_eigenvalues_sequence(delta.detach(), x.detach(), q_g, q_a, scale=batch * batch), batch
        if sequence is not None:  # weight[i] = sum_t a_it b_it^T: rows a on G's side unless HF Conv1D
            a, b = sequence
            if spec.kind == "hf_conv1d":
                a, b = b, a
            batch = a.shape[0]
            return ekfac_eigenvalues_sequence(a.detach(), b.detach(), q_g, q_a, scale=batch * batch), batch
        matrices = spec.weight_matrix(dense.detach())
        batch = matrices.shape[0]
        return ekfac_eigenvalues(matrices, q_g, q_a, scale=batch * batch), batch

    def result(self) -> dict:
        return {"layers": self.layers, "grad": self.grad, "bases": self.bases}


@dataclass(frozen=True)
class LayerLogs(PerSampleStat):
    """The per-sample statistic that fills a :class:`StatisticsPlan`'s logs for one step.

    Equality is by ``key`` (one per requester); the result of a step is
    ``{"layers": {name: {"forward": {stat: state}, "backward": {...}}}, "grad": {param: {stat: state}}}``
    (states, not values: the requester merges them into its running logs).
    """

    key: str
    plan: StatisticsPlan = field(compare=False, hash=False, repr=False, default=None)

    factor_form = True
    sequence_form = True

    @property
    def module_form(self) -> bool:
        """Layer calls are read only by a plan that logs modules (``layers_from="modules"``)."""
        return self.plan is None or self.plan.layers_from == "modules"

    def init(self, params):
        return _Step(self.plan, params)

    def accumulate_module(self, state, module, x, delta):
        state.observe(module, x, delta)
        return state

    def accumulate(self, state, index, param, grad_batch):
        state.per_sample(index, param, dense=grad_batch)
        return state

    def accumulate_factors(self, state, index, param, kind, x, delta):
        state.per_sample(index, param, factors=(kind, x, delta))
        return state

    def accumulate_sequence(self, state, index, param, a, b):
        state.per_sample(index, param, sequence=(a, b))
        return state

    def finalize(self, state) -> dict[str, Any]:
        return state.result()

    def across_ranks(self, result, reduction):
        """Under DistributedDataParallel: the step's logs of the global batch, in the one all-reduce.

        Rows are scale-free (inputs; per-sample output gradients and
        gradients of the per-sample losses), so a "sum and count" state
        adds up over the ranks; ``Log`` values are concatenated in rank
        order; a statistic with a ``merge`` of its own gets every rank's
        state and merges them in rank order. EK-FAC's eigenbasis statistic
        cannot: its rotation uses the factors of the rank's own half of the
        batch before they are reduced.
        """
        if result.get("bases"):
            raise NotImplementedError(
                f"EK-FAC's corrected eigenvalues of a step split into {reduction.parts}: each part rotates its "
                "per-sample gradients into the eigenbasis of its own factors before the statistics are merged, "
                "which is not the basis of the whole step. Use statistics='kfac' (or KFAC-based quantities: "
                "curvature='kfac') there; EK-FAC needs the step's rows in one backward pass of one process."
            )
        stats = self.plan.stats
        finishers = {
            "layers": {
                name: {log: {s.name: _state_across_ranks(s, logs[log][s.name], reduction) for s in stats[log]}
                       for log in ("forward", "backward")}  # fmt: skip
                for name, logs in result["layers"].items()
            },
            "grad": {
                name: {s.name: _state_across_ranks(s, states[s.name], reduction) for s in stats["grad"]}
                for name, states in result["grad"].items()
            },
        }

        def finish() -> dict[str, Any]:
            return {
                "layers": {name: {log: {k: f() for k, f in states.items()} for log, states in logs.items()}
                           for name, logs in finishers["layers"].items()},  # fmt: skip
                "grad": {name: {k: f() for k, f in states.items()} for name, states in finishers["grad"].items()},
                "bases": {},
            }

        return finish


def _state_across_ranks(stat: Statistic, state: dict[str, Any], reduction):
    """A finisher of one statistic's state across the ranks (see :meth:`LayerLogs.across_ranks`)."""
    from cockpit_like.statistics.base import Log

    keys = sorted(state)
    if isinstance(stat, Log):
        kinds = {key: "cat" if key == "values" else "sum" for key in keys}
    elif type(stat).merge is Statistic.merge:
        kinds = dict.fromkeys(keys, "sum")
    else:
        kinds = dict.fromkeys(keys, "cat")
    parts = {}
    for key in keys:
        value = state[key]
        if value is None:
            continue  # this statistic saw nothing at this step (on every rank: the ranks run the same model)
        # a tensor stays where it is; a Python number (a count) is merged on the CPU
        tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value, device="cpu")
        if kinds[key] == "cat" and not isinstance(stat, Log):
            tensor = tensor.unsqueeze(0)  # one slot per rank: every rank's own state comes back
        parts[key] = (getattr(reduction, kinds[key])(tensor), isinstance(value, torch.Tensor))

    def value_of(key):
        part, is_tensor = parts[key]
        return part.value if is_tensor else part.value.item()

    def finish() -> dict[str, Any]:
        if isinstance(stat, Log) or type(stat).merge is Statistic.merge:
            return {key: value_of(key) if key in parts else None for key in keys}
        merged = None
        for rank in range(reduction.world):  # every rank's own state, merged in rank order
            own = {}
            for key in keys:
                if key not in parts:
                    own[key] = None
                    continue
                part, is_tensor = parts[key]
                own[key] = part.value[rank] if is_tensor else part.value[rank].item()
            merged = own if merged is None else stat.merge(merged, own)
        return merged

    return finish
