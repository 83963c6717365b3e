"""Round 10 of the diagnosis rules (outside trial 9's 36 runs, two seeds, as a tuning set): each test is built on
small hand-made values shaped like the trial's run it names, and fails without the change it names."""

from __future__ import annotations

from cockpit_like.diagnosis import rules as R
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
