"""Per-layer rules: a module's per-sample parameter gradients from its input and output gradient.

The hook backend (:mod:`cockpit_like.backends.hooks`) records each call of a
module in the forward pass and, during the backward pass, the gradient of the
**mean** loss w.r.t. the call's outputs (``delta``, which already carries the
``1/B`` of the mean, so every result here is BackPACK's
``grad_batch[i] = g_i / B``). A rule turns one call into one *form* per
parameter:

- :class:`Factors`: ``grad_batch[i] = delta_i x_i^T`` (2-D; the reducer's fast
  factor paths, the same numbers as BackPACK's linear path);
- :class:`Sequence`: ``grad_batch[i] = sum_t a_it b_it^T`` over the positions
  ``t`` of a sample (a linear layer on every token; never materialised by
  statistics with a sequence form, e.g. the gradient tests' Gram summary);
- :class:`Dense`: ``grad_batch`` ``[B, *param.shape]``.

Rules (``x`` the first input, ``B`` its leading dimension, a sample = one row):

===========================  =========================================================
module                        per-sample gradient
===========================  =========================================================
``nn.Linear``                 weight ``sum_t delta_t x_t^T`` (any leading dims), bias ``sum_t delta_t``
HF ``Conv1D`` (GPT-2)         the same with the weight stored transposed (``x_t delta_t^T``)
``nn.Conv1d``, ``nn.Conv2d``  ``delta_i X_i^T`` on the unfolded input (``groups == 1``)
``nn.Embedding``              ``sum_t e_{token_t} delta_t^T`` (scatter-add, padding row zero)
``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, eval ``BatchNorm``
                              weight ``sum (delta * x_hat)``, bias ``sum delta`` over non-channel dims
===========================  =========================================================

Anything else (and unsupported settings, e.g. grouped convolutions or
``Embedding(max_norm=...)``) returns ``None`` and goes to the ``torch.func``
fallback of the hook backend.

May import torch and :mod:`cockpit_like.backends` helpers only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like.backends.conv_unfold import conv2d_weight_grad_batch, supports_unfold
from cockpit_like.backends.per_sample import materialize_linear, materialize_sequence

__all__ = ["Factors", "Sequence", "Dense", "rule_for", "RULES", "is_hf_conv1d"]


class Factors:
    """``grad_batch[i] = delta_i x_i^T`` (``kind="weight"``) or ``delta_i`` (``kind="bias"``)."""

    __slots__ = ("kind", "x", "delta")

    def __init__(self, kind: str, x: torch.Tensor | None, delta: torch.Tensor):
        self.kind, self.x, self.delta = kind, x, delta

    def dense(self, shape: torch.Size) -> torch.Tensor:
        return materialize_linear(self.kind, self.x, self.delta).reshape(self.delta.shape[0], *shape)

    def feed(self, reducer, param: torch.Tensor) -> None:
        reducer.reduce_factors(param, self.kind, self.x, self.delta)


class Sequence:
    """``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` reshaped to the parameter's shape."""

    __slots__ = ("a", "b")

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b

    def dense(self, shape: torch.Size) -> torch.Tensor:
        return materialize_sequence(self.a, self.b, shape)

    def feed(self, reducer, param: torch.Tensor) -> None:
        reducer.reduce_sequence(param, self.a, self.b)


class Dense:
    """``grad_batch`` ``[B, *param.shape]``."""

    __slots__ = ("grad_batch",)

    def __init__(self, grad_batch: torch.Tensor):
        self.grad_batch = grad_batch

    def dense(self, shape: torch.Size) -> torch.Tensor:
        return self.grad_batch.reshape(self.grad_batch.shape[0], *shape)

    def feed(self, reducer, param: torch.Tensor) -> None:
        reducer.reduce_grad_batch(param, self.grad_batch)


Form = Factors | Sequence | Dense
#: ``rule(module, x, delta) -> {parameter name: form}`` or ``None`` (use the fallback)
Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], "dict[str, Form] | None"]


def _linear(module: nn.Linear, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form]:
    if x.dim() == 2:
        return {"weight": Factors("weight", x, delta), "bias": Factors("bias", None, delta)}
    batch = x.shape[0]
    a, b = delta.reshape(batch, -1, delta.shape[-1]), x.reshape(batch, -1, x.shape[-1])
    return {"weight": Sequence(a, b), "bias": Dense(a.sum(1))}


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): ``y = x @ weight + bias``, weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def _hf_conv1d(module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form]:
    if x.dim() == 2:  # grad_batch[i] = x_i delta_i^T: the factor form with the roles swapped
        return {"weight": Factors("weight", delta, x), "bias": Factors("bias", None, delta)}
    batch = x.shape[0]
    a, b = x.reshape(batch, -1, x.shape[-1]), delta.reshape(batch, -1, delta.shape[-1])
    return {"weight": Sequence(a, b), "bias": Dense(b.sum(1))}


def _conv2d(module: nn.Conv2d, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if not supports_unfold(module, x):
        return None
    return {
        "weight": Dense(conv2d_weight_grad_batch(module, x, delta)),
        "bias": Dense(delta.reshape(delta.shape[0], delta.shape[1], -1).sum(2)),
    }


def _conv1d(module: nn.Conv1d, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if module.groups != 1 or x.dim() != 3 or module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None
    (k,), (d,), (s,), (p,) = module.kernel_size, module.dilation, module.stride, module.padding
    patches = F.unfold(x.unsqueeze(2), (1, k), dilation=(1, d), padding=(0, p), stride=(1, s))  # [B, C*k, L]
    weight = torch.bmm(delta, patches.transpose(1, 2))  # [B, C_out, C_in * k]
    return {"weight": Dense(weight.reshape(x.shape[0], *module.weight.shape)), "bias": Dense(delta.sum(2))}


def _embedding(module: nn.Embedding, tokens: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return None
    batch, (vocab, width) = tokens.shape[0], module.weight.shape
    rows = (tokens.reshape(batch, -1) + vocab * torch.arange(batch, device=tokens.device).unsqueeze(1)).reshape(-1)
    grad_batch = delta.new_zeros(batch * vocab, width).index_add_(0, rows, delta.reshape(-1, width))
    grad_batch = grad_batch.view(batch, vocab, width)
    if module.padding_idx is not None:
        grad_batch[:, module.padding_idx] = 0
    return {"weight": Dense(grad_batch)}


def _affine(x_hat: torch.Tensor, delta: torch.Tensor, channel_dims: tuple[int, ...]) -> dict[str, Form]:
    """Weight ``sum(delta * x_hat)`` and bias ``sum(delta)`` over every dim but the batch and ``channel_dims``."""
    summed = [d for d in range(1, delta.dim()) if d not in channel_dims]
    weight = (delta * x_hat).sum(summed) if summed else delta * x_hat
    bias = delta.sum(summed) if summed else delta
    return {"weight": Dense(weight), "bias": Dense(bias)}


def _layer_norm(module: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    shape = tuple(module.normalized_shape)
    if x.dim() <= len(shape):
        return None
    x_hat = F.layer_norm(x, shape, None, None, module.eps)
    return _affine(x_hat, delta, tuple(range(x.dim() - len(shape), x.dim())))


def _rms_norm(module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    shape = tuple(module.normalized_shape)
    if x.dim() <= len(shape):
        return None
    x_hat = F.rms_norm(x, shape, None, module.eps)
    return _affine(x_hat, delta, tuple(range(x.dim() - len(shape), x.dim())))


def _group_norm(module: nn.GroupNorm, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if x.dim() < 2:
        return None
    return _affine(F.group_norm(x, module.num_groups, None, None, module.eps), delta, (1,))


def _batch_norm_eval(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, delta: torch.Tensor):
    # only reached in eval mode with running statistics (the hook backend rejects the rest)
    view = (1, -1) + (1,) * (x.dim() - 2)
    x_hat = (x - module.running_mean.view(view)) / torch.sqrt(module.running_var.view(view) + module.eps)
    return _affine(x_hat, delta, (1,))


#: exact module class -> rule (subclasses with their own ``forward`` go to the fallback)
RULES: dict[type, Rule] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv1d,
    nn.Conv2d: _conv2d,
    nn.Embedding: _embedding,
    nn.LayerNorm: _layer_norm,
    nn.GroupNorm: _group_norm,
    nn.BatchNorm1d: _batch_norm_eval,
    nn.BatchNorm2d: _batch_norm_eval,
    nn.BatchNorm3d: _batch_norm_eval,
}
if hasattr(nn, "RMSNorm"):
    RULES[nn.RMSNorm] = _rms_norm


def rule_for(module: nn.Module) -> Rule | None:
    """The per-layer rule of ``module``, or ``None`` (the ``torch.func`` fallback)."""
    rule = RULES.get(type(module))
    if rule is not None:
        return rule
    if is_hf_conv1d(module):
        return _hf_conv1d
    return None
