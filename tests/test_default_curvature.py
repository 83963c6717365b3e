"""Quantities built with default arguments run on any model (issue: defaults that work on any model).

On a model BackPACK can handle they compute Cockpit's exact BackPACK numbers
(``curvature="diag_h"`` / ``"kfac"`` explicitly give the same); on any other
model the any-model estimator, written to ``settings()["computed_with"]``.
"""

from __future__ import annotations

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.quantities import HessTrace, KFACTrace, TICDiag, TICTrace
from cockpit_like.utils.schedules import linear
from tests.helpers import make_batch, make_problem
from tests.zoo import ZOO

DEFAULTS = (HessTrace, TICDiag, TICTrace, KFACTrace)


def _track(model, lossfunc, individual, batch, quantities, step_seed=0):
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, labels = batch
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": len(labels), "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
    torch.manual_seed(step_seed)
    with cockpit(0, info=info):
        loss.backward(create_graph=cockpit.create_graph(0))
    return cockpit


@pytest.mark.parametrize("cls", DEFAULTS)
def test_defaults_run_on_a_model_backpack_cannot_handle(cls):
    problem = ZOO["encoder"](0)
    inputs, targets = problem.batch(4, 0)

    def mean(outputs, targets):
        return problem.sample_losses(outputs, targets).mean()

    cockpit = _track(problem.model, mean, problem.sample_losses, (inputs, targets), [cls(linear(1))])
    settings = cockpit.quantities[0].settings()
    expected = {KFACTrace: "empirical", HessTrace: "hutchinson"}.get(cls, "ggn")  # TIC: the GGN (issue 37)
    assert settings["computed_with"] == expected, settings
    notes = cockpit.get_output()[0].get("checks", {}).get("notes", [])
    if cls is TICDiag:  # no info["outputs"] here: no positive curvature to divide by entry by entry, no value
        assert cls.__name__ not in cockpit.get_output()[0]
        assert any("TICDiag at step 0: no value stored" in note for note in notes), notes
        return
    value = cockpit.get_output()[0][cls.__name__]
    assert value is not None
    if cls is TICTrace:  # no info["outputs"] here: Hutchinson's diagonal, and the step says so
        assert any(f"{cls.__name__} at step 0: curvature='auto' divides by the GGN" in note for note in notes), notes


@pytest.mark.parametrize("cls, exact", [(HessTrace, "diag_h"), (TICDiag, "diag_h"), (TICTrace, "diag_h"), (KFACTrace, "kfac")])
def test_defaults_keep_backpacks_exact_numbers_where_it_can(cls, exact):
    outputs = []
    for curvature in ("auto", exact):
        model, lossfunc, individual = make_problem("mlp")
        quantity = cls(linear(1)) if curvature == "auto" else cls(linear(1), curvature=curvature)
        cockpit = _track(model, lossfunc, individual, make_batch("mlp", 6, 0), [quantity])
        outputs.append(cockpit.get_output()[0][cls.__name__])
        if curvature == "auto":
            assert quantity.settings()["computed_with"] == exact
    assert repr(outputs[0]) == repr(outputs[1])
