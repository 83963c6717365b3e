"""What a cockpit stores besides its quantities' values, and who hears of it as it is stored.

:class:`RunOutput` keeps the figures of :meth:`Cockpit.log`, the findings
(and their clearances), and the steps a ``GradScaler`` skipped; it hands
each piece, as it is stored, to the streaming log (so a crash loses nothing
already stored) and to the listeners (exporters, live viewers). The cockpit
merges it with its quantities' values in :meth:`Cockpit.get_output`.

May import :mod:`cockpit_like.logs` and :mod:`cockpit_like.diagnosis` (the findings' keys).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from cockpit_like.checks.invariants import CHECKS_KEY, notable
from cockpit_like.diagnosis import CLEARED_KEY, FINDINGS_KEY, Finding
from cockpit_like.logs import StreamWriter

__all__ = ["RunOutput", "SKIPPED_KEY", "StepAlreadyTrackedError"]

#: the output key of a tracked step whose optimizer step a GradScaler skipped
SKIPPED_KEY = "skipped"

Listener = Callable[[int, dict[str, Any]], None]


class StepAlreadyTrackedError(ValueError):
    """A step number at or before a step this cockpit has already stored (e.g. a notebook cell run again).

    Tracking it would replace stored values in memory while the stream on
    disk keeps the first ones, so the cockpit refuses before the backward
    pass, and nothing is stored or streamed (docs/notebooks.md).
    """


class RunOutput:
    """The cockpit's own stored values, the stream and the listeners (see the module docstring)."""

    def __init__(self) -> None:
        #: ``{step: {key: value}}`` of :meth:`Cockpit.log`
        self.epoch_logs: dict[int, dict[str, Any]] = {}
        #: ``{step: {"findings": [...], "cleared": [...]}}``
        self.findings: dict[int, dict[str, list[dict[str, Any]]]] = {}
        #: ``{step: why}`` of the steps a GradScaler skipped
        self.skipped: dict[int, dict[str, Any]] = {}
        #: ``{step: checks}``: the self-checks of each tracked step (:mod:`cockpit_like.checks`)
        self.checks: dict[int, dict[str, Any]] = {}
        #: the steps whose checks are in the output and the stream (see :meth:`store_checks`)
        self.shown_checks: set[int] = set()
        #: the self-checks whose failure was told by a warning (once each per run)
        self.told_checks: set[str] = set()
        self.stream: StreamWriter | None = None
        self.listeners: list[Listener] = []
        #: the last step whose quantities were tracked (noted on every rank, also where no output is kept)
        self.last_tracked: int | None = None
        #: a step being stored (:meth:`hold`): its stream lines and listener calls wait for :meth:`commit`
        self._held: list[tuple[bytes | None, int, dict[str, Any] | None]] | None = None
        #: what undoes each change the step being stored made here (:meth:`rollback`)
        self._journal: list[Callable[[], None]] = []
        #: listeners whose last call raised (warned once per streak of failures)
        self._failing_listeners: set[int] = set()

    # ---- one step, all or nothing -------------------------------------------------------
    def hold(self) -> None:
        """Begin storing one step: until :meth:`commit`, what is stored here can be taken back (:meth:`rollback`)
        and what is published waits, so that a step that fails midway (an exception, ``KeyboardInterrupt``)
        leaves memory and stream as they were, and one that completes reaches both."""
        self._journal = []
        self._held = []

    def commit(self) -> list | None:
        """The step is stored: queue its stream lines (all at once); what :meth:`deliver` then hands on."""
        held = self._held
        if held is None:
            return None
        if self.stream is not None:
            self.stream.enqueue([line for line, _, _ in held if line is not None])
        self._held = None  # (right after the lines are queued: from here on the step counts as stored)
        self._journal = []
        return held

    def deliver(self, held: list | None) -> None:
        """After :meth:`commit`: write the stream, then call the listeners with what the step published."""
        if self.stream is not None:
            self.stream.drain()
        for _, step, values in held or ():
            if values is not None:
                for listener in list(self.listeners):
                    self._call(listener, step, values)

    def _call(self, listener: Listener, step: int, values: dict[str, Any]) -> None:
        """Call one listener; one that raises (an exporter whose folder vanished, a viewer that closed) does not
        stop the run, as a failed stream write does not: a warning names it and the error, once per streak of
        failures, and it is called again at the next step. The step is stored whatever it does."""
        try:
            listener(step, values)
        except Exception as error:  # (KeyboardInterrupt and SystemExit still stop the run)
            if id(listener) not in self._failing_listeners:
                self._failing_listeners.add(id(listener))
                import warnings

                warnings.warn(
                    f"[cockpit_like] the listener {getattr(listener, '__qualname__', None) or listener!r} raised at "
                    f"step {step} ({type(error).__name__}: {error}); the step is stored (memory and stream) and "
                    "training goes on. It is called again at the next step; this warning comes once until it "
                    "succeeds. Remove it with cockpit.remove_listener(...) (an exporter: exporter.close()).",
                    RuntimeWarning,
                    stacklevel=2,
                )
        else:
            self._failing_listeners.discard(id(listener))

    def rollback(self) -> bool:
        """Take back what the step being stored changed here and drop what it published; whether it was still
        being stored (``False``: it was committed, or none was held)."""
        if self._held is None:
            return False
        for undo in reversed(self._journal):
            undo()
        self._journal = []
        self._held = None
        return True

    def _undoable(self, mapping: dict, key: Any) -> None:
        """Journal ``mapping[key]`` as it is now, while a step is held."""
        if self._held is None:
            return
        if key in mapping:
            old = mapping[key]
            self._journal.append(lambda: mapping.__setitem__(key, old))
        else:
            self._journal.append(lambda: mapping.pop(key, None))

    # ---- who hears of it ------------------------------------------------------------
    def publish(
        self, step: int, values: dict[str, Any], listeners: bool = True, line: bytes | None = None, held: bool = True
    ) -> None:
        """Stream ``values`` of ``step``, then hand them to the listeners (``line``: the stream line, if not of
        ``values``). While a step is held (:meth:`hold`), both wait for :meth:`commit` (``held=False``: not what
        the step stores, published now)."""
        if line is None and self.stream is not None and values:
            line = self.stream.step_line(step, values)  # encoded now: a value that cannot be written raises here
        entry = (line, step, values if listeners else None)
        if held and self._held is not None:
            self._held.append(entry)
            return
        if self.stream is not None and line is not None:
            self.stream.enqueue([line])
        self.deliver([entry])

    def add_listener(self, listener: Listener) -> None:
        if not callable(listener):
            raise ValueError(f"Cockpit.add_listener: {listener!r} is not callable")
        self.listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self.listeners = [known for known in self.listeners if known is not listener]

    # ---- what is stored ---------------------------------------------------------------
    def store_log(self, step: int, values: dict[str, Any]) -> None:
        self.epoch_logs.setdefault(step, {}).update(values)
        self.publish(step, values, held=False)  # (the user's, also from inside a step's on_finding)

    def store_skipped(self, step: int, why: dict[str, Any]) -> None:
        self._undoable(self.skipped, step)
        self.skipped[step] = dict(why)
        self.publish(step, {SKIPPED_KEY: dict(why)})

    def retract(self, step: int, names: list[str]) -> None:
        """Values of ``step`` already streamed that no longer hold: the stream says so (the reader drops them)."""
        if self.stream is not None and names:
            self.publish(step, {}, listeners=False, line=self.stream.retract_line(step, names))

    def store_checks(self, step: int, checks: dict[str, Any]) -> None:
        """Keep a step's self-checks; stream them and show them in the output when they say something (a
        failed check, a note, frozen parameters or ones without a gradient, a loss factor or a number of
        backward passes other than declared): a plain valid step stays as it was."""
        self._undoable(self.checks, step)
        self.checks[step] = dict(checks)
        self._tell_failed(step, checks)
        if notable(checks):
            if self._held is not None and step not in self.shown_checks:
                self._journal.append(lambda: self.shown_checks.discard(step))
            self.shown_checks.add(step)
            self.publish(step, {CHECKS_KEY: dict(checks)})

    def _tell_failed(self, step: int, checks: dict[str, Any]) -> None:
        """Warn, once per check and run, that a step failed it: its values are not stored, which a run that
        forgot ``optimizer.zero_grad()`` would otherwise learn only from the dashboard or the log."""
        from cockpit_like.tracked_step import _user_stacklevel  # (imports this module)

        for failed in checks.get("failed", ()):
            check = failed.get("check")
            if check is None or check in self.told_checks:
                continue
            self.told_checks.add(check)
            warnings.warn(
                f"[cockpit_like] step {step} failed the self-check {check!r}, so it stores none of the values that "
                f"check guards: {failed.get('reason', '')} (Told once per check; every tracked step's record is in "
                "cockpit.checks[step] and the log, the failed ones in cockpit.invalid_steps.)",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )

    def store_findings(self, found: list[Finding], cleared: list[dict[str, Any]]) -> None:
        """Store findings and clearances under their steps; stream each touched list whole (the reader keeps
        the last line's). Listeners get findings through ``on_finding`` instead."""
        if not isinstance(found, list) or not all(isinstance(f, Finding) for f in found):
            raise ValueError("Cockpit.add_finding takes a cockpit_like.diagnosis.Finding")
        touched: dict[int, set[str]] = {}
        for finding in found:
            self.findings.setdefault(finding.step, {}).setdefault(FINDINGS_KEY, []).append(finding.to_dict())
            touched.setdefault(finding.step, set()).add(FINDINGS_KEY)
        for entry in cleared:
            step = int(entry["step"])
            record = {key: entry[key] for key in ("rule", "layer", "found_at")}
            self.findings.setdefault(step, {}).setdefault(CLEARED_KEY, []).append(record)
            touched.setdefault(step, set()).add(CLEARED_KEY)
        for step, keys in sorted(touched.items()):  # (not held: a finding stays stored if its step fails)
            self.publish(step, {key: self.findings[step][key] for key in sorted(keys)}, listeners=False, held=False)

    # ---- steps are stored once ------------------------------------------------------------
    def note_tracked(self, step: int) -> None:
        """``step``'s quantities were tracked (or the step was skipped by a GradScaler)."""
        if self._held is not None:
            last = self.last_tracked
            self._journal.append(lambda: setattr(self, "last_tracked", last))
        self.last_tracked = step if self.last_tracked is None else max(self.last_tracked, step)

    def last_stored_step(self, outputs: Iterable[dict[int, Any]] = ()) -> int | None:
        """The last step tracked so far: :attr:`last_tracked`, the skipped steps, and the last key of each of
        ``outputs`` (the quantities' ``{step: value}``, also those restored by ``load_state_dict``; stored in
        step order, so the last key is the largest: O(1) per quantity)."""
        last = [self.last_tracked] if self.last_tracked is not None else []
        last += [max(self.skipped)] if self.skipped else []
        for output in outputs:
            if output:
                last.append(next(reversed(output)))
        return max(last) if last else None

    def check_new_step(self, step: int, outputs: Iterable[dict[int, Any]] = (), declared: bool = False) -> None:
        """Raise :class:`StepAlreadyTrackedError` if ``step`` is before :meth:`last_stored_step`, or is that step
        again with ``declared`` micro-batches (``info["micro_batches"]``).

        The last step again *without* declared micro-batches is let through: it is a loop that accumulates
        gradients without saying so (a further backward pass of the step), which the step engine handles.
        """
        last = self.last_stored_step(outputs)
        if last is None or step > last or (step == last and not declared):
            return
        stream = f" (and its stream {self.stream.path} holds them)" if self.stream is not None else ""
        if step == last:
            what = (f"tracking step {step} again would replace what it stored (a step with declared micro-batches "
                    "is entered once per micro-batch, and the next step has a new number)")
        else:
            what = (f"step {step} comes before it: the step numbers of one run only go forward (a log holds each "
                    "step once, in order)")
        raise StepAlreadyTrackedError(
            f"cockpit step {step}: this cockpit has already tracked steps up to {last}{stream}; {what}. This "
            "happens when a notebook cell with the training loop is run a second time, or when the loop's step "
            "counter restarts (a new epoch numbered from 0). To start a new run, create a new Cockpit (with a "
            f"new stream_to path) and a new plotter; to go on with this run, continue the step numbers after {last} "
            f"(e.g. `enumerate(loader, start={last + 1})`, or a global step counted across epochs)."
        )

    def merge_into(self, merged: dict[int, dict[str, Any]]) -> None:
        """Add the stored values to ``{step: {key: value}}`` (copies of the lists and dicts)."""
        for step, values in self.epoch_logs.items():
            merged.setdefault(step, {}).update(values)
        for step, values in self.findings.items():
            merged.setdefault(step, {}).update({key: list(found) for key, found in values.items()})
        for step, why in self.skipped.items():
            merged.setdefault(step, {})[SKIPPED_KEY] = dict(why)
        for step in self.shown_checks:
            merged.setdefault(step, {})[CHECKS_KEY] = dict(self.checks[step])

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()

    def drain(self) -> None:
        """Write what the stream could not write before (a failed write's lines), if any."""
        if self.stream is not None:
            self.stream.drain()
