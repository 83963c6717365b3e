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

Supported: ``groups == 1``, every padding (integer, tuple, ``"valid"``,
``"same"``) and padding mode (``"zeros"``, ``"reflect"``, ``"replicate"``,
``"circular"``, padded as ``nn.Conv2d`` pads), any stride and dilation, 4-D
input. (BackPACK's ``BatchGrad`` ignores non-zero padding modes and raises for
``"same"``; this path gets both right.)
:func:`unfold_conv2d_input` returns ``None`` for anything else, and callers
fall back to BackPACK.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import Conv2d, Module

__all__ = [
    "supports_unfold",
    "conv2d_input_windows",
    "unfold_conv2d_input",
    "conv2d_weight_grad_batch",
    "conv2d_bias_grad_batch",
]


def supports_unfold(module: Module, x: torch.Tensor) -> bool:
    """Whether :func:`unfold_conv2d_input` handles ``module`` with input ``x``."""
    return type(module) is Conv2d and module.groups == 1 and x.dim() == 4


def _padding(module: Conv2d) -> tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` as ``F.pad`` takes it."""
    padding = module.padding
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        # as PyTorch: dilation * (k - 1) in total per axis, the odd one extra at the end
        (kh, kw), (dh, dw) = module.kernel_size, module.dilation
        th, tw = dh * (kh - 1), dw * (kw - 1)
        return (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    ph, pw = padding
    return (pw, pw, ph, ph)


def conv2d_input_windows(module: Module, x: torch.Tensor) -> torch.Tensor | None:
    """``[B, C_in, kh, kw, H_out, W_out]``: a strided view of the (padded) input, or ``None`` if unsupported.

    Entry ``[b, c, i, j, r, s]`` is the input value that kernel tap ``(i, j)`` of
    channel ``c`` meets at output position ``(r, s)``. Nothing is copied except
    the padded input when the convolution pads.
    """
    if not supports_unfold(module, x):
        return None
    left, right, top, bottom = _padding(module)
    if left or right or top or bottom:
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, (left, right, top, bottom), mode=mode)
    (kh, kw), (dh, dw), (sh, sw) = module.kernel_size, module.dilation, module.stride
    batch, channels, height, width = x.shape
    out_h = (height - dh * (kh - 1) - 1) // sh + 1
    out_w = (width - dw * (kw - 1) - 1) // sw + 1
    s0, s1, s2, s3 = x.stride()
    return x.as_strided(
        (batch, channels, kh, kw, out_h, out_w),
        (s0, s1, s2 * dh, s3 * dw, s2 * sh, s3 * sw),
        x.storage_offset(),
    )


def unfold_conv2d_input(module: Module, x: torch.Tensor) -> torch.Tensor | None:
    """``[B, C_in * kh * kw, L]``: the input unfolded as the convolution sees it, or ``None`` if unsupported.

    Equal to ``F.unfold`` but built as one copy of a strided view of the
    (padded) input (:func:`conv2d_input_windows`), which is 1.3-20x faster
    than ``F.unfold`` on CPU.
    """
    windows = conv2d_input_windows(module, x)
    if windows is None:
        return None
    batch, channels, kh, kw, out_h, out_w = windows.shape
    return windows.reshape(batch, channels * kh * kw, out_h * out_w)


#: bytes of unfolded input per chunk of samples in :func:`conv2d_weight_grad_batch`
UNFOLD_CHUNK_BYTES = 4 << 20


def conv2d_weight_grad_batch(
    module: Conv2d, x: torch.Tensor, delta: torch.Tensor, chunk_bytes: int = UNFOLD_CHUNK_BYTES
) -> torch.Tensor:
    """``grad_batch`` of the weight, ``[B, *weight.shape]``, from the layer input and the output gradient.

    The input is unfolded a few samples at a time into one small reused
    buffer (about ``chunk_bytes``), each chunk followed by its ``bmm`` into
    the result: the whole ``[B, C_in * kh * kw, L]`` unfolded input, often
    larger than the result, is never allocated (a fresh allocation of tens of
    MB costs about as much in page faults as the copy itself).
    """
    windows = conv2d_input_windows(module, x)
    batch, channels, kh, kw, out_h, out_w = windows.shape
    rows, positions = channels * kh * kw, out_h * out_w
    # under autocast the layer's input (float32) and its output gradient (float16) differ: the wider one
    dtype = torch.promote_types(delta.dtype, windows.dtype)
    delta = delta.reshape(batch, delta.shape[1], positions).to(dtype)
    result = torch.empty(batch, delta.shape[1], rows, dtype=dtype, device=delta.device)
    per_sample = max(1, rows * positions * result.element_size())
    step = max(1, min(batch, chunk_bytes // per_sample))
    buffer = torch.empty((step, channels, kh, kw, out_h, out_w), dtype=dtype, device=windows.device)
    for start in range(0, batch, step):
        stop = min(batch, start + step)
        chunk = buffer[: stop - start]
        chunk.copy_(windows[start:stop])
        torch.bmm(delta[start:stop], chunk.view(stop - start, rows, positions).transpose(1, 2), out=result[start:stop])
    return result.view(batch, *module.weight.shape)


def conv2d_bias_grad_batch(delta: torch.Tensor) -> torch.Tensor:
    """``grad_batch`` of the bias, ``[B, C_out]``: the output gradient summed over positions."""
    return delta.reshape(delta.shape[0], delta.shape[1], -1).sum(2)
