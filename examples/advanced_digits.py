"""Advanced example: full configuration, a custom quantity and the secondary screen.

Runs without any download (scikit-learn's 8x8 digits)::

    python examples/advanced_digits.py                    # 150 steps
    python examples/advanced_digits.py --steps 20 --no-show

On top of the basic example it shows:

- the ``"full"`` configuration (curvature: Hessian trace, TIC, top
  eigenvalue, 2-D histograms) tracked every ``--every`` steps, plus the
  quantities that are in no preset (KFACTrace, TICTrace, MeanGSNR, CABS,
  EarlyStopping) and per-layer 2-D histograms (``keep_individual=True``);
- a custom quantity (:class:`ParameterNorm`), drawn on the secondary
  screen's "Other quantities" panel;
- a log streamed to disk while training (``stream_to=``), plotted from the
  file at the end: the file and the live cockpit give the same picture.
"""

from __future__ import annotations

import argparse
import os

import torch
from backpack import extend

from cockpit_like import Cockpit, CockpitPlotter, quantities
from cockpit_like.demo import accuracy, load_digits_tensors, minibatches
from cockpit_like.quantities.quantity import ByproductQuantity
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear


class ParameterNorm(ByproductQuantity):
    """``||theta||_2`` over all parameters: a custom quantity needing nothing from BackPACK."""

    def _compute(self, global_step, params, batch_loss):
        return torch.sqrt(sum((p.detach() ** 2).sum() for p in params))


def make_quantities(every: int) -> list:
    """The full configuration (GradHist2d keeping per-layer histograms) plus the extras."""
    schedule = linear(every)
    chosen = [q for q in configuration("full", track_schedule=schedule) if type(q).__name__ != "GradHist2d"]
    if hasattr(quantities, "GradHist2d"):
        chosen.append(quantities.GradHist2d(schedule, keep_individual=True))
    for name in ("KFACTrace", "TICTrace", "MeanGSNR", "CABS", "EarlyStopping"):
        if hasattr(quantities, name):
            chosen.append(getattr(quantities, name)(schedule))
    chosen.append(ParameterNorm(schedule))
    return chosen


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description="full cockpit with a custom quantity and the secondary screen")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=2, help="track every N steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--plot-every", type=int, default=50, help="redraw the dashboard every N steps (0: never)")
    parser.add_argument("--out", default="runs/advanced_digits", help="log path without suffix")
    parser.add_argument("--no-show", action="store_true", help="never open a window")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_x, train_y, test_x, test_y = load_digits_tensors(args.seed)
    model = extend(torch.nn.Sequential(torch.nn.Linear(64, 24), torch.nn.Tanh(), torch.nn.Linear(24, 10)))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    individual_lossfunc = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    cockpit = Cockpit(model.parameters(), quantities=make_quantities(args.every), stream_to=args.out, diagnose=True)
    plotter = CockpitPlotter(secondary_screen=True)
    show = not args.no_show

    for step, epoch, epoch_end, inputs, labels in minibatches(train_x, train_y, args.batch_size, args.steps):
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        info = {
            "batch_size": len(labels),
            "individual_losses": individual_lossfunc(outputs, labels),
            "loss": loss,
            "optimizer": optimizer,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()

        if epoch_end:
            with torch.no_grad():
                test_loss = lossfunc(model(test_x), test_y).item()
            cockpit.log(
                step,
                epoch_count=epoch,
                train_loss=loss.item(),
                test_loss=test_loss,
                train_accuracy=accuracy(model, train_x, train_y),
                test_accuracy=accuracy(model, test_x, test_y),
                learning_rate=optimizer.param_groups[0]["lr"],
            )
        if args.plot_every and step % args.plot_every == 0:
            plotter.plot(cockpit, show_plot=show, plot_title=f"advanced digits, live (step {step})")

    cockpit.close()
    logpath = cockpit.write(args.out)
    directory, name = os.path.split(args.out)
    # Plot from the streamed file: the same picture as from the live cockpit.
    plotter.plot(cockpit.stream_path, show_plot=show, block=show, save_plot=True, savedir=directory or ".",
                 savename=name, savefig_kwargs={"dpi": 110})
    print(f"[advanced_digits] test accuracy {accuracy(model, test_x, test_y):.3f}")
    print(f"[advanced_digits] log: {logpath}\n[advanced_digits] dashboard: {plotter.last_saved}")
    return {"log": logpath, "stream": cockpit.stream_path, "dashboard": str(plotter.last_saved)}


if __name__ == "__main__":
    main()
