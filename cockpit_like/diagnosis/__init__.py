"""Check-engine lights: findings about a training run, made from what the cockpit stored.

What lives here:

- :mod:`~cockpit_like.diagnosis.findings`: :class:`Finding` (plain data) and
  where findings sit in the output (``{step: {"findings": [...]}}``);
- :mod:`~cockpit_like.diagnosis.history`: :class:`RunHistory`, the stored
  values the rules read;
- :mod:`~cockpit_like.diagnosis.rule`: :class:`Rule`, the contract of a rule;
- :mod:`~cockpit_like.diagnosis.rules`: the built-in rules (their classes,
  e.g. :class:`LossDiverging`, are importable from this package too, and so
  is ``loss-spike``'s :class:`LossSpike` of
  :mod:`~cockpit_like.diagnosis.spike_rule`);
- :mod:`~cockpit_like.diagnosis.recipe`: what the rules know of the training
  recipe (the scheduled learning rate, an adaptive optimizer, how far the
  loss came), read from stored values;
- :mod:`~cockpit_like.diagnosis.causes`: the cause layer, :func:`group_findings`
  (the findings of one incident as one :class:`Incident`: cause, evidence,
  symptoms, fix);
- :mod:`~cockpit_like.diagnosis.scoring`: scoring findings against labelled
  runs (the corpus, :mod:`cockpit_like.corpus`);
- :mod:`~cockpit_like.diagnosis.engine`: :class:`Diagnosis` (runs rules live,
  reports a finding once per rule and layer until it clears) and
  :func:`diagnose` / :func:`diagnose_log` (the same on a saved run);
- :mod:`~cockpit_like.diagnosis.report`: the table and JSON of
  ``cockpit-like diagnose``;
- :mod:`~cockpit_like.diagnosis.recorder`: the recorder, which produces
  findings of its own (``nonfinite-origin``; its docstring says what it
  imports).

What the rules' side may import: numpy, :mod:`cockpit_like.logs` (reading
and encoding logs) and the stored output of quantities (by name). It never
computes from the model and never imports torch, the quantities' code, the
backends or the plotting; the cockpit, the dashboard and the command line
import this package, not the other way round.
"""

from cockpit_like.diagnosis.causes import CAUSES, Incident, group_findings
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
from cockpit_like.diagnosis.rules import (
    ConstantInputs,
    DeadUnits,
    ExplodingGradient,
    ExplodingRecurrence,
    GradientsAccumulate,
    LargeInputScale,
    LearningRateJump,
    LossAtChance,
    LossDiverging,
    LossJump,
    LossNotDecreasing,
    NoiseDominated,
    NoisyLoss,
    NonFiniteLoss,
    Overfitting,
    PoorInitialization,
    SaturatedOutput,
    SaturatedUnits,
    SharpnessAboveStability,
    SmallBatch,
    StepOvershoots,
    StepTooShort,
    UnchangedParameters,
    UpdateRatioTooLarge,
    UpdateRatioTooSmall,
    VanishingGradient,
    WeightsShrinking,
    default_rules,
)
from cockpit_like.diagnosis import rules as _rules
from cockpit_like.diagnosis.spike_rule import LossSpike

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
    # the built-in rules (cockpit_like.diagnosis.rules), for diagnose=[...] with thresholds of one's own
    *(name for name in _rules.__all__ if name != "default_rules"),
    "LossSpike",
    "Diagnosis",
    "DiagnosisReport",
    "diagnose",
    "diagnose_log",
    "CAUSES",
    "Incident",
    "group_findings",
]
