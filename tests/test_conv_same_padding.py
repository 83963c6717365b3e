"""Extended convolutions with ``padding="same"`` after the first layer (sixth outside round, curvature 5).

BackPACK's derivatives subtract the padding from sizes, so a ``"same"`` convolution that BackPACK
backpropagates through (any but the first layer) raised a raw ``TypeError: unsupported operand type(s) for
-: 'int' and 'str'``. The cockpit now gives such a layer its padding as numbers during the pass where
``"same"`` pads symmetrically (``dilation * (kernel - 1)`` even), and puts ``"same"`` back after;
elsewhere BackPACK's error is the cockpit's clear UnsupportedLayerError. Checked against the dense float64
Hessian of the mean loss.
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like import quantities as Q
from cockpit_like.backends.step import UnsupportedLayerError
from tests.helpers import dense_hessian

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")
DT = torch.float64
EVERY = lambda step: True  # noqa: E731


def _model(kernel, dilation=1):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Conv2d(2, 2, kernel, padding="same", dilation=dilation), nn.Tanh(),
        nn.Flatten(), nn.Linear(2 * 3 * 3, 3),
    ).to(DT)


def _track(model, quantities, x, y):
    model = extend(model)
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    out = model(x)
    loss = extend(nn.CrossEntropyLoss())(out, y)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    with cockpit(0, info={"batch_size": len(y), "individual_losses": losses, "loss": loss}):
        loss.backward()
    return cockpit


@pytest.mark.parametrize("kernel, dilation", [(3, 1), (3, 2), (5, 1)])
def test_hess_trace_equals_the_dense_hessians_blocks(kernel, dilation):
    x = torch.randn(4, 1, 5, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    y = torch.tensor([0, 2, 1, 2])
    model = _model(kernel, dilation)
    hessian = dense_hessian(model, x, y)
    sizes = [p.numel() for p in model.parameters()]
    expected, start = [], 0
    for size in sizes:
        expected.append(float(torch.diagonal(hessian)[start : start + size].sum()))
        start += size
    quantity = Q.HessTrace(EVERY)
    cockpit = _track(model, [quantity], x, y)
    assert cockpit.get_output()[0]["HessTrace"] == pytest.approx(expected, rel=1e-8, abs=1e-12)
    assert model[2].padding == "same"  # put back: the model is the user's
    assert model(x).shape == (4, 3)


def test_an_asymmetric_same_padding_is_the_clear_error():
    x = torch.randn(4, 1, 5, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    y = torch.tensor([0, 2, 1, 2])
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Conv2d(2, 2, 2, padding="same"), nn.Tanh(), nn.Flatten(), nn.Linear(18, 3),
    ).to(DT)
    with pytest.raises(UnsupportedLayerError, match="curvature='auto'"):
        _track(model, [Q.HessTrace(EVERY)], x, y)
    assert model[2].padding == "same"
