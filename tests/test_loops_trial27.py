"""Outside trial 27 (held out for trial 25's check: losses with derivatives, and look-alikes that are not).

31 of 32 loops whose loss reaches the parameters around their calls were left out with a true note, 15 of 15
look-alikes kept exact per-sample numbers. Found:

- a critic with LayerNorm under a gradient penalty: PyTorch's third derivative through LayerNorm is wrong, so the
  Hessian-vector products are not symmetric; HessMaxEV said so and stored nothing, but HessTrace (Hutch++ in
  ``full``, and Hutchinson with 400 samples, "reliable") was stored from the same products, 0.7-4.1 errors high.
  Every trace and diagonal estimate now compares its probes' bilinear forms ``v_i^T H v_j`` and ``v_j^T H v_i``;
- a weight penalty that the model's forward returns beside its logits failed the gradient check (the same penalty
  written in the loss was a note): a call's outputs without rows are not where the hooks take rows;
- a BackPACK-extended model under an input-gradient penalty in ``full`` stopped with an error that blamed an
  evaluation batch.
"""

import pytest
import torch
import torch.nn.functional as F
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import HessTrace
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


def critic(layer_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 6), nn.LayerNorm(6) if layer_norm else nn.Identity(), nn.Tanh(),
                         nn.Linear(6, 1)).double()


def penalty_rows(model, x):
    """WGAN-GP style: each row's critic value squared plus ``(||d critic / dx|| - 1)^2``."""
    x = x.clone().requires_grad_(True)
    d = model(x)
    (g,) = torch.autograd.grad(d.sum(), x, create_graph=True)
    return d.squeeze(1) ** 2 + (g.norm(dim=1) - 1) ** 2


def _step(model, quantities):
    cockpit = Cockpit(list(model.parameters()), quantities=quantities, model=model)
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    losses = penalty_rows(model, x)
    with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    return cockpit.get_output()[0], cockpit.checks[0]


@pytest.mark.parametrize("quantities", ["hutchinson", "full"])
def test_traces_from_products_that_are_not_symmetric_are_not_stored(quantities):
    make = (lambda: [HessTrace(linear(1), curvature="hutchinson", hutchinson_samples=16)]) if quantities == "hutchinson" \
        else (lambda: configuration("full"))
    values, checks = _step(critic(layer_norm=True), make())
    assert "HessTrace" not in values
    assert any(note.startswith("HessTrace at step 0: no value stored: the Hessian-vector products are not symmetric")
               for note in checks["notes"]), checks["notes"]
    # the same loop without the LayerNorm: symmetric products, the trace stored, within its errors of the exact one
    model = critic(layer_norm=False)
    values, checks = _step(model, make())
    assert "HessTrace" in values and not any("not symmetric" in note for note in checks["notes"])
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = list(model.parameters())
    grads = torch.autograd.grad(penalty_rows(model, x).mean(), params, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    exact = sum(float(torch.cat([h.reshape(-1) for h in torch.autograd.grad(flat[i], params, retain_graph=True)])[i])
                for i in range(flat.numel()))
    error = checks["standard_errors"]["HessTrace"]["standard_error"]
    assert abs(sum(values["HessTrace"]) - exact) <= 4 * error


def test_a_penalty_returned_by_the_forward_pass_is_a_note_like_one_in_the_loss():
    class PenaltyOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.l2(torch.tanh(self.l1(x))), self.l1.weight.square().sum()

    torch.manual_seed(0)
    model = PenaltyOut().double()
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("full"), model=model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    logits, penalty = model(x)
    losses = F.cross_entropy(logits, y, reduction="none") + 1e-2 * penalty
    with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    values, checks = cockpit.get_output()[0], cockpit.checks[0]
    assert checks["valid"] and not checks["failed"], checks
    assert "info['loss'] reaches l1.weight other than through the module calls" in " ".join(checks["notes"])
    assert "NormTest" not in values and "HessMaxEV" in values


def test_an_extended_model_under_an_input_gradient_penalty_names_it():
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double())
    lossfunc = extend(nn.CrossEntropyLoss())
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("full"))
    x, y = torch.randn(8, 4, dtype=torch.float64).requires_grad_(True), torch.randint(0, 3, (8,))
    out = model(x)
    ce = F.cross_entropy(out, y, reduction="none")
    (g,) = torch.autograd.grad(ce.sum(), x, create_graph=True)
    losses = ce + 0.5 * g.square().sum(1)
    loss = lossfunc(out, y) + 0.5 * g.square().sum(1).mean()
    with pytest.raises(ValueError, match="holds a derivative of the model's outputs taken with create_graph"):
        with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": loss}):
            loss.backward(create_graph=cockpit.create_graph(0))
