"""Issue 36: the corpus generator, leave-family-out scoring, and the rules that know the recipe.

- the generator's families and their split (whole families, both halves
  cover every architecture), determinism, and its healthy check;
- each new or changed rule on hand-made histories: fires on its problem,
  silent on the recipe that looks like it (warm-up, a cosine tail, Adam's
  first steps, a 3-step spike, a fresh mini-batch gradient);
- severity: an error only for a sustained divergence, reported again when it
  escalates;
- the Wilson interval against textbook values;
- the CI slice: a handful of generated runs from held-out families, trained
  and diagnosed (the benchmark command runs the full set).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from cockpit_like.corpus_generator import (ARCHITECTURES, FAULTS, GeneratedRun, family_split, generate,
                                           healthy_check, scheduled_rate, train_generated)
from cockpit_like.diagnosis import CAUSES, diagnose, group_findings
from cockpit_like.diagnosis import rules as R
from cockpit_like.diagnosis.engine import Diagnosis
from cockpit_like.diagnosis.findings import severity_rank
from cockpit_like.diagnosis.history import RunHistory
from cockpit_like.diagnosis.scoring import format_generated, score_run, wilson


def history(series: dict[str, list], metadata: dict | None = None) -> RunHistory:
    h = RunHistory(metadata)
    for name, values in series.items():
        for step, value in enumerate(values):
            h.add(step, {name: value})
    return h


def rules_of(findings) -> list[str]:
    return [f.rule for f in findings]


# ---- the generator -----------------------------------------------------------------------------
def test_family_split_holds_out_whole_families_of_every_architecture():
    halves = family_split()
    tuning, held_out = set(halves["tuning"]), set(halves["held-out"])
    assert tuning and held_out and not tuning & held_out
    assert {f[0] for f in tuning} == {f[0] for f in held_out} == set(ARCHITECTURES)
    assert family_split() == halves  # fixed by its seed
    for half, families in halves.items():
        assert {r.family for r in generate(half, 60, seed=3)} <= {"/".join(f) for f in families}


def test_generate_is_deterministic_and_labels_every_fault_with_a_cause():
    first, second = generate("tuning", 40, seed=1), generate("tuning", 40, seed=1)
    assert [r.name for r in first] == [r.name for r in second]
    assert generate("tuning", 20, seed=1) == first[:20]  # a longer draw extends a shorter one
    assert {FAULTS[f][0] for f in FAULTS} <= set(CAUSES)
    faults = {r.fault for r in generate("held-out", 300, seed=0)}
    assert None in faults and len(faults - {None}) >= 12
    with pytest.raises(ValueError, match="unknown half"):
        generate("validation", 3)


def test_scheduled_rates():
    run = GeneratedRun("x", "mlp", "sgd", "warmup-cosine", "digits-ce", 1.0, 16, seed=0, steps=80)
    assert scheduled_rate(run, 0) == pytest.approx(0.1) and scheduled_rate(run, 9) == pytest.approx(1.0)
    assert scheduled_rate(run, 79) < 0.01
    stepped = GeneratedRun("x", "mlp", "sgd", "step", "digits-ce", 1.0, 16, seed=0, steps=80)
    assert [scheduled_rate(stepped, s) for s in (39, 40, 60)] == pytest.approx([1.0, 0.1, 0.01])
    jump = GeneratedRun("x", "mlp", "sgd", "constant", "digits-ce", 0.1, 16, seed=0, onset=30,
                        fault="lr-jump", options={"lr_jump": 100.0})
    assert scheduled_rate(jump, 29) == pytest.approx(0.1) and scheduled_rate(jump, 30) == pytest.approx(10.0)


def test_healthy_check_reads_the_loss_only():
    run = GeneratedRun("x", "mlp", "sgd", "constant", "digits-ce", 0.1, 16, seed=0)
    assert healthy_check(run, [2.3] * 3 + [1.0] * 20)["passed"]
    assert not healthy_check(run, [2.3] * 23)["passed"]
    assert not healthy_check(run, [2.3] * 3 + [math.nan] + [0.5] * 19)["passed"]


# ---- rules that know the recipe ----------------------------------------------------------------
_SHAPES = {"param_shapes": [[4, 4]], "param_names": ["w"]}


def test_update_ratio_too_small_leaves_scheduled_small_rates_alone():
    small = {"UpdateSize": [[1e-5]] * 12, "ParamNorm": [[1.0]] * 12, "Loss": [2.0] * 12}
    assert rules_of(R.UpdateRatioTooSmall().check(history({**small, "LearningRate": [0.1] * 12}, _SHAPES))) == [
        "update-ratio-too-small"]
    cosine_tail = [0.1 * 0.5 * (1 + math.cos(math.pi * s / 12)) for s in range(12)]  # ends far below the peak
    assert R.UpdateRatioTooSmall().check(history({**small, "LearningRate": cosine_tail}, _SHAPES)) == []
    warmup = [0.01 * (s + 1) for s in range(12)]  # rising over the window
    assert R.UpdateRatioTooSmall().check(history({**small, "LearningRate": warmup}, _SHAPES)) == []
    converged = {**small, "Loss": [2.0] * 6 + [0.2] * 6, "LearningRate": [0.1] * 12}  # the run learned
    assert R.UpdateRatioTooSmall().check(history(converged, _SHAPES)) == []


def test_update_ratio_too_large_leaves_adaptive_first_steps_alone():
    first_steps = [[0.5]] * 6 + [[0.05]] * 14  # RMSprop's first updates are large by design
    for end in (7, 20):  # while the large steps are in the window, and after
        series = {"UpdateSize": first_steps[:end], "ParamNorm": [[1.0]] * end, "Loss": [2.0] * end}
        adaptive = history({**series, "Momentum": [math.nan] * end}, _SHAPES)
        assert R.UpdateRatioTooLarge(spike=0.4).check(adaptive) == []
    series = {"UpdateSize": first_steps[:7], "ParamNorm": [[1.0]] * 7, "Loss": [2.0] * 7}
    heavy_ball = history({**series, "Momentum": [0.9] * 7}, _SHAPES)  # not adaptive: the spike is a finding
    assert rules_of(R.UpdateRatioTooLarge(spike=0.4).check(heavy_ball)) == ["update-ratio-too-large"]
    blow_up = history({"UpdateSize": [[2.0]] * 20, "ParamNorm": [[1.0]] * 20, "Loss": [2.0] * 20,
                       "Momentum": [math.nan] * 20}, _SHAPES)
    assert rules_of(R.UpdateRatioTooLarge().check(blow_up)) == ["update-ratio-too-large"]


def test_learning_rate_jump_but_not_warmup_or_one_cycle():
    warmup = [0.001 * (s + 1) for s in range(10)] + [0.01] * 10
    assert R.LearningRateJump().check(history({"LearningRate": warmup})) == []
    one_cycle = [0.04 + 0.96 * s / 24 for s in range(24)] + [1.0 - s / 20 for s in range(20)]
    assert R.LearningRateJump().check(history({"LearningRate": one_cycle})) == []
    (found,) = R.LearningRateJump().check(history({"LearningRate": [0.01] * 30 + [1.0] * 3}))
    assert found.evidence["step"] == 30 and found.evidence["since"] == 30
    assert R.LearningRateJump().check(history({"LearningRate": [0.01] * 30 + [1.0] * 3 + [0.01]})) == []


def test_weights_shrinking():
    meta = {"param_shapes": [[4, 4], [4]], "param_names": ["w", "b"]}
    shrinking = [[1.0 * 0.95**s, 1.0] for s in range(12)]
    (found,) = R.WeightsShrinking().check(history({"ParamNorm": shrinking}, meta))
    assert found.evidence["ratio"] == pytest.approx(0.95**11)
    growing = [[1.0 + 0.01 * s, 0.1] for s in range(12)]
    assert R.WeightsShrinking().check(history({"ParamNorm": growing}, meta)) == []


def test_gradients_accumulate_tells_a_sum_from_fresh_gradients():
    rng = np.random.default_rng(0)
    fresh = [rng.normal(size=20) + 1.0 for _ in range(30)]
    summed = np.cumsum(fresh, axis=0)
    norms = lambda rows: [[float(np.linalg.norm(r))] for r in rows]  # noqa: E731
    (found,) = R.GradientsAccumulate().check(history({"GradNorm": norms(summed)}))
    assert found.evidence["relative_change"] < 0.1
    assert R.GradientsAccumulate().check(history({"GradNorm": norms(fresh)})) == []
    # a gradient that grows but jumps from batch to batch (a healthy run leaving its plateau)
    growing = [np.linalg.norm(r) * (1 + s / 5) for s, r in enumerate(fresh)]
    assert R.GradientsAccumulate().check(history({"GradNorm": [[g] for g in growing]})) == []


def test_gradients_accumulate_defers_to_the_self_check_where_it_ran():
    """Where the run's metadata says each tracked step checked p.grad for stale sums (``stale_gradients_checked``),
    a forgotten zero_grad is the self-check's conclusive finding; the statistical rule stays silent there (a smooth
    rise is a healthy run's) and runs where the check did not (older logs, self-checks off, sharded gradients)."""
    rng = np.random.default_rng(0)
    summed = np.cumsum([rng.normal(size=20) + 1.0 for _ in range(30)], axis=0)
    series = {"GradNorm": [[float(np.linalg.norm(r))] for r in summed]}
    assert R.GradientsAccumulate().check(history(series, {"stale_gradients_checked": True})) == []
    assert rules_of(R.GradientsAccumulate().check(history(series, {"stale_gradients_checked": False}))) == [
        "gradients-accumulate"]


def test_gradients_accumulate_leaves_out_parameters_the_optimizer_does_not_move():
    """A layer left out of the optimizer keeps its gradients (zero_grad() clears only the optimizer's):
    they add up, harmlessly, since no step uses them; the layers that train get fresh gradients."""
    rng = np.random.default_rng(1)
    fresh = [rng.normal(size=20) + 1.0 for _ in range(30)]
    summed = np.cumsum([rng.normal(size=20) + 1.0 for _ in range(30)], axis=0)
    grads = [[float(np.linalg.norm(f)), float(np.linalg.norm(a))] for f, a in zip(fresh, summed)]
    frozen = [[0.01, 0.0]] * 30  # the second parameter never moves
    assert R.GradientsAccumulate().check(history({"GradNorm": grads, "UpdateSize": frozen})) == []
    assert R.GradientsAccumulate().check(history({"GradNorm": grads})) != []  # without UpdateSize: the total
    moving = [[0.01, 0.01]] * 30  # both move: the summed one is applied at every step
    (found,) = R.GradientsAccumulate().check(history({"GradNorm": grads, "UpdateSize": moving}))
    assert found.evidence["norm"] == pytest.approx(math.hypot(*grads[-1]))
    # the accumulating parameter is the one that moves: found, on its norm alone
    swapped = [[a, f] for f, a in grads]
    (found,) = R.GradientsAccumulate().check(history({"GradNorm": swapped, "UpdateSize": frozen}))
    assert found.evidence["norm"] == pytest.approx(grads[-1][1]) and found.evidence["first"] == pytest.approx(grads[0][1])


def test_exploding_gradient_leaves_out_parameters_the_optimizer_does_not_move():
    fresh = [[1.0 + 0.1 * math.sin(s), 0.5 * (s + 1)] for s in range(120)]  # the second one adds up, unused
    frozen = [[0.01, 0.0]] * 120
    assert R.ExplodingGradient().check(history({"GradNorm": fresh, "UpdateSize": frozen})) == []
    assert rules_of(R.ExplodingGradient().check(history({"GradNorm": fresh}))) == ["exploding-gradient"]
    moving = [[0.01, 0.01]] * 120
    assert rules_of(R.ExplodingGradient().check(history({"GradNorm": fresh, "UpdateSize": moving}))) == [
        "exploding-gradient"]
    # the parameter that moves explodes: found (on its own norm)
    grows = [[1.0 if s < 119 else 80.0, 0.5] for s in range(120)]
    (found,) = R.ExplodingGradient().check(history({"GradNorm": grows, "UpdateSize": frozen}))
    assert found.evidence["norm"] == pytest.approx(80.0)


def test_saturated_output():
    squashed = [2.3026 + 0.0005 * math.sin(s) for s in range(30)]
    (found,) = R.SaturatedOutput().check(history({"Loss": squashed}))
    assert found.evidence["relative_noise"] < 0.0015
    healthy_start = [2.30 + 0.03 * math.sin(3 * s) for s in range(30)]
    assert R.SaturatedOutput().check(history({"Loss": healthy_start})) == []


def test_exploding_recurrence_is_not_unnormalized_inputs():
    recurrent = {"act": {"kind": "relu", "samples": 320, "rms": 800.0}}  # 20 calls per sample
    h = history({"ActivationStats": [recurrent] * 3, "BatchSize": [16] * 3})
    assert rules_of(R.ExplodingRecurrence().check(h)) == ["exploding-recurrence"]
    for share, found in ((0.21, ["exploding-recurrence"]), (0.03, [])):  # tanh: saturated outputs at the start
        tanh = {"act": {"kind": "tanh", "samples": 320, "rms": 0.8, "saturated_fraction": share}}
        h_tanh = history({"ActivationStats": [tanh] * 3, "BatchSize": [16] * 3})
        assert rules_of(R.ExplodingRecurrence().check(h_tanh)) == found
    once = {"act": {"kind": "tanh", "samples": 16, "rms": 0.8, "saturated_fraction": 0.5}}  # once per sample
    assert R.ExplodingRecurrence().check(history({"ActivationStats": [once] * 3, "BatchSize": [16] * 3})) == []
    assert R.LargeInputScale().check(h) == []
    feed_forward = {"act": {"kind": "relu", "samples": 16, "rms": 800.0}}
    h = history({"ActivationStats": [feed_forward] * 3, "BatchSize": [16] * 3})
    assert R.ExplodingRecurrence().check(h) == [] and rules_of(R.LargeInputScale().check(h)) == ["large-input-scale"]


def test_causes_of_the_new_rules():
    from cockpit_like.diagnosis.causes import cause_of
    from cockpit_like.diagnosis.findings import Finding

    def f(rule, **evidence):
        return Finding(rule, "warning", 10, "", evidence=evidence)

    assert cause_of(f("gradients-accumulate")) == "gradients-accumulate"
    assert cause_of(f("saturated-output")) == "saturated-output"
    assert cause_of(f("weights-shrinking")) == "weight-decay-too-large"
    assert cause_of(f("exploding-recurrence")) == "exploding-gradient"
    assert cause_of(f("learning-rate-jump")) == "learning-rate-too-large"
    jump = f("loss-jump", rate_ratio=1.0, since=10)
    assert cause_of(jump, [jump]) == "labels-do-not-match"  # nothing in the recipe changed: the data did
    raised = f("learning-rate-jump", since=9)
    assert cause_of(jump, [raised, jump]) == "learning-rate-too-large"
    assert cause_of(f("loss-jump", rate_ratio=100.0, since=10)) == "learning-rate-too-large"
    # a forgotten zero_grad makes every step larger: with a gradients-accumulate finding in the run, the
    # large updates are its symptoms (unless the schedule raised the rate)
    large = f("update-ratio-too-large", since=8)
    summed = f("gradients-accumulate", since=12)
    assert cause_of(large) == "learning-rate-too-large" and cause_of(large, [large, summed]) == "gradients-accumulate"
    assert cause_of(large, [large, summed, raised]) == "learning-rate-too-large"
    # a gradient that vanishes from the first step is the initialization; one that vanishes later is not
    assert cause_of(f("vanishing-gradient", at_start=True)) == "poor-initialization"
    assert cause_of(f("vanishing-gradient", at_start=False)) == "learning-rate-too-large"


# ---- round 4: rules that read what the model was fed (DataStats) --------------------------------
def _fed(model, batches, losses=True):
    """Train ``model`` on ``batches`` (``(x, y)`` pairs) for one step each under a cockpit tracking the
    rules' quantities; return ``(steps, metadata)``."""
    from cockpit_like import Cockpit
    from cockpit_like.corpus import quantities_for_rules

    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    quantities = [q for q in quantities_for_rules() if type(q).__name__ != "Alpha"]
    cockpit = Cockpit(list(model.parameters()), quantities=quantities, model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            individual = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            loss = individual.mean()
            info = {"batch_size": len(x), "loss": loss, "optimizer": optimizer}
            if losses:
                info["individual_losses"] = individual
            with cockpit(step, info=info):
                loss.backward()
            optimizer.step()
    return cockpit.get_output(), cockpit.metadata()


def test_data_stats_records_the_raw_input_the_output_and_the_per_sample_losses():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    x, y = 3.0 * torch.randn(32, 8), torch.randint(0, 5, (32,))
    steps, _ = _fed(model, [(x, y), (x[:1].expand(32, 8).clone(), y), (x[:1], y[:1])])
    first, constant, single = (steps[s]["DataStats"] for s in (0, 1, 2))
    assert first["input_rms"] == pytest.approx(float(x.pow(2).mean().sqrt()), rel=1e-5)
    assert 0.9 < first["input_spread"] <= 1.0 and first["outputs"] == 5 and not first["input_integer"]
    assert first["loss_min"] <= first["loss_median"] <= first["loss_max"]
    assert not first["output_probabilities"]
    assert constant["input_spread"] == 0.0  # every row the same input
    assert math.isnan(single["input_spread"]) and single["samples"] == 1  # one row has no spread
    tokens = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(), torch.nn.Linear(12, 10))
    steps, _ = _fed(tokens, [(torch.randint(0, 10, (16, 3)), torch.randint(0, 10, (16,)))], losses=False)
    value = steps[0]["DataStats"]
    assert value["input_integer"] and math.isnan(value["input_rms"]) and "loss_min" not in value


def test_large_input_scale_reads_the_raw_input_behind_a_norm_layer():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    batches = [(100.0 * torch.randn(16, 8), torch.randint(0, 3, (16,))) for _ in range(3)]
    steps, metadata = _fed(model, batches)
    (found,) = [f for f in diagnose(steps, metadata).findings if f.rule == "large-input-scale"]
    assert found.evidence["input_rms"] > 50 and found.step == 0
    assert group_findings([found])[0].cause == "unnormalized-inputs"
    # the activations alone do not show it: the LayerNorm brings the first ReLU's outputs to unit scale
    hidden = {s: {k: v for k, v in value.items() if k != "DataStats"} for s, value in steps.items()}
    assert [f for f in diagnose(hidden, metadata).findings if f.rule == "large-input-scale"] == []
    normal = [(torch.randn(16, 8), y) for _, y in batches]
    steps, metadata = _fed(model, normal)
    assert [f for f in diagnose(steps, metadata).findings if f.rule == "large-input-scale"] == []


def _data(spread=0.5, samples=16, outputs=10, **more):
    return {"samples": samples, "input_spread": spread, "input_rms": 1.0, "input_integer": False,
            "outputs": outputs, **more}


def test_constant_inputs_mid_run():
    varied, constant = [_data()] * 10, [_data(spread=0.0)] * 3
    (found,) = R.ConstantInputs().check(history({"DataStats": varied + constant}))
    assert found.evidence["since"] == 10 and found.step == 12
    assert R.ConstantInputs().check(history({"DataStats": varied + constant[:1]})) == []  # one step: wait
    assert R.ConstantInputs().check(history({"DataStats": varied})) == []
    single = [_data(spread=math.nan, samples=1)] * 3  # batches of one row: no spread to judge
    assert R.ConstantInputs().check(history({"DataStats": varied + single})) == []
    rule = R.ConstantInputs()  # checked step by step (the incremental state), as the engine does
    h = RunHistory()
    for step, value in enumerate(varied + constant + varied[:2] + constant):
        h.add(step, {"DataStats": value})
        found = rule.check(h)
    assert found[0].evidence["since"] == 15  # the second constant stretch


def test_constant_inputs_explain_what_follows_them():
    from cockpit_like.diagnosis.causes import cause_of
    from cockpit_like.diagnosis.findings import Finding

    constant = Finding("constant-inputs", "warning", 31, "", evidence={"since": 30})
    blow_up = Finding("exploding-gradient", "warning", 33, "", evidence={"since": 32, "at_start": False})
    assert cause_of(blow_up, [blow_up]) == "learning-rate-too-large"
    assert cause_of(blow_up, [constant, blow_up]) == "labels-do-not-match"
    earlier = Finding("update-ratio-too-large", "warning", 20, "", evidence={"since": 18})
    assert cause_of(earlier, [constant, earlier]) == "learning-rate-too-large"  # it came before
    (incident,) = group_findings([constant, blow_up])
    assert incident.cause == "labels-do-not-match"
    # a windowed finding (dead units over 3 steps) whose window reaches back before the first constant batch
    dead = Finding("dead-units", "warning", 32, "", evidence={"since": 27, "at_start": False, "developed": True})
    assert cause_of(dead, [constant, dead]) == "learning-rate-too-large"  # 3 steps before: more than its window
    dead = Finding("dead-units", "warning", 31, "", evidence={"since": 29, "at_start": False, "developed": True})
    assert cause_of(dead, [constant, dead]) == "labels-do-not-match"
    early = Finding("exploding-gradient", "warning", 29, "", evidence={"since": 29, "at_start": False})
    assert cause_of(early, [constant, early]) == "learning-rate-too-large"  # one step, before the data changed


def test_a_loss_held_at_chance_by_a_blow_up_is_its_symptom():
    """Updates far too large from the first step keep a loss at chance (the units die): one incident, the
    learning rate's; alone, a loss at chance is the data's."""
    from cockpit_like.diagnosis.findings import Finding

    chance = Finding("loss-at-chance", "warning", 53, "", evidence={"since": 0})
    large = Finding("update-ratio-too-large", "warning", 1, "", evidence={"since": 1})
    assert [(i.cause, len(i.symptoms)) for i in group_findings([chance, large])] == [("learning-rate-too-large", 1)]
    assert [i.cause for i in group_findings([chance])] == ["labels-do-not-match"]


def test_a_batch_of_one_explains_the_blow_up_it_makes():
    from cockpit_like.diagnosis.causes import cause_of
    from cockpit_like.diagnosis.findings import Finding

    small = Finding("small-batch", "warning", 20, "", evidence={"batch_size": 1.0})
    diverging = Finding("loss-diverging", "warning", 27, "", evidence={"since": 19, "from_first": True})
    assert cause_of(diverging, [diverging]) == "learning-rate-too-large"
    assert cause_of(diverging, [small, diverging]) == "batch-too-small"
    nan_grad = Finding("exploding-gradient", "error", 30, "", evidence={"since": 30})
    assert cause_of(nan_grad, [small, nan_grad]) == "nonfinite-operation"  # a non-finite gradient: as before
    incidents = group_findings([diverging, small])
    assert [i.cause for i in incidents] == ["batch-too-small"]


def _losses(values, outputs=10, integer=False, ratio=0.01):
    return {"Loss": values, "DataStats": [_data(outputs=outputs, input_integer=integer)] * len(values),
            "UpdateSize": [[ratio]] * len(values), "ParamNorm": [[1.0]] * len(values)}


def test_loss_at_chance():
    chance = math.log(10)
    flat = [chance * (1 + 0.01 * math.sin(s)) for s in range(60)]
    (found,) = R.LossAtChance().check(history(_losses(flat), _SHAPES))
    assert found.evidence["since"] == 0 and found.evidence["classes"] == 10
    assert group_findings([found])[0].cause == "labels-do-not-match"
    learns = flat[:30] + [chance * 0.7] * 30  # at chance for 30 steps, then it learns
    assert R.LossAtChance().check(history(_losses(learns), _SHAPES)) == []
    slow = [chance * (1.015 - 0.0005 * s) for s in range(60)]  # within 2% of chance, but falling: a slow start
    assert R.LossAtChance().check(history(_losses(slow), _SHAPES)) == []
    assert R.LossAtChance().check(history(_losses(flat[:45]), _SHAPES)) == []  # not long enough yet
    # the parameters barely move: a learning rate too small, not the data
    assert R.LossAtChance().check(history(_losses(flat, ratio=1e-5), _SHAPES)) == []
    # a model fed token ids gets longer (a language model sits near log V before it learns)
    assert R.LossAtChance().check(history(_losses(flat, integer=True), _SHAPES)) == []
    tokens = [chance * (1 + 0.01 * math.sin(s)) for s in range(75)]
    assert rules_of(R.LossAtChance().check(history(_losses(tokens, integer=True), _SHAPES))) == ["loss-at-chance"]
    # a wider band (4%) held longer (45 steps): two classes whose loss wanders around log 2 (shuffled labels)
    wide = [chance * (1.03 + 0.005 * math.sin(s)) for s in range(60)]  # 3% above: outside the 2% band
    (found,) = R.LossAtChance().check(history(_losses(wide), _SHAPES))
    assert "within 4% of log(10)" in found.message
    assert R.LossAtChance().check(history(_losses(wide[:50]), _SHAPES)) == []  # 41 medians: not 45 yet
    assert R.LossAtChance(wide_margin=0.02).check(history(_losses(wide), _SHAPES)) == []
    assert R.LossAtChance().check(history(_losses(wide + wide[:15], integer=True), _SHAPES)) == []  # tokens: 2% only
    off = [chance * (1 + 0.05 + 0.01 * math.sin(s)) for s in range(60)]  # 5% above chance
    assert R.LossAtChance().check(history(_losses(off), _SHAPES)) == []
    regression = history({**_losses(flat), "DataStats": [_data(outputs=1)] * 60}, _SHAPES)
    assert R.LossAtChance().check(regression) == []  # one output: no classes


def test_saturated_output_from_the_band_of_a_cross_entropy_over_probabilities():
    floor = math.log(math.e + 1) - 1  # two classes: the losses lie in [0.313, 1.313]
    pressed = [_data(outputs=2, loss_min=floor * 1.01, loss_median=0.5, loss_max=1.0)] * 35
    varied = [0.5 + 0.05 * math.sin(3 * s) for s in range(35)]  # (not the quiet loss of the first test)
    (found,) = R.SaturatedOutput().check(history({"Loss": varied, "DataStats": pressed}))
    assert found.evidence["classes"] == 2 and found.evidence["since"] == 0
    # a run that learns passes below the floor (once is enough)
    passed = pressed[:20] + [_data(outputs=2, loss_min=0.2, loss_median=0.5, loss_max=1.0)] + pressed[:14]
    assert R.SaturatedOutput().check(history({"Loss": varied, "DataStats": passed})) == []
    # ... and one at chance stays well above it
    chance = [_data(outputs=2, loss_min=0.6, loss_median=0.69, loss_max=0.8)] * 35
    assert R.SaturatedOutput().check(history({"Loss": [0.69 + 0.01 * math.sin(s) for s in range(35)],
                                              "DataStats": chance})) == []
    # ten classes: the band lies around chance; staying in it for 50 steps is enough
    floor10 = math.log(math.e + 9) - 1
    inside = [_data(loss_min=floor10 * 1.2, loss_median=2.0, loss_max=2.4)]
    noisy = [2.0 + 0.05 * math.sin(3 * s) for s in range(60)]
    assert R.SaturatedOutput().check(history({"Loss": noisy[:45], "DataStats": inside * 45})) == []
    assert rules_of(R.SaturatedOutput().check(history({"Loss": noisy, "DataStats": inside * 60}))) == [
        "saturated-output"]
    above = [_data(loss_min=floor10 * 1.2, loss_median=2.0, loss_max=2.6)]  # above the ceiling: logits
    assert R.SaturatedOutput().check(history({"Loss": noisy, "DataStats": above * 60})) == []


def test_round_four_thresholds():
    # a transformer's position table (0.02 x N(0, 1) at the start) moves by 0.3-0.4 of its norm per step
    # in healthy runs: not a finding any more at the default (0.5); a window median of 0.6 still is
    for ratio, expected in ((0.41, []), (0.6, ["update-ratio-too-large"])):
        h = history({"UpdateSize": [[ratio]] * 8, "ParamNorm": [[1.0]] * 8, "Loss": [2.0] * 8,
                     "Momentum": [0.9] * 8}, _SHAPES)
        assert rules_of(R.UpdateRatioTooLarge().check(h)) == expected
    # units alive at the first step that die early: reported after 30 steps (Adagrad CNNs lose half their
    # units in the first 10 steps and train well), and only while the loss has not fallen
    alive, dead = {"1": {"kind": "relu", "dead_fraction": 0.0, "samples": 16}}, {
        "1": {"kind": "relu", "dead_fraction": 0.8, "samples": 16}}
    for count, expected in ((25, []), (35, ["dead-units"])):
        h = history({"ActivationStats": [alive] * 5 + [dead] * (count - 5), "Loss": [2.3] * count})
        assert rules_of(R.DeadUnits().check(h)) == expected
    h = history({"ActivationStats": [alive] * 5 + [dead] * 30, "Loss": [2.3] * 5 + [1.0] * 30})
    assert R.DeadUnits().check(h) == []  # the run learns


# ---- severity ---------------------------------------------------------------------------------------
def test_a_spike_is_a_warning_and_a_sustained_divergence_an_error():
    spike = [2.0] * 10 + [0.5] * 20 + [3.0] * 3 + [0.5] * 10  # a 3-step spike after a step decay
    found = [f for f in diagnose({s: {"Loss": v} for s, v in enumerate(spike)}).findings if f.rule == "loss-diverging"]
    assert found and all(f.severity == "warning" for f in found)
    sustained = [2.0] * 10 + [0.5] * 20 + [3.0] * 12
    found = [f for f in diagnose({s: {"Loss": v} for s, v in enumerate(sustained)}).findings
             if f.rule == "loss-diverging"]
    assert [f.severity for f in found] == ["warning", "error"]  # reported again when it escalates
    assert found[1].evidence["sustained"] and found[1].evidence["strength"] == "conclusive"


def test_findings_carry_their_strength():
    diagnosis = Diagnosis()
    for step, loss in enumerate([2.0] * 10 + [0.5] * 20 + [3.0] * 12):
        diagnosis.update(step, {"Loss": loss, "LearningRate": 0.1})
        diagnosis.run()
    assert diagnosis.reported and all(f.evidence.get("strength") in R.STRENGTHS for f in diagnosis.reported)


# ---- scoring ----------------------------------------------------------------------------------------
def test_wilson_interval_textbook_values():
    low, high = wilson(0, 20)
    assert low == 0.0 and high == pytest.approx(0.1611, abs=1e-3)  # the "rule of three"-like bound for n = 20
    low, high = wilson(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-3)
    assert wilson(0, 0) is None


def test_format_generated_reports_rates_with_intervals():
    healthy = score_run(None, 0, [])
    healthy.update(fault=None)
    problem = score_run("frozen-layer", 0, [])
    problem.update(fault="frozen")
    table = format_generated({"tuning": [healthy, problem], "held-out": [healthy]}, {"tuning": 1, "held-out": 0})
    assert "| healthy runs with an alarm (95% interval) | 0/1 = 0.0% [0.0, 79.3] | 0/1 = 0.0% [0.0, 79.3] |" in table
    assert "| frozen | frozen-layer | 1 / 0 | 0 / 0 |" in table


# ---- the CI slice: a handful of generated runs ------------------------------------------------------------
def _candidates(half: str, fault: str | None) -> list[GeneratedRun]:
    """``half``'s draws with ``fault`` (None: healthy) on the fast architectures, in draw order."""
    return [run for run in generate(half, 400, seed=7) if run.arch in ("mlp", "cnn", "rnn") and run.fault == fault]


@pytest.mark.parametrize("fault", [None, "lr-jump", "weight-decay", "frozen", "zero-grad"])
def test_ci_slice_of_held_out_families(fault):
    """One held-out run per fault (and a healthy one that passes its own loss check: a healthy draw
    that does not train is left out of the corpus too): the healthy one raises nothing at warning or
    above; a broken one is found and its cause is named first. The full figures come from
    ``python benchmarks/diagnosis_corpus.py --generated ...``."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in _candidates("held-out", fault)[:3]:
            trained = train_generated(run)
            if fault is not None or trained["healthy_check"]["passed"]:
                break
    if fault is None:
        assert trained["healthy_check"]["passed"], "none of the first three healthy draws trained"
    report = diagnose(trained["steps"], trained["metadata"])
    loud = [i for i in group_findings(report.findings) if severity_rank(i.severity) >= 1]
    if fault is None:
        assert loud == [], [f.message for i in loud for f in i.findings]
    else:
        assert loud and loud[0].cause == run.problem, (run.name, [i.cause for i in loud])
        assert loud[0].step >= run.onset - 1


def test_benchmark_command_regenerates_the_generated_table(tmp_path, capsys):
    """``benchmarks/diagnosis_corpus.py --generated N --held-out M`` trains, scores and writes the table
    between the doc's markers (here with two runs per half into a copy of the markers)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnosis_corpus.py"
    spec = importlib.util.spec_from_file_location("_diagnosis_corpus_generated", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.set_num_threads(1)
    figures = tmp_path / "figures.json"
    halves = script.main(["--generated", "2", "--held-out", "3", "--seed", "5", "--cache", str(tmp_path / "runs.pkl"),
                          "--json", str(figures)])
    assert set(halves) == {"tuning", "held-out"}
    table = capsys.readouterr().out
    assert "| figure | tuning | held-out |" in table and "healthy runs with an alarm (95% interval)" in table
    saved = json.loads(figures.read_text())
    left = {"tuning": 2, "held-out": 3}
    for half, runs in saved.items():
        assert len(runs) <= left[half] and all(r["family"].split("/")[0] in ARCHITECTURES for r in runs)
    doc = tmp_path / "doc.md"
    doc.write_text(f"a\n{script.GENERATED_BEGIN}\nold\n{script.GENERATED_END}\nb\n")
    assert script.update_doc("new", doc, script.GENERATED_BEGIN, script.GENERATED_END)
    assert doc.read_text() == f"a\n{script.GENERATED_BEGIN}\nnew\n{script.GENERATED_END}\nb\n"
