"""An extended model whose BackPACK buffers are gone when the cockpit's pass needs them: a clear error, not
BackPACK's raw ``AttributeError: '...' object has no attribute 'output'`` (sixth outside round, curvature 3, 4).

BackPACK keeps one forward call's input and output per extended module (the loss module too) and frees them in
the first backward pass through it. A layer used twice, or a backward pass outside the cockpit's block before
it, leaves nothing for the step's extensions, with any quantity that asks for them alone (HessTrace's
``diag_h``, KFACTrace), not only with the per-sample statistics.
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like import quantities as Q
from cockpit_like.utils.configuration import configuration

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")
DT = torch.float64
EVERY = lambda step: True  # noqa: E731

QUANTITIES = {
    "HessTrace": lambda: [Q.HessTrace(EVERY)],
    "KFACTrace": lambda: [Q.KFACTrace(EVERY, curvature="kflr")],
    "business": lambda: configuration("business"),
}


def _step(cockpit, model, lossfunc, x, y, step, before=None):
    out = model(x)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    loss = lossfunc(out, y)
    if before is not None:
        before(loss, out, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with cockpit(step, info={"batch_size": len(y), "individual_losses": losses, "loss": loss, "optimizer": opt}):
        loss.backward(create_graph=cockpit.create_graph(step))


@pytest.mark.parametrize("name", ["HessTrace", "KFACTrace"])
def test_a_layer_used_twice_is_named_before_the_pass(name):
    torch.manual_seed(0)
    shared = nn.Linear(6, 6).to(DT)
    model = extend(nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(6, 3).to(DT)))
    cockpit = Cockpit(model.parameters(), quantities=QUANTITIES[name](), model=model)
    x, y = torch.randn(6, 6, dtype=DT), torch.randint(0, 3, (6,))
    with pytest.raises(ValueError, match=r"\['Linear'\] ran more than once .* without backpack.extend"):
        _step(cockpit, model, extend(nn.CrossEntropyLoss()), x, y, 0)


def _logits_gradient(loss, out, model):
    torch.autograd.grad(loss, out, retain_graph=True)  # the user's monitoring pass: frees the loss module's buffers


def _parameters_gradient(loss, out, model):
    torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)  # through the layers too


@pytest.mark.parametrize("name", list(QUANTITIES))
@pytest.mark.parametrize("before, message", [
    (_logits_gradient, r"nothing stored on the extended module 'CrossEntropyLoss' .* outside the cockpit's block"),
    (_parameters_gradient, r"\['Linear'\] ran again .* a backward pass outside the cockpit's block freed"),
])
def test_a_backward_pass_before_the_block_is_explained_and_the_next_step_runs(name, before, message):
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    x, y = torch.randn(8, 5, dtype=DT), torch.randint(0, 3, (8,))
    quantities = QUANTITIES[name]()
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    with pytest.raises(ValueError, match=message):
        _step(cockpit, model, lossfunc, x, y, 0, before=before)
    for p in model.parameters():
        p.grad = None
    _step(cockpit, model, lossfunc, x, y, 1)  # without the outside pass: the step runs and stores its values
    output = cockpit.get_output()
    assert 0 not in output or not any(q.__class__.__name__ in output[0] for q in quantities)
    stored = [type(q).__name__ for q in quantities if type(q).__name__ in output.get(1, {})]
    assert ("HessTrace" if name == "business" else name) in stored, output.get(1)
