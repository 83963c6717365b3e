"""The three logs per layer (``forward``, ``backward``, ``grad``), the configuration, and the logged layers.

Rows each log hands its statistics (a layer applied to ``B`` samples at ``T``
positions each: ``T = 1`` for a plain linear layer, the tokens of a sequence,
the output pixels of a convolution):

==============  ===========================================================  ===============
log             rows                                                         count
==============  ===========================================================  ===============
``forward``     the layer inputs ``x_{n,t}`` ``[B T, in]`` (a convolution's   ``B T``
                unfolded input patches, ``in = C kh kw``)
``backward``    the output gradients of each sample's loss,                  ``B``
                ``B delta_{n,t}`` ``[B T, out]`` (``delta`` is the gradient
                of the mean loss, which carries ``1/B``)
``grad``        per parameter, the per-sample gradients ``g_n`` ``[B, D]``   ``B``
==============  ===========================================================  ===============

So ``Covariance`` on ``forward`` is ``A = (1/(B T)) sum_{n,t} x x^T`` and on
``backward`` ``G = (1/B) sum_{n,t} (B delta)(B delta)^T``: KFAC's factors of
the empirical Fisher ``F = (1/B) sum_n g_n g_n^T`` with the "expand"
convention for weight sharing (curvlinops' ``KFACType.EXPAND``,
``FisherType.EMPIRICAL``, mean reduction), ``F ≈ G ⊗ A``.

Layers logged: ``nn.Linear``, ``nn.Conv2d`` (``groups == 1``) and Hugging
Face's ``Conv1D`` (whose weight is stored transposed), seen through the hook
backend (:mod:`cockpit_like.backends.hooks`); their per-sample gradients come
from the same backward pass. A plan with ``layers_from="factors"``
(:mod:`cockpit_like.statistics.collect`) logs instead every weight whose
per-sample gradient arrives as a sum of outer products, with the same
normalisation.

May import torch, :mod:`cockpit_like.backends` and this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cockpit_like.backends.conv_unfold import unfold_conv2d_input
from cockpit_like.backends.distributed import unwrap
from cockpit_like.backends.module_rules import is_hf_conv1d
from cockpit_like.statistics.base import Covariance, Log, Mean, Statistic

__all__ = ["LOGS", "KroneckerEigenvalues", "parse_statistics", "LayerSpec", "find_layers", "layer_rows"]

LOGS = ("forward", "backward", "grad")


class KroneckerEigenvalues(Statistic):
    """EK-FAC's corrected eigenvalues (a ``grad`` statistic): ``(1/B) sum_n (Q_G^T g_n Q_A)^2``.

    ``g_n`` is sample ``n``'s weight gradient as an ``[out, in]`` matrix and
    ``Q_A``, ``Q_G`` the eigenvectors of the layer's ``forward`` and
    ``backward`` covariances (accumulated up to and including the step); for
    a bias ``(1/B) sum_n (Q_G^T g_n)^2``. The collector rotates the
    per-sample gradients and hands the squares' sum to :meth:`add_sum`.
    The eigenbasis changes from step to step, so :meth:`merge` keeps the
    later side (the eigenvalues of the latest step, in the latest basis).
    """

    name = "kronecker_eigenvalues"
    #: the collector rotates the per-sample gradients into the layer's Kronecker eigenbasis
    eigenbasis = True

    def update(self, state, values, count):
        return self.add_sum(state, (values * values).sum(0), count)

    def merge(self, state, other):
        return state if other["sum"] is None else {"sum": other["sum"].clone(), "count": other["count"]}


_SHORT = {
    "kfac": {"forward": [Covariance], "backward": [Covariance], "grad": []},
    "ekfac": {"forward": [Covariance], "backward": [Covariance], "grad": [KroneckerEigenvalues]},
}


def parse_statistics(config: str | dict) -> dict[str, tuple[Statistic, ...]]:
    """``{"forward": (...), "backward": (...), "grad": (...)}`` of statistic instances.

    ``config`` is ``"kfac"``, ``"ekfac"`` or a dict with some of the three
    logs as keys and lists of statistic classes or instances as values, e.g.
    ``{"forward": [Covariance], "backward": [Covariance, Mean], "grad": []}``.
    """
    if isinstance(config, str):
        if config not in _SHORT:
            raise ValueError(f"statistics={config!r}: unknown short form; use one of {sorted(_SHORT)} or a dict")
        config = _SHORT[config]
    if not isinstance(config, dict):
        raise ValueError(f"statistics must be 'kfac', 'ekfac' or a dict of logs, got {type(config).__name__}")
    unknown = sorted(set(config) - set(LOGS))
    if unknown:
        raise ValueError(f"statistics: unknown logs {unknown}; the logs are {list(LOGS)}")
    parsed = {}
    for log in LOGS:
        entries = config.get(log, [])
        if not isinstance(entries, (list, tuple)):
            raise ValueError(f"statistics[{log!r}] must be a list of statistics, got {type(entries).__name__}")
        stats = []
        for entry in entries:
            if isinstance(entry, type) and issubclass(entry, Statistic):
                entry = entry()
            if not isinstance(entry, Statistic):
                raise ValueError(
                    f"statistics[{log!r}]: {entry!r} is not a Statistic (cockpit_like.statistics.Mean, "
                    "Covariance, Log, or a subclass of Statistic)"
                )
            if getattr(entry, "eigenbasis", False) and log != "grad":
                raise ValueError(f"statistics[{log!r}]: {type(entry).__name__} is a 'grad' statistic")
            if any(s.name == entry.name for s in stats):
                raise ValueError(f"statistics[{log!r}]: two statistics named {entry.name!r}")
            stats.append(entry)
        parsed[log] = tuple(stats)
    if any(getattr(s, "eigenbasis", False) for s in parsed["grad"]):
        for log in ("forward", "backward"):
            if not any(isinstance(s, Covariance) for s in parsed[log]):
                raise ValueError(
                    f"statistics: KroneckerEigenvalues (EK-FAC) needs Covariance in {log!r}, the factor "
                    "whose eigenvectors form the basis"
                )
    return parsed


@dataclass(frozen=True)
class LayerSpec:
    """A logged layer: its name, kind (``"linear"``, ``"conv2d"``, ``"hf_conv1d"``) and parameters."""

    name: str
    kind: str
    module: nn.Module

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.module.bias

    @property
    def sizes(self) -> tuple[int, int]:
        """``(out, in)``: the sides of ``G`` and ``A``."""
        w = self.module.weight
        if self.kind == "hf_conv1d":
            return w.shape[1], w.shape[0]
        return w.shape[0], w[0].numel()

    def weight_matrix(self, grad_batch: torch.Tensor) -> torch.Tensor:
        """Per-sample weight gradients ``[B, *weight.shape]`` as ``[B, out, in]`` matrices."""
        batch = grad_batch.shape[0]
        if self.kind == "hf_conv1d":
            return grad_batch.reshape(batch, *self.module.weight.shape).transpose(1, 2)
        return grad_batch.reshape(batch, self.module.weight.shape[0], -1)


def _kind(module: nn.Module) -> str | None:
    if type(module) is nn.Linear:
        return "linear"
    if type(module) is nn.Conv2d and module.groups == 1:
        return "conv2d"
    if is_hf_conv1d(module):
        return "hf_conv1d"
    return None


def find_layers(models: list[nn.Module]) -> dict[int, LayerSpec]:
    """``{id(module): LayerSpec}`` of the loggable layers of ``models`` (named by their module paths)."""
    found: dict[int, LayerSpec] = {}
    names: set[str] = set()
    for position, model in enumerate(models):
        for name, module in unwrap(model).named_modules():
            kind = _kind(module)
            if kind is None or id(module) in found:
                continue
            name = name or type(module).__name__
            if len(models) > 1:
                name = f"{position}.{name}"
            while name in names:
                name += "_"
            names.add(name)
            found[id(module)] = LayerSpec(name, kind, module)
    return found


def layer_rows(spec: LayerSpec, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(inputs [B T, in], B * delta [B T, out], B)`` of one call of a logged layer."""
    batch = delta.shape[0]
    if spec.kind == "conv2d":
        patches = unfold_conv2d_input(spec.module, x)  # [B, C kh kw, L]
        inputs = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        grads = delta.reshape(batch, delta.shape[1], -1).transpose(1, 2).reshape(-1, delta.shape[1])
    else:
        inputs, grads = x.reshape(-1, x.shape[-1]), delta.reshape(-1, delta.shape[-1])
    return inputs, grads * batch, batch


def empty_states(stats: tuple[Statistic, ...]) -> dict[str, Any]:
    return {s.name: s.init() for s in stats}
