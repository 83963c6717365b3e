"""DataStats reads the model's input and output where a Hugging Face-style model takes keyword arguments and
returns a ModelOutput (a mapping whose "loss" comes first): it stored ``outputs: None`` there, so the
saturated-output and loss-at-chance tests could not find the number of classes (an outside trial's tiny
Llama with a softmax before the cross-entropy was missed)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import DataStats
from cockpit_like.utils.schedules import linear


class _KeywordModel(nn.Module):
    """``model(input_ids=ids, labels=y)`` -> ``{"loss": ..., "logits": ...}``, a softmax inside (probabilities)."""

    def __init__(self, vocab=11, classes=5, softmax=True):
        super().__init__()
        self.emb, self.head, self.softmax = nn.Embedding(vocab, 8), nn.Linear(8, classes), softmax

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        out = logits.softmax(-1) if self.softmax else logits
        loss = F.cross_entropy(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


def _run(model, ids, y):
    cockpit = Cockpit(model.parameters(), quantities=[DataStats(linear(1))], model=model)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=None)
    losses = F.cross_entropy(out["logits"], y, reduction="none")
    with cockpit(0, info={"batch_size": len(y), "loss": losses.mean(), "individual_losses": losses}):
        losses.mean().backward()
    return cockpit.get_output()[0]["DataStats"], out["logits"].detach()


@pytest.mark.parametrize("softmax", [True, False])
def test_keyword_inputs_and_a_mapping_output(softmax):
    torch.manual_seed(0)
    ids, y = torch.randint(0, 11, (6, 4)), torch.randint(0, 5, (6,))
    value, logits = _run(_KeywordModel(softmax=softmax), ids, y)
    assert value["outputs"] == 5 and value["output_probabilities"] is softmax
    assert value["output_min"] == pytest.approx(float(logits.min())) and value["output_max"] == pytest.approx(
        float(logits.max()))
    assert value["input_integer"] is True and math.isnan(value["input_rms"]) and value["samples"] == 6


def test_a_hugging_face_model_output():
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=4, pad_token_id=0)
    model = LlamaForSequenceClassification(config)
    ids, y = torch.randint(1, 32, (5, 6)), torch.randint(0, 4, (5,))
    cockpit = Cockpit(model.parameters(), quantities=[DataStats(linear(1))], model=model)
    out = model(input_ids=ids)
    assert isinstance(out, transformers.utils.ModelOutput)
    losses = F.cross_entropy(out.logits, y, reduction="none")
    with cockpit(0, info={"batch_size": 5, "loss": losses.mean(), "individual_losses": losses}):
        losses.mean().backward()
    value = cockpit.get_output()[0]["DataStats"]
    assert value["outputs"] == 4 and value["output_probabilities"] is False and value["input_integer"] is True
    assert value["output_max"] == pytest.approx(float(out.logits.max()))
