"""Outside trial 10 (a new user's first week): mistakes that were taken silently or got a raw Python error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from cockpit_like import Cockpit, read_log
from cockpit_like.utils.configuration import configuration
from tests.helpers import make_batch, make_problem


def _cockpit(**kwargs):
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model, **kwargs)
    return cockpit, model, lossfunc


def _step(cockpit, model, lossfunc, optimizer, step):
    inputs, labels = make_batch("mlp", 8, seed=step)
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": 8, "individual_losses": nn.functional.cross_entropy(outputs, labels, reduction="none"),
            "loss": loss, "optimizer": optimizer}
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    optimizer.step()


# ---- finding 3: cockpit.log with a step that is not an int -------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_log_refuses_a_non_int_step_before_storing(tmp_path, stream):
    cockpit, model, lossfunc = _cockpit(stream_to=str(tmp_path / "run") if stream else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(cockpit, model, lossfunc, optimizer, 0)
    for bad in ("epoch1", 1.5, -1, True):
        with pytest.raises(ValueError, match=r"global_step must be an int >= 0, the optimizer step number"):
            cockpit.log(bad, train_loss=1.0)
    assert all("train_loss" not in values for values in cockpit.get_output().values())
    path = cockpit.write(str(tmp_path / "full"))
    cockpit.close()
    assert all("train_loss" not in values for values in read_log(path).values())
    if stream:
        assert all("train_loss" not in values for values in read_log(str(tmp_path / "run.jsonl")).values())


def test_log_takes_integer_tensors_and_numpy_ints_as_the_step():
    cockpit, _, _ = _cockpit()
    cockpit.log(torch.tensor(3), train_loss=1.0)
    cockpit.log(np.int64(4), train_loss=2.0)
    output = cockpit.get_output()
    assert output[3]["train_loss"] == 1.0 and output[4]["train_loss"] == 2.0
    assert all(type(step) is int for step in output)


# ---- finding 11: cockpit.log stores plain numbers ---------------------------------------------------------
def test_log_converts_tensors_and_numpy_scalars_to_python_numbers(tmp_path):
    cockpit, _, _ = _cockpit(stream_to=str(tmp_path / "run"))
    loss = torch.tensor(1.0, dtype=torch.float64, requires_grad=True) * 2
    cockpit.log(0, epoch_count=torch.tensor(1), train_loss=loss, valid_loss=np.float32(0.25),
                valid_accuracy=np.array([0.5]), learning_rate=[torch.tensor(0.1), 0.2])
    logged = cockpit.get_output()[0]
    assert type(logged["train_loss"]) is float and logged["train_loss"] == 2.0
    assert type(logged["epoch_count"]) is int and logged["epoch_count"] == 1
    assert type(logged["valid_loss"]) is float and logged["valid_loss"] == 0.25
    assert type(logged["valid_accuracy"]) is float and logged["valid_accuracy"] == 0.5
    assert logged["learning_rate"] == pytest.approx([0.1, 0.2]) and type(logged["learning_rate"][0]) is float
    cockpit.close()
    assert read_log(str(tmp_path / "run.jsonl"))[0]["train_loss"] == 2.0


@pytest.mark.parametrize(
    "value, match",
    [
        ("0.5", r"train_loss=\.\.\.\): got the string '0.5'; train_loss takes a number.*float\(text\)"),
        (torch.ones(3), r"train_loss=\.\.\.\): got a tensor of shape \(3,\).*one real number.*\.mean\(\)"),
        (nn.CrossEntropyLoss(), r"train_loss=\.\.\.\): got a CrossEntropyLoss.*takes a number"),
        (["0.5"], r"train_loss=\.\.\.\): got the string '0.5'"),
    ],
)
def test_log_refuses_non_numeric_figures_naming_the_key(value, match):
    cockpit, _, _ = _cockpit()
    with pytest.raises(TypeError, match=match):
        cockpit.log(1, valid_loss=0.5, train_loss=value)
    assert cockpit.get_output() == {}  # nothing stored, not even the good figure


# ---- finding 7: raw Python errors that named neither the argument nor the fix -----------------------------
def test_info_loss_given_the_loss_module_is_refused_before_backward():
    cockpit, model, lossfunc = _cockpit()
    inputs, labels = make_batch("mlp", 8, seed=0)
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(ValueError, match=r"info\['loss'\] takes the mini-batch loss tensor.*got a CrossEntropyLoss "
                                         r"\(the loss function itself: pass the value it returns"):
        with cockpit(0, info={"batch_size": 8, "loss": lossfunc}):
            loss.backward()
    assert cockpit.get_output() == {}


@pytest.mark.parametrize("step", ["0", 1.0, -2])
def test_create_graph_names_a_bad_step(step):
    cockpit, _, _ = _cockpit()
    with pytest.raises(ValueError, match=r"cockpit.create_graph\(global_step\): need the step number, an int >= 0"):
        cockpit.create_graph(step)


def test_write_names_a_path_that_is_not_a_path(tmp_path):
    cockpit, _, _ = _cockpit()
    with pytest.raises(TypeError, match=r"cockpit.write\(logpath\): logpath takes a path.*got 123 \(int\)"):
        cockpit.write(123)
    assert cockpit.write(tmp_path / "run").endswith("run.json")  # a pathlib.Path is a path


def test_cockpit_given_the_parameters_method_says_to_call_it():
    model, _, _ = make_problem("mlp")
    with pytest.raises(ValueError, match=r"Cockpit\(params\): got the method/function Module.parameters itself.*"
                                         r"Cockpit\(model.parameters\(\), \.\.\.\)"):
        Cockpit(model.parameters, quantities=configuration("economy"))


def test_configuration_given_a_list_names_the_label():
    with pytest.raises(TypeError, match=r"configuration\(label\): label takes one preset name, a str.*"
                                        r"got \['economy'\] \(list\)"):
        configuration(["economy"])


# ---- finding 8: a file that is not a log, an export folder that is a file ---------------------------------
PNG_START = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def test_read_log_of_a_binary_file_names_the_file(tmp_path):
    picture = tmp_path / "demo.png"
    picture.write_bytes(PNG_START)
    with pytest.raises(ValueError, match=r"demo.png is not a cockpit log: it is not text \(byte 0x89 at offset 0"):
        read_log(picture)


def test_cli_summary_and_export_say_what_is_wrong_without_a_traceback(tmp_path, capsys):
    from cockpit_like.cli import main

    picture = tmp_path / "demo.png"
    picture.write_bytes(PNG_START)
    assert main(["summary", str(picture), "--no-progress"]) == 2
    assert "demo.png is not a cockpit log: it is not text" in capsys.readouterr().err
    log = tmp_path / "run.json"
    log.write_text(json.dumps({"schema": "cockpit_like.log", "schema_version": 1, "metadata": {},
                               "steps": {"0": {"Loss": 1.0}}}))
    pytest.importorskip("tensorboard")
    assert main(["export", str(log), "--to", "tensorboard", str(picture), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "demo.png is a file, not a folder; give a folder" in err and "Traceback" not in err
    assert picture.read_bytes() == PNG_START


# ---- finding 10: the plotter's and the exporter's arguments -----------------------------------------------
def test_plotter_given_the_cockpit_in_its_constructor_says_where_it_goes(tmp_path):
    from cockpit_like.plotting.plotter import CockpitPlotter

    cockpit, _, _ = _cockpit()
    for source in (cockpit, "runs/demo", tmp_path):
        with pytest.raises(TypeError, match=r"CockpitPlotter\(secondary_screen=\.\.\.\): takes True or False.*"
                                            r"goes to plot\(\), not to the constructor"):
            CockpitPlotter(source)
    assert CockpitPlotter(True).secondary_screen and not CockpitPlotter(0).secondary_screen
    assert CockpitPlotter(np.bool_(True)).secondary_screen


def test_exporter_attach_given_a_path_says_how_to_export_a_log(tmp_path):
    pytest.importorskip("tensorboard")
    from cockpit_like.integrations.exporters import TensorBoardExporter

    exporter = TensorBoardExporter(tmp_path / "tb")
    with pytest.raises(TypeError, match=r"TensorBoardExporter.attach\(cockpit\): takes a running Cockpit, got "
                                        r"'runs/demo' \(str\).*export_log\(path, to, directory\)"):
        exporter.attach("runs/demo")
    cockpit, _, _ = _cockpit()
    exporter.attach(cockpit)  # the failed call left the exporter free to attach
    exporter.close()
    picture = tmp_path / "demo.png"
    picture.write_bytes(PNG_START)
    with pytest.raises(ValueError, match=r"TensorBoardExporter\(log_dir\): .*demo.png is a file, not a folder"):
        TensorBoardExporter(picture)


# ---- finding 9: gradients cleared inside the block after the backward pass --------------------------------
def test_zero_grad_after_backward_inside_the_block_is_named():
    cockpit, model, lossfunc = _cockpit()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = make_batch("mlp", 8, seed=0)
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": 8, "individual_losses": nn.functional.cross_entropy(outputs, labels, reduction="none"),
            "loss": loss, "optimizer": optimizer}
    with pytest.raises(RuntimeError) as raised:
        with cockpit(0, info=info):
            loss.backward()
            optimizer.zero_grad()
    message = str(raised.value)
    assert "a backward pass ran inside the cockpit's block" in message
    assert "the gradients were cleared (set to None) inside the block after the backward pass" in message
    assert "optimizer.zero_grad()" in message and "Call loss.backward() inside" not in message
