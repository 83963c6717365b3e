"""The rule contract: :class:`Rule`.

A rule is a small class that looks at the stored values of a run
(:class:`~cockpit_like.diagnosis.history.RunHistory`) and returns the
findings that hold *now*. It computes nothing new from the model: it reads
what quantities stored, ``cockpit.log`` figures and the log metadata.

Contract (see ``docs/diagnosis.md``):

- class attributes ``id`` (stable, kebab-case), ``severity`` (default
  severity of its findings) and ``reads`` (stored keys that must all be
  present, e.g. ``("Loss",)``; otherwise the rule is skipped with a note);
- thresholds are constructor arguments, listed by :meth:`settings`;
- :meth:`check` returns the list of findings that hold at the latest data
  (empty when all is well). The engine reports a finding once per
  ``(rule, layer)`` and clears it when :meth:`check` stops returning it, so
  :meth:`check` may return the same problem at every call.
"""

from __future__ import annotations

from typing import Any, ClassVar

from cockpit_like.diagnosis.findings import SEVERITIES, STRENGTHS, Finding
from cockpit_like.diagnosis.history import RunHistory

__all__ = ["Rule"]


#: how a run stores what a rule reads, where it takes more than tracking the quantity
_HOW_TO_STORE = {
    "ActivationStats": "Cockpit(..., diagnose=True) tracks it for the rules where it sees the activations: pass "
                       "Cockpit(..., model=model) (or use activation modules such as nn.ReLU)",
    "HessMaxEV": "HessMaxEV is in the full preset, or track it at a few steps, with "
                 "loss.backward(create_graph=cockpit.create_graph(step))",
}


class Rule:
    """Base class of every diagnosis rule.

    Example::

        class LossAboveTen(Rule):
            id = "loss-above-ten"
            severity = "warning"
            reads = ("Loss",)

            def __init__(self, limit: float = 10.0):
                self.limit = limit

            def check(self, history):
                step, loss = history.last("Loss")[0]
                if loss > self.limit:
                    return [self.finding(step, f"the loss is {loss:.3g} > {self.limit}", fix="...")]
                return []
    """

    id: ClassVar[str] = ""
    severity: ClassVar[str] = "warning"
    reads: ClassVar[tuple[str, ...]] = ()
    #: the evidence strength of a finding that does not set ``evidence["strength"]`` itself
    strength: ClassVar[str] = "moderate"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.severity not in SEVERITIES:
            raise ValueError(f"{cls.__name__}.severity must be one of {SEVERITIES}, got {cls.severity!r}")
        if cls.strength not in STRENGTHS:
            raise ValueError(f"{cls.__name__}.strength must be one of {STRENGTHS}, got {cls.strength!r}")

    # ---- what the engine asks ------------------------------------------------------
    def missing(self, history: RunHistory) -> list[str]:
        """The keys in :attr:`reads` that the run did not store (the rule is skipped if any)."""
        return [name for name in self.reads if not history.has(name)]

    def skip_note(self, missing: list[str]) -> str:
        """Why the rule was skipped, in the user's terms."""
        what = ", ".join(missing)
        hints = [_HOW_TO_STORE[name] for name in missing if name in _HOW_TO_STORE]
        how = f"; {'; '.join(hints)}" if hints else ""
        return (f"{self.id}: skipped, it reads {what}, which the run did not store (track or log it to enable the "
                f"rule{how})")

    def check(self, history: RunHistory) -> list[Finding]:
        """The findings that hold at the latest stored data."""
        raise NotImplementedError(f"{type(self).__name__} must implement check(history)")

    def settings(self) -> dict[str, Any]:
        """The rule's thresholds (its constructor arguments)."""
        return {key: value for key, value in vars(self).items() if not key.startswith("_")}

    # ---- helpers -------------------------------------------------------------------------
    def finding(
        self,
        step: int,
        message: str,
        fix: str = "",
        layer: str | None = None,
        evidence: dict[str, Any] | None = None,
        severity: str | None = None,
    ) -> Finding:
        """A :class:`Finding` of this rule; ``evidence["strength"]`` defaults to the class's :attr:`strength`
        (an error about a non-finite value: ``conclusive``)."""
        evidence = dict(evidence or {})
        if "strength" not in evidence:
            evidence["strength"] = "conclusive" if severity == "error" else self.strength
        return Finding(
            rule=self.id,
            severity=severity or self.severity,
            step=int(step),
            message=message,
            fix=fix,
            layer=layer,
            evidence=evidence,
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"
