"""Outside trial 43 (2026-11-29): are the reasons true where the declared loss and the backpropagated one differ?

59 scenarios (31 mismatches, 28 consistent controls) x economy / business, float64: every mismatch caught, 0 wrong
values of 2,232 checked, 185 of 198 runs bitwise; but one consistent loop stopped with a false error, and four
reasons named a wrong cause or advice that did not work. Each here, with the advice applied.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from backpack import extend
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.step import UnsupportedLayerError
from cockpit_like.checks.graphs import class_weights_in, weighs_rows
from cockpit_like.utils.configuration import configuration

DTYPE = torch.float64


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).to(DTYPE)


def _batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(8, 5, generator=generator, dtype=DTYPE), torch.randint(0, 4, (8,), generator=generator)


def _step(preset, loss_of, rows_of, backpropagated_of, extended=False):
    model = _mlp()
    x, y = _batch()
    lossfunc = nn.CrossEntropyLoss()
    if extended:
        model, lossfunc = extend(model), extend(lossfunc)
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), **({} if extended else {"model": model}))
    out = model(x)
    info = {"batch_size": 8, "individual_losses": rows_of(out, y), "loss": loss_of(out, y, lossfunc),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            backpropagated_of(out, y, lossfunc, info["loss"]).backward(create_graph=cockpit.create_graph(0))
    return cockpit.checks[0], cockpit.get_output()[0]


def test_an_extended_loss_on_logits_divided_by_a_temperature_names_the_operation():
    """A consistent loop (``lossfunc(model(x) / T)`` declared as it is) on an extended chain, ``business``: the step
    raised NotExtendedError ("not extended, not supported, or not used in the loss", all false); it names the
    operation between the model and the loss, and the fixes."""
    temperature = 2.0
    with pytest.raises(UnsupportedLayerError, match=r"CrossEntropyLoss: it reads a tensor of shape \[8, 4\] that no "
                                                    r"extended module of the model returned.*model\(x\) / T"):  # fmt: skip
        _step("business", lambda out, y, f: f(out / temperature, y),
              lambda out, y: F.cross_entropy(out / temperature, y, reduction="none"),
              lambda out, y, f, loss: loss, extended=True)  # fmt: skip


def test_the_temperature_folded_into_the_last_layer_runs():
    """The fix it names: the last layer's weight and bias divided by T compute model(x) / T as modules, and the
    step is valid with BackPACK's curvature."""
    temperature = 2.0
    model, lossfunc = extend(_mlp()), extend(nn.CrossEntropyLoss())
    x, y = _batch()
    reference = model(x).detach() / temperature
    with torch.no_grad():
        model[2].weight.div_(temperature)
        model[2].bias.div_(temperature)
    cockpit = Cockpit(model.parameters(), quantities=configuration("business"))
    out = model(x)
    torch.testing.assert_close(out.detach(), reference)
    loss = lossfunc(out, y)
    info = {"batch_size": 8, "individual_losses": F.cross_entropy(out, y, reduction="none"), "loss": loss,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))
    assert cockpit.checks[0]["valid"] and "HessTrace" in cockpit.get_output()[0]


def _plain_step(backpropagated_of):
    """One economy step of a plain module: info['loss'] = rows.mean() of the declared rows, ``backpropagated_of(
    model, out, y, rows)`` what the loop calls backward() on."""
    model = _mlp()
    x, y = _batch()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    out = model(x)
    rows = F.cross_entropy(out, y, reduction="none")
    info = {"batch_size": 8, "individual_losses": rows, "loss": rows.mean(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            backpropagated_of(model, out, y, rows).backward()
    return cockpit.checks[0]


def test_a_distillation_term_beside_weighted_rows_is_not_called_row_weights():
    """``mean(0.5 * CE_rows + 0.5 * KD_rows)`` backpropagated, plain CE declared: the reason said row weights (its
    advice raised) and a note said to declare 2 micro-batches (which raised); now the failed check's general reason,
    and the note points at it."""
    torch.manual_seed(5)
    teacher = torch.randn(8, 4, dtype=DTYPE)

    def distilled(model, out, y, rows):
        kd = F.kl_div(F.log_softmax(out, 1), F.softmax(teacher, 1), reduction="none").sum(1)
        return (0.5 * rows + 0.5 * kd).mean()

    checks = _plain_step(distilled)
    reasons = {f["check"]: f["reason"] for f in checks["failed"]}
    assert "backpropagated_loss" in reasons and "multiplies (or divides) the rows" not in reasons["backpropagated_loss"]
    (note,) = [n for n in checks["notes"] if "x those of the step's mean loss" in n]
    assert "failed backpropagated_loss check" in note and "micro_batches'] = 2" not in note


def test_class_weights_in_the_backpropagated_loss_only_are_named_and_the_advice_works():
    weight = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=DTYPE)
    weighted = lambda out, y, f, loss: F.cross_entropy(out, y, weight=weight)  # noqa: E731
    checks, _ = _step("economy", lambda out, y, f: F.cross_entropy(out, y),
                      lambda out, y: F.cross_entropy(out, y, reduction="none"), weighted)  # fmt: skip
    reason = {f["check"]: f["reason"] for f in checks["failed"]}["backpropagated_loss"]
    assert "class weights (weight=) in the tensor backpropagated" in reason
    checks, _ = _step("economy", lambda out, y, f: F.cross_entropy(out, y, weight=weight),
                      lambda out, y: F.cross_entropy(out, y, weight=weight, reduction="none") * 8 / weight[y].sum(),
                      lambda out, y, f, loss: loss)  # fmt: skip
    assert checks["valid"] and not checks["failed"]
    with pytest.raises(ValueError, match=r"class weights \(weight=\) in info\['loss'\] and not"):
        _step("economy", lambda out, y, f: F.cross_entropy(out, y, weight=weight),
              lambda out, y: F.cross_entropy(out, y, reduction="none"), lambda out, y, f, loss: loss)  # fmt: skip


def test_graph_readers_for_weights():
    out, y = torch.randn(6, 4, dtype=DTYPE, requires_grad=True), torch.randint(0, 4, (6,))
    assert class_weights_in([F.cross_entropy(out, y, weight=torch.ones(4, dtype=DTYPE)).grad_fn]) is True
    assert class_weights_in([F.cross_entropy(out, y).grad_fn]) is False
    assert class_weights_in([F.mse_loss(out, torch.zeros_like(out)).grad_fn]) is None
    rows = F.cross_entropy(out, y, reduction="none")
    w = torch.linspace(0.5, 1.5, 6, dtype=DTYPE)
    assert weighs_rows([(rows * w).mean().grad_fn], rows)
    assert not weighs_rows([((rows * w) + rows.detach() * 0 + (out**2).sum(1)).mean().grad_fn], rows)


def test_an_orthogonality_penalty_is_told_to_be_declared_not_turned_into_weight_decay():
    """The reason called ||W W^T - I||^2 an L2 penalty and advised weight_decay (another objective); it names a
    penalty on the weights and how to declare it, which gives a valid step (the per-sample quantities left out)."""
    def penalised(model, out, y, rows):
        weight = model[0].weight
        return rows.mean() + 1e-2 * ((weight @ weight.T - torch.eye(8, dtype=DTYPE)) ** 2).sum()

    reason = {f["check"]: f["reason"] for f in _plain_step(penalised)["failed"]}["backpropagated_loss"]
    assert "orthogonality or other penalty" in reason and "Declare it" in reason
