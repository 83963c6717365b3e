"""A value withdrawn from a step takes its error bar with it (sixth outside round, curvature 7): undeclared
gradient accumulation withdraws HessTrace's value, and the step's ``checks["standard_errors"]`` no longer
describes it; the error bars of values the step keeps stay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import HessTrace

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward", "ignore:.*accumulat")


def test_undeclared_accumulation_withdraws_the_value_and_its_error_bar():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randint(0, 3, (9,))
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(lambda s: True, curvature="hutchinson")], model=model)
    for k in range(3):
        out = model(x[3 * k : 3 * k + 3])
        losses = nn.functional.cross_entropy(out, y[3 * k : 3 * k + 3], reduction="none")
        loss = losses.mean()
        with cockpit(0, info={"batch_size": 3, "individual_losses": losses, "loss": loss}):
            (loss / 3).backward(create_graph=cockpit.create_graph(0))
    output = cockpit.get_output()[0]
    assert "HessTrace" not in output
    assert [f.get("withdrawn") for f in output["checks"]["failed"]] == [["HessTrace"]]
    assert "HessTrace" not in output["checks"].get("standard_errors", {})
    assert "HessTrace" not in cockpit.checks[0].get("standard_errors", {})


def test_a_kept_value_keeps_its_error_bar():
    from cockpit_like.cockpit import _without_error_bars

    record = {"valid": True, "standard_errors": {"HessTrace": {"standard_error": 1.0}, "TICTrace": {"standard_error": 2.0}}}
    assert _without_error_bars(record, ["HessTrace"])["standard_errors"] == {"TICTrace": {"standard_error": 2.0}}
    assert "standard_errors" not in _without_error_bars(record, ["HessTrace", "TICTrace"])
    assert record["standard_errors"]["HessTrace"] == {"standard_error": 1.0}  # the stored record is not changed
