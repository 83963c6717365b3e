"""``benchmarks/launch_count.py``: the operations a step dispatches, counted (no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import launch_count  # noqa: E402


def test_operations_that_launch_kernels_are_counted_views_are_not():
    a, b = torch.ones(3, 4), torch.ones(3, 4)
    with launch_count.OperationCount() as counted:
        c = a + b  # 1
        c.view(12)  # a view: 0
        torch.mm(a, b.t())  # mm 1, t 0
        c.sum()  # 1
    assert counted.total == 3
    assert set(counted.by_source) == {"(the training step itself)"}


def test_the_accelerators_chunk_takes_fewer_operations(monkeypatch):
    from cockpit_like.backends import fast_histograms

    monkeypatch.setattr(fast_histograms, "default_chunk", fast_histograms.default_chunk)  # put back after the test
    cpu = launch_count.count("mlp", "economy", batch_size=32)
    plain = launch_count.count("mlp", "plain", batch_size=32)
    launch_count.main(["--problems", "mlp", "--configs", "economy", "--batch-size", "32", "--device-chunk", "--top", "0"])
    device = launch_count.count("mlp", "economy", batch_size=32)
    assert plain.total < device.total < cpu.total
    assert any("fast_histograms" in source for source in cpu.by_source)
    assert cpu.by_source["(the training step itself)"] >= plain.total  # the user's own step is in there too


@pytest.mark.parametrize("argv,message", [(["--problems", "bogus"], "unknown problem"), (["--configs", "nope"], "unknown configuration")])
def test_bad_arguments_fail_clearly(argv, message):
    with pytest.raises(SystemExit, match=message):
        launch_count.main(argv)
