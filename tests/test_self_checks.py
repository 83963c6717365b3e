"""Issue 34: the self-checks of a tracked step, and mutations of the per-sample path that they must catch."""

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit, read_log
from cockpit_like.backends.per_sample import PerSampleReducer
from cockpit_like.backends.step import StepExecution
from cockpit_like.checks import GradientProbe, check_losses_mean
from cockpit_like.checks.probe import probe_directions, project
from cockpit_like.quantities import GradNorm, InnerTest, NormTest
from cockpit_like.utils.schedules import linear

ROWS = 8


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def data(step, rows=ROWS):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 5, generator=generator, dtype=torch.float64), torch.randint(0, 3, (rows,), generator=generator)


def quantities():
    return [GradNorm(linear(1)), NormTest(linear(1)), InnerTest(linear(1))]


def train(factor=1.0, steps=2, micro_batches=None, stream_to=None, two_losses=False, summed=False):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / factor)  # the same run whatever the factor
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model, stream_to=stream_to)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = data(step)
        parts = [(x, y)] if micro_batches is None else list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
        for xs, ys in parts:
            outputs = model(xs)
            losses = nn.functional.cross_entropy(outputs, ys, reduction="none")
            if summed:  # the reference of two_losses: the two losses' sum backpropagated once
                losses = losses + outputs.square().mean(1)
            loss = losses.mean()
            info = {"batch_size": len(ys), "individual_losses": losses, "loss": loss, "optimizer": optimizer}
            if two_losses:
                info["individual_losses"] = losses + outputs.square().mean(1)
                info["loss"] = info["individual_losses"].mean()
            with cockpit(step, info=info):
                if two_losses:
                    loss.backward(retain_graph=True)
                    outputs.square().mean().backward()
                else:
                    (loss * factor / len(parts)).backward()
        optimizer.step()
    return cockpit


def test_a_plain_step_is_valid_and_says_what_it_checked():
    cockpit = train()
    assert "checks" not in cockpit.get_output()[0]  # nothing to say: the output stays as it was
    checks = cockpit.checks[0]
    assert checks["valid"] and checks["failed"] == [] and checks["backward_passes"] == 1
    assert checks["loss_factor"] == 1.0 and checks["gradient"]["layers"] == 4
    assert checks["gradient"]["worst"] < checks["gradient"]["tolerance"] == 1e-6


def test_an_undeclared_loss_factor_is_seen_and_used():
    plain, scaled = train().get_output(), train(factor=1024.0).get_output()
    for step in plain:
        assert scaled[step]["checks"]["loss_factor"] == 1024.0 and scaled[step]["checks"]["valid"]
        for name in ("GradNorm", "NormTest", "InnerTest"):
            assert scaled[step][name] == pytest.approx(plain[step][name], rel=1e-10)


def test_mutation_ignoring_the_loss_factor_fails_the_gradient_check(monkeypatch):
    """Break the per-sample path: the rows keep the factor the hook saw. The check must fail the step."""
    plain = train().get_output()
    monkeypatch.setattr(StepExecution, "observe_loss_factor", lambda self, factor: None)
    output = train(factor=1024.0).get_output()
    for step, values in output.items():
        assert not values["checks"]["valid"]
        assert [f["check"] for f in values["checks"]["failed"]] == ["gradient"]
        assert "NormTest" not in values and "InnerTest" not in values  # no number rather than a wrong one
        # p.grad is unscaled by the factor the hook saw (the step's scale, not the rows'): GradNorm, kept where only
        # the gradient check failed, is the plain run's (tests/test_row_check_keeps.py)
        assert values["GradNorm"] == pytest.approx(plain[step]["GradNorm"], rel=1e-9)


def test_mutation_dropping_the_second_backward_pass_rows_fails_the_gradient_check(monkeypatch):
    """Break the per-sample path: the second micro-batch's rows reach the statistics as zeros."""
    made = []
    original = PerSampleReducer.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)
        if len(made) % 2 == 0:  # every second backward pass of a step
            self._scaled = lambda tensor: torch.zeros_like(tensor, dtype=torch.float64 if tensor.dtype == torch.float64 else tensor.dtype)

    monkeypatch.setattr(PerSampleReducer, "__init__", init)
    model = mlp()
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    x, y = data(0)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        outputs = model(xs)
        losses = nn.functional.cross_entropy(outputs, ys, reduction="none")
        loss = losses.mean()
        info = {"batch_size": len(ys), "individual_losses": losses, "loss": loss, "micro_batches": 2}
        with cockpit(0, info=info):
            (loss / 2).backward()
    checks = cockpit.get_output()[0]["checks"]
    assert not checks["valid"] and checks["failed"][0]["check"] == "gradient"
    assert "NormTest" not in cockpit.get_output()[0]


def test_two_losses_in_one_block_first_invalid_then_summed_exactly():
    """l1.backward(retain_graph=True); l2.backward(): the first such step stores no numbers and says why; the
    cockpit learns it and sums each layer's output gradients over the block's passes from then on."""
    output = train(two_losses=True, steps=3).get_output()
    reference = train(summed=True, steps=3).get_output()
    failed = output[0]["checks"]["failed"]
    assert [f["check"] for f in failed] == ["backward_passes", "gradient"] and "retain_graph" in failed[0]["reason"]
    assert "NormTest" not in output[0] and "GradNorm" not in output[0]  # an invalid step stores no numbers
    for step in (1, 2):
        assert "checks" not in output[step] or output[step]["checks"]["valid"]
        for name in ("GradNorm", "NormTest", "InnerTest"):
            assert output[step][name] == pytest.approx(reference[step][name], rel=1e-10)


@pytest.mark.parametrize("passes", [2, 3])
def test_the_step_that_fails_for_several_passes_in_one_block_counts_them(passes):
    """Its record said backward_passes: 1 beside the failed check that several passes ran."""
    model = mlp()
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    x, y = data(0)
    outputs = model(x)
    losses = nn.functional.cross_entropy(outputs, y, reduction="none")
    with cockpit(0, info={"batch_size": len(y), "individual_losses": losses, "loss": losses.mean()}):
        for k in range(passes):
            (losses.mean() / passes).backward(retain_graph=k < passes - 1)
    checks = cockpit.checks[0]
    assert "backward_passes" in [f["check"] for f in checks["failed"]]
    assert checks["backward_passes"] == passes


def test_a_parameter_transformed_through_functional_call_fails_the_gradient_check_naming_that_cause():
    """``functional_call(model, {"0.weight": w * mask})``: the layer's rows are the masked tensor's; the check's
    list of causes now names this one (and the fix: a parametrization, which the cockpit re-runs)."""
    model = mlp()
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    name, weight = next(iter(model.named_parameters()))
    mask = (torch.arange(weight.numel()).reshape(weight.shape) % 3 != 0).to(weight.dtype)
    x, y = data(0)
    params = dict(model.named_parameters())
    params[name] = params[name] * mask
    losses = nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y, reduction="none")
    with cockpit(0, info={"batch_size": len(y), "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    failed = cockpit.checks[0]["failed"]
    assert [f["check"] for f in failed] == ["gradient"] and failed[0]["parameters"] == [name]
    assert "a parameter transformed before the layer uses it" in failed[0]["reason"]
    assert "torch.nn.utils.parametrize" in failed[0]["reason"]


def test_undeclared_micro_batches_first_step_withdrawn_then_merged_exactly(tmp_path):
    whole = train(steps=3).get_output()
    accumulated = train(steps=3, micro_batches=2, stream_to=tmp_path / "run")
    output = accumulated.get_output()
    assert not output[0]["checks"]["valid"] and output[0]["checks"]["failed"][0]["check"] == "backward_passes"
    assert set(output[0]) == {"checks"}  # every value of the first pass was withdrawn
    for step in (1, 2):
        assert output[step]["checks"]["valid"] and output[step]["checks"]["backward_passes"] == 2
        for name in ("GradNorm", "NormTest", "InnerTest"):
            assert output[step][name] == pytest.approx(whole[step][name], rel=1e-10)
    streamed = read_log(tmp_path / "run.jsonl")  # the stream on disk agrees with the log in memory
    assert set(streamed[0]) == {"checks"} and streamed[1]["NormTest"] == output[1]["NormTest"]


def test_the_mean_of_the_losses_must_be_the_loss():
    losses = torch.tensor([1.0, 2.0, 4.0])
    check_losses_mean({"loss": losses.mean(), "individual_losses": losses}, 0)
    with pytest.raises(ValueError, match=r"info\['loss'\] is 3.5 but the mean of info\['individual_losses'\] is 2.3333333"):
        check_losses_mean({"loss": torch.tensor(3.5), "individual_losses": losses}, 0)
    with pytest.raises(ValueError) as raised:  # not a round factor: no hint about scaled losses
        check_losses_mean({"loss": torch.tensor(3.5), "individual_losses": losses}, 0)
    assert "x that mean" not in str(raised.value)


def test_a_loss_divided_by_a_round_factor_is_named_also_just_below_it():
    """A float32 ``loss / 2`` against the rows' mean in float64 is 1.99999992 x apart: the hint that names the
    factor asked for at least 2 and said nothing (outside trial 19, Lightning's manual_backward(loss / 2))."""
    for seed in range(20):
        losses = torch.rand(8, generator=torch.Generator().manual_seed(seed)) * 3
        for divisor in (2, 4):
            with pytest.raises(ValueError, match=rf"info\['loss'\] is 1/{divisor} x that mean"):
                check_losses_mean({"loss": losses.mean() / divisor, "individual_losses": losses}, 0)
        with pytest.raises(ValueError, match=r"info\['loss'\] is 3 x that mean"):
            check_losses_mean({"loss": losses.mean() * 3, "individual_losses": losses}, 0)


def test_a_mean_off_at_float32_rounding_for_float64_losses_names_the_lower_precision_factor():
    """The docs' padded-rows recipe once multiplied float64 losses by ``B / counted`` (an integer tensor: a
    float32 factor): the rows' mean was off by 5e-8 relative, and the error listed causes that were all wrong."""
    generator = torch.Generator().manual_seed(0)
    per_token = torch.rand(4, 5, generator=generator, dtype=torch.float64) * 4
    labels = torch.randint(3, 40, (4, 5), generator=generator)
    labels[1, 3:], labels[2, 2:] = -100, -100  # 15 counted tokens
    per_token = per_token * (labels != -100)
    counted = (labels != -100).sum()
    loss = per_token.sum() / counted
    rounded = per_token.sum(1) * (labels.shape[0] / counted)  # float32 factor
    assert (labels.shape[0] / counted).dtype == torch.float32
    with pytest.raises(ValueError, match="at float32 rounding level") as raised:
        check_losses_mean({"loss": loss, "individual_losses": rounded}, 0)
    assert "counted.to(per_token.dtype)" in str(raised.value) and "weight decay" not in str(raised.value)
    check_losses_mean({"loss": loss, "individual_losses": per_token.sum(1) * (4 / counted.to(per_token.dtype))}, 0)
    # a real difference (an extra term of 1 %) keeps the list of common causes
    with pytest.raises(ValueError, match="Common causes") as raised:
        check_losses_mean({"loss": loss * 1.01, "individual_losses": rounded}, 0)
    assert "rounding level" not in str(raised.value)


@pytest.mark.parametrize("factor, shown", [(1024.0, "1024 x"), (0.25, "1/4 x"), (3.0, "3 x")])
def test_a_scaled_or_divided_loss_passed_as_the_loss_is_named_with_its_factor(factor, shown):
    losses = torch.tensor([1.0, 2.0, 4.0, 0.5, 3.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"info\['loss'\] is " + shown + r" that mean: pass as info\['loss'\] the mean loss"):
        check_losses_mean({"loss": losses.mean() * factor, "individual_losses": losses}, 0)


def test_a_sum_over_the_rows_is_told_to_use_the_mean_reduction_first():
    """Outside trial 39: an extended ``CrossEntropyLoss(reduction='sum')`` was told first to pass the mean as
    info['loss'] (the cockpit would see the factor), which it cannot inside a BackPACK-extended loss module."""
    losses = torch.tensor([1.0, 2.0, 4.0, 0.5, 3.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"is 5 x that mean, the number of rows: a sum over the rows "
                                         r"\(reduction='sum'\)\. Use reduction='mean'") as raised:
        check_losses_mean({"loss": losses.sum(), "individual_losses": losses}, 0)
    assert "the cockpit sees that factor on its own" not in str(raised.value)


@pytest.mark.parametrize("form", ["factors", "sequence", "grad_batch", "sum"])
def test_the_probe_equals_the_projection_of_the_brute_force_row_sum(form):
    torch.manual_seed(1)
    param = torch.zeros(4, 3, dtype=torch.float64)
    a, b = torch.randn(6, 5, 4, dtype=torch.float64), torch.randn(6, 5, 3, dtype=torch.float64)
    rows = torch.einsum("btr,btc->brc", a, b)  # brute force: each row's gradient
    probe = GradientProbe(seed=3)
    state = probe.init([param])
    if form == "factors":
        state = probe.accumulate_factors(state, 0, param, "weight", b[:, 0], a[:, 0])
        rows = torch.einsum("br,bc->brc", a[:, 0], b[:, 0])
    elif form == "sequence":
        state = probe.accumulate_sequence(state, 0, param, a, b)
    elif form == "grad_batch":
        state = probe.accumulate(state, 0, param, rows)
    else:
        state = probe.accumulate_sum(state, 0, param, rows.sum(0))
    total, _ = probe.finalize(state)[0]
    u, v = probe_directions(3, 0, param.shape, param.device)
    assert float(total) == pytest.approx(float(u @ rows.sum(0) @ v), rel=1e-12)
    assert float(project(rows.sum(0), (u, v))) == pytest.approx(float(total), rel=1e-12)


def test_the_probe_leaves_the_user_random_streams_alone():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    probe_directions(1, 2, torch.Size([7, 3]), "cpu")
    assert torch.equal(torch.get_rng_state(), before)


def test_batch_norm_in_training_mode_runs_the_rest_and_notes_what_was_left_out():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    x, y = data(0)
    outputs = model(x)
    losses = nn.functional.cross_entropy(outputs, y, reduction="none")
    loss = losses.mean()
    with cockpit(0, info={"batch_size": ROWS, "individual_losses": losses, "loss": loss}):
        loss.backward()
    values = cockpit.get_output()[0]
    assert values["checks"]["valid"] and "BatchNorm1d in training mode" in values["checks"]["notes"][0]
    assert "NormTest" not in values and "InnerTest" not in values
    assert values["GradNorm"] == pytest.approx([p.grad.norm().item() for p in model.parameters()], rel=1e-12)


class _TwiceReturned(nn.Module):
    """Returns its output twice (as DeBERTa's encoder returns its last hidden state again at the end of the
    tuple of hidden states) and reads a table of its own as a weight (computed by its torch.func re-run)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 4)
        self.table = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = torch.tanh(self.lin(x)) * self.table
        return h, (h,)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.out = _TwiceReturned(), nn.Linear(4, 3)

    def forward(self, x):
        h, _ = self.body(x)
        return self.out(h)


def test_an_output_returned_twice_is_counted_once():
    """Found by the gradient check on DeBERTa: a re-run's vjp got a cotangent for each copy of the same output,
    so the table's rows were twice its gradient. Exact against a loop of autograd over rows."""
    torch.manual_seed(0)
    model = _Head().double()
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    x, y = data(0)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    loss = losses.mean()
    with cockpit(0, info={"batch_size": ROWS, "individual_losses": losses, "loss": loss}):
        loss.backward()
    assert cockpit.checks[0]["valid"] and cockpit.checks[0]["gradient"]["worst"] < 1e-12
    rows = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))])
        for i in range(ROWS)
    ])  # fmt: skip
    mean = rows.mean(0)
    # NormTest (QUANTITIES.md): sqrt(sum_i ||g_i - g||^2 / ((B - 1) B ||g||^2))
    expected = ((rows - mean).square().sum() / (ROWS * (ROWS - 1)) / mean.square().sum()).sqrt().item()
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(expected, rel=1e-10)


def test_the_dashboard_title_says_which_steps_failed_and_what_is_frozen():
    from cockpit_like.plotting.data import RunData
    from cockpit_like.plotting.plotter import CockpitPlotter

    steps = {
        0: {"Loss": 1.0, "checks": {"valid": False, "failed": [{"check": "gradient", "reason": "..."}], "frozen": ["a"]}},
        1: {"Loss": 0.9, "checks": {"valid": True, "failed": [], "frozen": ["a", "b"], "no_gradient": ["c"]}},
    }
    data = RunData(steps)
    title = CockpitPlotter._title(None, data, "run.json")
    assert "1 step failed a self-check, numbers left out (last: 0, gradient)" in title
    assert "2 frozen parameters" in title and "1 without a gradient" in title


def test_a_distributed_mistake_is_an_error_within_two_minutes_by_default():
    """Issue 34: a cockpit on rank 0 only waited torch's 30 minutes; the cockpit's collectives now give up after
    120 s unless told otherwise (tests/test_distributed.py runs the mistake itself with a short timeout)."""
    import inspect

    assert inspect.signature(Cockpit).parameters["distributed_timeout"].default == 120.0


def _sgd_steps(model, optimized, steps: int, zero_grad: bool):
    """``steps`` SGD steps of ``model`` (``optimized``: the optimizer's parameters) under a cockpit on every
    parameter, with or without ``optimizer.zero_grad()``; the cockpit."""
    optimizer = torch.optim.SGD(list(optimized), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    for step in range(steps):
        if zero_grad:
            optimizer.zero_grad()
        x, y = data(step)
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean()
        with cockpit(step, info={"batch_size": ROWS, "individual_losses": losses, "loss": loss, "optimizer": optimizer}):
            loss.backward()
        optimizer.step()
    return cockpit


def test_a_forgotten_zero_grad_fails_the_step_and_is_reported_once():
    model = mlp()
    cockpit = _sgd_steps(model, model.parameters(), steps=3, zero_grad=False)
    assert "checks" not in cockpit.get_output()[0]  # the first step starts from no gradient
    for step in (1, 2):
        failed = cockpit.invalid_steps[step]
        assert [f["check"] for f in failed] == ["stale_gradient"] and "zero_grad" in failed[0]["reason"]
    assert [(f.rule, f.step) for f in cockpit.findings] == [("gradients-accumulate", 1)]


def test_the_metadata_says_whether_stale_gradients_were_checked(tmp_path):
    """``metadata["stale_gradients_checked"]`` (read by the diagnosis: the statistical gradients-accumulate rule
    defers to the self-check where it ran) follows the self-checks, in the stream too when they are switched."""
    from cockpit_like.logs import read_log_with_metadata

    model = mlp()
    cockpit = Cockpit(model.parameters(), [GradNorm(linear(1))], model=model, stream_to=tmp_path / "run")
    assert cockpit.metadata()["stale_gradients_checked"] is True
    cockpit.self_checks = False
    assert cockpit.metadata()["stale_gradients_checked"] is False
    cockpit.close()
    assert read_log_with_metadata(tmp_path / "run.jsonl")[0]["stale_gradients_checked"] is False


def test_parameters_left_out_of_the_optimizer_are_noted_not_failed():
    """A layer frozen by leaving it out of the optimizer: its p.grad is never zeroed. The step stays valid (the
    per-sample check compares this step's part) and a note says what p.grad holds."""
    model = mlp()
    cockpit = _sgd_steps(model, model[2].parameters(), steps=2, zero_grad=True)
    checks = cockpit.checks[1]
    assert checks["valid"] and "not in info['optimizer']" in checks["notes"][0] and "0.weight" in checks["notes"][0]
    assert "NormTest" in cockpit.get_output()[1]


def test_projecting_every_gradient_at_once_equals_one_by_one():
    """project_all groups tensors of one shape into batched products: the same numbers as project() per tensor."""
    from cockpit_like.checks.probe import project_all

    generator = torch.Generator().manual_seed(4)
    shapes = [(4, 3), (4, 3), (5,), (4, 3), (5,), (2, 3, 2), (7,), (2, 3, 2)]
    items = [(index, torch.randn(*shape, generator=generator, dtype=torch.float64)) for index, shape in enumerate(shapes)]
    items.append((8, torch.randn(4, 3, generator=generator).half()))  # half precision: read in float32
    got = project_all(11, items)
    for (index, tensor), value in zip(items, got):
        wide = tensor if tensor.dtype == torch.float64 else tensor.float()
        expected = float(project(wide, probe_directions(11, index, tensor.shape, "cpu")))
        assert value == pytest.approx(expected, rel=1e-6 if tensor.dtype != torch.float64 else 1e-12)
    assert project_all(11, []) == []


def test_a_non_finite_row_loss_beside_a_finite_loss_is_refused():
    # a padded row with no counted token: its token mean is 0/0, and a nanmean loss skips it
    losses = torch.tensor([1.0, float("nan"), 4.0])
    with pytest.raises(ValueError, match=r"not finite at row\(s\) 1 of 3.*Padding or ignored tokens"):
        check_losses_mean({"loss": losses.nanmean(), "individual_losses": losses}, 0)
    # a non-finite loss with non-finite rows is the run's own NaN: handled (and recorded) elsewhere
    check_losses_mean({"loss": losses.mean(), "individual_losses": losses}, 0)
