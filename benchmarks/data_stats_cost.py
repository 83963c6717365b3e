"""What ``DataStats`` (the input statistics the round-4/5 rules read) costs per tracked step.

Per problem, one process trains a healthy generated run (``cockpit_like.corpus_generator``) under a
cockpit tracking every quantity the rules read at every step, ``DataStats`` included only on some
steps: in the order on, off, off, on (repeated), so that a shared machine's drifting load falls on
both alike. The figure per problem is the difference of the median step times (the whole step:
forward, backward under the cockpit, the optimizer step) with and without ``DataStats``, in ms and
as a share of the step without it; per round, and the median over rounds.

    python benchmarks/data_stats_cost.py --archs mlp,cnn,gpt,lstm --steps 160 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _on(step: int) -> bool:
    """The interleaving: on, off, off, on, on, off, off, on, ..."""
    return (step % 4) in (0, 3)


def one_round(arch: str, steps: int, warmup: int, seed: int) -> dict:
    import torch

    from cockpit_like import Cockpit
    from cockpit_like.corpus_generator import (_WITH_ALPHA, _data, _loss, _model, _optimizer, generate,
                                               quantities_for_rules, scheduled_rate)
    from cockpit_like.quantities import DataStats

    spec = next(s for s in generate("tuning", 400, seed=seed) if s.arch == arch and s.fault is None)
    torch.manual_seed(spec.seed)
    inputs, targets, in_features, out_features = _data(spec)
    model = _model(spec, in_features, out_features)
    params = list(model.parameters())
    optimizer = _optimizer(spec, [{"params": params}])
    quantities = [q for q in quantities_for_rules() if not isinstance(q, DataStats)]
    if arch not in _WITH_ALPHA:
        quantities = [q for q in quantities if type(q).__name__ != "Alpha"]
    quantities.append(DataStats(_on))
    cockpit = Cockpit(params, quantities=quantities, model=model)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    times = {True: [], False: []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = scheduled_rate(spec, step % spec.steps)
            rows = torch.randint(0, len(inputs), (spec.batch,), generator=generator)
            x = inputs[rows]
            y = x[:, 1:] if spec.data == "tokens-lm" else targets[rows]
            if spec.data == "tokens-lm":
                x = x[:, :-1]
            optimizer.zero_grad()
            individual = _loss(spec, model(x), y)
            loss = individual.mean()
            info = {"batch_size": spec.batch, "loss": loss, "optimizer": optimizer, "individual_losses": individual}
            with cockpit(step, info=info):
                loss.backward()
            optimizer.step()
            if step >= warmup:
                times[_on(step)].append(time.perf_counter() - started)
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    return {"arch": arch, "run": spec.name, "with_ms": 1e3 * with_, "without_ms": 1e3 * without,
            "cost_ms": 1e3 * (with_ - without), "share": (with_ - without) / without,
            "steps": [len(times[True]), len(times[False])]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="mlp,cnn,gpt,lstm")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed the healthy runs are drawn with")
    parser.add_argument("--out", help="write the results to this JSON file")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results = {}
    for arch in args.archs.split(","):
        rounds = [one_round(arch, args.steps, args.warmup, args.seed) for _ in range(args.rounds)]
        cost = statistics.median(r["cost_ms"] for r in rounds)
        share = statistics.median(r["share"] for r in rounds)
        results[arch] = {"rounds": rounds, "cost_ms": cost, "share": share}
        print(f"{arch:6s} {rounds[0]['run']:55s} step without {statistics.median(r['without_ms'] for r in rounds):7.2f} ms, "
              f"DataStats {cost:+.3f} ms ({100 * share:+.1f}%); rounds: "
              + ", ".join(f"{r['cost_ms']:+.3f}" for r in rounds), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
