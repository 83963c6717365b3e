"""Exporters: TensorBoard, W&B (offline) and MLflow (file store) hold the values of the JSON log.

Each backend is read back with its own reader: TensorBoard's
``EventAccumulator``, W&B's protobuf records of the offline ``.wandb`` file,
``MlflowClient``.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from backpack import extend

from cockpit_like import Cockpit, quantities, read_log
from cockpit_like.cli import main
from cockpit_like.integrations.flatten import flatten
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

STEPS = 5


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                       "WANDB_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path),
                       "WANDB_CONFIG_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny float64 training run, exported live to TensorBoard; its JSON log."""
    from cockpit_like.integrations.exporters import TensorBoardExporter

    folder = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double())
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tracked = configuration("economy") + [quantities.GradHist2d(linear(2), keep_individual=True),
                                          quantities.KFACTrace(linear(2))]
    cockpit = Cockpit(model.parameters(), quantities=tracked, stream_to=folder / "log")
    exporter = TensorBoardExporter(folder / "live_tb", image_every=2).attach(cockpit)
    for step in range(STEPS):
        x = torch.randn(8, 4, dtype=torch.float64)
        y = torch.randint(0, 2, (8,))
        optimizer.zero_grad()
        outputs = model(x)
        loss = lossfunc(outputs, y)
        info = {"batch_size": 8, "loss": loss, "optimizer": optimizer,
                "individual_losses": torch.nn.functional.cross_entropy(outputs, y, reduction="none")}
        with cockpit(step, info=info):
            loss.backward()
        optimizer.step()
    cockpit.log(STEPS - 1, epoch_count=0, train_loss=0.25, valid_accuracy=0.75, learning_rate=0.5)
    exporter.close()
    cockpit.close()
    log = Path(cockpit.write(folder / "log"))
    return {"folder": folder, "log": log, "steps": read_log(log), "live_tb": folder / "live_tb"}


def test_flatten_names_and_values():
    values = {
        "Loss": 0.5, "Alpha": float("nan"), "GradNorm": [1.0, 2.0], "valid_loss": None, "flag": True,
        "KFACTrace": {"trace": [3.0, 4.0], "trace_total": 7.0},
        "GradHist1d": {"hist": [1, 2, 0], "edges": [-1.0, 0.0, 1.0, 2.0]},
        "GradHist2d": {"hist": [[1, 2, 3], [4, 5, 6]], "edges": [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]],
                       "param_groups": 1, "param_0": {"hist": [[1, 0], [0, 1]], "edges": [[0, 1, 2], [5, 6, 7]]}},
        "Parameters": [[[0.1, 0.2]], [0.3]],
    }
    flat = flatten(values, "c/")
    assert flat.scalars.keys() == {"c/Loss", "c/Alpha", "c/GradNorm/param_0", "c/GradNorm/param_1",
                                   "c/KFACTrace/trace/param_0", "c/KFACTrace/trace/param_1", "c/KFACTrace/trace_total"}
    assert flat.scalars["c/GradNorm/param_1"] == 2.0 and flat.scalars["c/KFACTrace/trace_total"] == 7.0
    assert np.isnan(flat.scalars["c/Alpha"])
    assert flat.histograms.keys() == {"c/GradHist1d", "c/GradHist2d/gradient", "c/GradHist2d/parameter",
                                      "c/GradHist2d/param_0/gradient", "c/GradHist2d/param_0/parameter"}
    counts, edges = flat.histograms["c/GradHist2d/gradient"]  # x = gradient: rows summed over y
    assert counts.tolist() == [6, 15] and edges.tolist() == [0.0, 1.0, 2.0]
    counts, edges = flat.histograms["c/GradHist2d/parameter"]
    assert counts.tolist() == [5, 7, 9] and edges.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert flat.histograms["c/GradHist2d/param_0/parameter"][1].tolist() == [5, 6, 7]


def _expected(steps):
    scalars, histograms = {}, {}
    for step, values in steps.items():
        flat = flatten(values)
        for tag, value in flat.scalars.items():
            scalars.setdefault(tag, {})[step] = value
        for tag, value in flat.histograms.items():
            histograms.setdefault(tag, {})[step] = value
    return scalars, histograms


def _check_tensorboard(directory, steps, images=()):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    accumulator.Reload()
    scalars, histograms = _expected(steps)
    tags = accumulator.Tags()
    assert set(tags["scalars"]) == set(scalars)
    assert set(tags["histograms"]) == set(histograms)
    for tag, expected in scalars.items():
        stored = {event.step: event.value for event in accumulator.Scalars(tag)}
        assert stored.keys() == expected.keys(), tag
        for step, value in expected.items():  # TensorBoard keeps float32
            assert np.float32(stored[step]) == np.float32(value) or (np.isnan(value) and np.isnan(stored[step])), (tag, step)
    for tag, expected in histograms.items():
        stored = {event.step: event.histogram_value for event in accumulator.Histograms(tag)}
        assert stored.keys() == expected.keys(), tag
        for step, (counts, edges) in expected.items():
            assert list(stored[step].bucket) == counts.tolist()
            np.testing.assert_allclose(stored[step].bucket_limit, edges[1:], rtol=1e-12)
    # spot checks straight from the log, without flatten
    last = max(steps)
    assert np.float32(accumulator.Scalars("Loss")[-1].value) == np.float32(steps[last]["Loss"])
    assert {e.step: e.value for e in accumulator.Scalars("GradNorm/param_2")}[1] == np.float32(steps[1]["GradNorm"][2])
    assert {e.step: e.value for e in accumulator.Scalars("valid_accuracy")} == {last: 0.75}
    assert [int(c) for c in accumulator.Histograms("GradHist1d")[0].histogram_value.bucket] == steps[0]["GradHist1d"]["hist"]
    if images:
        assert [event.step for event in accumulator.Images("dashboard")] == list(images)
        assert accumulator.Images("dashboard")[0].width > 100


def test_tensorboard_live_equals_log(run):
    steps = run["steps"]
    assert "UpdateSize" in steps[0] and "GradHist2d" in steps[2] and "KFACTrace" in steps[4]
    _check_tensorboard(run["live_tb"], steps, images=(0, 2, 4))


def test_cli_export_tensorboard(run, capsys):
    target = run["folder"] / "cli_tb"
    assert main(["export", str(run["log"]), "--to", "tensorboard", str(target), "--no-progress"]) == 0
    assert f"log_dir {target}" in capsys.readouterr().out
    _check_tensorboard(target, run["steps"])


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (LevelDB log blocks, read with wandb's own record type)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(raw):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        data = raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:
            pending = data
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + data
            continue
        elif kind == 4:
            pending += data
        else:
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        yield record


def test_wandb_offline_run_holds_the_log(run):
    from cockpit_like.integrations.exporters import export_log

    exporter = export_log(run["log"], "wandb", run["folder"] / "wandb", image_every=4)
    files = list(Path(exporter.run_dir).glob("run-*.wandb"))
    assert len(files) == 1 and "offline-run" in exporter.run_dir
    from google.protobuf.message import DecodeError

    records = []
    for _ in range(100):  # wandb's service may still be writing when finish() returns: wait for the exit record
        try:
            records = list(_wandb_records(files[0]))
        except DecodeError:  # a record read while the service was writing it (CI under load): read again
            time.sleep(0.2)
            continue
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            break
        time.sleep(0.2)
    stored: dict[str, dict[int, object]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = row.pop("global_step")
        for key, value in row.items():
            if not key.startswith("_"):
                stored.setdefault(key, {})[step] = value
    scalars, histograms = _expected(run["steps"])
    for tag, expected in scalars.items():
        assert stored[tag].keys() == expected.keys(), tag
        for step, value in expected.items():  # JSON float64: exact
            assert stored[tag][step] == value or (np.isnan(value) and stored[tag][step] == "NaN"), (tag, step)
    for tag, expected in histograms.items():
        for step, (counts, edges) in expected.items():
            assert step in stored[f"{tag}/values"], (tag, step, [r.WhichOneof("record_type") for r in records][-12:])
            assert stored[f"{tag}/values"][step] == counts.tolist()
            np.testing.assert_allclose(stored[f"{tag}/bins"][step], edges, rtol=1e-6)
    assert stored["dashboard/_type"] == {0: "image-file", 4: "image-file"}


def test_mlflow_file_store_holds_the_log(run):
    from mlflow.tracking import MlflowClient

    from cockpit_like.integrations.exporters import export_log

    store = run["folder"] / "mlruns"
    exporter = export_log(run["log"], "mlflow", store)
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    scalars, histograms = _expected(run["steps"])
    assert set(client.get_run(exporter.run_id).data.metrics) == set(scalars)
    for tag, expected in scalars.items():
        stored = {m.step: m.value for m in client.get_metric_history(exporter.run_id, tag)}
        assert stored.keys() == expected.keys(), tag
        for step, value in expected.items():
            assert stored[step] == value or (np.isnan(value) and np.isnan(stored[step])), (tag, step)
    local = client.download_artifacts(exporter.run_id, "histograms/GradHist2d/param_1/gradient", str(run["folder"] / "dl"))
    for step, (counts, edges) in histograms["GradHist2d/param_1/gradient"].items():
        document = json.loads((Path(local) / f"step_{step:07d}.json").read_text())
        assert document["counts"] == counts.tolist() and np.allclose(document["edges"], edges)
    assert client.get_run(exporter.run_id).info.status == "FINISHED"


def test_bad_target_and_arguments(run, capsys):
    from cockpit_like.integrations.exporters import TensorBoardExporter, make_exporter

    with pytest.raises(ValueError, match="unknown export target 'csv'; choose one of tensorboard, wandb, mlflow"):
        make_exporter("csv", run["folder"])
    with pytest.raises(ValueError, match="image_every"):
        TensorBoardExporter(run["folder"] / "x", image_every=-1)
    assert main(["export", str(run["folder"] / "missing.json"), "--to", "tensorboard", str(run["folder"] / "y")]) == 2
    assert "no cockpit log" in capsys.readouterr().err


@pytest.mark.parametrize("to, modules, install", [
    ("tensorboard", ("tensorboard", "torch.utils.tensorboard"), "pip install tensorboard"),
    ("wandb", ("wandb",), "pip install wandb"),
    ("mlflow", ("mlflow", "mlflow.entities", "mlflow.tracking"), "pip install mlflow-skinny"),
])
def test_cli_export_without_the_package_says_what_to_install(run, capsys, monkeypatch, to, modules, install):
    """The outside tester's repro: ``--to wandb`` without wandb printed a traceback and exited with 1."""
    from cockpit_like.integrations.exporters import MissingPackage, make_exporter

    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    target = run["folder"] / f"missing_{to}"
    assert main(["export", str(run["log"]), "--to", to, str(target), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"cockpit-like export: error: --to {to}: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert f"install it with: {install} (or pip install 'cockpit_like[{to}]')" in captured.err
    with pytest.raises(MissingPackage) as raised:  # an ImportError, for code that catches those
        make_exporter(to, target)
    assert isinstance(raised.value, ImportError) and raised.value.install == install


def test_optional_packages_are_not_imported_with_the_package():
    import subprocess
    import sys

    modules = ("lightning", "pytorch_lightning", "transformers", "accelerate", "tensorboard", "wandb", "mlflow",
               "torch.utils.tensorboard")
    code = ("import sys, cockpit_like, cockpit_like.cli, cockpit_like.watch, cockpit_like.integrations.lightning, "
            "cockpit_like.integrations.transformers, cockpit_like.integrations.exporters\n"
            f"print([m for m in {modules!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.stdout.strip() == "[]"
