"""Losses that are not one per row, and rows that are not the losses': checked at every tracked step.

Found by outside trials (contrastive and triplet losses, a siamese model on
``torch.cat([x1, x2])``, an extended model called twice, padded rows with a
NaN token mean, detached declarations): before, most stored wrong per-sample
numbers on a step marked valid. Now the per-sample quantities are left out
with a note where each row's loss reads other rows of the output
(:mod:`cockpit_like.checks.rows`), and the rest of the step is stored (checked
here against brute force in float64); rows of another batch, an extended
module called twice with BackPACK's curvature, and non-finite row losses are
clear errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.checks import coupled_rows
from cockpit_like.checks.invariants import tolerance_for
from cockpit_like.quantities import GradHist1d, GradNorm, InnerTest, Loss, NormTest
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

B = 8
PER_SAMPLE = {"NormTest", "InnerTest", "GradHist1d"}


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _quantities():
    every = linear(1)
    return [Loss(every), GradNorm(every), NormTest(every), InnerTest(every), GradHist1d(every)]


def _infonce(model, x):
    z1 = F.normalize(model(x), dim=1)
    z2 = F.normalize(model(x + 0.1 * torch.sin(3 * x)), dim=1)
    return F.cross_entropy(z1 @ z2.T / 0.5, torch.arange(len(x)), reduction="none")


def _centred(model, x):
    out = model(x)
    return ((out - out.mean(0, keepdim=True)) ** 2).sum(1)  # each row's loss reads the batch mean


def _one_step(loss_of, extended: bool, quantities=None):
    model = _net()
    if extended:
        model = extend(model)
    cockpit = Cockpit(model.parameters(), quantities=quantities or _quantities(), **({} if extended else {"model": model}))
    x = torch.randn(B, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    losses = loss_of(model, x)
    loss = losses.mean()
    with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": loss}):
        loss.backward()
    grad_norms = [float(p.grad.norm()) for p in model.parameters()]
    return cockpit, grad_norms


@pytest.mark.parametrize("extended", [False, True], ids=["hooks", "backpack"])
@pytest.mark.parametrize("loss_of", [_infonce, _centred], ids=["infonce", "centred"])
def test_a_loss_over_the_batch_leaves_the_per_sample_quantities_out_and_keeps_the_rest(loss_of, extended):
    cockpit, grad_norms = _one_step(loss_of, extended)
    output, checks = cockpit.get_output()[0], cockpit.checks[0]
    assert checks["valid"]
    assert not PER_SAMPLE & set(output)  # no per-sample number, where before they were stored wrong
    note = " ".join(checks["notes"])
    assert "not separable by rows" in note and "NormTest" in note
    assert output["GradNorm"] == pytest.approx(grad_norms, rel=1e-12)  # the batch gradient is still the gradient
    assert "Loss" in output


@pytest.mark.parametrize("extended", [False, True], ids=["hooks", "backpack"])
def test_separable_losses_keep_their_per_sample_quantities_without_a_note(extended):
    def squared(model, x):
        return (model(x) ** 2).sum(1)

    cockpit, _ = _one_step(squared, extended)
    assert PER_SAMPLE <= set(cockpit.get_output()[0])
    assert cockpit.checks[0]["notes"] == []


def test_the_check_itself_on_known_cases():
    torch.manual_seed(0)
    y = torch.randn(B, 4, dtype=torch.float64, requires_grad=True)
    separable = (y.tanh() ** 2).sum(1)
    assert coupled_rows(separable, [y], B, seed=1, tolerance_for=tolerance_for) is None
    coupled = ((y - y.mean(0)) ** 2).sum(1)
    found = coupled_rows(coupled, [y], B, seed=1, tolerance_for=tolerance_for)
    assert found is not None and found["error"] > 1e-3 and found["output"] == 0
    # rows along another dimension of the batch's size: [T, B, C] with T == B, each row's loss over its column
    t = torch.randn(B, B, 3, dtype=torch.float64, requires_grad=True)
    assert coupled_rows((t**2).sum((0, 2)), [t], B, seed=1, tolerance_for=tolerance_for) is None
    # without a graph, or not reaching the outputs: nothing can be seen, nothing is claimed
    assert coupled_rows(separable.detach(), [y], B, seed=1, tolerance_for=tolerance_for) is None
    other = torch.randn(B, dtype=torch.float64, requires_grad=True) * 2
    assert coupled_rows(other, [y], B, seed=1, tolerance_for=tolerance_for) is None


def test_the_check_moves_no_random_stream():
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    y = torch.randn(B, 4, dtype=torch.float64, requires_grad=True)
    state = torch.random.get_rng_state()
    coupled_rows(((y - y.mean(0)) ** 2).sum(1), [y], B, seed=1, tolerance_for=tolerance_for)
    assert torch.equal(torch.random.get_rng_state(), state) and not torch.equal(before, state)


def test_rows_of_another_batch_in_backpack_are_a_clear_error():
    """A pair loss over one call on torch.cat([x1, x2]): BackPACK sees 2B rows for B losses."""
    model = extend(_net())
    cockpit = Cockpit(model.parameters(), quantities=_quantities())
    x1 = torch.randn(B, 5, dtype=torch.float64)
    out = model(torch.cat([x1, x1 + 0.1]))
    losses = ((out[:B] - out[B:]) ** 2).sum(1)
    with pytest.raises(ValueError, match=r"BackPACK computed 16 per-sample rows .*individual_losses'\] has 8 rows"):
        with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()


def _siamese(model, x):
    return ((model(x) - model(x + 0.1)) ** 2).sum(1)


def test_an_extended_model_called_twice_takes_the_hooks_for_its_rows():
    """Each row's gradient is the sum over the two calls: exact against a loop of autograd.grad."""
    cockpit, _ = _one_step(_siamese, extended=True)
    output = cockpit.get_output()[0]
    assert cockpit.checks[0]["valid"] and cockpit.checks[0]["notes"] == []
    reference = _net()
    x = torch.randn(B, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    params = list(reference.parameters())
    rows = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(_siamese(reference, x[i : i + 1])[0], params)])
        for i in range(B)
    ])  # fmt: skip
    mean = rows.mean(0)
    norm_test = float((((rows - mean) ** 2).sum() / ((B - 1) * B * mean.dot(mean))).sqrt())
    assert output["NormTest"] == pytest.approx(norm_test, rel=1e-10)


def test_an_extended_model_called_twice_with_backpack_curvature_is_a_clear_error():
    with pytest.raises(ValueError, match=r"ran more than once in this backward pass .* curvature='hutchinson'"):
        _one_step(_siamese, extended=True, quantities=configuration("full"))


def test_detached_declarations_say_that_the_factor_was_not_verified():
    model = _net()
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))], model=model)
    x = torch.randn(B, 5, dtype=torch.float64)
    losses = (model(x) ** 2).sum(1)
    with cockpit(0, info={"batch_size": B, "individual_losses": losses.detach(), "loss": float(losses.mean())}):
        losses.sum().backward()  # a sum where the declarations say mean: B times the mean's gradient
    notes = cockpit.checks[0]["notes"]
    assert any(note.startswith("loss factor not verified") for note in notes)
