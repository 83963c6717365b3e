"""The two-call form of a step: ``cockpit.begin(step, info=...)`` / ``cockpit.end()``."""

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration
from tests.helpers import make_batch, make_problem


def run(form, steps=4):
    """Train a few SGD steps with the full preset, stepping the cockpit in ``form``."""
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        inputs, labels = make_batch("mlp", 8, seed=step)
        optimizer.zero_grad()
        output = model(inputs)
        loss = lossfunc(output, labels)
        info = {
            "batch_size": 8,
            "individual_losses": individual(output, labels),
            "loss": loss,
            "optimizer": optimizer,
        }
        if form == "with":
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        else:
            cockpit.begin(step, info=info)
            assert cockpit.open_step == step
            loss.backward(create_graph=cockpit.create_graph(step))
            cockpit.end()
            assert cockpit.open_step is None
        optimizer.step()
    return cockpit.get_output()


def drop_time(output):
    return {step: {k: v for k, v in values.items() if k != "Time"} for step, values in output.items()}


def test_begin_end_equals_with():
    with_form, calls = drop_time(run("with")), drop_time(run("begin"))
    assert with_form.keys() == calls.keys() and len(with_form) == 4
    assert repr(with_form) == repr(calls)


def test_end_without_begin():
    model, _, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    with pytest.raises(RuntimeError, match=r"end\(\) without an open step.*begin\(global_step"):
        cockpit.end()


def test_overlapping_steps():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy", track_schedule=lambda step: step > 0))
    inputs, labels = make_batch("mlp", 8, seed=0)
    loss = lossfunc(model(inputs), labels)
    info = {"batch_size": 8, "loss": loss}
    info["individual_losses"] = torch.full((8,), loss.item())  # mean(individual_losses) == loss
    cockpit.begin(1, info=info)
    with pytest.raises(RuntimeError, match="step 1 is still open"):
        cockpit.begin(2, info=info)
    with pytest.raises(RuntimeError, match="step 1 is still open"):
        with cockpit(2, info=info):
            pass
    loss.backward()
    cockpit.end()
    assert 1 in cockpit.get_output()


def test_failed_begin_leaves_no_open_step():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    with pytest.raises(Exception, match="batch_size"):
        cockpit.begin(0, info={})
    assert cockpit.open_step is None


def test_end_with_error_stores_nothing():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy", track_schedule=lambda step: step > 0))
    inputs, labels = make_batch("mlp", 8, seed=0)
    loss = lossfunc(model(inputs), labels)
    info = {"batch_size": 8, "loss": loss, "individual_losses": torch.full((8,), loss.item())}
    cockpit.begin(1, info=info)
    cockpit.end(ValueError("the framework's backward failed"))
    assert cockpit.get_output() == {} and cockpit.open_step is None
    # the cockpit is usable again
    loss = lossfunc(model(inputs), labels)
    with cockpit(2, info={**info, "loss": loss}):
        loss.backward()
    assert 2 in cockpit.get_output()
