"""Cockpit logs on disk: plain JSON, a streaming form, and one reader for both.

Two forms, both plain JSON with no special encoders:

- **Full log** (``Cockpit.write(path)`` writes ``path.json``)::

      {"schema": "cockpit_like.log", "schema_version": 1,
       "metadata": {...}, "steps": {"0": {"Loss": 2.3, ...}, "1": {...}}}

- **Streaming log** (``Cockpit(..., stream_to=path)`` writes ``path.jsonl``),
  one JSON document per line, flushed as each step is tracked::

      {"schema": "cockpit_like.stream", "schema_version": 1, "metadata": {...}}
      {"step": 0, "values": {"Loss": 2.3, ...}}
      {"step": 0, "values": {"UpdateSize": [...]}}     # finished one step later

  A run that crashes or is killed loses at most the line being written; the
  reader skips a torn last line.

Values: numpy arrays become nested lists, tuples become lists, and the
non-finite floats NaN, inf and -inf (not allowed in JSON) are written as the
strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``, which the reader turns
back into floats. :func:`read_log` also reads logs written by Cockpit
(``cockpit-for-pytorch``), whose arrays are ``{"__ndarray__": ...}`` objects.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = ["SCHEMA_VERSION", "EPOCH_KEYS", "read_log", "read_log_with_metadata", "write_log", "StreamWriter", "encode", "decode"]

SCHEMA_VERSION = 1

#: Keys stored by ``Cockpit.log(...)`` (epoch-level figures), in signature order.
EPOCH_KEYS = (
    "epoch_count",
    "train_loss",
    "valid_loss",
    "test_loss",
    "train_accuracy",
    "valid_accuracy",
    "test_accuracy",
    "learning_rate",
)
_FULL = "cockpit_like.log"
_STREAM = "cockpit_like.stream"
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode_float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _encode_nested(value: Any) -> Any:
    if isinstance(value, list):
        return [_encode_nested(v) for v in value]
    if isinstance(value, float):
        return _encode_float(value)
    return value


def encode(value: Any) -> Any:
    """A JSON-safe copy of a stored value (see the module docstring)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return _encode_float(value)
    if isinstance(value, np.ndarray):
        listed = value.tolist()
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return _encode_nested(listed)
        return listed
    if isinstance(value, np.generic):
        return encode(value.item())
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if hasattr(value, "tolist"):  # e.g. a tensor a custom quantity left unconverted
        return encode(np.asarray(value.tolist()))
    raise TypeError(
        f"cannot write a {type(value).__name__} to a cockpit log; quantities must return "
        "numbers, arrays, or lists/tuples/dicts of them"
    )


def decode(value: Any) -> Any:
    """Inverse of :func:`encode` (arrays come back as nested lists)."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__ndarray__" in value:  # a Cockpit (json_tricks) array
            return np.asarray(decode(value["__ndarray__"]), dtype=value.get("dtype"))
        return {k: decode(v) for k, v in value.items()}
    return value


def run_metadata(quantities: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Library and torch versions, the time, and the tracked quantities."""
    import torch

    from cockpit_like import __version__

    return {
        "library": "cockpit_like",
        "version": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "created": now_iso(),
        "quantities": quantities or [],
    }


def now_iso() -> str:
    """The time now, as the logs' ``created`` says it (UTC, to the second)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _json_path(logpath: str | os.PathLike, suffix: str) -> Path:
    path = Path(logpath)
    return path if path.suffix == suffix else path.with_name(path.name + suffix)


def make_folder(folder: Path, what: str) -> None:
    """``folder`` and its parents, or an error that says what could not be made for what and why."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        blocking = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
        raise ValueError(
            f"cannot create the folder {folder} for {what}: {blocking or error.filename} is a file, not a folder; "
            "choose another path"
        ) from error
    except OSError as error:  # no permission, a read-only or special file system (/proc), ...
        raise ValueError(
            f"cannot create the folder {folder} for {what}: {error.strerror or error} ({error.filename}); choose a "
            "path you can write to"
        ) from error


def write_log(logpath: str | os.PathLike, steps: Mapping[int, Mapping[str, Any]], metadata: dict) -> Path:
    """Write the full form to ``logpath + ".json"`` atomically; return the path.

    Folders are created as needed. The file is written to a temporary name
    and renamed, so a crash while writing never leaves a half-written log in
    place of the previous one.
    """
    path = _json_path(logpath, ".json")
    make_folder(path.parent, "the log")
    document = {
        "schema": _FULL,
        "schema_version": SCHEMA_VERSION,
        "metadata": metadata,
        "steps": {str(step): encode(values) for step, values in sorted(steps.items())},
    }
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        json.dump(document, handle, indent=1, allow_nan=False)
    os.replace(temporary, path)
    return path


class StreamWriter:
    """Appends one line per tracked step to ``logpath + ".jsonl"``.

    The file is opened (and an existing one replaced) at the first step
    line, not when the writer is made: until then the header and metadata
    lines wait in memory, so that a resumed run can instead continue the
    file at its checkpoint (:meth:`continue_at`) without losing it.

    Lines go through a queue: :meth:`enqueue` adds them (all or none), and
    :meth:`drain` writes them in order. A line whose write fails (a full disk,
    a ``KeyboardInterrupt`` in the middle of it) stays queued: the next
    drain cuts the file back to its last whole line and writes it again, so
    what the cockpit stored in memory reaches the file as soon as a write
    succeeds (the next step, :meth:`drain`, :meth:`close`). An ``OSError``
    does not stop the run: a warning says how many lines wait, once per
    streak of failed writes; :meth:`close` warns of those it could not write.

    Args:
        logpath: where to write (``.jsonl`` is appended if missing).
        metadata: written in the header line.
        fsync: also force each line to the disk (survives a machine crash,
            not only a killed process; slower).
    """

    #: ``{resolved path: writer}`` of the files open in this process: a second writer that opens one
    #: takes it over (see :meth:`_take_over`)
    _owners: "weakref.WeakValueDictionary[str, StreamWriter]" = weakref.WeakValueDictionary()

    def __init__(self, logpath: str | os.PathLike, metadata: dict, fsync: bool = False):
        if not isinstance(logpath, (str, os.PathLike)):
            raise TypeError(
                f"Cockpit(stream_to=...) takes a path (str or pathlib.Path) without an extension, e.g. 'runs/exp1' "
                f"(the cockpit writes runs/exp1.jsonl), got {type(logpath).__name__}"
            )
        text = os.fspath(logpath)
        if text.endswith(("/", os.sep)):  # (a folder of that name may exist: runs/exp1 beside TensorBoard's runs/exp1/)
            raise ValueError(
                f"Cockpit(stream_to={text!r}) names a folder; stream_to is the log's path (runs/exp1 writes runs/exp1.jsonl): "
                f"e.g. stream_to={os.path.join(text.rstrip('/' + os.sep) or '.', 'run')!r} writes "
                f"{os.path.join(text.rstrip('/' + os.sep) or '.', 'run.jsonl')} (and cockpit.write() its .json)"
            )
        self.path = _json_path(logpath, ".jsonl")
        #: another writer in this process opened the same file after this one: this one writes no more
        self.superseded = False
        make_folder(self.path.parent, "the stream (stream_to)")
        self._fsync = fsync
        self._handle: IO[bytes] | None = None
        self._closed = False
        self._waiting: list[dict] = [{"schema": _STREAM, "schema_version": SCHEMA_VERSION, "metadata": metadata}]
        #: encoded lines not yet written, in order
        self._queue: list[bytes] = []
        #: the file may hold part of a line after :attr:`_offset` (a write failed or was interrupted)
        self._torn = False
        #: a warning was given for the current streak of failed writes
        self._warned = False
        self._offset = 0  # bytes in the file
        self._tail = b""  # the last line written

    @property
    def opened(self) -> bool:
        """Whether the file was opened (it holds this writer's lines, up to :meth:`position`; also once another
        writer took the file over: what this one wrote stays there, and a resumed run can continue after it)."""
        return self._handle is not None or self._closed or self.superseded

    @property
    def pending(self) -> int:
        """Lines queued and not yet written (a failed write's; see the class docstring)."""
        return len(self._queue)

    def position(self) -> tuple[int, str]:
        """``(bytes written, last line)``: where a resumed run continues (see :meth:`continue_at`)."""
        return self._offset, self._tail.decode()

    def continue_at(self, offset: int, tail: str) -> None:
        """Continue an existing stream: drop what follows byte ``offset`` and append from there.

        ``tail`` is the line that ends at ``offset`` (from :meth:`position`); it
        is checked so that a different file is never cut. Lines waiting to be
        written (the header) are dropped: the file has its own.

        Raises:
            RuntimeError: this writer already wrote to its file.
            ValueError: the file does not hold ``tail`` just before ``offset``.
        """
        if self.opened:
            raise RuntimeError(f"the stream to {self.path} was already written; continue it before the first step")
        if not stream_holds(self.path, offset, tail):
            raise ValueError(f"{self.path} does not hold the line {tail[:80]!r} ending at byte {offset}")
        self._take_over(warn=False)  # a resumed run continues the file by design (the older writer stops)
        handle = open(self.path, "r+b", buffering=0)
        handle.truncate(offset)
        handle.seek(offset)
        self._handle, self._waiting, self._closed = handle, [], False
        self._offset, self._tail = offset, tail.encode()

    @staticmethod
    def _encode(document: dict) -> bytes:
        return (json.dumps(document, allow_nan=False) + "\n").encode()

    def _take_over(self, warn: bool = True) -> None:
        """Become the one writer of this file in the process. A writer that still has it open (two cockpits
        given one ``stream_to``, or a notebook cell that made a new cockpit while the old one lives) stops
        writing to it, with a warning: their lines interleaved, and no reader could read the file (outside
        trial 9). The other cockpit keeps every step in memory."""
        key = str(self.path.resolve())
        other = StreamWriter._owners.get(key)
        if other is not None and other is not self and other._handle is not None and not other._closed:
            other._handle.close()
            other._handle, other._queue, other.superseded = None, [], True
            if not warn:
                StreamWriter._owners[key] = self
                return
            import warnings

            warnings.warn(
                f"[cockpit_like] two cockpits stream to {self.path}: the newer one now writes it (it starts the file "
                "afresh) and the older one writes no more (its steps stay in its memory: cockpit.get_output(), "
                "cockpit.write(path)). Give each Cockpit its own stream_to, or close() the old one first.",
                RuntimeWarning,
                stacklevel=4,
            )
        StreamWriter._owners[key] = self

    def _open(self) -> None:
        self._take_over()
        # unbuffered: what a write call returns is in the file, so a failed line can be cut back exactly
        handle = open(self.path, "wb", buffering=0)
        self._queue[:0] = [self._encode(document) for document in self._waiting]  # (then dropped: never lost)
        self._waiting = []
        self._handle = handle

    def _write(self, line: bytes) -> None:
        """Write one whole line at :attr:`_offset` (after cutting off what a failed write left)."""
        if self._torn:
            self._handle.truncate(self._offset)
            self._handle.seek(self._offset)
        self._torn = True  # until the line is known to be complete
        view = memoryview(line)
        while view:
            view = view[self._handle.write(view):]
        if self._fsync:
            os.fsync(self._handle.fileno())
        self._offset += len(line)
        self._tail = line
        self._torn = False

    def enqueue(self, lines: list[bytes]) -> None:
        """Queue encoded lines (:meth:`step_line`, :meth:`retract_line`) to be written by :meth:`drain`."""
        if self._closed:
            raise RuntimeError(f"the stream to {self.path} was closed")
        if self.superseded:
            return  # another cockpit writes this file now (warned when it took it over); memory has the steps
        self._queue.extend(lines)  # one operation: all of them or none

    def drain(self) -> bool:
        """Write the queued lines in order; whether none is left. An ``OSError`` leaves the failed line and those
        after it queued and warns (once per streak of failures); anything else (``KeyboardInterrupt``) propagates,
        the lines still queued."""
        if not self._queue:
            return True
        try:
            if self._handle is None:
                self._open()
            while self._queue:
                self._write(self._queue[0])
                del self._queue[0]
        except OSError as error:
            if not self._warned:
                self._warned = True
                import warnings

                warnings.warn(
                    f"[cockpit_like] could not write to the stream {self.path} ({type(error).__name__}: {error}): "
                    f"{len(self._queue)} line(s) wait in memory and are written as soon as a write succeeds (at the "
                    "next step, cockpit.write() or cockpit.close()). The output in memory (cockpit.get_output(), "
                    "cockpit.write(path)) has every step.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return False
        self._warned = False
        return True

    def step_line(self, step: int, values: Mapping[str, Any]) -> bytes:
        """The encoded line of a step's values (raises for a value that cannot be written, queuing nothing)."""
        return self._encode({"step": int(step), "values": encode(values)})

    def retract_line(self, step: int, names: list[str]) -> bytes:
        """The encoded line that withdraws values of ``step`` streamed earlier (the reader drops them)."""
        return self._encode({"step": int(step), "retract": sorted(names)})

    def _line(self, document: dict) -> None:
        if self._handle is None:
            if self._closed:
                raise RuntimeError(f"the stream to {self.path} was closed")
            if "step" not in document and not self._queue:
                self._waiting.append(document)  # header and metadata wait for the first step
                return
        self.enqueue([self._encode(document)])
        self.drain()

    def write_metadata(self, metadata: dict) -> None:
        """Replace the metadata (e.g. once quantities chose how to compute for the model)."""
        self._line({"metadata": metadata})

    def write_step(self, step: int, values: Mapping[str, Any]) -> None:
        if values:
            self.enqueue([self.step_line(step, values)])
            self.drain()

    def retract(self, step: int, names: list[str]) -> None:
        """Values of ``step`` streamed earlier that no longer hold (a step found invalid after it was stored):
        the reader drops them."""
        if names:
            self.enqueue([self.retract_line(step, names)])
            self.drain()

    def close(self) -> None:
        if self._closed:
            return
        if self.superseded:  # another cockpit writes the file now: nothing of this one goes there
            self._closed = True
            return
        if self._handle is None and not self._queue:
            self._queue = [self._encode(document) for document in self._waiting]  # a run without steps: its header
            self._waiting = []
        self._warned = False  # a last try, and a last word if it fails
        written = self.drain()
        if not written:
            import warnings

            warnings.warn(
                f"[cockpit_like] closing the stream {self.path}: {len(self._queue)} line(s) could not be written "
                "(see the warning before); the stream misses them. Save the output in memory, which has every "
                "step, with cockpit.write(path).",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self._closed = True


def stream_holds(path: str | os.PathLike, offset: int, tail: str) -> bool:
    """Whether the file at ``path`` has the line ``tail`` ending at byte ``offset``."""
    path, data = Path(path), tail.encode()
    if not path.is_file() or path.stat().st_size < offset or len(data) > offset:
        return False
    with open(path, "rb") as handle:
        handle.seek(offset - len(data))
        return handle.read(len(data)) == data


def _progress(iterable, total: int, path: Path, unit: str, enabled: bool | None):
    if enabled is False:
        return iterable
    from cockpit_like.utils.progress import progress

    # shown only if the reading takes more than half a second (unless asked for)
    return progress(iterable, total, f"reading {path.name}", enabled, unit=unit, delay=0.0 if enabled else 0.5)


def _json_kind(value: Any) -> str:
    """What a JSON document is, in words: ``a JSON array``, ``a JSON number``, ..."""
    if isinstance(value, dict):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, bool):
        return f"the JSON value {str(value).lower()}"
    if isinstance(value, (int, float)):
        return "a JSON number"
    if isinstance(value, str):
        return "a JSON string"
    return "the JSON value null"


#: What a cockpit log looks like, for the errors on a file that is not one.
LOG_FORMS = (
    "A cockpit log is the JSON object Cockpit.write() writes "
    '({"schema": "cockpit_like.log", "schema_version": 1, "metadata": {...}, "steps": {"0": {"Loss": ...}, ...}}), '
    "the stream Cockpit(..., stream_to=...) writes (a .jsonl file: the header line "
    '{"schema": "cockpit_like.stream", ...}, then one {"step": s, "values": {...}} line per step), '
    'or a log written by Cockpit (cockpit-for-pytorch: {"0": {"Loss": ...}, "1": {...}}). '
    "Check that the path names the run's log (docs/logs.md)."
)


def _not_a_log(path: Path, problem: str) -> ValueError:
    """The error for a file that is not a cockpit log: the file, what is wrong with it, and the forms a log has."""
    return ValueError(f"{path} is not a cockpit log: {problem}. {LOG_FORMS}")


def _read_stream(
    lines: list[str], path: Path, progress: bool | None = False, first_line: int = 1
) -> tuple[dict, dict[int, dict[str, Any]]]:
    """The metadata and steps of stream lines (``first_line``: the number of ``lines[0]`` in the file, for errors).

    Raises:
        ValueError: a line is not one a stream has (:func:`_not_a_log`), or is not JSON and is not the last.
    """
    metadata: dict = {}
    steps: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(_progress(lines, len(lines), path, "line", progress)):
        if not line.strip():
            continue
        where = f"line {first_line + number}"
        try:
            document = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) - 1:
                break  # the line in flight when the run stopped
            raise ValueError(f"{path}: {where} is not valid JSON") from None
        if not isinstance(document, dict):
            raise _not_a_log(path, f"{where} is {_json_kind(document)}, where a stream has one JSON object per line")
        if "schema" in document:
            if document["schema"] != _STREAM:
                raise _not_a_log(path, f'{where} has "schema": {document["schema"]!r}, where a stream\'s header has '
                                       f'"{_STREAM}"')
            _check_version(document, path)
            metadata = merge_metadata(metadata, _metadata_of(document, path))
            continue
        if "step" not in document:
            if "metadata" in document:  # updated metadata
                metadata = merge_metadata(metadata, _metadata_of(document, path))
                continue
            keys = ", ".join(sorted(map(str, document))[:5])
            raise _not_a_log(path, f'{where} is a JSON object without "step" (its keys: {keys or "none"})')
        step, values = document["step"], document.get("values", {})
        if not isinstance(step, int) or isinstance(step, bool):
            raise _not_a_log(path, f"{where} has step {step!r}, where a stream has a whole number")
        if not isinstance(values, dict):
            raise _not_a_log(path, f'{where} has "values" that are {_json_kind(values)}, not an object of name: value')
        merged = steps.setdefault(step, {})
        for name in document.get("retract", ()):
            merged.pop(name, None)
        merged.update(decode(values))
    return metadata, steps


def merge_metadata(earlier: dict, later: dict) -> dict:
    """The metadata of a stream with a later metadata line (or the metadata read from later lines).

    A later line replaces what it holds (quantities that chose how to compute
    once they saw the model), except the run's history: ``created`` stays the
    first line's (when the run began), and each resumption
    (``"resumed_at_step"``, written when a run continues the stream from a
    checkpoint, docs/resume.md) is kept in ``"resumptions"``, a list of
    ``{"step": ..., "created": ...}`` in order; ``"resumed_at_step"`` is the
    last one's step.
    """
    if not earlier:
        return dict(later)
    merged = {**earlier, **later}
    if "created" in earlier:
        merged["created"] = earlier["created"]
    resumptions = _resumptions(earlier) + _resumptions(later)
    if resumptions:
        merged["resumptions"] = resumptions
        merged["resumed_at_step"] = resumptions[-1]["step"]
    return merged


def _resumptions(metadata: dict) -> list[dict]:
    if "resumptions" in metadata:
        return list(metadata["resumptions"])
    if "resumed_at_step" in metadata:
        return [{"step": metadata["resumed_at_step"], "created": metadata.get("created")}]
    return []


def _metadata_of(document: dict, path: Path) -> dict:
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _not_a_log(path, f'its "metadata" is {_json_kind(metadata)}, not an object')
    return metadata


def _steps_of(items: Mapping[str, Any], path: Path, progress: bool | None) -> dict[int, dict[str, Any]]:
    """``{step: values}`` of a full log's ``steps`` or a Cockpit log, checking that each is ``"<int>": {...}``."""
    steps: dict[int, dict[str, Any]] = {}
    for key, values in _progress(items.items(), len(items), path, "step", progress):
        if not isinstance(values, dict):
            raise _not_a_log(path, f"step {key} holds {_json_kind(values)}, not an object of name: value")
        steps[int(key)] = decode(values)
    return steps


def _check_version(document: dict, path: Path) -> None:
    version = document.get("schema_version")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(
            f"{path} has log schema version {version!r}; this cockpit_like reads versions "
            f"up to {SCHEMA_VERSION}. Upgrade cockpit_like to read it."
        )


def _resolve(path: str | os.PathLike) -> Path:
    """``path`` itself, else (when it has no ``.json`` / ``.jsonl`` suffix) ``path + ".json"``, then ``+ ".jsonl"``."""
    path = Path(path)
    if path.suffix in (".json", ".jsonl"):  # a full name: nothing to add to it
        if path.is_file():
            return path
        raise FileNotFoundError(f"no cockpit log at {path}")
    for candidate in (path, _json_path(path, ".json"), _json_path(path, ".jsonl")):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no cockpit log at {path} (also tried {path}.json and {path}.jsonl)"
    )


def read_log_with_metadata(path: str | os.PathLike, progress: bool | None = False) -> tuple[dict, dict[int, dict[str, Any]]]:
    """``(metadata, {step: {name: value}})`` from any log form (``progress``: as in :func:`read_log`).

    An empty ``.jsonl`` (0 bytes, or only a header line torn by a crash) is an
    empty stream, ``({}, {})``: a run stopped before its first step reached
    the file. Every other file that is not a cockpit log raises.

    Raises:
        FileNotFoundError: no file at ``path`` (nor with ``.json`` / ``.jsonl``).
        ValueError: the file is not a cockpit log (an empty ``.json``, a JSON
            array, number or string, an object of another kind, lines that are
            not a stream), or one of a newer schema version.
    """
    path = _resolve(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise _not_a_log(path, f"it is not text (byte {error.object[error.start]:#04x} at offset {error.start} is not "
                               "UTF-8: a binary file, such as the dashboard's .png)") from None
    if not text.strip():
        if path.suffix == ".jsonl":
            return {}, {}  # an empty stream: the run stopped before its first step reached the file
        raise _not_a_log(path, "the file is empty" if not text else "the file holds only white space")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        lines = text.split("\n")
        first = next(number for number, line in enumerate(lines) if line.strip())
        try:
            header = json.loads(lines[first])
        except json.JSONDecodeError:
            header = None
        if isinstance(header, dict) and header.get("schema") == _STREAM:
            return _read_stream(lines[first:], path, progress, first_line=first + 1)
        if header is None and path.suffix == ".jsonl" and "\n" not in text.strip() and not text.endswith("\n") and (
                text.lstrip().startswith("{")):
            return {}, {}  # a stream whose header line (a JSON object) was torn by a crash: no step reached the file
        if header is None and text.lstrip().startswith("{") and error.pos >= len(text.rstrip()) - 1:
            stream = path.with_suffix(".jsonl")
            where = (f"the run's stream {stream} holds each step as it was tracked (read or plot that file)"
                     if stream.exists() and stream != path else
                     "a run streamed with Cockpit(..., stream_to=...) keeps each step in its .jsonl file as it is "
                     "tracked")  # fmt: skip
            raise ValueError(
                f"{path} is cut off: its JSON ends at line {error.lineno} before it is complete ({error.msg}), as "
                f"when writing it was interrupted or a copy stopped short; {where}"
            ) from None
        if header is None:
            raise _not_a_log(path, f"it is not JSON ({error.msg}: line {error.lineno} column {error.colno})") from None
        raise _not_a_log(path, f"the file is not one JSON document, and its first line ({lines[first].strip()[:60]}) "
                               f'is not the header of a stream ({{"schema": "{_STREAM}", ...}})') from None
    if not isinstance(document, dict):
        raise _not_a_log(path, f"it holds {_json_kind(document)}")
    schema = document.get("schema")
    if schema == _STREAM:  # a stream with its header line only: a run that tracked no step
        return _read_stream([text], path, progress)
    if schema == _FULL:
        _check_version(document, path)
        steps = document.get("steps")
        if not isinstance(steps, dict):
            raise _not_a_log(path, f'it has "schema": "{_FULL}" but its "steps" are '
                                   f"{'missing' if steps is None else _json_kind(steps)}, not an object of steps")
        if not all(key.lstrip("-").isdigit() for key in steps):
            raise _not_a_log(path, 'its "steps" have keys that are not step numbers')
        return _metadata_of(document, path), _steps_of(steps, path, progress)
    if schema is None and all(key.lstrip("-").isdigit() for key in document):  # a Cockpit log ({} if it has no step)
        return {"library": "cockpit"}, _steps_of(document, path, progress)
    if schema is not None:
        raise _not_a_log(path, f'it has "schema": {schema!r}, which is not a cockpit log\'s')
    keys = ", ".join(sorted(document)[:5]) + (", ..." if len(document) > 5 else "")
    raise _not_a_log(path, f'it is a JSON object with neither "schema" nor step numbers as keys (its keys: {keys})')


def read_log(path: str | os.PathLike, progress: bool | None = False) -> dict[int, dict[str, Any]]:
    """Load a log written by :meth:`Cockpit.write`, a streaming log, or a Cockpit log.

    Args:
        path: the file, with or without ``.json`` / ``.jsonl``.
        progress: a progress bar on stderr while the steps are decoded
            (tqdm; :func:`cockpit_like.utils.progress.progress`): True always,
            None in a terminal or a notebook once it takes over half a second
            (what ``cockpit-like plot`` / ``influence`` use), False never.

    Returns:
        ``{global_step: {quantity_name: value}}`` as :meth:`Cockpit.get_output`
        gives it, with arrays as nested lists and non-finite floats restored.
    """
    return read_log_with_metadata(path, progress)[1]
