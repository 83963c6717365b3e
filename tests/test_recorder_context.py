"""The recorder keeps the step's context (issue 36, item 6): the automatic re-run runs under the step's
``torch.autocast``, covers every micro-batch of an accumulated step, and a step that the GradScaler
skipped gets no finding.

Expected values are computed here by hand: the half-precision forward pass of the layer that overflows
(and its float32 twin, which does not), the rows made zero on purpose, the scaler's own decision
(``scaler.get_scale()`` dropping).
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.conv_unfold import conv2d_weight_grad_batch
from cockpit_like.diagnosis.recorder.control import autocast_state, under_autocast
from cockpit_like.quantities import GradNorm
from cockpit_like.utils.schedules import linear
from cockpit_like.utils.configuration import configuration


class Square(nn.Module):
    """``(scale * x) ** 2 / scale**2``: equal to ``x**2``, until ``(scale * x) ** 2`` overflows float16."""

    def __init__(self, scale: float = 100.0):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return (x * self.scale) ** 2 / self.scale**2


class NaiveNorm(nn.Module):
    """Normalises each row with ``var = mean(x²) - mean(x)²``: in bfloat16 the difference of two large,
    nearly equal numbers is 0 for rows far from zero, and the division makes inf/NaN."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / var.sqrt()


class RowNorm(nn.Module):
    """``sqrt(sum(x**2))`` per row: finite at a zero row, its gradient there is NaN."""

    def forward(self, x):
        return x.pow(2).sum(-1, keepdim=True).sqrt()


def _batch(step: int, rows: int = 6, scale: float = 1.0):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(rows, 4, generator=generator) * scale, torch.randint(0, 3, (rows,), generator=generator)


def _square_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Square(), nn.Linear(8, 3))


def _train_autocast(model, cockpit, dtype, steps, scale_at=None, scaler=None, declare_scaler=True):
    """The loop as docs/your_training_loop.md shows it: the forward pass and the loss inside
    ``torch.autocast``, the cockpit's block outside it around the backward pass."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses, scales = [], []
    for step in range(steps):
        x, y = _batch(step, scale=30.0 if step == scale_at else 1.0)
        with torch.autocast("cpu", dtype=dtype):
            losses_per = nn.functional.cross_entropy(model(x), y, reduction="none")
            loss = losses_per.mean()
        info = {"loss": loss, "batch_size": len(y), "individual_losses": losses_per,
                "loss_fn": lambda output, y=y: nn.functional.cross_entropy(output, y)}
        if scaler is not None and declare_scaler:
            info["grad_scaler"] = scaler
        with cockpit(step, info=info):
            (loss if scaler is None else scaler.scale(loss)).backward()
        losses.append(loss.detach().float())
        if scaler is None:
            optimizer.step()
        else:
            scales.append(scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
    return losses, scales


# ---- the re-run under the step's autocast ------------------------------------------------------------
def test_autocast_state_is_read_and_set_back():
    assert autocast_state() == []
    with torch.autocast("cpu", dtype=torch.float16):
        state = autocast_state()
        assert state == [{"device_type": "cpu", "dtype": "float16"}]
        with under_autocast([]):  # a re-run of a forward pass that ran without autocast, from inside one
            assert not torch.is_autocast_enabled("cpu")
    with under_autocast(state):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert not torch.is_autocast_enabled("cpu")


def test_float16_overflow_under_autocast_is_reproduced_and_named(tmp_path):
    model = _square_net()
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model, record_dir=tmp_path)
    x, _ = _batch(1, scale=30.0)
    with torch.no_grad():  # by hand: the layer's input in float16, and the same product in float16 and float32
        hidden = torch.nn.functional.linear(x.half(), model[0].weight.half(), model[0].bias.half())
        in_half = torch.isinf((hidden * 100.0) ** 2)
        in_float = torch.isinf((hidden.float() * 100.0) ** 2)
    assert in_half.any() and not in_float.any()  # the overflow exists only in reduced precision
    with pytest.warns(RuntimeWarning, match="loss is nan"):
        losses, _ = _train_autocast(model, cockpit, torch.float16, 3, scale_at=1)
    assert torch.isfinite(losses[0]) and not torch.isfinite(losses[1])
    assert list(cockpit.records) == [1]
    record = cockpit.records[1]
    assert record.data["autocast"] == [{"device_type": "cpu", "dtype": "float16"}]
    origin = record.first_nonfinite
    assert origin["kind"] == "operation" and origin["phase"] == "forward"
    assert origin["module"] == "1" and origin["module_type"] == "Square"
    assert origin["op"] == "aten.pow.Tensor_Scalar"
    (produced,) = origin["outputs"]
    assert produced["dtype"] == "float16" and produced["nan"] == 0
    assert produced["nonfinite"] == int(in_half.sum())
    (finding,) = [f for f in cockpit.findings if f.rule == "nonfinite-origin"]
    assert finding.step == 1 and finding.layer == "1" and "float16 overflows" in finding.fix
    assert finding.evidence["autocast"] == [{"device_type": "cpu", "dtype": "float16"}]
    # the replay program replays the casts autocast made, without autocast
    program = tmp_path / "step_1.py"
    done = subprocess.run([sys.executable, "-I", str(program)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"first non-finite value: op {origin['op_index']}: aten.pow.Tensor_Scalar" in done.stdout


def test_bfloat16_cancellation_under_autocast_is_named():
    torch.manual_seed(0)
    first = nn.Linear(4, 8)
    with torch.no_grad():
        first.bias += 100.0  # rows far from zero: mean(x²) - mean(x)² cancels in bfloat16
    model = nn.Sequential(first, NaiveNorm(), nn.Linear(8, 3))
    x, y = _batch(0)
    x = x * 0.05
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()  # in float32 the step is finite
    cockpit = Cockpit(model.parameters(), [], model=model)  # no quantity: the loss check alone
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    assert not torch.isfinite(loss)
    with cockpit(0, info={"loss": loss, "loss_fn": lambda output: nn.functional.cross_entropy(output, y)}):
        loss.backward()
    origin = cockpit.records[0].first_nonfinite
    assert origin["module"] == "1" and origin["module_type"] == "NaiveNorm" and origin["phase"] == "forward"
    assert origin["op"] == "aten.div.Tensor" and origin["outputs"][0]["dtype"] == "bfloat16"
    assert cockpit.records[0].data["autocast"] == [{"device_type": "cpu", "dtype": "bfloat16"}]


def test_a_rerun_inside_the_callers_autocast_runs_as_the_forward_pass_did():
    """The cockpit's block inside ``torch.autocast`` while the forward pass ran outside it: the re-run
    is in float32, like the step (the overflow is in float32: exp of a large input)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    x, y = _batch(0, scale=1e3)

    def lossfunc(output):
        return torch.exp(output).mean()  # overflows float32 at inputs above ~88

    cockpit = Cockpit(model.parameters(), [], model=model)
    loss = lossfunc(model(x))
    assert not torch.isfinite(loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with cockpit(0, info={"loss": loss, "loss_fn": lossfunc}):
            loss.backward()
    record = cockpit.records[0]
    assert record.data["autocast"] == []
    forward = {op["index"] for op in record.ops if op["phase"] in ("forward", "loss")}
    assert {v["dtype"] for v in record.data["values"].values() if v.get("op") in forward} == {"float32"}
    assert record.first_nonfinite["op"] == "aten.exp.default"


# ---- every micro-batch -----------------------------------------------------------------------------
def _train_accumulated(model, cockpit, bad_step, bad_micro, micros=2, steps=2, declared=True):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(micros):
            x, y = _batch(10 * step + micro)
            if (step, micro) == (bad_step, bad_micro):
                x[2] = 0.0  # a zero row: RowNorm's output is finite, its gradient is not
            loss = nn.functional.cross_entropy(model(x), y) / micros
            info = {"loss": loss, "batch_size": len(y), "optimizer": optimizer,
                    "loss_fn": lambda output, y=y: nn.functional.cross_entropy(output, y) / micros}
            if declared:
                info["micro_batches"] = micros
            with cockpit(step, info=info):
                loss.backward()
        optimizer.step()


def _rownorm_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3, bias=False), RowNorm(), nn.Linear(1, 3))


@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize("bad_micro,micros", [(0, 2), (1, 2), (1, 3)])
def test_a_nan_made_in_the_backward_pass_of_any_micro_batch_is_found(declared, bad_micro, micros):
    model = _rownorm_net()
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_accumulated(model, cockpit, 1, bad_micro, micros, declared=declared)
    assert list(cockpit.records) == [1]
    record = cockpit.records[1]
    assert record.data["trigger"] == "non-finite gradient"
    assert record.data["micro_batch"] == bad_micro
    assert record.data["micro_batches"] == (micros if declared else None)
    origin = record.first_nonfinite
    assert origin["phase"] == "backward" and origin["module"] == "1" and origin["module_type"] == "RowNorm"
    assert origin["outputs"][0]["nonfinite"] == 1  # the one zero row
    (finding,) = [f for f in cockpit.findings if f.rule == "nonfinite-origin"]
    assert f"micro-batch {bad_micro}" in finding.message and finding.evidence["micro_batch"] == bad_micro
    if declared:
        assert f"micro-batch {bad_micro} of {micros}" in finding.message
    if bad_micro > 0 and declared:
        assert any("re-ran finite" in note for note in record.notes)


def test_a_nonfinite_loss_in_micro_batch_0_is_recorded_there(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model, record_dir=tmp_path)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for micro in range(2):
        x, y = _batch(micro)
        if micro == 0:
            x[1] = float("nan")  # a NaN in the batch of micro-batch 0
        loss = nn.functional.cross_entropy(model(x), y) / 2
        info = {"loss": loss, "batch_size": len(y), "micro_batches": 2, "optimizer": optimizer,
                "loss_fn": lambda output, y=y: nn.functional.cross_entropy(output, y) / 2}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(0, info=info):
                loss.backward()
    record = cockpit.records[0]
    assert record.data["micro_batch"] == 0 and record.data["micro_batches"] == 2
    assert record.first_nonfinite["kind"] == "input" and record.first_nonfinite["module"] == "0"
    namespace = runpy.run_path(str(tmp_path / "step_0.py"))
    assert namespace["main"]() == 0


@pytest.mark.parametrize("declared", [False, True])
def test_a_single_backward_pass_waiting_for_the_optimizer_is_no_micro_batch(declared):
    """Alpha waits for the optimizer's step (clip_grad_value_ changed the gradients at step 0), so the cockpit leaves
    step 2 open until SGD.step(): before, the recorder took that for undeclared micro-batches and its record and
    finding read "step 2, micro-batch 0" and "Step 2 has several backward passes". One backward pass is none (as
    without info["optimizer"]); ``declared``: info["micro_batches"] = 1 says the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    cockpit = Cockpit(model.parameters(), configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        if step == 2:
            x[1] = float("nan")
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        info = {"loss": losses.mean(), "batch_size": len(y), "individual_losses": losses, "optimizer": optimizer}
        if declared:
            info["micro_batches"] = 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info=info):
                info["loss"].backward()
        if step == 0:
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        optimizer.step()
    assert "Alpha waits" in " ".join(cockpit.checks[0]["notes"])  # step 2 waited for the optimizer's step
    record = cockpit.records[2]
    assert record.data["micro_batch"] is None and record.data["micro_batches"] is None
    assert not [note for note in record.notes if "micro-batch" in note]
    (finding,) = [f for f in cockpit.findings if f.rule == "nonfinite-origin"]
    assert finding.message.startswith("step 2: ") and "micro-batch" not in finding.message


# ---- a step the GradScaler skipped ------------------------------------------------------------------
@pytest.mark.parametrize("declare_scaler", [True, False])
def test_a_step_the_grad_scaler_skipped_gets_no_record_and_no_finding(declare_scaler):
    model = _square_net()
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, scales = _train_autocast(model, cockpit, torch.float16, 4, scale_at=1, scaler=scaler,
                                         declare_scaler=declare_scaler)  # fmt: skip
    assert not torch.isfinite(losses[1])
    assert scaler.get_scale() < scales[1]  # the scaler skipped step 1 (its scale dropped)
    assert cockpit.records == {}
    assert [f for f in cockpit.findings if f.rule == "nonfinite-origin"] == []
    assert 1 in cockpit.skipped_steps
    # the same run without the scaler: the step is recorded (the test can fail)
    model = _square_net()
    control = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_autocast(model, control, torch.float16, 4, scale_at=1)
    assert list(control.records) == [1]


def test_a_scaled_backward_pass_that_overflows_is_skipped_not_recorded():
    """The scale is too large: the scaled gradients overflow float16 while the loss is finite (the
    scaler's normal first steps). With learned accumulation (step 0) the cockpit checks the gradients
    after each backward pass: the scaler's skips from step 1 on are still no finding."""
    model = _square_net()
    cockpit = Cockpit(model.parameters(), configuration("economy"), model=model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            for micro in range(2):  # undeclared accumulation: learned at step 0
                x, y = _batch(10 * step + micro)
                with torch.autocast("cpu", dtype=torch.float16):
                    per = nn.functional.cross_entropy(model(x), y, reduction="none")
                    loss = per.mean() / 2
                info = {"loss": loss, "batch_size": len(y), "individual_losses": per / 2, "optimizer": optimizer}
                with cockpit(step, info=info):
                    scaler.scale(loss).backward()
                assert torch.isfinite(loss)
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if scaler.get_scale() < before:
                skipped.append(step)
            if step == 0:
                scaler.update(2.0**60)  # too large for float16 from now on
    assert skipped == [1, 2]  # the scale was too large for float16
    assert cockpit.records == {} and [f for f in cockpit.findings if f.rule == "nonfinite-origin"] == []


def test_an_on_demand_record_of_a_skipped_step_says_so_without_a_finding():
    model = _square_net()
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    cockpit.record(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train_autocast(model, cockpit, torch.float16, 3, scale_at=1, scaler=torch.amp.GradScaler("cpu"))
    record = cockpit.records[1]
    assert record.data["skipped"] == {"reason": "grad_scaler"} and record.findings == []
    assert record.first_nonfinite["op"] == "aten.pow.Tensor_Scalar"  # still there to read
    assert [f for f in cockpit.findings if f.rule == "nonfinite-origin"] == []


# ---- the per-sample gradients of a convolution under autocast --------------------------------------------
def test_conv_per_sample_weight_gradient_with_a_float16_output_gradient():
    """Under autocast a Conv2d's input is float32 and its output gradient float16 (this raised a dtype
    error in every tracked step of a CNN): the per-sample gradient is computed in float32."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(4, 2, 5, 5)
    delta = torch.randn(4, 3, 5, 5).half()
    got = conv2d_weight_grad_batch(conv, x, delta)
    assert got.dtype == torch.float32
    for sample in range(4):  # brute force: autograd of one sample's output against the weight, float64
        weight = conv.weight.detach().double().requires_grad_()
        out = nn.functional.conv2d(x[sample : sample + 1].double(), weight, padding=1)
        (expected,) = torch.autograd.grad(out, weight, delta[sample : sample + 1].double())
        torch.testing.assert_close(got[sample].double(), expected, rtol=1e-5, atol=1e-5)


def test_a_cnn_under_float16_autocast_is_tracked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (1, 2, 2)), nn.Conv2d(1, 4, 2), nn.Flatten(), nn.Linear(4, 3))
    cockpit = Cockpit(model.parameters(), configuration("economy"), model=model)
    _train_autocast(model, cockpit, torch.float16, 2)
    assert all(torch.isfinite(torch.tensor(v)) for v in cockpit.get_output()[0]["GradNorm"])


# ---- the replay program of a step with a mask and a dropout layer -------------------------------------
class MaskedRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = torch.zeros(6, 6, dtype=torch.bool)

    def forward(self, h):
        scores = (h @ h.T).masked_fill(self.mask, float("-inf"))
        return scores.softmax(-1) @ h


def test_the_replay_program_passes_over_masks_and_uninitialised_memory(tmp_path):
    """The program names the softmax as the record does, not the intended -inf of the mask; and it does
    not check the uninitialised memory of dropout's ``empty_like`` (it may hold NaN)."""
    torch.manual_seed(0)
    mix = MaskedRows()
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), mix, nn.Linear(4, 3))
    cockpit = Cockpit(model.parameters(), [], model=model, record_dir=tmp_path)
    x, y = _batch(0)
    mix.mask[2] = True  # row 2 mixes with nothing: its softmax is NaN
    loss = nn.functional.cross_entropy(model(x), y)
    with cockpit(0, info={"loss": loss, "loss_fn": lambda output: nn.functional.cross_entropy(output, y)}):
        loss.backward()
    record = cockpit.records[0]
    origin = record.first_nonfinite
    assert origin["op"] == "aten._softmax.default" and origin["module"] == "2"
    assert record.data["intended_infinities"]  # the masked_fill's output
    text = (tmp_path / "step_0.py").read_text()
    empties = [op["index"] for op in record.ops if op["op"].startswith("aten.empty")]
    assert empties and not any(f"check({index}," in text for index in empties)
    done = subprocess.run([sys.executable, "-I", str(tmp_path / "step_0.py")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"first non-finite value: op {origin['op_index']}: aten._softmax.default" in done.stdout


def test_a_loss_given_as_a_number_cannot_show_the_scaler_and_the_fix_says_so():
    """Without info['grad_scaler'] and with info['loss'] a number, a step the scaler skips cannot be told
    apart: it is reported, and the fix says what to pass."""
    model = _square_net()
    cockpit = Cockpit(model.parameters(), [], model=model)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batch(0, scale=30.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    with cockpit(0, info={"loss": float(loss), "loss_fn": lambda output: nn.functional.cross_entropy(output, y)}):
        scaler.scale(loss).backward()
    (finding,) = cockpit.findings
    assert "info['grad_scaler'] = scaler" in finding.fix


def test_a_forward_pass_inside_the_cockpits_block_is_re_run():
    """The model called inside ``with cockpit(step)``: a non-finite gradient still re-runs that forward pass."""
    model = _rownorm_net()
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    x, y = _batch(0)
    x[1] = 0.0
    with cockpit(0, info={"loss_fn": lambda output: nn.functional.cross_entropy(output, y)}):
        nn.functional.cross_entropy(model(x), y).backward()
    origin = cockpit.records[0].first_nonfinite
    assert origin["phase"] == "backward" and origin["module_type"] == "RowNorm"


def test_the_rerun_leaves_torchs_random_streams_alone():
    """A re-run through dropout draws masks again; the user's stream continues as if it had not run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), Square(), nn.Linear(8, 3))
    cockpit = Cockpit(model.parameters(), [], model=model)
    x, y = _batch(0, scale=30.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    before = torch.get_rng_state()
    with cockpit(0, info={"loss": loss, "loss_fn": lambda output: nn.functional.cross_entropy(output, y)}):
        loss.backward()
    assert 0 in cockpit.records and any(op.get("random") for op in cockpit.records[0].ops)  # it did draw
    assert torch.equal(torch.get_rng_state(), before)


def test_a_slice_of_the_outside_benchmark(tmp_path):
    """benchmarks/nan_origin_outside.py (the figures in docs/recorder.md) runs: one case per kind."""
    from benchmarks.nan_origin_outside import cases, run

    wanted = ("fp16 autocast: x**3", "2 micro-batches: custom Function", "GradScaler declared")
    chosen = [case for case in cases() if case.name.startswith(wanted)]
    assert len(chosen) == 3
    for index, case in enumerate(chosen):
        result = run(case, tmp_path / str(index))
        assert result["valid"] and result["right"] and result["raised"] is None, result


# ---- a non-finite step never raises into the training loop ---------------------------------------------
class Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.rnn, self.out = getattr(nn, kind)(4, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


def _two_steps_nan_at_step_1(model, width, poison):
    """Two economy steps on ``[6, 5, width]`` inputs, ``poison(x)`` putting a NaN into step 1's; the cockpit."""
    cockpit = Cockpit(model.parameters(), configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 5, width, generator=generator), torch.randint(0, 3, (6,), generator=generator)
            if step == 1:
                poison(x)
            per = nn.functional.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, info={"loss": per.mean(), "batch_size": 6, "individual_losses": per,
                                     "optimizer": optimizer}):  # fmt: skip
                per.mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return cockpit


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("where", ["one time step", "the whole row"])
def test_a_nan_row_into_a_recurrent_net_is_recorded_not_raised(kind, where):
    """The per-sample re-run of a recurrent layer compares its outputs with the step's: NaN rows are
    the same NaN rows (this raised UncoveredParameterError into the training loop; the generated
    corpus's ``nan-input`` fault makes the whole row NaN)."""
    torch.manual_seed(0)
    poison = (lambda x: x[2, 3].fill_(float("nan"))) if where == "one time step" else (
        lambda x: x[2].fill_(float("nan")))
    cockpit = _two_steps_nan_at_step_1(Recurrent(kind), 4, poison)
    origin = cockpit.records[1].first_nonfinite
    assert origin["kind"] == "input" and origin["module"] == "rnn"


def test_same_outputs_takes_the_same_non_finite_entries_as_equal():
    from cockpit_like.backends.rerun import _same_outputs

    old = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    assert _same_outputs([old.clone()], [old])
    assert _same_outputs([old + 1e-6], [old])
    moved = torch.tensor([[float("nan"), 1.0], [float("inf"), 2.0]])
    assert not _same_outputs([moved], [old])
    flipped = torch.tensor([[1.0, float("nan")], [-float("inf"), 2.0]])
    assert not _same_outputs([flipped], [old])
    assert not _same_outputs([torch.tensor([[1.5, float("nan")], [float("inf"), 2.0]])], [old])
    assert not _same_outputs([torch.tensor([[1.0, 3.0], [float("inf"), 2.0]])], [old])


# ---- a GradScaler that keeps skipping ----------------------------------------------------------------
def _skipping_run(model, scaler, steps, scale, quantities=()):
    cockpit = Cockpit(model.parameters(), list(quantities), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    skipped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            x, y = _batch(step, scale=scale)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            with cockpit(step, info={"loss": loss, "batch_size": len(y), "grad_scaler": scaler,
                                     "loss_fn": lambda output, y=y: nn.functional.cross_entropy(output, y)}):  # fmt: skip
                scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            skipped += scaler.get_scale() < before
    return cockpit, skipped


def test_a_scaler_that_keeps_skipping_a_forward_overflow_gets_a_record_after_all():
    from cockpit_like.diagnosis.recorder.control import SKIPS_IN_A_ROW

    cockpit, skipped = _skipping_run(_square_net(), torch.amp.GradScaler("cpu"), SKIPS_IN_A_ROW + 2, 30.0)
    assert skipped == SKIPS_IN_A_ROW + 2  # every step overflows in float16, whatever the scale
    last = SKIPS_IN_A_ROW - 1
    assert list(cockpit.records) == [last]
    record = cockpit.records[last]
    assert record.data["skipped"] == {"reason": "grad_scaler", "in_a_row": SKIPS_IN_A_ROW}
    assert record.first_nonfinite["op"] == "aten.pow.Tensor_Scalar" and record.first_nonfinite["module"] == "1"
    (finding,) = cockpit.findings
    assert finding.step == last and "skipped step in a row" in finding.message


def test_a_scale_too_large_that_keeps_being_lowered_is_not_reported():
    """The scaled backward pass overflows for many steps (the scale starts far too large); the unscaled
    re-run is finite, so the scaler's skips stay unreported."""
    from cockpit_like.diagnosis.recorder.control import SKIPS_IN_A_ROW

    cockpit, skipped = _skipping_run(_square_net(), torch.amp.GradScaler("cpu", init_scale=2.0**50),
                                     SKIPS_IN_A_ROW + 4, 1.0, [GradNorm(linear(1))])  # fmt: skip
    assert skipped > SKIPS_IN_A_ROW
    assert cockpit.records == {} and cockpit.findings == []


def test_a_scaler_that_keeps_skipping_a_nan_made_in_the_backward_pass_gets_a_record_after_all():
    from cockpit_like.diagnosis.recorder.control import SKIPS_IN_A_ROW

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), RowNorm(), nn.Linear(1, 3))
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model)
    scaler = torch.amp.GradScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(SKIPS_IN_A_ROW + 1):
            x, y = _batch(step)
            x[0] = 0.0  # every batch: a zero row, whose RowNorm gradient is NaN
            loss = nn.functional.cross_entropy(model(x), y)
            with cockpit(step, info={"loss": loss, "batch_size": len(y), "grad_scaler": scaler,
                                     "loss_fn": lambda output, y=y: nn.functional.cross_entropy(output, y)}):  # fmt: skip
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert sorted(cockpit.skipped_steps) == list(range(SKIPS_IN_A_ROW + 1))
    assert list(cockpit.records) == [SKIPS_IN_A_ROW - 1]
    origin = cockpit.records[SKIPS_IN_A_ROW - 1].first_nonfinite
    assert origin["phase"] == "backward" and origin["module_type"] == "RowNorm"


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))


def test_a_nan_row_into_multihead_attention_is_recorded_not_raised():
    """The attention rule compares its re-computed output with the step's before using it: with a NaN row the
    tolerance taken from the output's largest value was NaN, and `allclose` raised into the training loop (found
    by the spike corpus: a learning-rate jump drove a transformer's activations to NaN)."""
    torch.manual_seed(0)
    cockpit = _two_steps_nan_at_step_1(_Attention(), 8, lambda x: x[2, 3, 0].fill_(float("nan")))
    assert 1 in cockpit.records
    from cockpit_like.backends.module_rules import finite_parts

    old = torch.tensor([1.0, float("nan"), float("-inf")])
    assert finite_parts(old.clone(), old) is not None
    assert finite_parts(torch.tensor([1.0, 0.0, float("-inf")]), old) is None
    assert finite_parts(torch.tensor([1.0, float("nan"), float("inf")]), old) is None
