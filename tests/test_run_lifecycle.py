"""A user's first week (outside trial 9): a closed cockpit takes its hooks off the model and refuses more steps,
a listener that raises does not stop training, and two cockpits given one stream_to leave a readable file."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.logs import read_log
from cockpit_like.quantities import GradNorm, Loss
from cockpit_like.utils.schedules import linear


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))


def _step(cockpit, model, step, optimizer=None):
    model.zero_grad()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    loss = losses.mean()
    with cockpit(step, info={"loss": loss, "individual_losses": losses, "batch_size": 6}):
        loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_close_takes_the_hooks_off_the_model_and_refuses_more_steps(tmp_path):
    model = _model()
    cockpit = Cockpit(model.parameters(), quantities=[Loss(linear(1)), GradNorm(linear(1))], model=model,
                      stream_to=tmp_path / "run")
    _step(cockpit, model, 0)
    assert _hooks(model) > 0  # the tracer's, while the run goes on
    cockpit.close()
    assert _hooks(model) == 0  # torch.save(model) no longer pickles references to cockpit_like
    model.zero_grad()
    loss = model(torch.randn(2, 4)).sum()
    with pytest.raises(RuntimeError, match="was closed") as error:
        with cockpit(1, info={"loss": loss}):
            loss.backward()
    assert "new Cockpit" in str(error.value) and "load_state_dict" in str(error.value)
    assert model[0].weight.grad is None  # refused before the backward pass
    assert sorted(read_log(tmp_path / "run.jsonl")) == [0] and 0 in cockpit.get_output()
    cockpit.close()  # again: nothing


def test_a_listener_that_raises_does_not_stop_training(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=[Loss(linear(1))], stream_to=tmp_path / "run")
    calls = []

    def exporter(step, values):
        calls.append(step)
        if step < 2:
            raise NotADirectoryError("'/tmp/mlruns' is not a directory")

    cockpit.add_listener(exporter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            _step(cockpit, model, step, optimizer)
    told = [str(w.message) for w in caught if "listener" in str(w.message)]
    assert len(told) == 1 and "NotADirectoryError" in told[0] and "training goes on" in told[0]
    assert calls == [0, 1, 2, 3]  # called again at each step
    cockpit.close()
    assert sorted(read_log(tmp_path / "run.jsonl")) == [0, 1, 2, 3]


def test_two_cockpits_with_one_stream_to_leave_a_readable_file(tmp_path):
    first_model, second_model = _model(), _model()
    first = Cockpit(first_model.parameters(), quantities=[Loss(linear(1))], stream_to=tmp_path / "shared")
    second = Cockpit(second_model.parameters(), quantities=[Loss(linear(1))], stream_to=tmp_path / "shared")
    _step(first, first_model, 0)
    with pytest.warns(RuntimeWarning, match="two cockpits stream to"):
        _step(second, second_model, 0)
    for step in (1, 2):
        _step(first, first_model, step)
        _step(second, second_model, step)
    first.close()
    second.close()
    logged = read_log(tmp_path / "shared.jsonl")  # before: "line 10 is not valid JSON"
    assert sorted(logged) == [0, 1, 2]
    assert [logged[s]["Loss"] for s in (0, 1, 2)] == [second.get_output()[s]["Loss"] for s in (0, 1, 2)]
    assert sorted(first.get_output()) == [0, 1, 2]  # the older one keeps its steps in memory


def test_a_cockpit_cannot_be_pickled_or_copied_and_says_what_to_save():
    import copy
    import pickle

    model = _model()
    cockpit = Cockpit(model.parameters(), quantities=[Loss(linear(1))], model=model)
    for attempt in (lambda: pickle.dumps(cockpit), lambda: copy.deepcopy(cockpit), lambda: copy.copy(cockpit)):
        with pytest.raises(TypeError, match="state_dict") as error:
            attempt()
        assert "cannot be pickled or copied" in str(error.value)


def test_stream_to_must_be_a_path_and_not_a_folder(tmp_path):
    params = [torch.zeros(2, requires_grad=True)]
    with pytest.raises(TypeError, match=r"stream_to=\.\.\.\) takes a path"):
        Cockpit(params, stream_to=123)
    with pytest.raises(ValueError, match="names a folder") as error:
        Cockpit(params, stream_to=f"{tmp_path}/logs/")  # before: wrote logs.jsonl beside the folder
    assert f"{tmp_path}/logs/run.jsonl" in str(error.value)
    (tmp_path / "exp1").mkdir()  # TensorBoard's folder of the same name: the cockpit's log goes beside it
    cockpit = Cockpit(params, stream_to=tmp_path / "exp1")
    assert cockpit.stream_path == str(tmp_path / "exp1.jsonl")
