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


def _resident_mb() -> float:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # not Linux: nothing to measure, nothing released
        return 0.0


def _release_memory() -> None:
    """Collect reference cycles (a trained model inside one lives until the next full collection) and hand
    the freed heap back to the system (glibc keeps it otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


_RELEASE_ABOVE_MB = 512.0
_floor_mb = [0.0]


@pytest.fixture(autouse=True)
def _memory_given_back():
    """After a test whose leftovers hold more than 512 MB above the last floor, release them: without this the
    suite's process grew to 6 GB (a GPT-2 small of an earlier test still held by a cycle while the next one
    trained). A read of /proc per test; a collection only when memory grew."""
    yield
    if _resident_mb() > _floor_mb[0] + _RELEASE_ABOVE_MB:
        _release_memory()
        _floor_mb[0] = _resident_mb()


#: The test modules that take longest (wall time: a module fixture that trains 52 runs, child processes, spawned
#: ranks), heaviest first. With ``make test`` (two pytest-xdist workers, one module per work unit, in collection
#: order) they are handed out first, so that both workers finish near the same time (longest first); a serial
#: run keeps the collection order. Times in docs/performance.md ("The test suite's time").
HEAVY_MODULES_FIRST = (
    "test_diagnosis_corpus.py", "test_benchmark_script.py", "test_distributed.py", "test_benchmark_smoke.py",
    "test_transformers.py", "test_model_zoo.py", "test_plotting.py", "test_recorder.py", "test_spikes.py",
    "test_rerun_data_assignment.py", "test_cli.py", "test_notebooks.py", "test_diagnosis_generator.py",
    "test_accumulation.py", "test_fsdp.py", "test_resume.py", "test_diagnosis_runs.py", "test_exporters.py",
    "test_loops_trial28.py", "test_any_model.py", "test_examples.py", "test_model_errors.py", "test_watch.py",
    "test_lookahead_guard.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not a pytest-xdist worker: a serial run keeps its order
        return
    rank = {name: index for index, name in enumerate(HEAVY_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keeps its order
