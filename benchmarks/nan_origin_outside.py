"""The NaN origin on cases it was not built on (issue 36, item 6): small training loops written as a
user would, each with a non-finite value made on purpose at a known step, in a known module and
operation (and micro-batch), or a step that a GradScaler skips (where nothing must be reported).

    python benchmarks/nan_origin_outside.py            # all cases, one line each, then the tally
    python benchmarks/nan_origin_outside.py --json out.json

A case is right when the cockpit's ``nonfinite-origin`` finding is at the expected step, the record's
first non-finite value is in the expected module and operation (a set of acceptable aten names,
written down before the first run from what the code computes) and, for accumulated steps, the
expected micro-batch; for a skipped step, when there is no record and no finding. Training must never
raise. The replay program (``step_<N>.py``) is run for every record and counted apart. The expected
values were fixed before any of these cases was run; none of them is in the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import runpy
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

F = nn.functional


# ---- the users' layers -----------------------------------------------------------------------------
class Cube(nn.Module):
    """A polynomial feature: x**3."""

    def forward(self, x):
        return x.pow(3)


class PlainAttention(nn.Module):
    """Single-head attention without the 1/sqrt(d) scaling and with a hand-written softmax."""

    def __init__(self, width):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):  # x: [B, T, W]
        scores = torch.matmul(self.q(x), self.k(x).transpose(1, 2))
        weights = scores.softmax(-1)
        return torch.matmul(weights, self.v(x)).mean(1)


class NaiveSoftmax(nn.Module):
    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)


class Energy(nn.Module):
    """The squared norm of each row, as a feature."""

    def forward(self, x):
        return torch.cat([x, (x * x).sum(-1, keepdim=True)], -1)


class RsqrtNorm(nn.Module):
    """A layer norm written with E[x²] - E[x]²."""

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) * torch.rsqrt(var)


class Contrast(nn.Module):
    """1 / (first feature - second feature): a ratio feature."""

    def forward(self, x):
        return torch.cat([x, 1.0 / (x[:, :1] - x[:, 1:2])], -1)


class SqrtST(torch.autograd.Function):
    """sqrt with a hand-written backward (grad / (2 sqrt(x))): infinite at 0."""

    @staticmethod
    def forward(ctx, x):
        root = x.clamp_min(0).sqrt()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx, grad):
        (root,) = ctx.saved_tensors
        return grad / (2 * root)


class SqrtFeature(nn.Module):
    def forward(self, x):
        return SqrtST.apply(x)


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=1, keepdim=True)


class Standardize(nn.Module):
    """Standardize each feature over the batch."""

    def forward(self, x):
        return (x - x.mean(0)) / x.std(0)


class Complement(nn.Module):
    """sqrt(1 - p²) of a bounded feature, p = 1.01 tanh(x): NaN where |tanh(x)| > 1/1.01."""

    def forward(self, x):
        p = 1.01 * torch.tanh(x)
        return torch.sqrt(1 - p * p)


class MaskedMix(nn.Module):
    """Mixes the rows of a batch by attention, with a mask of the pairs not to mix."""

    def forward(self, h, mask):
        scores = (h @ h.T).masked_fill(mask, -math.inf)
        return scores.softmax(-1) @ h


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.mix, self.head = nn.Linear(6, 6), MaskedMix(), nn.Linear(6, 3)

    def forward(self, x, mask=None):
        return self.head(self.mix(self.proj(x), mask))


def _mask(at):
    def keywords(step, micro):
        mask = torch.zeros(8, 8, dtype=torch.bool)
        mask[:, 0] = True  # nobody mixes in the first row
        if step == at:
            mask[5] = True  # row 5 may mix with nothing
        return {"mask": mask}
    return keywords


class RootAbs(nn.Module):
    """A signed-magnitude feature sqrt(|x|): its derivative is infinite at 0."""

    def forward(self, x):
        return x.abs().pow(0.5)


# ---- one case -----------------------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (step, micro) -> (x, y)
    steps: int = 3
    expect_step: int | None = None  # None: nothing must be reported (a step the scaler skips)
    expect_module: str = ""
    expect_ops: set[str] = field(default_factory=set)
    expect_micro: int | None = None
    autocast: torch.dtype | None = None
    scaler: str | None = None  # "declared", "undeclared", "disabled"
    init_scale: float = 2.0**16
    micros: int = 1
    declare_micros: bool = True
    loss: Callable | None = None  # (output, y) -> loss; default cross-entropy
    lr: float = 0.01
    keywords: Callable[[int, int], dict] | None = None  # (step, micro) -> keyword inputs of the model
    float_loss: bool = False  # info["loss"] = loss.item(), a number
    compile: bool = False  # torch.compile(model, backend="eager")


def _ce(output, y):
    return F.cross_entropy(output.float(), y)


def run(case: Case, folder: Path) -> dict:
    from cockpit_like import Cockpit
    from cockpit_like.quantities import GradNorm
    from cockpit_like.utils.schedules import linear

    torch.manual_seed(0)
    model = case.model()
    if case.compile:
        model = torch.compile(model, backend="eager")
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model, record_dir=folder)
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr)
    scaler = None
    if case.scaler:
        scaler = torch.amp.GradScaler("cpu", init_scale=case.init_scale, enabled=case.scaler != "disabled")
    lossfunc = case.loss or _ce
    skipped, raised = [], None
    bad = []  # (step, micro) whose loss is not finite or whose backward pass made a gradient non-finite

    def gradients_finite():
        return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(case.steps):
                optimizer.zero_grad()
                for micro in range(case.micros):
                    x, y = case.batch(step, micro)
                    with torch.autocast("cpu", dtype=case.autocast or torch.bfloat16, enabled=case.autocast is not None):
                        keywords = case.keywords(step, micro) if case.keywords else {}
                        loss = lossfunc(model(x, **keywords), y) / case.micros
                    info = {"loss": float(loss) if case.float_loss else loss, "batch_size": len(y), "optimizer": optimizer,
                            "loss_fn": lambda output, y=y: lossfunc(output, y) / case.micros}
                    if case.micros > 1 and case.declare_micros:
                        info["micro_batches"] = case.micros
                    if scaler is not None and case.scaler != "undeclared":
                        info["grad_scaler"] = scaler
                    finite_before = gradients_finite()
                    with cockpit(step, info=info):
                        (loss if scaler is None else scaler.scale(loss)).backward()
                    if not torch.isfinite(loss) or (finite_before and not gradients_finite()):
                        bad.append((step, micro))
                if scaler is None:
                    optimizer.step()
                else:
                    before = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    if scaler.is_enabled() and scaler.get_scale() < before:
                        skipped.append(step)
    except Exception as error:  # noqa: BLE001 - counted: training must never raise
        raised = f"{type(error).__name__}: {error}"
    findings = [f for f in cockpit.findings if f.rule == "nonfinite-origin"]
    result = {"case": case.name, "raised": raised, "records": sorted(cockpit.records), "skipped": skipped,
              "findings": [(f.step, f.message[:160]) for f in findings], "bad": bad}
    if case.expect_step is None:  # valid when the scaler did skip a step
        result["valid"] = bool(skipped)
        result["right"] = result["valid"] and raised is None and not findings and not cockpit.records
        result["said"] = "nothing" if result["right"] else (findings[0].message[:160] if findings else "a record")
        return result
    record = cockpit.records.get(case.expect_step)
    origin = record.first_nonfinite if record is not None else None
    said = {"step": f.step if (f := findings[0] if findings else None) else None}
    if origin is not None:
        said.update(module=origin["module"], op=origin["op"], kind=origin["kind"], phase=origin["phase"],
                    micro=record.data.get("micro_batch"))
    result["said"] = said
    first = bad[0] if bad else None  # valid when the first non-finite value is where the case puts it
    result["valid"] = first is not None and first[0] == case.expect_step and (
        case.expect_micro is None or first[1] == case.expect_micro)
    result["right"] = (
        result["valid"] and raised is None and len(findings) == 1 and findings[0].step == case.expect_step and origin is not None
        and origin["module"] == case.expect_module and origin["op"] in case.expect_ops
        and record.data.get("micro_batch") == case.expect_micro
    )  # fmt: skip
    program = folder / f"step_{case.expect_step}.py"
    result["replayed"] = None
    if program.is_file():
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                namespace = runpy.run_path(str(program), run_name="replay")
                result["replayed"] = namespace["main"]() == 0
        except Exception as error:  # noqa: BLE001
            result["replayed"] = f"{type(error).__name__}: {error}"
    return result


# ---- the cases ----------------------------------------------------------------------------------------
def _data(step, micro, rows=8, features=6, classes=3, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(1000 * seed + 10 * step + micro)
    return torch.randn(rows, features, generator=generator) * scale, torch.randint(0, classes, (rows,), generator=generator)


def _spike(at, scale, micro_at=None, **kw):
    """Batches of N(0, 1) rows; at step ``at`` (micro-batch ``micro_at``) scaled by ``scale``."""
    def batch(step, micro):
        hit = step == at and (micro_at is None or micro == micro_at)
        return _data(step, micro, scale=scale if hit else 1.0, **kw)
    return batch


def _zero_row(at, micro_at=None, value=0.0, row=3, **kw):
    def batch(step, micro):
        x, y = _data(step, micro, **kw)
        if step == at and (micro_at is None or micro == micro_at):
            x[row] = value
        return x, y
    return batch


def _seq(at, scale):
    def batch(step, micro):
        generator = torch.Generator().manual_seed(10 * step + micro)
        x = torch.randn(4, 5, 8, generator=generator) * (scale if step == at else 1.0)
        return x, torch.randint(0, 3, (4,), generator=generator)
    return batch


def _images(at, scale):
    def batch(step, micro):
        generator = torch.Generator().manual_seed(10 * step + micro)
        x = torch.randn(4, 1, 6, 6, generator=generator) * (scale if step == at else 1.0)
        return x, torch.randint(0, 3, (4,), generator=generator)
    return batch


def _const_feature(at):
    def batch(step, micro):
        x, y = _data(step, micro)
        if step == at:
            x[:] = x[0]  # one sample repeated: every feature is constant over this batch
        return x, y
    return batch


def _mlp(mid: nn.Module, width=8, features=6, classes=3, out_width=None):
    return lambda: nn.Sequential(nn.Linear(features, width), mid, nn.Linear(out_width or width, classes))


def _hand_bce(output, y):
    p = torch.sigmoid(output[:, 0])
    t = (y > 0).float()
    return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()


def _seq_model():
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = PlainAttention(8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x))
    return Seq()


def _conv_model():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():
        model[0].weight.mul_(100.0)
    return model


def _sqrt_model():
    return nn.Sequential(nn.Linear(6, 8), nn.Sigmoid(), SqrtFeature(), nn.Linear(8, 3))


def _root_abs_model():
    return nn.Sequential(nn.Linear(6, 8, bias=False), RootAbs(), nn.Linear(8, 3))


def _relu_norm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), L2Normalize(), nn.Linear(8, 3))


def _wide_linear():
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 3))
    with torch.no_grad():
        model[2].weight.mul_(400.0)
    return model


def _offset_norm_model():
    first = nn.Linear(6, 8)
    with torch.no_grad():
        first.weight.mul_(0.01)
        first.bias.add_(300.0)  # rows far from zero, spread 0.01: E[x²] - E[x]² cancels in bfloat16
    return nn.Sequential(first, RsqrtNorm(), nn.Linear(8, 3))


def _contrast_model():
    first = nn.Linear(6, 4)
    with torch.no_grad():
        first.weight[1] = first.weight[0] * (1 + 1e-3)  # two features within bfloat16's rounding
        first.bias[1] = first.bias[0] = 50.0
    return nn.Sequential(first, Contrast(), nn.Linear(5, 3))


def cases() -> list[Case]:
    pow_ops = {"aten.pow.Tensor_Scalar"}
    mm = {"aten.mm.default", "aten.bmm.default", "aten.matmul.default"}
    backward_div = {"aten.div.Tensor"}
    return [
        # -- float16 / bfloat16 autocast: values that overflow or cancel only in reduced precision
        Case("fp16 autocast: x**3 of a spiked batch", _mlp(Cube()), _spike(1, 60.0), expect_step=1,
             expect_module="1", expect_ops=pow_ops, autocast=torch.float16),
        Case("fp16 autocast: unscaled attention scores (matmul)", _seq_model, _seq(2, 200.0), expect_step=2,
             expect_module="attn", expect_ops=mm, autocast=torch.float16),
        Case("fp16 autocast: hand-written softmax exp", _mlp(NaiveSoftmax()), _spike(1, 40.0), expect_step=1,
             expect_module="1", expect_ops={"aten.exp.default"}, autocast=torch.float16),
        Case("fp16 autocast: row energy sum(x*x)", _mlp(Energy(), width=64, out_width=65), _spike(1, 100.0),
             expect_step=1, expect_module="1", expect_ops={"aten.sum.dim_IntList", "aten.mul.Tensor"},
             autocast=torch.float16),
        Case("fp16 autocast: a Linear with large weights (addmm)", _wide_linear, _spike(1, 1000.0), expect_step=1,
             expect_module="2", expect_ops={"aten.addmm.default"}, autocast=torch.float16),
        Case("fp16 autocast: Conv2d on a spiked image", _conv_model, _images(1, 1e3), expect_step=1,
             expect_module="0", expect_ops={"aten.convolution.default", "aten._convolution.default",
                                            "aten.mkldnn_convolution.default"}, autocast=torch.float16),
        Case("bf16 autocast: layer norm via E[x²]-E[x]² (rsqrt)", _offset_norm_model, _spike(9, 1.0), steps=1,
             expect_step=0, expect_module="1", expect_ops={"aten.rsqrt.default"}, autocast=torch.bfloat16),
        Case("bf16 autocast: 1/(a-b) of two close features", _contrast_model, _spike(9, 1.0), steps=1,
             expect_step=0, expect_module="1", expect_ops={"aten.reciprocal.default", "aten.div.Tensor",
                                                          "aten.mul.Tensor"}, autocast=torch.bfloat16),
        # -- gradient accumulation: the micro-batch that makes the value
        Case("2 micro-batches: custom Function backward inf in micro-batch 0", _sqrt_model,
             _zero_row(1, micro_at=0, value=-1000.0), expect_step=1, expect_module="2", expect_ops=backward_div,
             expect_micro=0, micros=2),
        Case("3 micro-batches: log of 0 in a hand-written BCE in micro-batch 2",
             lambda: nn.Sequential(nn.Linear(6, 3)), _spike(1, 400.0, micro_at=2), expect_step=1,
             expect_module="", expect_ops={"aten.log.default"}, expect_micro=2, micros=3, loss=_hand_bce),
        Case("2 micro-batches, undeclared: sqrt(|x|) of a zero row, backward, micro-batch 1",
             _root_abs_model, _zero_row(2, micro_at=1), expect_step=2, expect_module="1",
             expect_ops={"aten.pow.Tensor_Scalar", "aten.mul.Tensor"}, expect_micro=1, micros=2,
             declare_micros=False),
        Case("2 micro-batches: a NaN in the batch of micro-batch 1", _mlp(nn.ReLU()),
             _zero_row(1, micro_at=1, value=math.nan), expect_step=1, expect_module="0",
             expect_ops={"aten.addmm.default", "aten.t.default", "aten.mm.default"}, expect_micro=1, micros=2),
        Case("2 micro-batches + fp16 autocast: x**3 overflow in micro-batch 0", _mlp(Cube()),
             _spike(1, 60.0, micro_at=0), expect_step=1, expect_module="1", expect_ops=pow_ops, expect_micro=0,
             micros=2, autocast=torch.float16),
        Case("4 micro-batches: L2 normalize of a dead ReLU row in micro-batch 2", _relu_norm_model,
             _zero_row(1, micro_at=2), expect_step=1, expect_module="2", expect_ops={"aten.div.Tensor"},
             expect_micro=2, micros=4),
        # -- a GradScaler skips the step: nothing to report
        Case("GradScaler declared: fp16 forward overflow at step 1", _mlp(Cube()), _spike(1, 60.0),
             autocast=torch.float16, scaler="declared"),
        Case("GradScaler not declared: fp16 forward overflow at step 1", _mlp(Cube()), _spike(1, 60.0),
             autocast=torch.float16, scaler="undeclared"),
        Case("GradScaler with a scale too large: scaled backward overflows", _mlp(nn.Tanh()), _spike(9, 1.0),
             autocast=torch.float16, scaler="declared", init_scale=2.0**40),
        Case("GradScaler + 2 micro-batches: scaled backward overflows", _mlp(nn.Tanh()), _spike(9, 1.0),
             autocast=torch.float16, scaler="declared", init_scale=2.0**40, micros=2),
        Case("GradScaler(enabled=False) declared: a real overflow is reported", _mlp(Cube()), _spike(1, 60.0),
             expect_step=1, expect_module="1", expect_ops=pow_ops, autocast=torch.float16, scaler="disabled"),
        # -- other makers of NaN, float32
        Case("custom autograd.Function: inf in its backward", _sqrt_model, _zero_row(2, value=-1000.0),
             expect_step=2, expect_module="2", expect_ops=backward_div),
        Case("log of 0 in a hand-written BCE (saturated sigmoid)", lambda: nn.Sequential(nn.Linear(6, 3)),
             _spike(1, 400.0), expect_step=1, expect_module="", expect_ops={"aten.log.default"}, loss=_hand_bce),
        Case("L2 normalize of a dead ReLU row (0/0)", _relu_norm_model, _zero_row(1), expect_step=1,
             expect_module="2", expect_ops={"aten.div.Tensor"}),
        Case("standardize over the batch with a constant feature (std 0)", _mlp(Standardize()),
             _const_feature(1), expect_step=1, expect_module="1", expect_ops={"aten.div.Tensor"}),
        Case("fp16 autocast + dropout: x**3 after a dropout layer",
             lambda: nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), Cube(), nn.Linear(8, 3)), _spike(1, 60.0),
             expect_step=1, expect_module="2", expect_ops=pow_ops, autocast=torch.float16),
        Case("fp16 autocast, keyword inputs: a fully masked attention row", KeywordModel, _spike(9, 1.0),
             keywords=_mask(1), expect_step=1, expect_module="mix", expect_ops={"aten._softmax.default"},
             autocast=torch.float16),
        Case("GradScaler not declared, info['loss'] a number: fp16 forward overflow", _mlp(Cube()),
             _spike(1, 60.0), autocast=torch.float16, scaler="undeclared", float_loss=True),
        Case("torch.compile (eager) + fp16 autocast: x**3 overflow", _mlp(Cube()), _spike(1, 60.0), expect_step=1,
             expect_module="1", expect_ops=pow_ops, autocast=torch.float16, compile=True),
        Case("sqrt(1 - p²) with p = 1.01 tanh(x)", _mlp(Complement()), _spike(1, 10.0), expect_step=1,
             expect_module="1", expect_ops={"aten.sqrt.default"}),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("-k", help="run only the cases whose name contains this")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for case in cases():
        if args.k and args.k not in case.name:
            continue
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            result = run(case, Path(folder))
        result["seconds"] = round(time.perf_counter() - started, 2)
        results.append(result)
        mark = "right" if result["right"] else ("WRONG" if result["valid"] else "NOCASE")
        replay = "" if result.get("replayed") is None else f"; replay {'ok' if result['replayed'] is True else result['replayed']}"
        print(f"{mark:5s} {case.name:72s} said {result['said']}{replay}"
              + (f"; raised {result['raised']}" if result["raised"] else ""), flush=True)
    right = sum(r["right"] for r in results)
    invalid = [r["case"] for r in results if not r["valid"]]
    if invalid:
        print(f"\n{len(invalid)} cases did not make their value where they should (NOCASE): {invalid}")
    replays = [r["replayed"] for r in results if r.get("replayed") is not None]
    print(f"\n{right} of {len(results)} right; replay programs reproduced {sum(r is True for r in replays)} of "
          f"{len(replays)} records; training raised in {sum(r['raised'] is not None for r in results)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
