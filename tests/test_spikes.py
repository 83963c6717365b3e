"""The loss-spike post-mortem (issue 38): rows with an identity, spikes, causes.

Every per-row number is checked in float64 against a brute-force twin: the
per-sample gradients from a loop of ``torch.autograd.grad`` (one row at a
time), ``G`` their mean, ``share_i = <g_i / B, G> / ||G||^2``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.functional.row_summaries import row_norms, row_shares, top_rows
from cockpit_like.functional.spikes import robust_score
from cockpit_like.diagnosis import diagnose
from cockpit_like.spikes import PostMortem, RowBuffer, RowSummaries, SpikeDetector, name_cause
from cockpit_like.utils.schedules import linear
from tests.helpers import zoo_or_helper_problem

ROWS = 8


def _brute_rows(model: nn.Module, individual, inputs, targets):
    """``(losses, ||g_i||, shares)`` from a loop of autograd.grad over the rows (float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, losses = [], []
    for i in range(len(inputs)):
        loss = individual(model(inputs[i : i + 1]), targets[i : i + 1])[0]
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
        losses.append(float(loss.detach()))
    g = torch.stack(grads)
    mean = g.mean(0)
    return torch.tensor(losses, dtype=torch.float64), g.norm(dim=1), (g @ mean) / len(g) / (mean @ mean)


def _run_rows(name: str, micro_batches: int, ids, steps: int = 2, top_k: int = ROWS):
    model, lossfunc, individual, batch = zoo_or_helper_problem(name)
    rows = RowSummaries(linear(1), keep_steps=3, top_k=top_k)
    cockpit = Cockpit(model.parameters(), quantities=[rows], model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    size = ROWS // micro_batches
    expected = {}
    for step in range(steps):
        inputs, targets = batch(ROWS, 100 + step)
        expected[step] = _brute_rows(model, individual, inputs, targets)
        optimizer.zero_grad()
        for micro in range(micro_batches):
            part = slice(micro * size, (micro + 1) * size)
            outputs = model(inputs[part])
            info = {"batch_size": size, "individual_losses": individual(outputs, targets[part]),
                    "loss": lossfunc(outputs, targets[part]), "optimizer": optimizer,
                    "micro_batches": micro_batches, "sample_ids": ids(step)[part]}
            with cockpit(step, info=info):
                (info["loss"] / micro_batches).backward()
        optimizer.step()
    return rows, cockpit.get_output(), expected


@pytest.mark.parametrize("name,micro_batches,kind", [("mlp", 1, "tensor"), ("cnn", 1, "str"), ("mlp", 2, "str"),
                                                     ("encoder", 2, "tensor")])
def test_row_summaries_match_brute_force(name, micro_batches, kind):
    """Loss, ||g_i|| and share of every row, with its id, equal the brute-force twin (micro-batches in order)."""
    def ids(step):
        values = [1000 * step + 7 * i for i in range(ROWS)]
        return torch.tensor(values) if kind == "tensor" else [f"s{v}" for v in values]

    rows, output, expected = _run_rows(name, micro_batches, ids)
    for step, (losses, norms, shares) in expected.items():
        stored = output[step]["RowSummaries"]
        assert stored["batch"] == ROWS and len(stored["rows"]) == ROWS
        for entry in stored["rows"]:
            i = entry["row"]
            assert entry["id"] == (ids(step)[i].item() if kind == "tensor" else ids(step)[i])
            assert math.isclose(entry["loss"], float(losses[i]), rel_tol=1e-10)
            assert math.isclose(entry["grad_norm"], float(norms[i]), rel_tol=1e-8)
            assert math.isclose(entry["share"], float(shares[i]), rel_tol=1e-8, abs_tol=1e-12)
        assert math.isclose(sum(e["share"] for e in stored["rows"]), 1.0, rel_tol=1e-10)
        assert [stored["rows"][j]["row"] for j in stored["by_share"]] == top_rows(shares, ROWS)
    assert len(rows.buffer.steps) == 2 and 0 < rows.nbytes


def test_row_summaries_can_fail():
    """The twin tells rows apart: a different batch gives different shares (the check above can fail)."""
    model, _, individual, batch = zoo_or_helper_problem("mlp")
    a = _brute_rows(model, individual, *batch(ROWS, 100))[2]
    b = _brute_rows(model, individual, *batch(ROWS, 101))[2]
    assert not torch.allclose(a, b)


def test_functional_row_math():
    g = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    B, mean = len(g), g.mean(0)
    diag, row_sums = (g * g).sum(1) / B**2, g @ mean / B
    assert torch.allclose(row_norms(diag), g.norm(dim=1))
    shares = row_shares(row_sums)
    assert torch.allclose(shares, (g / B) @ mean / (mean @ mean)) and math.isclose(float(shares.sum()), 1.0)
    assert torch.isnan(row_shares(torch.zeros(3))).all()
    assert top_rows(torch.tensor([0.1, float("nan"), 0.5]), 2) == [2, 0]


def test_buffer_is_bounded():
    buffer = RowBuffer(keep_steps=3, top_k=2)
    for step in range(10):
        buffer.add({"step": step, "rows": [{"id": i, "loss": 1.0, "grad_norm": 1.0, "share": .5, "row": i}
                                           for i in range(4)]})
    assert [s["step"] for s in buffer.steps] == [7, 8, 9]
    assert buffer.nbytes <= buffer.bound_bytes == 3 * (2 * 2 * 40 + 64)
    with pytest.raises(ValueError, match="keep_steps must be a positive int"):
        RowBuffer(keep_steps=0)


@pytest.mark.parametrize("ids,match", [
    (list(range(ROWS - 1)), "has 7 entries but info\\['batch_size'\\] is 8"),
    (torch.zeros(ROWS), "torch.float32 tensor"),
    ([0.5] * ROWS, "holds 0.5"),
    ([1, "a"] * (ROWS // 2), "mixes ints and strings"),
    ("abc", "is a str"),
])
def test_sample_ids_bad_input(ids, match):
    model, lossfunc, individual, batch = zoo_or_helper_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[RowSummaries(linear(1))], model=model)
    inputs, targets = batch(ROWS, 0)
    outputs = model(inputs)
    info = {"batch_size": ROWS, "individual_losses": individual(outputs, targets), "loss": lossfunc(outputs, targets),
            "sample_ids": ids}
    with pytest.raises(ValueError, match=match):
        with cockpit(0, info=info):
            info["loss"].backward()


# ---- the detector -------------------------------------------------------------------------------------
def test_detector_finds_a_spike_not_noise():
    generator = torch.Generator().manual_seed(0)
    noise = torch.exp(0.05 * torch.randn(300, generator=generator)).tolist()
    detector = SpikeDetector()
    alarms = [detector.update(t, 2.0 * v, 1.0 * v, 0.1) for t, v in enumerate(noise)]
    assert not any(alarms)  # healthy noise: no alarm in 300 steps
    found = detector.update(300, 6.0, 1.0, 0.1)
    assert found is not None and found["series"] == ["loss"] and found["loss"]["z"] > 6
    assert detector.update(301, 6.0, 1.0, 0.1) is None  # cooldown: the same incident


def test_detector_warmup_and_ramp():
    detector = SpikeDetector(warmup=10)
    values = [5.0, 3.0, 2.0, 1.5, 1.2, 1.1, 1.0, 1.0, 0.9, 20.0]  # a big value inside the warmup
    assert not any(detector.update(t, v, v, 0.1) for t, v in enumerate(values))
    ramp = SpikeDetector(window=10, warmup=3, ramp_z=1e9)
    for t in range(12):
        ramp.update(t, 1.0, 1.0 + 0.001 * (t % 2), 0.01 * (t + 1))  # the learning rate warms up
    found = ramp.update(12, 1.0, 3.0, 0.13)  # gradient norm x3 while ramping: needs ramp_z
    assert found is None
    assert SpikeDetector(window=10, warmup=3).update  # (constructor check)
    with pytest.raises(ValueError, match="window must be an int of at least 3"):
        SpikeDetector(window=2)
    with pytest.raises(ValueError, match="window must be an int of at least 3"):  # not "non-negative" (trial 9)
        SpikeDetector(window=-5)


def test_robust_score():
    assert math.isnan(robust_score([1.0, 1.0], 2.0, min_window=3))
    assert robust_score([1.0] * 5, float("nan")) == math.inf
    assert robust_score([1.0, 1.1, 0.9, 1.0, 1.05], 1.0) < 1


# ---- causes ---------------------------------------------------------------------------------------------
def test_earlier_row_is_the_suspect():
    """A spike one step after a row that carried most of its step's gradient: that row is the suspect."""
    calm = {"batch": 32, "outlier_rows": 0, "outlier_share": 0.0, "top_share": 0.1, "median_shift": 3.0}
    earlier = [{"step": 9, "row": 4, "id": 77, "share": 0.9, "loss": 30.0}, {"step": 5, "row": 1, "id": 5, "share": 0.8}]
    verdict = name_cause({"step": 10, "rows": calm, "earlier_rows": earlier,
                          "rows_by_share": [{"row": 0, "id": 1, "share": 0.1}]})
    assert verdict["cause"] == "bad-rows" and [r["id"] for r in verdict["suspects"]] == [77]
    assert "of step 9 carried 90%" in verdict["why"]
    verdict = name_cause({"step": 10, "rows": calm, "earlier_rows": [], "rows_by_share": [{"row": 0, "id": 1}]})
    assert verdict["cause"] == "bad-rows" and [r["id"] for r in verdict["suspects"]] == [1]  # a bad batch


def test_name_cause_order():
    rows = {"batch": 32, "outlier_rows": 1, "outlier_share": 0.9, "top_share": 0.9}
    scaler = {"scaler": True, "scale_dropped": True, "scale": 1024.0, "previous_scale": 2048.0, "missing_steps": []}
    rate = {"value": 1.0, "window_median": 0.1, "ratio": 10.0}
    assert name_cause({"rows": rows, "precision": scaler, "learning_rate": rate})["cause"] == "precision"
    assert name_cause({"rows": rows, "learning_rate": rate})["cause"] == "learning-rate"
    assert name_cause({"rows": rows, "learning_rate": {**rate, "ratio": 1.0}})["cause"] == "bad-rows"
    calm = {"batch": 32, "outlier_rows": 0, "outlier_share": 0.0, "top_share": 0.05}
    sharp = {"value": 30.0, "two_over_lr": 20.0, "ratio": 1.5}
    assert name_cause({"rows": calm, "sharpness": sharp})["cause"] == "curvature"
    assert name_cause({"rows": calm})["cause"] == "unknown"
    with pytest.raises(TypeError):
        name_cause({}, not_a_setting=1.0)


# ---- the post-mortem in a run --------------------------------------------------------------------------
def _spiky_run(fault: str, steps: int = 30, onset: int = 22, cockpit_args=None, batch_norm=False,
               losses_out: list | None = None, **post_args):
    """An MLP on blobs (batch 16) with a fault at ``onset``: ``row`` (row 3 scaled by 1e3, a wrong label) or
    ``lr`` (x100); ``batch_norm``: a BatchNorm1d (training mode) after the first layer; ``losses_out``: gets each
    step's row losses (float64)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 6, generator=generator) * 2
    norm = [nn.BatchNorm1d(16)] if batch_norm else []
    model = nn.Sequential(nn.Linear(6, 16), *norm, nn.ReLU(), nn.Linear(16, 4))
    post = PostMortem(linear(1), **post_args)
    cockpit = Cockpit(model.parameters(), quantities=[post], model=model, **(cockpit_args or {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        labels = torch.randint(0, 4, (16,), generator=generator)
        x = centers[labels] + torch.randn(16, 6, generator=generator)
        if fault == "row" and step == onset:
            x[3] *= 1e3
            model.eval()  # (one row through a BatchNorm: its running statistics)
            with torch.no_grad():
                labels[3] = (model(x[3:4]).argmax() + 1) % 4  # a row the model gets wrong
            model.train()
        for group in optimizer.param_groups:
            group["lr"] = 5.0 if fault == "lr" and step >= onset else 0.05
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), labels, reduction="none")
        if losses_out is not None:
            losses_out.append(losses.detach().to(torch.float64).clone())
        ids = torch.arange(16) + 100 * step
        with cockpit(step, info={"batch_size": 16, "individual_losses": losses, "loss": losses.mean(),
                                 "optimizer": optimizer, "sample_ids": ids}):
            losses.mean().backward()
        optimizer.step()
    return cockpit, post


def test_post_mortem_names_the_row():
    cockpit, post = _spiky_run("row")
    spikes = {s: v["PostMortem"] for s, v in cockpit.get_output().items() if "PostMortem" in v}
    assert min(spikes) == 22  # (the huge update it made may spike again later: another incident)
    pm = spikes[22]
    assert pm["rows_by_share"][0]["id"] == 2203 and pm["rows_by_loss"][0]["id"] == 2203
    assert pm["cause"] == "bad-rows", pm["why"]
    assert [(r["step"], r["id"]) for r in pm["suspects"]][:1] == [(22, 2203)]
    assert pm["layers"] and pm["layers"][0]["first_step"] == 22
    assert post.nbytes > 0


def test_post_mortem_under_batch_norm_in_training_mode_ranks_the_rows_by_loss():
    """A BatchNorm in training mode couples the rows (no per-sample gradients): the post-mortem is still made, its
    rows ranked by loss alone (``rows_by_share`` empty, ``rows["gradients"]`` False), and the step's note says so."""
    cockpit, _ = _spiky_run("row", batch_norm=True)
    output = cockpit.get_output()
    spikes = {s: v["PostMortem"] for s, v in output.items() if "PostMortem" in v}
    pm = spikes[22]
    assert pm["rows"]["gradients"] is False and pm["rows_by_share"] == []
    assert pm["rows_by_loss"][0]["id"] == 2203 and math.isnan(pm["rows_by_loss"][0]["share"])
    assert "['PostMortem'] computed without them" in output[22]["checks"]["notes"][0]
    assert pm["learning_rate"]["value"] == 0.05
    assert pm["cause"] == "bad-rows" and "of the batch's loss rise" in pm["why"], pm["why"]
    assert pm["suspects"][0]["id"] == 2203
    from cockpit_like.spikes.report import format_post_mortem

    text = format_post_mortem(22, pm)
    assert "rows by share of the step's gradient: none (no per-sample gradients" in text and "nan%" not in text
    from matplotlib.figure import Figure

    from cockpit_like import instruments

    figure = Figure()
    ax = instruments.post_mortem_gauge(output, figure, figure.add_gridspec(1, 1)[0, 0])
    widths = [bar.get_width() for bar in ax.patches if bar.get_gid() == "post-mortem:rows"]
    assert widths == pytest.approx([row["loss"] for row in pm["rows_by_loss"]]) and "row loss" in ax.get_xlabel()


def test_name_cause_without_per_sample_gradients_reads_the_rows_share_of_the_loss_rise():
    rows = {"batch": 32, "outlier_rows": 1, "outlier_share": 0.0, "top_share": 0.0, "gradients": False,
            "outlier_loss_share": 0.8, "top_loss_share": 0.8}
    by_loss = [{"row": 7, "id": 70, "loss": 9.0}, {"row": 1, "id": 10, "loss": 2.0}]
    verdict = name_cause({"rows": rows, "rows_by_loss": by_loss, "step": 5})
    assert verdict["cause"] == "bad-rows" and "of the batch's loss rise" in verdict["why"]
    assert [r["id"] for r in verdict["suspects"]] == [70, 10]
    spread = {**rows, "outlier_loss_share": 0.1, "top_loss_share": 0.1}
    assert name_cause({"rows": spread, "rows_by_loss": by_loss, "step": 5})["cause"] == "unknown"
    # with gradients the loss shares are not read
    assert name_cause({"rows": {**rows, "gradients": True}, "rows_by_loss": by_loss})["cause"] == "unknown"


def test_name_cause_states_the_batch_median_as_a_loss_and_its_shift_in_spreads():
    """The bad-batch clause: the median row loss as a loss, and how many spreads above or below (an outside trial
    printed "the batch's median row loss is -0.279 spreads above", the shift shown as a loss with the wrong side)."""
    rows = {"batch": 16, "outlier_rows": 0, "outlier_share": 0.0, "top_share": 0.1,
            "row_loss_baseline": 2.0, "row_loss_scale": 0.5, "median_shift": -1.0}
    why = name_cause({"rows": rows})["checks"]["bad-rows"]["why"]
    assert why.endswith("; the batch's median row loss is 1.5 against the previous steps' 2 (spread 0.5): 1 spreads below")
    why = name_cause({"rows": {**rows, "median_shift": 3.0}})["why"]  # 2 + 3 x 0.5: a bad batch
    assert why.endswith("; the batch's median row loss is 3.5 against the previous steps' 2 (spread 0.5): 3 spreads above")
    older = {key: value for key, value in rows.items() if key not in ("row_loss_baseline", "row_loss_scale")}
    assert name_cause({"rows": older})["checks"]["bad-rows"]["why"].endswith(
        "; the batch's median row loss is 1 spreads below the previous steps' median row loss")
    assert "median row loss" not in name_cause({"rows": {**rows, "median_shift": math.nan}})["checks"]["bad-rows"]["why"]


def _lower_median(values) -> float:
    """torch.median's median (the lower of the two middle values), by sorting."""
    ordered = sorted(float(v) for v in values)
    return ordered[(len(ordered) - 1) // 2]


def test_cli_states_the_batch_median_row_loss_of_the_spike_step(tmp_path, capsys):
    """``cockpit-like spikes``: the numbers of the bad-batch clause against brute force from the run's row losses:
    the step's median row loss, the previous 5 steps' median of their median row losses, their spread (the
    median of each step's 1.4826 MAD, floored at 2% of the run's first loss) and the shift in spreads."""
    import re

    from cockpit_like.cli import main

    losses: list = []
    cockpit, _ = _spiky_run("row", losses_out=losses)
    path = cockpit.write(str(tmp_path / "run"))
    assert main(["spikes", path, "--step", "22", "--no-progress"]) == 0
    text = capsys.readouterr().out
    number = r"(-?[0-9.]+(?:e[+-]?[0-9]+)?)"
    found = re.findall(rf"the batch's median row loss is {number} against the previous steps' {number} "
                       rf"\(spread {number}\): {number} spreads (above|below)", text)
    assert len(found) == 2, text  # the likeliest cause's line and the bad-rows check's
    assert found[0] == found[1]
    median, baseline, spread, shift, side = found[0]
    brute_median = _lower_median(losses[22])
    previous = [_lower_median(step) for step in losses[17:22]]
    brute_baseline = float(sorted(previous)[2])  # the median of 5
    scales = [1.4826 * _lower_median((step - _lower_median(step)).abs()) for step in losses[17:22]]
    first_loss = sorted(float(step.mean()) for step in losses[:3])[1]
    brute_spread = max(sorted(scales)[2], 0.02 * abs(first_loss))
    brute_shift = (brute_median - brute_baseline) / brute_spread
    assert float(median) == pytest.approx(brute_median, rel=5e-3)
    assert float(baseline) == pytest.approx(brute_baseline, rel=5e-3)
    assert float(spread) == pytest.approx(brute_spread, rel=5e-3)
    assert float(shift) == pytest.approx(abs(brute_shift), rel=5e-3, abs=1e-3)
    assert side == ("above" if brute_shift >= 0 else "below")


def test_post_mortem_names_the_learning_rate():
    cockpit, _ = _spiky_run("lr", onset=20)
    spikes = {s: v["PostMortem"] for s, v in cockpit.get_output().items() if "PostMortem" in v}
    assert spikes, "the learning-rate jump made no post-mortem"
    first = spikes[min(spikes)]
    assert first["cause"] == "learning-rate" and first["learning_rate"]["ratio"] > 10


def test_healthy_run_has_no_post_mortem():
    cockpit, _ = _spiky_run("none", steps=40)
    assert not any("PostMortem" in v for v in cockpit.get_output().values())


def test_spike_is_a_finding():
    """The stored post-mortem shows where findings show (rule loss-spike, with its cause), live and replayed."""
    cockpit, _ = _spiky_run("row", cockpit_args={"diagnose": True})
    found = [f for f in cockpit.findings if f.rule == "loss-spike"]
    assert found and found[0].step == 22 and found[0].evidence["cause"] == "bad-rows"
    assert "suspect step 22 row 3 (id 2203)" in found[0].message
    replayed = [f for f in diagnose(cockpit.get_output()).findings if f.rule == "loss-spike"]
    assert [f.step for f in replayed][:1] == [22]


def test_cli_prints_post_mortems(tmp_path, capsys):
    from cockpit_like.cli import main

    cockpit, _ = _spiky_run("row")
    path = cockpit.write(str(tmp_path / "run"))
    assert main(["spikes", path, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "step 22: spike of" in text and "likeliest cause: bad-rows" in text and "2203" in text
    assert "layers that moved first" in text and "0.weight" in text  # layer names from the model
    assert main(["spikes", path, "--step", "3", "--no-progress"]) == 0
    # the log has post-mortems, only not at that step: where they are, not "track PostMortem" (seventh round)
    assert "no post-mortem at step 3 (the log has 1, at step 22)" in capsys.readouterr().out


def test_post_mortem_gauge_draws_the_rows():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from cockpit_like import instruments

    cockpit, _ = _spiky_run("row", steps=25)
    fig = Figure(figsize=(6, 4))
    ax = instruments.post_mortem_gauge(cockpit.get_output(), fig, fig.add_gridspec(1, 1)[0, 0])
    bars = [p for p in ax.patches if p.get_gid() == "post-mortem:rows"]
    post = cockpit.get_output()[22]["PostMortem"]
    widths = sorted((p.get_width() for p in bars), reverse=True)
    assert math.isclose(widths[0], post["rows_by_share"][0]["share"], rel_tol=1e-9)
    assert "bad-rows" in ax.get_title() and "id 2203" in " ".join(t.get_text() for t in ax.get_yticklabels())
    empty = Figure()
    ax = instruments.post_mortem_gauge({0: {"Loss": 1.0}}, empty, empty.add_gridspec(1, 1)[0, 0])
    assert any(t.get_gid() == "not-tracked" for t in ax.texts)


def test_exporters_pass_the_post_mortem_on(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cockpit_like.integrations.exporters import export_log
    from cockpit_like.integrations.flatten import flatten

    cockpit, _ = _spiky_run("row", steps=25)
    flat = flatten(cockpit.get_output()[22])
    assert "likeliest cause: bad-rows" in flat.texts["PostMortem"] and flat.scalars["PostMortem/top_share"] > 0.9
    log = cockpit.write(str(tmp_path / "run"))
    export_log(log, "tensorboard", tmp_path / "tb").close()
    accumulator = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    accumulator.Reload()
    texts = accumulator.Tensors("PostMortem/text_summary")
    assert [t.step for t in texts] == [22] and b"2203" in texts[0].tensor_proto.string_val[0]
    assert "PostMortem/cause_index" in accumulator.Tags()["scalars"]
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    exporter = export_log(log, "mlflow", tmp_path / "mlruns")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    local = client.download_artifacts(exporter.run_id, "texts/PostMortem", str(tmp_path / "dl"))
    assert "2203" in (Path(local) / "step_0000022.txt").read_text()


def test_example_script(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "spike_postmortem.py"
    spec = importlib.util.spec_from_file_location("_example_spike_postmortem", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.main(["--steps", "60", "--out", str(tmp_path / "run"), "--picture", str(tmp_path / "pm.png"),
                           "--dashboard", str(tmp_path / "dash.png")])
    assert written["bad_in_top3"] and written["bad_in_top3"] == [s for s, _ in written["post_mortems"]]
    assert Path(written["picture"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path(written["dashboard"]) == tmp_path / "dash.png" and Path(written["dashboard"]).stat().st_size > 10_000
    assert "likeliest cause: bad-rows" in capsys.readouterr().out


def test_sample_ids_on_every_micro_batch_or_none():
    model, lossfunc, individual, batch = zoo_or_helper_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[RowSummaries(linear(1))], model=model)
    inputs, targets = batch(ROWS, 0)
    half = ROWS // 2
    for micro in range(2):
        part = slice(micro * half, (micro + 1) * half)
        outputs = model(inputs[part])
        info = {"batch_size": half, "individual_losses": individual(outputs, targets[part]),
                "loss": lossfunc(outputs, targets[part]), "micro_batches": 2}
        if micro == 0:
            info["sample_ids"] = list(range(half))
            with cockpit(0, info=info):
                (info["loss"] / 2).backward()
        else:
            with pytest.raises(ValueError, match="sample_ids'\\] was given to the first backward pass"):
                with cockpit(0, info=info):
                    (info["loss"] / 2).backward()


def test_post_mortem_state_round_trip():
    """What the post-mortem carries across steps (buffer, detector, layers) survives state_dict / load."""
    _, post = _spiky_run("none", steps=15)
    state = post.state_dict()
    fresh = PostMortem(linear(1))
    fresh.load_state_dict(state)
    assert fresh.detector.history == post.detector.history and fresh.buffer.steps == post.buffer.steps
    assert fresh.detector.first_losses == post.detector.first_losses and fresh.nbytes == post.nbytes


def test_precision_evidence_scale_drop_and_skipped_steps():
    """A GradScaler's scale that dropped since the previous tracked step, and scheduled steps the cockpit
    skipped, are the precision evidence (and name the cause before the others)."""
    from types import SimpleNamespace

    class Scaler:
        def __init__(self):
            self.scale = 65536.0

        def get_scale(self):
            return self.scale

        def is_enabled(self):
            return True

    scaler, post = Scaler(), PostMortem(linear(1))
    record = SimpleNamespace(info={"grad_scaler": scaler})
    first = post._precision(2, record, 1.0)
    assert first["scaler"] and not first["scale_dropped"] and first["missing_steps"] == []
    post._last_step, scaler.scale = 2, 32768.0
    second = post._precision(5, record, 1.0)
    assert second["scale_dropped"] and second["missing_steps"] == [3, 4] and second["previous_scale"] == 65536.0
    assert second["scaler_skips"] == 1  # 65536 -> 32768: one back-off of 0.5
    rows = {"batch": 32, "outlier_rows": 1, "outlier_share": 0.9, "top_share": 0.9}
    assert name_cause({"precision": second, "rows": rows})["cause"] == "precision"
    post._last_step, scaler.scale = 5, 4096.0  # three more back-offs (and no growth in between)
    third = post._precision(7, record, 1.0)
    assert third["scaler_skips"] == 3 and third["missing_steps"] == [6]
    post._last_step = 7  # steps missing while the scale held (a failed self-check) are not the scaler's
    held = post._precision(10, record, 1.0)
    assert held["missing_steps"] == [8, 9] and not held["scale_dropped"] and held["scaler_skips"] == 0
    assert name_cause({"precision": held, "rows": rows})["cause"] == "bad-rows"
    assert not post._precision(6, SimpleNamespace(info={}), 1.0)["scaler"]


def test_detector_skipped_steps():
    """Steps a GradScaler skipped in a row (at least skip_steps) are a spike of their own, after the warmup;
    one skipped step (the scaler's routine back-off) is not."""
    detector = SpikeDetector(window=5, warmup=5, skip_steps=2)
    calm = [detector.update(t, 1.0 + 0.01 * (t % 2), 1.0, skipped=3 if t == 2 else 0) for t in range(8)]
    assert calm == [None] * 8  # (3 skips during the warmup: the scale finds its level)
    assert detector.update(8, 1.0, 1.0, skipped=1) is None
    found = detector.update(9, 1.0, 1.0, skipped=2)
    assert found["series"] == ["loss_scale"] and found["skipped"] == 2
    with pytest.raises(ValueError, match="skip_steps must be a positive int"):
        SpikeDetector(skip_steps=0)


def _fp16_run(overflow: bool, steps: int = 30, onset: int = 20, row: int = 5):
    """An MLP on blobs (batch 16) under CPU fp16 autocast with a GradScaler (declared); with ``overflow`` row
    ``row``'s input is x1e8 (beyond fp16's 65504) at ``onset`` and the 2 steps after it."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 6, generator=generator) * 2
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    post = PostMortem(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[post], model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    nonfinite = []
    for step in range(steps):
        labels = torch.randint(0, 4, (16,), generator=generator)
        x = centers[labels] + torch.randn(16, 6, generator=generator)
        if overflow and onset <= step < onset + 3:
            x[row] *= 1e8
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        losses = nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        with cockpit(step, info={"batch_size": 16, "individual_losses": losses, "loss": losses.mean(),
                                 "optimizer": optimizer, "sample_ids": torch.arange(16) + 100 * step,
                                 "grad_scaler": scaler}):
            scaler.scale(losses.mean()).backward()
        nonfinite.append(not all(torch.isfinite(p.grad).all() for p in model.parameters()))
        scaler.step(optimizer)
        scaler.update()
    return cockpit, post, nonfinite


@pytest.mark.filterwarnings("ignore:.*the loss is nan:RuntimeWarning")
def test_fp16_overflow_is_a_precision_spike():
    """A real fp16 overflow (CPU autocast, GradScaler): the scaler skips the 3 steps whose gradients are not
    finite, the first tracked step after them holds a post-mortem whose cause is precision; a healthy fp16 run
    has none."""
    cockpit, post, nonfinite = _fp16_run(True)
    assert [t for t, bad in enumerate(nonfinite) if bad] == [20, 21, 22]  # the overflow is real
    output = cockpit.get_output()
    spikes = {s: v["PostMortem"] for s, v in output.items() if "PostMortem" in v}
    assert list(spikes) == [23]
    pm = spikes[23]
    assert pm["cause"] == "precision" and pm["strength"] == "conclusive"
    assert pm["trigger"]["series"] == ["loss_scale"] and pm["trigger"]["skipped"] == 3
    assert pm["precision"]["scale"] == 65536.0 / 8 and pm["precision"]["previous_scale"] == 65536.0
    assert pm["precision"]["missing_steps"] == [20, 21, 22] and pm["precision"]["scaler_skips"] == 3
    from cockpit_like.spikes.report import format_post_mortem

    assert "3 steps skipped by the GradScaler" in format_post_mortem(23, pm)
    found = [f for f in diagnose(output).findings if f.rule == "loss-spike"]
    assert [(f.step, f.evidence["cause"]) for f in found] == [(23, "precision")]
    assert "3 steps skipped by the GradScaler" in found[0].message and "fp16" in found[0].fix
    healthy, _, nonfinite = _fp16_run(False)
    assert not any(nonfinite) and not any("PostMortem" in v for v in healthy.get_output().values())


def test_the_run_is_unchanged():
    """Training with PostMortem (and RowSummaries) gives bit-identical parameters and RNG state."""
    def train(track: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        quantities = [PostMortem(linear(1), warmup=2, window=3), RowSummaries(linear(1))]
        cockpit = Cockpit(model.parameters(), quantities=quantities, model=model) if track else None
        for step in range(6):
            x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
            optimizer.zero_grad()
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            if cockpit is None:
                losses.mean().backward()
            else:
                with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean(),
                                         "optimizer": optimizer, "sample_ids": list(range(8))}):
                    losses.mean().backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()], torch.rand(1)

    (with_params, with_rng), (without_params, without_rng) = train(True), train(False)
    assert all(torch.equal(a, b) for a, b in zip(with_params, without_params)) and torch.equal(with_rng, without_rng)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sharpness_evidence_from_hess_max_ev():
    """PostMortem(sharpness=HessMaxEV quantity) reads the sharpness of the step and compares it with 2/lr."""
    from cockpit_like.quantities import HessMaxEV

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    hess = HessMaxEV(linear(1))
    post = PostMortem(linear(1), warmup=3, window=5, sharpness=hess, record_all=True)
    cockpit = Cockpit(model.parameters(), quantities=[hess, post], model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(6):
        x, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": 16, "individual_losses": losses, "loss": losses.mean(),
                                 "optimizer": optimizer}):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    stored = {s: v["PostMortem"] for s, v in cockpit.get_output().items() if "PostMortem" in v}
    assert stored  # record_all: every step after the warmup
    for step, pm in stored.items():
        assert pm["sharpness"]["step"] == step and pm["sharpness"]["value"] == hess.output[step]
        assert math.isclose(pm["sharpness"]["ratio"], hess.output[step] * 0.2 / 2) and "curvature" in pm["checks"]
    with pytest.raises(ValueError, match="layer_updates must be True or False"):  # "no" was taken as True (trial 9)
        PostMortem(linear(1), layer_updates="no")
    with pytest.raises(ValueError, match="takes the HessMaxEV quantity"):
        PostMortem(linear(1), sharpness=3.0)


def test_sample_ids_across_ranks():
    """Under torch.distributed (two ranks simulated) integer ids are concatenated rank after rank, like
    individual_losses; string ids cannot travel: a clear error."""
    from cockpit_like.backends.distributed import RankReduction
    from cockpit_like.backends.partitions import PartitionError, _merged_info
    from tests.test_distributed_reduction import _FakeRanks

    ids = {0: torch.tensor([10, 11]), 1: [20, 21]}
    record, merged = {}, {}
    for rank in (1, 0):
        reduction = RankReduction(_FakeRanks(rank, record), 2, 4, step=0, device="cpu")
        finish = _merged_info({"sample_ids": ids[rank], "individual_losses": torch.ones(2) * rank}, reduction)
        reduction.run()
        merged[rank] = finish()
    assert merged[0]["sample_ids"].tolist() == [10, 11, 20, 21] and merged[0]["sample_ids"].dtype == torch.int64
    assert merged[0]["individual_losses"].tolist() == [0.0, 0.0, 1.0, 1.0]
    reduction = RankReduction(_FakeRanks(0, {}), 2, 4, step=0, device="cpu")
    with pytest.raises(PartitionError, match="string info\\['sample_ids'\\] cannot be gathered across ranks"):
        _merged_info({"sample_ids": ["a", "b"]}, reduction)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lightning_passes_sample_ids(tmp_path):
    """A training_step that returns "sample_ids" (indices its data set yields) names the rows of RowSummaries."""
    L = pytest.importorskip("lightning")
    from cockpit_like.integrations.lightning import CockpitCallback, CockpitModule

    class Indexed(torch.utils.data.Dataset):
        def __init__(self):
            generator = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(12, 5, generator=generator), torch.randint(0, 3, (12,), generator=generator)

        def __len__(self):
            return 12

        def __getitem__(self, index):
            return index, self.x[index], self.y[index]

    class Net(CockpitModule, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))

        def training_step(self, batch, batch_idx):
            index, x, y = batch
            losses = nn.functional.cross_entropy(self.model(x), y, reduction="none")
            return {"loss": losses.mean(), "individual_losses": losses, "sample_ids": index}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    net = Net()
    rows = RowSummaries(linear(1), top_k=4)
    cockpit = Cockpit(net.parameters(), quantities=[rows], model=net.model)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                        callbacks=[CockpitCallback(cockpit)])
    trainer.fit(net, torch.utils.data.DataLoader(Indexed(), batch_size=4, shuffle=False))
    output = cockpit.get_output()
    assert sorted(output) == [0, 1, 2]
    for step, values in output.items():
        assert sorted(r["id"] for r in values["RowSummaries"]["rows"]) == list(range(4 * step, 4 * step + 4))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_passes_sample_ids(tmp_path):
    """A "sample_ids" column reaches the cockpit (and not the model) through CockpitTrainer."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from cockpit_like.integrations.transformers import CockpitCallback, CockpitTrainer
    from tests.test_transformers import Rows, _bert, _bert_data

    model = _bert()
    data = {**_bert_data(), "sample_ids": torch.arange(8) + 500}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, learning_rate=0.1,
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to="none", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, seed=0, train_sampling_strategy="sequential", save_strategy="no", remove_unused_columns=False)
    rows = RowSummaries(linear(1), top_k=4)
    cockpit = Cockpit(model.parameters(), quantities=[rows], model=model)
    trainer = CockpitTrainer(model=model, args=args, train_dataset=Rows(**data),
                             optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
                             callbacks=[CockpitCallback(cockpit)])
    trainer.train()
    output = cockpit.get_output()
    assert sorted(output) == [0, 1]
    for step, values in output.items():
        assert sorted(r["id"] for r in values["RowSummaries"]["rows"]) == list(range(500 + 4 * step, 504 + 4 * step))


def test_corpus_replay_is_exact():
    """Replaying the detector over a run recorded with record_all=True gives what PostMortem stores live."""
    from cockpit_like.spikes.corpus import replay, score, spike_runs, train_spike_run

    run = next(r for r in spike_runs("tuning") if r.arch == "mlp" and r.fault == "repeated-row")
    recorded = train_spike_run(run, record_all=True)
    live = train_spike_run(run)
    replayed = replay(recorded)
    assert [s for s, _ in replayed] == [s for s, _ in live["post_mortems"]] and replayed
    for (_, a), (_, b) in zip(replayed, live["post_mortems"]):
        assert a["cause"] == b["cause"] and a["suspects"] == b["suspects"] and a["trigger"] == b["trigger"]
    table = score([recorded])
    assert table["caught"] == 1 and table["rows_in_top3"] == 1 and table["cause_right"] == 1
    assert (table["row_faults"], table["row_faults_at_onset"], table["row_faults_at_onset_by_loss"]) == (1, 1, 1)
    assert score([{**recorded, "run": {**recorded["run"], "onset": recorded["run"]["onset"] - 1}}])["row_faults_at_onset"] == 0
    assert replay(recorded, {"z": 1e6}) == []  # a stricter detector finds nothing: the replay reads its settings


def test_corpus_fp16_overflow_run():
    """The corpus's fp16 fault trains under CPU autocast with a GradScaler; its replay is what PostMortem stores
    live, and it is caught with the cause precision."""
    from cockpit_like.spikes.corpus import FP16_ARCHS, replay, score, spike_runs, train_spike_run

    run = next(r for r in spike_runs("tuning") if r.arch == "mlp" and r.fault == "fp16-overflow")
    recorded = train_spike_run(run, record_all=True)
    live = train_spike_run(run)
    assert [s for s, _ in replay(recorded)] == [s for s, _ in live["post_mortems"]] == [run.onset + 3]
    assert live["post_mortems"][0][1]["cause"] == "precision"
    assert [row[4] for row in recorded["series"] if row[4]] == [3]
    table = score([recorded])
    assert table["caught"] == 1 and table["cause_right"] == 1 and table["row_spikes"] == 0
    assert all(r.arch in FP16_ARCHS for half in ("tuning", "held-out") for r in spike_runs(half)
               if r.precision == "fp16")


def test_dashboard_shows_the_last_post_mortem():
    """The dashboard gets the post-mortem panel once the run holds a post-mortem, beside the check engine,
    overlapping nothing; a run without one keeps Cockpit's layout, axes for axes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from cockpit_like import CockpitPlotter
    from cockpit_like.plotting.instruments import PRIMARY
    from cockpit_like.plotting.layout import PRIMARY_SIZE, build_layout

    cockpit, _ = _spiky_run("row", steps=25)
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False)
    axes = plotter.axes
    assert set(axes) == set(PRIMARY) | {"post_mortem"}
    panel = axes["post_mortem"]
    bars = [p for p in panel.patches if p.get_gid() == "post-mortem:rows"]
    post = cockpit.get_output()[22]["PostMortem"]
    assert math.isclose(max(p.get_width() for p in bars), post["rows_by_share"][0]["share"], rel_tol=1e-9)
    assert panel.get_gid() == "instrument:post_mortem" and "step 22: bad-rows" in panel.get_title()
    boxes = {key: ax.get_position() for key, ax in axes.items()}
    assert boxes["post_mortem"].x0 > boxes["findings"].x1
    for key, box in boxes.items():
        if key != "post_mortem":
            assert not box.overlaps(boxes["post_mortem"]), key
    without = {step: {k: v for k, v in values.items() if k != "PostMortem"}
               for step, values in cockpit.get_output().items()}
    plain = CockpitPlotter()
    plain.plot(without, show_plot=False)
    reference = build_layout(Figure(figsize=PRIMARY_SIZE), secondary_screen=False)
    assert set(plain.axes) == set(reference.axes) == set(PRIMARY)
    for key, ax in plain.axes.items():
        assert list(ax.get_position().bounds) == list(reference.axes[key].get_position().bounds), key
    plotter.plot(without, show_plot=False)  # the same plotter drops the panel when the data has none
    assert "post_mortem" not in plotter.axes


# ---- sample ids under real DDP (2 gloo ranks, spawned) ------------------------------------------------
DDP_SPIKE, DDP_ROW, DDP_LOCAL = 9, 13, 8  # the spike's step, its global row (rank 1's row 5), rows per rank


def _ddp_batch(step: int, centers: torch.Tensor):
    """The global batch of ``step`` (2 x 8 rows, the same on every rank): inputs, labels, dataset ids (a random
    draw, not sorted: an order other than rank after rank shows); the spike's row x1e3 with a wrong label."""
    generator = torch.Generator().manual_seed(step)
    labels = torch.randint(0, 4, (2 * DDP_LOCAL,), generator=generator)
    x = centers[labels] + torch.randn(2 * DDP_LOCAL, 6, generator=generator)
    ids = torch.randperm(10_000, generator=generator)[: 2 * DDP_LOCAL]
    if step == DDP_SPIKE:
        x[DDP_ROW] *= 1e3
        labels[DDP_ROW] = (labels[DDP_ROW] + 1) % 4
    return x, labels, ids


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def _job_ddp_sample_ids(rank: int) -> dict:
    """Each rank trains on its half of the global batch with its rows' ids; rank 0 keeps the output."""
    from cockpit_like.spikes import RowSummaries

    model = _ddp_model()
    net = nn.parallel.DistributedDataParallel(model)
    centers = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 2
    post = PostMortem(linear(1), window=5, warmup=4, layer_updates=False)
    rows = RowSummaries(linear(1), top_k=2 * DDP_LOCAL)  # every row of the global batch
    cockpit = Cockpit(model.parameters(), quantities=[post, rows], model=net, distributed_timeout=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = None
    mine = slice(rank * DDP_LOCAL, (rank + 1) * DDP_LOCAL)
    for step in range(DDP_SPIKE + 1):
        x, labels, ids = _ddp_batch(step, centers)
        if step == DDP_SPIKE:
            state = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(net(x[mine]), labels[mine], reduction="none")
        with cockpit(step, info={"batch_size": DDP_LOCAL, "individual_losses": losses, "loss": losses.mean(),
                                 "optimizer": optimizer, "sample_ids": ids[mine]}):
            losses.mean().backward()
        optimizer.step()
    return {"output": cockpit.get_output() if rank == 0 else None, "state": state}


def test_sample_ids_under_ddp_name_the_global_row(tmp_path):
    """Two gloo ranks (spawned, CPU): integer sample ids are concatenated rank after rank (every row of every
    step), and the post-mortem at the spike names the injected row of rank 1 by its global row and dataset id,
    with the share of a float64 brute force on the global batch."""
    from tests.test_distributed import _spawn

    ranks = _spawn("tests.test_spikes:_job_ddp_sample_ids", tmp_path, timeout=60)
    output = ranks[0]["output"]
    centers = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)) * 2
    for step in range(DDP_SPIKE + 1):
        ids = _ddp_batch(step, centers)[2].tolist()
        kept = output[step]["RowSummaries"]["rows"]
        assert sorted(r["row"] for r in kept) == list(range(2 * DDP_LOCAL))
        assert all(r["id"] == ids[r["row"]] for r in kept), step
    spikes = [s for s, v in output.items() if "PostMortem" in v]
    assert spikes == [DDP_SPIKE]
    post = output[DDP_SPIKE]["PostMortem"]
    x, labels, ids = _ddp_batch(DDP_SPIKE, centers)
    top = post["rows_by_share"][0]
    assert (top["row"], top["id"]) == (DDP_ROW, int(ids[DDP_ROW])) and post["cause"] == "bad-rows"
    assert post["suspects"][0]["id"] == int(ids[DDP_ROW])
    model = _ddp_model().double()  # the brute force: per-row gradients of the global batch, float64
    model.load_state_dict({k: v.double() for k, v in ranks[0]["state"].items()})
    rows = []
    for i in range(2 * DDP_LOCAL):
        loss = nn.functional.cross_entropy(model(x[i:i + 1].double()), labels[i:i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))]))
    per_row = torch.stack(rows) / (2 * DDP_LOCAL)  # g_i / B
    total = per_row.sum(0)
    shares = per_row @ total / total.dot(total)
    assert math.isclose(top["share"], float(shares[DDP_ROW]), rel_tol=1e-4)
    assert int(shares.argmax()) == DDP_ROW


def test_spike_corpus_table_has_the_gpt2_small_column(tmp_path):
    """benchmarks/spike_corpus.py: the table's columns (the halves and the GPT-2 small slice, read from its own
    cache only when every run of its seeds is there)."""
    import importlib.util

    from cockpit_like.spikes.corpus import gpt2_small_runs, score, spike_runs, train_spike_run

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "spike_corpus.py"
    spec = importlib.util.spec_from_file_location("_bench_spike_corpus", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run = next(r for r in spike_runs("tuning") if r.arch == "mlp" and r.fault == "fp16-overflow")
    scores = {half: {**score([train_spike_run(run, record_all=True)]), "archs": [half]}
              for half in ("tuning", "gpt2-small")}
    text = bench.table(scores)
    assert "held-out: GPT-2 small (gpt2-small)" in text.splitlines()[0]
    assert "| fp16-overflow | 1/1, 0, 1 (precision: 1) | 1/1, 0, 1 (precision: 1) |" in text
    cache = tmp_path / "gpt2.jsonl"
    assert not bench._cached((0,), cache)
    cache.write_text("".join(f'{{"name": "{r.name}", "version": {bench.VERSION}}}\n' for r in gpt2_small_runs(0)))
    assert bench._cached((0,), cache) and not bench._cached((0, 1), cache)


def test_spike_cost_inside_the_step_adds_no_per_sample_statistic():
    """``benchmarks/spike_cost.py --inside``: PostMortem asks the backward pass for nothing the economy preset
    does not reduce already (its GramSummary is the gradient tests'), and its own work is timed inside the step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("spike_cost", Path(__file__).resolve().parents[1] / "benchmarks" / "spike_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.inside(steps=2)
    assert result["extra_per_sample_statistics"] == []
    assert 0 < result["median_post_mortem_seconds"] < result["median_step_seconds"]
