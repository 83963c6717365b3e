"""A loss computed in a coarser precision than its logits (Hugging Face's ``logits.float()`` on a float64 model) is
still a mean cross-entropy: the check of the loss (``backends/sampled.py``) reads it at the loss's own precision
(outside trial 33: every step of a float64 GPT-2 left TICDiag out saying its loss was not a cross-entropy)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from cockpit_like import Cockpit
from cockpit_like.backends.sampled import mean_cross_entropy_check
from cockpit_like.quantities import TICDiag


def _logits(rows=6, classes=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, classes, generator=generator, dtype=torch.float64).mul(3).requires_grad_(True)
    labels = torch.randint(0, classes, (rows,), generator=generator)
    return logits, labels


def test_a_float32_loss_of_float64_logits_is_a_mean_cross_entropy():
    logits, labels = _logits()
    loss = F.cross_entropy(logits.float(), labels)
    losses = F.cross_entropy(logits, labels, reduction="none")
    verdict, why = mean_cross_entropy_check(loss, logits, losses)
    assert verdict is True, why


@pytest.mark.parametrize("weight", [0.5, 0.9])
def test_a_weighted_float32_loss_of_float64_logits_is_still_refused(weight):
    logits, labels = _logits()
    loss = weight * F.cross_entropy(logits.float(), labels)
    verdict, why = mean_cross_entropy_check(loss, logits, None)
    assert verdict is False, why


def _gpt2_tic(loss_inside: bool) -> float:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).double()
    cockpit = Cockpit(model.parameters(), [TICDiag(track_schedule=lambda step: True)], model=model)
    ids = torch.randint(1, 50, (3, 10))
    out = model(input_ids=ids, labels=ids)
    logits, targets = out.logits[:, :-1], ids[:, 1:]
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
    loss = out.loss if loss_inside else losses.mean()
    assert loss.dtype == (torch.float32 if loss_inside else torch.float64)
    info = {"batch_size": 3, "individual_losses": losses, "loss": loss, "outputs": out.logits}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))
    record = cockpit.get_output()[0]
    assert "TICDiag" in record, record.get("checks")
    return record["TICDiag"]


def test_hugging_face_gpt2_in_float64_with_its_float32_loss_keeps_tic():
    inside, by_hand = _gpt2_tic(True), _gpt2_tic(False)
    # the same TIC up to float32's rounding of the loss's gradient
    assert inside == pytest.approx(by_hand, rel=1e-5)
