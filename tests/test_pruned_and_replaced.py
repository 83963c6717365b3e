"""Parameters that move while the run goes on: ``torch.nn.utils.prune`` (``weight`` becomes ``weight_orig *
weight_mask``, computed by a forward pre-hook) and a layer's weight replaced by a new ``nn.Parameter``. The per-sample
rows go to the parameter the module uses now, never to one it no longer uses (float64, against a loop of
``torch.autograd.grad``)."""

import pytest
import torch
import torch.nn.utils.prune as prune
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like import quantities as Q


def _norm_test(model, x, y, params):
    """NormTest from per-sample gradients by a loop of autograd.grad (QUANTITIES.md)."""
    rows = []
    for i in range(len(y)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    g = torch.stack(rows)
    mean = g.mean(0)
    b = len(y)
    return (((g - mean) ** 2).sum() / (b * (b - 1) * mean.dot(mean))).sqrt().item()


@pytest.mark.parametrize("extended", [False, True])
@pytest.mark.parametrize("when", ["before", "mid-run"])
def test_a_pruned_layer_gives_the_rows_of_weight_orig(extended, when):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    if extended:
        model = extend(model)
    if when == "before":
        prune.l1_unstructured(model[0], "weight", amount=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(list(model.parameters()), quantities=[Q.NormTest(track_schedule=lambda s: True)], model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1 and when == "mid-run":
            prune.l1_unstructured(model[0], "weight", amount=0.5)
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=generator)
        expected = _norm_test(model, x, y, [p for p in model.parameters()])
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward()
        assert cockpit.checks[step]["valid"], cockpit.checks[step]
        assert cockpit.get_output()[step]["NormTest"] == pytest.approx(expected, rel=1e-10)
        # the re-run put the module's computed weight back as the user's forward pass left it
        if hasattr(model[0], "weight_orig"):
            assert model[0].weight.grad_fn is not None  # the user's forward pass's tensor, with its graph
            assert torch.equal(model[0].weight.detach(), (model[0].weight_orig * model[0].weight_mask).detach())
        optimizer.step()


@pytest.mark.parametrize("model_given", [False, True])
def test_a_replaced_weight_is_no_longer_the_tracked_parameters(model_given):
    """The tracked weight is replaced by a new nn.Parameter: the old one has no rows (zero, in no_gradient) and the
    step stays valid, with BackPACK and with the hooks alike."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    if not model_given:
        model = extend(model)
    cockpit = Cockpit(
        list(model.parameters()), quantities=[Q.NormTest(track_schedule=lambda s: True), Q.GradNorm(track_schedule=lambda s: True)],
        **({"model": model} if model_given else {}),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    old = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if step == 1:  # the layer's weight replaced, the optimizer rebuilt on the model's parameters
            model[0].weight = nn.Parameter(model[0].weight.detach() * 0.5)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        info = {"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
        with cockpit(step, info=info):
            losses.mean().backward()
        checks = cockpit.checks[step]
        assert checks["valid"], checks
        if step >= 1:
            assert checks["no_gradient"] == ["0.weight"]
            assert cockpit.get_output()[step]["GradNorm"][0] == 0.0
        optimizer.step()
    assert old.grad is not None  # the old weight's gradient of step 0 is left as it was
