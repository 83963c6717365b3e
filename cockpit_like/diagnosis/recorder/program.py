"""Exporter: a standalone Python program that replays a record's forward pass and loss.

:func:`export_program` writes ``step_<N>.py`` and, next to it, one
``step_<N>.pt`` with the tensors it needs (the external inputs: parameters,
buffers, the batch; outputs of random operations such as dropout masks; the
outputs it must reproduce) and the recorded summary values. The program
imports only ``torch``: it calls the recorded aten operations in order
(``torch.ops.aten.<op>.<overload>(...)``, constants written inline), checks
the count of non-finite entries of every value against the record, names
the first operation that produced a non-finite value, and asserts that the
model's outputs and the loss equal the recorded ones (float tolerance,
NaN equal to NaN). It exits with status 1 when something differs.

May import torch and :mod:`cockpit_like.diagnosis.recorder`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from cockpit_like.diagnosis.recorder.tape import _UNINITIALISED

__all__ = ["export_program", "replayable_ops", "NotReplayableError"]


class NotReplayableError(ValueError):
    """The record holds an operation that a standalone program cannot call again."""


def _constant(value: Any, name_of) -> str:
    if isinstance(value, dict):
        if "t" in value:
            return name_of(value["t"])
        if "float" in value:
            return f"float({value['float']!r})"
        if "dtype" in value:
            return f"torch.{value['dtype']}"
        if "device" in value:
            return f"torch.device({value['device']!r})"
        if "layout" in value:
            return f"torch.{value['layout']}"
        if "memory_format" in value:
            return f"torch.{value['memory_format']}"
        raise NotReplayableError(f"argument {value!r} cannot be written into a program")
    if isinstance(value, list):
        return "[" + ", ".join(_constant(v, name_of) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({value!r})"
    return repr(value)


def replayable_ops(record) -> list[dict[str, Any]]:
    """The forward and loss operations of ``record``, or :class:`NotReplayableError` saying why they cannot be replayed."""
    data, tensors = record.data, record.tensors
    step = data["step"]
    replayed = [op for op in data["ops"] if op["phase"] in ("forward", "loss")]
    if not replayed:
        raise NotReplayableError(
            f"the record of step {step} holds no forward or loss operations, so there is nothing to replay"
        )
    bad = [op for op in replayed if op["index"] in set(data.get("not_replayable", []))]
    if bad:
        raise NotReplayableError(
            f"the record of step {step} cannot be replayed by a standalone program: "
            f"{sorted({op['op'] for op in bad})} (op {bad[0]['index']}) are not aten operations or take "
            "arguments that cannot be written back"
        )
    if data.get("dropped_ops"):
        raise NotReplayableError(
            f"the record of step {step} is incomplete ({data['dropped_ops']} operations beyond max_ops "
            "were not recorded); record again with a larger max_ops"
        )
    saved = set(data.get("saved", []))
    missing = sorted(saved - set(tensors))
    if missing:
        raise NotReplayableError(
            f"the record of step {step} has no tensors for values {missing[:5]}: export it from the "
            "cockpit that made it (cockpit.records[step]) or from a record saved with its .pt file"
        )

    return replayed


def export_program(record, folder: str | Path) -> dict[str, Path]:
    """Write the replay program of ``record`` (a :class:`~.record.Record` with its tensors) into ``folder``.

    Returns ``{"program": path_of_py, "tensors": path_of_pt}``. Raises
    :class:`NotReplayableError` if the forward pass or the loss ran an
    operation outside aten or the record lacks the tensors (a record read
    without its ``.pt``).
    """
    data, tensors = record.data, record.tensors
    step = data["step"]
    replayed = replayable_ops(record)
    saved = set(data.get("saved", []))
    produced: set[int] = set()
    lines: list[str] = []
    loads: list[str] = []

    def name_of(value_id: int) -> str:
        info = data["values"].get(str(value_id), {})
        if value_id not in produced and info.get("alias_of") is not None:  # the same tensor, written through a view
            base = name_of(info["alias_of"])
            lines.append(f"v{value_id} = {base}  # {base} after op {info.get('written_by')} wrote into it through a view")
            produced.add(value_id)
        if value_id not in produced and f"v{value_id}" not in loaded:
            if value_id not in saved:
                raise NotReplayableError(
                    f"value v{value_id} is read before any recorded operation made it and was not saved"
                )
            loaded.add(f"v{value_id}")
            info = data["values"][str(value_id)]
            what = info.get("source") or "input"
            loads.append(f'v{value_id} = T["v{value_id}"]  # {what}, {info.get("dtype")}{info.get("shape")}')
        return f"v{value_id}"

    loaded: set[str] = set()
    checked: list[int] = []
    module = None
    for op in replayed:
        where = f"{op['phase']}, {op['module'] or '(no module)'}"
        if (where, op["module_type"]) != module:
            module = (where, op["module_type"])
            lines.append(f"# -- {op['phase']}: {op['module'] or '(no module)'} ({op['module_type'] or '-'})")
        outputs = op["outputs"]
        if op.get("random"):  # random numbers: the recorded draw
            targets = [f"v{v}" for v in outputs if v is not None]
            for v in targets:
                lines.append(f'{v} = T["{v}"]  # op {op["index"]}: {op["op"]} (the recorded random draw)')
                loaded.add(v)
            produced.update(v for v in outputs if v is not None)
            checked += [v for v in outputs if v is not None]
            continue
        arguments = [_constant(a, name_of) for a in op["args"]]
        arguments += [f"{k}={_constant(v, name_of)}" for k, v in op["kwargs"].items()]
        call = f"torch.ops.{op['op']}({', '.join(arguments)})"
        if op["single"]:
            target = f"v{outputs[0]}"
        elif not outputs:
            target = "_"
        else:
            names = [f"v{v}" if v is not None else "_" for v in outputs]
            target = ", ".join(names) + ("," if len(names) == 1 else "")
            call = f"tree_leaves({call})"
        lines.append(f"{target} = {call}  # op {op['index']}")
        produced.update(v for v in outputs if v is not None)
        tensor_outputs = [v for v in outputs if v is not None]
        if tensor_outputs and not _uninitialised(op["op"]):  # empty_like's memory is garbage, NaN or not
            lines.append(f"check({op['index']}, {', '.join(f'v{v}=v{v}' for v in tensor_outputs)})")
            checked += tensor_outputs

    loss_id = data["outputs"].get("loss")
    for value_id in data["outputs"].get("output", []) + [loss_id]:  # an output written through a view
        if value_id is not None and value_id not in produced and data["values"].get(str(value_id), {}).get("alias_of") is not None:
            name_of(value_id)
    expected_outputs = [v for v in data["outputs"].get("output", []) if v in produced]
    expected = {f"v{v}": tensors[v] for v in expected_outputs if v in tensors}
    if loss_id is not None and loss_id in produced and loss_id in tensors:
        expected[f"v{loss_id}"] = tensors[loss_id]
    nonfinite = {
        f"v{v}": int(data["values"][str(v)]["nonfinite"])
        for v in checked
        if "nonfinite" in data["values"][str(v)]
    }
    ops_info = {op["index"]: f"{op['op']} in {op['module'] or '(no module)'} ({op['module_type'] or '-'}), {op['phase']} pass" for op in replayed}
    origin = data.get("first_nonfinite")
    recorded_origin = origin["op_index"] if origin and origin["phase"] in ("forward", "loss") else None
    payload = {
        "tensors": {name: tensors[int(name[1:])].detach() for name in sorted(loaded)},
        "expected": {name: t.detach() for name, t in expected.items()},
        "nonfinite": nonfinite,
        "ops": ops_info,
        "first_nonfinite": recorded_origin,
        "masks": [f"v{v}" for v in data.get("intended_infinities", [])],
        "loss": None if loss_id is None else f"v{loss_id}",
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pt = folder / f"step_{step}.pt"
    torch.save(payload, pt)
    program = folder / f"step_{step}.py"
    header = (
        _HEADER.replace("@STEP@", str(step))
        .replace("@TRIGGER@", str(data.get("trigger", "")))
        .replace("@COUNT@", str(len(replayed)))
        .replace("@TORCH@", torch.__version__)
    )
    body = "\n".join(loads + [""] + lines)
    program.write_text(header + "\n\ndef replay():\n" + _indent(body) + "\n    return locals()\n" + _FOOTER)
    return {"program": program, "tensors": pt}


def _uninitialised(name: str) -> bool:
    """Whether the operation ``"aten.empty_like.default"`` returns uninitialised memory (not checked)."""
    return name.rsplit(".", 1)[0].replace(".", "::", 1) in _UNINITIALISED


def _indent(text: str) -> str:
    return "\n".join(("    " + line) if line else "" for line in text.split("\n"))


_HEADER = '''"""Replay of step @STEP@ (@TRIGGER@): @COUNT@ aten operations of the forward pass and the loss.

Written by cockpit_like's recorder with torch @TORCH@. Runs on its own
(`python this_file.py`, needs only torch): it loads the parameters, inputs
and random draws of that step from the .pt file next to it, calls the
recorded operations in order, names the first operation that produces a
non-finite value, and asserts that the outputs and the loss equal the
recorded ones. Exit status 1 if anything differs.
"""

import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

DATA = torch.load(Path(__file__).with_suffix(".pt"), weights_only=True)
T = DATA["tensors"]
FIRST = []  # the op index of the first non-finite value
PROBLEMS = []


def check(index, **values):
    """After op ``index``: its outputs' non-finite entries against the record."""
    for name, value in values.items():
        if not value.is_floating_point():
            continue
        found = int((~torch.isfinite(value)).sum())
        if found and not FIRST and name not in DATA.get("masks", ()):  # not an intended infinity (a mask)
            FIRST.append(index)
        recorded = DATA["nonfinite"].get(name)
        if recorded is not None and found != recorded:
            PROBLEMS.append(f"{name} (op {index}): {found} non-finite entries, the record has {recorded}")
'''

_FOOTER = '''

def main() -> int:
    values = replay()
    problems = list(PROBLEMS)
    for name, recorded in DATA["expected"].items():
        try:
            torch.testing.assert_close(values[name], recorded, equal_nan=True)
        except AssertionError as error:
            problems.append(f"{name} differs from the recorded value: {error}")
    if DATA["loss"] is not None:
        print(f"loss: {float(values[DATA['loss']]):.17g} (recorded {float(DATA['expected'][DATA['loss']]):.17g})")
    if FIRST:
        print(f"first non-finite value: op {FIRST[0]}: {DATA['ops'][FIRST[0]]}")
    else:
        print("every value is finite")
    if (FIRST[0] if FIRST else None) != DATA["first_nonfinite"]:
        problems.append(f"the first non-finite value comes from op {FIRST[0] if FIRST else None}, the record says {DATA['first_nonfinite']}")
    if problems:
        print("NOT REPRODUCED:\\n  " + "\\n  ".join(problems[:20]))
        return 1
    print("reproduced: outputs, loss and non-finite counts equal the record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
