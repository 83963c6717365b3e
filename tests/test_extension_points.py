"""Cockpit's extension points (issue 18): the names that plugin code and subclasses use.

Every number is checked against float64 brute force (per-sample gradients from
``torch.func`` in :mod:`tests.helpers`, Hessians from ``torch.func.hessian``,
optimizer updates from a real ``optimizer.step()`` on a copy), never against
cockpit_like's own output. The subclasses below are written the way subclasses
of Cockpit's quantities are written (its own test suite subclasses GradHist1d,
GradHist2d and CABS like this).

BackPACK's raw ``AssertionError`` wrapped into ``UnsupportedLayerError``: see
``tests/test_model_errors.py::test_backpack_assertion_becomes_an_explained_error``;
the skip connection of the issue is checked here (BackPACK raises
``NotImplementedError`` for it, wrapped the same way).
"""

from __future__ import annotations

import inspect

import matplotlib
import matplotlib.image

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from backpack import backpack, extend  # noqa: E402
from backpack.extensions import BatchGrad, BatchL2Grad  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from torch import nn  # noqa: E402

from cockpit_like import Cockpit, CockpitPlotter  # noqa: E402
from cockpit_like.context import get_batch_size, get_individual_losses, get_optimizer  # noqa: E402
from cockpit_like.quantities import CABS, GradHist1d, GradHist2d, GradNorm, HessTrace, NormTest  # noqa: E402
from cockpit_like.quantities.bin_adaptation import GradAbsMax, NoAdaptation, ParamAbsMax  # noqa: E402
from cockpit_like.quantities.quantity import SingleStepQuantity  # noqa: E402
from cockpit_like.quantities.utils_transforms import (  # noqa: E402
    BatchGradTransformsHook,
    BatchGradTransformsHook_BatchDotGrad,
    BatchGradTransformsHook_BatchL2Grad,
    BatchGradTransformsHook_SumGradSquared,
    batch_l2_transform,
)
from cockpit_like.utils.optim import ComputeStep  # noqa: E402
from cockpit_like.utils.schedules import linear  # noqa: E402
from examples.subclass_quantity import AutogradCABS  # noqa: E402
from tests.helpers import DTYPE, PROBLEMS, dense_hessian, make_batch, make_problem, per_sample_grads  # noqa: E402
from tests.test_histograms import ref_hist1d, ref_hist2d  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Using backward", "ignore:Full backward hook")


# ---- a training loop that records brute-force references -----------------------------------------
def make_model(problem: str, extended: bool, seed: int = 0):
    """``(model, mean loss function)``; extended with BackPACK or a plain module (hook backend)."""
    model = PROBLEMS[problem][0](bias=True, seed=seed)
    if extended:
        return extend(model), extend(nn.CrossEntropyLoss())
    return model, nn.CrossEntropyLoss()


def run(quantities, problem="mlp", extended=True, steps=3, batch_size=5, optimizer=None, exts=(), inside=None,
        lr=0.3):
    """Train with ``quantities``; return ``refs[step] = (per-sample grads g_i, params, inputs, labels, lr)``."""
    model, lossfunc = make_model(problem, extended)
    params = list(model.parameters())
    opt = optimizer(params) if optimizer is not None else torch.optim.SGD(params, lr=lr)
    cockpit = Cockpit(params, quantities=quantities, model=model)
    individual = nn.CrossEntropyLoss(reduction="none")
    refs = {}
    for step in range(steps):
        inputs, labels = make_batch(problem, batch_size, seed=100 + step)
        refs[step] = (per_sample_grads(model, inputs, labels), [p.detach().clone() for p in params], inputs, labels)
        opt.zero_grad()
        outputs = model(inputs)
        loss, losses = lossfunc(outputs, labels), individual(outputs, labels)
        info = {"batch_size": batch_size, "loss": loss, "individual_losses": losses, "optimizer": opt}
        with cockpit(step, *exts, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
            if inside is not None:
                inside(step, params)
        opt.step()
    return refs, params, cockpit


def autograd_per_sample(params, global_step) -> list[torch.Tensor]:
    """``g_i`` from a loop of ``torch.autograd.grad`` over the per-sample losses (the graph is kept)."""
    losses = get_individual_losses(global_step)
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    return [torch.stack([row[k] for row in rows]) for k in range(len(params))]


# ---- 1. schedules ------------------------------------------------------------------------------
@pytest.mark.parametrize("interval,offset", [(10, -1), (3, -7), (4, -4), (5, 2), (1, -3)])
def test_linear_with_negative_offset_tracks_like_cockpit(interval, offset):
    from cockpit_like.utils.schedules import linear as make

    schedule = make(interval, offset)
    expected = sorted({offset + n * interval for n in range(200)} & set(range(60)))
    assert [t for t in range(60) if schedule(t)] == expected
    if (interval, offset) == (10, -1):
        assert expected[:3] == [9, 19, 29]


def test_negative_offset_schedule_drives_a_quantity():
    quantity = GradNorm(linear(3, -1))
    refs, _, _ = run([quantity], steps=9)
    assert sorted(quantity.get_output()) == [2, 5, 8]
    for step, norms in quantity.get_output().items():
        expected = [g.mean(0).norm().item() for g in refs[step][0]]
        np.testing.assert_allclose(norms, expected, rtol=1e-10)


# ---- 2. GradHist1d / GradHist2d subclasses and ``_adapt`` -------------------------------------------
class AutogradGradHist1d(GradHist1d):
    """Cockpit-style subclass: per-sample gradients by autograd, numpy counting, Cockpit's own ``track``."""

    def extensions(self, global_step):
        return []

    def extension_hooks(self, global_step):
        return []

    def create_graph(self, global_step):
        if self._adapt is None:
            should_adapt = False
        else:
            should_adapt = self._adapt.should_compute(global_step)
        return self.should_compute(global_step) or should_adapt

    def track(self, global_step, params, batch_loss):
        SingleStepQuantity.track(self, global_step, params, batch_loss)
        if self._adapt.should_compute(global_step):
            self._range = self._adapt.compute(global_step, params, batch_loss, self._range)

    def _compute(self, global_step, params, batch_loss):
        grads = torch.cat([g.reshape(-1) for g in autograd_per_sample(params, global_step)])
        hist = ref_hist1d(grads.detach().numpy(), self._bins, *self._range)
        return {"hist": hist, "edges": np.linspace(*self._range, self._bins + 1)}


class AutogradGradHist2d(GradHist2d):
    """Cockpit-style subclass of GradHist2d (autograd, numpy), adaptation by the base class."""

    def extensions(self, global_step):
        return []

    def extension_hooks(self, global_step):
        return []

    def create_graph(self, global_step):
        should_adapt = any(a.should_compute(global_step) for a in self._adapt if a is not None)
        return self.should_compute(global_step) or should_adapt

    def _compute(self, global_step, params, batch_loss):
        grads = autograd_per_sample(params, global_step)
        ranges = [tuple(r) for r in self._range]
        per_param = []
        for g, p in zip(grads, params):
            x = g.detach().reshape(-1).numpy()
            y = p.detach().unsqueeze(0).expand_as(g).reshape(-1).numpy()
            per_param.append(ref_hist2d(x, y, self._bins, ranges))
        return {"hist": sum(per_param), "ranges": [list(r) for r in ranges]}


def test_adapt_attribute_has_cockpits_meaning():
    hist = GradHist1d(linear(1))
    assert isinstance(hist._adapt, NoAdaptation) and not hist._adapt.should_compute(0)
    assert hist._adapt.compute(0, [], None, (-1.0, 3.0)) == (-1.0, 3.0)
    adapter = GradAbsMax(linear(2))
    assert GradHist1d(linear(1), adapt=adapter)._adapt is adapter
    both = GradHist2d(linear(1), adapt=(None, adapter))
    assert len(both._adapt) == 2 and isinstance(both._adapt[0], NoAdaptation) and both._adapt[1] is adapter
    assert both.settings()["adapt"][0] is None and hist.settings()["adapt"] is None  # logs unchanged
    assert isinstance(both._range, list)  # as in Cockpit: a subclass may assign one axis


@pytest.mark.parametrize("extended", [True, False])
def test_gradhist1d_subclass_with_adaptation(extended):
    padding = 0.25
    bins = 12
    hist = AutogradGradHist1d(linear(1), bins=bins, range=(-0.5, 0.5), adapt=GradAbsMax(linear(2), padding=padding))
    builtin = GradHist1d(linear(1), bins=bins, range=(-0.5, 0.5), adapt=GradAbsMax(linear(2), padding=padding))
    refs, _, _ = run([hist, builtin], extended=extended, steps=4)
    out = hist.get_output()
    assert sorted(out) == [0, 1, 2, 3]
    for step in range(4):
        if step == 0:
            lo, hi = -0.5, 0.5
        else:
            source = 2 * ((step - 1) // 2)  # the last adaptation step before `step`
            extent = (1 + padding) * max(g.abs().max().item() for g in refs[source][0])
            lo, hi = -extent, extent
        grads = np.concatenate([g.reshape(-1).numpy() for g in refs[step][0]])
        expected = ref_hist1d(grads, bins, lo, hi)
        np.testing.assert_allclose(out[step]["edges"][[0, -1]], [lo, hi], rtol=1e-9)
        np.testing.assert_array_equal(out[step]["hist"], expected)
        np.testing.assert_array_equal(builtin.get_output()[step]["hist"], expected)


def test_gradhist2d_subclass_with_adaptation_on_both_axes():
    bins = (6, 7)
    hist = AutogradGradHist2d(
        linear(2), bins=bins, range=((-1, 1), (-2, 2)), adapt=(GradAbsMax(linear(1), padding=0.1), ParamAbsMax(linear(3)))
    )
    refs, _, _ = run([hist], steps=5)
    out = hist.get_output()
    assert sorted(out) == [0, 2, 4]
    for step, value in out.items():
        if step == 0:
            ranges = [(-1.0, 1.0), (-2.0, 2.0)]
        else:
            g_extent = 1.1 * max(g.abs().max().item() for g in refs[step - 1][0])  # GradAbsMax at every step
            p_source = 3 * ((step - 1) // 3)  # ParamAbsMax ran at 0 and 3, on the parameters before the update
            p_extent = max(p.abs().max().item() for p in refs[p_source][1])
            ranges = [(-g_extent, g_extent), (-p_extent, p_extent)]
        np.testing.assert_allclose(np.asarray(value["ranges"]), np.asarray(ranges), rtol=1e-9)
        grads, params = refs[step][0], refs[step][1]
        expected = sum(
            ref_hist2d(g.reshape(-1).numpy(), p.unsqueeze(0).expand_as(g).reshape(-1).numpy(), bins, ranges)
            for g, p in zip(grads, params)
        )
        np.testing.assert_array_equal(value["hist"], expected)


# ---- 3. ComputeStep -------------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compute_update_step_is_the_next_optimizer_step(name):
    model, lossfunc, _ = make_problem("mlp")
    params = list(model.parameters())
    opt = OPTIMIZERS[name](params)
    for step in range(3):
        inputs, labels = make_batch("mlp", 6, seed=step)
        opt.zero_grad()
        lossfunc(model(inputs), labels).backward()
        before = [p.detach().clone() for p in params]
        grads = [p.grad.clone() for p in params]
        updates = ComputeStep.compute_update_step(opt, [id(p) for p in params[1:]])
        assert set(updates) == {id(p) for p in params[1:]}
        assert all(torch.equal(p, b) and torch.equal(p.grad, g) for p, b, g in zip(params, before, grads))
        opt.step()
        for p, b in zip(params[1:], before[1:]):
            torch.testing.assert_close(updates[id(p)], p.detach() - b, rtol=1e-12, atol=1e-15)


def test_compute_update_step_reads_grad_batch_when_grad_is_not_written():
    """Cockpit computes the step inside backward hooks, from ``grad_batch``; ``.grad`` is not there yet."""
    weight = torch.zeros(3, dtype=DTYPE, requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.5)
    weight.grad_batch = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], dtype=DTYPE)
    update = ComputeStep.compute_update_step(opt, [id(weight)])[id(weight)]
    torch.testing.assert_close(update, torch.tensor([-2.0, -2.0, -2.0], dtype=DTYPE))
    assert weight.grad is None
    del weight.grad_batch


def test_sgd_default_kwargs_as_in_cockpit():
    params = [torch.zeros(2, requires_grad=True)]
    assert ComputeStep.is_sgd_default_kwargs(torch.optim.SGD(params, lr=0.1))
    for kwargs in ({"momentum": 0.9}, {"weight_decay": 1e-4}, {"momentum": 0.0, "dampening": 0.1},
                   {"momentum": 0.9, "nesterov": True}):
        assert not ComputeStep.is_sgd_default_kwargs(torch.optim.SGD(params, lr=0.1, **kwargs))
    adam = torch.optim.Adam(params)
    assert not ComputeStep.is_sgd_default_kwargs(adam)
    with pytest.raises(ValueError, match="SGD"):
        ComputeStep.update_sgd_default_kwargs(adam, [id(params[0])])
    with pytest.raises(ValueError, match="not parameters of this SGD"):
        ComputeStep.compute_update_step(torch.optim.SGD(params, lr=0.1), [id(torch.zeros(1))])


def mean_loss(problem: str, params: list[torch.Tensor], inputs, labels) -> float:
    """The mean cross-entropy at ``params`` (a fresh plain model, ``torch.func.functional_call``)."""
    model = PROBLEMS[problem][0](bias=True)
    names = [name for name, _ in model.named_parameters()]
    outputs = torch.func.functional_call(model, dict(zip(names, params)), (inputs,))
    return nn.functional.cross_entropy(outputs, labels).item()


def brute_force_cabs(grads, loss_value: float, lr: float) -> float:
    """``lr * sum_j Var_i(g_ij) / L`` with the biased variance over the batch."""
    flat = torch.cat([g.flatten(1) for g in grads], dim=1)
    return lr * flat.var(0, unbiased=False).sum().item() / loss_value


class UpdateCABS(CABS):
    """CABS whose learning rate is read off the optimizer's next update (``ComputeStep``), d = -lr g."""

    def _compute(self, global_step, params, batch_loss):
        optimizer = get_optimizer(global_step)
        if not ComputeStep.is_sgd_default_kwargs(optimizer):
            raise ValueError("only plain SGD")
        updates = ComputeStep.compute_update_step(optimizer, [id(p) for p in params])
        d = torch.cat([updates[id(p)].flatten() for p in params])
        g = torch.cat([p.grad.flatten() for p in params])
        self._lr = -(d @ g / (g @ g)).item()
        return super()._compute(global_step, params, batch_loss)

    def get_lr(self, optimizer):
        return self._lr


@pytest.mark.parametrize("extended", [True, False])
def test_cabs_subclasses_match_brute_force(extended):
    lr = 0.3
    quantities = [AutogradCABS(linear(1)), UpdateCABS(linear(2)), CABS(linear(1))]
    refs, _, cockpit = run(quantities, extended=extended, steps=3, lr=lr)
    output = cockpit.get_output()
    for step, (grads, params, inputs, labels) in refs.items():
        expected = brute_force_cabs(grads, mean_loss("mlp", params, inputs, labels), lr)
        assert output[step]["AutogradCABS"] == pytest.approx(expected, rel=1e-10)
        assert output[step]["CABS"] == pytest.approx(expected, rel=1e-10)
        if step % 2 == 0:
            assert output[step]["UpdateCABS"] == pytest.approx(expected, rel=1e-10)
        else:
            assert "UpdateCABS" not in output[step]


def test_cabs_subclass_rejects_adam_like_cockpit():
    with pytest.raises(ValueError, match="SGD"):
        run([AutogradCABS(linear(1))], steps=1, optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01))


def test_compute_step_inside_a_transform_during_backward():
    """Cockpit's Alpha pattern: the update of a parameter computed in a transform of its ``grad_batch``."""
    seen = {}

    class StepInBackward(SingleStepQuantity):
        def extensions(self, global_step):
            return [BatchGrad()]

        def extension_hooks(self, global_step):
            optimizer = self._optimizer

            def update(grad_batch):
                param = grad_batch._param_weakref()
                return ComputeStep.compute_update_step(optimizer, [id(param)])[id(param)]

            return [BatchGradTransformsHook({"update": update})]

        def _compute(self, global_step, params, batch_loss):
            seen[global_step] = [p.grad_batch_transforms["update"].clone() for p in params]
            return 0.0

    quantity = StepInBackward(linear(1))
    model, lossfunc, _ = make_problem("mlp")
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    quantity._optimizer = opt
    cockpit = Cockpit(params, [quantity])
    for step in range(3):
        inputs, labels = make_batch("mlp", 4, seed=step)
        opt.zero_grad()
        loss = lossfunc(model(inputs), labels)
        with cockpit(step, info={"batch_size": 4}):
            loss.backward()
        before = [p.detach().clone() for p in params]
        opt.step()
        for p, b, predicted in zip(params, before, seen[step]):
            torch.testing.assert_close(predicted, p.detach() - b, rtol=1e-10, atol=1e-14)


# ---- 4. BatchGradTransformsHook --------------------------------------------------------------------
def abs_max_transform(grad_batch):
    return grad_batch.abs().amax()


def shape_transform(grad_batch):
    return tuple(grad_batch._param_weakref().shape)


class SampleNorms(SingleStepQuantity):
    """A custom quantity written for Cockpit: per-sample gradient norms from Cockpit's transforms."""

    def extensions(self, global_step):
        return [BatchGrad()] if self.should_compute(global_step) else []

    def extension_hooks(self, global_step):
        if not self.should_compute(global_step):
            return []
        return [
            BatchGradTransformsHook_BatchL2Grad(),
            BatchGradTransformsHook_BatchDotGrad(),
            BatchGradTransformsHook({"abs_max": abs_max_transform, "batch_l2": batch_l2_transform}),
        ]

    def _compute(self, global_step, params, batch_loss):
        batch_size = get_batch_size(global_step)
        transforms = [p.grad_batch_transforms for p in params]
        return {
            "norms": batch_size * sum(t["batch_l2"] for t in transforms).sqrt(),
            "gram": batch_size**2 * sum(t["batch_dot"] for t in transforms),
            "abs_max": [t["abs_max"] for t in transforms],
        }


class SecondMoments(SingleStepQuantity):
    """Another one (no BatchGrad asked for): Cockpit's sum_grad_squared, and the parameter via ``_param_weakref``."""

    def extension_hooks(self, global_step):
        return [BatchGradTransformsHook_SumGradSquared(), BatchGradTransformsHook({"shape": shape_transform})]

    def _compute(self, global_step, params, batch_loss):
        assert all(p.grad_batch_transforms["shape"] == tuple(p.shape) for p in params)
        return [p.grad_batch_transforms["sum_grad_squared"] for p in params]


def builtins():
    return [GradNorm(linear(1)), NormTest(linear(1)), CABS(linear(1)), GradHist1d(linear(1), bins=9)]


@pytest.mark.parametrize("extended", [True, False])
@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_transform_hooks_alongside_builtins_match_brute_force(problem, extended):
    batch_size = 5
    inside_seen = {}

    def inside(step, params):  # Cockpit's semantics: collected during the backward pass
        inside_seen[step] = {frozenset(p.grad_batch_transforms) for p in params}

    custom = [SampleNorms(linear(1)), SecondMoments(linear(2))]
    refs, params, cockpit = run(builtins() + custom, problem=problem, extended=extended, batch_size=batch_size,
                                inside=inside)
    alone = run(builtins(), problem=problem, extended=extended, batch_size=batch_size)[2]
    output = cockpit.get_output()
    everything = frozenset({"batch_l2", "batch_dot", "abs_max", "sum_grad_squared", "shape"})
    # at step 1 only the built-ins run; CABS's per-sample sum of squares is there as "sum_grad_squared",
    # as Cockpit's CABS puts it there with its BatchGradTransformsHook_SumGradSquared
    assert inside_seen == {0: {everything}, 1: {everything - {"shape"}}, 2: {everything}}
    assert not any(hasattr(p, "grad_batch_transforms") for p in params)  # freed after the step, as in Cockpit
    assert not any(hasattr(p, "grad_batch") for p in params)
    for step, (grads, _, _, _) in refs.items():
        flat = torch.cat([g.flatten(1) for g in grads], dim=1)  # g_i, float64
        value = output[step]["SampleNorms"]
        np.testing.assert_allclose(value["norms"], flat.norm(dim=1).numpy(), rtol=1e-10)
        np.testing.assert_allclose(value["gram"], (flat @ flat.T).numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(value["abs_max"], [g.abs().max().item() / batch_size for g in grads], rtol=1e-10)
        if step % 2 == 0:
            for moment, g in zip(output[step]["SecondMoments"], grads):
                np.testing.assert_allclose(moment, (g**2).sum(0).numpy() / batch_size**2, rtol=1e-10, atol=1e-16)
        else:
            assert "SecondMoments" not in output[step]
        for name in ("GradNorm", "NormTest", "CABS"):  # the built-ins are unchanged by the custom quantities
            np.testing.assert_allclose(output[step][name], alone.get_output()[step][name], rtol=1e-12)
        np.testing.assert_array_equal(output[step]["GradHist1d"]["hist"], alone.get_output()[step]["GradHist1d"]["hist"])


def test_transform_hooks_merge_and_conflict():
    class SameName(SingleStepQuantity):
        def extension_hooks(self, global_step):
            return [BatchGradTransformsHook({"batch_l2": lambda grad_batch: grad_batch.sum()})]

        def _compute(self, global_step, params, batch_loss):
            return 0.0

    first, second = SampleNorms(linear(1)), SampleNorms(linear(1))  # equal transforms: merged, computed once
    calls = []

    def counting(grad_batch):
        calls.append(1)
        return grad_batch.shape[0]

    class Counting(SingleStepQuantity):
        def extension_hooks(self, global_step):
            return [BatchGradTransformsHook({"count": counting})]

        def _compute(self, global_step, params, batch_loss):
            return [p.grad_batch_transforms["count"] for p in params]

    counters = [Counting(linear(1)), Counting(linear(1))]
    _, params, cockpit = run([first, second] + counters, steps=1)
    assert len(calls) == len(params)  # one call per parameter although two quantities asked
    assert cockpit.get_output()[0]["Counting"] == [5] * len(params)
    np.testing.assert_allclose(first.get_output()[0]["norms"], second.get_output()[0]["norms"])
    with pytest.raises(ValueError, match="two different transforms under the name 'batch_l2'"):
        run([SampleNorms(linear(1)), SameName(linear(1))], steps=1)


def test_transform_hook_in_a_plain_backpack_pass():
    model, lossfunc, _ = make_problem("mlp")
    inputs, labels = make_batch("mlp", 4, seed=3)
    grads = per_sample_grads(model, inputs, labels)
    hook = BatchGradTransformsHook_BatchL2Grad()
    with backpack(BatchGrad(), extension_hook=hook):
        lossfunc(model(inputs), labels).backward()
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad_batch_transforms["batch_l2"], g.flatten(1).pow(2).sum(1) / 16)


# ---- 6. user extensions and the quantities' BackPACK buffers ----------------------------------------
def test_extension_hooks_see_the_quantities_buffers_and_user_exts():
    """Inside the context, BackPACK's buffers of the quantities (HessTrace's diag_h) and of ``*exts``
    (BatchL2Grad) are on the parameters, as in Cockpit; after it only those of ``*exts`` are."""
    read = {}

    class Spy(SingleStepQuantity):
        def extension_hooks(self, global_step):
            def hook(module):
                for p in module.parameters(recurse=False):
                    read.setdefault(global_step, {})[id(p)] = (
                        p.diag_h.detach().clone(), p.batch_l2.detach().clone(), dict(p.grad_batch_transforms)
                    )

            return [hook]

        def _compute(self, global_step, params, batch_loss):
            return 0.0

    after_backward = {}

    def inside(step, params):
        after_backward[step] = [(p.diag_h.clone(), p.batch_l2.clone()) for p in params]

    quantities = [HessTrace(linear(1)), Spy(linear(1)), SecondMoments(linear(1))]
    refs, params, cockpit = run(quantities, steps=3, batch_size=4, exts=(BatchL2Grad(),), inside=inside)
    for step, (grads, params_then, inputs, labels) in refs.items():
        model = make_problem("mlp")[0]
        with torch.no_grad():
            for p, value in zip(model.parameters(), params_then):
                p.copy_(value)
        diagonal = torch.diagonal(dense_hessian(model, inputs, labels)).split([p.numel() for p in params])
        for k, (p, g) in enumerate(zip(params, grads)):
            diag_h, batch_l2, transforms = read[step][id(p)]
            torch.testing.assert_close(diag_h.reshape(-1), diagonal[k], rtol=1e-8, atol=1e-12)
            torch.testing.assert_close(batch_l2, g.flatten(1).pow(2).sum(1) / 16, rtol=1e-10, atol=1e-16)
            torch.testing.assert_close(transforms["sum_grad_squared"], (g**2).sum(0) / 16, rtol=1e-10, atol=1e-16)
            torch.testing.assert_close(after_backward[step][k][0], diag_h)
            torch.testing.assert_close(after_backward[step][k][1], batch_l2)
    assert all(hasattr(p, "batch_l2") and not hasattr(p, "diag_h") for p in params)
    torch.testing.assert_close(params[0].batch_l2, refs[2][0][0].flatten(1).pow(2).sum(1) / 16, rtol=1e-10, atol=0)


# ---- 5. instruments: a dashboard of one's own --------------------------------------------------------
COCKPIT_GAUGES = [
    "alpha_gauge", "distance_gauge", "grad_norm_gauge", "histogram_1d_gauge", "histogram_2d_gauge",
    "gradient_tests_gauge", "hyperparameter_gauge", "max_ev_gauge", "performance_gauge", "tic_gauge",
    "trace_gauge", "mean_gsnr_gauge", "early_stopping_gauge", "cabs_gauge",
]


def test_instrument_names_and_signatures_are_cockpits():
    from cockpit_like import instruments

    assert set(COCKPIT_GAUGES) <= set(instruments.__all__)
    for name in COCKPIT_GAUGES:
        parameters = list(inspect.signature(getattr(instruments, name)).parameters)
        assert parameters[1:3] == ["fig", "gridspec"] and len(parameters) >= 3
    assert list(inspect.signature(instruments.histogram_1d_gauge).parameters)[3:] == ["y_scale"]
    assert list(inspect.signature(instruments.histogram_2d_gauge).parameters)[3:] == [
        "transformation", "marginals", "idx"]


def gid_artists(ax, gid):
    return [a for a in list(ax.lines) + list(ax.patches) + list(ax.collections) if a.get_gid() == gid]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_custom_dashboard_from_gauges(tmp_path):
    from cockpit_like import instruments
    from cockpit_like.quantities import Alpha, InnerTest, Loss, OrthoTest

    quantities = [Alpha(linear(1)), GradNorm(linear(1)), NormTest(linear(1)), InnerTest(linear(1)),
                  OrthoTest(linear(1)), Loss(linear(1)), GradHist1d(linear(1), bins=20),
                  GradHist2d(linear(2), bins=(6, 8), keep_individual=True)]
    refs, params, cockpit = run(quantities, steps=5)
    cockpit.log(4, epoch_count=1, train_loss=0.9, valid_loss=1.0, test_loss=1.1, train_accuracy=0.6,
                valid_accuracy=0.5, test_accuracy=0.4, learning_rate=0.3)
    logpath = cockpit.write(str(tmp_path / "run"))

    plotter = CockpitPlotter()
    with pytest.raises(ValueError, match="no data yet"):
        instruments.alpha_gauge(plotter, Figure(), Figure().add_gridspec(1, 1)[0, 0])
    plotter.read(logpath[: -len(".json")])

    fig = Figure(figsize=(14, 9))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, 4)
    alpha = instruments.alpha_gauge(plotter, fig, grid[0, 0])
    norm = instruments.grad_norm_gauge(plotter, fig, grid[0, 1])
    tests = instruments.gradient_tests_gauge(plotter, fig, grid[0, 2])
    cabs = instruments.cabs_gauge(plotter, fig, grid[0, 3])
    hist1d = instruments.histogram_1d_gauge(plotter, fig, grid[1, 0])
    joint = instruments.histogram_2d_gauge(plotter, fig, grid[1, 1:3])
    layer = instruments.histogram_2d_gauge(plotter, fig, grid[1, 3], idx=2, marginals=False,
                                           transformation=lambda counts: counts)
    loss = instruments.performance_gauge(plotter, fig, grid[2, :3])
    lr = instruments.hyperparameter_gauge(plotter, fig, grid[2, 3])
    # 9 calls; 2 extra axes for the marginals, 1 for the accuracy beside the loss
    assert len(fig.axes) == 12
    assert all(ax.figure is fig for ax in (alpha, norm, tests, cabs, hist1d, joint, layer, loss, lr))

    output = cockpit.get_output()
    # alpha: the parabola x^2 and one histogram of all stored alphas
    (parabola,) = gid_artists(alpha, "alpha:parabola")
    np.testing.assert_allclose(parabola.get_ydata(), np.asarray(parabola.get_xdata()) ** 2)
    # gradient norm: one raw point per step, the norm over all parameters of the mean gradient
    (raw,) = gid_artists(norm, "raw:GradNorm")
    expected = [torch.cat([g.mean(0).flatten() for g in refs[s][0]]).norm().item() for s in range(5)]
    np.testing.assert_allclose(raw.get_ydata(), expected, rtol=1e-10)
    assert {line.get_gid() for line in tests.lines} >= {"raw:NormTest", "raw:InnerTest", "raw:OrthoTest"}
    assert any(t.get_gid() == "not-tracked" for t in cabs.texts)  # CABS was not tracked: blank, no error
    # 1-D histogram of the last step, log counts
    (bars,) = gid_artists(hist1d, "hist1d")
    grads = np.concatenate([g.reshape(-1).numpy() for g in refs[4][0]])
    np.testing.assert_array_equal(bars.get_data().values, np.maximum(ref_hist1d(grads, 20, -2, 2), 0.5))
    assert hist1d.get_yscale() == "log"
    # 2-D histogram of the last tracked step (4) with its marginals
    last = output[4]["GradHist2d"]
    (mesh,) = gid_artists(joint, "hist2d")
    np.testing.assert_allclose(np.ma.filled(mesh.get_array(), 0).reshape(8, 6), np.ma.filled(
        np.ma.masked_equal(np.log10(1 + last["hist"].T.astype(float)), 0), 0))
    (x_margin,) = [a for ax in fig.axes for a in gid_artists(ax, "hist2d:marginal:x")]
    (y_margin,) = [a for ax in fig.axes for a in gid_artists(ax, "hist2d:marginal:y")]
    np.testing.assert_array_equal(x_margin.get_data().values, last["hist"].sum(1))
    np.testing.assert_array_equal(y_margin.get_data().values, last["hist"].sum(0))
    grads4, params4 = refs[4][0], refs[4][1]
    expected_layer = ref_hist2d(grads4[2].reshape(-1).numpy(),
                                params4[2].unsqueeze(0).expand_as(grads4[2]).reshape(-1).numpy(), (6, 8),
                                ((-1, 1), (-2, 2)))
    (layer_mesh,) = gid_artists(layer, "hist2d:param_2")
    np.testing.assert_array_equal(np.ma.filled(layer_mesh.get_array(), 0).reshape(8, 6), expected_layer.T)
    # performance: loss and the logged accuracies side by side
    assert [ax.get_gid() for ax in fig.axes if ax.get_gid() in ("instrument:loss", "instrument:accuracy")] == [
        "instrument:loss", "instrument:accuracy"]
    (accuracy,) = [ax for ax in fig.axes if ax.get_gid() == "instrument:accuracy"]
    (train_accuracy,) = gid_artists(accuracy, "raw:train_accuracy")
    assert list(train_accuracy.get_ydata()) == [0.6]
    (rate,) = gid_artists(lr, "raw:learning_rate")
    assert list(rate.get_ydata()) == [0.3]

    path = tmp_path / "mine.png"
    fig.savefig(path)
    pixels = matplotlib.image.imread(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pixels.std() > 0.05

    # the same gauges straight from the live cockpit (no plotter) draw the same data
    live = Figure()
    ax = instruments.grad_norm_gauge(cockpit, live, live.add_gridspec(1, 1)[0, 0])
    np.testing.assert_allclose(gid_artists(ax, "raw:GradNorm")[0].get_ydata(), expected, rtol=1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gauges_after_plot_use_the_plotters_data_and_log_axis():
    from cockpit_like import instruments

    quantity = GradNorm(linear(1))
    run([quantity], steps=3)
    output = {step: {"GradNorm": value} for step, value in quantity.get_output().items()}
    plotter = CockpitPlotter()
    plotter.plot(output, show_plot=False, show_log_iter=True)
    fig = Figure()
    ax = instruments.grad_norm_gauge(plotter, fig, fig.add_gridspec(1, 1)[0, 0])
    assert ax.get_xscale() == "symlog"
    linear_hist = instruments.histogram_1d_gauge(plotter, fig, fig.add_gridspec(1, 1)[0, 0], y_scale="linear")
    assert any(t.get_gid() == "not-tracked" for t in linear_hist.texts)  # no GradHist1d in this run


# ---- the documented examples run and are right ------------------------------------------------------
def documented_class(name: str):
    """Execute the code block of docs/custom_quantities.md that defines ``name``; return the class."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "custom_quantities.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]
    (code,) = [block for block in blocks if f"class {name}(" in block]
    namespace: dict = {}
    exec(compile(code, f"docs/custom_quantities.md:{name}", "exec"), namespace)  # noqa: S102 - our own docs
    return namespace[name]


@pytest.mark.parametrize("extended", [True, False])
def test_documented_subclass_and_transform_examples(extended):
    lr, batch_size = 0.3, 6
    autograd_cabs = documented_class("AutogradCABS")(linear(1))
    largest = documented_class("LargestSampleNorm")(linear(1))
    refs, _, _ = run([autograd_cabs, largest], extended=extended, batch_size=batch_size, lr=lr)
    for step, (grads, params, inputs, labels) in refs.items():
        expected = brute_force_cabs(grads, mean_loss("mlp", params, inputs, labels), lr)
        assert autograd_cabs.get_output()[step] == pytest.approx(expected, rel=1e-10)
        flat = torch.cat([g.flatten(1) for g in grads], dim=1)
        assert largest.get_output()[step] == pytest.approx(flat.norm(dim=1).max().item(), rel=1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_subclass_example_script_agrees_with_builtin_cabs():
    from examples.subclass_quantity import main

    output = main(steps=2)
    for values in output.values():
        assert values["AutogradCABS"] == pytest.approx(values["CABS"], rel=1e-5)  # float32 model


# ---- 7. BackPACK's errors on a model it cannot handle are explained --------------------------------
def test_curvature_extension_on_a_skip_connection_is_explained():
    from cockpit_like.cockpit import UnsupportedLayerError

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.inner(x)) + x)

    torch.manual_seed(0)
    model = extend(Residual().to(DTYPE))
    cockpit = Cockpit(model.parameters(), [HessTrace(linear(1), curvature="diag_h")])  # the default (auto) would use Hutchinson
    inputs, labels = torch.randn(5, 4, dtype=DTYPE), torch.randint(0, 3, (5,))
    loss = extend(nn.CrossEntropyLoss())(model(inputs), labels)
    with pytest.raises(UnsupportedLayerError, match="curvature='auto'") as error:
        with cockpit(0, info={"batch_size": 5}):
            loss.backward()
    assert "DiagHessian()" in str(error.value) and isinstance(error.value.__cause__, (AssertionError, NotImplementedError))
    assert not any(hasattr(p, "diag_h") for p in model.parameters())
