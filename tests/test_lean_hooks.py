"""Lean hooks: BackPACK's full backward hooks swapped for tensor hooks on module outputs.

Every BackPACK extension must give the same results on a lean model as on the
same model with the hooks ``backpack.extend`` set, and the cockpit must give
the same outputs with ``lean_hooks=True`` (the default) as with ``False``.
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref

import pytest
import torch
from backpack import backpack, extend
from backpack.context import CTX
from backpack.custom_module.branching import Parallel, SumModule
from backpack.extensions import (
    KFAC,
    KFLR,
    BatchDiagGGNExact,
    BatchDiagHessian,
    BatchGrad,
    BatchL2Grad,
    DiagGGNExact,
    DiagGGNMC,
    DiagHessian,
    SqrtGGNExact,
    SumGradSquared,
    Variance,
)
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.lean_hooks import can_make_lean, is_lean, make_lean, restore
from cockpit_like.utils.configuration import configuration
from tests.helpers import DTYPE, make_problem, train


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 8), nn.Sigmoid(), nn.Linear(8, 4))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 3, 2), nn.ELU(), nn.AvgPool2d(2, ceil_mode=False), nn.ZeroPad2d(1),
        nn.Flatten(), nn.Linear(27, 4),
    )  # fmt: skip


def _residual():
    # a branch: x -> Linear+Tanh and x -> Linear, summed (BackPACK's branching modules)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(12, 8),
        nn.Sigmoid(),
        Parallel(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8), merge_module=SumModule()),
        nn.LeakyReLU(),
        nn.Linear(8, 4),
    )


# BackPACK's transposed convolution for curvature extensions runs in float32 only
MODELS = {
    "mlp": (_mlp, (3, 4), DTYPE),
    "cnn": (_cnn, (2, 6, 6), torch.float32),
    "residual": (_residual, (3, 4), DTYPE),
}
LOSSES = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss}
EXTENSIONS = [
    BatchGrad, BatchL2Grad, SumGradSquared, Variance, DiagGGNExact, lambda: DiagGGNMC(mc_samples=3),
    DiagHessian, BatchDiagGGNExact, BatchDiagHessian, lambda: KFAC(mc_samples=2), KFLR, SqrtGGNExact,
]  # fmt: skip


def _build(model_name: str, loss_name: str, lean: bool):
    factory, shape, dtype = MODELS[model_name]
    torch.manual_seed(0)
    model = extend(factory().to(dtype))
    lossfunc = extend(LOSSES[loss_name]())
    if lean:
        for module in [*model.modules(), lossfunc]:
            make_lean(module)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(6, *shape, generator=generator, dtype=dtype)
    if loss_name == "ce":
        targets = torch.randint(0, 4, (6,), generator=generator)
    else:
        targets = torch.randn(6, 4, generator=generator, dtype=dtype)
    return model, lossfunc, inputs, targets


def _run(model, lossfunc, inputs, targets, extension):
    model.zero_grad()
    loss = lossfunc(model(inputs), targets)
    torch.manual_seed(2)  # the MC extensions sample at the loss module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BackPACK's full hook warns at the first layer
        with backpack(extension):
            loss.backward()
    results = {}
    for name, param in model.named_parameters():
        results[(name, "grad")] = param.grad.clone()
        value = getattr(param, extension.savefield)
        results[(name, extension.savefield)] = value
    return results


def _assert_same(expected, got):
    # the same operations in the same order: equal up to the last bits
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        pairs = zip(value, got[key]) if isinstance(value, (list, tuple)) else [(value, got[key])]
        assert not isinstance(value, (list, tuple)) or len(value) == len(got[key]), key
        for a, b in pairs:
            tol = 1e-12 if a.dtype == torch.float64 else 1e-6
            torch.testing.assert_close(b, a, rtol=tol, atol=tol * 1e-2, msg=str(key))


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("make_extension", EXTENSIONS, ids=lambda e: getattr(e, "__name__", "mc"))
def test_every_backpack_extension_gives_the_same_results(model_name, loss_name, make_extension):
    full = _build(model_name, loss_name, lean=False)
    lean = _build(model_name, loss_name, lean=True)
    assert all(not is_lean(m) for m in full[0].modules())
    swapped = [m for m in [*lean[0].modules(), lean[1]] if is_lean(m)]
    assert swapped and all(not m._backward_hooks for m in swapped)
    try:
        expected = _run(*full, make_extension())
    except NotImplementedError:
        pytest.skip("BackPACK does not support this extension on this model")
    got = _run(*lean, make_extension())
    _assert_same(expected, got)
    # the stored inputs and outputs are freed as after a full hook
    for module_full, module_lean in zip([*full[0].modules(), full[1]], [*lean[0].modules(), lean[1]]):
        for attribute in ("output", "input0"):
            assert hasattr(module_full, attribute) == hasattr(module_lean, attribute), (module_lean, attribute)
    assert not hasattr(lean[1], "input0")


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_backward_without_extensions_frees_io_as_backpack(model_name):
    """Outside ``with backpack(...)`` the lean hook only frees the stored input/output, as BackPACK's hook."""
    full, lean = _build(model_name, "ce", lean=False), _build(model_name, "ce", lean=True)
    for model, lossfunc, inputs, targets in (full, lean):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lossfunc(model(inputs), targets).backward()
    pairs = list(zip([*full[0].modules(), full[1]], [*lean[0].modules(), lean[1]]))
    for module_full, module_lean in pairs:
        for attribute in ("output", "input0"):
            assert hasattr(module_full, attribute) == hasattr(module_lean, attribute), (module_lean, attribute)
    assert not hasattr(lean[1], "input0") and not hasattr(lean[0][-1], "output")
    # an extension hook alone (no extension) still runs on every lean module, in BackPACK's order
    seen = {"full": [], "lean": []}
    for key, (model, lossfunc, inputs, targets) in zip(("full", "lean"), (full, lean)):
        loss = lossfunc(model(inputs), targets)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with backpack(extension_hook=lambda module, key=key: seen[key].append(type(module).__name__)):
                loss.backward()
    assert seen["lean"] == seen["full"] and seen["lean"]


def test_what_is_left_alone():
    extended = extend(nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True), nn.LSTM(3, 2)))
    linear, inplace_relu, lstm = extended
    assert can_make_lean(linear)
    assert not make_lean(inplace_relu) and not make_lean(lstm)
    assert not make_lean(nn.Linear(2, 2))  # not extended
    with_user_hook = extend(nn.Linear(2, 2))
    with_user_hook.register_full_backward_hook(lambda *args: None)
    assert not make_lean(with_user_hook)
    assert len(with_user_hook._backward_hooks) == 2


def test_restore_and_backpack_hook_removal():
    module = extend(nn.Linear(3, 2))
    assert make_lean(module) and is_lean(module) and make_lean(module)
    assert not module._backward_hooks
    restore(module)
    assert not is_lean(module) and len(module._backward_hooks) == 1
    assert make_lean(module)
    CTX.remove_hooks()  # BackPACK's clean-up removes our forward hook with its own hooks
    assert not is_lean(module) and not module._forward_hooks


def test_copies_are_lean_and_run_on_themselves():
    model, lossfunc, inputs, targets = _build("mlp", "ce", lean=True)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(is_lean(a) == is_lean(b) for a, b in zip(model.modules(), clone.modules()))
        with torch.no_grad():
            for p in clone.parameters():
                p.mul_(2.0)  # the copy differs: its hooks must see the copy, not the original
        results = _run(clone, lossfunc, inputs, targets, BatchGrad())
        for name, param in clone.named_parameters():
            torch.testing.assert_close(results[(name, "grad_batch")].sum(0), param.grad)
            assert not hasattr(dict(model.named_parameters())[name], "grad_batch")


def test_lean_modules_are_garbage_collected():
    model, lossfunc, inputs, targets = _build("cnn", "ce", lean=True)
    lossfunc(model(inputs), targets)  # the output tensors carry hooks that refer to the modules
    ref = weakref.ref(model[0])
    del model
    gc.collect()
    assert ref() is None


def _cockpit_run(lean_hooks: bool, problem: str):
    model, lossfunc, individual = make_problem(problem)
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"), lean_hooks=lean_hooks)
    train(model, lossfunc, individual, cockpit, problem, steps=3)
    lean = [is_lean(m) for m in [*model.modules(), lossfunc]]
    return cockpit.get_output(), lean


def _assert_outputs_equal(a, b, path="output"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_outputs_equal(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_outputs_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=path)
    elif isinstance(a, float):
        assert b == pytest.approx(a, rel=1e-10, abs=1e-12, nan_ok=True), path
    else:
        import numpy as np

        if isinstance(a, np.ndarray):
            np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12, err_msg=path)
        else:
            assert a == b, path


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_cockpit_outputs_do_not_depend_on_lean_hooks(problem):
    lean_output, lean = _cockpit_run(True, problem)
    full_output, full = _cockpit_run(False, problem)
    assert any(lean) and not any(full)  # swapped after step 0 when on, never when off
    _assert_outputs_equal(full_output, lean_output)
