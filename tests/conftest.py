"""Test configuration: one thread (the machine is shared), float64 references."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


def _kernel_state():
    return (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
        torch.backends.cudnn.enabled,
    )


@pytest.fixture(autouse=True)
def _no_kernel_choice_leaks():
    """The cockpit picks the math attention kernel for forward passes whose step needs the graph and
    puts back what was there when the pass ends (even when it raises). A test after which the choice
    is still changed fails here, and the choice is put back so later tests run as they would alone."""
    from cockpit_like.backends.tracer import _graph_kernels

    before = _kernel_state()
    attention = torch.nn.functional.scaled_dot_product_attention  # counted while the kernels are held
    yield
    leaked = _graph_kernels.depth != 0 or _kernel_state() != before
    leaked |= torch.nn.functional.scaled_dot_product_attention is not attention
    torch.nn.functional.scaled_dot_product_attention = attention
    while _graph_kernels.depth > 0:
        _graph_kernels.release()
    _graph_kernels.depth = 0
    torch.backends.cuda.enable_flash_sdp(before[0])
    torch.backends.cuda.enable_mem_efficient_sdp(before[1])
    torch.backends.cuda.enable_math_sdp(before[2])
    torch.backends.cudnn.enabled = before[3]
    assert not leaked, "the test left the attention/cuDNN kernel choice changed (graph kernels not released)"
