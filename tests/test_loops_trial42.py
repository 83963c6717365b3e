"""Outside trial 42 (2026-11-29): real users' loops on BackPACK-extended models, held out for trial 39's fixes.

342 runs on 38 set-ups: every finished run bitwise the run without a cockpit; 30 values wrong with no note, all
from convolutions whose ``padding_mode`` is not ``"zeros"`` (BackPACK's derivatives pad with zeros whatever the
mode). Each finding here against float64 brute force.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.step import UnsupportedLayerError
from cockpit_like.quantities import HessTrace, TICDiag
from cockpit_like.utils import schedules
from cockpit_like.utils.configuration import configuration
from tests.helpers import assert_rows_match, gram_probe

DTYPE = torch.float64


def _net(mode: str, dims: int) -> nn.Sequential:
    torch.manual_seed(0)
    if dims == 1:
        conv, features = nn.Conv1d(2, 3, 3, padding=1, padding_mode=mode), 3 * 6
    else:
        conv, features = nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode), 3 * 5 * 4
    return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(features, 4)).to(DTYPE)


def _batch(dims: int):
    generator = torch.Generator().manual_seed(1)
    shape = (6, 2, 6) if dims == 1 else (6, 2, 5, 4)
    return torch.randn(*shape, generator=generator, dtype=DTYPE), torch.randint(0, 4, (6,), generator=generator)


def _step(model, quantities, with_model=True, extra=()):
    model, lossfunc = extend(model), extend(nn.CrossEntropyLoss())
    cockpit = Cockpit(model.parameters(), quantities=[*quantities, *extra], **({"model": model} if with_model else {}))
    x, y = _batch(model[0].weight.dim() - 2)
    out = model(x)
    loss = lossfunc(out, y)
    info = {"batch_size": 6, "individual_losses": nn.functional.cross_entropy(out, y, reduction="none"), "loss": loss,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "outputs": out}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))
    return cockpit


@pytest.mark.parametrize("mode,dims", [("reflect", 2), ("circular", 1), ("replicate", 2)])
@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
def test_backpacks_curvature_on_other_padding_modes_is_refused(mode, dims, curvature):
    """HessTrace and TIC from BackPACK on a reflect- or circular-padded convolution were another function's (the
    conv block 0.859 for 1.187, TICDiag -2373 for 188), on valid steps with no note: the step now raises naming
    the layer and its padding mode, and stores nothing."""
    quantities = [HessTrace(schedules.linear(1), curvature=curvature), TICDiag(schedules.linear(1), curvature=curvature)]
    with pytest.raises(UnsupportedLayerError, match=rf"padding_mode='{mode}': BackPACK's convolution derivatives"):
        _step(_net(mode, dims), quantities)


@pytest.mark.parametrize("mode,dims", [("reflect", 2), ("circular", 1)])
def test_the_presets_estimate_there_and_the_rows_are_the_brute_forces(mode, dims):
    """``business`` with ``model=``: curvature='auto' takes Hessian-vector products, and the per-sample rows (the
    hooks', not BackPACK's, which ignored the padding mode: the gradient check failed at every step) equal a loop
    of torch.autograd.grad."""
    model = _net(mode, dims)
    x, y = _batch(dims)
    probe = gram_probe(schedules.linear(1))
    cockpit = _step(model, configuration("business"), extra=[probe])
    hess_trace = next(q for q in cockpit.quantities if isinstance(q, HessTrace))
    assert hess_trace.method == "hutchinson"
    assert "HessTrace" in cockpit.get_output()[0]
    assert_rows_match(cockpit, probe, 0, _rows(model, x, y))


def _rows(model, x, y) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(grads)


def test_without_the_model_the_error_says_to_pass_it():
    with pytest.raises(UnsupportedLayerError, match=r"reads the model from Cockpit\(\.\.\., model=model\)"):
        _step(_net("reflect", 2), [HessTrace(schedules.linear(1), curvature="diag_h")], with_model=False)


def _mlp(outputs: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, outputs)).to(DTYPE)


@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
def test_two_extended_loss_modules_are_named(curvature):
    """``CE + 0.1 * MSE``, both extended: a raw shape error from BackPACK's GGN, or its "No accumulation rule"
    under a list of requirements that were all met; now the cause, and the advice that works."""
    model, ce, mse = extend(_mlp()), extend(nn.CrossEntropyLoss()), extend(nn.MSELoss())
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(schedules.linear(1), curvature=curvature)])
    x, y = torch.randn(6, 5, dtype=DTYPE), torch.randint(0, 4, (6,))
    out = model(x)
    loss = ce(out, y) + 0.1 * mse(out, nn.functional.one_hot(y, 4).to(DTYPE))
    with pytest.raises(UnsupportedLayerError, match="two extended loss modules ran in this backward pass"
                                                    r".*curvature='hutchinson'"):  # fmt: skip
        with cockpit(0, info={"batch_size": 6}):
            loss.backward()


def _regression(curvature_quantity, flatten_inside: bool):
    model = _mlp(1)
    if flatten_inside:
        model.append(nn.Flatten(0))
    model, lossfunc = extend(model), extend(nn.MSELoss())
    cockpit = Cockpit(model.parameters(), quantities=[curvature_quantity])
    x, y = torch.randn(6, 5, dtype=DTYPE), torch.randn(6, dtype=DTYPE)
    out = model(x)
    loss = lossfunc(out if flatten_inside else out.squeeze(1), y)
    with cockpit(0, info={"batch_size": 6}):
        loss.backward()
    return cockpit.get_output()[0], model, x, y


def test_an_output_reshaped_outside_the_model_is_named_and_the_fix_inside_is_exact():
    """MSE on ``model(x).squeeze(1)``: the error said the loss "reads a part of its output ... a model with two
    heads"; it names the reshape and the fix, ``nn.Flatten(0)`` as the last module, whose values are the dense
    Hessian's."""
    with pytest.raises(UnsupportedLayerError, match=r"reads its whole output \(shape \[6, 1\]\) reshaped outside the model"):
        _regression(HessTrace(schedules.linear(1), curvature="diag_h"), flatten_inside=False)
    output, model, x, y = _regression(HessTrace(schedules.linear(1), curvature="diag_h"), flatten_inside=True)
    from torch.func import functional_call, hessian

    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    shapes = [p.shape for p in model.parameters()]
    twin = nn.Sequential(*[m for m in model]).to(DTYPE)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(vector):
        pieces = {n: v.reshape(s) for n, v, s in zip(names, vector.split(sizes), shapes)}
        return nn.functional.mse_loss(functional_call(twin, pieces, (x,)), y)

    expected = [float(d.sum()) for d in hessian(loss)(flat).diagonal().split(sizes)]
    assert output["HessTrace"] == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_a_runtime_error_inside_backpack_is_the_cockpits_error():
    """KFLR on a reshaped output: BackPACK's raw ``einsum`` RuntimeError, now the cockpit's error with its fixes."""
    from cockpit_like.quantities import KFACTrace

    with pytest.raises(UnsupportedLayerError, match=r"RuntimeError: einsum.*KFACTrace\(curvature='empirical'\)"):
        _regression(KFACTrace(schedules.linear(1), curvature="kflr"), flatten_inside=False)
