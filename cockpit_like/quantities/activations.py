"""Statistics of activation functions' outputs: :class:`ActivationStats`.

Forward hooks on the activation *modules* (``nn.ReLU``, ``nn.ReLU6``,
``nn.GELU``, ``nn.SiLU``, ``nn.Mish``, ``nn.Hardswish``, ``nn.Tanh``,
``nn.Sigmoid``, and Hugging Face's GELU, SiLU, Mish and squared-ReLU
modules) of the models the cockpit knows.
The hooks exist only during the forward passes of tracked steps: the cockpit
calls :meth:`ActivationStats.prepare_forward` at the start of a forward pass
whose step is scheduled, the hooks are removed when the step's value is
stored, and an untracked step runs no hook at all. Forward passes without
gradients (evaluation under ``torch.no_grad()``) are not counted.

Limit: activations applied as functions inside ``forward`` (``torch.relu``,
``F.gelu``, ``x.tanh()``) are not modules and are not seen. Wrap them in a
module (``nn.ReLU()``) to have them counted.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from cockpit_like.backends.distributed import unwrap
from cockpit_like.backends.user_state import in_rerun
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["ActivationStats", "activation_kind", "GELU_OFF_BELOW"]

#: a GELU unit counts as off when its input is at most this (|gelu(x)| < 0.005 and |gelu'(x)| < 0.012)
GELU_OFF_BELOW = -3.0
#: a SiLU (swish) or Mish unit counts as off when its input is at most this: the same slope as GELU's bound
#: (|silu'(-6)| = 0.012, |mish'(-6)| = 0.012; |silu(-6)| = 0.015)
SILU_OFF_BELOW = -6.0
#: a Hardswish unit is off (exactly 0, no gradient) where its input is at most this
HARDSWISH_OFF_BELOW = -3.0

#: activation modules of Hugging Face ``transformers.activations`` (matched by class name, so that the package is
#: never imported here), by kind: its GELU approximations, SiLU and Mish, and the squared ReLU
_NAMED_KINDS = {
    "GELUActivation": "gelu", "NewGELUActivation": "gelu", "FastGELUActivation": "gelu", "GELUTanh": "gelu",
    "PytorchGELUTanh": "gelu", "AccurateGELUActivation": "gelu", "QuickGELUActivation": "gelu",
    "ClippedGELUActivation": "gelu", "SiLUActivation": "silu", "MishActivation": "silu",
    "ReLUSquaredActivation": "relu",
}


def activation_kind(module: nn.Module) -> str | None:
    """``"relu"``, ``"relu6"``, ``"gelu"``, ``"silu"`` (SiLU / swish and Mish), ``"hardswish"``, ``"tanh"``,
    ``"sigmoid"`` or None for other modules (Hugging Face's activation modules by their kind)."""
    if isinstance(module, nn.ReLU6):  # a Hardtanh subclass: test before anything broader
        return "relu6"
    if isinstance(module, nn.ReLU):
        return "relu"
    if isinstance(module, nn.GELU):
        return "gelu"
    if isinstance(module, (nn.SiLU, nn.Mish)):
        return "silu"
    if isinstance(module, nn.Hardswish):
        return "hardswish"
    if isinstance(module, nn.Tanh):
        return "tanh"
    if isinstance(module, nn.Sigmoid):
        return "sigmoid"
    kind = _NAMED_KINDS.get(type(module).__name__)
    if kind is not None and type(module).__module__.startswith("transformers."):
        return kind
    return None


_ZERO_KINDS = ("relu", "relu6", "gelu", "silu", "hardswish")
#: the kinds whose units are off where their input is at most a bound
_OFF_BELOW = {"gelu": GELU_OFF_BELOW, "silu": SILU_OFF_BELOW, "hardswish": HARDSWISH_OFF_BELOW}


class _Tally:
    """What the hooks of one module add up over the forward calls of one step."""

    __slots__ = ("kind", "entries", "off", "sumsq", "samples", "unit_shape", "ever_on")

    def __init__(self, kind: str):
        self.kind = kind
        self.entries = 0
        self.off = 0
        self.sumsq = 0.0
        self.samples = 0
        self.unit_shape: tuple[int, ...] | None = None
        self.ever_on: torch.Tensor | None = None  # per unit: not off for some sample

    def add(self, inputs: torch.Tensor, output: torch.Tensor, saturation: float) -> None:
        output = output.detach()
        if self.kind in ("relu", "relu6"):
            off = output == 0  # from the output: inplace ReLUs overwrite their input
        elif self.kind in _OFF_BELOW:
            off = inputs.detach() <= _OFF_BELOW[self.kind]
        elif self.kind == "tanh":
            off = output.abs() >= 1.0 - saturation
        else:  # sigmoid
            off = torch.minimum(output, 1.0 - output) <= saturation
        self.entries += off.numel()
        self.off += int(off.sum())
        self.sumsq += float(torch.linalg.vector_norm(output, dtype=torch.float64) ** 2)
        if off.dim() == 0:
            return
        self.samples += off.shape[0]
        on = ~off.all(dim=0) if off.dim() > 1 else ~off
        shape = tuple(on.shape)
        if self.ever_on is None and self.unit_shape is None:
            self.unit_shape, self.ever_on = shape, on
        elif self.unit_shape == shape and self.ever_on is not None:
            self.ever_on = self.ever_on | on
        else:  # calls with differently shaped outputs (e.g. sequence lengths): no per-unit answer
            self.ever_on = None

    def result(self) -> dict[str, Any]:
        fraction = self.off / self.entries if self.entries else math.nan
        units = int(self.ever_on.numel()) if self.ever_on is not None else 0
        always = float((~self.ever_on).sum()) / units if units else math.nan
        if self.kind in _ZERO_KINDS:
            fractions = {"zero_fraction": fraction, "dead_fraction": always}
        else:
            fractions = {"saturated_fraction": fraction, "saturated_unit_fraction": always}
        return {
            "kind": self.kind,
            "units": units,
            "samples": self.samples,
            **fractions,
            "rms": math.sqrt(self.sumsq / self.entries) if self.entries else math.nan,
        }


class ActivationStats(SingleStepQuantity):
    """Per activation module: how many units are off (ReLU, GELU) or saturated (tanh, sigmoid).

    For each activation module, keyed by its name in the model
    (``model.named_modules()``), over all entries ``y`` of its outputs in
    the step's forward passes with gradients (a *unit* is one position of
    the output without the batch dimension: a feature of a linear layer, a
    channel-pixel of a convolution, a token-feature of a sequence):

    - ReLU / ReLU6 / GELU / SiLU / Mish / Hardswish: ``zero_fraction`` = share
      of entries that are off (``y == 0``; GELU and Hardswish: input ``<= -3``;
      SiLU and Mish: input ``<= -6``, where the slope is GELU's at -3),
      ``dead_fraction`` = share of units that are off for every sample of the step;
    - tanh / sigmoid: ``saturated_fraction`` = share of entries with
      ``|y| >= 1 - saturation`` (tanh) or ``min(y, 1 - y) <= saturation``
      (sigmoid), i.e. a local derivative below about ``2 * saturation``;
      ``saturated_unit_fraction`` = share of units saturated for every sample;
    - all: ``kind``, ``units``, ``samples`` (rows seen) and ``rms`` =
      ``sqrt(mean(y**2))``, the activation scale.

    Args:
        track_schedule: when to compute.
        saturation: distance to the asymptote that counts as saturated (default 0.01).
        verbose: print each value.

    Example::

        ActivationStats(linear(10))  # {"1": {"kind": "relu", "zero_fraction": 0.41, ...}, ...}

    Functional activations (``torch.relu(x)`` inside ``forward``) are not
    seen; see the module docstring.
    """

    #: hooks, the model references and one step's tallies are not carried across a resume
    _STATE_SKIP = SingleStepQuantity._STATE_SKIP + ("_models", "_handles", "_tallies", "_armed_step", "_warned",
                                                    "_weight_calls")

    def __init__(self, track_schedule, verbose: bool = False, saturation: float = 0.01):
        super().__init__(track_schedule, verbose=verbose)
        if not 0.0 < saturation < 0.5:
            raise ValueError(f"ActivationStats(saturation=...) must lie in (0, 0.5), got {saturation!r}")
        self.saturation = float(saturation)
        self._models: list[weakref.ref] = []
        self._handles: list[Any] = []
        self._tallies: dict[str, _Tally] = {}
        self._armed_step: int | None = None
        self._warned = False
        #: ``{id(module): calls}`` of the modules with weights in the step's forward passes
        self._weight_calls: dict[int, int] = {}

    def settings(self) -> dict[str, Any]:
        return {"saturation": self.saturation}

    def adapt_to_models(self, models: list) -> None:
        self._remove_hooks()
        self._models = [weakref.ref(model) for model in models]

    def _modules(self) -> list[tuple[str, nn.Module, str]]:
        models = [model for model in (ref() for ref in self._models) if model is not None]
        found = []
        for index, model in enumerate(models):
            prefix = f"model{index}." if len(models) > 1 else ""
            for name, module in unwrap(model).named_modules():
                kind = activation_kind(module)
                if kind is not None:
                    found.append((prefix + (name or type(module).__name__), module, kind))
        return found

    def _weighted_modules(self) -> list[nn.Module]:
        """The modules of the cockpit's models that own parameters themselves."""
        models = [model for model in (ref() for ref in self._models) if model is not None]
        return [module for model in models for module in unwrap(model).modules()
                if next(module.parameters(recurse=False), None) is not None]

    def prepare_forward(self, global_step: int) -> None:
        """Install the forward hooks for ``global_step`` (once per step)."""
        if self._armed_step != global_step:
            self._armed_step = global_step
            self._tallies = {}
            self._weight_calls = {}
        if self._handles:
            return
        # how often each module with weights runs in the step: a recurrence calls one (its cell) more often than the
        # others; depth reusing one activation module (one nn.ReLU after every layer) calls each layer once
        for module in self._weighted_modules():
            self._handles.append(module.register_forward_hook(self._count_hook()))
        for name, module, kind in self._modules():
            kept: list = []
            if kind in _OFF_BELOW and getattr(module, "inplace", False):
                # an in-place SiLU / Mish / Hardswish overwrites its input: the input is read before the call
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(kept)))
            self._handles.append(module.register_forward_hook(self._hook(name, kind, kept)))

    @staticmethod
    def _pre_hook(kept: list):
        def hook(module, args):
            if in_rerun():
                return
            kept.clear()
            if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor):
                kept.append(args[0].detach().clone())

        return hook

    def _hook(self, name: str, kind: str, kept: list):
        def hook(module, args, output):
            # (not in the cockpit's per-row re-runs of a module: an MLP after an embedding counted each sample
            # twice, and exploding-recurrence read its ReLUs as a recurrence; outside trial 10)
            if in_rerun() or not torch.is_grad_enabled() or not isinstance(output, torch.Tensor):
                return
            inputs = kept.pop() if kept else args[0] if args and isinstance(args[0], torch.Tensor) else output
            tally = self._tallies.get(name)
            if tally is None:
                tally = self._tallies[name] = _Tally(kind)
            tally.add(inputs, output, self.saturation)

        return hook

    def _count_hook(self):
        def hook(module, args, output):
            if in_rerun() or not torch.is_grad_enabled():
                return
            self._weight_calls[id(module)] = self._weight_calls.get(id(module), 0) + 1

        return hook

    def skip(self, global_step: int) -> None:
        """Nothing is stored for this step: the forward hooks go, as after a tracked step."""
        self._remove_hooks()
        self._tallies, self._armed_step = {}, None

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _compute(self, global_step, params, batch_loss):
        tallies = self._tallies if self._armed_step == global_step else {}
        calls = list(self._weight_calls.values()) if self._armed_step == global_step else []
        self._remove_hooks()
        self._tallies, self._armed_step, self._weight_calls = {}, None, {}
        if not tallies:
            if not self._warned:
                self._warned = True
                if not self._models:
                    known, fix = "no model known yet", "Pass Cockpit(..., model=model) and use activation modules."
                else:  # (outside trial 26: the advice to pass model=, which the transformer example did)
                    known = "the model ran no activation module"
                    fix = (
                        "Use activation modules where they should be watched (nn.TransformerEncoderLayer("
                        "..., activation=nn.ReLU()) instead of the default functional relu); without them the "
                        "dead-units and saturated-units rules stay silent, the rest is unaffected."
                    )
                warnings.warn(
                    f"[cockpit_like] ActivationStats, step {global_step}: nothing recorded ({known}). "
                    "It counts nn.ReLU / ReLU6 / GELU / SiLU / Mish / Hardswish / Tanh / Sigmoid modules (and "
                    "Hugging Face's activation modules) of the cockpit's model "
                    "in forward passes with gradients; functional activations (torch.relu or F.gelu in forward) "
                    f"are not seen. {fix}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None
        # (None where no module with weights ran: nothing to tell)
        reused = (max(calls) > min(calls)) if calls else None
        return {name: {**tally.result(), "weights_reused": reused} for name, tally in tallies.items()}
