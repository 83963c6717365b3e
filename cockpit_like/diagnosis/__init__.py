"""Check-engine lights: findings about a training run, made from what the cockpit stored.

What lives here:

- :mod:`~cockpit_like.diagnosis.findings`: :class:`Finding` (plain data) and
  where findings sit in the output (``{step: {"findings": [...]}}``);
- :mod:`~cockpit_like.diagnosis.history`: :class:`RunHistory`, the stored
  values the rules read;
- :mod:`~cockpit_like.diagnosis.rule`: :class:`Rule`, the contract of a rule;
- :mod:`~cockpit_like.diagnosis.rules`: the built-in rules;
- :mod:`~cockpit_like.diagnosis.engine`: :class:`Diagnosis` (runs rules live,
  reports a finding once per rule and layer until it clears) and
  :func:`diagnose` / :func:`diagnose_log` (the same on a saved run);
- :mod:`~cockpit_like.diagnosis.report`: the table and JSON of
  ``cockpit-like diagnose``;
- the recorder (``recorder*.py``), which produces findings of its own.

What it may import: numpy, :mod:`cockpit_like.logs` (reading logs) and the
stored output of quantities (by name). Rules never compute from the model,
never import torch, the quantities' code, the backends or the plotting;
the cockpit and the dashboard import this package, not the other way round.
"""

from cockpit_like.diagnosis.engine import Diagnosis, DiagnosisReport, diagnose, diagnose_log
from cockpit_like.diagnosis.findings import (
    CLEARED_KEY,
    FINDINGS_KEY,
    SEVERITIES,
    Finding,
    active_findings,
    findings_in,
)
from cockpit_like.diagnosis.history import RunHistory
from cockpit_like.diagnosis.rule import Rule
from cockpit_like.diagnosis.rules import default_rules

__all__ = [
    "Finding",
    "SEVERITIES",
    "FINDINGS_KEY",
    "CLEARED_KEY",
    "findings_in",
    "active_findings",
    "RunHistory",
    "Rule",
    "default_rules",
    "Diagnosis",
    "DiagnosisReport",
    "diagnose",
    "diagnose_log",
]
