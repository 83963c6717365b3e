"""Where did the NaN come from? The recorder on a run that diverges.

An MLP on scikit-learn's digits whose hidden activation is a custom layer,
``log(cosh(x))`` written naively: ``cosh`` overflows to inf in float32 once
its input passes about 89, and with a learning rate far too large the
pre-activations get there within a few dozen steps. The loss turns NaN; the
cockpit records that step by itself (``Cockpit(record_nonfinite=True)``, the
default), names the operation and the module that produced the first
non-finite value, and writes a standalone program that replays the step::

    python examples/nan_origin.py                   # trains until the loss is NaN
    python runs/nan_origin/step_<N>.py              # the replay, needs only torch

See docs/recorder.md.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.demo import load_digits_tensors, minibatches
from cockpit_like.quantities import GradNorm, Loss
from cockpit_like.utils.schedules import linear


class NaiveLogCosh(nn.Module):
    """``log(cosh(x))``, a smooth |x|: fine for small inputs, inf once ``cosh`` overflows."""

    def forward(self, x):
        return torch.log(torch.cosh(x))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="find the operation that made the first NaN")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=4.0, help="far too large on purpose")
    parser.add_argument("--out", default="runs/nan_origin", help="folder for the record and its replay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-replay", action="store_true", help="do not run the replay program")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_x, train_y, _, _ = load_digits_tensors(args.seed)
    model = nn.Sequential(nn.Linear(64, 64), NaiveLogCosh(), nn.Linear(64, 10))
    lossfunc = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    cockpit = Cockpit(
        model.parameters(), [Loss(linear(10)), GradNorm(linear(10))], model=model, record_dir=args.out
    )

    bad_step = None
    for step, _, _, inputs, labels in minibatches(train_x, train_y, 64, args.steps):
        optimizer.zero_grad()
        loss = lossfunc(model(inputs), labels)
        info = {"loss": loss, "batch_size": len(labels), "loss_fn": lambda out, labels=labels: lossfunc(out, labels)}
        with cockpit(step, info=info):
            loss.backward()
        optimizer.step()
        if not math.isfinite(loss.item()):
            bad_step = step
            break
    if bad_step is None:
        print(f"the loss stayed finite for {args.steps} steps; try a larger --lr")
        return {"step": None}

    record = cockpit.records[bad_step]
    print(f"step {bad_step}: the loss is {loss.item()}")
    print(record.summary())
    for finding in cockpit.findings:
        print(f"[{finding.severity}] {finding.rule} ({finding.layer}): {finding.fix}")
    program = Path(args.out) / f"step_{bad_step}.py"
    replay = None
    if not args.no_replay:
        print(f"replaying {program} on its own:")
        replay = subprocess.run([sys.executable, str(program)], capture_output=True, text=True)
        print(replay.stdout.rstrip())
    return {"step": bad_step, "record": record, "program": str(program), "replay": replay}


if __name__ == "__main__":
    main()
