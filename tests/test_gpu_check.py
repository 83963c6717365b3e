"""The prepared GPU check and ``overhead.py --device cuda``, tested for their arguments on a CPU (issue 37, item 5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu_check.sh"

sys.path.insert(0, str(ROOT / "benchmarks"))
import overhead  # noqa: E402


def _check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def test_dry_run_plans_the_cuda_tests_and_the_three_problems():
    done = _check("--dry-run", "--steps", "5")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("tests/test_cuda.py" in line and line.startswith("would run: timeout 90") for line in lines)
    runs = [line for line in lines if line.startswith("would run:") and "overhead.py" in line]
    assert [line.split()[3] for line in runs] == ["110", "90", "150"]  # per-problem limits: 440 s with the tests' 90
    assert all("--merge" in line and "--device cuda" in line for line in runs)
    children = [line for line in lines if "--child" in line]
    for problem in ("gpt", "resnet", "gpt2-small"):
        for config in ("plain", "economy", "full_every10"):
            assert any(f"--problem {problem} --config {config} " in c for c in children), (problem, config)
    assert all(c.endswith("--device cuda") and "--steps 5" in c for c in children)
    assert lines.count("4 child processes planned (1 rounds, device cuda)") == 3  # plain twice per problem


@pytest.mark.parametrize("args,message", [(["--steps", "x"], "positive integer"), (["--bogus"], "unknown argument")])
def test_bad_arguments_fail_clearly(args, message):
    done = _check(*args)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_overhead_on_cuda_without_a_gpu_says_so():
    # in this process (the script's main; a SystemExit with a message is exit status 1 and the message on
    # stderr): a subprocess only added the import of torch
    with pytest.raises(SystemExit, match=r"torch\.cuda\.is_available\(\) is False"):
        overhead.main(["--device", "cuda", "--problems", "mlp", "--configs", "economy", "--quantities", "none",
                       "--rounds", "1"])
    with pytest.raises(SystemExit, match="expected cpu, cuda"):
        overhead.main(["--device", "tpu", "--problems", "mlp", "--quantities", "none", "--dry-run"])


def test_child_command_carries_the_device_and_the_table_shows_cuda_memory():
    args = overhead.parse_args(["--device", "cuda:1"])
    args.budget, args.min_time = 8.0, 1.0
    command = overhead.child_command("gpt", "economy", 4, 1, args)
    assert command[-2:] == ["--device", "cuda:1"]
    assert "--device" not in overhead.child_command("gpt", "economy", 4, 1, _cpu_args())
    results = {"gpt": {"num_params": 10, "batch_size": 2, "per_sample_grads_mb": 0.0, "configs": {
        "plain": {"time_s": 0.01, "cuda_peak_mb": 100.0, "rounds": 1},
        "economy": {"time_s": 0.02, "cuda_peak_mb": 150.0, "cuda_added_mb": 50.0, "rounds": 1},
    }}}
    lines = overhead._cuda_memory_table(results, ["gpt"], {"device": "cuda (NVIDIA H100)"})
    assert "| gpt | 100 | 150 (+50) |" in lines and any("NVIDIA H100" in line for line in lines)
    assert overhead._cuda_memory_table({"mlp": {"configs": {"plain": {"time_s": 1.0}}}}, ["mlp"], {}) == []


def _cpu_args():
    args = overhead.parse_args([])
    args.budget, args.min_time = 8.0, 1.0
    return args


def test_a_cpu_child_with_an_explicit_device_runs(capsys):
    # the child's main in this process (what its process prints is what main prints); the child sets one thread
    threads = torch.get_num_threads()
    try:
        status = overhead.main(["--child", "--problem", "mlp", "--config", "plain", "--steps", "2", "--warmup", "0",
                                "--batch-size", "4", "--budget", "5", "--min-time", "0", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert status == 0
    assert '"config": "plain"' in out and "cuda_peak_mb" not in out


class _Killed(Exception):
    pass


def test_a_run_cut_off_keeps_every_child_measured_before(tmp_path, monkeypatch):
    """gpu_check.sh kills a problem's benchmark at its time limit: the figures of the children that had finished
    are on disk, said to be partial (on an H200 a limit once cut off gpt's last plain run and lost the lot)."""
    calls, cut = [], True

    def fake_spawn(problem, config, steps, warmup, args, live=False):
        calls.append(config)
        if len(calls) == 3 and cut:
            raise _Killed  # what a kill does to the parent between two children
        seconds = {"plain": 0.01, "economy": 0.02, "full_every10": 0.03}[config]
        return {"problem": problem, "config": config, "times": [seconds] * steps, "median_s": seconds,
                "mean_s": seconds, "maxrss_mb": 100.0}

    monkeypatch.setattr(overhead, "spawn", fake_spawn)
    out, table = tmp_path / "o.json", tmp_path / "o.md"
    args = ["--problems", "mlp", "--configs", "economy,full_every10", "--quantities", "none", "--rounds", "1",
            "--steps", "2", "--no-docs", "--no-live-memory", "--out", str(out), "--merge", str(out), "--table", str(table),
            "--seed", "0"]
    with pytest.raises(_Killed):
        overhead.main(args)
    import json

    saved = json.loads(out.read_text())
    assert saved["meta"]["partial"] == {"done": 2, "planned": 4}
    configs = saved["results"]["mlp"]["configs"]
    assert set(configs) == {"plain", calls[1]}  # plain first, then one of the two in the round's random order
    assert configs[calls[1]]["ratio"] == pytest.approx({"economy": 2.0, "full_every10": 3.0}[calls[1]])
    assert "Partial: 2 of 4 child processes" in table.read_text()
    # the same run to its end: the files are whole
    cut = False
    assert overhead.main(args) == 0
    saved = json.loads(out.read_text())
    assert "partial" not in saved["meta"] and set(saved["results"]["mlp"]["configs"]) == {"plain", "economy", "full_every10"}
    assert "Partial" not in table.read_text()


def test_a_python_without_backpack_asks_for_the_wheels(tmp_path):
    """On a GPU machine with PyTorch but without BackPACK (and no network) the check says how to bring it."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nfor a in "$@"; do [ "$a" = "import backpack" ] && exit 1; done\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    done = _check("--python", str(fake), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and "cannot import backpack; pass --wheels DIR" in done.stderr
    assert not (tmp_path / "out" / "test_cuda.log").exists()  # nothing ran
    assert "--wheels DIR" in _check("--help").stdout
