"""Outside trial 15 (2026-11-29): loops that call the tracked model more than once per step.

A tester who had not seen the code found three loops whose per-sample numbers were stored as valid and wrong
(NormTest 0.84 where the per-sample gradients give 0.36): the check that each row's loss reads only its own row of
the model's output looked at the model's last call only, and these losses couple the rows through an earlier one
(InfoNCE with the keys computed before the anchors, prototypes from a support set of as many rows as the batch, a
loss centred on the batch mean of the first of two calls). Every call of the model is checked now. Also: a table of
``C`` class embeddings with ``C`` equal to the batch size by chance (``img(x) @ txt(classes).T``) was refused; a
support set of another size stopped training where the per-sample quantities are undefined.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration
from tests.helpers import brute_force_step

DT = torch.float64
B = 8


def _encoder():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 6)).to(DT)


def _run(model, losses_of, preset="economy", steps=2, batch=B):
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            x = torch.randn(batch, 10, generator=generator, dtype=DT)
            views = (x + 0.2 * torch.randn(x.shape, generator=generator, dtype=DT),
                     x + 0.2 * torch.randn(x.shape, generator=generator, dtype=DT))  # fmt: skip
            optimizer.zero_grad()
            rows = losses_of(model, *views)
            with cockpit(step, info={"batch_size": batch, "individual_losses": rows, "loss": rows.mean(), "optimizer": optimizer}):
                rows.mean().backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
    return cockpit


def _infonce(keys_first):
    def losses(model, x1, x2):
        if keys_first:
            keys = model(x2)
            anchors = model(x1)
        else:
            anchors = model(x1)
            keys = model(x2)
        logits = F.normalize(anchors, dim=1) @ F.normalize(keys, dim=1).T / 0.5
        return F.cross_entropy(logits, torch.arange(len(x1)), reduction="none")

    return losses


def _centred_on_first(model, x1, x2):
    first = model(x1)
    second = model(x2)
    return ((second - first.mean(0)) ** 2).sum(1)


def _squared_distances(a, b):
    return ((a[:, None] - b[None]) ** 2).sum(-1)  # (torch.cdist has no second derivative: the full preset's HVPs)


def _prototypes(model, x1, x2):
    """4 classes of 2 support rows (x1) and 2 queries each (x2): every query reads every prototype."""
    prototypes = model(x1).view(4, 2, -1).mean(1)
    queries = model(x2)
    return F.cross_entropy(-_squared_distances(queries, prototypes), torch.arange(4).repeat_interleave(2), reduction="none")


@pytest.mark.parametrize("losses", [_infonce(True), _infonce(False), _centred_on_first, _prototypes],
                         ids=["infonce-keys-first", "infonce-anchors-first", "centred-on-first", "prototypes"])
@pytest.mark.parametrize("preset", ["economy", "full"])
def test_rows_coupled_through_any_call_of_the_model_leave_the_per_sample_quantities_out(losses, preset):
    """Before, the first, third and fourth were stored as valid with NormTest, InnerTest, OrthoTest, Alpha and the
    histograms of mixed rows (NormTest 0.84 / 0.96 / 0.30 where the per-sample gradients give 0.36 / 0.60 / 0.45)."""
    cockpit = _run(_encoder(), losses, preset)
    for step in range(2):
        checks, output = cockpit.checks[step], cockpit.get_output()[step]
        assert checks["valid"] and any("not separable by rows" in note for note in checks["notes"]), checks["notes"]
        assert not {"NormTest", "InnerTest", "OrthoTest", "GradHist1d"} & set(output)
        assert {"Loss", "GradNorm"} <= set(output)


def test_two_calls_read_row_by_row_stay_exact():
    """A loss that reads row ``n`` of both calls only (a paired or siamese loss): separable, every per-sample
    quantity stored and equal to the loop of ``torch.autograd.grad`` over the rows."""

    def paired(model, x1, x2):
        return ((model(x1) - model(x2)) ** 2).sum(1) + model(x1).pow(2).mean(1)

    model = _encoder()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(B, 10, generator=generator, dtype=DT)
    views = (x + 0.2 * torch.randn(x.shape, generator=generator, dtype=DT), x + 0.2 * torch.randn(x.shape, generator=generator, dtype=DT))
    expected = brute_force_step(model, lambda m, i: paired(m, views[0][i : i + 1], views[1][i : i + 1])[0], B)
    cockpit = _run(model, paired, steps=1)
    output = cockpit.get_output()[0]
    assert cockpit.checks[0]["valid"] and not cockpit.checks[0]["notes"]
    for name in ("NormTest", "InnerTest", "OrthoTest"):
        assert output[name] == pytest.approx(expected[name], rel=1e-9), name
    assert output["GradNorm"] == pytest.approx(expected["GradNorm"], rel=1e-9)


class _ZeroShot(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))
        self.txt = nn.Linear(7, 4)

    def forward(self, x, classes):
        return self.img(x) @ self.txt(classes).T


@pytest.mark.parametrize("classes", [5, 6])
def test_a_class_table_as_long_as_the_batch_by_chance_climbs_to_the_model(classes):
    """``txt(classes)`` has 6 rows at batch 6: its rows end along dimension 1 of the model's output. Before, this
    was refused (with advice about an RNN's hidden state) where 5 classes were fine; now its parameters are
    computed by the model's call, row by row, as with 5."""
    torch.manual_seed(0)
    model = _ZeroShot().to(DT)
    table = torch.randn(classes, 7, dtype=DT)
    x, y = torch.randn(6, 5, dtype=DT), torch.randint(0, classes, (6,))
    expected = brute_force_step(model, lambda m, i: F.cross_entropy(m(x[i : i + 1], table), y[i : i + 1]), 6)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    rows = F.cross_entropy(model(x, table), y, reduction="none")
    with cockpit(0, info={"batch_size": 6, "individual_losses": rows, "loss": rows.mean()}):
        rows.mean().backward()
    output = cockpit.get_output()[0]
    assert cockpit.checks[0]["valid"]
    for name in ("NormTest", "InnerTest", "OrthoTest"):
        assert output[name] == pytest.approx(expected[name], rel=1e-9), name


@pytest.mark.parametrize("preset", ["economy", "full"])
def test_a_support_set_of_other_rows_leaves_the_per_sample_quantities_out_and_training_goes_on(preset):
    """Prototypes from 3 support rows per class, 2 queries per class: the model runs on 12 and on 8 rows. Before,
    every step raised UncoveredParameterError; now the per-sample quantities are left out with a note naming the
    support set, and Loss, GradNorm (and HessMaxEV in full) are stored."""

    def losses(model, x1, x2):
        support = torch.cat([x1, x1[:4]])  # 12 rows: 4 classes x 3
        prototypes = model(support).view(4, 3, -1).mean(1)
        return F.cross_entropy(-_squared_distances(model(x2), prototypes), torch.arange(4).repeat_interleave(2), reduction="none")

    cockpit = _run(_encoder(), losses, preset)
    for step in range(2):
        checks, output = cockpit.checks[step], cockpit.get_output()[step]
        assert checks["valid"] and any("support set" in note for note in checks["notes"])
        assert {"Loss", "GradNorm"} <= set(output) and "NormTest" not in output
        assert preset == "economy" or "HessMaxEV" in output


# ---- outside trial 16 (the same day, multi-call loops after the change above) ---------------------------------
class _WithEncoder(nn.Module):
    """An encoder and a pooled head; ``forward`` returns both (as Hugging Face's BertModel returns its
    ``last_hidden_state`` and ``pooler_output``)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 6))
        self.pool = nn.Linear(6, 6)

    def forward(self, x):
        hidden = self.enc(x)
        return hidden, torch.tanh(self.pool(hidden))


def test_a_loss_over_calls_of_a_submodule_is_checked_too():
    """InfoNCE on ``model.enc(x1)`` and ``model.enc(x2)``, a submodule of ``model=`` called from the loop: before,
    stored as valid with NormTest 1.39 where the per-sample gradients give 1.26 (only the model's own calls were
    checked); every outermost call is checked now."""

    def losses(model, x1, x2):
        logits = F.normalize(model.enc(x1), dim=1) @ F.normalize(model.enc(x2), dim=1).T / 0.5
        return F.cross_entropy(logits, torch.arange(len(x1)), reduction="none")

    torch.manual_seed(0)
    cockpit = _run(_WithEncoder().to(DT), losses)
    for step in range(2):
        assert any("not separable by rows" in note for note in cockpit.checks[step]["notes"])
        assert "NormTest" not in cockpit.get_output()[step]


def test_a_head_no_loss_reads_in_a_model_called_twice_gets_no_gradient():
    """Two calls of a model whose second output (a pooled head) neither loss reads, and a separable loss on the
    mean of the first (a sentence-transformers bi-encoder on BertModel's ``last_hidden_state``): before,
    ``UncoveredParameterError`` about the head's parameters (its calls, unreached by the loss, were dropped and the
    head went to the model's call); now valid and exact."""

    def losses(model, x1, x2):
        return (F.cosine_similarity(model(x1)[0], model(x2)[0], dim=1) - 0.5) ** 2

    torch.manual_seed(0)
    model = _WithEncoder().to(DT)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(B, 10, generator=generator, dtype=DT)
    views = (x + 0.2 * torch.randn(x.shape, generator=generator, dtype=DT), x + 0.2 * torch.randn(x.shape, generator=generator, dtype=DT))
    model.pool.requires_grad_(False)  # (no gradient: the loop of torch.autograd.grad goes without it)
    expected = brute_force_step(model, lambda m, i: losses(m, views[0][i : i + 1], views[1][i : i + 1])[0], B)
    model.pool.requires_grad_(True)
    cockpit = _run(model, losses, steps=1)
    output = cockpit.get_output()[0]
    assert cockpit.checks[0]["valid"] and cockpit.checks[0]["no_gradient"] == ["pool.weight", "pool.bias"]
    for name in ("NormTest", "InnerTest", "OrthoTest"):
        assert output[name] == pytest.approx(expected[name], rel=1e-9), name
