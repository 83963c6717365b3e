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
    # the norm over all parameters (what the dashboard plots as ||grad L||), not the sum of the blocks' norms
    assert rows["GradNorm"][2] == (
        f"norm {float(np.sqrt(np.sum(np.square(norms)))):.4g} over all parameters (per-block mean "
        f"{float(np.mean(norms)):.4g} over {len(norms)} params)"
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


def test_an_unknown_option_shows_the_commands_own_usage(tmp_path, capsys):
    """`cockpit-like diagnose LOG --jsn` printed the top-level usage (outside trial 8)."""
    with pytest.raises(SystemExit) as stopped:
        main(["diagnose", str(tmp_path / "run"), "--jsn"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cockpit-like diagnose") and "cockpit-like diagnose: error: unrecognized arguments: --jsn" in err


def test_a_missing_log_named_with_its_suffix_is_not_tried_with_another(tmp_path, capsys):
    """The outside tester's repro: ``runs/missing.json`` "also tried runs/missing.json.json"."""
    for name in ("missing.json", "missing.jsonl"):
        assert main(["summary", str(tmp_path / name)]) == 2
        assert capsys.readouterr().err == f"cockpit-like summary: error: no cockpit log at {tmp_path / name}\n"
    assert main(["summary", str(tmp_path / "missing")]) == 2  # without a suffix both forms are tried
    assert f"also tried {tmp_path / 'missing'}.json and {tmp_path / 'missing'}.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["influence", "LOG", "--top", "-3"], ["influence", "LOG", "--top", "0"],
                                  ["influence", "LOG", "--top", "two"], ["spikes", "LOG", "--last", "-1"],
                                  ["spikes", "LOG", "--last", "0"]])
def test_counts_must_be_positive(run, capsys, argv):
    folder, _, _ = run
    argv = [str(folder / "run") if a == "LOG" else a for a in argv]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"cockpit-like {argv[0]}: error: argument {argv[2]}: expected a positive integer" in err


def test_influence_without_self_influence_says_how_to_track_it(run, capsys):
    folder, _, _ = run
    assert main(["influence", str(folder / "run"), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder / 'run.json'}: no SelfInfluence values (track cockpit_like.quantities.SelfInfluence")
    assert "info['sample_ids']" in out and "docs/curvature_statistics.md" in out


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


# Every subcommand reads its log through cockpit_like.logs.read_log_with_metadata: a file that is not a cockpit
# log is exit status 2 and one message naming the file, what is wrong with it and what a log looks like.
def _subcommand_args(tmp_path: Path) -> dict[str, list[str]]:
    """The options each subcommand needs besides LOG (outputs under ``tmp_path``)."""
    return {
        "plot": ["-o", str(tmp_path / "dash.png")],
        "summary": [],
        "export": ["--to", "tensorboard", str(tmp_path / "tb"), "--no-progress"],
        "watch": ["--once", "-o", str(tmp_path / "watch.png")],
        "influence": [],
        "diagnose": [],
        "spikes": [],
    }


def test_every_subcommand_is_in_the_not_a_log_tests(tmp_path):
    from cockpit_like.cli import _parser

    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    assert set(commands) == set(_subcommand_args(tmp_path))  # a new subcommand gets these tests too


NOT_LOGS = {  # file name: (its text, what the message says is wrong)
    "array.json": ("[1, 2]\n", "it holds a JSON array"),
    "array_lines.json": ("[\n 1,\n 2\n]\n", "it holds a JSON array"),
    "number.json": ("3\n", "it holds a JSON number"),
    "string.json": ('"run"', "it holds a JSON string"),
    "empty.json": ("", "the file is empty"),
    "other.json": ('{"a": 1, "b": [2]}', 'neither "schema" nor step numbers as keys (its keys: a, b)'),
    "no_steps.json": ('{"schema": "cockpit_like.log", "schema_version": 1}', '"steps" are missing'),
    "bad_step.json": ('{"1": 5}', "step 1 holds a JSON number"),
    "text.json": ("hello\n", "it is not JSON"),
    "lines.jsonl": ('{"a": 1}\n{"a": 2}\n', None),  # the message depends on the reader (whole file or watch's)
}


@pytest.mark.parametrize("command", sorted(_subcommand_args(Path("."))))
@pytest.mark.parametrize("name", sorted(NOT_LOGS))
def test_a_file_that_is_not_a_log_is_exit_status_2_and_says_why(tmp_path, capsys, command, name):
    text, problem = NOT_LOGS[name]
    path = tmp_path / name
    path.write_text(text)
    assert main([command, str(path), *_subcommand_args(tmp_path)[command]]) == 2
    captured = capsys.readouterr()
    assert f"cockpit-like {command}: error: {path} is not a cockpit log: " in captured.err
    if problem is not None:
        assert problem in captured.err
    assert '"schema": "cockpit_like.log"' in captured.err and '"schema": "cockpit_like.stream"' in captured.err
    assert captured.out == ""
    assert not (tmp_path / "dash.png").exists() and not (tmp_path / "watch.png").exists()


def test_not_a_log_from_the_console_has_no_traceback(tmp_path):
    """The outside tester's repro: ``cockpit-like summary`` on a JSON array printed a TypeError traceback."""
    (tmp_path / "list.json").write_text("[1,2]\n")
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "cockpit_like.cli", "summary", str(tmp_path / "list.json")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'list.json'} is not a cockpit log: it holds a JSON array" in result.stderr


@pytest.mark.parametrize("command", sorted(_subcommand_args(Path("."))))
@pytest.mark.parametrize("text", ["", "\n", '{"schema": "cockpit_like.stream", "schema_ver'], ids=["0 bytes", "blank", "torn header"])
def test_an_empty_stream_is_a_log_without_steps(tmp_path, capsys, command, text):
    """A ``.jsonl`` with no complete line is the stream of a run stopped before its first step reached the file
    (the writer creates the file at the first step, docs/logs.md#reading): every subcommand treats it as a log
    with no steps, and ``summary`` says so."""
    path = tmp_path / "run.jsonl"
    path.write_text(text)
    assert main([command, str(path), *_subcommand_args(tmp_path)[command]]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    if command == "summary":
        assert captured.out == f"{path}: 0 steps: an empty stream (the run stopped before its first step reached the file)\n"
    if command in ("plot", "watch"):
        assert captured.out == f"wrote {tmp_path / ('dash.png' if command == 'plot' else 'watch.png')}\n"


@pytest.mark.parametrize("text", ["garbage\n", "garbage"], ids=["complete line", "no newline"])
def test_a_line_that_is_not_a_header_is_not_an_empty_stream(tmp_path, capsys, text):
    """One line that is not JSON, complete or not an object's beginning, is not a header torn by a crash: the
    file is not a cockpit log (exit 2), not an empty stream (seventh round of outside trials)."""
    path = tmp_path / "run.jsonl"
    path.write_text(text)
    assert main(["summary", str(path)]) == 2
    assert "is not a cockpit log" in capsys.readouterr().err


def test_a_stream_with_its_header_only_is_a_run_without_steps(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    path.write_text('{"schema": "cockpit_like.stream", "schema_version": 1, "metadata": {"library": "cockpit_like", '
                    '"version": "9.9"}}\n')
    assert main(["summary", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: 0 steps, written by cockpit_like 9.9\n(nothing tracked)\n"
