"""Exact curvature of ``BCEWithLogitsLoss`` and ``MSELoss`` over outputs of any shape on extended models, float64.

BackPACK factors the loss Hessian of ``BCEWithLogitsLoss`` only for one logit
per sample with default arguments; a multi-label classifier on an extended
chain stopped the ``business`` and ``full`` presets (and HessTrace, TICDiag
alone) with ``UnsupportedLayerError`` (outside trial 35). The cockpit's
factories give the loss the diagonal factor of any outputs
(``conv_diagonals._ElementwiseBCEWithLogitsDerivatives``). Checked against
brute force independent of BackPACK: the dense Hessian of the loss
(``torch.func.hessian``) for ``diag_h``, ``J^T H_f J`` for the GGN, per-sample
gradients from ``vmap(grad)`` for TIC; BackPACK's own numbers where it runs.
``MSELoss`` on ``[B, C, H, W]`` or ``[B, C, T]`` outputs stopped the presets
with BackPACK's raw "Only 2D inputs are currently supported for MSELoss"
(outside trial 39); it gets the factor of any shape too.
"""

from __future__ import annotations

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import DiagGGNExact, DiagHessian
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

from cockpit_like import Cockpit
from cockpit_like.backends.conv_diagonals import diag_ggn_exact, diag_ggn_mc, diag_hessian
from cockpit_like.backends.step import UnsupportedLayerError
from cockpit_like.quantities import HessTrace, KFACTrace, TICDiag, TICTrace
from cockpit_like.utils import schedules
from cockpit_like.utils.configuration import configuration
from tests.helpers import plain_copy

DTYPE = torch.float64
BATCH, FEATURES, LABELS = 5, 4, 3


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(3)
    if kind == "conv":
        model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.Sigmoid(), nn.Flatten(), nn.Linear(3 * 3, LABELS))
    elif kind == "scalar":
        model = nn.Sequential(nn.Linear(FEATURES, 6), nn.Tanh(), nn.Linear(6, 1))
    else:  # Sigmoid and Tanh: DiagHessian's residual terms of both signs
        model = nn.Sequential(nn.Linear(FEATURES, 6), nn.Sigmoid(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, LABELS))
    return model.to(DTYPE)


def _data(case: str, kind: str):
    generator = torch.Generator().manual_seed(11)
    shape = {"conv": (BATCH, 2, 4), "sequence": (BATCH, 2, FEATURES)}.get(kind, (BATCH, FEATURES))
    inputs = torch.randn(*shape, generator=generator, dtype=DTYPE)
    out_shape = (BATCH, 1) if kind == "scalar" else (BATCH, 2, LABELS) if kind == "sequence" else (BATCH, LABELS)
    targets = (torch.rand(out_shape, generator=generator, dtype=DTYPE) > 0.5).to(DTYPE)
    if case == "soft":
        targets = torch.rand(out_shape, generator=generator, dtype=DTYPE)
    return inputs, targets


def _loss(case: str, kind: str) -> nn.BCEWithLogitsLoss:
    labels = 1 if kind == "scalar" else LABELS
    if case == "sum":
        return nn.BCEWithLogitsLoss(reduction="sum")
    if case == "pos_weight":
        return nn.BCEWithLogitsLoss(pos_weight=torch.linspace(0.5, 3.0, labels, dtype=DTYPE))
    if case == "class_weight":
        return nn.BCEWithLogitsLoss(weight=torch.linspace(0.2, 2.0, labels, dtype=DTYPE))
    if case == "row_weight":  # a weight per sample, broadcast over the labels
        shape = (BATCH, 1, 1) if kind == "sequence" else (BATCH, 1)
        return nn.BCEWithLogitsLoss(weight=torch.linspace(0.1, 1.5, BATCH, dtype=DTYPE).reshape(shape))
    return nn.BCEWithLogitsLoss()


def _flat(model):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def unflatten(vector):
        return {n: piece.reshape(s) for n, piece, s in zip(names, vector.split(sizes), shapes)}

    return flat, unflatten, shapes, sizes


def _brute_force(model, lossfunc, inputs, targets, curvature: str) -> list[torch.Tensor]:
    model = plain_copy(model)
    flat, unflatten, shapes, sizes = _flat(model)

    def outputs(vector):
        return functional_call(model, unflatten(vector), (inputs,))

    if curvature == "diag_h":
        diagonal = hessian(lambda vector: lossfunc(outputs(vector), targets))(flat).diagonal()
    else:
        logits = outputs(flat).detach()
        jac = jacrev(outputs)(flat).reshape(logits.numel(), -1)
        hess_f = hessian(lambda f: lossfunc(f.reshape(logits.shape), targets))(logits.reshape(-1))
        diagonal = torch.einsum("id,ij,jd->d", jac, hess_f, jac)
    return [piece.reshape(s) for piece, s in zip(diagonal.split(sizes), shapes)]


def _backpack(model, lossfunc, inputs, targets, extension) -> list[torch.Tensor]:
    model, lossfunc = extend(model), extend(lossfunc)
    model.zero_grad()
    with backpack(extension):
        lossfunc(model(inputs), targets).backward()
    diagonals = [getattr(p, extension.savefield).detach().clone() for p in model.parameters()]
    for param in model.parameters():
        delattr(param, extension.savefield)
    return diagonals


def _close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-14)


CASES = ["mean", "sum", "soft", "pos_weight", "class_weight", "row_weight"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["mlp", "conv", "sequence"])
@pytest.mark.parametrize("curvature,ours", [("diag_h", diag_hessian), ("diag_ggn_exact", diag_ggn_exact)])
def test_several_outputs_against_brute_force(curvature, ours, kind, case):
    """Multi-label logits ``[B, C]`` (and ``[B, T, C]`` from a Linear on sequences): BackPACK raised "Only
    scalar-valued predictions are currently supported"; the factories' diagonals are the dense ones."""
    model, lossfunc = _model(kind), _loss(case, kind)
    inputs, targets = _data(case, kind)
    expected = _brute_force(model, lossfunc, inputs, targets, curvature)
    assert any(bool((e != 0).any()) for e in expected)
    _close(_backpack(model, lossfunc, inputs, targets, ours()), expected)
    theirs = DiagHessian() if curvature == "diag_h" else DiagGGNExact()
    with pytest.raises(NotImplementedError):  # what it fixes: BackPACK's own extension refuses these
        _backpack(model, lossfunc, inputs, targets, theirs)


@pytest.mark.parametrize("case", ["mean", "sum", "soft"])
def test_one_logit_per_sample_is_backpacks_own_factor(case):
    """``[B, 1]`` logits with default weights: BackPACK's own code, bitwise its numbers (and the brute force)."""
    model, lossfunc = _model("scalar"), _loss(case, "scalar")
    inputs, targets = _data(case, "scalar")
    expected = _brute_force(model, lossfunc, inputs, targets, "diag_h")  # (before extend() hooks the loss)
    mine = _backpack(model, lossfunc, inputs, targets, diag_hessian())
    theirs = _backpack(model, lossfunc, inputs, targets, DiagHessian())
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    _close(mine, expected)


@pytest.mark.parametrize("case", ["pos_weight", "class_weight"])
def test_one_logit_with_weights_which_backpack_refuses(case):
    model, lossfunc = _model("scalar"), _loss(case, "scalar")
    inputs, targets = _data(case, "scalar")
    expected = _brute_force(model, lossfunc, inputs, targets, "diag_h")
    _close(_backpack(model, lossfunc, inputs, targets, diag_hessian()), expected)
    with pytest.raises(NotImplementedError, match="weight"):
        _backpack(model, lossfunc, inputs, targets, DiagHessian())


def test_negative_weights_are_refused_through_the_cockpit():
    """No square root of a loss Hessian with negative entries: the step raises the cockpit's error, naming
    the loss and the fixes (``curvature='hutchinson'``), before any value is stored."""
    model = extend(_model("mlp"))
    lossfunc = extend(nn.BCEWithLogitsLoss(weight=torch.tensor([1.0, -0.5, 1.0], dtype=DTYPE)))
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(schedules.linear(1))])
    inputs, targets = _data("mean", "mlp")
    loss = lossfunc(model(inputs), targets)
    with pytest.raises(UnsupportedLayerError, match="negative weight.*curvature='hutchinson'"):
        with cockpit(0, info={"batch_size": BATCH}):
            loss.backward()
    assert cockpit.get_output() == {}


def _per_sample_gradients(model, inputs, targets) -> torch.Tensor:
    """``[B, D]``: the gradient of each row's term of the mean loss, times ``B`` (its loss over its labels)."""
    model = plain_copy(model)
    flat, unflatten, _, _ = _flat(model)
    per_row = nn.BCEWithLogitsLoss(reduction="none")

    def row_loss(vector, x, y):
        return per_row(functional_call(model, unflatten(vector), (x.unsqueeze(0),)), y.unsqueeze(0)).mean()

    return vmap(grad(row_loss), in_dims=(None, 0, 0))(flat, inputs, targets)


def _train_tracked(cockpit, model, lossfunc, batches, rows_of):
    """Three SGD steps in the README's loop; ``batches(step)`` gives ``(inputs, targets)``; the tracked steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        inputs, targets = batches(step)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, targets)
        info = {"batch_size": BATCH, "individual_losses": rows_of(outputs, targets), "loss": loss,
                "optimizer": optimizer}  # fmt: skip
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    output = cockpit.get_output()
    tracked = [step for step in range(3) if "HessTrace" in output.get(step, {})]
    assert tracked and tracked[0] == 0
    assert all(cockpit.checks[step]["valid"] for step in tracked), cockpit.checks
    return output, tracked


@pytest.mark.parametrize("preset", ["full", "business"])
def test_presets_on_a_multi_label_classifier(preset):
    """The presets on an extended multi-label chain (outside trial 35's set-up): every step stores HessTrace
    per layer equal to the dense Hessian's blocks, and TICDiag / TICTrace equal to their definition with
    per-sample gradients from ``vmap(grad)`` (``curvature="auto"`` resolves to BackPACK's ``diag_h``)."""
    model, lossfunc = extend(_model("mlp")), extend(nn.BCEWithLogitsLoss())
    reference_loss = nn.BCEWithLogitsLoss()  # (the brute force's: functorch cannot run BackPACK's hooks)
    per_row = nn.BCEWithLogitsLoss(reduction="none")
    quantities = configuration(preset) + ([TICTrace(schedules.linear(1))] if preset == "full" else [])
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    references = {}

    def batches(step):
        inputs, targets = _data("mean", "mlp")
        inputs = inputs + step
        blocks = _brute_force(model, reference_loss, inputs, targets, "diag_h")  # (the parameters before the step)
        flat_diag = torch.cat([d.reshape(-1) for d in blocks])
        second_moment = (_per_sample_gradients(model, inputs, targets) ** 2).mean(0)
        references[step] = (
            [d.sum().item() for d in blocks],
            (second_moment / (flat_diag + 1e-7)).sum().item(),
            (second_moment.sum() / (flat_diag.sum() + 1e-7)).item(),
        )
        return inputs, targets

    output, tracked = _train_tracked(cockpit, model, lossfunc, batches, lambda out, y: per_row(out, y).mean(1))
    for step in tracked:
        traces, tic_diag, tic_trace = references[step]
        assert output[step]["HessTrace"] == pytest.approx(traces, rel=1e-9, abs=1e-12)
        assert output[step]["TICDiag"] == pytest.approx(tic_diag, rel=1e-8)
        if "TICTrace" in output[step]:
            assert output[step]["TICTrace"] == pytest.approx(tic_trace, rel=1e-9)
    hess_trace = next(q for q in cockpit.quantities if isinstance(q, HessTrace))
    tic = next(q for q in cockpit.quantities if isinstance(q, TICDiag))
    assert hess_trace.method == "diag_h" and tic.method == "diag_h"


@pytest.mark.parametrize("case", ["mean", "soft", "sum"])
def test_sampled_ggn_agrees_with_the_exact_one_in_expectation(case):
    """``DiagGGNMC`` draws one target per entry from ``Bernoulli(sigma(z))``: with many draws its diagonal is the
    exact GGN's (BackPACK refused several outputs and soft targets)."""
    model, lossfunc = _model("mlp"), _loss(case, "mlp")
    inputs, targets = _data(case, "mlp")
    expected = _brute_force(model, lossfunc, inputs, targets, "diag_ggn_exact")
    torch.manual_seed(0)
    sampled = _backpack(model, lossfunc, inputs, targets, diag_ggn_mc(mc_samples=4000))
    for mine, exact in zip(sampled, expected):
        assert float(mine.sum()) == pytest.approx(float(exact.sum()), rel=0.05)
        assert not torch.allclose(mine, exact, rtol=1e-6)  # (sampled: not the exact diagonal by accident)


def test_sampled_factor_refuses_weights():
    model, lossfunc = _model("mlp"), _loss("pos_weight", "mlp")
    inputs, targets = _data("pos_weight", "mlp")
    with pytest.raises(NotImplementedError, match="pos_weight"):
        _backpack(model, lossfunc, inputs, targets, diag_ggn_mc())


def _kfac_trace(model, lossfunc, inputs, targets, curvature, samples=1):
    quantity = KFACTrace(schedules.linear(1), curvature=curvature, mc_samples=samples)
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
    loss = lossfunc(model(inputs), targets)
    torch.manual_seed(0)
    with cockpit(0, info={"loss": loss}):
        loss.backward()
    return quantity.get_output()[0]


@pytest.mark.parametrize("case", ["mean", "sum", "soft", "pos_weight"])
def test_kflr_on_one_linear_layer_is_the_hessian_where_it_is_a_kronecker_product(case):
    """KFLR on ``nn.Linear`` with several BCE outputs: the bias block is the Hessian's ``sum_n H_n`` for any
    inputs; the weight block ``sum_n H_n (x) a_n a_n^T`` is ``G (x) A`` where every row has the same input."""
    torch.manual_seed(0)
    layer = nn.Linear(FEATURES, LABELS).to(DTYPE)
    lossfunc = _loss(case, "mlp")
    inputs, targets = _data(case, "mlp")
    inputs[:] = inputs[0]  # one input row: the weight block is a Kronecker product
    layer.bias.data = torch.linspace(-2, 2, LABELS, dtype=DTYPE)  # logits away from 0: sigma(1 - sigma) varies
    hessian_blocks = _brute_force_blocks(layer, lossfunc, inputs, targets)
    value = _kfac_trace(extend(layer), extend(lossfunc), inputs, targets, "kflr")
    for i, block in enumerate(hessian_blocks):
        assert value["trace"][i] == pytest.approx(block.trace().item(), rel=1e-10)
        assert value["frobenius"][i] == pytest.approx(torch.linalg.matrix_norm(block).item(), rel=1e-10)


def _brute_force_blocks(model, lossfunc, inputs, targets) -> list[torch.Tensor]:
    flat, unflatten, _, sizes = _flat(model)
    dense = hessian(lambda vector: lossfunc(functional_call(model, unflatten(vector), (inputs,)), targets))(flat)
    ends = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [dense[a:b, a:b] for a, b in zip(ends[:-1], ends[1:])]


def test_kfac_monte_carlo_agrees_with_kflr_in_expectation_on_several_outputs():
    traces = {}
    for curvature, samples in (("kflr", 1), ("kfac", 3000)):
        model, lossfunc = extend(_model("mlp")), extend(nn.BCEWithLogitsLoss())
        inputs, targets = _data("mean", "mlp")
        traces[curvature] = _kfac_trace(model, lossfunc, inputs, targets, curvature, samples)["trace"]
    for mc, exact in zip(traces["kfac"], traces["kflr"]):
        assert mc == pytest.approx(exact, rel=0.1)
    assert traces["kfac"] != traces["kflr"]



# ---- MSELoss on outputs that are not [B, C] ----------------------------------------------------------------------
def _mse_model(kind: str) -> nn.Sequential:
    torch.manual_seed(5)
    if kind == "image":  # [B, C, H, W] outputs (a denoiser, a segmentation regression)
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Sigmoid(), nn.Conv2d(3, 2, 2, padding=1))
    else:  # [B, C, T]: a 1-d convolution over a sequence
        model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Tanh(), nn.Conv1d(4, 3, 2))
    return model.to(DTYPE)


def _mse_data(kind: str):
    generator = torch.Generator().manual_seed(13)
    inputs = torch.randn(BATCH, 2, *((4, 3) if kind == "image" else (7,)), generator=generator, dtype=DTYPE)
    with torch.no_grad():
        targets = torch.randn_like(_mse_model(kind)(inputs))
    return inputs, targets


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["image", "sequence"])
@pytest.mark.parametrize("curvature,ours", [("diag_h", diag_hessian), ("diag_ggn_exact", diag_ggn_exact)])
def test_mse_on_outputs_of_any_shape_against_brute_force(curvature, ours, kind, reduction):
    model, lossfunc = _mse_model(kind), nn.MSELoss(reduction=reduction)
    inputs, targets = _mse_data(kind)
    expected = _brute_force(model, lossfunc, inputs, targets, curvature)
    _close(_backpack(model, lossfunc, inputs, targets, ours()), expected)
    theirs = DiagHessian() if curvature == "diag_h" else DiagGGNExact()
    with pytest.raises(ValueError, match="Only 2D inputs"):  # what it fixes
        _backpack(model, lossfunc, inputs, targets, theirs)


def test_mse_on_two_dimensional_outputs_is_backpacks_own_factor():
    model, lossfunc = _model("mlp"), nn.MSELoss()
    inputs, _ = _data("mean", "mlp")
    targets = torch.randn(BATCH, LABELS, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
    expected = _brute_force(model, lossfunc, inputs, targets, "diag_h")
    mine = _backpack(model, lossfunc, inputs, targets, diag_hessian())
    assert all(torch.equal(a, b) for a, b in zip(mine, _backpack(model, lossfunc, inputs, targets, DiagHessian())))
    _close(mine, expected)


def test_mse_sampled_ggn_on_images_agrees_with_the_exact_one_in_expectation():
    model, lossfunc = _mse_model("image"), nn.MSELoss()
    inputs, targets = _mse_data("image")
    expected = _brute_force(model, lossfunc, inputs, targets, "diag_ggn_exact")
    torch.manual_seed(0)
    sampled = _backpack(model, lossfunc, inputs, targets, diag_ggn_mc(mc_samples=4000))
    for mine, exact in zip(sampled, expected):
        assert float(mine.sum()) == pytest.approx(float(exact.sum()), rel=0.05)


@pytest.mark.parametrize("preset", ["full", "business"])
def test_presets_on_an_image_regression(preset):
    """The presets on an extended image-to-image chain with a mean MSE: HessTrace per layer equals the dense
    Hessian's blocks at every tracked step (before: BackPACK's raw ValueError at step 0)."""
    model, lossfunc = extend(_mse_model("image")), extend(nn.MSELoss())
    reference_loss = nn.MSELoss()
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset))
    references = {}

    def batches(step):
        inputs, targets = _mse_data("image")
        references[step] = [d.sum().item() for d in _brute_force(model, reference_loss, inputs, targets, "diag_h")]
        return inputs, targets

    output, tracked = _train_tracked(cockpit, model, lossfunc, batches,
                                     lambda out, y: ((out - y) ** 2).flatten(1).mean(1))  # fmt: skip
    for step in tracked:
        assert output[step]["HessTrace"] == pytest.approx(references[step], rel=1e-9, abs=1e-12)


def test_a_value_error_inside_backpack_is_the_cockpits_error_with_its_fixes(monkeypatch):
    """A ``ValueError`` that BackPACK raises for a module it cannot handle (its raw "Only 2D inputs" before this
    change) reaches the user as ``UnsupportedLayerError`` naming the quantities and the fixes."""
    from backpack.core.derivatives.mseloss import MSELossDerivatives

    from cockpit_like.backends import conv_diagonals

    monkeypatch.setattr(conv_diagonals._AnyShapeMSELossDerivatives, "_check_input_dims",
                        MSELossDerivatives._check_input_dims)  # fmt: skip
    monkeypatch.setattr(conv_diagonals._AnyShapeMSELossDerivatives, "_sqrt_hessian",
                        MSELossDerivatives._sqrt_hessian)  # fmt: skip
    model, lossfunc = extend(_mse_model("image")), extend(nn.MSELoss())
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(schedules.linear(1))])
    inputs, targets = _mse_data("image")
    loss = lossfunc(model(inputs), targets)
    with pytest.raises(UnsupportedLayerError, match="Only 2D inputs.*HessTrace.*curvature='hutchinson'"):
        with cockpit(0, info={"batch_size": BATCH}):
            loss.backward()
