"""Outside trial 34 (2026-11-29): are the reasons true, and does their advice work? A tester who had not seen the
code built 60 set-ups with one known fault each (or none), classified every reason the cockpit gave against the
fault, and applied the advice. What it found, each test failing on the code before its fix:

- a term of value 0 with a gradient (``loss + (z - z.detach())``) backpropagated beside the declared loss: with
  per-sample quantities the step failed ``backpropagated_loss``; with HessMaxEV (or HessTrace) alone it was valid,
  HessMaxEV the Hessian of the other loss (1.70 for 0.606);
- the curvature left out as "not symmetric" named fused weight norms and LayerNorm where a hook of the user's
  had changed the gradient;
- label smoothing in the backpropagated loss only: the advice (pass that loss) raised an error whose causes
  did not name it;
- an undeclared division by the micro-batches, a loss not divided by its declared micro-batches and a gradient
  penalty's second pass through the loss were each read as a GradScaler (or a factor to declare);
- gradients clipped inside the block failed the gradient check with the generic list of causes (found in the
  tester's generic reasons after the round: the rows and the gradient differ by one factor in every parameter).
(Also found: a float32 loss of float64 logits read as "not a mean cross-entropy", mended in
``tests/test_loss_precision.py`` the same day.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import Alpha, GradNorm, HessMaxEV, HessTrace
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

DTYPE = torch.float64


def _problem(batch=12):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)
    g = torch.Generator().manual_seed(2)
    return model, torch.randn(batch, 6, generator=g, dtype=DTYPE), torch.randint(0, 4, (batch,), generator=g)


def _step(quantities, backpropagated, declared=None, **info):
    """One tracked step: ``backpropagated(out, rows, loss)`` is what the loop calls backward() on; ``declared``
    (default: the rows' mean) is info['loss']."""
    model, x, y = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    loss = rows.mean()
    info = {"batch_size": 12, "individual_losses": rows, "loss": loss if declared is None else declared(out, y),
            "optimizer": optimizer, **info}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            backpropagated(out, rows, loss).backward(create_graph=cockpit.create_graph(0))
    return cockpit.get_output()[0], cockpit.checks[0]


def _surrogate(out, rows, loss):
    z = (out**2).mean()
    return loss + (z - z.detach())


@pytest.mark.parametrize("make", [lambda: HessMaxEV(track_schedule=linear(1)), lambda: HessTrace(track_schedule=linear(1)),
                                  lambda: Alpha(track_schedule=linear(1))], ids=["HessMaxEV", "HessTrace", "Alpha"])  # fmt: skip
def test_a_zero_valued_term_with_a_gradient_is_seen_without_per_sample_quantities(make):
    quantity = make()
    record, checks = _step([quantity, GradNorm(track_schedule=linear(1))], _surrogate)
    name = type(quantity).__name__
    assert not checks["valid"] and [f["check"] for f in checks["failed"]] == ["backpropagated_loss"], checks
    assert "a term whose value is 0 but whose gradient is not" in checks["failed"][0]["reason"]
    assert name not in record  # (HessMaxEV stored 1.70 for 0.606 before, as valid)
    assert "GradNorm" not in record  # a failed check of the loss: nothing stored, as with per-sample quantities


def test_the_same_quantities_alone_stay_valid_on_the_declared_loss():
    record, checks = _step([HessMaxEV(track_schedule=linear(1)), HessTrace(track_schedule=linear(1))],
                           lambda out, rows, loss: loss)  # fmt: skip
    assert checks["valid"] and not checks["failed"] and "HessMaxEV" in record and "HessTrace" in record


def test_products_that_a_hook_made_asymmetric_name_the_hook_not_weight_norm():
    """A hook doubling an activation's gradient: HessTrace left out as 'not symmetric' blamed fused weight norms and
    LayerNorm (neither in the model); the note now names the user's hook and what to do instead."""
    model, x, y = _problem()
    model[0].register_forward_hook(lambda module, args, out: (out.register_hook(lambda g: 2 * g), None)[1])
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(track_schedule=linear(1)),
                                                      HessMaxEV(track_schedule=linear(1))], model=model)  # fmt: skip
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": 12, "individual_losses": rows, "loss": rows.mean()}):
            rows.mean().backward(create_graph=cockpit.create_graph(0))
    record = cockpit.get_output()[0]
    notes = [n for n in cockpit.checks[0]["notes"] if "no value stored" in n and "not symmetric" in n]
    assert "HessTrace" not in record and "HessMaxEV" not in record and len(notes) == 2
    for note in notes:
        assert "a backward hook of yours (" in note.lower() and "weight norm" not in note, note
        assert "after the cockpit's block (on p.grad" in note


def test_label_smoothing_in_the_backpropagated_loss_only_is_named_and_the_advice_leads_there():
    """The loss backpropagated with label_smoothing, the rows without: the failed check names other options of the
    same loss; following the note's advice (pass the loss backpropagated as info['loss']) raised an error whose
    causes did not name them: now both say to compute the rows with the loss's own options."""
    smoothed = lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1)  # noqa: E731
    _, checks = _step(configuration("economy"), lambda out, rows, loss: F.cross_entropy(out, _problem()[2], label_smoothing=0.1))
    reason = checks["failed"][0]["reason"]
    assert checks["failed"][0]["check"] == "backpropagated_loss" and "label_smoothing" in reason, reason
    with pytest.raises(ValueError, match="label_smoothing=0.1, reduction='none'"):
        _step(configuration("economy"), lambda out, rows, loss: F.cross_entropy(out, _problem()[2], label_smoothing=0.1),
              declared=smoothed)  # fmt: skip


def _accumulated(micro_batches_declared: int, divide: bool):
    model, x, y = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for part in (slice(0, 6), slice(6, 12)):
            out = model(x[part])
            rows = F.cross_entropy(out, y[part], reduction="none")
            info = {"batch_size": 6, "individual_losses": rows, "loss": rows.mean(), "optimizer": optimizer}
            if micro_batches_declared > 1:
                info["micro_batches"] = micro_batches_declared
            with cockpit(0, info=info):
                (rows.mean() / 2 if divide else rows.mean()).backward()
    optimizer.step()
    return [n for n in cockpit.checks[0]["notes"] if "x those of the step's mean loss" in n]


def test_an_undeclared_division_of_the_loss_is_read_as_accumulation_not_a_grad_scaler():
    (note,) = _accumulated(1, divide=True)
    assert "declare info['micro_batches'] = 2" in note and "GradScaler" not in note, note


def test_declared_micro_batches_whose_loss_was_not_divided_say_so():
    (note,) = _accumulated(2, divide=False)
    assert "not divided by 2 (loss / 2 forgotten" in note and "GradScaler" not in note, note


def test_a_factor_beside_a_failed_check_points_at_the_check():
    """A gradient penalty's second pass through the loss: the factor 2 was read as a GradScaler's."""
    model, x, y = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = rows.mean()
        with cockpit(0, info={"batch_size": 12, "individual_losses": rows, "loss": loss, "optimizer": optimizer}):
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            (loss + 1e-2 * sum((g**2).sum() for g in grads)).backward()
    (note,) = [n for n in cockpit.checks[0]["notes"] if "x those of the step's mean loss" in n]
    assert "most likely what the failed" in note and "GradScaler" not in note, note


def test_a_mean_of_row_token_means_is_named_and_its_advice_passes():
    """Each row's loss its own token mean over a padded batch: TICDiag was left out with the generic 'not a mean
    cross-entropy'; the reason names the unequal weights of the positions, and its advice passes the check."""
    from cockpit_like.backends.sampled import mean_cross_entropy_check

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, dtype=DTYPE, requires_grad=True)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 3:] = -100
    per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    counted = (labels != -100).sum(1).to(per_token.dtype)
    row_means = per_token.sum(1) / counted
    verdict, why = mean_cross_entropy_check(row_means.mean(), logits, row_means)
    assert verdict is False and "each row's own token mean" in why and "token sum times B / N" in why
    advised = per_token.sum(1) * 3 / counted.sum()
    assert mean_cross_entropy_check(advised.mean(), logits, advised) == (True, None)


def test_gradients_clipped_inside_the_block_are_named_by_their_one_factor():
    """clip_grad_norm_ inside the cockpit's block: the gradient check failed with the generic list of causes; the
    rows and the gradient differ by one factor in every parameter, which the reason now names, with the fix."""
    model, x, y = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    loss = rows.mean()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": 12, "individual_losses": rows, "loss": loss, "optimizer": optimizer}):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    (failed,) = [f for f in cockpit.checks[0]["failed"] if f["check"] == "gradient"]
    assert "times one factor" in failed["reason"] and "after the cockpit's block" in failed["reason"], failed


def _penalised_step(on, declare):
    """One step of the full preset whose backpropagated loss adds a gradient penalty (``on`` the inputs or the
    parameters) to the cross-entropy; ``declare``: info['loss'] the sum, the rows each row's loss plus the penalty."""
    model, x, y = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"), model=model)
    inputs = x.clone().requires_grad_(on == "inputs")
    out = model(inputs)
    rows = F.cross_entropy(out, y, reduction="none")
    loss = rows.mean()
    wrt = [inputs] if on == "inputs" else list(model.parameters())
    penalty = 1e-2 * sum((g**2).sum() for g in torch.autograd.grad(loss, wrt, create_graph=True))
    info = {"batch_size": 12, "individual_losses": rows, "loss": loss, "optimizer": optimizer}
    if declare:
        info.update(loss=loss + penalty, individual_losses=rows + penalty)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            (loss + penalty).backward(create_graph=cockpit.create_graph(0))
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return cockpit.get_output()[0], cockpit.checks[0], grads


def _penalised_top_eigenvalue(on):
    """The eigenvalue of largest magnitude of the dense Hessian of cross-entropy plus the gradient penalty."""
    model, x, y = _problem()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def total(theta):
        params = dict(zip(names, torch.split(theta, [s.numel() for s in shapes])))
        params = {n: t.reshape(s) for (n, t), s in zip(params.items(), shapes)}
        inputs = x.clone().requires_grad_(on == "inputs")
        loss = F.cross_entropy(torch.func.functional_call(model, params, (inputs,)), y)
        wrt = [inputs] if on == "inputs" else list(params.values())
        return loss + 1e-2 * sum((g**2).sum() for g in torch.autograd.grad(loss, wrt, create_graph=True))

    eigenvalues = torch.linalg.eigvalsh(torch.autograd.functional.hessian(total, flat))
    return float(eigenvalues[eigenvalues.abs().argmax()])


@pytest.mark.parametrize("on", ["inputs", "parameters"])
def test_an_undeclared_gradient_penalty_is_named_and_its_advice_works(on):
    """A gradient penalty backpropagated beside the declared loss failed ``backpropagated_loss`` with the generic
    list of causes (trial 34's generic reasons): the reason names the derivative in the backpropagated graph, and
    declaring the sum as it says gives a valid step, the per-sample quantities left out with their note, the rest
    stored and right."""
    record, checks, _ = _penalised_step(on, declare=False)
    (failed,) = [f for f in checks["failed"] if f["check"] == "backpropagated_loss"]
    assert "holds a derivative taken with create_graph" in failed["reason"], failed
    assert "BackwardBackward" in failed["reason"] and "rows + penalty" in failed["reason"]
    record, checks, grads = _penalised_step(on, declare=True)
    assert checks["valid"] and not checks["failed"], checks
    assert any("per-sample quantities" in n and "create_graph" in n for n in checks["notes"]), checks["notes"]
    assert "NormTest" not in record
    assert record["HessMaxEV"] == pytest.approx(_penalised_top_eigenvalue(on), rel=1e-2)
    assert record["GradNorm"] == pytest.approx([float(g.norm()) for g in grads], rel=1e-12)


def test_a_derivative_inside_the_declared_loss_too_keeps_the_general_reason():
    """Where info['loss'] itself holds a derivative (a model trained on its input gradient, declared), another
    undeclared term is not blamed on a gradient penalty."""
    model, x, y = _problem()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    inputs = x.clone().requires_grad_(True)
    out = model(inputs)
    (gx,) = torch.autograd.grad(out.sum(), inputs, create_graph=True)
    rows = F.cross_entropy(out, y, reduction="none") + (gx**2).sum(1)
    loss = rows.mean()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": 12, "individual_losses": rows, "loss": loss}):
            (loss + 0.1 * (out**2).mean()).backward()
    (failed,) = [f for f in cockpit.checks[0]["failed"] if f["check"] == "backpropagated_loss"]
    assert "holds a derivative" not in failed["reason"] and "an auxiliary loss" in failed["reason"], failed


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "through_data"])
def test_parameters_changed_after_the_optimizers_step_are_named_for_alpha(in_place):
    """A weight scaled after ``optimizer.step()`` left Alpha out with the general list of causes (clipping, a loss
    factor, another optimizer...): the update was checked right after the step and was the predicted one, so the
    note says the parameters changed after it, naming those changed in place; the other steps store Alpha."""
    model, x, y = _problem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(model.parameters(), quantities=[Alpha(track_schedule=linear(1))], model=model)
    for step in range(4):
        optimizer.zero_grad()
        out = model(x)
        rows = F.cross_entropy(out, y, reduction="none")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info={"batch_size": 12, "individual_losses": rows, "loss": rows.mean(),
                                     "optimizer": optimizer}):  # fmt: skip
                rows.mean().backward()
        optimizer.step()
        if step == 1:
            with torch.no_grad():
                (model[2].weight if in_place else model[2].weight.data).mul_(0.9)
    alpha = {step: values["Alpha"] for step, values in cockpit.get_output().items() if "Alpha" in values}
    assert sorted(alpha) == [0, 2], alpha
    (note,) = [n for n in cockpit.checks[2]["notes"] if n.startswith("Alpha of step 1")]
    assert "changed after optimizer.step() and before step 2" in note, note
    assert ("indices [2]" in note) == in_place, note


def test_alpha_starting_from_a_withdrawn_first_pass_is_dropped_with_it():
    """Undeclared accumulation: step 0 is withdrawn when its second backward pass comes; Alpha of step 0, predicted
    from the first pass's gradients, was then left out at step 1 with the general list of causes (trial 34's
    generic reasons, read again). It is dropped with the step, and the step's failed check says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=[Alpha(track_schedule=linear(1))], model=model)
    x, y = torch.randn(36, 6, dtype=DTYPE), torch.randint(0, 4, (36,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            optimizer.zero_grad()
            for part in range(2):
                rows = F.cross_entropy(model(x[12 * step + 6 * part :][:6]), y[12 * step + 6 * part :][:6], reduction="none")
                with cockpit(step, info={"batch_size": 6, "individual_losses": rows, "loss": rows.mean(), "optimizer": optimizer}):
                    (rows.mean() / 2).backward()
            optimizer.step()
    (failed,) = [f for f in cockpit.checks[0]["failed"] if f["check"] == "backward_passes"]
    assert "Alpha of step 0, which started from the first pass's gradients, will not be stored" in failed["reason"]
    assert not any(n.startswith("Alpha of step 0") for n in cockpit.checks[1]["notes"]), cockpit.checks[1]["notes"]
    assert "Alpha" in cockpit.get_output()[1]  # the merged steps from then on
