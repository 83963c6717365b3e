#!/usr/bin/env python
"""Cost of TICDiag's curvatures on models BackPACK cannot handle: one tracked step against a plain step (issue 37).

    python benchmarks/tic_cost.py

TICDiag alone with ``curvature="auto"`` (the GGN diagonal: exact per class for
outputs ``[B, C]`` with at most 10 classes, else 4 sketched draws) and with
``"hutchinson"`` (4 Hessian-vector products); median of 4 alternating
repetitions, one thread, batch 16, float64.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def problems():
    from examples.transformer_digits import DigitTransformer
    from tests.zoo import ZOO

    problem = ZOO["encoder"](0)
    yield ("zoo/encoder (3 classes)", problem.model, problem.forward, problem.batch(16, 0), problem.sample_losses,
           lambda outputs: outputs)
    problem = ZOO["gpt2"](0)
    yield ("zoo/gpt2 (sequence, vocabulary 40)", problem.model, problem.forward, problem.batch(16, 0),
           problem.sample_losses, lambda outputs: outputs.logits[:, :-1])
    torch.manual_seed(0)
    model = DigitTransformer().double()
    inputs, labels = torch.randn(16, 8, 8, dtype=torch.float64), torch.randint(0, 10, (16,))

    def losses(outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets, reduction="none")

    yield "transformer_digits (10 classes)", model, lambda m, x: m(x), (inputs, labels), losses, lambda outputs: outputs


def main() -> int:
    from cockpit_like import Cockpit
    from cockpit_like.quantities import TICDiag
    from cockpit_like.utils.schedules import linear

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name, model, forward, (inputs, targets), losses, logits in problems():
        times = {"plain": [], "auto (ggn)": [], "hutchinson": []}
        # Hutchinson's Hessian diagonal: refused by TICDiag since outside trial 35, measured here for its cost only
        refusing_nothing = type("TICDiag", (TICDiag,), {"_refused": {}})
        cockpits = {key: Cockpit(model.parameters(), quantities=[kind(linear(1), curvature=curvature)], model=model)
                    for key, kind, curvature in (("auto (ggn)", TICDiag, "auto"),
                                                 ("hutchinson", refusing_nothing, "hutchinson"))}  # fmt: skip
        for step in range(4):
            for key in times:
                for p in model.parameters():
                    p.grad = None
                start = time.perf_counter()
                if key == "plain":
                    losses(forward(model, inputs), targets).mean().backward()
                else:
                    cockpit = cockpits[key]
                    outputs = forward(model, inputs)
                    loss = losses(outputs, targets).mean()
                    with cockpit(step, info={"batch_size": len(targets), "loss": loss, "outputs": logits(outputs)}):
                        loss.backward(create_graph=cockpit.create_graph(step))
                times[key].append(time.perf_counter() - start)
        plain = statistics.median(times["plain"])
        ratios = {key: f"{statistics.median(value) / plain:.1f}x plain" for key, value in times.items() if key != "plain"}
        print(name, ratios, f"(plain {1000 * plain:.0f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
