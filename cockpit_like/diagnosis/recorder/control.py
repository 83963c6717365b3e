"""When the cockpit records: :class:`Recorder`, one per cockpit.

- **On demand** (``cockpit.record(step)``): the step is *armed*. When the
  model's forward pass of that step begins (the tracer's root forward
  pre-hook, which knows the coming step), the :class:`~.tape.Tape` starts;
  it stops when the step's ``with cockpit(step)`` block (or ``end()``) exits,
  before the cockpit computes its quantities. So the forward pass, the loss
  and the backward pass are recorded as they run. Steps that are not armed
  pay one Python call per forward pass (the tracer notes the inputs).
- **Automatically** (``Cockpit(record_nonfinite=True)``, the default), at the
  first step whose loss or gradient is not finite, once per cockpit:

  * the loss is read from ``info["loss"]`` when the step begins (one
    device sync per step that passes a tensor loss: ``isfinite``; tracked
    steps did this already). If it is not finite, the model's forward pass
    is run again under the tape, from the inputs the tracer saw at this
    step's forward pass (the parameters have not changed yet: the optimizer
    steps after the backward pass), with the model's buffers restored
    afterwards. The loss is computed again if ``info["loss_fn"]`` is given
    (a function of the model's output: ``lambda out: lossfunc(out, y)``),
    and then the backward pass too (``torch.autograd.grad``; ``.grad`` is
    not touched); without it the record holds the forward pass and says so.
  * on tracked steps the gradients are checked at the end of the step (one
    ``isfinite`` per parameter and one sync); untracked steps are not
    checked. A non-finite gradient under a finite loss re-runs the forward
    pass, the loss (``info["loss_fn"]``) and the backward pass.

  Random layers (dropout) draw again in the re-run; the record notes when
  the re-run's loss differs from the step's.

May import torch and :mod:`cockpit_like.diagnosis`.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from cockpit_like.diagnosis.findings import Finding
from cockpit_like.diagnosis.recorder.record import Record
from cockpit_like.diagnosis.recorder.tape import Tape

__all__ = ["Recorder", "RECORD_KEY"]

#: where a record is stored in the cockpit's output: ``{step: {RECORD_KEY: record dict}}``
RECORD_KEY = "record"


def _names(root: nn.Module) -> dict[int, str]:
    """``id -> name`` of the modules (path), parameters and buffers of ``root``."""
    names: dict[int, str] = {}
    for name, module in root.named_modules():
        names.setdefault(id(module), name)
    for name, param in root.named_parameters():
        names.setdefault(id(param), f"parameter '{name}'")
    for name, buffer in root.named_buffers():
        names.setdefault(id(buffer), f"buffer '{name}'")
    return names


def gradients_finite(params: list[torch.Tensor]) -> bool:
    """Whether every gradient entry of ``params`` is finite (one device sync).

    The sum of all entries is non-finite whenever an entry is (NaN and ±inf
    propagate); only then, or when finite entries overflow the sum, are the
    entries checked one by one.
    """
    grads = []
    for param in params:
        grad = param.grad
        if grad is not None:
            grads.append(grad.coalesce().values() if grad.is_sparse else grad.detach())
    if not grads:
        return True
    with torch.no_grad():
        sums = [grad.sum(dtype=torch.float64 if grad.dtype == torch.float64 else torch.float32) for grad in grads]
        if math.isfinite(torch.stack([total.double() for total in sums]).sum().item()):
            return True
        return bool(torch.stack([torch.isfinite(grad).all() for grad in grads]).all())


def loss_finite(loss: Any) -> bool | None:
    """Whether a loss (tensor or number) is finite; ``None`` for anything else (one device sync)."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() == 1:
            return math.isfinite(loss.item())
        return bool(torch.isfinite(loss.detach()).all())
    if isinstance(loss, (int, float)):
        return math.isfinite(loss)
    return None


class Recorder:
    """Arms, runs and stores the records of one cockpit (see the module docstring).

    Args:
        tracer: the cockpit's :class:`~cockpit_like.backends.tracer.ModelTracer`.
        params: the tracked parameters.
        auto: record the first step with a non-finite loss or gradient (``True``;
            ``"tracked"``: check the loss only on tracked steps, no device sync on
            the others; ``False``: never).
        is_tracked: ``step -> bool``, whether a quantity tracks ``step`` (for ``"tracked"``).
        folder: where to save each record (``step_<N>.record.json``, the replay
            program ``step_<N>.py`` and its ``step_<N>.pt``); ``None``: in memory only.
        max_ops: operations recorded at most per step.
        on_record: ``(step, record) -> None``, called when a record is finished.
        paused: ``() -> bool``, true while the cockpit does its own work inside the
            step (then nothing is recorded); default: while the tracer is paused.
    """

    def __init__(
        self,
        tracer,
        params: list[torch.Tensor],
        *,
        auto: bool | str = True,
        folder: str | os.PathLike | None = None,
        max_ops: int = 50_000,
        on_record: Callable[[int, Record], None] = lambda step, record: None,
        paused: Callable[[], bool] | None = None,
        is_tracked: Callable[[int], bool] = lambda step: True,
    ):
        if auto not in (True, False, "tracked"):
            raise ValueError(f"Cockpit(record_nonfinite=...) takes True, False or 'tracked', got {auto!r}")
        self.tracer = tracer
        self.params = params
        self.auto = auto
        self.is_tracked = is_tracked
        self.folder = None if folder is None else Path(folder)
        self.max_ops = max_ops
        self.on_record = on_record
        self._paused = paused if paused is not None else (lambda: tracer.paused)
        self.armed: set[int] = set()
        #: ``{step: Record}`` of the finished records
        self.records: dict[int, Record] = {}
        self._tape: Tape | None = None
        self._tape_step: int | None = None
        self._tape_notes: list[str] = []
        self._forward: tuple[weakref.ref, tuple, dict] | None = None
        self._auto_done = not auto

    # ---- arming ------------------------------------------------------------------------
    def arm(self, step: int, next_step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"cockpit.record(step): need a non-negative int, got {step!r}")
        if step < next_step:
            raise ValueError(
                f"cockpit.record({step}): step {step} has already begun or passed (the next step is "
                f"{next_step}). Call cockpit.record(step) before that step's forward pass."
            )
        self.armed.add(step)

    @property
    def recording(self) -> bool:
        return self._tape is not None

    # ---- the model's forward pass (called by the tracer) --------------------------------
    def forward_begins(self, root: nn.Module, args: tuple, kwargs: dict, step: int) -> None:
        if self._tape is None and step in self.armed:
            self._start(root, step, inside_root=True)
            return
        if not self._auto_done:
            self._forward = (weakref.ref(root), args, kwargs)

    def _start(self, root: nn.Module, step: int, inside_root: bool, notes: list[str] | None = None) -> None:
        self.armed.discard(step)
        tape = Tape(root, _names(root), paused=self._paused, max_ops=self.max_ops)
        tape.start(inside_root)
        self._tape, self._tape_step, self._tape_notes = tape, step, list(notes or [])

    # ---- the step (called by the cockpit) ------------------------------------------------
    @contextlib.contextmanager
    def beginning(self, step: int, info: dict, finite: Callable[[], bool | None] | None = None):
        """Around ``cockpit.begin(step)``: :meth:`step_begins`, then the cockpit's own work
        (loss checks, setting up the step) runs without being recorded."""
        self.step_begins(step, info, finite)
        tape = self._tape
        if tape is not None:
            tape._busy = True
        try:
            yield
        finally:
            if tape is not None:
                tape._busy = False

    def step_begins(self, step: int, info: dict, finite: Callable[[], bool | None] | None = None) -> None:
        """At ``cockpit.begin(step)``: a tape left by an unfinished step is closed; the automatic check.

        ``finite``: the step's loss check, shared with the cockpit's (asked at most once a step).
        """
        loss_fn = info.get("loss_fn")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(
                f"cockpit step {step}: info['loss_fn'] must be a function of the model's output that returns "
                f"the loss (e.g. lambda output: lossfunc(output, targets)), got {type(loss_fn).__name__}"
            )
        if self._tape is not None and self._tape_step != step:
            self._finish(info, [f"Step {self._tape_step} never reached cockpit.end(); the record stops at step {step}."])
        if self._tape is None and step in self.armed:
            root = self._root()
            if root is None:
                self.armed.discard(step)
                warnings.warn(
                    f"[cockpit_like] cockpit.record({step}): the cockpit has not seen the model, so nothing "
                    "was recorded. Pass Cockpit(..., model=model).",
                    RuntimeWarning,
                    stacklevel=4,
                )
            else:
                self._start(
                    root,
                    step,
                    inside_root=False,
                    notes=[
                        f"The forward pass of step {step} was not recorded: the model's forward pass did not "
                        "run with gradients enabled after the previous step began, or ran before "
                        "cockpit.record was called. The record holds the backward pass."
                    ],
                )
        if self._tape is not None or self._auto_done:
            return
        if self.auto == "tracked" and not self.is_tracked(step):
            return
        finite = finite or (lambda: loss_finite(info.get("loss")))
        if finite() is False:
            self._auto_done = True
            self._rerun(step, info, "non-finite loss", backward=True)

    def step_ends(self, step: int, info: dict, error: BaseException | None = None) -> None:
        """At ``cockpit.end()``, before the quantities: stop and store the live record."""
        if self._tape is None or self._tape_step != step:
            return
        notes = []
        if error is not None:
            notes.append(f"The step was interrupted by {type(error).__name__}: {error}")
        self._finish(info, notes)

    def after_step(self, step: int, info: dict, tracked: bool) -> None:
        """After the quantities of a step: on tracked steps, the automatic check of the gradients."""
        try:
            if tracked and not self._auto_done and step not in self.records and not gradients_finite(self.params):
                self._auto_done = True
                self._rerun(step, info, "non-finite gradient", backward=True)
        finally:
            self._forward = None

    # ---- finishing ------------------------------------------------------------------------
    def _finish(
        self, info: dict, notes: list[str], loss: Any = None, trigger: str = "on demand", finalize=None
    ) -> Record:
        tape, step = self._tape, self._tape_step
        self._tape = self._tape_step = None
        tape.stop()
        if loss is None:
            loss = info.get("loss")
        record = Record.from_tape(tape, step, trigger, loss=loss, notes=self._tape_notes + notes)
        if finalize is not None:
            finalize(record)
        if record.first_nonfinite is not None:
            self._auto_done = True  # the first bad step is recorded
        self._store(record)
        return record

    def _store(self, record: Record) -> None:
        self.records[record.step] = record
        if self.folder is not None:
            try:
                record.save(self.folder)
            except Exception as error:  # noqa: BLE001 - a record that cannot be replayed is still stored
                record.data["notes"].append(f"No replay program: {error}")
                record.save(self.folder, program=False)
        self.on_record(record.step, record)

    def _root(self) -> nn.Module | None:
        if self._forward is not None:
            return self._forward[0]()
        for ref in self.tracer.roots:
            root = ref()
            if root is not None:
                return root
        return None

    # ---- the automatic re-run ---------------------------------------------------------------
    def _rerun(self, step: int, info: dict, trigger: str, backward: bool) -> None:
        what = "loss" if trigger == "non-finite loss" else "gradient"
        root = self._forward[0]() if self._forward is not None else None
        if root is None:
            warnings.warn(
                f"[cockpit_like] step {step}: the {what} is not finite, but the cockpit did not see this "
                "step's forward pass, so it cannot record it. Pass Cockpit(..., model=model), or record a "
                "step on demand with cockpit.record(step).",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        _, args, kwargs = self._forward
        while isinstance(root, nn.parallel.DistributedDataParallel):
            root = root.module  # the wrapped model: DDP's forward would wait for the other ranks
        loss_fn = info.get("loss_fn")
        notes = [
            f"Recorded automatically: the {what} of step {step} was not finite. The cockpit ran the model's "
            "forward pass of that step again, from the inputs it saw, with the parameters of that step "
            "(the optimizer had not stepped yet); the model's buffers were restored afterwards."
        ]
        buffers = [(b, b.detach().clone()) for b in root.buffers()]
        tape = Tape(root, _names(root), paused=lambda: False, max_ops=self.max_ops)
        self._tape, self._tape_step, self._tape_notes = tape, step, []
        loss = None
        stage = "the model's forward pass"
        try:
            with self.tracer.pause(), torch.enable_grad():
                tape.start(inside_root=False)
                output = root(*args, **kwargs)
                if loss_fn is not None:
                    stage = "info['loss_fn']"
                    loss = loss_fn(output)
                    if backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
                        stage = "the backward pass"
                        wanted = [p for p in self.params if p.requires_grad]
                        torch.autograd.grad(loss, wanted, allow_unused=True)
        except Exception as error:  # noqa: BLE001 - a failed re-run must not stop the training run
            notes.append(f"The re-run stopped in {stage}: {type(error).__name__}: {error}. The record ends there.")
            warnings.warn(
                f"[cockpit_like] step {step}: recording the non-finite {what} failed in {stage} "
                f"({type(error).__name__}: {error}); the record holds what ran before and training goes on. "
                "Its notes (cockpit.records[step]) say where it stopped",
                RuntimeWarning,
                stacklevel=4,
            )
        finally:
            tape.stop()
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        if loss_fn is None:
            notes.append(
                "The loss and the backward pass were not recorded: the cockpit got the loss only as a "
                "value. Pass info['loss_fn'] (a function of the model's output that returns the loss, "
                "e.g. lambda output: lossfunc(output, targets)) to record them at a bad step."
            )
        elif isinstance(loss, torch.Tensor) and isinstance(info.get("loss"), torch.Tensor):
            same = torch.allclose(loss.detach(), info["loss"].detach().to(loss.dtype), equal_nan=True)
            notes.append(
                f"The re-run's loss {float(loss.detach()):g} "
                + ("equals the step's loss." if same else f"differs from the step's loss {float(info['loss']):g} "
                   "(random layers such as dropout drew again, or the inputs were changed in place): the "
                   "record shows the re-run.")
            )

        def unexplained(record: Record) -> None:
            if record.first_nonfinite is not None:
                return
            where = (
                "in the loss computation, which was not recorded (pass info['loss_fn'])"
                if loss_fn is None and what == "loss"
                else "outside the recorded operations (the re-run is finite: random layers, or inputs "
                "changed in place)"
            )
            finding = Finding(
                rule="nonfinite-origin",
                severity="error",
                step=step,
                message=f"step {step}: the {what} is not finite, and every value of the recorded re-run is "
                f"finite: the non-finite value arose {where}",
                fix="pass info['loss_fn'] to record the loss, or record the step with cockpit.record(step)",
                evidence={"trigger": trigger},
            )
            record.data["findings"].append(finding.to_dict())

        self._finish(info, notes, loss=_NO_LOSS if loss is None else loss, trigger=trigger, finalize=unexplained)


_NO_LOSS = object()
