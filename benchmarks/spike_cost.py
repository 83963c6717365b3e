"""What the loss-spike post-mortem costs on top of an economy step (issue 38, part 4, at a small scale).

    python benchmarks/spike_cost.py                # a tiny GPT-2 (Hugging Face, from a config), CPU, one thread
    python benchmarks/spike_cost.py --gpt2-small   # GPT-2 small (124M, GPT2Config() defaults), batch 8 x 256
    python benchmarks/spike_cost.py --gpt2-small --inside   # PostMortem's own work timed inside the step

Times, in one process and interleaved (round after round, so that a busy
machine slows every configuration alike), the training step with the
cockpit's ``economy`` preset tracking every step, and the same with
``PostMortem`` added (with and without the per-layer update ratios, whose
parameter copy is the only cost that grows with the model), and reports the
median step time of each and ``PostMortem``'s memory (``nbytes``). Writes
``benchmarks/results/spike_cost.json`` (``spike_cost_gpt2_small.json`` with
``--gpt2-small``: the Hugging Face ``GPT2Config()`` defaults, 124M parameters,
dropout off, built from the config, batch 8 x 256 tokens; a few rounds, each
step several seconds on one thread); ``--out PATH`` writes elsewhere (a smoke run).
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


def build(kind: str, seed: int = 0, small: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    from cockpit_like import Cockpit
    from cockpit_like.spikes import PostMortem
    from cockpit_like.utils.configuration import configuration
    from cockpit_like.utils.schedules import linear

    torch.manual_seed(seed)
    if small:  # GPT-2 small
        config = GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    else:
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
    tokens = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)
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


def main(rounds: int = 40, warmup: int = 3, gpt2_small: bool = False, out: Path | None = None) -> dict:
    torch.set_num_threads(1)
    kinds = ["economy", "economy+PostMortem(layer_updates=False)", "economy+PostMortem"]
    built = {kind: build(kind, small=gpt2_small) for kind in kinds}
    length = 256 if gpt2_small else 64
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(warmup + rounds):
            for kind in kinds:  # interleaved
                model, cockpit, optimizer, _ = built[kind]
                seconds = step(model, cockpit, optimizer, index, length=length)
                if index >= warmup:
                    times[kind].append(seconds)
    base = statistics.median(times["economy"])
    name = ("GPT-2 small (GPT2Config() defaults, from the config), batch 8 x 256 tokens, AdamW, 1 thread" if gpt2_small
            else "GPT-2 from a config (2 layers, width 64, vocabulary 256), batch 8 x 64 tokens, AdamW, 1 thread")
    result = {"model": name,
              "parameters": sum(p.numel() for p in built["economy"][0].parameters()),
              "median_step_seconds": {k: statistics.median(v) for k, v in times.items()},
              "overhead_vs_economy": {k: statistics.median(v) / base - 1 for k, v in times.items()},
              "post_mortem_nbytes": {k: built[k][3].nbytes for k in kinds if built[k][3] is not None},
              "rounds": rounds}
    if out is None:
        out = ROOT / "benchmarks" / "results" / ("spike_cost_gpt2_small.json" if gpt2_small else "spike_cost.json")
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


def inside(steps: int = 6, gpt2_small: bool = False) -> dict:
    """PostMortem's own work timed inside the economy step: its ``track`` call (row summaries, detector, norms,
    at a spike the post-mortem), against the whole step, per step; and whether it asks the backward pass for
    any per-sample statistic the economy preset does not already reduce (its ``GramSummary`` is the gradient
    tests'). Robust on a busy machine: both are timed in the same step."""
    torch.set_num_threads(1)
    model, cockpit, optimizer, post = build("economy+PostMortem(layer_updates=False)", small=gpt2_small)
    others = [q for q in cockpit.quantities if q is not post]
    own = set(post.per_sample_stats(0)) - {s for q in others for s in q.per_sample_stats(0)}
    inner: list[float] = []
    track = post.track

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return track(*args, **kwargs)
        finally:
            inner.append(time.perf_counter() - started)

    post.track = timed
    totals = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(steps + 1):
            seconds = step(model, cockpit, optimizer, index, length=256 if gpt2_small else 64)
            if index:  # the first step warms up
                totals.append(seconds)
    inner = inner[1:]
    shares = [a / b for a, b in zip(inner, totals)]
    result = {"model": "GPT-2 small, batch 8 x 256" if gpt2_small else "tiny GPT-2, batch 8 x 64",
              "steps": steps, "median_step_seconds": statistics.median(totals),
              "median_post_mortem_seconds": statistics.median(inner), "max_share_of_step": max(shares),
              "median_share_of_step": statistics.median(shares),
              "extra_per_sample_statistics": sorted(map(repr, own)), "nbytes": post.nbytes}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpt2-small", action="store_true", help="GPT-2 small, batch 8 x 256 (minutes)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 40; 3 with --gpt2-small)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3; 1 with --gpt2-small)")
    parser.add_argument("--inside", action="store_true",
                        help="time PostMortem's own work inside the step (robust on a busy machine)")
    parser.add_argument("--out", default=None,
                        help="where the JSON goes (default: the tracked benchmarks/results/spike_cost[_gpt2_small].json)")
    args = parser.parse_args()
    for name in ("rounds", "warmup"):
        value = getattr(args, name)
        if value is not None and (value < 0 or (name == "rounds" and value == 0)):
            parser.error(f"--{name} must be {'positive' if name == 'rounds' else 'zero or more'}, got {value}")
    if args.inside:
        inside(6 if args.rounds is None else args.rounds, args.gpt2_small)
        sys.exit(0)
    main(rounds=(3 if args.gpt2_small else 40) if args.rounds is None else args.rounds,
         warmup=(1 if args.gpt2_small else 3) if args.warmup is None else args.warmup,
         gpt2_small=args.gpt2_small, out=args.out)
