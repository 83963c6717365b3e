"""A learning rate far too large, diagnosed: the check-engine panel names the cause.

The MLP of ``basic_digits.py`` (ReLU, SGD, the economy preset) with a
learning rate of 40: the loss goes 2.3, 76, 5000 in the first steps, then
every ReLU is dead and the loss sits near 10-16. Several rules fire (update
spike, loss-diverging, exploding-gradient, dead-units, vanishing-gradient,
unchanged-parameters); the diagnosis groups them into one incident whose
cause is the learning rate, lists the others as its symptoms and gives the
fix for the cause::

    python examples/lr_blowup.py                 # lr 40: the blow-up
    python examples/lr_blowup.py --lr 0.3        # the same run, healthy: no finding
    cockpit-like diagnose runs/lr_blowup.json    # the grouped diagnosis as text

With ``diagnose=True`` the cockpit also tracks what the economy preset does
not (``ParamNorm``, ``LearningRate``, ``ActivationStats``) so that no rule is
skipped but those that read what no preset run has (``HessMaxEV``,
``valid_loss``, ``PostMortem``: the ``note:`` lines of ``cockpit-like
diagnose``); see docs/diagnosis.md and docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch

from cockpit_like import Cockpit, CockpitPlotter
from cockpit_like.demo import load_digits_tensors, minibatches
from cockpit_like.diagnosis import diagnose
from cockpit_like.diagnosis.report import format_incidents
from cockpit_like.utils.configuration import configuration


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="a learning-rate blow-up and its diagnosis")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=40.0, help="far too large on purpose (0.3 is healthy)")
    parser.add_argument("--out", default="runs/lr_blowup", help="log path without suffix")
    parser.add_argument("--no-show", action="store_true", help="never open a window")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_x, train_y, _, _ = load_digits_tensors(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    lossfunc = torch.nn.CrossEntropyLoss()
    individual_lossfunc = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model, diagnose=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a blow-up makes some quantities warn
        for step, epoch, epoch_end, inputs, labels in minibatches(train_x, train_y, args.batch_size, args.steps):
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = lossfunc(outputs, labels)
            info = {"batch_size": len(labels), "individual_losses": individual_lossfunc(outputs, labels),
                    "loss": loss, "optimizer": optimizer}
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()

    logpath = cockpit.write(args.out)
    incidents = diagnose(cockpit.get_output(), cockpit.metadata(), rules=[]).incidents  # the stored findings
    print(f"[lr_blowup] lr {args.lr}: {len(incidents)} incident(s)")
    print("\n".join(format_incidents(incidents)))
    directory, name = os.path.split(args.out)
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=not args.no_show, save_plot=True, savedir=directory or ".", savename=name)
    print(f"[lr_blowup] log: {logpath}\n[lr_blowup] dashboard: {plotter.last_saved}")
    return {"log": logpath, "dashboard": str(plotter.last_saved), "incidents": incidents}


if __name__ == "__main__":
    main()
