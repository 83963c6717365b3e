"""A quantity belongs to one cockpit: reusing the instances of a run in a new Cockpit (a notebook's setup cell
run once, its training cell twice) is refused at construction with what to do, not at step 0 with a misleading
'already tracked' error."""

import gc

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration
from tests.helpers import make_problem, train


def test_reused_quantities_of_a_trained_cockpit_are_refused_with_the_fix():
    model, lossfunc, individual = make_problem("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    quantities = configuration("economy")
    first = Cockpit(model.parameters(), quantities=quantities)
    train(model, lossfunc, individual, first, "mlp", 4, 6, optimizer)
    stored = {step: dict(values) for step, values in first.get_output().items()}
    with pytest.raises(ValueError, match=r"already holds steps 0-[23] of another cockpit.*configuration\(\"economy\"\) again"):
        Cockpit(model.parameters(), quantities=quantities)
    assert first.get_output().keys() == stored.keys()  # the first run is left as it was
    # what the message says to do works: fresh quantities, a new run from step 0
    second = Cockpit(model.parameters(), quantities=configuration("economy"))
    train(model, lossfunc, individual, second, "mlp", 2, 6, optimizer)
    assert sorted(second.get_output()) == [0, 1]


def test_quantities_of_a_live_cockpit_are_refused_and_of_a_dropped_unused_one_are_taken():
    model, _, _ = make_problem("mlp")
    quantities = configuration("economy")
    first = Cockpit(model.parameters(), quantities=quantities)
    with pytest.raises(ValueError, match="already belongs to another cockpit"):
        Cockpit(model.parameters(), quantities=quantities)
    del first
    gc.collect()
    Cockpit(model.parameters(), quantities=quantities)  # nothing stored, no other owner: taken
