"""Outside trial 34 (2026-11-29): are the reasons true, and does their advice work? A tester who had not seen the
code built 60 set-ups with one known fault each (or none), classified every reason the cockpit gave against the
fault, and applied the advice. What it found, each test failing on the code before its fix:

- a term of value 0 with a gradient (``loss + (z - z.detach())``) backpropagated beside the declared loss: with
  per-sample quantities the step failed ``backpropagated_loss``; with HessMaxEV (or HessTrace) alone it was valid,
  HessMaxEV the Hessian of the other loss (1.70 for 0.606).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import Alpha, GradNorm, HessMaxEV, HessTrace
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
