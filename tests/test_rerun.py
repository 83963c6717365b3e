"""A step is stored once: a training loop run again on the same cockpit (a notebook cell re-run) is refused,
and the stream on disk and the log in memory agree, also after a step failed; PyTorch's full-backward-hook
warning of an ``extend``-ed model is hidden while a step is open, and only then."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.helpers import make_batch, make_problem, train

from cockpit_like import Cockpit, quantities, read_log
from cockpit_like.quiet import FULL_BACKWARD_HOOK_MESSAGE, QuietStep
from cockpit_like.run_output import StepAlreadyTrackedError
from cockpit_like.utils.schedules import linear


def memory_and_disk(cockpit: Cockpit, tmp_path) -> tuple[dict, dict]:
    """The log in memory (written whole, read back) and the streamed log."""
    written = cockpit.write(tmp_path / "whole")
    return read_log(written), read_log(cockpit.stream_path)


def make_cockpit(model, tmp_path, extra=()) -> Cockpit:
    return Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1)), quantities.GradNorm(linear(1)),
                                                   quantities.UpdateSize(linear(2)), *extra],
                   stream_to=tmp_path / "run")


def test_a_loop_run_again_is_refused_and_nothing_is_replaced(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = make_cockpit(model, tmp_path)
    train(model, lossfunc, individual, cockpit, "mlp", steps=4)
    before = {step: dict(values) for step, values in cockpit.get_output().items()}
    assert sorted(before) == [0, 1, 2, 3]
    with pytest.raises(StepAlreadyTrackedError, match=r"step 0: .*already tracked steps up to 3.*start=4") as error:
        train(model, lossfunc, individual, cockpit, "mlp", steps=4)  # the cell run a second time
    assert isinstance(error.value, ValueError) and "new Cockpit" in str(error.value)
    assert str(tmp_path / "run.jsonl") in str(error.value)
    assert cockpit.open_step is None
    after = cockpit.get_output()
    assert sorted(after) == [0, 1, 2, 3]
    assert after[0]["Loss"] == before[0]["Loss"] and after[3]["GradNorm"] == before[3]["GradNorm"]
    memory, disk = memory_and_disk(cockpit, tmp_path)
    assert memory == disk and sorted(disk) == [0, 1, 2, 3]


def test_going_on_after_the_last_step_is_fine(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = make_cockpit(model, tmp_path)
    train(model, lossfunc, individual, cockpit, "mlp", steps=3)
    with pytest.raises(StepAlreadyTrackedError, match="step 1: .*up to 2"):
        _step(model, lossfunc, individual, cockpit, 1)
    _step(model, lossfunc, individual, cockpit, 3)
    _step(model, lossfunc, individual, cockpit, 7)
    with pytest.raises(StepAlreadyTrackedError, match="step 5: .*up to 7"):
        _step(model, lossfunc, individual, cockpit, 5)  # backwards, though 5 itself was never tracked
    memory, disk = memory_and_disk(cockpit, tmp_path)
    assert memory == disk and sorted(disk) == [0, 1, 2, 3, 7]


def test_the_last_step_again_without_declared_micro_batches_is_left_to_the_engine(tmp_path):
    """A further backward pass of the last step, undeclared, is a loop that accumulates without saying so (the
    step engine's case), not a re-run; declared (info["micro_batches"]), the step is complete and refused."""
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1))])
    for step in range(2):  # no info["optimizer"]: the cockpit cannot tell when the optimizer steps
        _step(model, lossfunc, individual, cockpit, step)
    _step(model, lossfunc, individual, cockpit, 1)  # not refused
    with pytest.raises(StepAlreadyTrackedError, match="step 1: .*up to 1"):
        _step(model, lossfunc, individual, cockpit, 1, micro_batches=2)


def test_the_last_step_again_after_its_optimizer_stepped_is_refused():
    """With info["optimizer"] the cockpit sees optimizer.step() after the step: a backward pass with that number
    again is a new optimizer step under a repeated number (a counter bug, found outside the tests: before, the
    step was withdrawn as undeclared accumulation and the cockpit switched to accumulating)."""
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1))])
    train(model, lossfunc, individual, cockpit, "mlp", steps=2)
    with pytest.raises(StepAlreadyTrackedError, match=r"step 1: this step was tracked and SGD.step\(\) has run since"):
        _step(model, lossfunc, individual, cockpit, 1)
    assert cockpit.checks.get(1, {}).get("valid", True) and sorted(cockpit.get_output()) == [0, 1]


def test_a_step_without_scheduled_quantities_is_not_checked(tmp_path):
    """Nothing would be stored, so nothing can be replaced."""
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(lambda step: step in (0, 4))],
                      stream_to=tmp_path / "run")
    for step in (0, 4, 1, 2):
        _step(model, lossfunc, individual, cockpit, step)
    assert sorted(cockpit.get_output()) == [0, 4]


def _step(model, lossfunc, individual, cockpit, step: int, micro_batches: int = 1) -> None:
    inputs, labels = make_batch("mlp", 8, seed=step)
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": 8, "individual_losses": individual(outputs, labels), "loss": loss}
    if micro_batches > 1:
        info["micro_batches"] = micro_batches
    with cockpit(step, info=info):
        loss.backward()


def test_micro_batches_of_one_step_are_not_a_rerun(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1)), quantities.GradNorm(linear(1))])
    for step in range(2):
        for _ in range(2):
            _step(model, lossfunc, individual, cockpit, step, micro_batches=2)
    assert sorted(cockpit.get_output()) == [0, 1]
    with pytest.raises(StepAlreadyTrackedError):
        _step(model, lossfunc, individual, cockpit, 1, micro_batches=2)


def test_a_resumed_cockpit_refuses_steps_before_its_checkpoint(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1))])
    train(model, lossfunc, individual, cockpit, "mlp", steps=3)
    resumed = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1))])
    resumed.load_state_dict(cockpit.state_dict())
    with pytest.raises(StepAlreadyTrackedError, match="up to 2"):
        _step(model, lossfunc, individual, resumed, 1)
    _step(model, lossfunc, individual, resumed, 3)
    assert sorted(resumed.get_output()) == [0, 1, 2, 3]


class Failing(quantities.Loss):
    """A quantity that fails at one step (after the quantities before it stored theirs)."""

    def __init__(self, track_schedule, fail_at: int):
        super().__init__(track_schedule)
        self.fail_at = fail_at

    def _compute(self, global_step, params, batch_loss):
        if global_step == self.fail_at:
            self.fail_at = None  # once
            raise RuntimeError("a quantity fails")
        return super()._compute(global_step, params, batch_loss)


def test_memory_and_stream_agree_after_a_step_failed(tmp_path):
    """A quantity that fails mid-step: the values other quantities computed for that step are dropped
    (never streamed), so the log in memory is what is on disk; training goes on at the next step."""
    model, lossfunc, individual = make_problem("mlp")
    cockpit = make_cockpit(model, tmp_path, extra=[Failing(linear(1), fail_at=2)])
    with pytest.raises(RuntimeError, match="a quantity fails"):
        train(model, lossfunc, individual, cockpit, "mlp", steps=4)
    memory, disk = memory_and_disk(cockpit, tmp_path)
    assert memory == disk
    assert sorted(disk) == [0, 1] and "Loss" in disk[1]
    assert 2 not in cockpit.get_output()
    _step(model, lossfunc, individual, cockpit, 2)  # the failed step can be tracked again
    _step(model, lossfunc, individual, cockpit, 3)
    memory, disk = memory_and_disk(cockpit, tmp_path)
    assert memory == disk and sorted(disk) == [0, 1, 2, 3]


def test_memory_and_stream_agree_after_the_backward_pass_failed(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = make_cockpit(model, tmp_path)
    train(model, lossfunc, individual, cockpit, "mlp", steps=2)
    inputs, labels = make_batch("mlp", 8, seed=2)
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    with pytest.raises(KeyboardInterrupt):
        with cockpit(2, info={"batch_size": 8, "individual_losses": individual(outputs, labels), "loss": loss}):
            raise KeyboardInterrupt  # interrupted before the backward pass ran
    memory, disk = memory_and_disk(cockpit, tmp_path)
    assert memory == disk and sorted(disk) == [0, 1]


# ---- the full-backward-hook warning --------------------------------------------------------
def _hook_warnings(caught) -> list:
    return [w for w in caught if FULL_BACKWARD_HOOK_MESSAGE in str(w.message)]


def test_extended_model_warns_outside_a_step_and_not_inside(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    inputs, labels = make_batch("mlp", 8, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lossfunc(model(inputs), labels).backward()  # no cockpit: PyTorch's warning, as without us
    assert len(_hook_warnings(caught)) >= 1, "PyTorch no longer warns here: the filter can go"

    cockpit = make_cockpit(model, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, lossfunc, individual, cockpit, "mlp", steps=3)
        warnings.warn("the user's own warning", UserWarning)
        lossfunc(model(inputs), labels).backward()  # after the steps: shown again
    assert len(_hook_warnings(caught)) == 1
    assert [str(w.message) for w in caught if "own warning" in str(w.message)] == ["the user's own warning"]


def test_quiet_step_removes_only_its_own_filter():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet = QuietStep().open()
        warnings.filterwarnings("ignore", message="something of the user's")  # added while the step is open
        other = QuietStep().open()  # a second one adds no second filter
        warnings.warn(FULL_BACKWARD_HOOK_MESSAGE + ". See ...", UserWarning)
        warnings.warn("Full backward hook is firing for another reason", UserWarning)
        warnings.warn(FULL_BACKWARD_HOOK_MESSAGE, DeprecationWarning)  # not the category PyTorch uses
        assert [str(w.message) for w in caught] == ["Full backward hook is firing for another reason",
                                                    FULL_BACKWARD_HOOK_MESSAGE]
        quiet.close()
        quiet.close()
        other.close()
        assert any(f[1] is not None and f[1].pattern == "something of the user's" for f in warnings.filters)
        del caught[:]
        warnings.warn(FULL_BACKWARD_HOOK_MESSAGE, UserWarning)
        assert len(caught) == 1


def test_quiet_step_keeps_a_filter_the_user_had():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=__import__("re").escape(FULL_BACKWARD_HOOK_MESSAGE),
                                category=UserWarning)
        mine = list(warnings.filters)
        quiet = QuietStep().open()
        assert warnings.filters == mine
        quiet.close()
        assert warnings.filters == mine


def test_the_warning_is_hidden_in_a_step_that_fails(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = make_cockpit(model, tmp_path)
    filters = list(warnings.filters)
    with pytest.raises(ValueError, match="batch_size"):
        with cockpit(0, info={"batch_size": 0, "loss": torch.tensor(1.0)}):
            pass
    assert warnings.filters == filters  # the filter of the refused step is gone


class Interrupted(quantities.GradNorm):
    """Ctrl-C (a BaseException) while the step's quantities are computed, after Loss stored its value."""

    def _compute(self, global_step, params, batch_loss):
        if global_step == 1:
            raise KeyboardInterrupt
        return super()._compute(global_step, params, batch_loss)


def test_memory_and_stream_agree_after_an_interrupt_mid_step(tmp_path):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(1)), Interrupted(linear(1))],
                      stream_to=tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        train(model, lossfunc, individual, cockpit, "mlp", steps=3)
    memory, disk = memory_and_disk(cockpit, tmp_path)
    assert memory == disk and sorted(disk) == [0]


def test_the_error_for_an_earlier_step_says_the_numbers_only_go_forward():
    """Step 3 after step 5, never tracked: the message said "tracking step 3 again would replace what it stored"
    (seventh round of outside trials); it now says that step numbers only go forward."""
    model = torch.nn.Linear(3, 2)
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNorm(lambda step: True)])
    for step in (5, 3):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        if step == 3:
            with pytest.raises(StepAlreadyTrackedError, match=r"step 3 comes before it: the step numbers of one run only go forward") as error:
                with cockpit(step, info={"loss": loss}):
                    loss.backward()
            assert "again would replace" not in str(error.value)
        else:
            with cockpit(step, info={"loss": loss}):
                loss.backward()
