"""Round 9 of the diagnosis rules (outside trial 8's 36 runs, two seeds, as a tuning set): each test is built on
small hand-made values shaped like the trial's run it names, and fails without the change it names."""

from __future__ import annotations

import math

from cockpit_like.diagnosis import group_findings
from cockpit_like.diagnosis import recipe
from cockpit_like.diagnosis import rules as R
from tests.test_diagnosis import history


def test_overfitting_is_a_rise_against_the_fall_the_validation_loss_made():
    """H04 (a healthy 1-D CNN): validation 0.60 -> 0.062 -> 0.106 -> 0.083, a rise of 4% of its fall; H14 (a
    Gaussian-NLL regression): a negative best, -0.0094, for which 'rose 10% above the best' held for any value
    above -0.0103. Both were called overfitting; both then fell further."""
    steps = [19, 39, 59, 79, 99]
    cnn = history({"valid_loss": [0.599, 0.096, 0.0616, 0.106, 0.0827],
                   "train_loss": [0.9, 0.1, 0.0523, 0.03, 0.0184]}, steps=steps)
    assert R.Overfitting().check(cnn) == []
    gauss = history({"valid_loss": [0.603, 0.267, -0.0094, 0.0116, 0.0001],
                     "train_loss": [0.7, 0.3, -0.0652, -0.07, -0.0826]}, steps=steps)
    assert R.Overfitting().check(gauss) == []
    # a rise of a third of the fall (the fixed corpus's overfitting runs rose 29% and 127% of theirs): found
    real = history({"valid_loss": [2.36, 1.9, 1.74, 1.95, 2.0], "train_loss": [2.3, 1.5, 1.0, 0.6, 0.4]},
                   steps=steps)
    (found,) = R.Overfitting().check(real)
    assert found.evidence["best_step"] == 59


def test_a_flat_loss_with_weights_that_barely_move_is_not_a_squashed_output():
    """B18 (a denoising autoencoder at a learning rate 10,000x too small): its reconstruction loss over 64
    pixels barely varies from batch to batch and did not fall, with update ratios of about 1e-6; it was named
    saturated-output first."""
    flat = [0.693 + 0.0003 * math.sin(s) for s in range(30)]
    tiny = {"Loss": flat, "UpdateSize": [[1e-6]] * 30, "ParamNorm": [[1.0]] * 30}
    assert R.SaturatedOutput().check(history(tiny)) == []
    moving = {**tiny, "UpdateSize": [[1e-2]] * 30}
    assert [f.rule for f in R.SaturatedOutput().check(history(moving))] == ["saturated-output"]


def test_radam_steps_below_lr_times_the_gradient_are_its_warm_up():
    """H09 (a healthy FiLM MLP with RAdam at 3e-3) and B09 (the same at batch 1): RAdam's un-rectified steps
    are lr x the bias-corrected momentum, 0.3-0.6x lr x the gradient where gradients change from step to step;
    the steps had to be within 1.5x of lr x the gradient, so the warm-up was named a learning rate too small."""
    meta = {"param_shapes": [[8, 8], [8, 8]], "param_names": ["a.weight", "b.weight"]}
    grad, rate, norm = [0.24, 0.14], 0.003, [12.0, 9.0]
    momentum_steps = [0.33 * rate * g for g in grad]  # ratio 2e-5 and 1.5e-5: below 1e-4
    series = {"UpdateSize": [momentum_steps] * 5, "GradNorm": [grad] * 5, "ParamNorm": [norm] * 5,
              "LearningRate": [rate] * 5, "Momentum": [math.nan] * 5, "Loss": [0.7] * 5}
    assert R.UpdateRatioTooSmall().check(history(series, meta)) == []
    # Adam at a tiny rate (about lr per coordinate, far above lr x a small gradient): still a finding
    adam = {**series, "UpdateSize": [[8 * 3e-6, 8 * 3e-6]] * 5, "LearningRate": [3e-6] * 5}
    assert [f.layer for f in R.UpdateRatioTooSmall().check(history(adam, meta))] == ["a.weight", "b.weight"]


def _at_chance(count: int, rates: list[float]) -> dict:
    chance = math.log(10)
    return {"Loss": [chance * (1 + 0.005 * math.sin(s)) for s in range(count)],
            "DataStats": [{"outputs": 10, "input_integer": False}] * count,
            "UpdateSize": [[0.01]] * count, "ParamNorm": [[1.0]] * count, "LearningRate": rates}


def test_a_loss_at_chance_during_a_warm_up_is_not_yet_a_data_problem():
    """H11 (a healthy squeeze-and-excitation CNN, SGD with a one-cycle schedule): at chance while its rate
    rose for 60 steps, falling 20 steps after the peak; named labels-do-not-match at step 39 by
    loss-at-chance and loss-not-decreasing."""
    warm = [0.004 + 0.096 * min(s, 60) / 60 for s in range(61)]  # 0.004 -> 0.1 over 60 steps
    h = history(_at_chance(61, warm))
    assert R.LossAtChance().check(h) == [] and R.LossNotDecreasing().check(h) == []
    # the same losses at a constant rate: both fire (the tests can fail)
    constant = history(_at_chance(61, [0.1] * 61))
    assert [f.rule for f in R.LossAtChance().check(constant)] == ["loss-at-chance"]
    assert [f.rule for f in R.LossNotDecreasing().check(constant)] == ["loss-not-decreasing"]
    # still at chance 60 steps after the warm-up ended: found again, counted from where the rate settled
    long = history(_at_chance(121, warm + [0.1] * 60))
    assert recipe.rate_settled(long, 120) == 50  # the running peak came within 1.2x of 0.1 at step 50
    assert [f.rule for f in R.LossAtChance().check(long)] == ["loss-at-chance"]
    assert [f.rule for f in R.LossNotDecreasing().check(long)] == ["loss-not-decreasing"]
    # 40 losses at the run's rate are needed: at step 80 (30 since step 50) no verdict yet
    assert R.LossNotDecreasing().check(history(_at_chance(81, warm + [0.1] * 20))) == []
    assert [i.cause for i in group_findings(R.LossAtChance().check(long))] == ["labels-do-not-match"]


def test_a_slow_warm_up_seen_over_a_short_window_is_warming_up():
    """H11 again: update-ratio-too-small over steps 30..34 of the 60-step rise (the rate gained 8% there, below
    the 1.2x that warming_up asked of the window), named a learning rate too small."""
    rates = [0.004 + 0.096 * min(s, 60) / 60 for s in range(35)]
    h = history({"LearningRate": rates})
    assert recipe.warming_up(h, 30, 34)
    flat = history({"LearningRate": [0.004] * 5 + [0.1] * 30})
    assert not recipe.warming_up(flat, 30, 34)  # after a warm-up, at a constant rate: no longer
