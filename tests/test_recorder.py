"""The recorder (issue #15, item 3): records of one step, the first non-finite value, replay programs.

References are computed here without the recorder: plain float64 forward
passes of the same model at the same parameters.
"""

from __future__ import annotations

import copy
import math
import json
import runpy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.diagnosis.recorder import (
    CONTROL_FLOW_NOTE,
    NotReplayableError,
    export_program,
    read_record,
    to_graph_module,
)
from cockpit_like.logs import read_log
from cockpit_like.quantities import GradHist1d, GradNorm, Loss, NormTest
from cockpit_like.utils.schedules import linear
from tests import zoo
from tests.helpers import make_batch, make_cnn, make_mlp

DTYPE = torch.float64


# ---- models with a non-finite value ------------------------------------------------------------------
class Exploding(nn.Module):
    """``log(exp(scale * x))``: equal to ``scale * x``, until exp overflows."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale, dtype=DTYPE))

    def forward(self, x):
        return torch.log(torch.exp(self.scale * x))


class LogOfRelu(nn.Module):
    """``log(relu(x) + shift)``: -inf where ``relu(x) + shift`` is 0."""

    def __init__(self, shift: float = 1.0):
        super().__init__()
        self.shift = shift

    def forward(self, x):
        return torch.log(torch.relu(x) + self.shift)


class RowNorm(nn.Module):
    """``sqrt(sum(x**2))`` per row: finite at a zero row, its gradient there is NaN."""

    def forward(self, x):
        return x.pow(2).sum(-1, keepdim=True).sqrt()


def exploding_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), Exploding(), nn.Linear(6, 3)).to(DTYPE)


def train(model, cockpit, steps, batch, lossfunc, before_step=lambda step: None, with_loss_fn=True):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        before_step(step)
        x, y = batch(step)
        loss = lossfunc(model(x), y)
        info = {"loss": loss, "batch_size": len(y)}
        if with_loss_fn:
            info["loss_fn"] = lambda output, y=y: lossfunc(output, y)
        with cockpit(step, info=info):
            loss.backward()
        losses.append(loss.detach().clone())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _batch(step, rows=5, features=4, classes=3):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, features, generator=generator, dtype=DTYPE), torch.randint(0, classes, (rows,), generator=generator)


def _run_program(path) -> subprocess.CompletedProcess:
    """The exported program on its own: a fresh interpreter in its folder, no cockpit_like on the path."""
    return subprocess.run(
        [sys.executable, "-I", str(path)], capture_output=True, text=True, cwd=path.parent, timeout=120
    )


# ---- non-finite values ---------------------------------------------------------------------------------
def test_exploding_exp_is_recorded_automatically_and_replayed(tmp_path):
    model = exploding_net()
    blow = model[2]
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(3))], model=model, record_dir=tmp_path)
    reference = {}

    def blow_up(step):
        if step == 2:
            with torch.no_grad():
                blow.scale.fill_(2000.0)
            x, _ = _batch(step)
            with torch.no_grad():  # brute force: the input of exp, from a copy of the model
                twin = copy.deepcopy(model)
                reference["exp_input"] = twin[2].scale * twin[1](twin[0](x))

    with pytest.warns(RuntimeWarning, match="loss is nan"):
        losses = train(model, cockpit, 4, _batch, nn.CrossEntropyLoss(), blow_up)
    assert all(torch.isfinite(loss) for loss in losses[:2]) and torch.isnan(losses[2])
    assert list(cockpit.records) == [2]  # only the first bad step
    record = cockpit.records[2]
    assert record.data["trigger"] == "non-finite loss"
    origin = record.first_nonfinite
    assert origin["kind"] == "operation"
    assert origin["op"] == "aten.exp.default"
    assert origin["module"] == "2" and origin["module_type"] == "Exploding"
    assert origin["phase"] == "forward"
    (given,) = origin["inputs"]
    exp_input = reference["exp_input"]
    assert given["min"] == pytest.approx(exp_input.min().item(), rel=1e-12)
    assert given["max"] == pytest.approx(exp_input.max().item(), rel=1e-12)
    assert given["nonfinite"] == 0
    (produced,) = origin["outputs"]
    assert produced["nonfinite"] == int(torch.isinf(torch.exp(exp_input)).sum()) > 0
    assert produced["nan"] == 0
    # the finding, handed to the cockpit's findings
    (finding,) = [f for f in cockpit.findings if f.rule == "nonfinite-origin"]
    assert finding.severity == "error" and finding.step == 2 and finding.layer == "2"
    assert "aten.exp" in finding.message and "exp overflows" in finding.fix
    # the replay, alone in a fresh interpreter
    program = tmp_path / "step_2.py"
    text = program.read_text()
    imports = {line for line in text.splitlines() if line.startswith(("import ", "from "))}
    assert imports == {"import sys", "from pathlib import Path", "import torch", "from torch.utils._pytree import tree_leaves"}
    assert "class Exploding" not in text
    done = _run_program(program)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "first non-finite value: op %d: aten.exp.default" % origin["op_index"] in done.stdout
    assert "loss: nan (recorded nan)" in done.stdout


def test_log_of_zero_recorded_automatically(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), LogOfRelu(shift=0.0), nn.Linear(6, 3)).to(DTYPE)
    cockpit = Cockpit(model.parameters(), [], model=model)  # no quantity: the loss check alone
    x, y = _batch(0)
    loss = nn.functional.cross_entropy(model(x), y)
    assert not torch.isfinite(loss)
    with cockpit(0, info={"loss": loss, "loss_fn": lambda output: nn.functional.cross_entropy(output, y)}):
        loss.backward()
    record = cockpit.records[0]
    assert record.data["trigger"] == "non-finite loss"
    assert {"forward", "loss", "backward"} <= set(record.data["phases"])
    origin = record.first_nonfinite
    assert origin["op"] == "aten.log.default" and origin["module"] == "1" and origin["module_type"] == "LogOfRelu"
    with torch.no_grad():
        hidden = torch.relu(model[0](x))
    (given,) = origin["inputs"]
    assert given["min"] == 0.0 and given["max"] == pytest.approx(hidden.max().item(), rel=1e-12)
    assert origin["outputs"][0]["nonfinite"] == int((hidden == 0).sum()) > 0
    assert origin["outputs"][0]["nan"] == 0
    assert [f.rule for f in cockpit.findings] == ["nonfinite-origin"]
    namespace = runpy.run_path(str(record.save(tmp_path)["program"]))
    assert namespace["main"]() == 0
    assert namespace["FIRST"] == [origin["op_index"]]


def test_nonfinite_gradient_under_finite_loss(tmp_path):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 3), RowNorm(), nn.Linear(1, 2)).to(DTYPE)
    with torch.no_grad():
        model[0].weight[:] = 0.0
        model[0].bias[:] = 0.0  # every row of the first layer's output is 0: sqrt'(0) = inf
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    losses = train(model, cockpit, 1, lambda step: _batch(step, classes=2), nn.CrossEntropyLoss())
    assert torch.isfinite(losses[0])
    record = cockpit.records[0]
    assert record.data["trigger"] == "non-finite gradient"
    origin = record.first_nonfinite
    assert origin["phase"] == "backward" and origin["module"] == "1" and origin["module_type"] == "RowNorm"
    assert [f.layer for f in cockpit.findings] == ["1"]
    # the re-run's loss is the step's loss, and its replay reproduces it
    assert any("equals the step's loss" in note for note in record.notes)
    paths = record.save(tmp_path)
    namespace = runpy.run_path(str(paths["program"]))
    assert namespace["main"]() == 0


def test_automatic_recording_can_be_turned_off_and_happens_once():
    def fresh(**options):
        model = exploding_net()
        return model, Cockpit(model.parameters(), [], model=model, **options)

    def make_nan(step, model):
        if step >= 1:
            with torch.no_grad():
                model[2].scale.fill_(5000.0)

    model, cockpit = fresh(record_nonfinite=False)
    train(model, cockpit, 3, _batch, nn.CrossEntropyLoss(), lambda s: make_nan(s, model))
    assert cockpit.records == {} and cockpit.findings == []
    model, cockpit = fresh(record_nonfinite="tracked")  # no loss check on untracked steps
    cockpit.add(Loss(linear(2)))
    with pytest.warns(RuntimeWarning, match="loss is nan"):
        train(model, cockpit, 3, _batch, nn.CrossEntropyLoss(), lambda s: make_nan(s, model))
    assert list(cockpit.records) == [2]  # step 1 is not tracked
    with pytest.raises(ValueError, match="True, False or 'tracked'"):
        fresh(record_nonfinite="always")
    model, cockpit = fresh()
    train(model, cockpit, 3, _batch, nn.CrossEntropyLoss(), lambda s: make_nan(s, model), with_loss_fn=False)
    assert list(cockpit.records) == [1]
    record = cockpit.records[1]
    assert {op["phase"] for op in record.ops} == {"forward"}  # no loss_fn: the forward pass only
    assert any("info['loss_fn']" in note for note in record.notes)
    assert record.first_nonfinite["op"] == "aten.exp.default"


# ---- healthy steps: replay reproduces the loss -------------------------------------------------------
def _problem(name):
    if name in ("mlp", "cnn"):
        factory = make_mlp if name == "mlp" else make_cnn
        return factory(), (lambda step: make_batch(name, 6, step)), nn.CrossEntropyLoss()
    problem = getattr(zoo, name)()
    return problem.model, (lambda step: problem.batch(4, step)), lambda out, y: problem.sample_losses(out, y).mean()


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2", "encoder", "gru", "resnet_batchnorm_eval", "custom"])
def test_replay_reproduces_a_healthy_step(name, tmp_path):
    model, batch, lossfunc = _problem(name)
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    cockpit.record(1)
    twins = {}

    def keep_twin(step):
        if step == 1:
            twins["model"] = copy.deepcopy(model)

    losses = train(model, cockpit, 2, batch, lossfunc, keep_twin)
    record = cockpit.records[1]
    assert record.first_nonfinite is None and record.findings == []
    assert {"forward", "loss", "backward"} <= set(record.data["phases"])
    x, y = batch(1)
    with torch.no_grad():
        expected = lossfunc(twins["model"](x), y)  # brute force: the same step without any recorder
    assert torch.allclose(losses[1], expected, rtol=1e-13, atol=0)
    paths = record.save(tmp_path)
    namespace = runpy.run_path(str(paths["program"]))
    values = namespace["replay"]()
    replayed = values[namespace["DATA"]["loss"]]
    torch.testing.assert_close(replayed, expected, rtol=1e-12, atol=1e-14)
    assert namespace["main"]() == 0
    # the same replay as a torch.fx graph: (model outputs..., loss)
    graph_module, inputs = to_graph_module(record)
    replayed = graph_module(*inputs)
    torch.testing.assert_close(replayed[-1], expected, rtol=1e-12, atol=1e-14)
    with torch.no_grad():
        output = twins["model"](x)
    output = output.logits if hasattr(output, "logits") else output
    torch.testing.assert_close(replayed[0], output, rtol=1e-12, atol=1e-14)
    assert {node.meta.get("phase") for node in graph_module.graph.nodes} >= {"forward", "loss"}
    # module paths of the forward pass are the model's own
    names = {name for name, _ in model.named_modules()}
    assert {op["module"] for op in record.ops if op["phase"] == "forward"} <= names


def test_replay_of_dropout_uses_the_recorded_masks(tmp_path):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.ReLU(inplace=True), nn.Linear(16, 3)).to(DTYPE)
    cockpit = Cockpit(model.parameters(), [], model=model)
    cockpit.record(0)
    losses = train(model, cockpit, 1, _batch, nn.CrossEntropyLoss())
    record = cockpit.records[0]
    assert any(op.get("random") for op in record.ops)
    namespace = runpy.run_path(str(record.save(tmp_path)["program"]))
    torch.testing.assert_close(namespace["replay"]()[namespace["DATA"]["loss"]], losses[0], rtol=1e-13, atol=0)
    graph_module, inputs = to_graph_module(record)
    before = [t.clone() for t in inputs]
    for _ in range(2):  # in-place operations work on copies: the same result twice
        torch.testing.assert_close(graph_module(*inputs)[-1], losses[0], rtol=1e-13, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(before, inputs))


# ---- the record itself ------------------------------------------------------------------------------------
def test_record_of_an_untracked_step_names_modules_phases_and_values():
    model = make_mlp()
    cockpit = Cockpit(model.parameters(), [Loss(linear(5, offset=3))], model=model)  # step 1 not tracked
    cockpit.record(1)
    train(model, cockpit, 2, lambda step: make_batch("mlp", 6, step), nn.CrossEntropyLoss())
    record = cockpit.records[1]
    forward = [op for op in record.ops if op["phase"] == "forward"]
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert [op["module"] for op in forward if op["op"] == "aten.addmm.default"] == linears
    assert [op["module"] for op in forward if op["op"] == "aten.tanh.default"] == ["2"]
    # sources of the external values: the parameters by name and the batch
    sources = {record.value(v)["source"] for op in forward for v in op["inputs"] if record.value(v)["op"] is None}
    assert {f"parameter '{name}'" for name, _ in model.named_parameters()} | {"input"} == sources
    # summary values against a plain forward pass at the recorded parameters
    (out_id,) = record.data["outputs"]["output"]
    x, _ = make_batch("mlp", 6, 1)
    params = {name: record.tensors[v] for v, name in _param_ids(record).items()}
    with torch.no_grad():
        plain = torch.func.functional_call(model, params, (x,))
    assert record.value(out_id)["min"] == pytest.approx(plain.min().item(), rel=1e-13)
    assert record.value(out_id)["max"] == pytest.approx(plain.max().item(), rel=1e-13)
    # the backward pass: the weight gradients' matrix products come from the linear layers
    backward = [op for op in record.ops if op["phase"] == "backward" and op["op"] == "aten.mm.default"]
    assert backward and {op["module"] for op in backward} <= set(linears)
    by_node = {}
    for op in record.ops:
        if op["phase"] == "backward":
            by_node.setdefault(op["node"], set()).add(op["module"])
    assert by_node["TanhBackward0"] == {"2"} and by_node["SigmoidBackward0"] == {"4"}
    assert by_node["NllLossBackward0"] == {"<CrossEntropyLoss>"}
    assert record.notes[0] == CONTROL_FLOW_NOTE
    json.dumps(record.to_dict())  # JSON-ready (non-finite floats: through the log's encoder)


def _param_ids(record):
    return {
        int(v): info["source"].split("'")[1]
        for v, info in record.data["values"].items()
        if (info.get("source") or "").startswith("parameter")
    }


def test_cockpit_internal_work_is_not_recorded():
    """A tracked step with per-sample statistics records the same operations as an untracked one."""

    def ops_of(quantities):
        model = make_mlp()
        cockpit = Cockpit(model.parameters(), quantities, model=model)
        cockpit.record(0)
        train(model, cockpit, 1, lambda step: make_batch("mlp", 6, step), nn.CrossEntropyLoss())
        return [(op["op"], op["phase"], op["module"]) for op in cockpit.records[0].ops]

    plain = ops_of([])
    tracked = ops_of([GradNorm(linear(1)), NormTest(linear(1)), GradHist1d(linear(1))])
    assert tracked == plain


def test_backpack_extensions_are_not_recorded():
    """BackPACK's extensions (curvature, per-sample gradients) run inside the backward pass but are the cockpit's."""
    from cockpit_like.quantities import HessTrace
    from tests.helpers import make_problem

    def backward_ops(quantities):
        model, lossfunc, _ = make_problem("mlp")
        cockpit = Cockpit(model.parameters(), quantities, model=model)
        cockpit.record(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # PyTorch on full backward hooks without input grads
            train(model, cockpit, 3, lambda step: make_batch("mlp", 6, step), lossfunc)
        return [(op["op"], op["module"]) for op in cockpit.records[2].ops if op["phase"] == "backward"]

    assert backward_ops([HessTrace(linear(1)), GradHist1d(linear(1))]) == backward_ops([])


class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_data_dependent_control_flow_is_noted():
    torch.manual_seed(4)
    model = Branching().to(DTYPE)
    cockpit = Cockpit(model.parameters(), [], model=model)
    cockpit.record(0)
    x = torch.ones(5, 4, dtype=DTYPE)
    loss = model(x).pow(2).mean()
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    record = cockpit.records[0]
    assert any("Data-dependent control flow" in note and "_local_scalar_dense" in note for note in record.notes)
    assert "a" in {op["module"] for op in record.ops} and "b" not in {op["module"] for op in record.ops}


def test_record_in_the_log_and_from_files(tmp_path):
    model = exploding_net()
    cockpit = Cockpit(model.parameters(), [Loss(linear(1))], model=model, stream_to=tmp_path / "run")
    cockpit.record(0)

    def explode(step):
        with torch.no_grad():
            model[2].scale.fill_(3000.0)

    with pytest.warns(RuntimeWarning):
        train(model, cockpit, 1, _batch, nn.CrossEntropyLoss(), explode)
    cockpit.write(tmp_path / "run")
    for log in (read_log(tmp_path / "run.json"), read_log(tmp_path / "run.jsonl")):
        stored = log[0]["record"]
        assert stored["first_nonfinite"]["op"] == "aten.exp.default"
        assert [f["rule"] for f in log[0]["findings"]] == ["nonfinite-origin"]
    from cockpit_like.cli import main as cli
    from cockpit_like.cli import summarize

    assert cli(["diagnose", str(tmp_path / "run.json")]) == 1  # the nonfinite-origin error
    assert summarize(stored).endswith("(on demand), first non-finite: aten.exp.default in '2'")
    paths = cockpit.records[0].save(tmp_path / "files")
    loaded = read_record(paths["record"])
    assert loaded.first_nonfinite == cockpit.records[0].first_nonfinite
    export_program(loaded, tmp_path / "again")  # from the files alone
    assert runpy.run_path(str(tmp_path / "again" / "step_0.py"))["main"]() == 0


def test_bad_arguments():
    model = make_mlp()
    cockpit = Cockpit(model.parameters(), [], model=model)
    train(model, cockpit, 2, lambda step: make_batch("mlp", 6, step), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="already begun or passed"):
        cockpit.record(1)
    with pytest.raises(ValueError, match="non-negative int"):
        cockpit.record("3")
    record = read_record_without_tensors(model)
    with pytest.raises(NotReplayableError, match="no tensors"):
        export_program(record, "/nonexistent")


def read_record_without_tensors(model):
    cockpit = Cockpit(model.parameters(), [], model=model)
    cockpit.record(0)
    train(model, cockpit, 1, lambda step: make_batch("mlp", 6, step), nn.CrossEntropyLoss())
    record = cockpit.records[0]
    record.tensors = {}
    return record


def test_gradients_finite_against_entrywise_check():
    from cockpit_like.diagnosis.recorder.control import gradients_finite

    def params_with(*grads):
        params = []
        for grad in grads:
            param = torch.zeros_like(grad, requires_grad=True)
            param.grad = grad
            params.append(param)
        return params

    huge = torch.full((4,), torch.finfo(torch.float32).max)  # finite entries whose sum overflows
    cases = [
        params_with(torch.randn(3, 2), torch.randn(5)),
        params_with(huge, huge.clone()),
        params_with(torch.randn(3), torch.tensor([1.0, float("nan")])),
        params_with(torch.tensor([float("inf"), -float("inf")], dtype=DTYPE), torch.randn(2, dtype=DTYPE)),
        params_with(torch.randn(2, dtype=torch.float16)),
        [],
    ]
    for params in cases:
        entrywise = all(bool(torch.isfinite(p.grad).all()) for p in params)
        assert gradients_finite(params) == entrywise


def test_model_found_at_its_first_forward_pass_is_recorded():
    model = make_mlp()
    cockpit = Cockpit(model.parameters(), [])  # no model=: the tracer finds it at the first forward pass
    cockpit.record(0)
    train(model, cockpit, 1, lambda step: make_batch("mlp", 6, step), nn.CrossEntropyLoss())
    forward = [op for op in cockpit.records[0].ops if op["phase"] == "forward"]
    assert [op["module"] for op in forward if op["op"] == "aten.addmm.default"] == ["1", "3", "5"]


def test_too_many_operations_are_counted_and_not_replayed(tmp_path):
    model = make_mlp()
    cockpit = Cockpit(model.parameters(), [], model=model)
    cockpit._recorder.max_ops = 5
    cockpit.record(0)
    train(model, cockpit, 1, lambda step: make_batch("mlp", 6, step), nn.CrossEntropyLoss())
    record = cockpit.records[0]
    assert len(record.ops) == 5 and record.data["dropped_ops"] > 0
    assert any("max_ops=5" in note for note in record.notes)
    with pytest.raises(NotReplayableError, match="incomplete"):
        export_program(record, tmp_path)


def test_record_without_a_model_warns():
    weight = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)  # no nn.Module: nothing to trace
    cockpit = Cockpit([weight], [])
    cockpit.record(0)
    loss = (torch.randn(5, 4, dtype=DTYPE) @ weight.T).pow(2).mean()
    with pytest.warns(RuntimeWarning, match="has not seen the model"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    assert cockpit.records == {}


def test_a_nonfinite_parameter_is_named_as_the_source():
    model = make_mlp()
    with torch.no_grad():
        model[3].weight[2, 5] = float("nan")  # left by an earlier step
    called = []
    cockpit = Cockpit(model.parameters(), [], model=model, on_finding=called.append)
    cockpit.record(0)
    train(model, cockpit, 1, lambda step: make_batch("mlp", 6, step), nn.CrossEntropyLoss())
    assert [f.rule for f in called] == ["nonfinite-origin"]  # the cockpit's on_finding callback
    origin = cockpit.records[0].first_nonfinite
    assert origin["kind"] == "input" and origin["module"] == "3"
    assert "parameter '3.weight'" in origin["message"]
    assert [v["nan"] for v in origin["inputs"] if v.get("source") == "parameter '3.weight'"] == [1]
    (finding,) = cockpit.findings
    assert "earlier step" in finding.fix


def test_armed_after_the_forward_pass_records_the_backward_pass_with_a_note():
    model = make_mlp()
    cockpit = Cockpit(model.parameters(), [], model=model)
    x, y = make_batch("mlp", 6, 0)
    loss = nn.functional.cross_entropy(model(x), y)
    cockpit.record(0)  # too late for the forward pass
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    record = cockpit.records[0]
    assert "forward" not in {op["phase"] for op in record.ops}
    assert "backward" in {op["phase"] for op in record.ops}
    assert any("forward pass of step 0 was not recorded" in note for note in record.notes)
    # without the forward pass, backward operations have no forward operation to name their module
    assert all("forward_op" not in op for op in record.ops)


def test_a_failing_loss_fn_does_not_stop_training():
    model = exploding_net()
    cockpit = Cockpit(model.parameters(), [], model=model)
    with torch.no_grad():
        model[2].scale.fill_(5000.0)
    x, y = _batch(0)
    loss = nn.functional.cross_entropy(model(x), y)

    def broken(output):
        raise KeyError("targets")

    with pytest.warns(RuntimeWarning, match="failed in info\\['loss_fn'\\]"):
        with cockpit(0, info={"loss": loss, "loss_fn": broken}):
            loss.backward()
    record = cockpit.records[0]
    assert any("KeyError" in note for note in record.notes)
    assert record.first_nonfinite["op"] == "aten.exp.default"  # the forward pass is there
    # a loss_fn that is not a function is an error at any step, not only at a bad one
    model = make_mlp()
    cockpit = Cockpit(model.parameters(), [], model=model)
    x, y = make_batch("mlp", 6, 0)
    loss = nn.functional.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match="must be a function of the model's output"):
        with cockpit(0, info={"loss": loss, "loss_fn": "cross_entropy"}):
            loss.backward()


def test_loss_item_in_the_training_loop_is_not_control_flow():
    model = make_mlp()
    cockpit = Cockpit(model.parameters(), [], model=model)
    cockpit.record(0)
    x, y = make_batch("mlp", 6, 0)
    loss = nn.functional.cross_entropy(model(x), y)
    assert loss.item() > 0  # logging between the forward pass and the cockpit: recorded, not a branch of the model
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    record = cockpit.records[0]
    assert "aten._local_scalar_dense.default" in {op["op"] for op in record.ops if op["phase"] == "loss"}
    assert not any("Data-dependent" in note for note in record.notes)


def test_the_example_run_finds_the_overflowing_cosh(tmp_path):
    from tests.test_examples import load

    result = load("nan_origin").main(["--out", str(tmp_path), "--no-replay", "--steps", "60"])
    origin = result["record"].first_nonfinite
    assert origin["op"] == "aten.cosh.default" and origin["module_type"] == "NaiveLogCosh"
    assert origin["inputs"][0]["max"] > 89.0  # cosh(89.5) > float32's largest number
    namespace = runpy.run_path(result["program"])
    assert namespace["main"]() == 0


# ---- issue 36: intended infinities, torch.compile names -----------------------------------------------
class MaskedScores(nn.Module):
    """Attention-like scores over 4 positions, masked where ``mask`` is true, then a softmax: a row
    whose every position is masked is all -inf, and the softmax makes NaN of it (0 / 0)."""

    def __init__(self, additive: bool):
        super().__init__()
        self.additive = additive
        self.mask = torch.zeros(5, 4, dtype=torch.bool)

    def forward(self, x):
        if self.additive:  # the caller's additive mask: 0 where allowed, -inf where masked
            bias = torch.zeros(self.mask.shape, dtype=x.dtype).masked_fill(self.mask, -math.inf)
            return torch.softmax(x + bias, dim=-1)
        return torch.softmax(x.masked_fill(self.mask, -math.inf), dim=-1)


@pytest.mark.parametrize("additive", [False, True])
def test_a_fully_masked_row_blames_the_softmax_not_the_mask(tmp_path, additive):
    torch.manual_seed(0)
    scores = MaskedScores(additive)
    model = nn.Sequential(nn.Linear(4, 4), scores, nn.Linear(4, 3)).to(DTYPE)
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model, record_dir=tmp_path)

    def mask_a_row(step):
        scores.mask = torch.zeros(5, 4, dtype=torch.bool)
        if step == 1:
            scores.mask[2] = True  # every position of row 2 masked

    with pytest.warns(RuntimeWarning, match="loss is nan"):
        train(model, cockpit, 2, _batch, nn.CrossEntropyLoss(), mask_a_row)
    origin = cockpit.records[1].first_nonfinite
    assert origin["kind"] == "operation" and "softmax" in origin["op"] and origin["module"] == "1"
    assert origin["outputs"][0]["nan"] > 0
    assert "intended infinity" in origin["message"]


def test_module_names_under_torch_compile_are_the_users():
    from cockpit_like.diagnosis.recorder.tape import user_name

    assert user_name("_orig_mod.0") == "0" and user_name("_orig_mod.block._orig_mod.fc") == "block.fc"
    assert user_name("encoder.layer.1") == "encoder.layer.1" and user_name("_orig_mod") == "_orig_mod"


# ---- masks made inside the forward pass by writing into a tensor -----------------------------------------
class PaddedScores(nn.Module):
    """``MaskedScores`` with a padding mask built inside forward (the last of 4 positions masked in every
    row), written in one of several ways; ``self.mask`` masks whole rows (a fully masked row: NaN)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.mask = torch.zeros(5, 4, dtype=torch.bool)

    def forward(self, x):
        pad = torch.zeros(5, 4, dtype=x.dtype)
        if self.how == "slice_assign":  # aten.lift_fresh of the number, then fill_ of a slice view of pad
            pad[:, 3:] = float("-inf")
        elif self.how == "fill_view":  # fill_ of a slice view, a Python number
            pad[:, 3:].fill_(float("-inf"))
        elif self.how == "copy_slice":  # copy_ into a slice view
            pad[:, 3:] = torch.full((5, 1), float("-inf"), dtype=x.dtype)
        elif self.how == "index_put":  # index_put_ on pad itself, a lifted scalar tensor
            pad.index_put_((torch.arange(5), torch.full((5,), 3)), torch.tensor(float("-inf"), dtype=x.dtype))
        elif self.how == "tensor_constant":  # torch.tensor(...) made in forward
            pad = pad + torch.tensor([0.0, 0.0, 0.0, float("-inf")], dtype=x.dtype)
        return torch.softmax((x + pad).masked_fill(self.mask, -math.inf), dim=-1)


def _padded_net(how):
    torch.manual_seed(0)
    scores = PaddedScores(how)
    return nn.Sequential(nn.Linear(4, 4), scores, nn.Linear(4, 3)).to(DTYPE), scores


def _mask_row_2_at_step_1(scores):
    def mask_a_row(step):
        scores.mask = torch.zeros(5, 4, dtype=torch.bool)
        if step == 1:
            scores.mask[2] = True  # every position of row 2 masked

    return mask_a_row


#: per way of writing the padding mask: the operation that writes the -inf into pad
_WRITERS = {
    "slice_assign": "aten.fill_.Tensor",
    "fill_view": "aten.fill_.Scalar",
    "copy_slice": "aten.copy_.default",
    "index_put": "aten.index_put_.default",
    "tensor_constant": "aten.lift_fresh.default",
}


@pytest.mark.parametrize("how", sorted(_WRITERS))
def test_a_mask_written_inside_forward_is_intended_and_the_softmax_is_the_origin(tmp_path, how):
    model, scores = _padded_net(how)
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model, record_dir=tmp_path)
    with pytest.warns(RuntimeWarning, match="loss is nan"):
        train(model, cockpit, 2, _batch, nn.CrossEntropyLoss(), _mask_row_2_at_step_1(scores))
    record = cockpit.records[1]
    origin = record.first_nonfinite
    assert (origin["kind"], origin["op"], origin["module"], origin["phase"]) == (
        "operation", "aten._softmax.default", "1", "forward")
    assert origin["outputs"][0]["nan"] == 4  # row 2: 0/0 at its 4 positions
    assert "intended infinity" in origin["message"] and "the step received it" not in origin["message"]
    (finding,) = record.findings
    assert "keep one position unmasked" in finding.fix and "check the batch" not in finding.fix

    forward = [op for op in record.ops if op["phase"] == "forward"]
    (writer,) = [op for op in forward if op["op"] == _WRITERS[how]]
    add = next(op for op in forward if op["op"] == "aten.add.Tensor" and op["index"] > writer["index"])
    padded = [v for v in add["inputs"] if record.value(v)["nonfinite"]]
    assert len(padded) == 1  # pad as add read it: its last column -inf (5 entries; the constant: 1), no NaN
    assert (record.value(padded[0])["nonfinite"], record.value(padded[0])["nan"]) == (1 if how == "tensor_constant" else 5, 0)
    intended = set(record.to_dict()["intended_infinities"])
    assert set(writer["outputs"]) <= intended and padded[0] in intended and set(add["outputs"]) <= intended
    assert all(record.value(v)["nan"] == 0 for v in intended)
    assert not any(record.value(v).get("source") == "input" for v in intended)
    if how in ("slice_assign", "fill_view", "copy_slice"):  # pad, read again after a write into its slice
        (zeros,) = [op for op in forward if op["op"] == "aten.zeros.default" and op["module"] == "1"]
        assert record.value(padded[0])["written_by"] == writer["index"]
        assert record.value(padded[0])["alias_of"] == zeros["outputs"][0]  # the id pad had before the write
    if how in ("slice_assign", "index_put", "tensor_constant"):  # the constant -inf of the code
        (lift,) = [op for op in forward if op["op"] == "aten.lift_fresh.default" and record.value(op["outputs"][0])["nonfinite"]]
        assert record.value(lift["inputs"][0])["source"] == "constant"

    # the replay program and the FX graph compute the same values: the same origin, the same NaN loss
    done = _run_program(tmp_path / "step_1.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"first non-finite value: op {origin['op_index']}: aten._softmax.default" in done.stdout
    graph_module, inputs = to_graph_module(record)
    replayed = graph_module(*inputs)
    assert torch.isnan(replayed[-1]) and torch.isnan(replayed[0][2]).all() and torch.isfinite(replayed[0][[0, 1, 3, 4]]).all()


def test_a_nan_in_the_batch_is_still_the_input_with_masks_written_inside_forward():
    model, scores = _padded_net("slice_assign")
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)

    def batch(step):
        x, y = _batch(step)
        if step == 1:
            x[4, 1] = float("nan")  # the data, not the model's code
        return x, y

    with pytest.warns(RuntimeWarning, match="loss is nan"):
        train(model, cockpit, 2, batch, nn.CrossEntropyLoss())
    origin = cockpit.records[1].first_nonfinite
    assert (origin["kind"], origin["op"], origin["module"]) == ("input", "aten.addmm.default", "0")
    assert "the value input (v" in origin["message"] and "the step received it" in origin["message"]
    (given,) = [v for v in origin["inputs"] if v.get("nonfinite")]
    assert (given["source"], given["nan"], given["shape"]) == ("input", 1, [5, 4])
    assert cockpit.records[1].to_dict()["intended_infinities"] == []
    (finding,) = cockpit.records[1].findings
    assert "check the batch" in finding.fix


def test_a_nan_constant_of_the_code_is_an_operation_not_an_input(tmp_path):
    class NanBias(nn.Module):
        def forward(self, x):
            return x + torch.tensor([0.0, float("nan"), 0.0], dtype=x.dtype)  # a typo'd mask: NaN, not -inf

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), NanBias()).to(DTYPE)
    cockpit = Cockpit(model.parameters(), [], model=model)  # no quantity: the loss check alone
    x, y = _batch(0)
    loss = nn.functional.cross_entropy(model(x), y)
    assert torch.isnan(loss)
    with cockpit(0, info={"loss": loss, "loss_fn": lambda output: nn.functional.cross_entropy(output, y)}):
        loss.backward()
    record = cockpit.records[0]
    origin = record.first_nonfinite
    assert (origin["kind"], origin["op"], origin["module"]) == ("operation", "aten.lift_fresh.default", "1")
    assert "a constant that the code of the step made and that holds NaN" in origin["message"]
    assert "received" not in origin["message"]
    (finding,) = record.findings
    assert "constant in the model's code holds NaN" in finding.fix
    namespace = runpy.run_path(str(record.save(tmp_path)["program"]))
    assert namespace["main"]() == 0 and namespace["FIRST"] == [origin["op_index"]]
