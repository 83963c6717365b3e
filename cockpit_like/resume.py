"""Resuming a run: the cockpit's state as plain tensors and Python values.

What lives here:

- :func:`pack` / :func:`unpack`: stored values and quantity states in a form
  that ``torch.load(..., weights_only=True)`` reads back (numpy arrays and
  scalars become tagged tensors, the cockpit's own parameters become their
  index, so that a restored quantity refers to the *new* run's parameters);
- :func:`is_plain`: what the generic :meth:`Quantity.state_dict` saves;
- :func:`cockpit_state` / :func:`load_cockpit_state`: the body of
  :meth:`Cockpit.state_dict` / :meth:`Cockpit.load_state_dict`, with the
  checks behind the mismatch errors and the continuation of the stream.

Imports torch, numpy, :mod:`cockpit_like.logs` and the key names of
:mod:`cockpit_like.diagnosis.findings`; it gets the cockpit as an argument
(no import of :mod:`cockpit_like.cockpit`). See ``docs/resume.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from cockpit_like.diagnosis.findings import DIAGNOSIS_KEYS, Finding
from cockpit_like.logs import EPOCH_KEYS, _read_stream, stream_holds
from cockpit_like.checks.invariants import CHECKS_KEY, notable
from cockpit_like.run_output import SKIPPED_KEY

__all__ = ["FORMAT", "VERSION", "StateMismatchError", "pack", "unpack", "is_plain", "cockpit_state", "load_cockpit_state"]

FORMAT = "cockpit_like.state"
VERSION = 1

_ARRAY = "__cockpit_like_ndarray__"
_SCALAR = "__cockpit_like_numpy_scalar__"
_PARAM = "__cockpit_like_param__"
_ATOMS = (bool, int, float, complex, str, bytes, type(None))


class StateMismatchError(ValueError):
    """The state was saved by a cockpit with other quantities or parameters than this one."""


# ---- plain values ------------------------------------------------------------------
def is_plain(value: Any) -> bool:
    """Whether ``value`` is plain data: tensors, numpy arrays and scalars, Python
    numbers/strings/``None``, and lists/tuples/sets/dicts of them (keys plain too)."""
    if isinstance(value, (_ATOMS, torch.Tensor, np.generic)):
        return True
    if isinstance(value, np.ndarray):
        return value.dtype != object
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(is_plain(key) and is_plain(item) for key, item in value.items())
    return False


def pack(value: Any, params: list[torch.Tensor] = (), where: str = "value") -> Any:
    """``value`` in the form ``torch.load(weights_only=True)`` reads.

    Tensors that *are* one of ``params`` become ``{_PARAM: index}``; other
    tensors are kept (detached); numpy arrays and scalars become tagged
    tensors. ``where`` names the value in the error for anything else.

    Raises:
        TypeError: an object that is not plain data (see :func:`is_plain`).
    """
    index = {id(p): i for i, p in enumerate(params)}
    return _pack(value, index, where)


def _pack(value: Any, index: dict[int, int], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if id(value) in index:
            return {_PARAM: index[id(value)]}
        return value.detach()
    if isinstance(value, np.generic):  # before the atoms: np.float64 is a float
        return {_SCALAR: torch.from_numpy(np.asarray(value).copy())}
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise TypeError(f"{where}: a numpy array of Python objects cannot be saved")
        return {_ARRAY: torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, dict):
        return {key: _pack(item, index, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        packed = [_pack(item, index, f"{where}[{i}]") for i, item in enumerate(value)]
        return packed if isinstance(value, list) else type(value)(packed)
    raise TypeError(
        f"{where}: cannot save a {type(value).__name__} in a cockpit state (tensors, numpy arrays, "
        "numbers, strings and lists/tuples/dicts of them only); override the quantity's "
        "state_dict()/load_state_dict() to save it another way"
    )


def unpack(value: Any, params: list[torch.Tensor] = ()) -> Any:
    """Inverse of :func:`pack`: references become ``params[index]``, tensors are copied."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        if len(value) == 1:
            (key, item), = value.items()
            if key == _PARAM:
                if not 0 <= item < len(params):
                    raise StateMismatchError(f"the state refers to parameter #{item}, but there are {len(params)}")
                return params[item]
            if key == _ARRAY:
                return item.numpy().copy()
            if key == _SCALAR:
                return item.numpy()[()]
        return {key: unpack(item, params) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [unpack(item, params) for item in value]
        return items if isinstance(value, list) else type(value)(items)
    return value


# ---- the cockpit's state -------------------------------------------------------------
def _param_description(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")} for p in params]


def cockpit_state(cockpit, with_output: bool | None = None) -> dict[str, Any]:
    """The body of :meth:`Cockpit.state_dict` (see ``docs/resume.md`` for the layout)."""
    if cockpit._open_step is not None:
        raise RuntimeError(
            f"cockpit.state_dict(): step {cockpit._open_step.step} is still open; call it after "
            "cockpit.end() (after the with block), e.g. next to optimizer.state_dict()"
        )
    params = cockpit.params
    stream = cockpit._output.stream
    pointer = None
    if stream is not None and stream.opened and stream.drain():  # (lines a failed write left: in the state instead)
        offset, tail = stream.position()
        pointer = {"path": str(Path(stream.path).resolve()), "offset": offset, "tail": tail}
    if with_output is None:
        with_output = pointer is None
    quantities = []
    for quantity in cockpit.quantities:
        name = cockpit.name_of(quantity)
        quantities.append(
            {
                "name": name,
                "class": _class_path(quantity),
                "settings": pack(cockpit._initial_settings.get(id(quantity), {}), where=f"{name} settings"),
                "state": pack(quantity.state_dict(), params, f"{name}.state_dict()"),
                "output": pack(dict(quantity.output), params, f"{name}.output") if with_output else None,
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "next_step": cockpit._next_step,
        "params": _param_description(params),
        "quantities": quantities,
        "epoch_logs": pack(cockpit._output.epoch_logs, params, "cockpit.log(...) values") if with_output else None,
        "findings": pack(cockpit._output.findings, where="findings") if with_output else None,
        "skipped": pack(cockpit._output.skipped, where="skipped steps") if with_output else None,
        "checks": pack(cockpit._output.checks, where="self-checks") if with_output else None,
        "diagnosis": _diagnosis_state(cockpit),
        "stream": pointer,
        "history": _history_state(cockpit),
    }


def _history_state(cockpit) -> dict[str, Any]:
    """When the run began and where it was resumed, for :meth:`Cockpit.write` after a resumption."""
    return {"created": cockpit._history.get("created"),
            "resumptions": [dict(entry) for entry in cockpit._history.get("resumptions", [])]}


def _diagnosis_state(cockpit) -> Any:
    diagnosis = getattr(cockpit, "diagnosis", None)
    if diagnosis is None or not callable(getattr(diagnosis, "state_dict", None)):
        return None  # rebuilt from the output on load
    return pack(diagnosis.state_dict(), cockpit.params, "cockpit.diagnosis.state_dict()")


def _restore_diagnosis(cockpit, saved: Any) -> None:
    """The diagnosis from its own state, else rebuilt: its history from the output so far,
    what it reported and what is active from the stored findings (no finding twice)."""
    diagnosis = getattr(cockpit, "diagnosis", None)
    if diagnosis is None:
        return
    if saved is not None and callable(getattr(diagnosis, "load_state_dict", None)):
        diagnosis.load_state_dict(unpack(saved, cockpit.params))
        return
    for step, values in cockpit.get_output().items():
        diagnosis.update(step, values)
    found = {int(step): values for step, values in cockpit._output.findings.items()}
    cleared = set()
    for values in found.values():
        for entry in values.get(DIAGNOSIS_KEYS[1]) or []:
            cleared.add((entry.get("rule"), entry.get("layer"), entry.get("found_at")))
    findings_key = DIAGNOSIS_KEYS[0]
    reported = [Finding.from_dict(dict(data)) for step in sorted(found) for data in found[step].get(findings_key) or []]
    diagnosis.reported = reported
    diagnosis.active = {f.key: f for f in reported if (f.rule, f.layer, f.step) not in cleared}


def _check_format(state: Any) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"cockpit.load_state_dict(): not a cockpit state (got {keys}); pass what "
            "cockpit.state_dict() returned, e.g. checkpoint['cockpit']"
        )
    if not isinstance(state.get("version"), int) or state["version"] > VERSION:
        raise ValueError(
            f"cockpit.load_state_dict(): state version {state.get('version')!r}; this cockpit_like "
            f"reads versions up to {VERSION}. Upgrade cockpit_like to load it."
        )


def _check_fresh(cockpit) -> None:
    used = (
        cockpit._open_step is not None
        or cockpit._next_step != 0
        or cockpit._output.epoch_logs
        or getattr(cockpit, "_findings", None)
        or any(q.output for q in cockpit.quantities)
        or (cockpit._output.stream is not None and cockpit._output.stream.opened)
    )
    if used:
        raise RuntimeError(
            "cockpit.load_state_dict(): this cockpit already tracked steps; load the state into "
            "a new cockpit before its first step (build it with the same quantities and params)"
        )


def _check_params(cockpit, saved: list[dict[str, Any]]) -> None:
    mine = _param_description(cockpit.params)
    if mine == saved:
        return
    names = cockpit._names_of_params()
    lines = []
    if len(mine) != len(saved):
        lines.append(f"the checkpoint has {len(saved)} parameter tensors, this cockpit {len(mine)}")
    for index, (old, new) in enumerate(zip(saved, mine)):
        if old != new:
            name = names.get(id(cockpit.params[index]))
            label = f"#{index}" + (f" ({name})" if name else "")
            lines.append(
                f"parameter {label}: {old['dtype']}{old['shape']} in the checkpoint, "
                f"{new['dtype']}{new['shape']} here"
            )
    raise StateMismatchError(
        "cockpit.load_state_dict(): the parameters differ from the checkpoint's:\n  "
        + "\n  ".join(lines)
        + "\nBuild the cockpit on the same model (Cockpit(model.parameters(), ...)) as the saved run."
    )


def _class_path(quantity) -> str:
    """``module:qualname`` of the quantity's class."""
    return f"{type(quantity).__module__}:{type(quantity).__qualname__}"


def _same_class(old: str, new: str) -> bool:
    """Same module and name; a class of a script (``__main__``) matches by name alone."""
    (old_module, old_name), (new_module, new_name) = old.split(":"), new.split(":")
    return old_name == new_name and (old_module == new_module or "__main__" in (old_module, new_module))


def _check_quantities(cockpit, saved: list[dict[str, Any]]) -> None:
    old = [(q["name"], q["class"]) for q in saved]
    new = [(cockpit.name_of(q), _class_path(q)) for q in cockpit.quantities]
    if len(old) != len(new) or any(a != b or not _same_class(x, y) for (a, x), (b, y) in zip(old, new)):
        missing = [name for name, _ in old if name not in dict(new)]
        extra = [name for name, _ in new if name not in dict(old)]
        detail = []
        if missing:
            detail.append(f"missing here: {missing}")
        if extra:
            detail.append(f"not in the checkpoint: {extra}")
        if not detail:
            changed = [f"{a} ({x} -> {y})" for (a, x), (b, y) in zip(old, new) if a == b and not _same_class(x, y)]
            detail.append("other classes: " + ", ".join(changed) if changed else "same names in another order")
        raise StateMismatchError(
            "cockpit.load_state_dict(): the quantities differ from the checkpoint's ("
            + "; ".join(detail)
            + f").\n  checkpoint: {[name for name, _ in old]}\n  this cockpit: {[name for name, _ in new]}\n"
            "Build the cockpit with the same quantities, in the same order, as the saved run."
        )
    differences = []
    for entry, quantity in zip(saved, cockpit.quantities):
        before = unpack(entry["settings"])
        now = cockpit._initial_settings.get(id(quantity), {})
        if before != now:
            keys = sorted(set(before) | set(now), key=str)
            keys = [key for key in keys if before.get(key, _UNSET) != now.get(key, _UNSET)]
            changed = [f"{key}={before.get(key, '<unset>')!r} -> {now.get(key, '<unset>')!r}" for key in keys]
            differences.append(f"{entry['name']}: " + ", ".join(changed))
    if differences:
        raise StateMismatchError(
            "cockpit.load_state_dict(): quantity settings differ from the checkpoint's "
            "(checkpoint -> this cockpit):\n  " + "\n  ".join(differences)
            + "\nBuild the quantities with the same arguments as the saved run."
        )


_UNSET = object()


def _read_stream_output(pointer: dict[str, Any], candidates: list[Path]) -> dict[int, dict[str, Any]]:
    """The steps of the checkpoint's stream, up to its offset, from the first candidate that holds it."""
    for path in candidates:
        if stream_holds(path, pointer["offset"], pointer["tail"]):
            with open(path, "rb") as handle:
                text = handle.read(pointer["offset"]).decode()
            return _read_stream(text.split("\n"), path)[1]
    tried = ", ".join(str(p) for p in dict.fromkeys(candidates))
    raise FileNotFoundError(
        f"cockpit.load_state_dict(): the checkpoint keeps its output in its stream ({pointer['path']}, "
        f"{pointer['offset']} bytes), but no file holds it (tried {tried}; a file that was replaced or "
        "cut shorter does not count). Pass stream_to= the run's .jsonl, or save the state with "
        "cockpit.state_dict(with_output=True)."
    )


def load_cockpit_state(cockpit, state: dict[str, Any]) -> None:
    """The body of :meth:`Cockpit.load_state_dict`: check everything, then restore."""
    _check_format(state)
    _check_fresh(cockpit)
    _check_params(cockpit, state["params"])
    _check_quantities(cockpit, state["quantities"])
    params = cockpit.params
    pointer = state.get("stream")
    stream = cockpit._output.stream
    here = None if stream is None else Path(stream.path).resolve()
    continues = False
    streamed: dict[int, dict[str, Any]] = {}
    if pointer is not None:
        continues = here is not None and stream_holds(here, pointer["offset"], pointer["tail"])
        if any(entry["output"] is None for entry in state["quantities"]) or state["epoch_logs"] is None:
            candidates = ([here] if here is not None else []) + [Path(pointer["path"])]
            streamed = _read_stream_output(pointer, candidates)

    for entry, quantity in zip(state["quantities"], cockpit.quantities):
        quantity.load_state_dict(unpack(entry["state"], params))
        if entry["output"] is not None:
            quantity.output = unpack(entry["output"], params)
        else:
            name = entry["name"]
            quantity.output = {
                step: quantity.from_log(values[name], params) for step, values in sorted(streamed.items()) if name in values
            }
    if state["epoch_logs"] is not None:
        epoch_logs = unpack(state["epoch_logs"], params)
    else:
        epoch_logs = {}
        for step, values in sorted(streamed.items()):
            logged = {key: value for key, value in values.items() if key in EPOCH_KEYS}
            if logged:
                epoch_logs[step] = logged
    cockpit._output.epoch_logs = epoch_logs
    if state.get("findings") is not None:
        cockpit._output.findings = unpack(state["findings"])
    else:
        cockpit._output.findings = {}
        for step, values in sorted(streamed.items()):
            kept = {key: value for key, value in values.items() if key in DIAGNOSIS_KEYS}
            if kept:
                cockpit._output.findings[step] = kept
    if state.get("skipped") is not None:  # checkpoints of earlier versions have no "skipped"
        cockpit._output.skipped = unpack(state["skipped"])
    else:
        cockpit._output.skipped = {
            step: dict(values[SKIPPED_KEY]) for step, values in sorted(streamed.items()) if SKIPPED_KEY in values
        }
    if state.get("checks") is not None:  # checkpoints of earlier versions have no "checks"
        cockpit._output.checks = unpack(state["checks"])
    else:
        cockpit._output.checks = {
            step: dict(values[CHECKS_KEY]) for step, values in sorted(streamed.items()) if CHECKS_KEY in values
        }
    # the checks the output showed (a note, a failed check): shown again (a plain valid step stays as it was)
    cockpit._output.shown_checks = {step for step, checks in cockpit._output.checks.items() if notable(checks)}
    _restore_diagnosis(cockpit, state.get("diagnosis"))
    cockpit._next_step = int(state["next_step"])
    now = cockpit.metadata()["created"]
    history = state.get("history") or {}  # checkpoints of earlier versions have none: the start is unknown
    cockpit._history = {
        "created": history.get("created"),
        "resumptions": list(history.get("resumptions", [])) + [{"step": cockpit._next_step, "created": now}],
    }

    if stream is None:
        return
    if continues:
        stream.continue_at(pointer["offset"], pointer["tail"])
        stream.write_metadata({**cockpit.metadata(), "created": now, "resumed_at_step": cockpit._next_step})
    else:  # another file (or none yet): it gets everything restored, then the new steps
        for step, values in cockpit.get_output().items():
            stream.write_step(step, values)
