"""KFAC / EK-FAC records of logged statistics, for :mod:`cockpit_like.operators` and :mod:`cockpit_like.ihvp`.

:func:`layer_curvatures` turns a :class:`~cockpit_like.statistics.collect.StatisticsPlan`'s
running logs into :class:`~cockpit_like.operators.LayerCurvature` records,
``A`` = ``Covariance`` of ``forward``, ``G`` = ``Covariance`` of ``backward``,
and (EK-FAC) the ``KroneckerEigenvalues`` of ``grad`` with the eigenbasis they
were computed in. It also returns the covered parameters in the cockpit's
order: a logged layer's weight (and bias) when the cockpit tracks them and
no other module uses them too (a tied embedding, whose gradient has a part
the layer does not see, is left out).

Adapter for Hugging Face ``Conv1D`` (weight ``[in, out]``, flattened in that
order): its weight is a record with the roles of the factors swapped (the
block ``A ⊗ G`` of ``W.flatten()``), its bias a record of its own named
``"<layer>(bias)"`` on a placeholder weight that is never in ``params``.
"""

from __future__ import annotations

import torch

from cockpit_like.operators import BlockDiagonal, LayerCurvature, ekfac_operator, kfac_operator
from cockpit_like.statistics.collect import StatisticsPlan
from cockpit_like.statistics.logs import KroneckerEigenvalues

__all__ = ["layer_curvatures", "layer_eigen", "curvature_operator", "NotLoggedError"]

KINDS = ("kfac", "ekfac")


class NotLoggedError(LookupError):
    """Curvature asked for a layer or statistic that was not logged."""


def _eigen_name(plan: StatisticsPlan) -> str | None:
    for stat in plan.stats["grad"]:
        if isinstance(stat, KroneckerEigenvalues):
            return stat.name
    return None


def layer_curvatures(
    plan: StatisticsPlan, params: list[torch.Tensor], kind: str = "kfac", damping: float | None = None
) -> tuple[list[LayerCurvature], list[torch.Tensor]]:
    """``(records, covered params in the order of params)`` of the running logs.

    With ``damping``, the records describe ``F + damping I`` in eigen form
    (eigenvalues ``λ_G ⊗ λ_A + damping``, or EK-FAC's ``λ + damping``): build
    them with :func:`~cockpit_like.operators.ekfac_operator`.
    """
    if kind not in KINDS:
        raise ValueError(f"curvature kind {kind!r}: choose 'kfac' or 'ekfac'")
    eigen = _eigen_name(plan)
    if kind == "ekfac" and eigen is None:
        raise NotLoggedError(
            "EK-FAC needs the corrected eigenvalues: log statistics='ekfac' (KroneckerEigenvalues in 'grad')"
        )
    logs = plan.finalized()
    fcov, bcov = plan.covariance("forward").name, plan.covariance("backward").name
    tracked = {id(p) for p in params}
    shared = plan.shared
    records, covered = [], set()
    for spec in plan.layers.values():
        layer = logs["layers"].get(spec.name)
        if layer is None or id(spec.weight) not in tracked or id(spec.weight) in shared:
            continue
        A, G = layer["forward"][fcov], layer["backward"][bcov]
        bias = spec.bias if spec.bias is not None and id(spec.bias) in tracked and id(spec.bias) not in shared else None
        values = bias_values = q_g = q_a = None
        if kind == "ekfac":
            grads = logs["grad"]
            values = grads.get(f"{spec.name}.weight", {}).get(eigen)
            if values is None:
                raise NotLoggedError(f"layer '{spec.name}': no EK-FAC eigenvalues were logged for its weight")
            if bias is not None:
                bias_values = grads.get(f"{spec.name}.bias", {}).get(eigen)
            q_g, q_a = plan.running["bases"][spec.name]
        elif damping is not None:
            (l_g, q_g), (l_a, q_a) = torch.linalg.eigh(G), torch.linalg.eigh(A)
            values = torch.outer(l_g, l_a)
            bias_values = l_g if bias is not None else None
        if damping is not None:
            values = values + damping
            bias_values = None if bias_values is None else bias_values + damping
        if spec.kind == "hf_conv1d":  # adapter: weight [in, out] -> block A ⊗ G
            records.append(LayerCurvature(
                spec.name, spec.weight, G, A,
                eigenvalues=None if values is None else values.T.contiguous(), eigvecs_G=q_a, eigvecs_A=q_g,
            ))  # fmt: skip
            if bias is not None:
                placeholder = torch.empty(G.shape[0], 1, dtype=G.dtype, device=G.device)
                records.append(LayerCurvature(
                    f"{spec.name}(bias)", placeholder, torch.ones(1, 1, dtype=G.dtype, device=G.device), G, bias=bias,
                    eigenvalues=None if values is None else torch.zeros(G.shape[0], dtype=G.dtype, device=G.device),
                    bias_eigenvalues=bias_values, eigvecs_G=q_g,
                    eigvecs_A=None if q_g is None else torch.ones(1, 1, dtype=G.dtype, device=G.device),
                ))  # fmt: skip
        else:
            records.append(LayerCurvature(
                spec.name, spec.weight, A, G, bias=bias, eigenvalues=values, bias_eigenvalues=bias_values,
                eigvecs_G=q_g, eigvecs_A=q_a,
            ))  # fmt: skip
        covered.add(id(spec.weight))
        if bias is not None:
            covered.add(id(bias))
    return records, [p for p in params if id(p) in covered]


def layer_eigen(plan: StatisticsPlan, params: list[torch.Tensor], kind: str = "kfac") -> list[dict]:
    """Per covered layer its Kronecker eigenbasis and eigenvalues (for per-sample quadratic forms).

    Entries ``{"spec", "weight", "bias", "q_g", "q_a", "values" [out, in], "bias_values" [out] | None}``
    (orientation ``[out, in]`` whatever the layer stores); KFAC's eigenvalues are
    ``λ_G ⊗ λ_A`` (clamped at 0: the factors are PSD), EK-FAC's the corrected ones
    in the basis they were computed in.
    """
    records, covered = layer_curvatures(plan, params, kind)
    ids = {id(p) for p in covered}
    logs = plan.finalized() if kind == "kfac" else None
    entries = []
    for spec in plan.layers.values():
        if id(spec.weight) not in ids:
            continue
        bias = spec.bias if spec.bias is not None and id(spec.bias) in ids else None
        if kind == "kfac":
            layer = logs["layers"][spec.name]
            (l_g, q_g), (l_a, q_a) = (torch.linalg.eigh(layer[log][plan.covariance(log).name]) for log in ("backward", "forward"))
            l_g, l_a = l_g.clamp(min=0), l_a.clamp(min=0)
            values, bias_values = torch.outer(l_g, l_a), l_g
        else:
            record = next(r for r in records if r.name == spec.name)
            q_g, q_a = plan.running["bases"][spec.name]
            values = record.eigenvalues if spec.kind != "hf_conv1d" else record.eigenvalues.T
            values = values.reshape(len(q_g), len(q_a))
            bias_values = None
            if bias is not None:
                bias_record = record if spec.kind != "hf_conv1d" else next(r for r in records if r.name == f"{spec.name}(bias)")
                bias_values = bias_record.bias_eigenvalues
        entries.append({"spec": spec, "weight": spec.weight, "bias": bias, "q_g": q_g, "q_a": q_a,
                        "values": values, "bias_values": bias_values if bias is not None else None})  # fmt: skip
    return entries


def curvature_operator(
    plan: StatisticsPlan, params: list[torch.Tensor], kind: str = "kfac", damping: float | None = None, layers=None
):
    """KFAC / EK-FAC (``+ damping I``) of the logged layers, a named :class:`~cockpit_like.operators.BlockDiagonal`.

    Args:
        layers: names of logged layers to keep (default: all); an unknown name is a :class:`NotLoggedError`.
    """
    if damping is not None:
        if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not damping >= 0:
            raise ValueError(f"damping must be None or a float >= 0, got {damping!r}")
        damping = float(damping)
    records, covered = layer_curvatures(plan, params, kind, damping)
    if layers is not None:
        if isinstance(layers, str):
            layers = [layers]
        logged = sorted(spec.name for spec in plan.layers.values() if spec.name in plan.running["layers"])
        unknown = [name for name in layers if name not in logged]
        if unknown:
            raise NotLoggedError(
                f"layers {unknown} were not logged; logged layers: {logged} (only nn.Linear, nn.Conv2d and "
                "Hugging Face Conv1D layers computed by the hook backend at a tracked step are logged)"
            )
        keep = set(layers) | {f"{name}(bias)" for name in layers}
        records = [r for r in records if r.name in keep]
        ids = {id(p) for r in records for p in r.parameters() + ([r.bias] if r.bias is not None else [])}
        covered = [p for p in covered if id(p) in ids]
    if not records:
        raise NotLoggedError(
            "no layer has logged curvature yet: the quantity must have tracked a step of a model with nn.Linear / "
            "nn.Conv2d / Hugging Face Conv1D layers (pass Cockpit(..., model=model))"
        )
    build = ekfac_operator if (kind == "ekfac" or damping is not None) else kfac_operator
    operator = build(records, covered)
    if any(name.endswith("(bias).bias") for name in operator.names):  # the HF Conv1D adapter's bias records
        operator = BlockDiagonal(operator.blocks, [name.replace("(bias).bias", ".bias") for name in operator.names])
    return operator, covered
