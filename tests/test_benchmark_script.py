"""The overhead benchmark script runs and writes well-formed results (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "overhead.py"

sys.path.insert(0, str(ROOT / "benchmarks"))
import overhead  # noqa: E402


def _run(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out, table = tmp_path / "overhead.json", tmp_path / "table.md"
    command = [
        sys.executable, str(SCRIPT), "--problems", "mlp", "--rounds", "1", "--steps", "2",
        "--warmup", "1", "--min-time", "0", "--batch-size", "8", "--out", str(out),
        "--table", str(table), "--no-docs", *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), table.read_text()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    return _run(tmp_path, "--configs", "nothing,full_every10", "--quantities", "GradNorm")


def test_json_structure(tiny):
    data, _ = tiny
    assert set(data) == {"meta", "targets", "results", "runs"}
    assert data["meta"]["rounds"] == 1 and data["meta"]["batch_size"] == 8
    mlp = data["results"]["mlp"]
    assert mlp["num_params"] == 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert mlp["per_sample_grads_mb"] == pytest.approx(8 * mlp["num_params"] * 4 / 2**20)
    configs = mlp["configs"]
    assert set(configs) == {"plain", "nothing", "full_every10", "q:GradNorm"}
    for name, entry in configs.items():
        assert "errors" not in entry, (name, entry)
        assert entry["rounds"] == (2 if name == "plain" else 1)  # plain at the start and end of the round
        assert entry["time_s"] > 0 and entry["ratio"] > 0
        assert isinstance(entry["added_memory_mb"], float)
    # plain's two runs average to the round's reference
    assert configs["plain"]["ratio"] == pytest.approx(1.0)
    assert configs["plain"]["ratio_min"] <= 1.0 <= configs["plain"]["ratio_max"]
    assert configs["full_every10"]["statistic"] == "mean"
    assert configs["nothing"]["statistic"] == "median"
    # every child process ran with one thread; full_every10 timed a whole period
    assert all(run["threads"] == 1 for run in data["runs"])
    assert [run["steps"] for run in data["runs"] if run["config"] == "full_every10"] == [10]
    assert {run["round"] for run in data["runs"]} == {0}


def test_table_structure(tiny):
    _, table = tiny
    assert "| mlp |" in table
    for title in ("nothing scheduled at the step", "full every 10th step (amortised)"):
        assert f"| {title} |" in table
    assert "business, every step" not in table  # not run
    assert "| GradNorm |" in table
    assert "<= 1.3" in table and "<= 8" in table  # MLP targets from issue 6


def test_update_doc_replaces_only_between_markers(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"intro\n{overhead.BEGIN}\nold table\n{overhead.END}\noutro\n")
    assert overhead.update_doc("new table\n", doc)
    assert doc.read_text() == f"intro\n{overhead.BEGIN}\nnew table\n{overhead.END}\noutro\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers")
    assert not overhead.update_doc("x\n", plain) and plain.read_text() == "no markers"


def test_every_quantity_is_benchmarked():
    from cockpit_like import quantities

    names = {c[2:] for c in overhead.all_quantity_configs()}
    assert names == set(quantities.__all__) - overhead.BASE_CLASSES
    assert "Parameters" in names


@pytest.mark.parametrize("problem, shape", [("mlp", (1, 28, 28)), ("3c3d", (3, 32, 32)), ("2c2d", (1, 28, 28))])
def test_problems_build_and_run_with_backpack(problem, shape):
    """The networks have the DeepOBS shapes, and BackPACK's BatchGrad runs on them."""
    import torch
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    model, got = overhead.build_problem(problem, 2)
    assert got == shape
    model = extend(model)
    loss = extend(torch.nn.CrossEntropyLoss())(model(torch.randn(2, *shape)), torch.tensor([0, 1]))
    with backpack(BatchGrad()):
        loss.backward()
    for param in model.parameters():
        assert param.grad_batch.shape == (2, *param.shape)
    expected = {"mlp": 109_386, "3c3d": 895_210, "2c2d": 3_274_634}[problem]
    assert sum(p.numel() for p in model.parameters()) == expected


def test_unknown_names_are_rejected(tmp_path):
    for flag, value in (("--problems", "resnet"), ("--configs", "premium"), ("--quantities", "Nope")):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), flag, value, "--no-docs", "--out", str(tmp_path / "x.json")],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode != 0 and "unknown" in done.stderr
