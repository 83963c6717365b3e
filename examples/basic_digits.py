"""Basic example: an MLP on scikit-learn's digits with the economy cockpit and a live dashboard.

Runs without any download (the 8x8 digits ship with scikit-learn)::

    python examples/basic_digits.py                      # 200 steps, redraw every 25
    python examples/basic_digits.py --steps 50 --plot-every 10 --no-show

What it shows:

1. build the cockpit from the ``"economy"`` configuration;
2. wrap ``loss.backward()`` in ``with cockpit(step, info=...)``;
3. log epoch figures with ``cockpit.log(...)`` (loss, accuracy, learning rate);
4. redraw one live window every ``--plot-every`` steps (in place);
5. write the log and save the final dashboard next to it
   (``runs/basic_digits.json`` and ``runs/basic_digits.png`` by default).

Without a display (e.g. over ssh, or ``MPLBACKEND=Agg``) nothing is shown and
the picture is still saved.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from backpack import extend

from cockpit_like import Cockpit, CockpitPlotter
from cockpit_like.demo import accuracy, load_digits_tensors, minibatches
from cockpit_like.utils.configuration import configuration


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description="MLP on digits with the economy cockpit")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--plot-every", type=int, default=25, help="redraw the dashboard every N steps (0: never)")
    parser.add_argument("--out", default="runs/basic_digits", help="log path without suffix")
    parser.add_argument("--no-show", action="store_true", help="never open a window")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_x, train_y, test_x, test_y = load_digits_tensors(args.seed)
    model = extend(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    individual_lossfunc = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), diagnose=True)
    plotter = CockpitPlotter()
    show = not args.no_show

    plot_seconds = []
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
            cockpit.log(
                step,
                epoch_count=epoch,
                train_loss=loss.item(),
                train_accuracy=accuracy(model, train_x, train_y),
                test_accuracy=accuracy(model, test_x, test_y),
                learning_rate=optimizer.param_groups[0]["lr"],
            )
        if args.plot_every and step % args.plot_every == 0:
            began = time.perf_counter()
            plotter.plot(cockpit, show_plot=show)  # one window, updated in place
            plot_seconds.append(time.perf_counter() - began)

    logpath = cockpit.write(args.out)
    directory, name = os.path.split(args.out)
    plotter.plot(cockpit, show_plot=show, save_plot=True, savedir=directory or ".", savename=name)
    if plot_seconds:
        print(f"[basic_digits] {len(plot_seconds)} live redraws, {sum(plot_seconds) / len(plot_seconds):.2f}s each")
    print(f"[basic_digits] test accuracy {accuracy(model, test_x, test_y):.3f}")
    print(f"[basic_digits] log: {logpath}\n[basic_digits] dashboard: {plotter.last_saved}")
    return {"log": logpath, "dashboard": str(plotter.last_saved)}


if __name__ == "__main__":
    main()
