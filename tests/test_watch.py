"""``cockpit-like watch``: following a streaming log that another process is writing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import pytest

from cockpit_like import read_log
from cockpit_like.cli import main
from cockpit_like.watch import LogFollower

HEADER = {"schema": "cockpit_like.stream", "schema_version": 1, "metadata": {"library": "cockpit_like"}}


def _line(step: int) -> str:
    return json.dumps({"step": step, "values": {"Loss": 2.0 / (step + 1), "GradNorm": [0.5, 0.25 + step],
                                                "GradHist1d": {"hist": [step, 1, 2], "edges": [-1, 0, 1, 2]}}}) + "\n"


def test_follower_reads_only_complete_lines(tmp_path):
    path = tmp_path / "run.jsonl"
    first = _line(1)
    path.write_text(json.dumps(HEADER) + "\n" + _line(0) + first[:17])  # step 1 is half written
    follower = LogFollower(tmp_path / "run")
    assert follower.poll() and sorted(follower.steps) == [0]
    assert follower.metadata == {"library": "cockpit_like"}
    assert not follower.poll()  # nothing new
    with open(path, "a") as handle:
        handle.write(first[17:] + json.dumps({"step": 0, "values": {"UpdateSize": [0.1, 0.2]}}) + "\n")
    assert follower.poll()
    assert follower.steps == read_log(path)  # the same as the reader of the whole file
    assert follower.steps[0]["UpdateSize"] == [0.1, 0.2] and follower.steps[1]["Loss"] == 1.0
    path.write_text(json.dumps(HEADER) + "\n" + _line(7))  # a new run writing to the same path
    assert follower.poll() and sorted(follower.steps) == [7]


def test_follower_of_a_full_log(tmp_path):
    from cockpit_like.logs import write_log

    write_log(tmp_path / "run", {0: {"Loss": 1.0}}, {})
    follower = LogFollower(tmp_path / "run.json")
    assert follower.poll() and not follower.poll()
    time.sleep(0.01)
    write_log(tmp_path / "run", {0: {"Loss": 1.0}, 1: {"Loss": 0.5}}, {})
    assert follower.poll() and sorted(follower.steps) == [0, 1]


WRITER = """
import json, sys, time
HEADER = {header!r}
def _line(step):
    return json.dumps({{"step": step, "values": {{"Loss": 2.0 / (step + 1), "GradNorm": [0.5, 0.25 + step],
                                                "GradHist1d": {{"hist": [step, 1, 2], "edges": [-1, 0, 1, 2]}}}}}}) + "\\n"
path, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with open(path, "a") as handle:
    if handle.tell() == 0:
        handle.write(json.dumps(HEADER) + "\\n"); handle.flush()
    for step in range(steps):
        line = _line(step)
        handle.write(line[:10]); handle.flush()   # a torn line for a moment
        time.sleep(pause / 2)
        handle.write(line[10:]); handle.flush()
        time.sleep(pause / 2)
"""


def _writer(path: Path, steps: int, pause: float) -> subprocess.Popen:
    script = WRITER.format(header=HEADER)
    return subprocess.Popen([sys.executable, "-c", script, str(path), str(steps), str(pause)])


def _png_shape(path: Path) -> tuple:
    return matplotlib.image.imread(path).shape


def test_watch_once_on_a_growing_log(tmp_path, capsys):
    log = tmp_path / "live.jsonl"
    writer = _writer(log, steps=500, pause=0.1)
    try:
        seen = []
        for index in range(2):
            time.sleep(0.5)
            output = tmp_path / f"look{index}.png"
            assert main(["watch", str(log), "--once", "-o", str(output), "--wait", "10"]) == 0
            assert f"wrote {output}" in capsys.readouterr().out
            assert _png_shape(output)[:2] == (900, 1600)
            follower = LogFollower(log)
            follower.poll()
            seen.append(max(follower.steps, default=-1))
        assert writer.poll() is None  # still writing
    finally:
        writer.kill()
        writer.wait()
    assert 0 <= seen[0] < seen[1]  # the log grew between the two looks
    first, second = (matplotlib.image.imread(tmp_path / f"look{i}.png") for i in range(2))
    assert (first != second).any()  # and the second picture shows more


def test_watch_follows_a_growing_log(tmp_path):
    log = tmp_path / "live.jsonl"
    log.write_text(json.dumps(HEADER) + "\n")  # the run has started, no step yet
    output = tmp_path / "dash.png"
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    watcher = subprocess.Popen(
        [sys.executable, "-m", "cockpit_like.cli", "watch", str(log), "--interval", "0.2", "--stop-after", "60",
         "-o", str(output)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    writer = None
    try:
        first = watcher.stdout.readline()  # the first picture is drawn: now the steps come in
        assert first.startswith("[cockpit-like watch] 0 steps"), (first, watcher.stderr.read() if not first else "")
        writer = _writer(log, steps=8, pause=0.2)
        lines = [first]
        while not lines[-1].startswith("[cockpit-like watch] 8 steps") and lines[-1]:  # until it caught up (or ended)
            lines.append(watcher.stdout.readline())
        assert writer.wait(timeout=30) == 0
    finally:
        for process in (watcher, writer):
            if process is not None:
                process.kill()
                process.wait()
    lines = [line for line in lines if line.startswith("[cockpit-like watch]")]
    counts = [int(line.split()[2]) for line in lines]
    assert len(counts) >= 2 and counts == sorted(counts) and counts[0] == 0  # redrawn as it grew
    assert counts[-1] == 8 and f"last 7: {output}" in lines[-1]  # and caught up with the finished log
    assert _png_shape(output)[:2] == (900, 1600)


def test_watch_errors(tmp_path, capsys):
    assert main(["watch", str(tmp_path / "nothing"), "--once"]) == 2
    assert "no cockpit log" in capsys.readouterr().err
    (tmp_path / "x.jsonl").write_text(json.dumps(HEADER) + "\n")
    with pytest.raises(ValueError, match="interval must be positive"):
        from cockpit_like.watch import watch

        watch(tmp_path / "x.jsonl", interval=0)
    with pytest.raises(ValueError, match="stop_after must be positive"):  # -1 was accepted (trial 9)
        watch(tmp_path / "x.jsonl", stop_after=-1)
