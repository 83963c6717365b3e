"""Hugging Face architectures for the model-zoo test: each built from a tiny config, in float64, offline.

Every entry of :data:`HF_ZOO` is ``name -> factory(seed) -> Problem`` (see
:mod:`tests.zoo`): a model built from a config (never ``from_pretrained``),
dropout off (the hook backend re-runs some modules), a batch maker and the
per-row losses whose mean is the mini-batch loss. ``Problem.forward`` returns
the logits, so outputs compare as tensors.

What each architecture exercises in the hook backend:

- GPT-2, BART, OPT (positions), Llama / Qwen2 / Mistral / GPT-NeoX (rotary
  tables shared by all rows): outputs of leading dimension 1 shared by the
  batch (climbing);
- OPT's MLP, Mixtral's experts: rows flattened to ``[B*T, d]``; Mixtral's
  experts receive tokens routed from every row;
- T5: the relative attention bias, an embedding whose output has no batch
  dimension and is passed on to every later layer;
- DeBERTa-v2: relative position embeddings read as a weight by a container;
- ViT: a class token and position table owned by the embedding module;
- ALBERT: one layer applied several times (shared parameters);
- Mamba: a state-space mixer with its own parameters (the ``torch.func`` fallback);
- BLOOM: ALiBi biases; BERT, RoBERTa: classifier and masked-LM heads.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.zoo import DTYPE, Problem

VOCAB, LENGTH, CLASSES = 40, 5, 3


def _tokens(size: int, seed: int, low: int = 3):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (size, LENGTH), generator=generator), generator


def _lm_batch(size, seed):
    tokens, _ = _tokens(size, seed)
    return tokens, tokens


def _lm_losses(logits, tokens):
    """Per row: the mean cross-entropy of predicting token ``t + 1`` from tokens ``<= t``."""
    per_token = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    return per_token.mean(1)


def _token_batch(size, seed):
    tokens, generator = _tokens(size, seed)
    return tokens, torch.randint(0, VOCAB, (size, LENGTH), generator=generator)


def _token_losses(logits, targets):
    return nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)


def _class_batch(size, seed):
    tokens, generator = _tokens(size, seed)
    return tokens, torch.randint(0, CLASSES, (size,), generator=generator)


def _class_losses(logits, labels):
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def _logits(model, inputs):
    return model(input_ids=inputs).logits


def _build(model_class, config, seed):
    torch.manual_seed(seed)
    return model_class(config).to(DTYPE).train()


def _causal(config_class, model_class, **options):
    def factory(seed: int = 0) -> Problem:
        config = config_class(vocab_size=VOCAB, **options)
        return Problem(_build(model_class, config, seed), _lm_batch, _lm_losses, _logits)

    return factory


def _decoder_options(**extra):
    return dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=16, attention_dropout=0.0, **extra)


def gpt2(seed: int = 0) -> Problem:
    from tests.zoo import gpt2 as plain

    problem = plain(seed)
    return Problem(problem.model, _lm_batch, _lm_losses, _logits)


def llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _causal(LlamaConfig, LlamaForCausalLM, **_decoder_options())(seed)


def qwen2(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _causal(Qwen2Config, Qwen2ForCausalLM, **_decoder_options())(seed)


def mistral(seed=0):
    from transformers import MistralConfig, MistralForCausalLM

    return _causal(MistralConfig, MistralForCausalLM, **_decoder_options(head_dim=8))(seed)


def mixtral(seed=0):
    from transformers import MixtralConfig, MixtralForCausalLM

    options = _decoder_options(head_dim=8, num_local_experts=3, num_experts_per_tok=2, router_jitter_noise=0.0,
                               experts_implementation="eager")
    return _causal(MixtralConfig, MixtralForCausalLM, **options)(seed)


def gpt_neox(seed=0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    options = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                   max_position_embeddings=16, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    return _causal(GPTNeoXConfig, GPTNeoXForCausalLM, **options)(seed)


def bloom(seed=0):
    from transformers import BloomConfig, BloomForCausalLM

    options = dict(hidden_size=16, n_layer=1, n_head=2, hidden_dropout=0.0, attention_dropout=0.0)
    return _causal(BloomConfig, BloomForCausalLM, **options)(seed)


def opt(seed=0):
    from transformers import OPTConfig, OPTForCausalLM

    options = dict(hidden_size=16, ffn_dim=24, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16,
                   word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
                   pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return _causal(OPTConfig, OPTForCausalLM, **options)(seed)


def mamba(seed=0):
    from transformers import MambaConfig, MambaForCausalLM

    options = dict(hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3, time_step_rank=4,
                   use_mambapy=False)
    return _causal(MambaConfig, MambaForCausalLM, **options)(seed)


def _seq2seq(config_class, model_class, seed, **options):
    config = config_class(vocab_size=VOCAB, **options)
    model = _build(model_class, config, seed)

    def forward(model, inputs):
        return model(input_ids=inputs, decoder_input_ids=inputs.flip(1)).logits

    return Problem(model, _token_batch, _token_losses, forward)


def t5(seed=0):
    from transformers import T5Config, T5ForConditionalGeneration

    return _seq2seq(T5Config, T5ForConditionalGeneration, seed, d_model=16, d_kv=8, d_ff=24, num_layers=2,
                    num_decoder_layers=1, num_heads=2, relative_attention_num_buckets=8,
                    relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)


def bart(seed=0):
    from transformers import BartConfig, BartForConditionalGeneration

    return _seq2seq(BartConfig, BartForConditionalGeneration, seed, d_model=16, encoder_layers=1, decoder_layers=1,
                    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
                    max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)


def _encoder_options(**extra):
    return dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)


def bert(seed=0):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, num_labels=CLASSES, **_encoder_options())
    return Problem(_build(BertForSequenceClassification, config, seed), _class_batch, _class_losses, _logits)


def roberta(seed=0):
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(vocab_size=VOCAB, pad_token_id=1, **_encoder_options())
    return Problem(_build(RobertaForMaskedLM, config, seed), _token_batch, _token_losses, _logits)


def albert(seed=0):
    from transformers import AlbertConfig, AlbertForSequenceClassification

    config = AlbertConfig(vocab_size=VOCAB, embedding_size=8, num_labels=CLASSES, num_hidden_layers=2, classifier_dropout_prob=0.0,
                          **{k: v for k, v in _encoder_options().items() if k != "num_hidden_layers"})
    return Problem(_build(AlbertForSequenceClassification, config, seed), _class_batch, _class_losses, _logits)


def deberta_v2(seed=0):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(vocab_size=VOCAB, num_labels=CLASSES, relative_attention=True, position_buckets=4,
                             max_relative_positions=8, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                             norm_rel_ebd="layer_norm", pooler_dropout=0.0, **_encoder_options())
    return Problem(_build(DebertaV2ForSequenceClassification, config, seed), _class_batch, _class_losses, _logits)


def vit(seed=0):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=8, patch_size=4, num_channels=2, num_labels=CLASSES, **{
        k: v for k, v in _encoder_options().items() if k != "max_position_embeddings"})

    def batch(size, seed):
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randn(size, 2, 8, 8, generator=generator, dtype=DTYPE)
        return pixels, torch.randint(0, CLASSES, (size,), generator=generator)

    def forward(model, pixels):
        return model(pixel_values=pixels).logits

    return Problem(_build(ViTForImageClassification, config, seed), batch, _class_losses, forward)


HF_ZOO = {
    "gpt2": gpt2,
    "llama": llama,
    "qwen2": qwen2,
    "mistral": mistral,
    "mixtral": mixtral,
    "gpt_neox": gpt_neox,
    "bloom": bloom,
    "opt": opt,
    "mamba": mamba,
    "t5": t5,
    "bart": bart,
    "bert": bert,
    "roberta": roberta,
    "albert": albert,
    "deberta_v2": deberta_v2,
    "vit": vit,
}
