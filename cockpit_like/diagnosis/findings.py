"""What a diagnosis produces: :class:`Finding` (plain data, JSON-ready).

Imports nothing from the rest of cockpit_like, so rules, the recorder, the
dashboard and the command line can all share it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from collections.abc import Mapping
from typing import Any

#: severities, least to most severe
SEVERITIES = ("info", "warning", "error")
#: how strong a finding's evidence is (``evidence["strength"]``), weakest first: ``suggestive`` (just past
#: a threshold), ``moderate``, ``strong`` (far past it, or several independent signs), ``conclusive``
#: (non-finite values, a divergence sustained for many steps)
STRENGTHS = ("suggestive", "moderate", "strong", "conclusive")


@dataclass
class Finding:
    """One check-engine light.

    Attributes:
        rule: the rule's stable id, e.g. ``"loss-diverging"``.
        severity: ``"info"``, ``"warning"`` or ``"error"``.
        step: the global step at which the finding was made.
        message: what is wrong, in the user's terms, with the evidence.
        fix: what to try.
        layer: the parameter/module it concerns, if any.
        evidence: the numbers behind the message (steps, values), JSON-ready.
    """

    rule: str
    severity: str
    step: int
    message: str
    fix: str = ""
    layer: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding.severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(**data)

    @property
    def key(self) -> tuple[str, str | None]:
        """``(rule, layer)``: a finding is reported once per key until it clears."""
        return (self.rule, self.layer)


#: where findings are stored in the cockpit's output ``{step: {FINDINGS_KEY: [finding dicts]}}``
FINDINGS_KEY = "findings"
#: where clearings are stored: ``{step: {CLEARED_KEY: [{"rule", "layer", "found_at"}]}}``
CLEARED_KEY = "findings_cleared"
#: stored keys that are diagnosis output, not quantities
DIAGNOSIS_KEYS = (FINDINGS_KEY, CLEARED_KEY)


def severity_rank(severity: str) -> int:
    """0 for ``"info"``, 1 for ``"warning"``, 2 for ``"error"``."""
    return SEVERITIES.index(severity)


def findings_in(steps: Mapping[Any, Mapping[str, Any]]) -> list[Finding]:
    """Every finding stored in an output or log ``{step: {name: value}}``, by step.

    Logs without findings (older ones, or Cockpit's) give ``[]``.
    """
    found = []
    for step in sorted(steps, key=int):
        values = steps[step]
        for data in (values.get(FINDINGS_KEY) or []) if isinstance(values, Mapping) else []:
            found.append(Finding.from_dict(dict(data)))
    return found


def active_findings(steps: Mapping[Any, Mapping[str, Any]]) -> list[Finding]:
    """The stored findings that were not cleared later (what the dashboard lists)."""
    cleared = set()
    for values in steps.values():
        if isinstance(values, Mapping):
            for entry in values.get(CLEARED_KEY) or []:
                cleared.add((entry.get("rule"), entry.get("layer"), entry.get("found_at")))
    return [f for f in findings_in(steps) if (f.rule, f.layer, f.step) not in cleared]
