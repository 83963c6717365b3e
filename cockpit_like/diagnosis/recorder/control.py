"""When the cockpit records: :class:`Recorder`, one per cockpit.

- **On demand** (``cockpit.record(step)``): the step is *armed*. When the
  model's forward pass of that step begins (the tracer's root forward
  pre-hook, which knows the coming step), the :class:`~.tape.Tape` starts;
  it stops when the step's ``with cockpit(step)`` block (or ``end()``) exits,
  before the cockpit computes its quantities. So the forward pass, the loss
  and the backward pass are recorded as they run. Steps that are not armed
  pay one Python call per forward pass (the tracer notes the inputs and the
  ``torch.autocast`` state).
- **Automatically** (``Cockpit(record_nonfinite=True)``, the default), at the
  first step whose loss or gradient is not finite, once per cockpit:

  * the loss is read from ``info["loss"]`` when the step begins (one
    device sync per step that passes a tensor loss: ``isfinite``; tracked
    steps did this already). If it is not finite, the step is re-run when
    its block ends (after the backward pass, before the optimizer steps):
    the model's forward pass again under the tape, from the inputs the
    tracer saw at this step's forward pass and under the autocast state it
    ran under (the parameters have not changed yet), with the model's buffers
    restored afterwards. The loss is computed again if ``info["loss_fn"]`` is
    given (a function of the model's output: ``lambda out: lossfunc(out, y)``),
    and then the backward pass too (``torch.autograd.grad``; ``.grad`` is
    not touched); without it the record holds the forward pass and says so.
  * on tracked steps the gradients are checked at the end of the step (one
    ``isfinite`` per parameter and one sync); untracked steps are not
    checked. A non-finite gradient under a finite loss re-runs the forward
    pass, the loss (``info["loss_fn"]``) and the backward pass.
  * with gradient accumulation each backward pass (micro-batch) keeps its
    forward pass's inputs, ``loss_fn`` and autocast state until the step's
    last one; the re-run goes through them in order and records the first
    whose re-run has a non-finite value (``record["micro_batch"]``).
  * a step a ``GradScaler`` skips is not recorded: the scaler is seen as
    ``info["grad_scaler"]`` or as a factor above 1 in the gradient that
    reaches ``info["loss"]`` (a hook, only on steps that need it), and the
    step's gradients are not finite. The automatic recording stays armed;
    after :data:`SKIPS_IN_A_ROW` skipped steps in a row, the last is re-run
    and recorded if its (unscaled) re-run has a non-finite value: lowering
    the scale does not remove a NaN the model makes.

  Random layers (dropout) draw again in the re-run; the record notes when
  the re-run's loss differs from the step's.

May import torch and :mod:`cockpit_like.diagnosis`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

__all__ = ["Recorder", "RECORD_KEY", "SKIPS_IN_A_ROW"]

#: a GradScaler that skips this many checked steps in a row does not remove the non-finite value by
#: lowering its scale: the last of them is recorded (with a finding) after all
SKIPS_IN_A_ROW = 8

#: where a record is stored in the cockpit's output: ``{step: {RECORD_KEY: record dict}}``
RECORD_KEY = "record"


#: the device types whose autocast state is read at each forward pass (more are added when available)
_AUTOCAST_DEVICES: tuple[str, ...] | None = None


def _autocast_devices() -> tuple[str, ...]:
    global _AUTOCAST_DEVICES
    if _AUTOCAST_DEVICES is None:
        found = ["cpu", "cuda"]
        for name in ("xpu", "mps", "hpu"):
            backend = getattr(torch, name, None) if name != "mps" else getattr(torch.backends, "mps", None)
            try:
                if backend is not None and backend.is_available():
                    torch.is_autocast_enabled(name)
                    found.append(name)
            except Exception:  # noqa: BLE001 - a backend PyTorch cannot autocast is left out
                pass
        _AUTOCAST_DEVICES = tuple(found)
    return _AUTOCAST_DEVICES


def autocast_state() -> list[dict[str, str]]:
    """The ``torch.autocast`` regions active now: ``[{"device_type": "cpu", "dtype": "float16"}]``
    (``[]``: none). About a microsecond: read at every forward pass the recorder keeps."""
    on = [device for device in (_AUTOCAST_DEVICES or _autocast_devices()) if torch.is_autocast_enabled(device)]
    if not on:
        return []
    return [{"device_type": device, "dtype": str(torch.get_autocast_dtype(device)).removeprefix("torch.")} for device in on]


def under_autocast(state: list[dict[str, str]]) -> contextlib.ExitStack:
    """A context that sets autocast as ``state`` says: on with its dtype for the device types listed,
    off for the others that are on now (a re-run inside the caller's own ``torch.autocast``)."""
    stack = contextlib.ExitStack()
    wanted = {entry["device_type"]: entry["dtype"] for entry in state}
    for device in _autocast_devices():
        if device in wanted:
            stack.enter_context(torch.autocast(device, dtype=getattr(torch, wanted[device])))
        elif torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


@dataclasses.dataclass
class _Forward:
    """A forward pass of the model the cockpit saw, with what its re-run needs: the inputs (references,
    not copies), the autocast state it ran under, and, once its backward pass begins, the ``info`` of
    that backward pass (``loss_fn``, ``loss``) and its place among the step's micro-batches."""

    root: weakref.ref
    args: tuple
    kwargs: dict
    autocast: list[dict[str, str]]
    loss_fn: Callable | None = None
    loss: Any = None
    micro: int = 0


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _scaler_on(info: dict) -> bool:
    """Whether ``info["grad_scaler"]`` is an enabled ``GradScaler`` (its ``is_enabled()``)."""
    scaler = info.get("grad_scaler")
    is_enabled = getattr(scaler, "is_enabled", None)
    return callable(is_enabled) and bool(is_enabled())


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
        self._tape_context: dict[str, Any] = {}
        #: the model's forward pass since the last backward pass began (not yet given to a micro-batch)
        self._forward: _Forward | None = None
        #: the forward passes of the step under way, one per backward pass (micro-batch) the cockpit saw
        self._forwards: list[_Forward] = []
        self._forwards_step: int | None = None
        self._micro_batches: int | None = None
        self._micro = 0
        #: the loss of the backward pass under way was not finite (its re-run waits for the step's end)
        self._bad_loss = False
        #: the step's backward passes are not declared and more may follow (the cockpit learned that it accumulates)
        self._open_ended = False
        #: an on-demand record finished at the step's end, stored once the cockpit knows whether it was skipped
        self._unstored: Record | None = None
        self._factor_hook: Any = None
        self._factor: list[torch.Tensor] = []
        #: ``(steps the GradScaler skipped in a row, the last of them)``, among the steps checked
        self._skips: tuple[int, int | None] = (0, None)
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
            self._tape_context["autocast"] = autocast_state()
            return
        if not self._auto_done:
            self._forward = _Forward(weakref.ref(root), args, kwargs, autocast_state())

    def _start(self, root: nn.Module, step: int, inside_root: bool, notes: list[str] | None = None) -> None:
        self.armed.discard(step)
        tape = Tape(root, _names(root), paused=self._paused, max_ops=self.max_ops)
        tape.start(inside_root)
        self._tape, self._tape_step, self._tape_notes = tape, step, list(notes or [])
        self._tape_context = {}

    # ---- the step (called by the cockpit) ------------------------------------------------
    @contextlib.contextmanager
    def beginning(
        self, step: int, info: dict, finite: Callable[[], bool | None] | None = None, micro: int = 0,
        micro_batches: int | None = None, open_ended: bool = False,
    ):  # fmt: skip
        """Around ``cockpit.begin(step)``: :meth:`step_begins`, then the cockpit's own work
        (loss checks, setting up the step) runs without being recorded."""
        self.step_begins(step, info, finite, micro, micro_batches, open_ended)
        tape = self._tape
        if tape is not None:
            tape._busy = True
        try:
            yield
        finally:
            if tape is not None:
                tape._busy = False

    def step_begins(
        self, step: int, info: dict, finite: Callable[[], bool | None] | None = None, micro: int = 0,
        micro_batches: int | None = None, open_ended: bool = False,
    ) -> None:  # fmt: skip
        """At ``cockpit.begin(step)``: a tape left by an unfinished step is closed; the forward pass seen
        since the last backward pass is kept as this backward pass's (micro-batch ``micro`` of
        ``micro_batches``: ``None`` when not declared; ``open_ended``: more undeclared backward passes
        may follow); the loss check.

        ``finite``: the step's loss check, shared with the cockpit's (asked at most once a step). A
        non-finite loss is re-run at the end of the step (:meth:`after_step`), when the cockpit knows
        whether a ``GradScaler`` skips it.
        """
        loss_fn = info.get("loss_fn")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(
                f"cockpit step {step}: info['loss_fn'] must be a function of the model's output that returns "
                f"the loss (e.g. lambda output: lossfunc(output, targets)), got {type(loss_fn).__name__}"
            )
        self._bad_loss, self._open_ended = False, open_ended
        self._unwatch_factor()
        if self._unstored is not None:  # a step that never reached after_step
            self._store(self._unstored, first_bad=True)
            self._unstored = None
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
        if self._tape is not None:
            if micro > 0 or (micro_batches or 1) > 1 or open_ended:
                self._tape_context.update(micro_batch=micro, micro_batches=micro_batches)
            if not _scaler_on(info):
                self._watch_factor(info.get("loss"))  # a step the GradScaler skips: its record says so
            return
        if self._auto_done:
            return
        self._keep_forward(step, info, micro, micro_batches)
        tracked = self.is_tracked(step)
        if self.auto == "tracked" and not tracked:
            return
        finite = finite or (lambda: loss_finite(info.get("loss")))
        if finite() is False:
            self._bad_loss = True
        if self._bad_loss or (tracked and not _scaler_on(info)):
            self._watch_factor(info.get("loss"))  # whether a GradScaler scales the loss: it skips such steps

    def _keep_forward(self, step: int, info: dict, micro: int, micro_batches: int | None) -> None:
        """The forward pass seen since the last backward pass began belongs to this one (micro-batch
        ``micro`` of ``step``); the forward passes of the step's earlier micro-batches are kept beside it."""
        forward, self._forward = self._forward, None
        if micro == 0 or self._forwards_step != step:
            self._forwards = []
        self._forwards_step, self._micro_batches, self._micro = step, micro_batches, micro
        if forward is not None:
            forward.loss_fn, forward.loss, forward.micro = info.get("loss_fn"), info.get("loss"), micro
            self._forwards.append(forward)

    def _watch_factor(self, loss: Any) -> None:
        """Note the gradient that reaches ``info["loss"]``: ``S`` under ``scaler.scale(loss).backward()``."""
        if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1:
            self._factor = []
            self._factor_hook = loss.register_hook(self._factor_seen)

    def _factor_seen(self, grad: torch.Tensor) -> None:
        """The hook on ``info["loss"]`` (a method of the cockpit's: the user's hooks' guard leaves it alone)."""
        self._factor.append(grad)

    def let_go(self) -> None:
        """The step failed between :meth:`step_begins` and the end of :meth:`after_step` (an exception, an
        interrupt): no hook stays on its loss. Safe to call at any time."""
        self._bad_loss = False
        self._unwatch_factor()

    def _unwatch_factor(self) -> None:
        if self._factor_hook is not None:
            self._factor_hook.remove()
        self._factor_hook, self._factor = None, []

    def _scaler_skips(self, info: dict, trigger: str) -> bool:
        """Whether a ``GradScaler`` skips this step: it scales the loss (``info["grad_scaler"]`` is on, or
        a factor above 1 reached ``info["loss"]``, as the cockpit's own check of skipped steps reads it)
        and the gradients are not finite."""
        with torch.no_grad():
            scaled = _scaler_on(info) or any(
                math.isfinite(value) and value > 1.0 for value in (float(g.detach().reshape(-1)[0]) for g in self._factor)
            )
        return scaled and (trigger == "non-finite gradient" or not gradients_finite(self.params))

    def step_ends(self, step: int, info: dict, error: BaseException | None = None) -> None:
        """At ``cockpit.end()``, before the quantities: stop and store the live record."""
        if self._tape is None or self._tape_step != step:
            return
        notes = []
        if error is not None:
            notes.append(f"The step was interrupted by {type(error).__name__}: {error}")
        self._unstored = self._finish(info, notes, store=False)

    def after_step(self, step: int, info: dict, tracked: bool, complete: bool = True) -> None:
        """After the quantities of a backward pass: the automatic re-run of a non-finite loss (seen when
        it began) or, on tracked steps, of a non-finite gradient, unless a ``GradScaler`` skips the step.

        ``complete``: the step has no more backward passes (its kept forward passes are let go).
        Never raises for a non-finite value: a re-run that fails warns and keeps what ran.
        """
        try:
            if self._unstored is not None:
                record, self._unstored = self._unstored, None
                self._store_on_demand(record, info)
            if self._auto_done or step in self.records:
                return
            if self._forward is not None and not any(f.micro == self._micro for f in self._forwards):
                self._keep_forward(step, info, self._micro, self._micro_batches)  # the forward pass ran in the block
            if self._bad_loss:
                trigger = "non-finite loss"
            elif tracked and not gradients_finite(self.params):
                trigger = "non-finite gradient"
            else:
                if complete and self._skips[1] != step:
                    self._skips = (0, None)  # a finite step ends a run of skipped ones
                return
            skips = 0
            if self._scaler_skips(info, trigger):
                count, last = self._skips
                self._skips = (count + (last != step), step)
                if self._skips[0] < SKIPS_IN_A_ROW:
                    return  # the scaler skips the optimizer step and lowers its scale: normal, no record
                skips = self._skips[0]  # lowering the scale does not help: record it after all
            self._auto_done = True
            self._rerun(step, trigger, info, skips)
        finally:
            self._bad_loss, self._forward = False, None
            self._unwatch_factor()
            if complete:
                self._forwards, self._forwards_step = [], None

    # ---- finishing ------------------------------------------------------------------------
    def _finish(self, info: dict, notes: list[str], store: bool = True) -> Record:
        """Stop the live (on-demand) tape and make its record (and store it)."""
        tape, step = self._tape, self._tape_step
        self._tape = self._tape_step = None
        tape.stop()
        context = self._tape_context
        record = Record.from_tape(
            tape, step, "on demand", loss=info.get("loss"), notes=self._tape_notes + notes,
            micro_batch=context.get("micro_batch"), micro_batches=context.get("micro_batches"),
            autocast=context.get("autocast"),
        )  # fmt: skip
        if store:
            self._store(record, first_bad=True)
        return record

    def _store_on_demand(self, record: Record, info: dict) -> None:
        """Store an on-demand record at its step's end: one the ``GradScaler`` skips is marked so and has
        no finding; else one with a non-finite value is the first bad step's (no automatic re-run)."""
        if self._scaler_skips(info, "on demand"):
            record.data["skipped"] = {"reason": "grad_scaler"}
            record.data["findings"] = []
            record.data["notes"].append(
                "A GradScaler skipped this step (its scaled gradients are not finite): the scaler lowers its "
                "scale and the optimizer does not step, so no finding is made."
            )
            self._store(record)
        else:
            self._store(record, first_bad=True)

    def _store(self, record: Record, first_bad: bool = False) -> None:
        """Keep, save and hand on a record; ``first_bad``: one with a non-finite value ends the automatic
        recording (the first bad step is recorded)."""
        if first_bad and record.first_nonfinite is not None:
            self._auto_done = True
        self.records[record.step] = record
        if self.folder is not None:
            try:
                record.save(self.folder)
            except Exception as error:  # noqa: BLE001 - a record that cannot be replayed is still stored
                record.data["notes"].append(f"No replay program: {error}")
                record.save(self.folder, program=False)
        self.on_record(record.step, record)

    def _root(self) -> nn.Module | None:
        for forward in [self._forward] + self._forwards[::-1]:
            if forward is not None and forward.root() is not None:
                return forward.root()
        for ref in self.tracer.roots:
            root = ref()
            if root is not None:
                return root
        return None

    # ---- the automatic re-run ---------------------------------------------------------------
    def _rerun(self, step: int, trigger: str, info: dict, skips: int = 0) -> None:
        """Re-run the step's backward passes the cockpit saw, in order, each under the autocast state of
        its forward pass; the first whose re-run has a non-finite value is the record."""
        what = "loss" if trigger == "non-finite loss" else "gradient"
        forwards = [forward for forward in self._forwards if forward.root() is not None]
        if not forwards:
            warnings.warn(
                f"[cockpit_like] step {step}: the {what} is not finite, but the cockpit did not see this "
                "step's forward pass, so it cannot record it. Pass Cockpit(..., model=model), or record a "
                "step on demand with cockpit.record(step).",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        count = self._micro_batches
        several = len(forwards) > 1 or forwards[0].micro > 0 or (count or 1) > 1 or self._open_ended
        record = None
        for forward in forwards:
            record = self._rerun_one(step, trigger, forward, several, count)
            if record.first_nonfinite is not None:
                break
        if several:
            micros = [forward.micro for forward in forwards]
            seen = f"the {len(forwards)} it saw" + (f" (of {count} declared)" if count else "")
            if record.first_nonfinite is not None:
                earlier = [str(m) for m in micros if m < forward.micro]
                record.data["notes"].append(
                    f"Step {step} has several backward passes (micro-batches); the cockpit re-ran {seen} in "
                    f"order: micro-batch {forward.micro} is the first whose re-run has a non-finite value"
                    + (f" (micro-batch{'es' if len(earlier) > 1 else ''} {', '.join(earlier)} re-ran finite)."
                       if earlier else ".")
                )
            else:
                record.data["notes"].append(
                    f"Step {step} has several backward passes (micro-batches); the cockpit re-ran {seen}: every "
                    f"value was finite. The record shows micro-batch {forward.micro}, the last."
                )
        if skips and record.first_nonfinite is None:
            # the unscaled re-run is finite: the scale made the overflow, and the scaler keeps lowering it
            self._auto_done, self._skips = False, (0, None)
            return
        if record.first_nonfinite is None:
            record.data["findings"].append(self._unexplained(step, trigger, forward).to_dict())
        if skips:
            said = (f"The GradScaler skipped this step and the {skips - 1} checked steps before it: lowering its "
                    "scale does not remove the non-finite value, so the step is recorded although it was skipped.")
            record.data["skipped"] = {"reason": "grad_scaler", "in_a_row": skips}
            record.data["notes"].append(said)
            for finding in record.data["findings"]:
                finding["message"] += f" (the GradScaler's {skips}th skipped step in a row)"
                finding["evidence"]["scaler_skips_in_a_row"] = skips
        unseen = not (isinstance(info.get("loss"), torch.Tensor) and info["loss"].requires_grad)
        if unseen and not _scaler_on(info) and any(a["dtype"] == "float16" for a in forward.autocast):
            hint = (" If a GradScaler scales this loss, pass info['grad_scaler'] = scaler (or the loss tensor as "
                    "info['loss']): a step the scaler skips then gets no finding.")
            for finding in record.data["findings"]:
                finding["fix"] += hint
            record.data["notes"].append("The cockpit could not tell whether a GradScaler skips this step: "
                                        "info['loss'] is not a tensor with a gradient, and info['grad_scaler'] "
                                        "is not given.")
        self._store(record)

    def _unexplained(self, step: int, trigger: str, forward: _Forward) -> Finding:
        what = "loss" if trigger == "non-finite loss" else "gradient"
        where = (
            "in the loss computation, which was not recorded (pass info['loss_fn'])"
            if forward.loss_fn is None and what == "loss"
            else "outside the recorded operations (the re-run is finite: random layers, or inputs "
            "changed in place)"
        )
        return Finding(
            rule="nonfinite-origin",
            severity="error",
            step=step,
            message=f"step {step}: the {what} is not finite, and every value of the recorded re-run is "
            f"finite: the non-finite value arose {where}",
            fix="pass info['loss_fn'] to record the loss, or record the step with cockpit.record(step)",
            evidence={"trigger": trigger},
        )

    def _rerun_one(self, step: int, trigger: str, forward: _Forward, several: bool, count: int | None) -> Record:
        """One backward pass of the step again, under the tape: the model's forward pass from the inputs
        it saw (under its autocast state), ``info["loss_fn"]`` and the backward pass."""
        what = "loss" if trigger == "non-finite loss" else "gradient"
        root = forward.root()
        while isinstance(root, nn.parallel.DistributedDataParallel):
            root = root.module  # the wrapped model: DDP's forward would wait for the other ranks
        loss_fn = forward.loss_fn
        notes = [
            f"Recorded automatically: the {what} of step {step} was not finite. The cockpit ran the model's "
            "forward pass of that step again, from the inputs it saw, with the parameters of that step "
            "(the optimizer had not stepped yet); the model's buffers were restored afterwards."
        ]
        if forward.autocast:
            regions = ", ".join(f"torch.autocast('{a['device_type']}', dtype=torch.{a['dtype']})" for a in forward.autocast)
            notes.append(
                f"The step's forward pass ran under {regions}; the re-run ran its forward pass and "
                "info['loss_fn'] under the same, and its backward pass as the cockpit's block ran."
            )
        buffers = [(b, b.detach().clone()) for b in root.buffers()]
        tape = Tape(root, _names(root), paused=lambda: False, max_ops=self.max_ops)
        loss = None
        stage = "the model's forward pass"
        cuda = sorted({_cuda_index(p.device) for p in self.params if p.device.type == "cuda"})
        try:  # random layers draw again, from torch's generators, which are put back afterwards
            with self.tracer.pause(), torch.enable_grad(), torch.random.fork_rng(devices=cuda):
                tape.start(inside_root=False)
                with under_autocast(forward.autocast):
                    output = root(*forward.args, **forward.kwargs)
                    if loss_fn is not None:
                        stage = "info['loss_fn']"
                        loss = loss_fn(output)
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
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
                stacklevel=5,
            )
        finally:
            tape.stop()
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        given = forward.loss
        if loss_fn is None:
            notes.append(
                "The loss and the backward pass were not recorded: the cockpit got the loss only as a "
                "value. Pass info['loss_fn'] (a function of the model's output that returns the loss, "
                "e.g. lambda output: lossfunc(output, targets)) to record them at a bad step."
            )
        elif isinstance(loss, torch.Tensor) and isinstance(given, torch.Tensor):
            same = torch.allclose(loss.detach(), given.detach().to(loss.dtype), equal_nan=True)
            notes.append(
                f"The re-run's loss {float(loss.detach()):g} "
                + ("equals the step's loss." if same else f"differs from the step's loss {float(given):g} "
                   "(random layers such as dropout drew again, or the inputs were changed in place): the "
                   "record shows the re-run.")
            )
        return Record.from_tape(
            tape, step, trigger, loss=loss if isinstance(loss, torch.Tensor) else None, notes=notes,
            micro_batch=forward.micro if several else None, micro_batches=count if several else None,
            autocast=forward.autocast,
        )  # fmt: skip
