"""Outside trial 12's loop findings: SAM written as an optimizer wrapper, and SAM's two passes in blocks of one step.

F1: the widely used SAM wrapper (``first_step`` / ``second_step`` around an inner optimizer) never calls its own
``step()``; with the block around the second backward pass (at the perturbed point) and ``info["optimizer"] =
sam``, the check at the optimizer's step never ran, and UpdateSize and Distance were stored 13-80% off on valid
steps. F2: both passes in blocks of one step, ``p.grad`` zeroed between them: the steps failed the gradient check,
but GradNorm (half of ``p.grad``'s norm) and Loss (the mean of the losses at two points) were kept.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

DT = torch.float64


class SAM(torch.optim.Optimizer):
    """SAM as the common wrapper: ``first_step`` moves to the perturbed point, ``second_step`` moves back and steps
    the inner optimizer; ``step()`` itself needs a closure and is not used."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.norm(torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]]))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * group["rho"] / (norm + 1e-12))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()

    def step(self, closure=None):
        raise NotImplementedError("SAM requires a closure")


def sam_run(declare_base: bool, preset: str = "economy", steps: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DT)
    sam = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration(preset), model=model)
    grad_norms = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            x, y = torch.randn(12, 6, dtype=DT), torch.randint(0, 4, (12,))
            F.cross_entropy(model(x), y).backward()
            sam.first_step()
            losses = F.cross_entropy(model(x), y, reduction="none")
            info = {"batch_size": 12, "individual_losses": losses, "loss": losses.mean(),
                    "optimizer": sam.base_optimizer if declare_base else sam}
            with cockpit(step, info=info):
                losses.mean().backward(create_graph=cockpit.create_graph(step))
            grad_norms[step] = [float(p.grad.norm()) for p in model.parameters()]
            sam.second_step()
    return cockpit, grad_norms


def test_a_sam_wrapper_declared_as_the_optimizer_stores_no_update_or_distance():
    cockpit, grad_norms = sam_run(declare_base=False)
    output = cockpit.get_output()
    for step in range(4):
        values = output[step]
        assert "UpdateSize" not in values and "Distance" not in values, (step, sorted(values))
        # what the block's backward pass computed is right: the gradient SGD steps with
        assert all(abs(a - b) <= 1e-12 * b for a, b in zip(values["GradNorm"], grad_norms[step]))
        assert values["checks"]["valid"]
    notes = " ".join(output[0]["checks"]["notes"])
    assert "did not step before the next tracked step" in notes and "SAM.base_optimizer" in notes
    assert "Distance" in notes and "UpdateSize" in notes
    # every later step, the last one included (no step follows it to show the update), says why
    for step in (1, 2, 3):
        assert any("did not make the update after step 0" in n for n in output[step]["checks"]["notes"]), step


def test_a_sam_wrapper_under_the_full_preset_stores_no_update_either():
    cockpit, _ = sam_run(declare_base=False, preset="full", steps=3)
    output = cockpit.get_output()
    assert not any("UpdateSize" in output[s] or "Distance" in output[s] or "Alpha" in output[s] for s in range(3))


def test_the_inner_optimizer_declared_gets_the_check_at_its_step():
    """The control: the optimizer that steps is declared; its step sees the parameters moved back (the note
    that existed before), at every step."""
    cockpit, _ = sam_run(declare_base=True)
    output = cockpit.get_output()
    for step in range(4):
        assert "UpdateSize" not in output[step] and "Distance" not in output[step]
        assert any("changed between the backward pass" in n for n in output[step]["checks"]["notes"]), step


def mlp_sgd_cockpit():
    """The small MLP of these tests (seed 0), plain SGD and an economy cockpit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)


def tracked_pass(cockpit, model, optimizer, step, batch=None):
    """``batch`` (a fresh one of 12 rows where None) through ``model``, its backward pass in ``cockpit``'s block of
    ``step``; the batch."""
    x, y = batch if batch is not None else (torch.randn(12, 6, dtype=DT), torch.randint(0, 4, (12,)))
    optimizer.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(step, info={"batch_size": 12, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
        losses.mean().backward()
    return x, y


def test_an_optimizer_that_steps_keeps_update_and_distance():
    """No false alarm: a plain loop with the declared optimizer stepping stores both."""
    model, optimizer, cockpit = mlp_sgd_cockpit()
    before = {}
    for step in range(3):
        tracked_pass(cockpit, model, optimizer, step)
        before[step] = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
    output = cockpit.get_output()
    for step in range(2):
        expected = [float((a - b).norm()) for a, b in zip(before[step + 1], before[step])]
        assert all(abs(a - b) <= 1e-12 * b for a, b in zip(output[step]["UpdateSize"], expected))
    assert all("Distance" in output[s] for s in range(3))


def test_sam_passes_in_two_blocks_of_one_step_keep_no_gradient_norm_or_loss():
    """Both of SAM's backward passes inside blocks of the same step, ``p.grad`` zeroed between them: the step
    fails its checks, and nothing is kept (before: GradNorm was half of ``||p.grad||``, Loss the mean of the
    losses at the two points, on steps 1-3)."""
    model, optimizer, cockpit = mlp_sgd_cockpit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            x, y = tracked_pass(cockpit, model, optimizer, step)
            norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            shifts = []
            with torch.no_grad():
                for p in model.parameters():
                    shifts.append(0.05 * p.grad / norm)
                    p.add_(shifts[-1])
            tracked_pass(cockpit, model, optimizer, step, (x, y))
            with torch.no_grad():
                for p, shift in zip(model.parameters(), shifts):
                    p.sub_(shift)
            optimizer.step()
    output = cockpit.get_output()
    for step in range(4):
        assert not output[step]["checks"]["valid"]
        assert "GradNorm" not in output[step] and "Loss" not in output[step], (step, sorted(output[step]))


class ManifoldMixup(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x, perm, lam):
        h = torch.tanh(self.a(x))
        return self.b(lam * h + (1 - lam) * h[perm])


def test_manifold_mixup_inside_the_model_names_the_rows_picked_by_index():
    """F6: rows mixed through a permutation inside the model: the re-run on one row fails with an IndexError,
    and the error now says what that usually means (before: graphs, flattened positions, in-place inputs)."""
    from cockpit_like.backends.rerun import UncoveredParameterError

    torch.manual_seed(0)
    model = ManifoldMixup().to(DT)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    x, y = torch.randn(12, 6, dtype=DT), torch.randint(0, 4, (12,))
    losses = F.cross_entropy(model(x, torch.randperm(12), 0.7), y, reduction="none")
    try:
        with cockpit(0, info={"batch_size": 12, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    except UncoveredParameterError as error:
        assert "picks rows of the batch by index" in str(error)
    else:
        assert "NormTest" not in cockpit.get_output().get(0, {})


@pytest.mark.parametrize("heads", ["both", "tail"])
def test_an_extended_loss_on_part_of_an_output_is_refused_with_the_cause(heads):
    """F5: one output layer split into two heads, both losses extended, the full preset: BackPACK's DiagHessian
    replay raised a raw shape error from inside BackPACK; now an UnsupportedLayerError that says why and what
    to do instead. One extended loss on the columns after the first (``mse(out[:, 2:], t)``) was refused as
    "not extended" (the part starts elsewhere in memory, and nothing reached the layer)."""
    from backpack import extend

    from cockpit_like.backends.step import UnsupportedLayerError

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).to(DT))
    ce, mse = extend(nn.CrossEntropyLoss()), extend(nn.MSELoss())
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("full"), model=model)
    x, y, t = torch.randn(12, 6, dtype=DT), torch.randint(0, 4, (12,)), torch.randn(12, 2, dtype=DT)
    out = model(x)
    if heads == "both":
        loss = ce(out[:, :4], y) + 0.5 * mse(out[:, 4:], t)
        rows = F.cross_entropy(out[:, :4], y, reduction="none") + 0.5 * F.mse_loss(out[:, 4:], t, reduction="none").mean(1)
    else:
        t = torch.randn(12, 4, dtype=DT)
        loss, rows = mse(out[:, 2:], t), F.mse_loss(out[:, 2:], t, reduction="none").mean(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (both heads extended: two loss modules in one backward pass, named as such since outside trial 42)
        cause = "two extended loss modules ran in this backward pass" if heads == "both" else "reads a part of its output"
        with pytest.raises(UnsupportedLayerError, match=cause):
            with cockpit(0, info={"batch_size": 12, "individual_losses": rows, "loss": loss}):
                loss.backward(create_graph=cockpit.create_graph(0))


def test_a_sum_reduced_extended_loss_is_told_to_backpropagate_the_mean():
    """F4: ``extend(CrossEntropyLoss(reduction="sum"))`` backpropagated, ``info["loss"]`` its mean: the step is
    refused (the factor cannot be seen inside an extended loss module), and the reason now says the loss is a
    whole multiple of info['loss'] and to backpropagate the mean (before: it blamed an auxiliary loss and said to
    declare the loss backpropagated, which a ValueError then refused)."""
    from backpack import extend

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DT))
    summed = extend(nn.CrossEntropyLoss(reduction="sum"))
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    x, y = torch.randn(12, 6, dtype=DT), torch.randint(0, 4, (12,))
    out = model(x)
    total = summed(out, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": 12, "individual_losses": F.cross_entropy(out, y, reduction="none"),
                              "loss": total / 12}):
            total.backward()
    reason = next(f["reason"] for f in cockpit.checks[0]["failed"] if f["check"] == "backpropagated_loss")
    assert "12 x info['loss']" in reason and "reduction='mean'" in reason
    assert "auxiliary loss" not in reason


def test_a_sam_perturbation_removed_by_subtraction_keeps_alpha():
    """F7: hand-written SAM, the block around the first backward pass, the perturbation removed by ``p.sub_(e)``
    (a rounding error away from the saved parameters, not bitwise) before ``SGD(momentum).step()``. Alpha of
    step 1 was withdrawn ("not in the direction the optimizer's look-ahead predicted"): the update's norm read
    at the end step, after the next perturbation and its removal, was compared for bitwise equality with the one
    settled at the optimizer's step. Now every Alpha from step 1 on is stored and equals the brute-force value
    (step 0's look-ahead was made from the first pass's gradients, and says so)."""
    from tests.helpers import make_batch, make_problem, per_sample_grads
    from tests.test_alpha import reference_alpha

    model, lossfunc, individual = make_problem("mlp")
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    cockpit = Cockpit(params, quantities=configuration("economy"), model=model)
    observed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(5):
            x, y = make_batch("mlp", 6, seed=100 + step)
            grads = per_sample_grads(model, x, y)
            opt.zero_grad()
            out = model(x)
            loss, losses = lossfunc(out, y), individual(out, y)
            observed[step] = {"params": [p.detach().clone() for p in params], "grads": grads,
                              "loss": loss.item(), "losses": losses.detach()}
            with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": loss, "optimizer": opt}):
                loss.backward()
            with torch.no_grad():
                norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
                perturbation = [0.05 * p.grad / norm for p in params]
                for p, e in zip(params, perturbation):
                    p.add_(e)
            opt.zero_grad()
            lossfunc(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(params, perturbation):
                    p.sub_(e)
            opt.step()
    alpha = next(q for q in cockpit.quantities if type(q).__name__ == "Alpha").get_output()
    assert sorted(alpha) == [1, 2, 3]
    for step, value in alpha.items():
        assert abs(value - reference_alpha(observed[step], observed[step + 1], 6)) < 1e-8 * max(1, abs(value))
