"""Running rules: :class:`Diagnosis` (live, fed step by step) and :func:`diagnose` (a log).

A finding is *reported* once per ``(rule, layer)``: when a rule's
:meth:`~cockpit_like.diagnosis.rule.Rule.check` first returns it, and again
when its severity rises (a divergence that turns out to be sustained). It stays
*active* while the rule keeps returning it, and is *cleared* when the rule
stops (the clearing is stored too, so the dashboard lists only active ones).
"""

from __future__ import annotations

import bisect
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from cockpit_like.diagnosis.causes import Incident, group_findings
from cockpit_like.diagnosis.findings import Finding, active_findings, findings_in, severity_rank
from cockpit_like.diagnosis.history import RunHistory
from cockpit_like.diagnosis.rule import Rule
from cockpit_like.diagnosis.rules import default_rules

__all__ = ["Diagnosis", "DiagnosisReport", "diagnose", "diagnose_log", "check_rules"]


def check_rules(rules: Any) -> list[Rule]:
    """``rules`` as a list of :class:`Rule` instances with distinct ids, or a clear error."""
    if isinstance(rules, Rule):
        rules = [rules]
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ValueError(
            f"diagnosis rules: pass a list of Rule instances (cockpit_like.diagnosis.rules), got {type(rules).__name__}"
        )
    checked: list[Rule] = []
    for rule in rules:
        if isinstance(rule, type) and issubclass(rule, Rule):
            raise ValueError(f"diagnosis rules: got the class {rule.__name__}; pass an instance, {rule.__name__}()")
        if not isinstance(rule, Rule):
            raise ValueError(f"diagnosis rules: {rule!r} is not a Rule (subclass cockpit_like.diagnosis.Rule)")
        if not rule.id:
            raise ValueError(f"diagnosis rules: {type(rule).__name__} has no id; set the class attribute id = '...'")
        if any(known.id == rule.id for known in checked):
            raise ValueError(f"diagnosis rules: two rules with the id {rule.id!r}; each id may appear once")
        checked.append(rule)
    return checked


class Diagnosis:
    """Runs rules on a :class:`RunHistory` as it grows.

    Args:
        rules: the rules (default: :func:`~cockpit_like.diagnosis.rules.default_rules`).
        metadata: run metadata for layer names (``param_names``, ``param_shapes``).

    Attributes:
        history: what the rules read.
        reported: every finding reported so far, in order.
        active: ``{(rule, layer): finding}`` of findings not cleared.
    """

    def __init__(self, rules: Sequence[Rule] | None = None, metadata: Mapping[str, Any] | None = None):
        self.rules = check_rules(default_rules() if rules is None else rules)
        self.history = RunHistory(metadata)
        self.reported: list[Finding] = []
        self.active: dict[tuple[str, str | None], Finding] = {}
        self._failed: dict[str, str] = {}

    def update(self, step: int, values: Mapping[str, Any]) -> bool:
        """Add stored values; return whether anything a rule may read was added."""
        return self.history.add(step, values)

    def run(self) -> tuple[list[Finding], list[dict[str, Any]]]:
        """Run every rule whose inputs exist; return ``(new findings, clearings)``.

        A clearing is ``{"rule", "layer", "found_at", "step"}``. A rule that
        raises is disabled for the rest of the run with a warning (training goes on).
        """
        new: list[Finding] = []
        cleared: list[dict[str, Any]] = []
        for rule in self.rules:
            if rule.id in self._failed or rule.missing(self.history):
                continue
            try:
                current = rule.check(self.history)
            except Exception as error:  # a rule must never stop training
                self._failed[rule.id] = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"[cockpit_like] diagnosis rule {rule.id} failed and is disabled: {self._failed[rule.id]}. "
                    "The other rules and the training go on; this is a bug of the rule: please report it with "
                    "this message",
                    RuntimeWarning,
                    stacklevel=2,
                )
                continue
            holding = {finding.key: finding for finding in current}
            for key, finding in holding.items():
                if key not in self.active or severity_rank(finding.severity) > severity_rank(self.active[key].severity):
                    self.active[key] = finding
                    self.reported.append(finding)
                    new.append(finding)
            for key in [key for key in self.active if key[0] == rule.id and key not in holding]:
                finding = self.active.pop(key)
                step = self.history.latest_step if self.history.latest_step is not None else finding.step
                cleared.append({"rule": key[0], "layer": key[1], "found_at": finding.step, "step": step})
        return new, cleared

    def plan(self, tracked: Sequence[str], feeds: Sequence[str] = ()) -> dict[str, Any]:
        """Which rules can run on the quantities ``tracked`` (their output names), for the log metadata:
        ``{"rules", "can_run", "needs": {rule: what it reads that is not tracked}, "feeds"}``.

        Figures given to ``cockpit.log`` (``learning_rate``, ``train_loss``, ``valid_loss``) count
        as missing here; the rules that read them run once they are logged (``LearningRate`` stands
        in for ``learning_rate``).
        """
        probe = RunHistory()
        probe.add(0, {name: 0.0 for name in tracked})
        if "LearningRate" in tracked:
            probe.add(0, {"learning_rate": 0.0})
        needs = {rule.id: ", ".join(rule.missing(probe)) for rule in self.rules if rule.missing(probe)}
        return {"rules": [rule.id for rule in self.rules], "can_run": [r.id for r in self.rules if r.id not in needs],
                "needs": needs, "feeds": list(feeds)}

    def notes(self) -> dict[str, str]:
        """``{rule id: why it did not run}`` for rules skipped (inputs not stored) or disabled."""
        notes = {}
        for rule in self.rules:
            missing = rule.missing(self.history)
            if missing:
                notes[rule.id] = rule.skip_note(missing)
            elif rule.id in self._failed:
                notes[rule.id] = f"{rule.id}: disabled after an error ({self._failed[rule.id]})"
        return notes


class DiagnosisReport:
    """What :func:`diagnose` finds in a run.

    Attributes:
        findings: every finding (stored in the log and found by the rules), by step.
        active: those not cleared by the end of the run.
        notes: ``{rule id: note}`` for rules that were skipped.
        incidents: the findings grouped by cause, cause first (a property).
    """

    def __init__(self, findings: list[Finding], active: list[Finding], notes: dict[str, str]):
        self.findings = findings
        self.active = active
        self.notes = notes

    @property
    def has_errors(self) -> bool:
        return any(finding.severity == "error" for finding in self.findings)

    @property
    def incidents(self) -> list[Incident]:
        """The findings grouped by cause (:func:`~cockpit_like.diagnosis.causes.group_findings`), in the
        order they started."""
        return group_findings(self.findings)

    def __str__(self) -> str:
        """The table ``cockpit-like diagnose`` prints: the incidents cause first, the findings, the notes."""
        from cockpit_like.diagnosis.report import format_table

        return format_table(self)

    def __repr__(self) -> str:
        errors = sum(finding.severity == "error" for finding in self.findings)
        return (f"<DiagnosisReport: {len(self.findings)} finding{'s' if len(self.findings) != 1 else ''} "
                f"({errors} error{'s' if errors != 1 else ''}), {len(self.active)} active; print() it for the "
                "table>")  # fmt: skip

    def _repr_pretty_(self, printer, cycle) -> None:
        """IPython and Jupyter show the table (a report as a cell's last expression)."""
        printer.text(repr(self) if cycle else str(self))

    def to_dict(self) -> dict[str, Any]:
        return {
            "incidents": [incident.to_dict() for incident in self.incidents],
            "findings": [finding.to_dict() for finding in self.findings],
            "active": [finding.to_dict() for finding in self.active],
            "notes": dict(self.notes),
        }


def diagnose(
    steps: Mapping[Any, Mapping[str, Any]],
    metadata: Mapping[str, Any] | None = None,
    rules: Sequence[Rule] | None = None,
    stored: bool = True,
) -> DiagnosisReport:
    """Replay the rules over a run's stored output, step by step, as they would have run live.

    Args:
        steps: ``{step: {name: value}}`` (``cockpit.get_output()`` or :func:`~cockpit_like.read_log`).
        metadata: the log's metadata (layer names).
        rules: the rules (default: all built-in ones); ``[]`` runs none.
        stored: also include the findings stored in the output (e.g. by a
            live diagnosis or the recorder); one equal to a replayed finding
            (same rule, layer and step) is listed once.
    """
    diagnosis = Diagnosis(rules, metadata)
    for step, arriving in _as_they_arrived(steps, metadata):
        added = [diagnosis.update(at, values) for at, values in arriving]
        if any(added):
            diagnosis.run()
    found = list(diagnosis.reported)
    active = list(diagnosis.active.values())
    if stored:
        seen = {(f.rule, f.layer, f.step) for f in found}
        still = {(f.rule, f.layer, f.step) for f in active_findings(steps)}
        for finding in findings_in(steps):
            identity = (finding.rule, finding.layer, finding.step)
            if identity not in seen:
                seen.add(identity)
                found.append(finding)
                if identity in still:
                    active.append(finding)
    found.sort(key=lambda f: f.step)
    active.sort(key=lambda f: f.step)
    return DiagnosisReport(found, active, diagnosis.notes())


def _as_they_arrived(steps: Mapping[Any, Any], metadata: Mapping[str, Any] | None) -> list[tuple[int, list]]:
    """``[(step, [(stored_at, values), ...])]``: what a live diagnosis was fed after each tracked step. A quantity
    with ``save_shift`` in the log's metadata (a two-step quantity: UpdateSize, Alpha) is stored under its start
    step ``t`` but known only at ``t + save_shift``; fed with step ``t``, a rule would see it one step early and
    name a later step than the live run did (outside trial 26: ``update-ratio-too-large`` listed at steps 0 and 1).
    Logs without ``save_shift`` are fed step by step, as written."""
    shifts = {
        entry["name"]: int(entry["save_shift"])
        for entry in (metadata or {}).get("quantities") or []
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str) and entry.get("save_shift")
    }
    order = sorted(((int(step), values) for step, values in steps.items() if isinstance(values, Mapping)),
                   key=lambda item: item[0])
    tracked = [step for step, _ in order]
    late: dict[int, list] = {}  # arrival step -> [(stored_at, values)]
    arrived = []
    for step, values in order:
        now = {name: value for name, value in values.items() if name not in shifts}
        arrived.append((step, late.pop(step, []) + [(step, now)]))
        for name, shift in shifts.items():
            if name in values:  # known at the first step of the log at or after its end step
                at = bisect.bisect_left(tracked, step + shift)
                late.setdefault(tracked[at] if at < len(tracked) else None, []).append((step, {name: values[name]}))
    if late.get(None):  # ends after the log's last step: fed after it
        arrived.append((tracked[-1], late[None]))
    return arrived


def diagnose_log(path: str | os.PathLike, rules: Sequence[Rule] | None = None, stored: bool = True) -> DiagnosisReport:
    """:func:`diagnose` on a log file (``.json``, ``.jsonl`` or a Cockpit log)."""
    from cockpit_like.logs import read_log_with_metadata

    metadata, steps = read_log_with_metadata(path)
    return diagnose(steps, metadata, rules, stored)
