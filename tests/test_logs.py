"""JSON logs: full form, streaming form, reading back, crashes."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cockpit_like import Cockpit, quantities, read_log
from cockpit_like.logs import SCHEMA_VERSION, decode, encode, read_log_with_metadata
from cockpit_like.utils.schedules import linear
from tests.helpers import make_problem, train

ROOT = Path(__file__).resolve().parents[1]


def plain(value):
    """Stored values in the form a log gives back (arrays -> lists, tuples -> lists)."""
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def same(a, b):
    a, b = plain(a), plain(b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


def small_run(tmp_path, stream=False, steps=5):
    model, lossfunc, individual = make_problem("mlp")
    made = [q(linear(1)) for q in (quantities.Loss, quantities.GradNorm, quantities.Distance, quantities.UpdateSize, quantities.Parameters)]
    cockpit = Cockpit(model.parameters(), quantities=made, stream_to=tmp_path / "stream" if stream else None)
    train(model, lossfunc, individual, cockpit, "mlp", steps)
    cockpit.log(steps - 1, epoch_count=0, train_loss=0.5, train_accuracy=0.25, learning_rate=0.1)
    return cockpit


def test_round_trip_full_form(tmp_path):
    cockpit = small_run(tmp_path)
    path = cockpit.write(tmp_path / "deep" / "folder" / "run")
    assert path.endswith("run.json")
    document = json.loads(Path(path).read_text())  # plain JSON, nothing special
    assert document["schema"] == "cockpit_like.log" and document["schema_version"] == SCHEMA_VERSION
    meta = document["metadata"]
    assert meta["torch"] == torch.__version__ and meta["library"] == "cockpit_like"
    assert [q["name"] for q in meta["quantities"]] == ["Loss", "GradNorm", "Distance", "UpdateSize", "Parameters"]
    assert meta["quantities"][0]["schedule"] == "linear(interval=1, offset=0)"
    back = read_log(path)
    original = cockpit.get_output()
    assert list(back) == list(original) == [0, 1, 2, 3, 4]
    assert same(back, original)
    assert read_log(tmp_path / "deep" / "folder" / "run") == back  # without the suffix


def test_numpy_tuples_and_non_finite_values_round_trip(tmp_path):
    values = {
        0: {"hist": {"hist": np.arange(4, dtype=np.float32), "edges": (np.zeros(2), np.ones(3))}, "alpha": -1},
        1: {"nan": math.nan, "inf": [math.inf, -math.inf, 1.5], "arr": np.array([[1.0, np.nan]]), "f64": np.float64(2.5)},
    }
    cockpit = Cockpit([torch.ones(1, requires_grad=True)])
    cockpit._output.epoch_logs.update(values)
    path = cockpit.write(tmp_path / "odd")
    text = Path(path).read_text()
    assert "NaN" in text and "Infinity" in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    back = read_log(path)
    assert back[0]["hist"] == {"hist": [0.0, 1.0, 2.0, 3.0], "edges": [[0.0, 0.0], [1.0, 1.0, 1.0]]}
    assert back[0]["alpha"] == -1
    assert math.isnan(back[1]["nan"]) and back[1]["inf"] == [math.inf, -math.inf, 1.5]
    assert back[1]["arr"][0][0] == 1.0 and math.isnan(back[1]["arr"][0][1]) and back[1]["f64"] == 2.5


def test_bare_file_name_is_written_to_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Cockpit([torch.ones(1, requires_grad=True)]).write("bare")
    assert (tmp_path / "bare.json").is_file()


def test_streaming_log_reads_back_like_the_full_log(tmp_path):
    cockpit = small_run(tmp_path, stream=True)
    assert cockpit.stream_path.endswith("stream.jsonl")
    streamed = read_log(cockpit.stream_path)
    assert same(streamed, cockpit.get_output())
    meta, _ = read_log_with_metadata(tmp_path / "stream")
    assert meta["num_params"] == 6


def test_torn_last_line_is_skipped(tmp_path):
    cockpit = small_run(tmp_path, stream=True)
    path = Path(cockpit.stream_path)
    with open(path, "a") as handle:
        handle.write('{"step": 9, "values": {"Loss": 0.')
    back = read_log(path)
    assert 9 not in back and same(back, cockpit.get_output())


def test_a_cut_off_json_log_says_so_and_points_at_its_stream(tmp_path):
    """A .json log cut short (an interrupted write, a partial copy) was "not a cockpit log: check the path"
    (outside trial 8); now it is "cut off", and the run's stream is named where there is one."""
    cockpit = small_run(tmp_path, stream=True)
    full = Path(cockpit.write(tmp_path / "stream"))
    text = full.read_text()
    full.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"is cut off: .*the run's stream {tmp_path / 'stream.jsonl'} holds each step"):
        read_log(full)
    alone = tmp_path / "alone.json"
    alone.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"is cut off: .*stream_to"):
        read_log(alone)
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"steps": [1, 2,, 3]}')
    with pytest.raises(ValueError, match="is not a cockpit log: it is not JSON"):
        read_log(garbage)


def test_a_killed_run_keeps_every_completed_step(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        sys.path.insert(0, {str(ROOT)!r})
        from cockpit_like import Cockpit, quantities
        from cockpit_like.utils.schedules import linear
        from tests.helpers import make_problem, make_batch
        model, lossfunc, individual = make_problem("mlp")
        cockpit = Cockpit(model.parameters(), [quantities.Loss(linear(1)), quantities.UpdateSize(linear(1))],
                          stream_to={str(tmp_path / "killed")!r})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10**6):
            inputs, labels = make_batch("mlp", 8, seed=step)
            optimizer.zero_grad()
            loss = lossfunc(model(inputs), labels)
            with cockpit(step, info={{"loss": loss}}):
                loss.backward()
            optimizer.step()
            print(step, loss.item(), flush=True)
            if step >= 5:
                time.sleep(0.05)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    printed = []
    for line in process.stdout:
        printed.append(line.split())
        if len(printed) == 12:
            break
    process.send_signal(signal.SIGKILL)
    process.wait()
    back = read_log(tmp_path / "killed.jsonl")
    for step, loss in printed:
        assert back[int(step)]["Loss"] == pytest.approx(float(loss), rel=1e-12)
    # Each UpdateSize is stored once the next step is tracked.
    assert all("UpdateSize" in back[int(step)] for step, _ in printed[:-1])


def test_metadata_lines_keep_the_runs_history_read_whole_or_a_chunk_at_a_time():
    """A later metadata line replaces what it holds, but the run's start and its resumptions are kept (the watcher
    reads a stream a chunk at a time: the same metadata)."""
    from functools import reduce

    from cockpit_like.logs import merge_metadata

    lines = [{"created": "t0", "param_names": ["p0"]}, {"created": "t1", "resumed_at_step": 3, "param_names": ["p0"]},
             {"created": "t2", "param_names": ["0.weight"]}, {"created": "t3", "resumed_at_step": 7}]  # fmt: skip
    whole = reduce(merge_metadata, lines, {})
    assert whole == {"created": "t0", "param_names": ["0.weight"], "resumed_at_step": 7,
                     "resumptions": [{"step": 3, "created": "t1"}, {"step": 7, "created": "t3"}]}  # fmt: skip
    for cut in range(1, len(lines)):
        assert merge_metadata(reduce(merge_metadata, lines[:cut], {}), reduce(merge_metadata, lines[cut:], {})) == whole


def test_reads_cockpit_logs(tmp_path):
    cockpit_style = {
        "0": {"Loss": 2.0, "GradHist1d": {"hist": {"__ndarray__": [1.0, 2.0], "dtype": "float32", "shape": [2]}}},
        "10": {"Alpha": -1},
    }
    path = tmp_path / "cockpit.json"
    path.write_text(json.dumps(cockpit_style))
    back = read_log(path)
    assert sorted(back) == [0, 10]
    assert back[0]["GradHist1d"]["hist"].dtype == np.float32 and back[0]["GradHist1d"]["hist"].tolist() == [1.0, 2.0]


def test_newer_schema_and_missing_files_are_clear_errors(tmp_path):
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"schema": "cockpit_like.log", "schema_version": SCHEMA_VERSION + 1, "steps": {}}))
    with pytest.raises(ValueError, match="schema version 2; this cockpit_like reads versions up to 1"):
        read_log(path)
    with pytest.raises(FileNotFoundError, match="no cockpit log at .*nothing.*also tried"):
        read_log(tmp_path / "nothing")


def test_encode_rejects_unknown_objects():
    with pytest.raises(TypeError, match="cannot write a object to a cockpit log"):
        encode(object())
    assert decode(encode({"a": (1, 2.0)})) == {"a": [1, 2.0]}


# ---- a progress line while a long log is read (issue 35) -------------------------------------------
def _long_logs(tmp_path, steps: int = 60) -> tuple[Path, Path]:
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1))], stream_to=tmp_path / "long")
    train(model, lossfunc, individual, cockpit, "mlp", steps=steps)
    cockpit.close()
    return Path(cockpit.write(tmp_path / "long")), Path(cockpit.stream_path)


def test_reading_shows_a_progress_line_when_asked(tmp_path, capsys):
    whole, stream = _long_logs(tmp_path)
    capsys.readouterr()
    lines = len(stream.read_text().split("\n"))
    for path, unit, count in ((stream, "line", lines), (whole, "step", 60)):
        quiet = read_log(path)
        assert capsys.readouterr().err == ""
        shown = read_log(path, progress=True)
        err = capsys.readouterr().err
        assert shown == quiet and sorted(shown) == list(range(60))
        assert f"reading {path.name}:" in err and f"0/{count} " in err and f"{unit}/s" in err


def test_automatic_progress_waits_half_a_second(tmp_path, capsys):
    """``progress=None`` (the command line's): a log read in well under half a second shows nothing."""
    _, stream = _long_logs(tmp_path, steps=5)
    capsys.readouterr()
    read_log(stream, progress=None)
    assert capsys.readouterr().err == ""


def test_progress_in_a_kernel_without_ipywidgets_is_a_text_line(monkeypatch, capsys):
    import warnings

    import tqdm.std

    from cockpit_like.utils import progress as module

    monkeypatch.setattr(module, "in_jupyter_kernel", lambda: True)
    real_find_spec = module.importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec",
                        lambda name, *args: None if name == "ipywidgets" else real_find_spec(name, *args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tqdm.auto would warn "IProgress not found"
        bar = module.progress(range(3), 3, "work", enabled=None)
    assert type(bar) is tqdm.std.tqdm and not bar.disable  # shown in a notebook although stderr is no terminal
    assert list(bar) == [0, 1, 2]
    bar.close()


def test_command_line_no_progress(tmp_path, capsys):
    from cockpit_like.cli import main

    whole, _ = _long_logs(tmp_path, steps=5)
    assert main(["plot", str(whole), "-o", str(tmp_path / "p.png"), "--no-progress", "--dpi", "30"]) == 0
    assert main(["summary", str(whole), "--no-progress"]) == 0
    assert main(["influence", str(whole), "--no-progress"]) == 0
    assert "reading" not in capsys.readouterr().err


# ---- a stream write that fails (a full disk, an interrupt) -------------------------------------------------
class _Failing:
    """``StreamWriter._write`` that fails ``times`` times from the first line of step ``step`` on (``partial``:
    after writing the first half of the line, as a disk that fills up mid-line)."""

    def __init__(self, monkeypatch, error: BaseException, step: int, times: int = 1, partial: bool = False):
        from cockpit_like.logs import StreamWriter

        original, self.started, self.failed = StreamWriter._write, False, 0
        failing = self

        def _write(writer, line):
            failing.started = failing.started or line.startswith(b'{"step": %d,' % step)
            if failing.started and failing.failed < times:
                failing.failed += 1
                if partial:
                    writer._torn = True
                    writer._handle.write(line[: len(line) // 2])
                raise error
            return original(writer, line)

        monkeypatch.setattr(StreamWriter, "_write", _write)


def _run_on(cockpit, model, lossfunc, individual, steps) -> list[int]:
    """Train ``steps``; a step whose block raises is left (as in a notebook) and the next one goes on."""
    from tests.helpers import make_batch

    optimizer, raised = torch.optim.SGD(model.parameters(), lr=0.1), []
    for step in steps:
        inputs, labels = make_batch("mlp", 8, seed=1000 + step)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        try:
            with cockpit(step, info={"batch_size": 8, "individual_losses": individual(outputs, labels), "loss": loss}):
                loss.backward()
        except KeyboardInterrupt:
            raised.append(step)
        optimizer.step()
    return raised


def _stream_cockpit(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    made = [q(linear(1)) for q in (quantities.Loss, quantities.GradNorm, quantities.UpdateSize)]
    return Cockpit(model.parameters(), quantities=made, stream_to=tmp_path / "run"), model, lossfunc, individual


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "torn"])
@pytest.mark.parametrize("times", [1, 2], ids=["written-as-the-interrupt-leaves", "written-at-the-next-step"])
def test_a_line_an_interrupt_kept_out_of_the_stream_is_written_after_all(tmp_path, monkeypatch, partial, times):
    cockpit, *problem = _stream_cockpit(tmp_path)
    failing = _Failing(monkeypatch, KeyboardInterrupt(), step=2, times=times, partial=partial)
    assert _run_on(cockpit, *problem, range(4)) == [2]
    assert failing.failed == times and 2 in cockpit.get_output()  # stored in memory: its line is written too
    assert same(read_log(tmp_path / "run.jsonl"), cockpit.get_output())  # no torn line left in the middle either


def test_a_full_disk_warns_once_and_the_stream_catches_up_when_it_frees(tmp_path, monkeypatch):
    import errno

    cockpit, *problem = _stream_cockpit(tmp_path)
    full = OSError(errno.ENOSPC, "No space left on device")
    failing = _Failing(monkeypatch, full, step=2, times=3, partial=True)
    with pytest.warns(RuntimeWarning, match=r"could not write to the stream .*run.jsonl .*No space left.*wait in memory") as caught:
        assert _run_on(cockpit, *problem, range(6)) == []  # the run goes on
    assert len([w for w in caught if "could not write" in str(w.message)]) == 1 and failing.failed == 3
    assert same(read_log(tmp_path / "run.jsonl"), cockpit.get_output())
    assert cockpit._output.stream.pending == 0


def test_lines_that_cannot_be_written_are_said_at_close_and_kept_in_the_checkpoint(tmp_path, monkeypatch):
    import errno

    cockpit, *problem = _stream_cockpit(tmp_path)
    _Failing(monkeypatch, OSError(errno.ENOSPC, "No space left on device"), step=2, times=10**6)
    with pytest.warns(RuntimeWarning, match="could not write"):
        _run_on(cockpit, *problem, range(4))
    state = cockpit.state_dict()  # the stream misses steps: the checkpoint holds the output itself
    assert state["stream"] is None and state["quantities"][0]["output"] is not None
    with pytest.warns(RuntimeWarning, match=r"closing the stream .*run.jsonl: \d+ line\(s\) could not be written"):
        cockpit.close()
    assert sorted(read_log(tmp_path / "run.jsonl")) == [0, 1]


def test_a_log_or_stream_under_a_file_is_a_clear_error(tmp_path):
    """`cockpit.write("data.py/run")` raised a raw FileExistsError naming 'data.py' (outside trial 8)."""
    blocking = tmp_path / "data.py"
    blocking.write_text("x = 1\n")
    cockpit = small_run(tmp_path, stream=False)
    with pytest.raises(ValueError, match=r"cannot create the folder .*data.py for the log: .*data.py is a file, not a folder"):
        cockpit.write(blocking / "run")
    with pytest.raises(ValueError, match=r"for the stream \(stream_to\): .*data.py is a file"):
        Cockpit([torch.zeros(1, requires_grad=True)], quantities=[quantities.Loss(linear(1))], stream_to=blocking / "run")
