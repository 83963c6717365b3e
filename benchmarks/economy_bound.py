#!/usr/bin/env python
"""The bound of the economy preset: what every implementation of its per-sample quantities must spend.

Cockpit's economy preset includes ``GradHist1d``, the histogram of all
``B x D`` individual gradient entries. Whatever the implementation, each of
those entries has to be produced (a per-sample gradient: for a convolution
a ``bmm`` per sample on the unfolded input, for a linear layer on a
sequence a ``bmm`` over positions) and binned once. This script times, on
the benchmark's problems (:mod:`benchmarks.overhead`) in one process,
interleaved over several repeats:

- ``plain``: one training step (zero_grad, forward, backward, SGD step);
- ``produce``: every per-sample gradient of every layer, from the layer
  inputs and output gradients of that step (the module rules of
  :mod:`cockpit_like.backends.module_rules`, made a block of rows at a time
  as the cockpit does, nothing else);
- ``bin``: counting those entries into the histogram
  (:class:`~cockpit_like.backends.fast_histograms.Hist1dCounter`, the
  cockpit's counter, on the dense rows);

and reports ``1 + (produce + bin) / plain``: the ratio to plain training
below which no implementation of the economy preset's exact histogram gets
on this machine with these kernels. Linear layers on 2-D inputs are left
out (their histogram is counted from the factors, without the dense
entries), so on problems with large ones (3c3d's classifier) the bound is
lower than what is spent. A parameter used by several layers (GPT-2's tied
embedding and output layer) is produced as the sum of its uses, a block of
rows at a time, and binned once, as the cockpit does.

    python benchmarks/economy_bound.py --problems 3c3d,2c2d,gpt,resnet --repeats 5
    python benchmarks/economy_bound.py --problems gpt2-small --repeats 3   # ~4 minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(problem: str, repeats: int) -> dict:
    import torch
    from torch import nn

    from benchmarks import overhead as ob
    from cockpit_like.backends.fast_histograms import Hist1dCounter
    from cockpit_like.backends.module_rules import Factors, rule_for, summed

    torch.set_num_threads(1)
    batch_size = ob.batch_size_of(problem, None)
    model, shape = ob.build_problem(problem, batch_size)
    batches = ob.make_batches(problem, model, shape, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    lossfunc = nn.CrossEntropyLoss()
    language_model = problem in ob.LANGUAGE_MODELS
    layers = [m for m in model.modules() if rule_for(m) is not None and any(True for _ in m.parameters(recurse=False))]
    seen: list = []

    def forward_hook(module, args, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            entry = [module, args[0].detach(), None]
            seen.append(entry)
            output.register_hook(lambda grad: entry.__setitem__(2, grad.detach()))

    handles = [m.register_forward_hook(forward_hook) for m in layers]

    def step(index: int, capture: bool) -> float:
        seen.clear()
        inputs, labels = batches[index % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = ob.token_losses(outputs.logits, labels).mean() if language_model else lossfunc(outputs, labels)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    def per_layer_rows():
        uses: dict = {}  # a tied parameter (GPT-2's embedding and output layer): one form, the sum of its uses
        for module, x, delta in seen:
            if delta is None:
                continue
            forms = rule_for(module)(module, x, delta)
            for name, param in module.named_parameters(recurse=False):
                form = (forms or {}).get(name)
                if form is not None:
                    uses.setdefault(id(param), (param, []))[1].append(form)
        for param, forms in uses.values():
            if len(forms) == 1 and isinstance(forms[0], Factors):
                continue  # a linear layer on rows: the factor form bins without the dense entries
            form = summed(forms, param.shape)
            rows = max(1, (256 << 20) // max(1, param.numel() * 4))
            for start in range(0, form.batch, rows):
                yield form.rows(start, min(form.batch, start + rows), param.shape), form.batch

    counter = Hist1dCounter(64, (-1.0, 1.0), torch.float32)
    plain, produce, binned, entries = [], [], [], 0
    step(0, True)  # warm-up
    for repeat in range(repeats):
        plain.append(step(repeat + 1, True))
        with torch.no_grad():
            start = time.perf_counter()
            count = 0
            for rows, _ in per_layer_rows():
                count += rows.numel()
            produce.append(time.perf_counter() - start)
            counts = counter.new_counts(torch.device("cpu"))
            start = time.perf_counter()
            for rows, batch in per_layer_rows():
                counter.count_grad_batch(counts, rows, scale=batch)
            binned.append(time.perf_counter() - start - produce[-1])
            entries = count
    for handle in handles:
        handle.remove()
    p, m, b = statistics.median(plain), statistics.median(produce), statistics.median(binned)
    return {
        "problem": problem,
        "batch_size": batch_size,
        "entries": entries,
        "plain_s": p,
        "produce_s": m,
        "bin_s": b,
        "bound_ratio": 1 + (m + b) / p,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", default="3c3d,2c2d,gpt,resnet")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "economy_bound.json"))
    args = parser.parse_args(argv)
    results = [measure(problem, args.repeats) for problem in args.problems.split(",")]
    print("| problem | B | entries (B x D) | plain step (ms) | produce per-sample gradients (ms) | bin them (ms) | bound (ratio) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['problem']} | {r['batch_size']} | {r['entries'] / 1e6:.1f} M | {1e3 * r['plain_s']:.0f} | "
            f"{1e3 * r['produce_s']:.0f} | {1e3 * r['bin_s']:.0f} | {r['bound_ratio']:.2f} |"
        )
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
