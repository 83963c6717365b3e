"""Extended (BackPACK) models where BackPACK alone would go wrong (found outside the repository's tests): what it
keeps on a module (the last call's input and output) when the loop does more than the training forward pass (a
second forward pass with gradients on, a backward pass outside the cockpit's block that frees the buffers), an
autocast forward pass or a loss that is not extended under its second-order extensions, and a layer configuration
it cannot compute."""

import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def _model(extended=True, dtype=torch.float64):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)
    return extend(model) if extended else model


def _data(step, rows=8, dtype=torch.float64):
    generator = torch.Generator().manual_seed(50 + step)
    return torch.randn(rows, 6, generator=generator, dtype=dtype), torch.randint(0, 4, (rows,), generator=generator)


def _train(extra=None, preset="economy", extended=True, autocast=False, steps=3, dtype=torch.float64):
    model = _model(extended, dtype)
    lossfunc = extend(nn.CrossEntropyLoss()) if extended else nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model)
    for step in range(steps):
        x, y = _data(step, dtype=dtype)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outputs = model(x)
            loss = lossfunc(outputs, y)
            losses = nn.functional.cross_entropy(outputs, y, reduction="none")
        if extra == "forward":  # a probe or evaluation batch with gradients on, never backpropagated
            model(_data(99, rows=5, dtype=dtype)[0]).sum()
        elif extra == "same_rows":  # the same number of rows: nothing in the shapes tells
            model(_data(98, dtype=dtype)[0]).sum()
        elif extra == "autograd":  # a backward pass outside the block: BackPACK's hooks free what they kept
            x1, y1 = _data(97, rows=1, dtype=dtype)
            torch.autograd.grad(nn.functional.cross_entropy(model(x1), y1), list(model.parameters()))
        info = {"batch_size": len(y), "individual_losses": losses, "loss": loss, "optimizer": optimizer}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return cockpit


@pytest.mark.parametrize("extra", ["forward", "same_rows", "autograd"])
def test_another_pass_of_an_extended_model_leaves_the_step_exact(extra):
    """Before: a raw size mismatch from the histograms, an AttributeError ('input0'), or an invalid step whose
    reason named other causes. The modules whose kept buffers are another call's are found from the recorded
    calls, and the hooks take their rows: every value equals the run without the extra pass."""
    reference = _train().get_output()
    output = _train(extra).get_output()
    for step in range(3):
        assert output[step].get("checks", {}).get("valid", True)
        for name in ("GradNorm", "NormTest", "InnerTest", "OrthoTest"):
            assert output[step][name] == pytest.approx(reference[step][name], rel=1e-10), (step, name)


def test_another_pass_before_backpacks_curvature_is_a_clear_error():
    with pytest.raises(ValueError, match=r"ran again after the forward pass of the loss.*torch.no_grad\(\)"):
        _train("forward", preset="business")


def test_autocast_leaves_backpacks_second_order_quantities_out_with_a_note():
    """Under bfloat16 autocast BackPACK's Hessian diagonal fails on the mixed dtypes (before: a raw einsum error,
    the whole step lost); the quantities that asked for it store nothing at the step and a note says why, the rest
    of the preset stores what the same model without extend stores."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extended = _train(preset="business", autocast=True, dtype=torch.float32)
        plain = _train(preset="business", extended=False, autocast=True, dtype=torch.float32)
    output, reference = extended.get_output(), plain.get_output()
    for step in range(3):
        notes = output[step]["checks"]["notes"]
        assert "HessTrace" not in output[step] and "TICDiag" not in output[step]
        assert any("HessTrace, TICDiag left out" in n and "half precision" in n for n in notes), notes
        assert "HessTrace" in reference[step]  # the hooks' Hessian-vector products run under autocast
        assert output[step]["GradNorm"] == pytest.approx(reference[step]["GradNorm"], rel=1e-3)


@pytest.mark.parametrize("tracked", ["all", "first_layer"])
def test_backpacks_curvature_without_an_extended_loss_is_a_clear_error(tracked):
    """An extended model with a loss that is not (F.cross_entropy): BackPACK's Hessian diagonal has no loss
    Hessian to start from, and with only the first layer tracked it held the activations' residual terms alone
    (HessTrace -0.70 where the dense Hessian gives -0.23, TICDiag -49 for 1.9, on a valid step). Now an error
    says to extend the loss, or to use Hessian-vector products."""
    model = _model()
    params = list(model[0].parameters()) if tracked == "first_layer" else list(model.parameters())
    cockpit = Cockpit(params, quantities=configuration("business"), model=model)
    x, y = _data(0)
    outputs = model(x)
    loss = nn.functional.cross_entropy(outputs, y)
    info = {"batch_size": 8, "individual_losses": nn.functional.cross_entropy(outputs, y, reduction="none"),
            "loss": loss, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(Exception, match=r"no extended loss module ran in this backward pass.*curvature='hutchinson'"):
        with cockpit(0, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))


def test_a_transposed_convolution_with_output_padding_takes_the_hooks_path():
    """BackPACK 1.7 fails on ConvTranspose1d/2d with output_padding (a raw shape error from its unfold, found
    outside the tests): the hooks take that layer's rows, exact against a loop of torch.autograd.grad, and the
    curvature 'auto' uses Hessian-vector products on the model."""
    from cockpit_like.quantities import GradNorm, HessTrace, NormTest
    from cockpit_like.utils.schedules import linear

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1), nn.Tanh(),
                                 nn.Flatten(), nn.Linear(24, 3)).double())  # fmt: skip
    quantities = [GradNorm(linear(1)), NormTest(linear(1)), HessTrace(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    assert quantities[2].method == "hutchinson"
    x, y = torch.randn(5, 2, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    rows = [torch.autograd.grad(nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
            for i in range(5)]  # fmt: skip
    outputs = model(x)
    losses = nn.functional.cross_entropy(outputs, y, reduction="none")
    loss = extend(nn.CrossEntropyLoss())(outputs, y)
    with cockpit(0, info={"batch_size": 5, "individual_losses": losses, "loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    values = cockpit.get_output()[0]
    grads = torch.stack([torch.cat([g.reshape(-1) for g in row]) for row in rows])
    mean = grads.mean(0)
    expected = ((grads - mean).square().sum() / (4 * 5 * mean.square().sum())).sqrt().item()
    assert values["NormTest"] == pytest.approx(expected, rel=1e-10)
    sizes = [p.numel() for p in model.parameters()]
    assert values["GradNorm"] == pytest.approx([float(g.norm()) for g in mean.split(sizes)], rel=1e-10)
    assert "HessTrace" in values
