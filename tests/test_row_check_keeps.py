"""A step whose rows are wrong keeps the quantities that read no per-sample rows.

The gradient check compares the per-sample rows with ``p.grad``: where it fails (a penalty on the parameters
inside each row's loss, as a Bayes-by-backprop KL term or a hand-written L2 term), the rows are wrong, but
``p.grad`` is the gradient autograd accumulated in the block from zero. Loss, GradNorm, UpdateSize, Distance
and DataStats read only ``p.grad``, the parameters, the loss and the forward pass: they are stored, checked
here against float64 brute force; the per-sample quantities are not, and a note says which are which.
Outside trial 9 (a Bayes-by-backprop net on raw wine features) stored nothing at every step, so its
diagnosis could not see the unnormalized inputs.
"""

import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.diagnosis import group_findings
from cockpit_like.quantities import DataStats
from cockpit_like.utils.configuration import configuration

STEPS, ROWS, PENALTY = 3, 12, 0.03


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def data(step, scale=1.0):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, 5, generator=generator, dtype=torch.float64) * scale
    return x, torch.randint(0, 3, (ROWS,), generator=generator)


def row_losses(net, x, y):
    """Each row's loss with the parameters' L2 term in it: its mean is the loss backpropagated."""
    penalty = PENALTY * sum(p.square().sum() for p in net.parameters())
    return nn.functional.cross_entropy(net(x), y, reduction="none") + penalty


def run(factor=1.0, quantities=None, scale=1.0, **kwargs):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(net.parameters(), quantities=quantities or configuration("economy"), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = data(step, scale)
            losses = row_losses(net, x, y)
            loss = losses.mean()
            info = {"batch_size": ROWS, "individual_losses": losses, "loss": loss, "optimizer": optimizer}
            with cockpit(step, info=info):
                (loss * factor).backward()
            optimizer.step()
    return cockpit


def brute_force(factor=1.0):
    """Per step: the loss, the gradient norms per parameter (of the mean loss) and the parameters, without the
    cockpit (the optimizer steps on ``factor`` x the gradient, as a loop that backpropagates ``factor * loss``)."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses, norms, params = [], [], [[p.detach().clone() for p in net.parameters()]]
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = data(step)
        loss = row_losses(net, x, y).mean()
        grads = torch.autograd.grad(loss, list(net.parameters()))
        for p, g in zip(net.parameters(), grads):
            p.grad = factor * g
        losses.append(loss.item())
        norms.append([float(g.norm()) for g in grads])
        optimizer.step()
        params.append([p.detach().clone() for p in net.parameters()])
    return losses, norms, params


@pytest.mark.parametrize("factor", [1.0, 4.0], ids=["plain", "undeclared_factor"])
def test_the_gradient_check_fails_and_the_quantities_without_rows_are_stored_exactly(factor):
    """Also with a factor the loop does not declare (a GradScaler, micro-batches need not be): p.grad is unscaled by
    the factor the hook saw, as on a valid step (outside trial 10's second look: it was kept only where declared)."""
    cockpit = run(factor=factor)
    output = cockpit.get_output()
    losses, norms, params = brute_force(factor)
    # since outside trial 25 the penalty is seen before the backward pass (the loss reaches the weights around the
    # layers' calls): the per-sample quantities are left out with a note, the step valid (it failed the gradient
    # check before; that path: test_a_parameter_no_call_owns_fails_the_gradient_check_and_keeps_the_rest)
    assert not cockpit.invalid_steps
    for step in range(STEPS):
        values = output[step]
        assert values["checks"]["failed"] == []
        for name in ("NormTest", "InnerTest", "OrthoTest", "GradHist1d", "Alpha"):
            assert name not in values  # the rows are wrong: no number
        assert values["Loss"] == pytest.approx(losses[step], rel=1e-12)
        assert values["GradNorm"] == pytest.approx(norms[step], rel=1e-10)
        distance = [float((now - start).norm()) for now, start in zip(params[step], params[0])]
        assert values["Distance"] == pytest.approx(distance, rel=1e-10, abs=1e-14)
        if step + 1 < STEPS:  # UpdateSize of step t ends at step t + 1
            update = [float((after - before).norm()) for after, before in zip(params[step + 1], params[step])]
            assert values["UpdateSize"] == pytest.approx(update, rel=1e-10)
        note = " ".join(values["checks"]["notes"])
        assert "per-sample quantities ['Alpha', 'GradHist1d', 'InnerTest', 'NormTest', 'OrthoTest'] left out" in note
        assert "a penalty on them: use the optimizer's weight_decay" in note


def test_a_parameter_no_call_owns_fails_the_gradient_check_and_keeps_the_rest():
    """A tracked parameter that no module call uses, read in each row's loss: the hooks give it no rows, the
    gradient check fails, and the quantities that read no rows are stored (exact), the others not."""
    net = model()
    extra = nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
    cockpit = Cockpit([*net.parameters(), extra], quantities=configuration("economy"), model=net)
    x, y = data(0)
    losses = nn.functional.cross_entropy(net(x), y, reduction="none") + PENALTY * extra.square() * x[:, 0].abs()
    expected = torch.autograd.grad(losses.mean(), [*net.parameters(), extra], retain_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with cockpit(0, info={"batch_size": ROWS, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    values = cockpit.get_output()[0]
    assert [f["check"] for f in values["checks"]["failed"]] == ["gradient"]
    assert "got no per-sample rows at all" in values["checks"]["failed"][0]["reason"]
    assert values["GradNorm"] == pytest.approx([float(g.norm()) for g in expected], rel=1e-12)
    assert "NormTest" not in values
    assert "stored although the step failed the gradient check" in " ".join(values["checks"]["notes"])


def _economy_loop(losses_of, zero_grad: bool) -> Cockpit:
    """SGD steps under the economy preset; ``losses_of(net, x, y)``: (individual losses, info['loss'], the tensor
    backpropagated)."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    cockpit = Cockpit(net.parameters(), quantities=configuration("economy"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(STEPS):
            if zero_grad:
                optimizer.zero_grad()
            x, y = data(step)
            rows, loss, backpropagated = losses_of(net, x, y)
            info = {"batch_size": ROWS, "individual_losses": rows, "loss": loss, "optimizer": optimizer}
            with cockpit(step, info=info):
                backpropagated.backward()
            optimizer.step()
    return cockpit


def test_a_loss_factor_not_seen_keeps_nothing():
    """Where the hook did not see the loss factor (info['loss'] a detached number), p.grad is unscaled by the
    declared factor, which nothing verified: nothing is kept."""
    def detached_loss(net, x, y):
        losses = row_losses(net, x, y)
        return losses.detach(), float(losses.mean()), 4.0 * losses.mean()

    cockpit = _economy_loop(detached_loss, zero_grad=True)
    for step in range(STEPS):
        failed = [f["check"] for f in cockpit.get_output()[step]["checks"]["failed"]]
        assert "GradNorm" not in cockpit.get_output()[step], failed


def test_a_forgotten_zero_grad_still_keeps_nothing():
    def plain_loss(net, x, y):
        losses = nn.functional.cross_entropy(net(x), y, reduction="none")
        return losses, losses.mean(), losses.mean()

    cockpit = _economy_loop(plain_loss, zero_grad=False)
    for step in range(1, STEPS):
        assert "stale_gradient" in [f["check"] for f in cockpit.get_output()[step]["checks"]["failed"]]
        assert "GradNorm" not in cockpit.get_output()[step]


def test_the_diagnosis_sees_unnormalized_inputs_through_a_failing_gradient_check():
    quantities = configuration("economy") + [DataStats(lambda step: True)]
    cockpit = run(quantities=quantities, scale=300.0, diagnose=True)
    stored = cockpit.get_output()[0]["DataStats"]
    assert stored["input_rms"] == pytest.approx(float(data(0, 300.0)[0].square().mean().sqrt()), rel=1e-12)
    causes = [incident.cause for incident in group_findings(cockpit.findings) if incident.severity == "warning"]
    assert causes and causes[0] == "unnormalized-inputs"
