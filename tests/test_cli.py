"""``cockpit-like plot`` and ``cockpit-like summary`` end to end, on a log of a real training run."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cockpit_like import Cockpit
from cockpit_like.cli import main, summarize
from cockpit_like.utils.configuration import configuration
from tests.helpers import make_problem, train

STEPS = 5
BATCH = 8
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny economy run (MLP, 5 steps) with one ``log`` call; both log forms on disk."""
    folder = tmp_path_factory.mktemp("cli")
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), stream_to=folder / "run")
    train(model, lossfunc, individual, cockpit, "mlp", steps=STEPS, batch_size=BATCH)
    cockpit.log(STEPS - 1, epoch_count=0, train_loss=0.25, learning_rate=0.1)
    cockpit.write(folder / "run")
    cockpit.close()
    return folder, cockpit.get_output(), sum(p.numel() for p in model.parameters())


def _table(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines()[3:]:
        parts = line.split(None, 3)
        rows[parts[0]] = parts[1:]
    return rows


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ""])
def test_summary(run, suffix, capsys):
    folder, output, entries = run
    assert main(["summary", str(folder / "run") + suffix]) == 0
    text = capsys.readouterr().out
    assert f"{STEPS} steps (0 .. {STEPS - 1})" in text
    rows = _table(text)
    tracked = {name for values in output.values() for name, value in values.items() if value is not None}
    assert set(rows) == tracked
    last_loss = output[STEPS - 1]["Loss"]
    assert rows["Loss"] == [str(STEPS), str(STEPS - 1), f"{last_loss:.4g}"]
    assert rows["UpdateSize"][:2] == [str(STEPS - 1), str(STEPS - 2)]  # stored under the start step
    norms = output[STEPS - 1]["GradNorm"]
    assert rows["GradNorm"][2] == (
        f"sum {float(np.sum(norms)):.4g}, mean {float(np.mean(norms)):.4g} over {len(norms)} params"
    )
    hist = output[STEPS - 1]["GradHist1d"]["hist"]
    assert rows["GradHist1d"][2] == f"histogram {len(hist)} bins, {BATCH * entries} counts"
    assert rows["learning_rate"] == ["1", str(STEPS - 1), "0.1"]


def test_summarize_values():
    assert summarize(None) == "None"
    assert summarize(math.nan) == "nan"
    assert summarize(-1) == "-1"
    assert summarize(1.23456e-7) == "1.235e-07"
    assert summarize([[1.0, 2.0], [3.0]]) == "2 blocks, 3 entries"
    assert summarize({"trace": [1.0, 2.0], "trace_total": 3.0, "frobenius_total": 1.5}) == (
        "trace_total=3, frobenius_total=1.5"
    )
    value = {"hist": np.ones((4, 5)), "edges": [[0, 1], [0, 1]], "param_groups": 2,
             "param_0": {"hist": np.ones((4, 5))}, "param_1": {"hist": np.ones((4, 5))}}
    assert summarize(value) == "histogram 4x5 bins, 20 counts, 2 per-layer"


def test_plot(run, capsys):
    folder, _, _ = run
    assert main(["plot", str(folder / "run.json")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {folder / 'run.png'}"
    assert (folder / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = folder / "out" / "dash.pdf"
    assert main(["plot", str(folder / "run.jsonl"), "-o", str(target), "--secondary", "--title", "t"]) == 0
    assert target.read_bytes()[:4] == b"%PDF"
    assert main(["plot", str(folder / "run"), "-o", str(folder / "small.png"), "--dpi", "40", "--log-iter"]) == 0
    from matplotlib.image import imread

    assert imread(folder / "small.png").shape[:2] == (360, 640)  # 16 x 9 inches at 40 dpi


def test_errors(tmp_path, capsys):
    assert main(["summary", str(tmp_path / "missing")]) == 2
    assert "no cockpit log" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert main(["plot", str(tmp_path / "other.json")]) == 2
    assert "not a cockpit log" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


def test_module_and_console_script(run):
    folder, _, _ = run
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "cockpit_like.cli", "summary", str(folder / "run")],
                            capture_output=True, text=True, env=env, check=True)
    assert "GradNorm" in result.stdout
    script = shutil.which("cockpit-like", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("cockpit-like is not installed in this environment (pip install -e .)")
    result = subprocess.run([script, "summary", str(folder / "run.jsonl")], capture_output=True, text=True,
                            env=env, check=True)
    assert "Loss" in result.stdout


def test_closed_pipe_ends_quietly(run):
    """``cockpit-like summary LOG | head``: no BrokenPipeError traceback when the reader is gone, status 0."""
    folder, _, _ = run
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    # `true` exits at once, long before the CLI (importing torch) prints: every write meets a closed pipe
    command = f"{sys.executable} -m cockpit_like.cli summary {folder / 'run'} | true"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, env=env)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.returncode == 0
