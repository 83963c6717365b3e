"""The cause layer: the findings of one incident grouped into one :class:`Incident`, cause first.

Rules report what they see; several of them often see one incident. A
learning rate far too large blows the loss and the gradient up, then ReLUs
die, gradients vanish and parameters stop changing: five rules fire, and only
the first names the cause. :func:`group_findings` turns a run's findings into
incidents: each names a **cause** (an id of :data:`CAUSES`), the findings that
point at it (**evidence**), the findings it explains (**symptoms**, e.g. dead
units after a blow-up) and the fix *for the cause*.

How findings are grouped (deterministic, from the findings alone):

1. Each finding of severity ``warning`` or above is *read* as evidence of a
   cause (:func:`cause_of`); some rules are read in context: a gradient
   explosion at the first tracked step (before any update) points at the
   model or the data, later at the learning rate; parameters that do not
   change although they get a gradient point at a frozen layer, with a zero
   gradient at whatever stopped the gradient; a non-finite loss with no
   blow-up before it points at an operation.
2. The earliest evidence (by ``evidence["since"]``, the step where a
   finding's evidence starts, else its step) opens an incident; among
   evidence starting within ``slack`` tracked steps of it (rules need
   different numbers of steps to be sure), the cause earliest in
   :data:`CAUSE_ORDER` wins (a cause before the causes it can produce:
   inputs and initialization before a learning rate, a learning rate before
   dead units). Findings of rules that mostly see symptoms (dead units,
   vanishing gradients, unchanged parameters, a loss that does not fall)
   compete only when nothing stronger is near, unless they hold from the
   first tracked step (``evidence["at_start"]``). A ``loss-spike`` is read by
   the cause its post-mortem names (a learning-rate or curvature spike is
   evidence of a learning rate too large).
3. The incident takes every later finding its cause explains (its own
   evidence, and the symptoms listed in :data:`CAUSES`); what is left opens
   the next incident. ``info`` findings are attached as symptoms where a
   cause explains them, else listed in an incident of their own.

Example::

    from cockpit_like.diagnosis import diagnose, group_findings
    report = diagnose(steps, metadata)
    for incident in group_findings(report.findings):
        print(incident.headline())
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cockpit_like.diagnosis.findings import Finding, severity_rank

__all__ = ["CAUSES", "CAUSE_ORDER", "Cause", "Incident", "cause_of", "group_findings", "since"]


@dataclass(frozen=True)
class Cause:
    """What can be wrong: an id, a sentence, the fix, and the rules whose findings it explains."""

    id: str
    title: str
    fix: str
    symptoms: tuple[str, ...] = ()


_BLOW_UP_SYMPTOMS = ("loss-diverging", "exploding-gradient", "update-ratio-too-large", "step-overshoots",
                     "sharpness-above-stability", "loss-spikes", "dead-units", "vanishing-gradient",
                     "unchanged-parameters", "saturated-units", "loss-not-decreasing", "nonfinite-loss",
                     "noisy-loss", "small-batch", "noise-dominated", "poor-initialization",
                     "update-ratio-too-small", "loss-at-chance")

#: the fix of a gradient that explodes before any update in a model with a recurrence ...
_RECURRENT_FIX = ("clip gradients (torch.nn.utils.clip_grad_norm_), initialize recurrent weights with a spectral "
                  "radius at most 1 (orthogonal init), or use gated cells (LSTM/GRU)")
#: ... and where nothing shows one (a CNN whose first gradient is far larger than the later ones)
_GENERAL_EXPLODING_FIX = (
    "clip gradients (torch.nn.utils.clip_grad_norm_) and look for what makes the first gradients large before any "
    "update: weights initialized at too large a scale (use a width-scaled initialization), inputs or a loss far "
    "from unit scale, or a layer applied again and again (a recurrence through time) that amplifies the gradient")


def exploding_gradient_fix(recurrent: list[str] | None) -> str:
    """The fix for a gradient that exploded before any update: recurrent weights only where the model is known
    to have them (``recurrent``: the names of its recurrent weights; ``[]`` or ``None``: none known)."""
    if not recurrent:
        return _GENERAL_EXPLODING_FIX
    shown = ", ".join(recurrent[:3]) + (f" +{len(recurrent) - 3}" if len(recurrent) > 3 else "")
    return _RECURRENT_FIX.replace("recurrent weights", f"the recurrent weights ({shown})")


def _recurrence_shown(evidence: Iterable[Finding]) -> bool:
    """Whether a finding shows a recurrence: ``exploding-recurrence`` (an activation called more than once per
    sample), or recurrent weights among the log's parameter names (``evidence["recurrent"]``)."""
    return any(f.rule == "exploding-recurrence" or f.evidence.get("recurrent") for f in evidence)


#: the title of a gradient that exploded after updates through a recurrence, with no sign of a large learning
#: rate before it (round 6)
_RECURRENT_GROWTH_TITLE = ("the gradient explodes through the recurrence: it grew before the updates or the loss "
                           "showed a learning rate too large")


#: the title of unnormalized inputs seen on the raw input (``DataStats``' ``input_rms``), not on the first layer
_RAW_INPUT_TITLE = "the inputs are not normalized: the model's raw inputs are far larger than unit scale"


def _wording(cause_id: str, evidence: list[Finding]) -> tuple[str, str]:
    """The cause's title and fix, for what its evidence shows: recurrent weights only for a model with a
    recurrence; the raw input or the first layer's outputs, whichever ``large-input-scale`` measured."""
    cause = CAUSES[cause_id]
    if cause_id == "exploding-gradient" and evidence and _recurrence_shown(evidence) and not any(
            f.evidence.get("at_start") for f in evidence):  # it grew after updates (round 6: a recurrence's)
        names = next((f.evidence["recurrent"] for f in evidence if f.evidence.get("recurrent")), None)
        return _RECURRENT_GROWTH_TITLE, exploding_gradient_fix(names)
    if cause_id == "exploding-gradient" and not _recurrence_shown(evidence):
        return cause.title, _GENERAL_EXPLODING_FIX
    if cause_id == "unnormalized-inputs" and any("input_rms" in f.evidence for f in evidence):
        return _RAW_INPUT_TITLE, cause.fix
    if cause_id == "nonfinite-operation" and any(
            f.rule == "nonfinite-origin" and f.evidence.get("origin") == "input" for f in evidence):
        return _NONFINITE_INPUT_TITLE, _NONFINITE_INPUT_FIX  # the recorder saw it arrive (outside trial 9)
    return cause.title, cause.fix


#: the wording of a non-finite value the recorder found already in the step's input (data or parameters)
_NONFINITE_INPUT_TITLE = ("the step received a NaN or an infinity: its data (or parameters made non-finite at "
                          "an earlier step) carried it; no operation of the step made it")
_NONFINITE_INPUT_FIX = ("check the batch of that step (torch.isfinite(x).all() where the data is loaded or "
                        "transformed); if the batch is finite, the parameters were: record the step before with "
                        "cockpit.record(step) to find the operation that made them")


#: every cause the layer can name
CAUSES: dict[str, Cause] = {
    cause.id: cause
    for cause in (
        Cause("unnormalized-inputs", "the inputs are not normalized: the first layer's outputs are far too large",
              "scale the inputs to about unit size (e.g. divide 0..255 pixels by 255, or standardize each "
              "feature with the training set's mean and standard deviation)", _BLOW_UP_SYMPTOMS),
        Cause("poor-initialization", "the initialization makes signals vanish or saturate through depth",
              "initialize weights with a variance scaled to the layer width (Kaiming for ReLU, Xavier for "
              "tanh/sigmoid), or add normalization layers or residual connections", _BLOW_UP_SYMPTOMS),
        Cause("exploding-gradient", "the gradient explodes through the model (before any update: not the "
              "learning rate)", _RECURRENT_FIX, _BLOW_UP_SYMPTOMS),
        Cause("learning-rate-too-large", "the learning rate is too large: the loss and the updates blow up",
              "lower the learning rate (by 10x for a blow-up, 2-3x for spikes), add warm-up, or clip "
              "gradients; check the learning-rate schedule where the blow-up starts later in the run",
              _BLOW_UP_SYMPTOMS),
        Cause("nonfinite-operation", "an operation made a NaN or an infinity",
              "find the operation (cockpit.record(step), or the recorder's nonfinite-origin finding): clamp "
              "log inputs, add an epsilon to divisions and norms, check the data of that step",
              ("exploding-gradient", "unchanged-parameters", "vanishing-gradient", "dead-units",
               "loss-not-decreasing", "update-ratio-too-small", "update-ratio-too-large")),
        Cause("frozen-layer", "a layer does not change: it is not being trained (left out of the optimizer, a "
              "learning rate of 0, or requires_grad=False since a step)",
              "give the parameter to the optimizer (model.parameters()), check its learning rate and its "
              "requires_grad, unless it is frozen on purpose", ()),
        Cause("dead-units", "ReLU units are off for every sample from the start; they pass no gradient",
              "initialize biases at 0 (not negative), use Kaiming initialization or LeakyReLU/GELU",
              ("vanishing-gradient", "unchanged-parameters", "loss-not-decreasing", "update-ratio-too-small")),
        Cause("learning-rate-too-small", "the learning rate is too small: the parameters barely move",
              "raise the learning rate (try 10x); check the schedule and weight decay",
              ("loss-not-decreasing", "step-too-short")),
        Cause("overfitting", "the model overfits: the validation loss rises while the training loss falls",
              "stop early at the best validation step, regularize (weight decay, dropout, augmentation), use "
              "more data; check the labels for noise", ()),
        Cause("batch-too-small", "the batch is too small: gradient noise swamps the signal",
              "use a larger batch (or accumulate gradients), or lower the learning rate",
              ("noise-dominated", "loss-not-decreasing")),
        Cause("labels-do-not-match", "the data does not match: the loss does not fall although the parameters "
              "move at a normal rate, or it rose mid-run with no change in the learning rate and no growth of the "
              "updates before it (labels shuffled or replaced, inputs constant)", "check the data pipeline: that "
              "labels and inputs are shuffled together, the label encoding, a loader that repeats one batch or "
              "zeroes the inputs, and that the task is learnable (try to overfit one batch)",
              ("loss-not-decreasing", "noisy-loss", "update-ratio-too-small")),
        Cause("gradient-noise", "gradient noise dominates the mini-batch gradient",
              "a larger batch would give cleaner steps (a suggestion, not a fault)", ()),
        Cause("gradients-accumulate", "the gradients add up over steps: optimizer.zero_grad() is not called "
              "(or is called after backward)", "call optimizer.zero_grad() (or model.zero_grad()) once per "
              "optimizer step, before loss.backward(); when accumulating on purpose, divide the loss by the "
              "number of micro-batches and zero after the step", _BLOW_UP_SYMPTOMS),
        Cause("saturated-output", "the output is squashed before the loss (e.g. softmax before "
              "CrossEntropyLoss, which applies its own): the loss barely varies and barely falls",
              "pass raw logits to CrossEntropyLoss / BCEWithLogitsLoss (remove the final softmax or sigmoid), "
              "or use NLLLoss on log_softmax", ("loss-not-decreasing", "update-ratio-too-small",
                                                "vanishing-gradient", "step-too-short")),
        Cause("weight-decay-too-large", "weight decay far too strong: every weight shrinks toward 0",
              "lower the weight decay (with AdamW the decay per step is lr x weight_decay)",
              ("loss-not-decreasing", "vanishing-gradient", "update-ratio-too-large", "unchanged-parameters",
               "dead-units", "update-ratio-too-small", "noisy-loss")),
        Cause("other", "cause unknown: no known cause fits these findings", "see the finding's fix", ()),
    )
}

#: the order in which causes win when their evidence is found within ``slack`` steps of each other
CAUSE_ORDER = ("unnormalized-inputs", "exploding-gradient", "poor-initialization", "gradients-accumulate",
               "weight-decay-too-large", "learning-rate-too-large", "nonfinite-operation",
               "saturated-output", "frozen-layer", "dead-units", "learning-rate-too-small", "overfitting",
               "batch-too-small", "labels-do-not-match", "gradient-noise", "other")

_DIRECT = {
    "large-input-scale": "unnormalized-inputs",
    "poor-initialization": "poor-initialization",
    "saturated-units": "poor-initialization",
    "vanishing-gradient": "poor-initialization",
    "loss-diverging": "learning-rate-too-large",
    "loss-spikes": "learning-rate-too-large",
    "update-ratio-too-large": "learning-rate-too-large",
    "step-overshoots": "learning-rate-too-large",
    "sharpness-above-stability": "learning-rate-too-large",
    "dead-units": "dead-units",
    "update-ratio-too-small": "learning-rate-too-small",
    "step-too-short": "learning-rate-too-small",
    "overfitting": "overfitting",
    "noisy-loss": "batch-too-small",
    "small-batch": "batch-too-small",
    "loss-not-decreasing": "labels-do-not-match",
    "noise-dominated": "gradient-noise",
    "nonfinite-origin": "nonfinite-operation",
    "learning-rate-jump": "learning-rate-too-large",
    "weights-shrinking": "weight-decay-too-large",
    "gradients-accumulate": "gradients-accumulate",
    "saturated-output": "saturated-output",
    "exploding-recurrence": "exploding-gradient",
    "constant-inputs": "labels-do-not-match",
    "loss-at-chance": "labels-do-not-match",
}


#: per cause, the rules whose findings are its own evidence (not symptoms), beyond :data:`_DIRECT`
_OWN = {cause: {rule for rule, named in _DIRECT.items() if named == cause} for cause in set(_DIRECT.values())}
_OWN.setdefault("learning-rate-too-large", set()).update({"exploding-gradient", "nonfinite-loss"})
_OWN.setdefault("exploding-gradient", set()).add("exploding-gradient")
_OWN.setdefault("nonfinite-operation", set()).update({"nonfinite-loss", "exploding-gradient"})
_OWN.setdefault("frozen-layer", set()).add("unchanged-parameters")
_OWN.setdefault("labels-do-not-match", set()).update({"loss-diverging", "loss-jump"})
_OWN.setdefault("learning-rate-too-large", set()).add("loss-jump")


#: findings that a forgotten zero_grad produces too (the summed gradient makes every step larger): read as
#: its symptoms when the run has a ``gradients-accumulate`` finding and no ``learning-rate-jump``
_ACCUMULATION_SYMPTOMS = ("update-ratio-too-large", "loss-diverging", "exploding-gradient", "loss-jump",
                          "step-overshoots", "nonfinite-loss")


#: findings that inputs turned constant produce too (the model fits one input: the loss and the gradient
#: jump): read as the data's when they start at or after a ``constant-inputs`` finding's evidence
_CONSTANT_INPUT_SYMPTOMS = _ACCUMULATION_SYMPTOMS + ("vanishing-gradient", "dead-units",
                                                     "saturated-units", "unchanged-parameters",
                                                     "update-ratio-too-small", "noisy-loss")


#: how many steps before a ``constant-inputs`` finding's first constant batch a windowed finding's evidence
#: may start and still be read as its symptom (``dead-units`` over 3 steps starts 2 steps before its step)
_WINDOW_LEAD = 2


#: findings that a batch of one sample produces too (each update follows one sample's gradient: the loss
#: and the updates jump): read as the batch's when the run has a ``small-batch`` finding (batches of at
#: most ``SmallBatch.max_batch`` samples whose loss is noisy and not falling)
_SMALL_BATCH_SYMPTOMS = ("loss-diverging", "update-ratio-too-large", "exploding-gradient", "loss-jump",
                         "step-overshoots")


#: the loss-spike post-mortem's causes (``loss-spike``'s ``evidence["cause"]``, :mod:`cockpit_like.spikes.causes`)
#: that name a cause of this layer: a learning rate that jumped, or one past the stability bound 2/lr
_SPIKE_CAUSES = {"learning-rate": "learning-rate-too-large", "curvature": "learning-rate-too-large"}


def _spike_cause(finding: Finding) -> str:
    """The cause a ``loss-spike`` finding names through its post-mortem (``other`` for rows, precision, unknown)."""
    cause = finding.evidence.get("cause") if isinstance(finding.evidence, dict) else None
    return _SPIKE_CAUSES.get(cause, "other")


def cause_of(finding: Finding, findings: Iterable[Finding] = ()) -> str:
    """The cause ``finding`` is evidence of, read in the context of the run's other ``findings``."""
    rule = finding.rule
    findings = list(findings)
    if rule == "loss-spike":  # the post-mortem named the spike's cause: a learning-rate spike is the rate's
        return _spike_cause(finding)
    if rule in _CONSTANT_INPUT_SYMPTOMS and not finding.evidence.get("at_start"):
        # (a windowed finding's evidence may start up to ``_WINDOW_LEAD`` steps before the inputs turned
        # constant, at the first step its window reaches back to, when only the window's last steps are new)
        start = since(finding) + (_WINDOW_LEAD if finding.step > since(finding) else 0)
        if any(other.rule == "constant-inputs" and since(other) <= start for other in findings):
            return "labels-do-not-match"
    if rule in _SMALL_BATCH_SYMPTOMS and not finding.evidence.get("at_start") and not (
            rule == "exploding-gradient" and finding.severity == "error") and any(
            other.rule == "small-batch" for other in findings):
        return "batch-too-small"  # a batch of one: its noisy steps blow the loss up before the learning rate does
    if rule in _ACCUMULATION_SYMPTOMS and not finding.evidence.get("at_start"):
        rules = {f.rule for f in findings}
        if "gradients-accumulate" in rules and "learning-rate-jump" not in rules:
            return "gradients-accumulate"
    if rule == "vanishing-gradient" and finding.evidence.get("zero") is False and finding.evidence.get("norm") == 0:
        # exactly 0 at most steps of its window, not all: the layer's input is 0 for whole batches at some steps
        # (a batch of one whose feature is 0, units dead for most inputs), which large updates do not do (they
        # shrink gradients, never to exactly 0 at alternate steps); outside trial 8's B09 (a batch of one)
        return "batch-too-small" if any(other.rule == "small-batch" for other in findings) else "dead-units"
    if rule in ("vanishing-gradient", "saturated-units") and finding.evidence.get("at_start") is False and not (
            finding.evidence.get("zero")):
        return "learning-rate-too-large"  # it set in after training began: large updates, not the initialization
    if rule == "exploding-gradient":
        if finding.evidence.get("at_start"):
            return "exploding-gradient"
        if finding.severity == "error":  # a non-finite gradient: as the loss
            return _nonfinite_cause(finding, findings)
        if _recurrence_shown([finding]) and not _rate_signal_before(since(finding), finding, findings):
            return "exploding-gradient"  # through a recurrence, before the updates or the loss showed a large rate
        return "learning-rate-too-large"
    if rule == "nonfinite-loss":
        return _nonfinite_cause(finding, findings)
    if rule == "loss-diverging" and _data_changed(finding, findings):
        return "labels-do-not-match"
    if rule == "loss-jump":
        return "labels-do-not-match" if _data_changed(finding, findings) else "learning-rate-too-large"
    if rule in ("vanishing-gradient", "poor-initialization") and finding.evidence.get("zero"):
        return "dead-units"  # exactly 0: cut off (dead units upstream), not a small initialization
    if rule == "dead-units" and not finding.evidence.get("at_start", True) and finding.evidence.get("developed"):
        return "learning-rate-too-large"  # units alive at the start, killed later: large updates pushed them off
    if rule == "unchanged-parameters":
        return "frozen-layer" if finding.evidence.get("has_gradient") or finding.evidence.get("frozen") else (
            "dead-units")
    return _DIRECT.get(rule, "other")


#: rules whose findings are mostly symptoms: they name a cause of their own only when seen from the
#: first tracked step (``evidence["at_start"]``), or when nothing stronger is found near them
_SYMPTOM_RULES = ("vanishing-gradient", "saturated-units", "dead-units", "unchanged-parameters",
                  "loss-not-decreasing", "noisy-loss", "small-batch", "update-ratio-too-small",
                  "noise-dominated")


def _weak(finding: Finding) -> bool:
    return finding.rule in _SYMPTOM_RULES and not finding.evidence.get("at_start")


def since(finding: Finding) -> int:
    """The step where the evidence of ``finding`` starts (``evidence["since"]``, else its step)."""
    value = finding.evidence.get("since") if isinstance(finding.evidence, dict) else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else int(finding.step)


def _nonfinite_cause(finding: Finding, findings: Iterable[Finding]) -> str:
    blow_up = {"loss-diverging", "update-ratio-too-large", "loss-spikes"}
    findings = list(findings)
    for other in findings:
        if other.step <= finding.step and other is not finding and (other.rule in blow_up or (
                other.rule == "exploding-gradient" and other.severity != "error") or (
                other.rule == "loss-spike" and _spike_cause(other) == "learning-rate-too-large")):
            if other.rule == "exploding-gradient" and cause_of(other, findings) == "exploding-gradient":
                return "exploding-gradient"  # the blow-up was the recurrence's (round 6)
            return "learning-rate-too-large"
    return "nonfinite-operation"


#: findings that show a learning rate too large in the updates or the loss (a ``loss-spike`` counts where its
#: post-mortem names the rate)
_RATE_SIGNALS = ("update-ratio-too-large", "loss-diverging", "learning-rate-jump", "step-overshoots",
                 "sharpness-above-stability", "loss-spikes", "loss-jump")


def _rate_signal_before(step: int, finding: Finding, findings: Iterable[Finding]) -> bool:
    """Whether a finding other than ``finding`` shows a learning rate too large with evidence starting before
    ``step`` (an update that blew up at the step of an exploding gradient is its consequence: update = rate x
    gradient)."""
    return any(other is not finding and since(other) < step and (
        other.rule in _RATE_SIGNALS or (other.rule == "loss-spike" and _spike_cause(other) == "learning-rate-too-large"))
        for other in findings)


#: rules whose findings say the learning rate or the updates grew: a loss that rises after them is theirs
_GROWTH = ("learning-rate-jump", "update-ratio-too-large", "exploding-gradient", "step-overshoots",
           "sharpness-above-stability", "gradients-accumulate", "weights-shrinking")


def _data_changed(finding: Finding, findings: Iterable[Finding]) -> bool:
    """A loss that rose from its best moving median (not from the start), with the learning rate at most
    1.5x what it was at that best, and no finding of growing updates or rates before the rise: the
    data changed, not the recipe."""
    evidence = finding.evidence
    if evidence.get("from_first", finding.rule != "loss-jump"):
        return False
    ratio = evidence.get("rate_ratio")
    if not isinstance(ratio, (int, float)) or not ratio <= 1.5:
        return False
    start = since(finding)
    return not any(other.rule in _GROWTH and since(other) <= start + 2 and other is not finding
                   for other in findings)


@dataclass
class Incident:
    """One diagnosis: a cause, the findings that point at it, and the symptoms it explains.

    Attributes:
        cause: an id of :data:`CAUSES`.
        title: the cause in words.
        severity: the most severe of its findings.
        step: the step where its evidence starts (``evidence["since"]`` of its findings, else their step);
            :attr:`found_at` is the step at which a rule first reported it.
        fix: the fix for the cause.
        evidence: findings that point at the cause, by step.
        symptoms: findings the cause explains, by step.
    """

    cause: str
    title: str
    severity: str
    step: int
    fix: str
    evidence: list[Finding] = field(default_factory=list)
    symptoms: list[Finding] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return sorted(self.evidence + self.symptoms, key=lambda f: f.step)

    @property
    def found_at(self) -> int:
        """The step at which a rule first reported the incident's evidence (``step`` is where that evidence
        starts: a loss at chance level since step 0 is found once 40 steps show it)."""
        return min((f.step for f in self.evidence), default=self.step)

    def span(self) -> str:
        """``from step S`` and, where a rule needed later steps to see it, ``, found at step N``."""
        return f"from step {self.step}" + (f", found at step {self.found_at}" if self.found_at != self.step else "")

    def headline(self) -> str:
        """One line: severity, cause, where its evidence starts (and where it was found), title."""
        return f"{self.severity.upper()} {self.cause} ({self.span()}): {self.title}"

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "title": self.title, "severity": self.severity, "step": self.step,
                "found_at": self.found_at, "fix": self.fix, "evidence": [f.to_dict() for f in self.evidence],
                "symptoms": [f.to_dict() for f in self.symptoms]}


def group_findings(findings: Iterable[Finding], slack: int = 3) -> list[Incident]:
    """The incidents of a run's findings, in the order they started (see the module docstring).

    Args:
        findings: the findings of one run (reported ones, e.g. ``diagnose(...).findings``).
        slack: evidence found within this many steps of an incident's first
            evidence competes for its cause (:data:`CAUSE_ORDER` decides).
    """
    if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
        raise ValueError(f"slack must be an int >= 0, got {slack!r}")
    findings = list(findings)
    for finding in findings:
        if not isinstance(finding, Finding):
            raise ValueError(f"group_findings takes Finding objects, got {type(finding).__name__}")
    ordered = sorted(findings, key=lambda f: (since(f), f.step, -severity_rank(f.severity)))
    causes = {id(f): cause_of(f, ordered) for f in ordered}
    left = list(ordered)
    incidents: list[Incident] = []
    for loud in (True, False):  # incidents opened by warnings and errors first, then infos
        while True:
            openers = [f for f in left if (severity_rank(f.severity) >= 1) == loud]
            if not openers:
                break
            start = since(openers[0])
            near = [f for f in openers if since(f) <= start + slack]
            near = [f for f in near if not _weak(f)] or near
            cause_id = min((causes[id(f)] for f in near), key=CAUSE_ORDER.index)
            cause = CAUSES[cause_id]
            evidence = [f for f in left if causes[id(f)] == cause_id]
            # a finding read as this cause's evidence in context (zero gradients below dead units) is
            # still listed as a symptom when its rule is one of the cause's symptoms and not its own
            own = [f for f in evidence if f.rule not in cause.symptoms or f.rule in _OWN.get(cause_id, ())]
            evidence = own or evidence
            first = min(since(f) for f in evidence)
            symptoms = [f for f in left if f not in evidence and f.rule in cause.symptoms and (
                since(f) >= first - slack or causes[id(f)] == cause_id)]
            taken = {id(f) for f in evidence + symptoms}
            left = [f for f in left if id(f) not in taken]
            severity = max((f.severity for f in evidence + symptoms), key=severity_rank)
            title, fix = _wording(cause_id, evidence)
            incidents.append(Incident(cause_id, title, severity, first, fix, evidence, symptoms))
    # infos explained by an open incident's cause were taken above only when that incident is loud;
    # order: by first step, louder first on ties
    incidents.sort(key=lambda i: (i.step, -severity_rank(i.severity)))
    return incidents
