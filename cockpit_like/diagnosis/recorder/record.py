"""The neutral record of one step, built from a :class:`~.tape.Tape`.

:class:`Record` holds a JSON-ready dictionary (``record.data``: the
operations with their modules, phases, arguments and the summary values of
every value; notes; the first non-finite value; findings) and, in memory,
the tensors a replay needs (``record.tensors``: the external inputs of the
forward pass and the loss, outputs of random operations, and the outputs a
replay must reproduce). Exporters (:mod:`.program`) read only these two.

Layout of ``record.data``::

    {"schema": "cockpit_like.record", "schema_version": 1, "step": 12,
     "trigger": "on demand" | "non-finite loss" | "non-finite gradient",
     "notes": [...],
     "ops": [{"index": 0, "op": "aten.addmm.default", "phase": "forward",
              "module": "fc1", "module_type": "Linear",
              "args": [{"t": 2}, {"t": 0}, {"t": 1}], "kwargs": {},
              "inputs": [2, 0, 1], "outputs": [3], "single": true}, ...],
     "values": {"3": {"shape": [8, 16], "dtype": "float32", "device": "cpu",
                      "min": -2.1, "max": 3.4, "nonfinite": 0, "nan": 0,
                      "op": 0, "source": null}, ...},
     "outputs": {"output": [17], "loss": 25},
     "micro_batch": 0, "micro_batches": 2,       # the step's backward pass recorded (null: one pass)
     "autocast": [{"device_type": "cpu", "dtype": "float16"}],   # the forward pass's autocast ([] off)
     "first_nonfinite": {...} or null, "findings": [...],
     "intended_infinities": [6],                 # values judged masks before the origin
     "skipped": {"reason": "grad_scaler", ...}}  # only for a step a GradScaler skipped

May import torch, :mod:`cockpit_like.logs`, :mod:`cockpit_like.diagnosis.findings`
and :mod:`cockpit_like.diagnosis.recorder`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from cockpit_like.diagnosis.findings import Finding
from cockpit_like.diagnosis.recorder.tape import Tape
from cockpit_like.logs import decode, encode

__all__ = ["Record", "read_record", "CONTROL_FLOW_NOTE", "SCHEMA"]

SCHEMA = "cockpit_like.record"
SCHEMA_VERSION = 1

CONTROL_FLOW_NOTE = (
    "The record holds the operations this step executed: the path the model's Python code took "
    "for this step's data. A forward pass that branches on tensor values (if/while on a tensor, "
    ".item(), data-dependent shapes) may take another path on other data."
)

#: what usually makes an operation produce its first non-finite value, and what to do
_HINTS = {
    "exp": "exp overflows to inf for inputs above ~88 (float32) / ~709 (float64): bound its input "
    "(clamp, a smaller scale) or work in log space (logsumexp, log_softmax)",
    "log": "log gives -inf at 0 and NaN below 0: clamp its input to a small positive minimum "
    "(x.clamp_min(eps)) or use a log-space formulation (log_softmax, logsigmoid)",
    "cosh": "cosh overflows to inf for |inputs| above ~89 (float32) / ~710 (float64): bound its input "
    "or use a stable form (log(cosh(x)) = |x| + log1p(exp(-2|x|)) - log(2))",
    "sinh": "sinh overflows to ±inf for |inputs| above ~89 (float32) / ~710 (float64): bound its input",
    "expm1": "expm1 overflows like exp for inputs above ~88 (float32) / ~709 (float64): bound its input",
    "div": "division by zero (or 0/0): add an epsilon to the denominator or mask the zero entries",
    "sqrt": "sqrt is NaN below 0 and its gradient infinite at 0: clamp its input to a small positive minimum",
    "rsqrt": "rsqrt is inf at 0: add an epsilon to its input",
    "pow": "pow overflows for large bases or exponents (or gives NaN for negative bases with "
    "fractional exponents): bound its input",
    "reciprocal": "reciprocal is inf at 0: add an epsilon",
    "_softmax": "softmax gets NaN when a whole row is -inf (every position masked): keep one position unmasked",
    "_log_softmax": "log_softmax gets NaN when a whole row is -inf or inf: bound the logits",
    "lift_fresh": "a constant in the model's code holds NaN (torch.tensor(float('nan')), x[...] = float('nan')): "
    "find it at this place of the forward pass and write the number meant (a mask takes float('-inf'))",
    "lift_fresh_copy": "a constant in the model's code holds NaN (torch.tensor(float('nan')), x[...] = float('nan')): "
    "find it at this place of the forward pass and write the number meant (a mask takes float('-inf'))",
}


class Record:
    """The record of one step (see the module docstring)."""

    def __init__(self, data: dict[str, Any], tensors: dict[int, torch.Tensor] | None = None):
        self.data = data
        #: value id -> tensor (in memory, or loaded from the ``.pt`` file)
        self.tensors = tensors or {}

    # ---- building -----------------------------------------------------------------------
    @classmethod
    def from_tape(
        cls,
        tape: Tape,
        step: int,
        trigger: str,
        loss: torch.Tensor | None = None,
        notes: list[str] | None = None,
        micro_batch: int | None = None,
        micro_batches: int | None = None,
        autocast: list[dict[str, str]] | None = None,
    ) -> Record:
        """Finish a tape into a record: outputs, notes, the first non-finite value, findings.

        ``micro_batch``: which backward pass of the step the tape holds (``None``: the step has one);
        ``micro_batches``: how many the step has (``None``: one, or not declared); ``autocast``: the
        ``torch.autocast`` state the forward pass ran under (:func:`.control.autocast_state`).
        """
        loss_id = tape.id_of(loss) if isinstance(loss, torch.Tensor) else None
        if loss_id is not None:
            tape.mark_expected([loss_id])
        all_notes = [CONTROL_FLOW_NOTE]
        if tape.data_dependent:
            shown = ", ".join(
                f"{tape.ops[i]['op']} in {_where(tape.ops[i])} (op {i})" for i in tape.data_dependent[:5]
            )
            all_notes.append(
                f"Data-dependent control flow is likely: the forward pass or the loss read tensor values "
                f"into Python or made data-dependent shapes ({shown}). The record is the path taken at "
                f"step {step}; a replay runs that path, whatever the data."
            )
        if tape.dropped:
            all_notes.append(
                f"{tape.dropped} operations beyond max_ops={tape.max_ops} were run but not recorded."
            )
        if tape.not_replayable:
            ops = sorted({tape.ops[i]["op"] for i in tape.not_replayable})
            all_notes.append(f"Operations outside aten or with arguments that cannot be written back: {ops}.")
        all_notes += notes or []
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "step": int(step),
            "trigger": trigger,
            "notes": all_notes,
            "phases": sorted({op["phase"] for op in tape.ops}, key=_PHASE_ORDER.index),
            "ops": tape.ops,
            "values": {str(k): v for k, v in tape.values.items()},
            "outputs": {"output": list(tape.root_outputs), "loss": loss_id},
            "saved": sorted(tape.tensors),
            "dropped_ops": tape.dropped,
            "not_replayable": list(tape.not_replayable),
            "micro_batch": micro_batch,
            "micro_batches": micro_batches,
            "autocast": list(autocast or []),
        }
        record = cls(data, dict(tape.tensors))
        data["first_nonfinite"] = record._find_first_nonfinite()
        data["intended_infinities"] = sorted(record._masks)  # masks passed over on the way to the origin
        data["findings"] = [finding.to_dict() for finding in record._findings()]
        return record

    # ---- reading ------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.data["step"]

    @property
    def ops(self) -> list[dict[str, Any]]:
        return self.data["ops"]

    def value(self, value_id: int) -> dict[str, Any]:
        return self.data["values"][str(value_id)]

    @property
    def first_nonfinite(self) -> dict[str, Any] | None:
        """Where the first non-finite value came from (``None`` if every value is finite)."""
        return self.data.get("first_nonfinite")

    @property
    def findings(self) -> list[Finding]:
        return [Finding.from_dict(f) for f in self.data.get("findings", [])]

    @property
    def notes(self) -> list[str]:
        return self.data["notes"]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready record (no tensors)."""
        return self.data

    def summary(self) -> str:
        """A few lines for people: step, trigger, counts per phase, the first non-finite value."""
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op["phase"]] = counts.get(op["phase"], 0) + 1
        lines = [f"record of step {self.step}{self.where_in_step()} ({self.data['trigger']}): " + ", ".join(f"{n} {p}" for p, n in counts.items())]
        origin = self.first_nonfinite
        lines.append("first non-finite value: " + (origin["message"] if origin else "none (every value is finite)"))
        return "\n".join(lines)

    def _nonfinite(self, value_id: int | None) -> bool:
        if value_id is None:
            return False
        return self.value(value_id).get("nonfinite", 0) > 0

    def _intended(self, op: dict[str, Any], value_id: int) -> bool:
        """Whether ``value_id``, an output of ``op``, holds infinities put there on purpose (a mask): its
        non-finite entries are all infinite, none NaN, and either ``op`` makes them from a constant
        (``masked_fill(mask, -inf)``, ``where``, ``full``: :data:`_MASK_MAKERS`) or passes on an
        infinity-only input without making NaN (an addition of the caller's -inf mask, a view:
        :data:`_MASK_PASSERS`). Constants of the code and tensors written through a view are masks
        by :meth:`_made_on_purpose`, checked when an operation reads them."""
        info = self.value(value_id)
        if info.get("nan", 0) or not info.get("nonfinite", 0):
            return False
        base = op["op"].split(".")[1] if op["op"].count(".") >= 2 else op["op"]
        inputs = [self.value(v) for v in op["inputs"] if self._nonfinite(v)]
        if any(i.get("nan", 0) for i in inputs):
            return False
        if base in _MASK_MAKERS:
            return all(v in self._masks or not self._nonfinite(v) for v in op["inputs"])
        return base in _MASK_PASSERS and bool(inputs) and all(v in self._masks or not self._nonfinite(v)
                                                               or self._external(v) for v in op["inputs"])

    def _external(self, value_id: int) -> bool:
        """Whether a value came into the step from outside (made by no recorded operation, no constant
        of the step's code, not written by a recorded operation through a view)."""
        info = self.value(value_id)
        return value_id not in self._made and info.get("source") != "constant" and "written_by" not in info

    def _made_on_purpose(self, value_id: int) -> bool:
        """Whether ``value_id``, read by an operation, holds infinities the step's own code put there (a mask)
        without being an operation's output: a constant (``torch.tensor(float("-inf"))``, the number in
        ``pad[:, 6:] = float("-inf")``), or a tensor a recorded operation wrote masks into through a view
        (``pad`` after ``pad[:, 6:].fill_(float("-inf"))``) that held masks or finite numbers before."""
        if value_id in self._masks or not self._nonfinite(value_id):
            return False
        info = self.value(value_id)
        if info.get("nan", 0):
            return False
        if info.get("source") == "constant":
            return True
        writer, before = info.get("written_by"), info.get("alias_of")
        if writer is None or writer >= len(self.ops) or self.ops[writer]["index"] != writer:
            return False
        written = [v for v in self.ops[writer]["outputs"] if v is not None]
        return all(v in self._masks or not self._nonfinite(v) for v in written + [before])

    def _source_of(self, value_id: int) -> str:
        """Where a value read from outside the step came from, in words."""
        info = self.value(value_id)
        if "written_by" in info:
            writer = self.ops[info["written_by"]]["op"] if info["written_by"] < len(self.ops) else "an operation"
            return f"v{info.get('alias_of')} after {writer} (op {info['written_by']}) wrote into it through a view"
        return info.get("source") or "an input"

    def _find_first_nonfinite(self) -> dict[str, Any] | None:
        self._made = {v for op in self.ops for v in op["outputs"]}
        self._masks: set[int] = set()  # values holding intended infinities (masks), found on the way
        for op in self.ops:
            self._masks.update(v for v in op["inputs"] if self._made_on_purpose(v))
            bad = [v for v in op["outputs"] if self._nonfinite(v)]
            if not bad:
                continue
            if all(self._intended(op, v) for v in bad):
                self._masks.update(bad)
                continue
            bad = [v for v in bad if v not in self._masks]
            bad_inputs = [v for v in op["inputs"] if self._nonfinite(v) and v not in self._masks]
            masks_in = [v for v in op["inputs"] if v in self._masks]
            inputs = [_range_of(v, self.value(v)) for v in op["inputs"]]
            outputs = [_range_of(v, self.value(v)) for v in bad]
            made = [v for v in bad_inputs if self.value(v).get("source") == "constant"]
            if made:  # a NaN the code wrote itself: torch.tensor(float("nan")), x[i] = float("nan")
                message = (
                    f"{op['op']} in {_where(op)} (op {op['index']}, {op['phase']} pass) took in a constant that "
                    f"the code of the step made and that holds NaN ({_describe_range(_range_of(made[0], self.value(made[0])))}: "
                    f"a torch.tensor(...) or a Python number written into a tensor)"
                )
                kind = "operation"
            elif bad_inputs:  # finite outputs so far: a non-finite value came in from outside (a parameter, the batch)
                source = self._source_of(bad_inputs[0])
                message = (
                    f"the value {source} (v{bad_inputs[0]}) was already non-finite when {op['op']} in "
                    f"{_where(op)} read it (op {op['index']}, {op['phase']} pass): the step received it"
                )
                kind = "input"
            else:
                shown = "; ".join(_describe_range(r) for r in inputs if "min" in r or "nonfinite" in r)
                produced = "; ".join(_describe_range(r) for r in outputs)
                what = "finite inputs" if not masks_in else (
                    "finite inputs and an intended infinity (a mask: " + ", ".join(f"v{v}" for v in masks_in) + ")")
                message = (
                    f"{op['op']} in {_where(op)} (op {op['index']}, {op['phase']} pass) produced the first "
                    f"non-finite value ({produced}) from {what} ({shown or 'no tensor inputs'})"
                )
                kind = "operation"
            return {
                "kind": kind,
                "op_index": op["index"],
                "op": op["op"],
                "phase": op["phase"],
                "module": op["module"],
                "module_type": op["module_type"],
                "inputs": inputs,
                "outputs": outputs,
                "message": message,
            }
        return None

    def _findings(self) -> list[Finding]:
        origin = self.first_nonfinite
        if origin is None:
            return []
        base = origin["op"].split(".")[1] if origin["op"].count(".") >= 2 else origin["op"]
        if origin["kind"] == "input":
            fix = (
                "the step started from non-finite parameters or data: find the earlier step that made "
                "them (record it with cockpit.record(step)) or check the batch"
            )
        else:
            fix = _HINTS.get(base, "look at the input ranges of this operation and bound them")
            if any(out.get("dtype") == "float16" and out.get("nonfinite", 0) > out.get("nan", 0)
                   for out in origin["outputs"]):
                fix = (f"float16 overflows to inf above 65504 (under torch.autocast, or half-precision tensors): "
                       f"run this operation in float32 (inside torch.autocast(device_type, enabled=False), on "
                       f"inputs cast with .float()), use bfloat16, or bound its input. {fix}")
        evidence = {k: origin[k] for k in ("op_index", "op", "phase", "module", "module_type", "inputs", "outputs")}
        evidence["origin"] = origin["kind"]  # "input": the step received it (the data, or earlier parameters)
        for key in ("micro_batch", "micro_batches", "autocast"):
            if self.data.get(key) not in (None, []):
                evidence[key] = self.data[key]
        return [
            Finding(
                rule="nonfinite-origin",
                severity="error",
                step=self.step,
                message=f"step {self.step}{self.where_in_step()}: {origin['message']}",
                fix=fix,
                layer=origin["module"] or None,
                evidence=evidence,
            )
        ]

    def where_in_step(self) -> str:
        """``", micro-batch 0 of 2"`` for a record of one backward pass of several, else ``""``."""
        micro, count = self.data.get("micro_batch"), self.data.get("micro_batches")
        if micro is None:
            return ""
        return f", micro-batch {micro}" + (f" of {count}" if count else "")

    # ---- files ----------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike, program: bool = True) -> dict[str, Path]:
        """Write ``step_<N>.record.json`` into ``folder`` (created), and with ``program``
        the replay ``step_<N>.py`` with its tensors ``step_<N>.pt`` (:func:`.program.export_program`).
        Returns the paths by kind (``"record"``, ``"program"``, ``"tensors"``)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{self.step}.record.json"
        temporary = path.with_name(path.name + ".tmp")
        with open(temporary, "w") as handle:
            json.dump(encode(self.data), handle, allow_nan=False)
        os.replace(temporary, path)
        paths = {"record": path}
        if program:
            from cockpit_like.diagnosis.recorder.program import export_program

            paths.update(export_program(self, folder))
        return paths


def read_record(path: str | os.PathLike) -> Record:
    """Load a record written by :meth:`Record.save` (with its tensors if the ``.pt`` file is next to it)."""
    path = Path(path)
    data = decode(json.loads(path.read_text()))
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a cockpit_like record (schema {data.get('schema')!r})")
    tensors = {}
    pt = path.with_name(f"step_{data['step']}.pt")
    if pt.is_file():
        saved = torch.load(pt, weights_only=True)
        tensors = {int(k[1:]): v for part in ("tensors", "expected") for k, v in saved[part].items()}
    return Record(data, tensors)


_PHASE_ORDER = ["forward", "loss", "backward", "after-backward"]


#: operations that put infinities in on purpose (attention masks), and operations that pass them on
_MASK_MAKERS = {"masked_fill", "masked_fill_", "where", "fill", "fill_", "full", "full_like", "new_full",
                "scalar_tensor", "lift_fresh", "lift_fresh_copy", "index_put", "index_put_"}
_MASK_PASSERS = {"add", "add_", "sub", "sub_", "clone", "copy_", "_to_copy", "view", "_unsafe_view", "reshape",
                 "expand", "unsqueeze", "squeeze", "slice", "select", "t", "transpose", "permute", "contiguous",
                 "repeat", "alias", "detach", "to", "masked_fill", "masked_fill_", "where"}


def _where(op: dict[str, Any]) -> str:
    module = op.get("module")
    if module and not module.startswith("<"):
        return f"module '{module}' ({op.get('module_type')})"
    if module:
        return f"{module[1:-1]} (outside the model)"
    if op.get("phase") == "forward":
        return f"the model's own forward ({op.get('module_type')})"
    return "code outside any module"


def _range_of(value_id: int, info: dict[str, Any]) -> dict[str, Any]:
    found = {"id": value_id, "shape": info.get("shape"), "dtype": info.get("dtype")}
    for key in ("min", "max", "nonfinite", "nan", "source"):
        if info.get(key) is not None:
            found[key] = info[key]
    return found


def _describe_range(found: dict[str, Any]) -> str:
    text = f"v{found['id']} {found.get('dtype')}{found.get('shape')}"
    if "min" in found:
        text += f" in [{found['min']:.4g}, {found['max']:.4g}]"
    if found.get("nonfinite"):
        text += f", {found['nonfinite']} non-finite ({found.get('nan', 0)} NaN)"
    return text
