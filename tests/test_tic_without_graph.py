"""TICDiag from the GGN on a plain model needs the step's graph kept: without it, a clear error that names
``loss.backward(create_graph=cockpit.create_graph(step))`` (sixth outside round, curvature 6), not PyTorch's
"Trying to backward through the graph a second time"; the next step, with the graph, runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.hvp import MissingGraphError
from cockpit_like.quantities import TICDiag, TICTrace

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")


def test_a_plain_backward_pass_is_the_clear_error_and_the_next_step_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    quantities = [TICDiag(lambda step: True), TICTrace(lambda step: True)]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)

    def step(index, create_graph):
        for p in model.parameters():
            p.grad = None
        out = model(x)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        loss = losses.mean()
        with cockpit(index, info={"batch_size": 6, "individual_losses": losses, "loss": loss, "outputs": out}):
            loss.backward(create_graph=create_graph and cockpit.create_graph(index))

    with pytest.raises(MissingGraphError, match=r"\['TICDiag', 'TICTrace'\].*create_graph=cockpit.create_graph\(0\)"):
        step(0, create_graph=False)
    step(1, create_graph=True)
    output = cockpit.get_output()
    assert output[1]["TICDiag"] > 0 and output[1]["TICTrace"] > 0
    assert "TICDiag" not in output.get(0, {})
