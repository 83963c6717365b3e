"""Per-sample gradients of ``nn.Conv2d`` by unfolding the input and one batched matmul.

A convolution is a matrix product on the unfolded input: with
``X_i = unfold(x_i)`` (``[C_in * kh * kw, L]``, one column per output
position, ``L = H_out * W_out``) and the output gradient ``delta_i``
reshaped to ``[C_out, L]``, sample ``i``'s weight gradient is
``delta_i X_i^T`` (``[C_out, C_in * kh * kw]``) and its bias gradient is
``delta_i`` summed over positions. For a mean loss ``delta`` already carries
the ``1/B``, so these are BackPACK's ``grad_batch[i] = g_i / B``.

One ``torch.bmm`` over the batch is several times faster than BackPACK's
``BatchGrad`` on convolutions with many input channels, and never builds
BackPACK's intermediate that repeats the output gradient per input channel.

Supported: ``groups == 1``, ``padding_mode == "zeros"``, integer, tuple,
``"valid"`` or ``"same"`` padding, any stride and dilation, 4-D input.
:func:`unfold_conv2d_input` returns ``None`` for anything else, and callers
fall back to BackPACK.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import Conv2d, Module

__all__ = ["supports_unfold", "unfold_conv2d_input", "conv2d_weight_grad_batch", "conv2d_bias_grad_batch"]


def supports_unfold(module: Module, x: torch.Tensor) -> bool:
    """Whether :func:`unfold_conv2d_input` handles ``module`` with input ``x``."""
    return (
        type(module) is Conv2d
        and module.groups == 1
        and module.padding_mode == "zeros"
        and x.dim() == 4
    )


def _explicit_padding(module: Conv2d) -> tuple[int, int, int, int] | tuple[int, int]:
    """``(top, left)`` symmetric padding, or ``(left, right, top, bottom)`` for ``F.pad``."""
    padding = module.padding
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        # as PyTorch: total dilation * (k - 1) per axis, the odd one extra at the end
        (kh, kw), (dh, dw) = module.kernel_size, module.dilation
        th, tw = dh * (kh - 1), dw * (kw - 1)
        return (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    return tuple(padding)


def unfold_conv2d_input(module: Module, x: torch.Tensor) -> torch.Tensor | None:
    """``[B, C_in * kh * kw, L]``: the input unfolded as the convolution sees it, or ``None`` if unsupported."""
    if not supports_unfold(module, x):
        return None
    padding = _explicit_padding(module)
    if len(padding) == 4:
        x = F.pad(x, padding)
        padding = (0, 0)
    return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride)


def conv2d_weight_grad_batch(module: Conv2d, unfolded: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``grad_batch`` of the weight, ``[B, *weight.shape]``, from the unfolded input and the output gradient."""
    batch = delta.shape[0]
    delta = delta.reshape(batch, delta.shape[1], -1)
    return torch.bmm(delta, unfolded.transpose(1, 2)).reshape(batch, *module.weight.shape)


def conv2d_bias_grad_batch(delta: torch.Tensor) -> torch.Tensor:
    """``grad_batch`` of the bias, ``[B, C_out]``: the output gradient summed over positions."""
    return delta.reshape(delta.shape[0], delta.shape[1], -1).sum(2)
