"""Functional operations that mix the batch's rows but keep the shape, between modules (outside trial 8): the
per-sample quantities were silently those of the coupled rows (NormTest 0.727 where an autograd loop over the
rows gives 0.713, on steps marked valid). The walk of the autograd graph from each call to the model's outputs
now sees normalisations whose statistics run over the rows and matrix functions of the rows: those steps leave
the per-sample quantities out with a note. The same operations along other dimensions stay exact (float64,
against per-row autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import GradNorm, NormTest
from cockpit_like.utils.schedules import linear

B = 5


class Between(nn.Module):
    def __init__(self, middle):
        super().__init__()
        self.a, self.b, self.middle = nn.Linear(6, 4), nn.Linear(4, 3), middle

    def forward(self, x):
        return self.b(torch.tanh(self.middle(self.a(x))))


MIXING = {
    "F.batch_norm(training=True)": lambda h: F.batch_norm(h, None, None, training=True),
    "F.layer_norm over the batch": lambda h: F.layer_norm(h.t(), (h.shape[0],)).t(),
    "F.group_norm over the batch": lambda h: F.group_norm(h.t().unsqueeze(0), 1).squeeze(0).t(),
    "torch.linalg.qr of the rows": lambda h: torch.linalg.qr(h).Q,
}
ROW_WISE = {
    "F.batch_norm(training=False)": lambda h: F.batch_norm(h, torch.zeros(4, dtype=h.dtype), torch.ones(4, dtype=h.dtype)),
    "F.layer_norm over the features": lambda h: F.layer_norm(h, (4,)),
    "F.group_norm per sample": lambda h: F.group_norm(h.unsqueeze(-1), 2).squeeze(-1),
    "torch.linalg.vector_norm per row": lambda h: h / torch.linalg.vector_norm(h, dim=-1, keepdim=True),
}


def _run(middle):
    torch.manual_seed(0)
    model = Between(middle).double()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (B,), generator=generator)
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1)), GradNorm(linear(1))], model=model)
    losses = F.cross_entropy(model(x), y, reduction="none")
    with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    return model, x, y, cockpit


@pytest.mark.parametrize("name", sorted(MIXING))
def test_row_mixing_operations_leave_the_per_sample_quantities_out_with_a_note(name):
    _, _, _, cockpit = _run(MIXING[name])
    values = cockpit.get_output()[0]
    assert "NormTest" not in values and "GradNorm" in values
    assert any("left out" in note and "takes in every row" in note and "docs/your_model.md#limits" in note
               for note in cockpit.checks[0]["notes"])  # fmt: skip


@pytest.mark.parametrize("name", sorted(ROW_WISE))
def test_the_same_operations_along_other_dimensions_stay_exact(name):
    model, x, y, cockpit = _run(ROW_WISE[name])
    rows = []
    for i in range(B):
        grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    rows = torch.stack(rows)
    mean = rows.mean(0)
    expected = float((((rows - mean) ** 2).sum() / ((B - 1) * B * (mean @ mean))).sqrt())
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(expected, rel=1e-10)
    assert not cockpit.checks[0].get("notes")


def test_a_statistic_over_the_rows_inside_a_rerun_module_is_named_as_such():
    """`h / h.std(0)` inside a module the cockpit re-runs: finite on the batch, NaN on one row. The note said the
    outputs "were not finite (an overflow)" (outside trial 8); it now says the rows depend on each other."""

    class Standardise(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, h):
            return self.scale * h / h.std(0)

    _, _, _, cockpit = _run(Standardise())
    notes = " ".join(cockpit.checks[0]["notes"])
    assert "NormTest" not in cockpit.get_output()[0]
    assert "where the training step's forward pass on the batch was finite: its rows depend on each other" in notes
