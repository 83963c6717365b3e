"""Round 10 of the diagnosis rules (outside trial 9's 36 runs, two seeds, as a tuning set): each test is built on
small hand-made values shaped like the trial's run it names, and fails without the change it names."""

from __future__ import annotations

from cockpit_like.diagnosis import Finding
from cockpit_like.diagnosis import rules as R
from cockpit_like.diagnosis.engine import DiagnosisReport
from cockpit_like.diagnosis.report import format_table
from tests.test_diagnosis import history


def test_a_loss_spike_that_comes_back_is_not_a_new_level():
    """H13, seed 1 (a healthy WaveNet, SGD with Nesterov): the loss rose from 0.075 to 0.37 over steps 32-37
    and was back at 0.07 by step 40. At step 37 the five losses after the old level were all above it, and
    loss-jump named the data (labels replaced); the first of them was 0.3 x the jump above the old level."""
    level = [0.07, 0.077, 0.0724, 0.0768, 0.07, 0.0766, 0.0704, 0.0677, 0.0736, 0.072]
    spike = history({"Loss": [0.65] * 3 + level + [0.127, 0.169, 0.325, 0.248, 0.372]})
    assert R.LossJump().check(spike) == []
    assert [f.rule for f in R.LossJump(hold=0.0).check(spike)] == ["loss-jump"]  # the old test: found
    # labels replaced mid-run lift every batch's loss: still found
    replaced = history({"Loss": [0.65] * 3 + level + [0.31, 0.36, 0.29, 0.33, 0.35]})
    (found,) = R.LossJump().check(replaced)
    assert found.evidence["since"] == 13


def test_the_active_diagnosis_reads_causes_in_the_context_of_every_finding():
    """`cockpit-like diagnose --active` grouped the active findings alone: at a 100x learning rate the updates that
    blew up were cleared by the end, the dead units they left were not, and the text named dead-units first with an
    initialization fix, where the whole diagnosis and --json name the learning rate (outside trial 10)."""
    blow_up = Finding("update-ratio-too-large", "warning", 0, "updates blow up", layer="0.weight",
                      evidence={"since": 0})
    vanished = Finding("vanishing-gradient", "warning", 19, "gradient exactly 0", layer="0.weight",
                       evidence={"since": 17, "at_start": False, "zero": True, "norm": 0.0})
    dead = Finding("dead-units", "warning", 30, "units dead", layer="1",
                   evidence={"since": 28, "at_start": False, "developed": True})
    report = DiagnosisReport([blow_up, vanished, dead], [vanished, dead], {})
    text = format_table(report, active_only=True)
    assert "1. WARNING learning-rate-too-large" in text and "dead-units" in text
    assert "WARNING dead-units" not in text
