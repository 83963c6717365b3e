"""What a run gets told while it trains: a failed self-check warns once per check (a forgotten zero_grad() was
visible only on the dashboard and in the log), and a block without a backward pass is a clear error."""

import warnings

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.cockpit import NoBackwardPassError
from cockpit_like.utils.configuration import configuration
from tests.helpers import make_batch, make_problem


def _step(cockpit, model, lossfunc, individual, optimizer, step, zero_grad=True, backward_inside=True):
    inputs, labels = make_batch("mlp", 6, seed=step)
    if zero_grad:
        optimizer.zero_grad()
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": 6, "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
    with cockpit(step, info=info):
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    optimizer.step()


def _run_and_catch(steps: int, zero_grad: bool = True):
    """``(cockpit, every warning)`` of ``steps`` economy steps on the MLP."""
    model, lossfunc, individual = make_problem("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            _step(cockpit, model, lossfunc, individual, optimizer, step, zero_grad=zero_grad)
    return cockpit, caught


def test_a_forgotten_zero_grad_warns_once_naming_the_check_and_the_fix():
    cockpit, caught = _run_and_catch(5, zero_grad=False)
    told = [w for w in caught if "failed the self-check" in str(w.message)]
    assert len(told) == 1 and told[0].category is RuntimeWarning
    assert "step 1 failed the self-check 'stale_gradient'" in str(told[0].message)
    assert "optimizer.zero_grad()" in str(told[0].message)
    assert told[0].filename == __file__  # points at the user's `with cockpit(...)`
    assert sorted(cockpit.invalid_steps) == [1, 2, 3, 4]


def test_a_valid_run_is_told_nothing():
    _, caught = _run_and_catch(3)
    assert not [w for w in caught if "cockpit_like" in str(w.message)]


@pytest.mark.parametrize("extended", [False, True])
def test_a_backward_pass_after_the_block_is_a_clear_error(extended):
    model, lossfunc, individual = make_problem("mlp")
    if extended:
        from backpack import extend

        model, lossfunc = extend(model), extend(lossfunc)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    with pytest.raises(NoBackwardPassError, match=r"no backward pass ran inside the cockpit's block.*loss.backward\(\)"):
        _step(cockpit, model, lossfunc, individual, optimizer, 0, backward_inside=False)
    assert cockpit.get_output().get(0, {}).keys() <= {"checks"}
    # the run goes on: the next step, written right, is tracked
    optimizer.zero_grad()
    _step(cockpit, model, lossfunc, individual, optimizer, 1)
    assert "GradNorm" in cockpit.get_output()[1]


def test_alpha_without_an_optimizer_warns_once_not_at_every_step():
    model, lossfunc, individual = make_problem("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own filter: once per location, the step in the text defeated it
        for step in range(6):
            inputs, labels = make_batch("mlp", 6, seed=step)
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = lossfunc(outputs, labels)
            with cockpit(step, info={"batch_size": 6, "individual_losses": individual(outputs, labels), "loss": loss}):
                loss.backward()
            optimizer.step()
    told = [w for w in caught if "no info['optimizer']" in str(w.message)]
    assert len(told) == 1 and told[0].filename == __file__


def test_a_step_context_never_entered_says_so():
    """`cockpit(step, info=info)` on a line of its own (no `with`) tracked nothing, silently (outside trial 8)."""
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    inputs, labels = make_batch("mlp", 6, seed=0)
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    with pytest.warns(RuntimeWarning, match=r"cockpit\(0, info=...\) was called but never entered"):
        cockpit(0, info={"batch_size": 6, "individual_losses": individual(outputs, labels), "loss": loss})
    loss.backward()
    assert cockpit.get_output() == {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*never entered")  # entered: nothing said
        model.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        with cockpit(1, info={"batch_size": 6, "individual_losses": individual(outputs, labels), "loss": loss}):
            loss.backward()


def test_a_loop_that_sets_the_gradients_with_autograd_grad_is_not_told_it_ran_no_backward_pass():
    """`grads = torch.autograd.grad(loss, params); p.grad = g` inside the block: no loss.backward() call, but the
    gradients are there (and the per-sample rows, from the same graph): valid steps, as before the error existed."""
    model, lossfunc, individual = make_problem("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    for step in range(2):
        inputs, labels = make_batch("mlp", 6, seed=step)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        info = {"batch_size": 6, "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
        with cockpit(step, info=info):
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g
        expected = float(torch.cat([g.reshape(-1) for g in grads]).norm())
        optimizer.step()
        assert cockpit.checks[step]["valid"]
        assert sum(v**2 for v in cockpit.get_output()[step]["GradNorm"]) ** 0.5 == pytest.approx(expected, rel=1e-5)
