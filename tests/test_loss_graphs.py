"""What a loss's autograd graph says (cockpit_like.checks.graphs), and the failed checks that name it.

Outside trial 34: a cross-entropy backpropagated with ``label_smoothing`` while
``info["loss"]`` and the rows were computed without it (or the rows without,
``info["loss"]`` with) was told only among the kinds of term a loss can have
(618 quantity-steps of generic reasons in the rerun, this cause among them).
Both checks now read the label smoothing from the two graphs and name it; row weights and
a statistic over the batch inside the loss (batch-centred logits) and a term on the parameters likewise.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.checks.graphs import (
    batch_statistic_in,
    derivative_in,
    label_smoothing_in,
    parameter_term_in,
    smoothing_mismatch,
    weighs_rows,
)
from cockpit_like.utils.configuration import configuration

DTYPE = torch.float64


def _logits(*shape):
    return torch.randn(*shape, dtype=DTYPE, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _targets(*shape, classes=4):
    return torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("epsilon", [0.1, 0.25])
def test_label_smoothing_of_torchs_cross_entropy_is_read_from_the_graph(epsilon, reduction):
    out, y = _logits(6, 4), _targets(6)
    loss = F.cross_entropy(out, y, label_smoothing=epsilon, reduction=reduction)
    assert label_smoothing_in([loss.grad_fn]) == pytest.approx(epsilon, abs=1e-12)
    module = nn.CrossEntropyLoss(label_smoothing=epsilon, reduction=reduction)(out, y)
    assert label_smoothing_in([module.grad_fn]) == pytest.approx(epsilon, abs=1e-12)


def test_sequences_token_means_and_terms_around_the_loss():
    """``[B, C, T]`` logits (NLL through a view), rows as token means, the loss inside a larger sum."""
    out, y = _logits(3, 4, 5), _targets(3, 5)
    tokens = F.cross_entropy(out, y, label_smoothing=0.2, reduction="none")  # [B, T]
    rows = tokens.mean(1)
    assert label_smoothing_in([rows.grad_fn]) == pytest.approx(0.2)
    flat = F.cross_entropy(out.transpose(1, 2).reshape(-1, 4), y.reshape(-1), label_smoothing=0.3)
    assert label_smoothing_in([(flat + 0.01 * (out**2).sum()).grad_fn]) == pytest.approx(0.3)


def test_no_smoothing_and_other_losses():
    out, y = _logits(6, 4), _targets(6)
    assert label_smoothing_in([F.cross_entropy(out, y).grad_fn]) == 0.0
    assert label_smoothing_in([F.nll_loss(F.log_softmax(out, 1), y).grad_fn]) == 0.0
    assert label_smoothing_in([F.mse_loss(out, torch.zeros_like(out)).grad_fn]) is None
    # soft targets: the smoothing is in the targets, not the graph
    soft = torch.softmax(torch.randn(6, 4, dtype=DTYPE), 1)
    assert label_smoothing_in([F.cross_entropy(out, soft, label_smoothing=0.1).grad_fn]) is None


@pytest.mark.parametrize("weight", [0.5, 0.9])
def test_a_weighted_sum_of_two_losses_is_not_read_as_smoothing(weight):
    """``w x CE + (1 - w) x`` another term of the logits: the same shape of sum, but the other term is not the
    cross-entropy's log-softmax summed over its classes."""
    out, y = _logits(6, 4), _targets(6)
    mixed = weight * F.cross_entropy(out, y) + (1 - weight) * F.mse_loss(out, torch.zeros_like(out))
    assert label_smoothing_in([mixed.grad_fn]) == 0.0
    other = weight * F.cross_entropy(out, y) + (1 - weight) * F.cross_entropy(out * 2, y)
    assert label_smoothing_in([other.grad_fn]) == 0.0


def test_mismatch_and_the_walk_limits():
    out, y = _logits(6, 4), _targets(6)
    smoothed, plain = F.cross_entropy(out, y, label_smoothing=0.1), F.cross_entropy(out, y, reduction="none")
    assert smoothing_mismatch(smoothed, plain) == pytest.approx((0.1, 0.0))
    assert smoothing_mismatch(plain, smoothed) == pytest.approx((0.0, 0.1))
    assert smoothing_mismatch(smoothed, F.cross_entropy(out, y, label_smoothing=0.1, reduction="none")) is None
    assert smoothing_mismatch(smoothed, F.mse_loss(out, torch.zeros_like(out))) is None
    assert smoothing_mismatch(smoothed, torch.tensor(1.0)) is None  # no graph: nothing to compare
    deep = smoothed
    for _ in range(30):
        deep = deep * 1.0
    assert label_smoothing_in([deep.grad_fn]) == pytest.approx(0.1)
    assert label_smoothing_in([deep.grad_fn], limit=10) is None
    assert derivative_in([smoothed.grad_fn]) is None


def _problem():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)
    generator = torch.Generator().manual_seed(2)
    return model, torch.randn(12, 6, generator=generator, dtype=DTYPE), torch.randint(0, 4, (12,), generator=generator)


def _step(loss_of, rows_of, backpropagated_of):
    model, x, y = _problem()
    _step.model = model  # (for a loss that reads the parameters)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(x)
    info = {"batch_size": 12, "individual_losses": rows_of(out, y), "loss": loss_of(out, y)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            backpropagated_of(out, y).backward()
    return cockpit.checks[0]


def _smoothed(out, y):
    return F.cross_entropy(out, y, label_smoothing=0.1)


def _plain(out, y):
    return F.cross_entropy(out, y)


def _plain_rows(out, y):
    return F.cross_entropy(out, y, reduction="none")


def test_the_backpropagated_loss_check_names_the_smoothing():
    """Trial 34's ``label_smoothing_mismatch``: backward() on the smoothed loss, both declarations without."""
    checks = _step(_plain, _plain_rows, _smoothed)
    (failed,) = checks["failed"]
    assert failed["check"] == "backpropagated_loss"
    assert "label_smoothing=0.1 in the tensor backpropagated, 0 in info['loss']" in failed["reason"]
    assert "F.cross_entropy(out, y, label_smoothing=0.1)" in failed["reason"]


def test_the_losses_mean_check_names_the_smoothing_first():
    """Following the note (pass the loss backpropagated as info['loss']) with the rows still plain: the error
    names the smoothing before the list of causes; the rows with it, as it says, make the step valid."""
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 in info\['loss'\], 0 in info\['individual_losses'\]"
                                         r".*reduction='none'\)\. Other causes"):
        _step(_smoothed, _plain_rows, _smoothed)
    checks = _step(_smoothed, lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1, reduction="none"), _smoothed)
    assert checks["valid"] and not checks["failed"]


def test_rows_smoothed_and_the_loss_not_is_named_the_other_way_round():
    with pytest.raises(ValueError, match=r"label_smoothing=0 in info\['loss'\], 0.1 in info\['individual_losses'\]"):
        _step(_plain, lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1, reduction="none"), _plain)


def test_a_generic_mismatch_keeps_the_common_causes():
    with pytest.raises(ValueError, match="Common causes") as caught:
        _step(lambda out, y: _plain(out, y) + 0.3, _plain_rows, _plain)
    assert "label smoothing" not in str(caught.value).split("Common causes")[0]


# ---- row weights ---------------------------------------------------------------------------------------------
def test_row_weights_are_read_from_the_graph():
    out, y = _logits(6, 4), _targets(6)
    rows = F.cross_entropy(out, y, reduction="none")
    w = torch.linspace(0.5, 1.5, 6, dtype=DTYPE)
    for weighted in ((rows * w).mean(), (w * rows).mean(), (rows * w).sum() / w.sum(), (rows / w).mean(),
                     torch.dot(rows, w) / 6):  # fmt: skip
        assert weighs_rows([weighted.grad_fn], rows)
    for plain in (rows.mean(), rows.sum() / 6, (rows * 2.0).mean(), (rows * rows).mean()):
        assert not weighs_rows([plain.grad_fn], rows)
    assert weighs_rows([(rows * rows.detach()).mean().grad_fn], rows)  # (detached weights are weights)
    other_rows = F.cross_entropy(out, y, reduction="none")  # the same values, another tensor: not these rows
    assert not weighs_rows([(other_rows * w).mean().grad_fn], rows)
    assert not weighs_rows([(rows * w).mean().grad_fn], rows.detach())


def test_row_weights_in_the_backpropagated_loss_only_are_named():
    """Trial 34's ``row_weights_bp_only``: ``(rows * w).mean()`` backpropagated, the plain rows declared."""
    model, x, y = _problem()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    w = torch.linspace(0.5, 1.5, 12, dtype=DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": 12, "individual_losses": rows, "loss": rows.mean()}):
            (rows * w).mean().backward()
    (failed,) = cockpit.checks[0]["failed"]
    assert failed["check"] == "backpropagated_loss"
    assert "multiplies (or divides) the rows of info['individual_losses'] by a tensor without gradient" in failed["reason"]
    # the advice: the weighted rows declared, the loss backpropagated: valid
    model, x, y = _problem()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    loss = (rows * w).mean()
    with cockpit(0, info={"batch_size": 12, "individual_losses": rows * w, "loss": loss}):
        loss.backward()
    assert cockpit.checks[0]["valid"] and not cockpit.checks[0]["failed"]


def test_row_weights_in_the_declared_loss_only_are_named_first():
    w = torch.linspace(0.5, 1.5, 12, dtype=DTYPE)
    model, x, y = _problem()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    loss = (rows * w).mean()
    with pytest.raises(ValueError, match=r"info\['loss'\] multiplies \(or divides\) the rows.*Other causes"):
        with cockpit(0, info={"batch_size": 12, "individual_losses": rows, "loss": loss}):
            loss.backward()


# ---- a statistic over the batch inside the loss --------------------------------------------------------------
@pytest.mark.parametrize("inside", [lambda o: o - o.mean(0, keepdim=True), lambda o: o - o.mean(0),
                                    lambda o: (o - o.mean(0)) / o.std(0), lambda o: o - o.mean()],
                         ids=["centred", "centred_broadcast", "standardised", "global_mean"])  # fmt: skip
def test_a_batch_statistic_inside_the_loss_is_read_from_the_graph(inside):
    out, y = _logits(6, 4), _targets(6)
    declared = F.cross_entropy(out, y)
    backpropagated = F.cross_entropy(inside(out), y)
    assert batch_statistic_in([backpropagated.grad_fn], declared) is not None
    assert batch_statistic_in([declared.grad_fn], declared) is None


def test_reductions_that_are_not_inside_the_loss_or_are_shared_are_not_read():
    out, y = _logits(6, 4), _targets(6)
    rows = F.cross_entropy(out, y, reduction="none")
    declared = rows.mean()
    assert batch_statistic_in([(rows.sum(0) / 6).grad_fn], declared) is None  # the rows' own mean: above the loss
    assert batch_statistic_in([(declared + 0.1 * (out**2).mean()).grad_fn], declared) is None  # a term beside it
    centred = out - out.mean(0)  # a batch statistic inside the model: in info['loss']'s graph as well
    inside_model = F.cross_entropy(centred, y)
    assert batch_statistic_in([(inside_model * 1.5).grad_fn], inside_model) is None
    assert batch_statistic_in([F.cross_entropy(out[:, :1] - out[:, :1], y * 0).grad_fn], declared) is None


def test_batch_centred_logits_in_the_backpropagated_loss_only_are_named_and_the_advice_works():
    """Trial 34's ``batch_mean_centred``: the failed check named it among the kinds of term; it names the
    statistic, and declaring that loss makes the step valid with the per-sample quantities left out (a note)."""
    centred = lambda out, y: F.cross_entropy(out - out.mean(0, keepdim=True), y)  # noqa: E731
    checks = _step(_plain, _plain_rows, centred)
    (failed,) = checks["failed"]
    assert failed["check"] == "backpropagated_loss"
    assert "a statistic over the batch (MeanBackward1" in failed["reason"]
    checks = _step(centred, lambda out, y: F.cross_entropy(out - out.mean(0, keepdim=True), y, reduction="none"),
                   centred)  # fmt: skip
    assert checks["valid"] and not checks["failed"]
    assert any("not separable by rows" in note for note in checks["notes"])


# ---- a term on the parameters ----------------------------------------------------------------------------------
def test_a_term_on_the_parameters_is_read_from_the_graph():
    model, x, y = _problem()
    out = model(x)
    declared = F.cross_entropy(out, y)
    penalty = 1e-2 * sum((p**2).sum() for p in model.parameters())
    assert parameter_term_in([(declared + penalty).grad_fn], declared)
    assert not parameter_term_in([(declared * 2).grad_fn], declared)
    assert not parameter_term_in([(declared + 0.1 * (out**2).mean()).grad_fn], declared)  # on the outputs: not
    assert not parameter_term_in([(declared + penalty).grad_fn], declared + penalty)  # declared too
    # a second head's loss reads its own layer's parameters, and the trunk the declared loss shares: not a penalty
    trunk = model[1](model[0](x))
    head = nn.Linear(8, 1).double()
    first = F.cross_entropy(model[2](trunk), y)
    assert not parameter_term_in([(first + head(trunk).pow(2).mean()).grad_fn], first)
    assert parameter_term_in([(first + head.weight.norm()).grad_fn], first)


def test_an_l2_term_in_the_backpropagated_loss_only_is_named():
    """Trial 34's ``l2_in_every_row`` (the L2 term backpropagated, the declarations without it)."""
    def with_l2(out, y):
        model = _step.model
        return F.cross_entropy(out, y) + 1e-2 * sum((p**2).sum() for p in model.parameters())

    checks = _step(_plain, _plain_rows, with_l2)
    reasons = {failed["check"]: failed["reason"] for failed in checks["failed"]}
    assert "a term on the parameters themselves" in reasons["backpropagated_loss"]
    assert "weight_decay" in reasons["backpropagated_loss"]
