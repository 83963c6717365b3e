"""Round 7 of the diagnosis rules (the outside tester's sixth trial as a tuning set): each test is built on
small hand-made values that show one problem, and fails without the change it names."""

from __future__ import annotations

import math

import pytest

from cockpit_like.diagnosis import Finding, RunHistory, group_findings
from cockpit_like.diagnosis import rules as R


def history(series: dict[str, list], metadata: dict | None = None) -> RunHistory:
    h = RunHistory(metadata)
    for name, values in series.items():
        for step, value in enumerate(values):
            h.add(step, {name: value})
    return h


def _acts(**layers):
    return {name: {"kind": kind, "units": 4, "samples": 8, **fields} for name, (kind, fields) in layers.items()}


def test_a_mostly_dead_layer_is_not_the_reference_for_growth_through_depth():
    """B10 (a ResNet whose BatchNorm biases are -4): the stem's ReLU is 99.6% dead (rms 0.0016), so every
    later layer looked 384-649x larger and the run was named poor-initialization instead of dead units."""
    value = _acts(**{"stem": ("relu", {"dead_fraction": 0.996, "rms": 0.0016}),
                     "block1": ("relu", {"dead_fraction": 0.2, "rms": 0.8}),
                     "block2": ("relu", {"dead_fraction": 0.3, "rms": 1.0})})
    assert R.PoorInitialization().check(history({"ActivationStats": [value] * 3})) == []
    # a live reference with the same scales still shows the growth (the test can fail)
    live = {**value, "stem": {**value["stem"], "dead_fraction": 0.1}}
    found = R.PoorInitialization().check(history({"ActivationStats": [live] * 3}))
    assert [f.layer for f in found] == ["block1", "block2"] and found[1].evidence["reference"] == pytest.approx(0.0016)


def test_growth_through_depth_must_show_at_the_first_tracked_step():
    """B01 (a U-Net with Adam at lr 0.3): the activations' rms ratio was 0.27 at step 0 and 352 after the first
    (huge) update; the median of steps 0..2 read the update's effect as a poor initialization."""
    before = _acts(**{"a": ("relu", {"dead_fraction": 0.0, "rms": 1.0}), "b": ("relu", {"dead_fraction": 0.0, "rms": 0.27})})
    after = _acts(**{"a": ("relu", {"dead_fraction": 0.0, "rms": 1.0}), "b": ("relu", {"dead_fraction": 0.0, "rms": 352.0})})
    assert R.PoorInitialization().check(history({"ActivationStats": [before, after, after]})) == []
    grown = _acts(**{"a": ("relu", {"dead_fraction": 0.0, "rms": 1.0}), "b": ("relu", {"dead_fraction": 0.0, "rms": 300.0})})
    (found,) = R.PoorInitialization().check(history({"ActivationStats": [grown, after, after]}))
    assert found.layer == "b" and found.evidence["ratio"] == pytest.approx(352.0)


def _band_stats(probabilities: bool, low: float, classes: int = 23) -> dict:
    return {"samples": 32, "outputs": classes, "output_probabilities": probabilities,
            "loss_min": low, "loss_median": low + 0.05, "loss_max": low + 0.1}


def test_outputs_that_are_probabilities_at_every_step_are_a_saturated_output():
    """B11 (a character LSTM with a softmax before CrossEntropyLoss, 23 classes): every per-sample loss stayed
    between the bounds of a cross-entropy over probabilities (2.21..3.21), but the run learned too little to
    come near the floor; DataStats stored output_probabilities: True at every step and no rule read it."""
    lows = [3.03 - 0.002 * k for k in range(30)]  # 3.03 -> 2.97: inside the band, far from its floor 2.21
    flagged = history({"DataStats": [_band_stats(True, low) for low in lows]})
    (found,) = R.SaturatedOutput().check(flagged)
    assert found.evidence["output_probabilities"] is True and found.evidence["since"] == 0
    assert "probabilities" in found.message and "23 classes" in found.message
    assert R.SaturatedOutput().check(history({"DataStats": [_band_stats(False, low) for low in lows]})) == []
    # one step whose outputs were not probabilities (logits): not this finding
    mixed = [_band_stats(k != 5, low) for k, low in enumerate(lows)]
    assert R.SaturatedOutput().check(history({"DataStats": mixed})) == []
    assert R.SaturatedOutput().check(history({"DataStats": [_band_stats(True, low) for low in lows[:29]]})) == []


def test_radam_warm_up_is_not_a_small_learning_rate():
    """H14 (a healthy MoE with RAdam): RAdam's first 5 steps are plain (lr x bias-corrected momentum) steps,
    update ratios 3.7e-5..5.6e-5 over steps 0..4, 10x larger from step 5; named learning-rate-too-small@4."""
    meta = {"param_shapes": [[8, 8], [8, 8]], "param_names": ["a.weight", "b.weight"]}
    grad, rate, norm = [0.075, 0.06], 0.003, [5.0, 4.0]
    plain = [rate * g for g in grad]  # ratio 4.5e-5: below 1e-4
    series = {"UpdateSize": [plain] * 5, "GradNorm": [grad] * 5, "ParamNorm": [norm] * 5,
              "LearningRate": [rate] * 5, "Momentum": [math.nan] * 5, "Loss": [2.3] * 5}
    assert R.UpdateRatioTooSmall().check(history(series, meta)) == []
    # Adam at a tiny rate: about lr per coordinate (lr x sqrt(64) = 8 lr), not lr x gradient: still a finding
    tiny = 3e-6
    adam = {**series, "UpdateSize": [[8 * tiny, 8 * tiny]] * 5, "LearningRate": [tiny] * 5}
    assert [f.layer for f in R.UpdateRatioTooSmall().check(history(adam, meta))] == ["a.weight", "b.weight"]
    # SGD (a momentum is tracked) with lr x gradient steps: a small rate, as before
    sgd = {**series, "Momentum": [0.0] * 5}
    assert [f.layer for f in R.UpdateRatioTooSmall().check(history(sgd, meta))] == ["a.weight", "b.weight"]


def test_an_exploding_start_is_not_read_against_norms_after_a_collapse():
    """B07 (a triplet net at batch 1): norms 6.69, 0, 5.67, 16.1 and then 0.175, 0.03, 0.05 once the embedding
    collapsed (the loss rose to the margin, 0.5); step 0 was read as 'exploding before any update' against a
    median taken after the collapse."""
    collapse = {"GradNorm": [[6.69], [0.0], [5.67], [16.1], [0.175], [0.032], [0.046]],
                "Loss": [0.13, 0.0, 0.157, 0.112, 0.479, 0.501, 0.5]}
    assert not any(f.evidence.get("at_start") for f in R.ExplodingGradient().check(history(collapse)))
    # the same norms while the loss falls (a recurrence that calmed as the run learned): exploding at the start
    falling = {**collapse, "Loss": [1.5, 1.0, 1.5, 0.8, 0.8, 0.75, 0.7]}
    (found,) = R.ExplodingGradient().check(history(falling))
    assert found.evidence["at_start"] is True and found.evidence["norm"] == pytest.approx(6.69)


def test_a_frozen_layer_is_not_a_symptom_of_dead_units_elsewhere():
    """B05 (a GCN whose first layer is not in the optimizer): the unchanged parameters that get a gradient
    (since step 0) were listed as symptoms of dead units in another layer, and frozen-layer was not named."""
    h = history({"UpdateSize": [[0.0, 0.1]] * 3, "GradNorm": [[0.5, 0.2]] * 3})
    (unchanged,) = R.UnchangedParameters().check(h)
    assert unchanged.evidence["at_start"] is True and unchanged.evidence["has_gradient"] is True
    dead = Finding("dead-units", "warning", 2, "55.7% of the units of act2 are dead", layer="act2",
                   evidence={"dead_fraction": 0.557, "since": 0, "at_start": True, "developed": False})
    incidents = group_findings([dead, unchanged])
    assert incidents[0].cause == "frozen-layer" and unchanged in incidents[0].evidence
    # without a gradient (cut off) it stays a symptom, and not from the start when it stopped later
    cut = R.UnchangedParameters().check(history({"UpdateSize": [[0.0, 0.1]] * 3, "GradNorm": [[0.0, 0.2]] * 3}))
    assert cut[0].evidence["at_start"] is False
    later = history({"UpdateSize": [[0.1, 0.1]] + [[0.0, 0.1]] * 3, "GradNorm": [[0.5, 0.2]] * 4})
    assert R.UnchangedParameters().check(later)[0].evidence["at_start"] is False


def test_a_gradient_exactly_zero_at_most_steps_is_said_as_such():
    """The wording bug: "norm 0 (median over steps 4..6), 0x the largest layer's" with evidence zero False
    (norm 3.29 at step 4, exactly 0 at steps 5 and 6)."""
    h = history({"GradNorm": [[1.0, 5.0]] * 4 + [[3.29, 5.0], [0.0, 5.0], [0.0, 5.0]]})
    (found,) = R.VanishingGradient().check(h)
    assert found.layer == "param_0" and found.evidence["zero"] is False
    assert found.message == "the gradient of param_0 is exactly 0 at steps 5, 6 of steps 4..6 (3.29 at step 4): mostly nothing reaches it"
    assert "0x" not in found.message


def test_dead_units_wait_while_the_loss_still_falls():
    """H05/H15 (healthy GCNs): 55-58% of a layer's units off for every graph for the whole run (mean
    aggregation), while the loss fell 1.13 -> 0.44, slowly at first (7.8% by step 30): named dead-units@30."""
    part = _acts(**{"act": ("relu", {"dead_fraction": 0.56, "rms": 0.3})})
    slow = [1.13 * (1 - 0.003 * k) for k in range(40)]  # 0.3% of the start per step: above 0.7x at step 39
    assert R.DeadUnits().check(history({"ActivationStats": [part] * 40, "Loss": slow})) == []
    flat = [1.13 + 0.001 * (k % 2) for k in range(40)]
    (held,) = R.DeadUnits().check(history({"ActivationStats": [part] * 40, "Loss": flat}))
    assert held.evidence["at_start"] and held.evidence["held"]
    # a loss that falls back after a blow-up (above 2x its start) is not a run that learns: no wait
    recovering = [1.13] * 5 + [30.0 * (1 - 0.02 * k) for k in range(35)]  # 30 -> 9.6: falling, after a blow-up
    (found,) = R.DeadUnits().check(history({"ActivationStats": [part] * 40, "Loss": recovering}))
    assert found.layer == "act"
