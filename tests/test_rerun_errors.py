"""A module re-run on single rows (the ``torch.func`` fallback) whose forward pass fails there: a clear
:class:`UncoveredParameterError` that says what the cockpit sliced and what to do, the user's error as its cause
(it used to surface as the user's own raw error, with no word of the cockpit)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.rerun import UncoveredParameterError
from cockpit_like.utils.configuration import configuration


class _GraphBatch(nn.Module):
    """Graph-level classification of a batch of graphs: node tensors with a ``batch`` vector, and a graph-level
    feature ``u`` ``[graphs, 2]``: only ``u`` has the batch dimension, so the whole model is re-run per row."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.head = nn.Linear(8, 3)

    def forward(self, u, x, batch):
        h = torch.tanh(self.lin(x))
        pooled = torch.zeros(u.shape[0], h.shape[1], dtype=h.dtype).index_add(0, batch, h)
        return self.head(torch.cat([pooled, u], 1))


class _MixesRows(nn.Module):
    """A linear layer applied along the batch dimension (``B == features``): the rows are mixed."""

    def __init__(self):
        super().__init__()
        self.a, self.mix, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.mix(torch.tanh(self.a(x)).T).T)


def _graph_inputs():
    sizes = [2, 4, 3, 2, 2]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), 4, generator=generator, dtype=torch.float64)
    batch = torch.cat([torch.full((s,), i, dtype=torch.long) for i, s in enumerate(sizes)])
    u = torch.randn(5, 2, generator=generator, dtype=torch.float64)
    return (u, x, batch), torch.randint(0, 3, (5,), generator=generator)


def _mix_inputs():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(4, 4, generator=generator, dtype=torch.float64),), torch.randint(0, 3, (4,), generator=generator)


def test_rows_mixed_by_a_layer_along_the_batch_are_a_note_not_an_error():
    """A layer applied along the batch dimension mixes the rows: re-running single rows failed and training stopped
    (the error above); since outside trial 35 the whole batch's outputs show that a row reads other rows, and the
    step goes on without per-sample values, with a note."""
    torch.manual_seed(0)
    model = _MixesRows().double()
    (x,), y = _mix_inputs()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": len(y), "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    record = cockpit.get_output()[0]
    assert "NormTest" not in record and "GradNorm" in record
    assert any("of the batch reads rows" in n for n in cockpit.checks[0]["notes"]), cockpit.checks[0]["notes"]


@pytest.mark.parametrize("make, inputs", [(_GraphBatch, _graph_inputs)])
def test_a_rerun_that_fails_on_single_rows_is_a_clear_error(make, inputs):
    torch.manual_seed(0)
    model = make().double()
    args, y = inputs()
    model(*args)  # the plain forward pass on the whole batch runs
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(*args)
    losses = F.cross_entropy(out, y, reduction="none")
    with pytest.raises(UncoveredParameterError, match="re-running it on single rows") as caught:
        with cockpit(0, info={"batch_size": len(y), "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    assert "Cockpit(params)" in str(caught.value)
    assert isinstance(caught.value.__cause__, UncoveredParameterError)
    assert isinstance(caught.value.__cause__.__cause__, RuntimeError)  # the user's forward pass's own error
