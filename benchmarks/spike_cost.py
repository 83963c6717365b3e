"""What the loss-spike post-mortem costs on top of an economy step (issue 38, part 4, at a small scale).

    python benchmarks/spike_cost.py                # a tiny GPT-2 (Hugging Face, from a config), CPU, one thread

Times, in one process and interleaved (round after round, so that a busy
machine slows every configuration alike), the training step with the
cockpit's ``economy`` preset tracking every step, and the same with
``PostMortem`` added (with and without the per-layer update ratios, whose
parameter copy is the only cost that grows with the model), and reports the
median step time of each and ``PostMortem``'s memory (``nbytes``). Writes
``benchmarks/results/spike_cost.json``. Not GPT-2 small (124M parameters,
batch 8 x 256): that needs the setup of ``benchmarks/economy_bound.py``
and minutes per configuration (docs/spikes.md).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(kind: str, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    from cockpit_like import Cockpit
    from cockpit_like.spikes import PostMortem
    from cockpit_like.utils.configuration import configuration
    from cockpit_like.utils.schedules import linear

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    quantities = configuration("economy")
    post = None
    if kind != "economy":
        post = PostMortem(linear(1), layer_updates=kind == "economy+PostMortem")
        quantities = quantities + [post]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, cockpit, optimizer, post


def step(model, cockpit, optimizer, index: int, batch: int = 8, length: int = 64) -> float:
    generator = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, 256, (batch, length), generator=generator)
    started = time.perf_counter()
    optimizer.zero_grad()
    logits = model(tokens, use_cache=False).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)
    info = {"batch_size": batch, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer,
            "sample_ids": torch.arange(batch) + batch * index}
    with cockpit(index, info=info):
        losses.mean().backward()
    optimizer.step()
    return time.perf_counter() - started


def main(rounds: int = 40, warmup: int = 3) -> dict:
    torch.set_num_threads(1)
    kinds = ["economy", "economy+PostMortem(layer_updates=False)", "economy+PostMortem"]
    built = {kind: build(kind) for kind in kinds}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(warmup + rounds):
            for kind in kinds:  # interleaved
                model, cockpit, optimizer, _ = built[kind]
                seconds = step(model, cockpit, optimizer, index)
                if index >= warmup:
                    times[kind].append(seconds)
    base = statistics.median(times["economy"])
    result = {"model": "GPT-2 from a config (2 layers, width 64, vocabulary 256), batch 8 x 64 tokens, AdamW, 1 thread",
              "parameters": sum(p.numel() for p in built["economy"][0].parameters()),
              "median_step_seconds": {k: statistics.median(v) for k, v in times.items()},
              "overhead_vs_economy": {k: statistics.median(v) / base - 1 for k, v in times.items()},
              "post_mortem_nbytes": {k: built[k][3].nbytes for k in kinds if built[k][3] is not None},
              "rounds": rounds}
    (ROOT / "benchmarks" / "results" / "spike_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
