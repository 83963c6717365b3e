"""The cockpit engine: needs per step, buffers, fast path, errors."""

import gc
import warnings

import pytest
import torch
from backpack import extend
from backpack.extensions import BatchGrad, DiagGGNMC, DiagHessian, SumGradSquared

from cockpit_like import Cockpit, quantities
from cockpit_like.backends.extensions import ExtensionConflictError
from cockpit_like.backends.per_sample import PerSampleReducer, PerSampleStat
from cockpit_like.cockpit import NotExtendedError, UnsupportedLayerError
from cockpit_like.context import MissingInfoError, get_batch_size, get_record
from cockpit_like.quantities.quantity import SingleStepQuantity, to_output
from cockpit_like.utils.schedules import linear
from tests.helpers import make_batch, make_problem, per_sample_grads


def one_step(cockpit, model, lossfunc, step=0, info=None, exts=(), problem="mlp", batch_size=6):
    inputs, labels = make_batch(problem, batch_size, seed=step)
    model.zero_grad()  # each step's gradient its own (the self-checks fail a step with stale gradients)
    loss = lossfunc(model(inputs), labels)
    info = {"loss": loss, "batch_size": batch_size} if info is None else info
    with cockpit(step, *exts, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    return inputs, labels


class NeedsExtension(SingleStepQuantity):
    """Asks for a BackPACK extension and records what it saw."""

    def __init__(self, schedule, extension, field):
        super().__init__(schedule)
        self.extension, self.field = extension, field

    def extensions(self, step):
        return [self.extension] if self.should_compute(step) else []

    def _compute(self, step, params, loss):
        return [getattr(p, self.field).sum() for p in params]


def test_frozen_params_are_tracked_and_named():
    """Issue 34: frozen parameters are accepted (they were refused); each tracked step names them, and their
    gradient counts as zero."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNorm(linear(1))], model=model)
    x = torch.randn(5, 3)
    loss = model(x).square().mean()
    with cockpit(0, info={"batch_size": 5, "loss": loss}):
        loss.backward()
    checks = cockpit.get_output()[0]["checks"]
    assert checks["valid"] and checks["frozen"] == ["0.weight"] and checks["no_gradient"] == []
    norms = cockpit.get_output()[0]["GradNorm"]
    assert norms[0] == 0.0 and norms[1] == pytest.approx(model[0].bias.grad.norm().item())
    assert model[0].weight.grad is None  # the zero the quantities saw is not left behind


def test_no_gradient_at_all_is_a_clear_error():
    model = torch.nn.Linear(3, 2)
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNorm(linear(1))], model=model)
    with pytest.raises(RuntimeError, match="no backward pass ran inside the cockpit.s block"):
        with cockpit(0, info={"batch_size": 5}):
            pass


@pytest.mark.parametrize(
    "bad, message",
    [
        ("GradNorm", r"'GradNorm' \(str\) is not a Quantity"),
        (quantities.GradNorm, r"got the class GradNorm; pass an instance"),
    ],
)
def test_quantities_must_be_instances(bad, message):
    param = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=message):
        Cockpit([param], quantities=[bad])
    with pytest.raises(ValueError, match=message):
        Cockpit([param]).add(bad)


def test_quantities_must_be_a_list():
    with pytest.raises(ValueError, match="takes a list of Quantity instances"):
        Cockpit([torch.zeros(2, requires_grad=True)], quantities=quantities.GradNorm(linear(1)))


def test_missing_info_key_fails_before_backward():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.Loss(linear(2))])
    inputs, labels = make_batch("mlp", 4, seed=0)
    loss = lossfunc(model(inputs), labels)
    with pytest.raises(MissingInfoError) as caught:
        with cockpit(2, info={"batch_size": 4}):
            loss.backward()
    message = str(caught.value)
    assert "Loss needs info['loss'] at step 2" in message and "Pass it via info=" in message
    assert isinstance(caught.value, KeyError)
    assert all(p.grad is None for p in model.parameters()), "backward must not have run"
    # Not needed at an unscheduled step: no error.
    with cockpit(1, info={}):
        loss.backward()


def test_context_getter_names_missing_key():
    class WantsBatchSize(SingleStepQuantity):  # a Cockpit-style plugin that does not declare needs
        def _compute(self, step, params, loss):
            return get_batch_size(step)

    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[WantsBatchSize(linear(1))])
    with pytest.raises(MissingInfoError, match=r"needs info\['batch_size'\] at step 0"):
        one_step(cockpit, model, lossfunc, info={})


def test_getters_outside_tracking():
    with pytest.raises(RuntimeError, match="only available while a cockpit tracks"):
        get_record(0)


def test_nan_loss_warns_and_stores_nan_for_quantities_that_fail():
    class Fragile(SingleStepQuantity):
        def _compute(self, step, params, loss):
            if not torch.isfinite(loss):
                raise FloatingPointError("cannot work on a NaN loss")
            return loss

    param = torch.ones(3, requires_grad=True)
    fragile, norm = Fragile(linear(1)), quantities.GradNorm(linear(1))
    cockpit = Cockpit([param], quantities=[fragile, norm, quantities.Loss(linear(1))])
    loss = (param * float("nan")).sum()
    with pytest.warns(RuntimeWarning) as caught:
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    messages = [str(w.message) for w in caught]
    assert any("step 0: the loss is nan" in m for m in messages)
    assert any("Fragile failed on the non-finite loss (FloatingPointError: cannot work on a NaN loss); storing NaN" in m for m in messages)
    output = cockpit.get_output()[0]
    assert output["Fragile"] != output["Fragile"]  # NaN
    assert all(v != v for v in output["GradNorm"]) and output["Loss"] != output["Loss"]


def test_quantity_errors_propagate_unchanged_with_finite_loss():
    class Broken(SingleStepQuantity):
        def _compute(self, step, params, loss):
            raise ValueError("only zero-momentum SGD is supported")

    param = torch.ones(3, requires_grad=True)
    cockpit = Cockpit([param], quantities=[Broken(linear(1))])
    loss = param.sum()
    with pytest.raises(ValueError, match="^only zero-momentum SGD is supported$"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_model_not_extended():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))  # no backpack.extend
    cockpit = Cockpit(model.parameters(), quantities=[NeedsExtension(linear(1), SumGradSquared(), "sum_grad_squared")])
    loss = torch.nn.functional.mse_loss(model(torch.randn(4, 3)), torch.zeros(4, 2))
    with pytest.raises(NotExtendedError, match=r"SumGradSquared\(\).*must be extended: `model = backpack.extend\(model\)`"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_batch_grad_alone_on_a_model_that_is_not_extended_is_made_by_the_hooks():
    """``BatchGrad()`` asked for alone: ``p.grad_batch`` on a plain model as BackPACK gives it on an extended one
    (it raised ``NotExtendedError``; outside trial 26 ran docs/custom_quantities.md's first example on a plain model)."""
    results = []
    for extended in (True, False):
        torch.manual_seed(0)
        first, second = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
        if extended:
            first, second = extend(first), extend(second)
        quantity = NeedsExtension(linear(1), BatchGrad(), "grad_batch")
        cockpit = Cockpit([*first.parameters(), *second.parameters()], quantities=[quantity])
        loss = second(torch.tanh(first(torch.randn(5, 3, generator=torch.Generator().manual_seed(1))))).pow(2).mean()
        with cockpit(0, info={"loss": loss, "batch_size": 5}):
            loss.backward()
        results.append([float(v) for v in quantity.get_output()[0]])
        assert not any(hasattr(p, "grad_batch") for p in [*first.parameters(), *second.parameters()])  # freed
    assert results[1] == pytest.approx(results[0], rel=1e-6)


def test_parameters_of_a_module_that_is_not_extended():
    torch.manual_seed(0)
    first, second = extend(torch.nn.Linear(3, 4)), torch.nn.Linear(4, 2)  # second not extended
    cockpit = Cockpit([*first.parameters(), *second.parameters()],
                      quantities=[NeedsExtension(linear(1), SumGradSquared(), "sum_grad_squared")])
    loss = second(first(torch.randn(5, 3))).pow(2).mean()
    with pytest.raises(NotExtendedError, match=r"parameters #2 weight \[2, 4\], #3 bias \[2\]"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_unsupported_layer():
    class Square(torch.nn.Module):
        def forward(self, x):
            return x**2

    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(3, 4), Square(), torch.nn.Linear(4, 2)))
    lossfunc = extend(torch.nn.MSELoss())
    cockpit = Cockpit(model.parameters(), quantities=[NeedsExtension(linear(1), DiagHessian(), "diag_h")])
    loss = lossfunc(model(torch.randn(5, 3)), torch.zeros(5, 2))
    with pytest.raises(UnsupportedLayerError, match=r"BackPACK cannot run the extensions needed at step 0 \(DiagHessian\(\) for NeedsExtension\)"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()


def test_extensions_merge_by_value_and_conflicts_raise():
    model, lossfunc, _ = make_problem("mlp")
    same = [NeedsExtension(linear(1), DiagGGNMC(mc_samples=1), "diag_ggn_mc") for _ in range(2)]
    cockpit = Cockpit(model.parameters(), quantities=same)
    one_step(cockpit, model, lossfunc)
    assert cockpit.get_output()[0]["NeedsExtension"] == same[0].get_output()[0]

    clash = NeedsExtension(linear(1), DiagGGNMC(mc_samples=2), "diag_ggn_mc")
    cockpit.add(clash)
    with pytest.raises(ExtensionConflictError, match=r"NeedsExtension asks for DiagGGNMC\(mc_samples=1[,)].*NeedsExtension_2 asks for DiagGGNMC\(mc_samples=2[,)].*use the same hyperparameters"):
        one_step(cockpit, model, lossfunc, step=1)


def test_user_extensions_keep_results_quantity_extensions_are_freed():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[NeedsExtension(linear(1), SumGradSquared(), "sum_grad_squared")])
    inputs, labels = one_step(cockpit, model, lossfunc, exts=(BatchGrad(),))
    expected = per_sample_grads(model, inputs, labels)
    for param, g in zip(model.parameters(), expected):
        assert torch.allclose(param.grad_batch * len(inputs), g, rtol=1e-10, atol=1e-12)
        assert not hasattr(param, "sum_grad_squared")


def test_user_extensions_run_on_unscheduled_steps():
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNorm(linear(5))])
    one_step(cockpit, model, lossfunc, step=1, exts=(SumGradSquared(),))
    assert all(hasattr(p, "sum_grad_squared") for p in model.parameters())


def test_nothing_scheduled_enters_no_backpack_context(monkeypatch):
    import cockpit_like.backends.step as engine

    entered = []
    monkeypatch.setattr(engine, "backpack", lambda *a, **k: entered.append(a))
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[NeedsExtension(linear(10, offset=3), BatchGrad(), "grad_batch")])
    one_step(cockpit, model, lossfunc, step=1, info={})  # not even the loss is needed
    assert entered == []
    assert cockpit.get_output() == {}


def test_two_instances_of_a_class_get_distinct_keys():
    param = torch.ones(2, requires_grad=True)
    norms = [quantities.GradNorm(linear(1)), quantities.GradNorm(linear(2))]
    cockpit = Cockpit([param], quantities=norms)
    for step in range(3):
        loss = (param * (step + 1)).sum()
        with cockpit(step, info={"loss": loss}):
            loss.backward()
        param.grad = None
    output = cockpit.get_output()
    assert sorted(output[1]) == ["GradNorm"] and sorted(output[2]) == ["GradNorm", "GradNorm_1"]
    assert [cockpit.name_of(q) for q in norms] == ["GradNorm", "GradNorm_1"]


def test_log_stores_epoch_figures():
    cockpit = Cockpit([torch.ones(2, requires_grad=True)])
    cockpit.log(10, epoch_count=1, train_loss=0.5, learning_rate=0.1)
    assert cockpit.get_output()[10] == {
        "epoch_count": 1, "train_loss": 0.5, "valid_loss": None, "test_loss": None,
        "train_accuracy": None, "valid_accuracy": None, "test_accuracy": None, "learning_rate": 0.1,
    }


def test_global_step_and_info_are_checked():
    cockpit = Cockpit([torch.ones(2, requires_grad=True)])
    with pytest.raises(ValueError, match="non-negative int"):
        cockpit(-1)
    with pytest.raises(ValueError, match="takes a dict"):
        cockpit(0, info=[1])


def test_debug_prints_the_plan(capsys):
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[NeedsExtension(linear(2), BatchGrad(), "grad_batch")])
    inputs, labels = make_batch("mlp", 4, seed=0)
    for step in (0, 1):
        loss = lossfunc(model(inputs), labels)
        with cockpit(step, info={"loss": loss}, debug=True):
            loss.backward()
    printed = capsys.readouterr().out
    assert "[cockpit_like|step 0] quantities: ['NeedsExtension']; extensions: ['BatchGrad()']" in printed
    assert "[cockpit_like|step 1] nothing scheduled" in printed


@pytest.mark.parametrize("keep_raw", [False, True])
def test_per_sample_stats_are_shared_and_free_grad_batch_per_layer(keep_raw):
    from dataclasses import dataclass

    calls = []

    @dataclass(frozen=True)
    class SampleSquaredNorms(PerSampleStat):
        def init(self, params):
            return 0

        def accumulate(self, state, index, param, grad_batch):
            calls.append(index)
            return state + grad_batch.flatten(1).pow(2).sum(1)

    class UsesStat(SingleStepQuantity):
        def per_sample_stats(self, step):
            return [SampleSquaredNorms()]

        def extensions(self, step):
            return [BatchGrad()] if keep_raw else []

        def _compute(self, step, params, loss):
            return get_record(step).stat(SampleSquaredNorms())

    live = []
    original = PerSampleReducer.__call__

    def spy(self, module):
        original(self, module)
        live.append(sum(hasattr(p, "grad_batch") for p in model.parameters()))

    model, lossfunc, _ = make_problem("cnn")
    users = [UsesStat(linear(1)), UsesStat(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=users)
    PerSampleReducer.__call__ = spy
    try:
        inputs, labels = one_step(cockpit, model, lossfunc, problem="cnn")
    finally:
        PerSampleReducer.__call__ = original
    assert sorted(calls) == [0, 1, 2, 3], "one statistic computed once for two quantities"
    expected = sum(g.flatten(1).pow(2).sum(1) for g in per_sample_grads(model, inputs, labels)) / len(inputs) ** 2
    assert torch.allclose(torch.as_tensor(users[0].get_output()[0]), expected, rtol=1e-10)
    if keep_raw:
        assert max(live) == 4
    else:
        assert max(live) == 0, "grad_batch must be freed right after each layer"
    assert not any(hasattr(p, "grad_batch") for p in model.parameters())


def test_to_output_conversions():
    import numpy as np

    converted = to_output({"a": torch.tensor(2.0), "b": (torch.ones(2, dtype=torch.float64), 3), "c": [torch.tensor(1)]})
    assert converted["a"] == 2.0 and isinstance(converted["a"], float)
    assert isinstance(converted["b"], tuple) and converted["b"][0].dtype == np.float64
    assert converted["c"] == [1]


def test_schedules_are_asked_once_per_step_and_again_after_add():
    """The forward pass, create_graph and begin of one step share one answer of each schedule."""
    model, lossfunc, _ = make_problem("mlp")
    calls = []

    def schedule(step):
        calls.append(step)
        return step == 2

    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNorm(schedule)], model=model)
    calls.clear()  # the constructor checks the schedule once
    for step in range(3):
        one_step(cockpit, model, lossfunc, step=step)
    assert calls[:3] == [0, 1, 2] and calls[3:] == [2]  # untracked steps: once; tracked: once more in track()
    assert 2 in cockpit.get_output() and 1 not in cockpit.get_output()
    # a quantity added between the forward pass and the step is tracked at that step
    inputs, labels = make_batch("mlp", 6, seed=3)
    model.zero_grad()
    loss = lossfunc(model(inputs), labels)
    cockpit.add(quantities.Loss(lambda step: True))
    with cockpit(3, info={"loss": loss, "batch_size": 6}):
        loss.backward()
    assert "Loss" in cockpit.get_output()[3]


def test_the_loss_is_checked_once_per_step(monkeypatch):
    """The recorder's automatic check and the tracked step's check share one look at the loss."""
    import cockpit_like.tracked_step as engine

    checked = []
    original = engine.loss_finite

    def counting(loss):
        checked.append(loss)
        return original(loss)

    monkeypatch.setattr(engine, "loss_finite", counting)
    model, lossfunc, _ = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), quantities=[quantities.GradNorm(lambda step: step == 1)], model=model)
    for step in range(3):  # untracked, tracked, untracked
        one_step(cockpit, model, lossfunc, step=step)
    assert len(checked) == 3 and 1 in cockpit.get_output()


def test_two_cockpits_on_one_model_leave_the_global_kernels_as_they_were():
    """Forward passes of steps that need the graph use the math attention kernel and no cuDNN; with two
    cockpits on one model their hooks nest out of order, and the global settings must still come back."""
    from torch.nn.attention import _cur_sdpa_kernel_backends

    def settings():
        return sorted(str(b) for b in _cur_sdpa_kernel_backends()), torch.backends.cudnn.enabled

    before = settings()
    model, _, _ = make_problem("mlp")
    first = Cockpit(model.parameters(), [quantities.HessMaxEV(linear(1))], model=model)
    second = Cockpit(model.parameters(), [quantities.HessMaxEV(linear(1))], model=model)
    inputs, _ = make_batch("mlp", 4, 0)
    model(inputs)  # both tracers want the graph at step 0
    assert settings() == before
    assert first is not second


class _DropsTheCockpit(torch.nn.Module):
    """A model whose forward pass drops the last reference to a cockpit (and collects it), or removes it."""

    def __init__(self, how: str):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2).double()
        self.how, self.holder = how, []

    def forward(self, x):
        cockpit = self.holder.pop()
        if self.how == "remove":
            cockpit._tracer.remove()
        del cockpit
        gc.collect()
        return self.layer(x)


@pytest.mark.parametrize("how", ["collected", "removed"])
def test_a_cockpit_gone_during_a_forward_pass_puts_the_kernels_back(how):
    """The graph kernels a forward pass took for a cockpit go back when the pass ends even if that
    cockpit was collected (or its hooks removed) while the pass ran: a leak would leave every later
    forward pass of the process on the math attention kernel, changing what other models compute."""
    from cockpit_like.backends.tracer import _graph_kernels
    from torch.nn.attention import _cur_sdpa_kernel_backends

    def settings():
        return sorted(str(b) for b in _cur_sdpa_kernel_backends()), torch.backends.cudnn.enabled

    before = settings()
    model = _DropsTheCockpit("remove" if how == "removed" else "collect")
    model.holder.append(Cockpit(model.parameters(), [quantities.HessMaxEV(linear(1))], model=model))
    model(torch.ones(4, 3, dtype=torch.float64))
    assert _graph_kernels.depth == 0 and settings() == before


def test_unsupported_layer_names_the_quantity_behind_each_extension_and_kfac_traces_way_out():
    """KFACTrace(curvature='kflr') beside HessTrace on a LeakyReLU net: the error says which quantity needs KFLR."""
    from cockpit_like.quantities import HessTrace, KFACTrace

    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LeakyReLU(0.1), torch.nn.Linear(10, 3)))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(linear(1)), KFACTrace(linear(1), curvature="kflr")])
    loss = lossfunc(model(torch.randn(6, 6)), torch.randint(0, 3, (6,)))
    with pytest.raises(UnsupportedLayerError) as caught:
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    assert "DiagHessian() for HessTrace; KFLR(" in str(caught.value) and ") for KFACTrace)" in str(caught.value)
    assert "KFACTrace(curvature='empirical')" in str(caught.value)
