"""What a diagnosis produces: :class:`Finding` (plain data, JSON-ready).

Imports nothing from the rest of cockpit_like, so rules, the recorder, the
dashboard and the command line can all share it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: severities, least to most severe
SEVERITIES = ("info", "warning", "error")


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
