"""Mixed precision: a ``GradScaler`` in ``info["grad_scaler"]``, skipped steps, half-precision tolerances.

- float64 with a GradScaler (scales are powers of two, so scaling is exact):
  every quantity of every preset equals the run without scaling (rtol 1e-10),
  also with accumulation;
- a step whose scaled gradients overflow is stored as skipped (output, stream),
  with no record, no finding and no warning of a non-finite loss, and the next
  step is tracked as usual;
- fp16 and bf16 autocast on CPU: within the tolerance documented in
  docs/your_training_loop.md of the float64 reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cockpit_like import Cockpit, read_log
from cockpit_like.utils.configuration import configuration
from tests.helpers import make_batch, make_problem
from tests.test_accumulation import _assert_close, _without_time

STEPS, ROWS = 3, 8


def _run(preset, scaler_scale=None, micro_batches=1, dtype=torch.float64, autocast=None, **cockpit_args):
    model, lossfunc, individual = make_problem("mlp")
    model = model.to(dtype)
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model, **cockpit_args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = None if scaler_scale is None else torch.amp.GradScaler("cpu", init_scale=scaler_scale, growth_interval=1000)
    size = ROWS // micro_batches
    for step in range(STEPS):
        inputs, labels = make_batch("mlp", ROWS, 200 + step)
        inputs = inputs.to(dtype)
        optimizer.zero_grad()
        for micro in range(micro_batches):
            part = slice(micro * size, (micro + 1) * size)
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                outputs = model(inputs[part])
                loss = lossfunc(outputs, labels[part])
                losses = individual(outputs, labels[part])
            info = {"batch_size": size, "individual_losses": losses, "loss": loss, "optimizer": optimizer,
                    "micro_batches": micro_batches}  # fmt: skip
            backward = loss / micro_batches
            if scaler is not None:
                info["grad_scaler"] = scaler
                backward = scaler.scale(backward)
            if micro == micro_batches - 1:
                torch.manual_seed(step)
            with cockpit(step, info=info):
                backward.backward(create_graph=cockpit.create_graph(step))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return cockpit


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("preset", ["economy", "business", "full"])
def test_grad_scaler_reports_the_unscaled_gradient(preset, micro_batches):
    reference = _without_time(_run(preset, micro_batches=micro_batches).get_output())
    scaled = _without_time(_run(preset, scaler_scale=2.0**16, micro_batches=micro_batches).get_output())
    assert len(reference) == STEPS
    _assert_close(scaled, reference, f"{preset}/K={micro_batches}", rtol=1e-10)


def test_without_the_scaler_in_info_the_factor_is_seen():
    """Issue 34: a scaled backward pass the cockpit is not told about (it was 2**16 times off) is seen on
    info['loss'] and unscaled: the numbers of the plain run, and the step's checks say what was seen."""
    reference = _run("economy").get_output()
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inputs, labels = make_batch("mlp", ROWS, 200)
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": ROWS, "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
    with cockpit(0, info=info):
        (loss * 2.0**16).backward()
    ratio = sum(cockpit.get_output()[0]["GradNorm"]) / sum(reference[0]["GradNorm"])
    assert ratio == pytest.approx(1.0, rel=1e-10)
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(reference[0]["NormTest"], rel=1e-10)
    checks = cockpit.get_output()[0]["checks"]
    assert checks["valid"] and checks["loss_factor"] == 2.0**16 and checks["assumed_factor"] == 1.0


def test_a_skipped_step_is_stored_as_skipped(tmp_path):
    """Scaled gradients that overflow: the scaler skips the step; so does the cockpit (no record, no finding)."""
    findings = []
    model, lossfunc, individual = make_problem("mlp")
    model = model.float()
    cockpit = Cockpit(
        model.parameters(), quantities=configuration("economy"), model=model, stream_to=tmp_path / "run",
        diagnose=True, on_finding=findings.append,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(4):
        if step == 1:
            scaler.update(new_scale=2.0**127)  # the scaled loss overflows float32
        inputs, labels = make_batch("mlp", ROWS, step)
        optimizer.zero_grad()
        outputs = model(inputs.float())
        factor = 4.0 if step == 1 else 1.0  # 4 x 1.4 x 2**127 overflows float32
        loss = lossfunc(outputs, labels) * factor
        info = {"batch_size": ROWS, "individual_losses": individual(outputs, labels) * factor, "loss": loss,
                "optimizer": optimizer, "grad_scaler": scaler}  # fmt: skip
        with cockpit(step, info=info):
            scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert moved == (step != 1)  # the scaler really skipped step 1 (and only it)
    output = cockpit.get_output()
    assert output[1] == {"skipped": {"reason": "grad_scaler", "scale": 2.0**127}}
    assert cockpit.skipped_steps == {1: {"reason": "grad_scaler", "scale": 2.0**127}}
    for step in (0, 2, 3):
        assert "skipped" not in output[step] and math.isfinite(sum(output[step]["GradNorm"]))
    assert not cockpit.records and "record" not in output[1]
    assert not [f for f in findings if f.step == 1]
    streamed = read_log(tmp_path / "run.jsonl")
    assert streamed[1] == output[1]
    # the gradients the scaler saw were not changed by the cockpit
    assert all(p.grad is not None for p in model.parameters())
    # a resumed run keeps them, from the checkpoint and from the stream
    for with_output in (True, False):
        resumed = Cockpit(model.parameters(), quantities=configuration("economy"), model=model,
                          stream_to=tmp_path / "run", diagnose=True)  # fmt: skip
        resumed.load_state_dict(cockpit.state_dict(with_output=with_output))
        assert resumed.skipped_steps == {1: {"reason": "grad_scaler", "scale": 2.0**127}}, with_output
        resumed.close()
    # the dashboard says so, live and from the log
    from cockpit_like import CockpitPlotter

    cockpit.write(tmp_path / "run")
    for source in (cockpit, str(tmp_path / "run.json")):
        figure = CockpitPlotter().plot(source, show_plot=False, save_plot=False)
        assert "1 step skipped by the GradScaler (last: 1)" in figure._suptitle.get_text()


@pytest.mark.parametrize("scaled", [True, False])
def test_a_non_finite_loss_warns_only_where_the_step_is_tracked(scaled):
    """A step whose loss is infinite: under a GradScaler it is skipped (no value, no record), so the cockpit does
    not warn that its quantities store NaN; without a scaler the same step is tracked, and it warns. A non-finite
    loss whose gradients are finite (an infinite term without a graph) is not skipped: it warns under a scaler too."""
    model, lossfunc, individual = make_problem("mlp")
    model = model.float()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    told = {}
    for step in range(4):
        inputs, labels = make_batch("mlp", ROWS, step)
        optimizer.zero_grad()
        outputs = model(inputs.float())
        losses = individual(outputs, labels)
        if step == 1:  # an infinite loss with infinite gradients
            losses = losses * math.inf
        if step == 2:  # an infinite loss with finite gradients: an infinite constant added
            losses = losses + torch.tensor(math.inf)
        loss = losses.mean()
        info = {"batch_size": ROWS, "individual_losses": losses, "loss": loss, "optimizer": optimizer}
        if scaled:
            info["grad_scaler"] = scaler
        with _recorded_warnings() as caught:
            with cockpit(step, info=info):
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        told[step] = [w for w in caught if f"step {step}: the loss is " in str(w.message)]
    assert (1 in cockpit.skipped_steps) == scaled and 2 not in cockpit.skipped_steps
    assert told[0] == []
    if scaled:  # the skipped step left the model as it was (without a scaler, SGD stepped to NaN at step 1)
        assert told[3] == []
    assert len(told[1]) == (0 if scaled else 1)  # a skipped step stores nothing: no warning that says it does
    # told once per run (a run gone NaN warned at every step after it: 298 lines in outside trial 15)
    first = 2 if scaled else 1
    assert len(told[first]) == 1 and "store NaN for this step" in str(told[first][0].message)
    assert "told once" in str(told[first][0].message) and (scaled or told[2] == [])
    # the warnings name the training loop's line, not one of the package
    assert {w.filename for step in (1, 2) for w in told[step]} == {__file__}


class _recorded_warnings:
    """A ``with`` block that records every warning raised in it."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        caught = self._catch.__enter__()
        warnings.simplefilter("always")
        return caught

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


def _relative(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_autocast_within_the_documented_tolerance(half):
    """Autocast on CPU (parameters in float32), with a GradScaler for fp16: close to the float64 reference.

    Documented tolerance (docs/your_training_loop.md): 2% relative for the gradient norm, the gradient
    tests, the loss and alpha in bf16 (8 mantissa bits; measured at most 0.44%), 0.2% in fp16 (measured
    at most 0.05%). The per-sample statistics accumulate in float32.
    """
    reference = _run("economy").get_output()
    low = _run("economy", scaler_scale=2.0**8 if half is torch.float16 else None, dtype=torch.float32, autocast=half)
    output = low.get_output()
    tolerance = 2e-3 if half is torch.float16 else 2e-2
    for step in range(STEPS):
        for name in ("GradNorm", "NormTest", "InnerTest", "OrthoTest", "Loss"):
            assert _relative(output[step][name], reference[step][name]) < tolerance, (step, name)
    for step in range(STEPS - 1):
        assert abs(output[step]["Alpha"] - reference[step]["Alpha"]) < tolerance * max(1.0, abs(reference[step]["Alpha"]))


def test_half_precision_rows_reach_the_statistics_in_float32():
    from cockpit_like.backends.per_sample import PerSampleReducer
    from cockpit_like.backends.per_sample_stats import SumOfSquares

    param = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
    reducer = PerSampleReducer([SumOfSquares()], [param], keep_grad_batch=False, row_scale=0.5)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    delta = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, 0.0]], dtype=torch.bfloat16)
    reducer.reduce_factors(param, "weight", x, delta)
    result = reducer.results()[SumOfSquares()][0]
    assert result.dtype == torch.float32
    expected = ((0.5 * delta.double()).square().T @ x.double().square()).float()
    torch.testing.assert_close(result, expected)


def test_grad_scaler_in_info_must_be_a_scaler():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    inputs, labels = make_batch("mlp", 4, 0)
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(ValueError, match=r"info\['grad_scaler'\] must be the torch.amp.GradScaler"):
        with cockpit(0, info={"batch_size": 4, "loss": loss, "individual_losses": loss.repeat(4),
                              "optimizer": None, "grad_scaler": 1024.0}):  # fmt: skip
            loss.backward()


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_parameters_within_the_documented_tolerance(half):
    """Pure low-precision training (parameters and gradients in fp16 / bf16): the same tolerances
    (measured at most 0.06% in fp16, 0.42% in bf16)."""
    reference = _run("economy").get_output()
    output = _run("economy", dtype=half).get_output()
    tolerance = 2e-3 if half is torch.float16 else 2e-2
    for step in range(STEPS):
        for name in ("GradNorm", "NormTest", "InnerTest", "OrthoTest", "Loss"):
            assert _relative(output[step][name], reference[step][name]) < tolerance, (step, name)


class _Tokens(torch.nn.Module):
    """Tokens ``[B, T, 8]`` through Linear, LayerNorm, GELU, Linear, averaged over the positions."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 5))

    def forward(self, x):
        return self.body(x).mean(1)


def _bf16_tokens(steps: int, tamper: bool = False, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = _Tokens().to(dtype)
    if tamper:  # a gradient the rows do not see: a hook adds to one Linear layer's gradient
        model.body[3].weight.register_hook(lambda grad: grad + 0.05)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 65, 8, generator=generator).to(dtype)
        y = torch.randint(0, 5, (32,), generator=generator)
        optimizer.zero_grad()
        rows = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": 32, "individual_losses": rows, "loss": rows.mean(), "optimizer": optimizer}):
            rows.mean().backward()
        optimizer.step()
    return cockpit


def test_bf16_parameters_norm_layers_are_not_compared_and_say_so():
    """bfloat16 parameters, a LayerNorm over 32 x 65 positions: autograd sums the bias's and weight's terms in
    bfloat16 (measured up to 38 units of rounding of their absolute sums off entry by entry on a ViT, 22-73% of the
    gradient on a ConvNeXt), so p.grad is no reference for the rows. Before, steps failed the gradient check at the
    LayerNorm (outside trial 14: a ViT's on 10 of 18 steps, GPT-2's on 3 of 8 at batch 64); now a norm layer's
    half-precision p.grad is not compared and the record names it (`unverified`); every other layer is compared as
    before: a gradient the rows do not see still fails the step at its layer."""
    cockpit = _bf16_tokens(6)
    assert cockpit.invalid_steps == {}
    assert all(c["gradient"]["unverified"] == ["body.1.weight", "body.1.bias"] for c in cockpit.checks.values())
    tampered = _bf16_tokens(2, tamper=True)
    assert set(tampered.invalid_steps) == {0, 1}
    reasons = [f["reason"] for c in tampered.checks.values() for f in c["failed"]]
    assert all("body.3.weight" in r for r in reasons) and not any("body.1." in r for r in reasons)
    assert all("half-precision parameters" in r for r in reasons)
    float32 = _bf16_tokens(2, dtype=torch.float32)  # in float32 every layer is compared
    assert all("unverified" not in c["gradient"] for c in float32.checks.values())


class _TokenTypes(torch.nn.Module):
    """Token ids and token types ``[B, T]`` (2 types, as BERT's), embedded, summed, through a Linear head."""

    def __init__(self):
        super().__init__()
        self.types, self.words = torch.nn.Embedding(2, 16), torch.nn.Embedding(4096, 16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, ids, types):
        return self.head(self.words(ids) + self.types(types)).mean(1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_half_precision_embeddings_summed_over_more_positions_than_rows_are_not_compared(dtype):
    """A token-type embedding (2 rows) over 32 x 65 positions: in half precision autograd sums each row's terms in
    half precision (BERT's in fp16: p.grad 10-15% off, the check failed on 5 of 16 steps in outside trial 17). Such
    an embedding is named unverified, as a norm layer; one with more rows than positions is compared, and every
    embedding is in float32."""
    torch.manual_seed(0)
    model = _TokenTypes().to(dtype)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        ids, types = torch.randint(0, 4096, (32, 65), generator=generator), torch.randint(0, 2, (32, 65), generator=generator)
        rows = torch.nn.functional.cross_entropy(model(ids, types).float(), torch.randint(0, 5, (32,), generator=generator), reduction="none")
        with cockpit(step, info={"batch_size": 32, "individual_losses": rows, "loss": rows.mean()}):
            rows.mean().backward()
        model.zero_grad()
    assert cockpit.invalid_steps == {}
    unverified = [c["gradient"].get("unverified", []) for c in cockpit.checks.values()]
    assert unverified == ([["types.weight"]] * 3 if dtype == torch.float16 else [[]] * 3)


class _PositionBias(torch.nn.Module):
    """Attention scores plus a bias read from a table of 8 buckets over the ``[T, T]`` offsets, shared by every
    row: T5's relative position bias, an embedding called on a table without a batch dimension (its parameters
    climb to the model's call, re-run row by row)."""

    def __init__(self, length=48, width=16):
        super().__init__()
        self.qk, self.bias = torch.nn.Linear(width, 2 * width), torch.nn.Embedding(8, 1)
        self.head = torch.nn.Linear(width, 5)
        offsets = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        self.register_buffer("buckets", offsets.clamp(-4, 3) + 4)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        scores = q @ k.transpose(1, 2) / 4 + self.bias(self.buckets).squeeze(-1)
        return self.head((scores.softmax(-1) @ x).mean(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_half_precision_position_bias_shared_by_the_rows_is_named_unverified(dtype):
    """The embedding's rows come from the enclosing call's re-run, while autograd still sums its gradient over
    the 48 x 48 positions in half precision: in bfloat16 every step failed the gradient check at it (T5's
    relative position bias, outside trial 17: 9 of 32 steps). Such an embedding is named unverified wherever its
    rows come from; in float32 it is compared."""
    torch.manual_seed(0)
    model = _PositionBias().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(32, 48, 16, generator=generator).to(dtype), torch.randint(0, 5, (32,), generator=generator)
        rows = torch.nn.functional.cross_entropy(model(x).float(), y, reduction="none")
        optimizer.zero_grad()
        with cockpit(step, info={"batch_size": 32, "individual_losses": rows, "loss": rows.mean(), "optimizer": optimizer}):
            rows.mean().backward()
        optimizer.step()
    assert cockpit.invalid_steps == {}
    unverified = [c["gradient"].get("unverified", []) for c in cockpit.checks.values()]
    assert unverified == ([[]] * 3 if dtype == torch.float32 else [["bias.weight"]] * 3)


def test_gradient_histograms_of_bfloat16_parameters_are_stored_in_float32():
    """numpy has no bfloat16: a bfloat16 convolution's GradHist1d counts stopped training (TypeError, outside
    trial 17). They are stored as float32 (every bfloat16 value exactly), all the entries counted."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1)).to(torch.bfloat16)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    x = torch.randn(8, 3, 8, 8).to(torch.bfloat16)
    losses = model(x).float().pow(2).flatten(1).mean(1)
    with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    hist = cockpit.get_output()[0]["GradHist1d"]["hist"]
    assert hist.dtype == np.float32 and hist.sum() == 8 * sum(p.numel() for p in model.parameters())


def test_loss_scale_is_not_a_scaler():
    """info['loss_scale'] (a framework's constant factor, e.g. Lightning's k/K): the quantities describe the
    loss without it (the first step equals the unscaled reference); a bad factor is a clear error."""
    reference = _without_time(_run("economy").get_output())
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        inputs, labels = make_batch("mlp", ROWS, 200 + step)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        info = {"batch_size": ROWS, "individual_losses": individual(outputs, labels), "loss": loss,
                "optimizer": optimizer, "loss_scale": 0.5}  # fmt: skip
        with cockpit(step, info=info):
            (0.5 * loss).backward()
        optimizer.step()  # with half the gradient: the parameters follow another path than the reference
    first = _without_time(cockpit.get_output())[0]
    for name in ("GradNorm", "NormTest", "InnerTest", "OrthoTest", "Loss"):
        _assert_close(first[name], reference[0][name], name, rtol=1e-10)
    with pytest.raises(ValueError, match=r"info\['loss_scale'\] must be a positive finite number"):
        with cockpit(STEPS, info={"batch_size": ROWS, "loss": loss, "individual_losses": individual(outputs, labels),
                                  "optimizer": optimizer, "loss_scale": 0.0}):  # fmt: skip
            pass


class _Attention(torch.nn.Module):
    """A linear embedding, one ``nn.MultiheadAttention`` (the hook backend's rule recomputes it) and a head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 16)
        self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.embed(x)
        return self.head((h + self.attention(h, h, h, need_weights=False)[0]).mean(1))


def _hooked_run(name, dtype=torch.float64, autocast=None, steps=4):
    """A model the cockpit reaches through module hooks (not extended): a CNN or an attention model, economy,
    with a GradScaler under fp16 autocast."""
    torch.manual_seed(0)
    if name == "cnn":
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(6, 6, 3, padding=1),
                                    torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(6 * 36, 3))
        shape = (ROWS, 1, 6, 6)
    else:
        model, shape = _Attention(), (ROWS, 5, 6)
    model = model.to(dtype)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=autocast is torch.float16)
    generator = torch.Generator().manual_seed(3)
    for step in range(steps):
        inputs, labels = torch.randn(*shape, generator=generator).to(dtype), torch.randint(0, 3, (ROWS,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
            outputs = model(inputs)
            losses = torch.nn.functional.cross_entropy(outputs.float(), labels, reduction="none")
        info = {"batch_size": ROWS, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
        if autocast is torch.float16:
            info["grad_scaler"] = scaler
        with cockpit(step, info=info):
            scaler.scale(losses.mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    return cockpit


@pytest.mark.parametrize("name", ["cnn", "attention"])
def test_autocast_through_module_hooks_is_checked_in_half_precision(name):
    """fp16 autocast on models the cockpit reaches through module hooks: every step passes its self-check at the
    half-precision tolerance (the rows are made in fp16 and reduced in float32: the reducer tells the probe; at
    the float32 tolerance a convolution bias failed a step), nn.MultiheadAttention's rule recomputes the layer
    under the step's autocast (outside it, it raised a dtype error into the training loop), and the numbers are
    those of the float64 run within 1%."""
    half = _hooked_run(name, dtype=torch.float32, autocast=torch.float16)
    reference = _hooked_run(name).get_output()
    for step, checks in half.checks.items():
        assert checks["valid"] and checks["gradient"]["tolerance"] == 0.05, (step, checks)
    output = half.get_output()
    for step in output:
        for quantity in ("GradNorm", "NormTest", "InnerTest"):
            assert _relative(output[step][quantity], reference[step][quantity]) < 1e-2, (step, quantity)


def test_sequence_forms_of_mixed_dtypes_are_reduced_in_the_wider_one():
    """Under autocast a layer's input and its output gradient can differ (a float32 input, a bfloat16 gradient):
    the rows and the batch sum of a sequence form are made in the wider dtype (a bfloat16 BERT raised a dtype error
    into the training loop from there)."""
    from cockpit_like.backends.per_sample import materialize_sequence, sequence_sum

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, 5, generator=generator)
    b = torch.randn(3, 4, 2, generator=generator).bfloat16()
    expected = torch.einsum("itr,itc->irc", a.double(), b.double())
    rows = materialize_sequence(a, b, torch.Size([5, 2]))
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sequence_sum(b, a).double(), expected.sum(0).T, rtol=1e-6, atol=1e-6)


def test_a_bfloat16_bert_trains_with_the_cockpit():
    """A Hugging Face BERT (from a config) under CPU bfloat16 autocast, economy: every step tracked, no error."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        tokens, labels = torch.randint(0, 64, (ROWS, 12), generator=generator), torch.randint(0, 2, (ROWS,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = torch.nn.functional.cross_entropy(model(tokens).logits.float(), labels, reduction="none")
        with cockpit(step, info={"batch_size": ROWS, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward()
        optimizer.step()
    output = cockpit.get_output()
    assert all("GradNorm" in output[step] for step in range(3))
    assert all(("NormTest" in output[step]) == cockpit.checks[step]["valid"] for step in range(3))


def test_hessian_products_that_overflow_store_no_curvature(monkeypatch):
    """Hessian-vector products that are not finite where the loss and gradients are (found outside the tests: fp16
    autocast, a GradScaler and the full preset on a tiny GPT-2, whose half-precision graph overflowed). Before, the
    Lanczos engine's eigh raised out of optimizer.step() (the cockpit's optimizer hook) and HessTrace stored NaN; now
    the solve stops at the first non-finite product and the curvature quantities store no value, with a note. The
    products are made to overflow from the third on (every engine and Hutchinson product goes through this one
    function)."""
    from cockpit_like.backends import curvature_engine, hvp
    from cockpit_like.utils.configuration import configuration

    real = hvp.hessian_vector_product

    def overflowing(params, owner, local=False):
        matvec, calls = real(params, owner, local=local), [0]

        def product(v):
            calls[0] += 1
            out = matvec(v)
            return out if calls[0] < 3 else out * float("inf")

        return product

    monkeypatch.setattr(curvature_engine, "hessian_vector_product", overflowing)
    monkeypatch.setattr(hvp, "hessian_vector_product", overflowing)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        outputs = model(x)
        losses = torch.nn.functional.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer,
                "outputs": outputs}  # fmt: skip
        with cockpit(step, info=info):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    output = cockpit.get_output()
    for step in output:
        notes = " ".join(cockpit.checks[step].get("notes", []))
        for name in ("HessMaxEV", "HessTrace"):
            assert name not in output[step], (step, name)
            assert f"{name} at step {step}: no value stored" in notes and "not finite" in notes, (step, name)
        assert "GradNorm" in output[step]  # the rest of the step is stored


def test_bf16_autocast_on_a_layernorm_mlp_gives_no_false_gradient_check_failures():
    """An ordinary bf16 autocast loop (found outside the tests: a LayerNorm MLP on digits, B=128, AdamW): before, 19
    of 120 steps failed the gradient check, always at the LayerNorm, whose rows reach the probe as their sum: the
    deviation was measured against one random projection of that sum, which is near 0 by chance at a few percent of
    the steps. Now the scale is at least the gradient's norm (a projection's typical size): no step fails, and a
    wrong decomposition still does (tests/test_self_checks.py)."""
    from sklearn.datasets import load_digits

    from cockpit_like.utils.configuration import configuration

    digits = load_digits()
    x, y = torch.tensor(digits.data / 16, dtype=torch.float32), torch.tensor(digits.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(0)
    for step in range(60):
        rows = torch.randint(0, len(x), (128,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = torch.nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="none")
        with cockpit(step, info={"batch_size": 128, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward()
        optimizer.step()
    assert cockpit.invalid_steps == {}
    worst = max(check["gradient"]["worst"] for check in cockpit.checks.values())
    assert 0.0 < worst < 0.05


def test_bf16_autocast_with_adamw_stores_alpha_from_the_first_step():
    """Alpha predicts the update from the per-sample rows' sum, which under autocast may be as far from p.grad as
    the gradient check allows (5e-2); Adam's first step, about sign(g), turns that into a 2% change of direction.
    Before, the float32 tolerance (5e-3) was applied: Alpha of step 0 was not stored and its note blamed clipping or a
    loss factor (found outside the tests on GPT-2 and BERT); now the start step's tolerance is."""
    from cockpit_like.quantities import Alpha
    from cockpit_like.utils.schedules import linear

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model.parameters(), quantities=[Alpha(linear(1))], model=model)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, 32, (8, 32), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits[:, :-1]
            losses = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1), reduction="none")
            losses = losses.view(8, -1).mean(1)
        with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward()
        optimizer.step()
    output = cockpit.get_output()
    assert math.isfinite(output[0]["Alpha"]) and math.isfinite(output[1]["Alpha"])
    assert not [n for s in (0, 1) for n in cockpit.checks.get(s, {}).get("notes", []) if "Alpha" in n]


def test_bf16_autocast_with_adamw_names_the_half_precision_rows_where_alpha_of_a_step_is_lost():
    """Where the rows' rounding moves Adam's first update beyond that tolerance (outside trial 14: 4 of 28 bf16
    autocast runs with AdamW, a LayerNorm MLP, gap 0.11), Alpha of that step is still not stored, but the start step
    finds it with a look-ahead on p.grad and says why (the rows in half precision, not clipping or a loss factor the
    loop does not have), and Alpha waits for the optimizer from then on: every later step stores it."""
    import torch.nn.functional as F
    from torch import nn

    lost, wrong = [], []
    for batch, seed in [(b, s) for b in (7, 64) for s in range(8)]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 5))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
        generator = torch.Generator().manual_seed(seed + 1)
        for step in range(3):
            optimizer.zero_grad()
            x, y = torch.randn(batch, 12, generator=generator), torch.randint(0, 5, (batch,), generator=generator)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rows = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, info={"batch_size": batch, "individual_losses": rows, "loss": rows.mean(), "optimizer": optimizer}):
                rows.mean().backward()
            optimizer.step()
        output, notes = cockpit.get_output(), [n for c in cockpit.checks.values() for n in c["notes"] if "Alpha" in n]
        assert cockpit.invalid_steps == {} and "Alpha" in output[1]
        if "Alpha" not in output[0]:
            lost.append((batch, seed))
            wrong += [n for n in notes if "came in half precision" not in n]
    assert not wrong, wrong  # before: "The gradients changed before the optimizer's step (clipping or a loss factor ..."
    assert len(lost) <= 4, lost  # 2 of these 16 on the machines of 2026-11


def test_a_conv1d_under_bf16_autocast_gets_its_rows():
    """Conv1d's hook rule got the recorded float32 input and a bfloat16 output gradient under autocast and raised
    'expected scalar type Float but found BFloat16' inside the backward pass (found outside the tests: a text CNN);
    now both are widened: every step valid, the rows within the half-precision tolerance of p.grad."""
    from cockpit_like.utils.configuration import configuration

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(60, 3))  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(8):
        x, y = torch.randn(8, 4, 10, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = torch.nn.functional.cross_entropy(model(x).float(), y, reduction="none")
        with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward()
        optimizer.step()
    assert cockpit.invalid_steps == {}
    assert all(check["gradient"]["layers"] == 4 for check in cockpit.checks.values())


def test_a_module_re_run_per_row_under_bf16_autocast_runs_in_the_recorded_precision():
    """A GRU (the fallback re-runs it row by row) under bf16 autocast: the re-run ran without autocast on the
    recorded bfloat16 input and raised 'RNN input dtype (torch.bfloat16) does not match weight dtype' (found outside
    the tests: a text model); now it runs under the recorded call's autocast: every step valid."""
    from cockpit_like.utils.configuration import configuration

    class Text(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.gru, self.head = torch.nn.Embedding(20, 8), torch.nn.GRU(8, 8, batch_first=True), torch.nn.Linear(8, 3)

        def forward(self, ids):
            return self.head(self.gru(self.embed(ids))[0][:, -1])

    torch.manual_seed(0)
    model = Text()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        ids, y = torch.randint(0, 20, (6, 5), generator=generator), torch.randint(0, 3, (6,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = torch.nn.functional.cross_entropy(model(ids).float(), y, reduction="none")
        with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward()
        optimizer.step()
    assert cockpit.invalid_steps == {}
    assert all("NormTest" in cockpit.get_output()[step] for step in range(4))
