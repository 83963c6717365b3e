"""Resuming a run: ``cockpit.state_dict()`` / ``cockpit.load_state_dict()``.

The main test kills a training process after its checkpoint and a few more
streamed steps, resumes it in a new process, and compares the log with the
uninterrupted run (``tests/resume_run.py``), for the economy, business and
full presets with histogram bin adaptation, in float64.
"""

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cockpit_like import Cockpit, read_log
from cockpit_like.quantities import Alpha, Distance, GradHist1d, GradNorm, HessMaxEV, Loss, UpdateSize
from cockpit_like.quantities.quantity import KeepUntil, SingleStepQuantity, TwoStepQuantity, last_blocked_step
from cockpit_like.resume import StateMismatchError, pack, unpack
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests import resume_run
from tests.helpers import make_batch, make_problem

ROOT = Path(__file__).resolve().parents[1]

#: HessMaxEV's Hessian-vector products go through BackPACK's full backward hooks at
#: a process's first tracked step and through lean tensor hooks afterwards
#: (cockpit_like.backends.lean_hooks), which rounds differently (last bits).
ROUNDED = {"HessMaxEV": 1e-12}


def phase(name: str, folder: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-W", "ignore", "-m", "tests.resume_run", name, str(folder)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=300)
    return process.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three phases of ``tests/resume_run.py``; the stream as the killed process left it."""
    folder = tmp_path_factory.mktemp("resume")
    reference, interrupted = phase("reference", folder), phase("interrupted", folder)  # side by side
    code, out, err = finish(interrupted)
    assert code == -9 and "killing myself" in out, err
    left = {preset: (folder / f"{preset}.jsonl").read_text() for preset in resume_run.PRESETS}
    resumed = phase("resumed", folder)
    for process in (reference, resumed):
        code, _, err = finish(process)
        assert code == 0, err
    return folder, left


def assert_same_log(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for step in expected:
        assert sorted(actual[step]) == sorted(expected[step]), step
        for name, value in expected[step].items():
            if name in ROUNDED:
                assert actual[step][name] == pytest.approx(value, rel=ROUNDED[name], abs=0), (step, name)
            else:
                assert actual[step][name] == value, (step, name)


def step_records(text: str) -> list[tuple[int, str]]:
    """``(step, name)`` of every value record in a stream (a torn last line is skipped)."""
    records = []
    for line in text.splitlines():
        try:
            document = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in document:
            records.extend((document["step"], name) for name in document["values"])
    return records


@pytest.mark.slow
@pytest.mark.parametrize("preset", resume_run.PRESETS)
def test_killed_and_resumed_run_logs_what_the_uninterrupted_run_logs(runs, preset):
    folder, left = runs
    expected = read_log(folder / f"{preset}-reference.jsonl")
    assert len(expected) == resume_run.STEPS
    names = {name for values in expected.values() for name in values}
    assert {"Alpha", "UpdateSize", "Distance", "GradHist1d"} <= names
    if preset == "full":
        assert {"HessMaxEV", "GradHist2d", "HessTrace", "TICDiag"} <= names
    # the killed run had streamed beyond its checkpoint (and died mid-line)
    killed_steps = {step for step, _ in step_records(left[preset])}
    assert max(killed_steps) == resume_run.CHECKPOINT + resume_run.AFTER
    # the continued stream and the resumed run's full log equal the uninterrupted run's
    streamed = (folder / f"{preset}.jsonl").read_text()
    assert_same_log(read_log(folder / f"{preset}.jsonl"), expected)
    assert_same_log(read_log(folder / f"{preset}-resumed.json"), read_log(folder / f"{preset}-reference.json"))
    # across the break: Alpha and UpdateSize of the checkpoint step come from the resumed process
    checkpoint = resume_run.CHECKPOINT
    assert isinstance(expected[checkpoint]["Alpha"], float) and expected[checkpoint]["Alpha"] != -1
    # no record twice: what the killed run streamed after its checkpoint was dropped
    records = step_records(streamed)
    assert len(records) == len(set(records))
    assert sorted(records) == sorted(step_records((folder / f"{preset}-reference.jsonl").read_text()))
    # the stream was continued, not rewritten: up to the checkpoint it is the killed run's, byte for byte
    offset = torch.load(folder / f"{preset}.pt", weights_only=True)["cockpit"]["stream"]["offset"]
    assert len(left[preset]) > offset and streamed[:offset] == left[preset][:offset]


@pytest.mark.slow
def test_checkpoint_is_plain_and_holds_the_cross_step_state(runs):
    folder, _ = runs
    checkpoint = torch.load(folder / "full.pt", weights_only=True)
    state = {q["name"]: q for q in checkpoint["cockpit"]["quantities"]}
    assert checkpoint["cockpit"]["next_step"] == resume_run.CHECKPOINT + 1
    assert checkpoint["cockpit"]["stream"]["path"].endswith("full.jsonl")
    assert all(entry["output"] is None for entry in state.values())  # streaming: a pointer, not the output
    alpha_cache = state["Alpha"]["state"]["cache"]
    assert list(alpha_cache) == [resume_run.CHECKPOINT]
    # checked at the optimizer's step: the predicted update and the gradient sum were freed there
    assert sorted(alpha_cache[resume_run.CHECKPOINT]) == ["observations", "params", "prediction", "settled"]
    assert alpha_cache[resume_run.CHECKPOINT]["params"][1] == resume_run.CHECKPOINT  # kept until the next step
    assert state["Distance"]["state"]["cache"][0]["params"][1] is None  # kept for the whole run
    size = sum(p.numel() for p in make_problem("mlp")[0].parameters())
    hess = state["HessMaxEV"]["state"]["attributes"]
    assert hess["_warm"] is None and hess["hvp_counts"]  # cold starts by default (warm starts: tests/test_curvature_engine.py)
    assert size > 0
    # GradAbsMax adapted the 1-d range at step 2: not the initial (-2, 2) any more
    low, high = state["GradHist1d"]["state"]["attributes"]["_range"]
    assert low == -high and (low, high) != (-2.0, 2.0)
    assert state["GradHist1d"]["settings"]["range"] == [-2, 2]


# ---- in one process -----------------------------------------------------------
def train(model, cockpit, optimizer, steps, individual=torch.nn.CrossEntropyLoss(reduction="none")):
    lossfunc = make_problem("mlp")[1]
    for step in steps:
        inputs, labels = make_batch("mlp", 8, seed=1000 + step)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        info = {"batch_size": 8, "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()


def through_a_file(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def fresh(quantities, seed=0, stream_to=None, attach=False, **kwargs):
    model = make_problem("mlp", seed=seed)[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    if attach:
        kwargs["model"] = model
    return model, optimizer, Cockpit(model.parameters(), quantities=quantities(), stream_to=stream_to, **kwargs)


def resume_from(checkpoint, quantities, stream_to=None, **kwargs):
    model, optimizer, cockpit = fresh(quantities, seed=1, stream_to=stream_to, **kwargs)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    cockpit.load_state_dict(checkpoint["cockpit"])
    return model, optimizer, cockpit


def save(model, optimizer, cockpit, **kwargs):
    return through_a_file({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "cockpit": cockpit.state_dict(**kwargs)})


def same_state(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def full_with_adaptation():
    return resume_run.make_quantities("full")


def test_in_process_round_trip_continues_exactly():
    """Lean hooks off: every number of the resumed cockpit equals the uninterrupted one's, bit for bit."""
    model, optimizer, cockpit = fresh(full_with_adaptation, lean_hooks=False)
    train(model, cockpit, optimizer, range(3))
    checkpoint = save(model, optimizer, cockpit)
    assert "output" in checkpoint["cockpit"]["quantities"][0] and checkpoint["cockpit"]["stream"] is None
    model2, optimizer2, resumed = resume_from(checkpoint, full_with_adaptation, lean_hooks=False)
    again = through_a_file(resumed.state_dict())
    history, saved_history = again.pop("history"), checkpoint["cockpit"].pop("history")
    assert same_state(again, checkpoint["cockpit"])  # load(save) is the identity, but for the run's history:
    assert history["created"] == saved_history["created"] and not saved_history["resumptions"]
    assert [entry["step"] for entry in history["resumptions"]] == [checkpoint["cockpit"]["next_step"]]
    assert repr(resumed.get_output()) == repr(cockpit.get_output())  # numpy arrays come back as arrays
    train(model, cockpit, optimizer, range(3, 6))
    train(model2, resumed, optimizer2, range(3, 6))
    assert repr(resumed.get_output()) == repr(cockpit.get_output())
    # without the cockpit's state the same continuation differs (Distance, Alpha at 2, histograms, ...)
    model3, optimizer3, _ = resume_from(checkpoint, full_with_adaptation, lean_hooks=False)
    blank = Cockpit(model3.parameters(), quantities=full_with_adaptation(), lean_hooks=False)
    train(model3, blank, optimizer3, range(3, 6))
    output, restarted = cockpit.get_output(), blank.get_output()
    for name in ("Distance", "GradHist1d", "GradHist2d"):
        assert repr(output[4][name]) != repr(restarted[4][name]), name
    assert "Alpha" in output[2] and 2 not in restarted


def test_epoch_logs_and_the_stream_of_another_file(tmp_path):
    """A resumed run streaming to another file starts it with everything so far."""
    model, optimizer, cockpit = fresh(lambda: configuration("economy"), stream_to=tmp_path / "first")
    train(model, cockpit, optimizer, range(3))
    cockpit.log(2, epoch_count=0, train_loss=0.5, learning_rate=0.2)
    checkpoint = save(model, optimizer, cockpit)
    assert checkpoint["cockpit"]["quantities"][0]["output"] is None  # the output stays in first.jsonl
    train(model, cockpit, optimizer, range(3, 5))
    model2, optimizer2, resumed = resume_from(checkpoint, lambda: configuration("economy"), stream_to=tmp_path / "second")
    assert resumed._output.epoch_logs == {2: {"epoch_count": 0, "train_loss": 0.5, "valid_loss": None, "test_loss": None,
                                      "train_accuracy": None, "valid_accuracy": None, "test_accuracy": None,
                                      "learning_rate": 0.2}}
    train(model2, resumed, optimizer2, range(3, 5))
    assert_same_log(read_log(tmp_path / "second.jsonl"), read_log(tmp_path / "first.jsonl"))
    assert_same_log(read_log(resumed.write(tmp_path / "second")), read_log(cockpit.write(tmp_path / "first")))
    # without stream_to the output is read back from the checkpoint's stream
    _, _, plain = resume_from(checkpoint, lambda: configuration("economy"))
    assert sorted(plain.get_output()) == [0, 1, 2] and "Alpha" in plain.get_output()[1]


def test_the_output_can_stay_in_the_state_and_a_lost_stream_is_a_clear_error(tmp_path):
    model, optimizer, cockpit = fresh(lambda: [Loss(linear(1)), UpdateSize(linear(1))], stream_to=tmp_path / "run")
    train(model, cockpit, optimizer, range(2))
    pointer, complete = save(model, optimizer, cockpit), save(model, optimizer, cockpit, with_output=True)
    (tmp_path / "run.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"keeps its output in its stream .*run.jsonl.*with_output=True"):
        resume_from(pointer, lambda: [Loss(linear(1)), UpdateSize(linear(1))], stream_to=tmp_path / "run")
    _, _, resumed = resume_from(complete, lambda: [Loss(linear(1)), UpdateSize(linear(1))], stream_to=tmp_path / "run")
    assert repr(resumed.get_output()) == repr(cockpit.get_output())
    rewritten = read_log(tmp_path / "run.jsonl")
    assert sorted(rewritten) == [0, 1] and sorted(rewritten[0]) == ["Loss", "UpdateSize"] and sorted(rewritten[1]) == ["Loss"]


def test_a_new_cockpit_does_not_touch_an_existing_stream_before_its_first_step(tmp_path):
    model, optimizer, cockpit = fresh(lambda: [Loss(linear(1))], stream_to=tmp_path / "run")
    train(model, cockpit, optimizer, range(2))
    before = (tmp_path / "run.jsonl").read_bytes()
    _, _, other = fresh(lambda: [Loss(linear(1))], stream_to=tmp_path / "run")
    assert (tmp_path / "run.jsonl").read_bytes() == before
    other.close()  # a run without steps still leaves its header (and replaces the old file)
    assert read_log(tmp_path / "run.jsonl") == {}


# ---- mismatches -------------------------------------------------------------------
def economy_state():
    model, optimizer, cockpit = fresh(lambda: configuration("economy"))
    train(model, cockpit, optimizer, range(2))
    return save(model, optimizer, cockpit)["cockpit"]


def test_other_quantities_are_a_clear_error():
    state = economy_state()
    other = Cockpit(make_problem("mlp")[0].parameters(), quantities=configuration("business"))
    with pytest.raises(StateMismatchError, match=r"quantities differ.*not in the checkpoint: \['TICDiag', 'HessTrace'\]"):
        other.load_state_dict(state)
    fewer = [q for q in configuration("economy") if not isinstance(q, Distance)]
    with pytest.raises(StateMismatchError, match=r"missing here: \['Distance'\]"):
        Cockpit(make_problem("mlp")[0].parameters(), quantities=fewer).load_state_dict(state)
    swapped = configuration("economy")
    swapped[-1] = type("UpdateSize", (GradNorm,), {})(linear(1))  # same name, another class
    moved = r"other classes: UpdateSize \(cockpit_like.quantities.parameter_motion:UpdateSize -> tests.test_resume:UpdateSize\)"
    with pytest.raises(StateMismatchError, match=moved):
        Cockpit(make_problem("mlp")[0].parameters(), quantities=swapped).load_state_dict(state)


def test_other_settings_are_a_clear_error():
    state = economy_state()
    changed = [GradHist1d(linear(1), bins=50) if isinstance(q, GradHist1d) else q for q in configuration("economy")]
    with pytest.raises(StateMismatchError, match=r"settings differ.*\n  GradHist1d: bins=100 -> 50"):
        Cockpit(make_problem("mlp")[0].parameters(), quantities=changed).load_state_dict(state)
    schedule = configuration("economy", track_schedule=linear(2))  # schedules are the user's code: not compared
    Cockpit(make_problem("mlp")[0].parameters(), quantities=schedule).load_state_dict(state)


def test_other_parameters_are_a_clear_error():
    state = economy_state()
    wider = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 11), torch.nn.Tanh(), torch.nn.Linear(11, 8),
                                torch.nn.Sigmoid(), torch.nn.Linear(8, 4)).double()
    cockpit = Cockpit(wider.parameters(), quantities=configuration("economy"), model=wider)
    shapes = r"parameter #0 \(1.weight\): float64\[10, 12\] in the checkpoint, float64\[11, 12\] here"
    with pytest.raises(StateMismatchError, match=shapes):
        cockpit.load_state_dict(state)
    fewer = list(make_problem("mlp")[0].parameters())[:4]
    with pytest.raises(StateMismatchError, match="the checkpoint has 6 parameter tensors, this cockpit 4"):
        Cockpit(fewer, quantities=configuration("economy")).load_state_dict(state)


def test_misuse_is_a_clear_error():
    state = economy_state()
    model, optimizer, used = fresh(lambda: configuration("economy"))
    train(model, used, optimizer, range(1))
    with pytest.raises(RuntimeError, match="already tracked steps; load the state into a new cockpit"):
        used.load_state_dict(state)
    with pytest.raises(ValueError, match=r"not a cockpit state \(got \['cockpit', 'model'\]\).*checkpoint\['cockpit'\]"):
        used.load_state_dict({"model": {}, "cockpit": state})
    with pytest.raises(ValueError, match="state version 99"):
        fresh(lambda: configuration("economy"))[2].load_state_dict({**state, "version": 99})
    inputs, labels = make_batch("mlp", 8, seed=0)
    optimizer.zero_grad()
    loss = make_problem("mlp")[1](model(inputs), labels)
    losses = torch.nn.CrossEntropyLoss(reduction="none")(model(inputs), labels)
    used.begin(1, info={"batch_size": 8, "loss": loss, "individual_losses": losses, "optimizer": optimizer})
    with pytest.raises(RuntimeError, match="step 1 is still open; call it after cockpit.end"):
        used.state_dict()
    loss.backward()
    used.end()


# ---- the quantity contract -------------------------------------------------------
class RunningMean:
    """A helper object with its own state_dict (as a statistics object might be)."""

    def __init__(self):
        self.total, self.count = torch.zeros(()), 0

    def state_dict(self):
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state):
        self.total, self.count = state["total"], state["count"]


class LossEMA(SingleStepQuantity):
    """A plugin written without any resume code: EMA of the loss, and a running mean in a helper."""

    def __init__(self, track_schedule):
        super().__init__(track_schedule)
        self.ema = None
        self.history = {"steps": [], "losses": np.zeros(0)}
        self.mean = RunningMean()

    def _compute(self, global_step, params, batch_loss):
        loss = batch_loss.detach()
        self.ema = loss if self.ema is None else 0.5 * self.ema + 0.5 * loss
        self.history["steps"].append(global_step)
        self.history["losses"] = np.append(self.history["losses"], loss.item())
        self.mean.total, self.mean.count = self.mean.total + loss, self.mean.count + 1
        return [self.ema, self.mean.total / self.mean.count, float(self.history["losses"].std())]


class ParamDrift(TwoStepQuantity):
    """A Cockpit-style two-step plugin: lambdas as block functions, a start three steps back."""

    SAVE_SHIFT = 3

    def _compute_start(self, global_step, params, batch_loss):
        self.save_to_cache(global_step, "p", [p.detach().clone() for p in params],
                           block_fn=lambda step, t=global_step: step < t + self.SAVE_SHIFT)

    def _compute_end(self, global_step, params, batch_loss):
        start = global_step - self.SAVE_SHIFT
        return sum(((p - q) ** 2).sum() for p, q in zip(params, self.load_from_cache(start, "p"))).sqrt()


def plugins():
    return [LossEMA(linear(1)), ParamDrift(linear(2)), HessMaxEV(linear(2)), Alpha(linear(2, 1))]


def test_plugins_without_resume_code_are_covered_by_the_generic_default():
    model, optimizer, cockpit = fresh(plugins, lean_hooks=False)
    train(model, cockpit, optimizer, range(5))
    checkpoint = save(model, optimizer, cockpit)
    ema_state = checkpoint["cockpit"]["quantities"][0]["state"]
    assert sorted(ema_state["attributes"]) == ["ema", "history"] and ema_state["objects"]["mean"]["count"] == 5
    drift_cache = checkpoint["cockpit"]["quantities"][1]["state"]["cache"]
    assert {step: entry["p"][1] for step, entry in drift_cache.items()} == {2: 4, 4: 6}  # step < t + 3
    model2, optimizer2, resumed = resume_from(checkpoint, plugins, lean_hooks=False)
    train(model, cockpit, optimizer, range(5, 10))
    train(model2, resumed, optimizer2, range(5, 10))
    assert repr(resumed.get_output()) == repr(cockpit.get_output())
    assert sorted(name for values in cockpit.get_output().values() for name in values) .count("ParamDrift") == 4


def test_last_blocked_step():
    assert last_blocked_step(lambda step, t=7: step <= t, 3) == 7
    assert last_blocked_step(lambda step, t=10**12 + 5: step <= t, 10**12) == 10**12 + 5
    assert last_blocked_step(lambda _: True, 4) is None
    assert last_blocked_step(lambda step: step < 3, 3) == 2
    assert last_blocked_step(KeepUntil(5), 0) == 5
    assert KeepUntil(5)(5) and not KeepUntil(5)(6) and KeepUntil(None)(10**18)


def test_pack_and_unpack():
    param = torch.ones(2, requires_grad=True)
    value = {"a": (np.arange(3, dtype=np.int32), np.float32(1.5)), 2: [param, torch.zeros(1), {1, 2}, None, "x"]}
    packed = through_a_file(pack(value, [param]))
    back = unpack(packed, [param])
    assert back[2][0] is param and back["a"][0].dtype == np.int32 and back["a"][0].tolist() == [0, 1, 2]
    assert type(back["a"][1]) is np.float32 and back["a"][1] == 1.5 and back[2][2] == {1, 2}
    with pytest.raises(TypeError, match=r"x\['b'\]: cannot save a object"):
        pack({"b": object()}, where="x")


def test_running_curvature_statistics_resume_through_their_plan():
    """CurvatureStatistics keeps running KFAC / EK-FAC sums in ``plan`` (an object with its own
    state_dict): the generic default saves it; the resumed statistics equal the uninterrupted ones."""
    from cockpit_like.quantities.curvature_statistics import CurvatureStatistics, EKFACSpectrum

    def statistics_quantities():
        return [CurvatureStatistics(linear(1), statistics="ekfac"), EKFACSpectrum(linear(2))]

    model, optimizer, cockpit = fresh(statistics_quantities, attach=True)
    train(model, cockpit, optimizer, range(3))
    checkpoint = save(model, optimizer, cockpit)
    assert [sorted(q["state"]["objects"]) for q in checkpoint["cockpit"]["quantities"]] == [["plan"], ["plan"]]
    model2, optimizer2, resumed = resume_from(checkpoint, statistics_quantities, attach=True)
    train(model, cockpit, optimizer, range(3, 5))
    train(model2, resumed, optimizer2, range(3, 5))
    assert repr(resumed.get_output()) == repr(cockpit.get_output())
    assert same_state(resumed.quantities[0].statistics(), cockpit.quantities[0].statistics())
    assert cockpit.quantities[0].statistics()["layers"]  # something was accumulated


@pytest.mark.filterwarnings("ignore:Alpha")  # lr = 0: no update to predict
@pytest.mark.parametrize("stream", [False, True])
def test_diagnosis_findings_are_not_reported_twice(tmp_path, stream):
    """A frozen run (lr = 0) gets 'unchanged-parameters' findings before the checkpoint;
    the resumed diagnosis knows them (history and active findings), so the log equals the
    uninterrupted run's and each finding is there once."""

    def frozen(stream_to=None):
        model = make_problem("mlp")[0]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), diagnose=True, stream_to=stream_to)
        return model, optimizer, cockpit

    model, optimizer, cockpit = frozen(tmp_path / "run" if stream else None)
    train(model, cockpit, optimizer, range(4))
    assert cockpit.findings and {f.rule for f in cockpit.findings} == {"unchanged-parameters"}
    checkpoint = save(model, optimizer, cockpit)
    assert (checkpoint["cockpit"]["findings"] is None) == stream
    train(model, cockpit, optimizer, range(4, 8))
    model2, optimizer2, resumed = frozen(tmp_path / "run" if stream else None)
    model2.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["cockpit"])
    train(model2, resumed, optimizer2, range(4, 8))
    assert resumed.findings == cockpit.findings
    assert len({(f.rule, f.layer) for f in cockpit.findings}) == len(cockpit.findings)
    assert_same_log(json.loads(json.dumps(read_log(resumed.write(tmp_path / "b")))),
                    json.loads(json.dumps(read_log(cockpit.write(tmp_path / "a")))))
    # without the diagnosis' state, the resumed rules would report the findings again
    model3, optimizer3, blank = frozen()
    model3.load_state_dict(checkpoint["model"])
    train(model3, blank, optimizer3, range(4, 8))
    assert blank.findings and min(f.step for f in blank.findings) > 4


def test_stream_writer_continues_only_its_own_file(tmp_path):
    from cockpit_like.logs import StreamWriter

    writer = StreamWriter(tmp_path / "s", {"run": 1})
    assert not (tmp_path / "s.jsonl").exists()  # nothing before the first step
    writer.write_step(0, {"Loss": 1.0})
    offset, tail = writer.position()
    assert tail == '{"step": 0, "values": {"Loss": 1.0}}\n' and offset == (tmp_path / "s.jsonl").stat().st_size
    writer.write_step(1, {"Loss": 0.5})
    with pytest.raises(RuntimeError, match="already written; continue it before the first step"):
        writer.continue_at(offset, tail)
    writer.close()
    other = StreamWriter(tmp_path / "s", {"run": 2})
    with pytest.raises(ValueError, match="does not hold the line"):
        other.continue_at(offset, tail.replace("1.0", "2.0"))
    other.continue_at(offset, tail)
    other.write_step(1, {"Loss": 0.25})
    other.close()
    assert read_log(tmp_path / "s.jsonl") == {0: {"Loss": 1.0}, 1: {"Loss": 0.25}}


def test_the_metadata_read_back_keeps_the_start_and_every_resumption(tmp_path, monkeypatch):
    """A resumed run marks its continuation of the stream with "resumed_at_step"; the metadata lines after it
    (the layer names, once the model is seen) must not hide it, nor the time the run began."""
    import cockpit_like.cockpit as cockpit_module
    from cockpit_like.logs import read_log_with_metadata

    made = iter(range(100))
    original = cockpit_module.run_metadata
    monkeypatch.setattr(cockpit_module, "run_metadata", lambda *a: {**original(*a), "created": f"t{next(made)}"})
    quantities = lambda: [Loss(linear(1)), UpdateSize(linear(1))]  # noqa: E731
    model, optimizer, cockpit = fresh(quantities, stream_to=tmp_path / "run")
    train(model, cockpit, optimizer, range(2))
    checkpoint = save(model, optimizer, cockpit)
    for start in (2, 4):
        model, optimizer, cockpit = resume_from(checkpoint, quantities, stream_to=tmp_path / "run")
        train(model, cockpit, optimizer, range(start, start + 2))
        checkpoint = save(model, optimizer, cockpit)
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    marks = [n for n, line in enumerate(lines) if "resumed_at_step" in line.get("metadata", {})]
    assert len(marks) == 2 and any("metadata" in line for line in lines[marks[-1] + 1:])  # a plain line follows
    metadata, steps = read_log_with_metadata(tmp_path / "run.jsonl")
    assert sorted(steps) == list(range(6))
    assert metadata["created"] == lines[0]["metadata"]["created"]
    assert metadata["resumed_at_step"] == 4
    assert [(r["step"], r["created"]) for r in metadata["resumptions"]] == [
        (2, lines[marks[0]]["metadata"]["created"]), (4, lines[marks[1]]["metadata"]["created"])]
    last = [line["metadata"] for line in lines if "metadata" in line][-1]
    assert metadata["param_names"] == last["param_names"] and "resumed_at_step" not in last  # what later lines say


@pytest.mark.parametrize("streamed", [False, True])
def test_write_after_resumptions_keeps_the_runs_history(tmp_path, monkeypatch, streamed):
    """``cockpit.write()`` of a resumed run says when the run began and where it was resumed, as the stream's
    reader does (it wrote the time of the write, and no resumption)."""
    import cockpit_like.cockpit as cockpit_module
    import cockpit_like.logs as logs_module
    from cockpit_like.logs import read_log_with_metadata

    made = iter(range(100))
    monkeypatch.setattr(logs_module, "now_iso", lambda: f"t{next(made)}")
    monkeypatch.setattr(cockpit_module, "now_iso", logs_module.now_iso)
    quantities = lambda: [Loss(linear(1)), UpdateSize(linear(1))]  # noqa: E731
    stream = (lambda: tmp_path / "run") if streamed else (lambda: None)
    model, optimizer, cockpit = fresh(quantities, stream_to=stream())
    began = cockpit._history["created"]
    train(model, cockpit, optimizer, range(2))
    checkpoint = save(model, optimizer, cockpit)
    at = []
    for start in (2, 4):
        model, optimizer, cockpit = resume_from(checkpoint, quantities, stream_to=stream())
        at.append(cockpit._history["resumptions"][-1]["created"])
        train(model, cockpit, optimizer, range(start, start + 2))
        checkpoint = save(model, optimizer, cockpit)
    written, steps = read_log_with_metadata(cockpit.write(tmp_path / "final"))
    assert sorted(steps) == list(range(6))
    assert written["created"] == began and began.startswith("t")
    assert [(r["step"], r["created"]) for r in written["resumptions"]] == [(2, at[0]), (4, at[1])]
    assert written["resumed_at_step"] == 4 and len(set([began, *at])) == 3
    if streamed:  # the stream's reader and the written log tell the same history
        cockpit.close()
        read, _ = read_log_with_metadata(tmp_path / "run.jsonl")
        assert read["created"] == written["created"] and read["resumptions"] == written["resumptions"]


def test_write_of_a_run_never_resumed_says_when_it_began(tmp_path, monkeypatch):
    import cockpit_like.cockpit as cockpit_module
    import cockpit_like.logs as logs_module
    from cockpit_like.logs import read_log_with_metadata

    made = iter(range(100))
    monkeypatch.setattr(logs_module, "now_iso", lambda: f"t{next(made)}")
    monkeypatch.setattr(cockpit_module, "now_iso", logs_module.now_iso)
    model, optimizer, cockpit = fresh(lambda: [Loss(linear(1))])
    train(model, cockpit, optimizer, range(2))
    written, _ = read_log_with_metadata(cockpit.write(tmp_path / "run"))
    assert written["created"] == "t0" and "resumptions" not in written and "resumed_at_step" not in written
