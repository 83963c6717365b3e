"""The main job: train a small network on scikit-learn's digits with a live cockpit.

``python -m cockpit_like.demo`` (or ``make demo``) trains an MLP on the 8x8
digits data that ships with scikit-learn (no download), tracks every
quantity cockpit_like has, writes the log to ``runs/digits.json`` (and streams
it to ``runs/digits.jsonl`` while training), and draws the dashboard to
``runs/digits.png``.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch
from backpack import extend

from cockpit_like import Cockpit, quantities
from cockpit_like.utils.progress import progress
from cockpit_like.utils.schedules import linear

__all__ = ["load_digits_tensors", "make_quantities", "main"]


def load_digits_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(train_x, train_y, test_x, test_y)``: scaled 8x8 digits, an 80/20 split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the demo uses scikit-learn's built-in digits data: pip install scikit-learn "
            "(or pip install -e '.[examples]')"
        ) from error
    data = load_digits()
    inputs = torch.tensor(data.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(labels))
    train, test = order[:split], order[split:]
    return inputs[train], labels[train], inputs[test], labels[test]


def make_quantities(every: int = 1, curvature_every: int = 5) -> list:
    """One instance of every available quantity.

    Cheap quantities track every ``every`` steps, the curvature ones (and the
    parameter snapshots) every ``curvature_every`` steps.
    """
    frequent, sparse = linear(every), linear(curvature_every)
    plan = [
        ("Loss", frequent), ("GradNorm", frequent), ("Distance", frequent), ("UpdateSize", frequent),
        ("Time", frequent), ("Alpha", frequent), ("NormTest", frequent), ("InnerTest", frequent),
        ("OrthoTest", frequent), ("MeanGSNR", frequent), ("CABS", frequent), ("EarlyStopping", frequent),
        ("GradHist1d", frequent), ("GradHist2d", sparse), ("HessTrace", sparse), ("TICDiag", sparse),
        ("TICTrace", sparse), ("HessMaxEV", sparse), ("KFACTrace", sparse), ("Parameters", linear(100)),
        ("ParamNorm", frequent), ("ActivationStats", frequent),
    ]
    made = []
    for name, schedule in plan:
        cls = getattr(quantities, name, None)
        if cls is not None:
            made.append(cls(track_schedule=schedule))
    return made


def minibatches(inputs: torch.Tensor, labels: torch.Tensor, batch_size: int, steps: int):
    """``steps`` shuffled mini-batches, a new permutation (``torch.randperm``) every epoch.

    Yields:
        ``(step, epoch, epoch_end, batch_inputs, batch_labels)``; ``epoch_end``
        is true at an epoch's last step and at the very last step.
    """
    per_epoch = len(labels) // batch_size
    for step in range(steps):
        position = step % per_epoch
        if position == 0:
            order = torch.randperm(len(labels))
        batch = order[position * batch_size : (position + 1) * batch_size]
        epoch_end = position == per_epoch - 1 or step == steps - 1
        yield step, step // per_epoch, epoch_end, inputs[batch], labels[batch]


def accuracy(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(inputs).argmax(1) == labels).float().mean().item()


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--out", default="runs/digits", help="log path without suffix (default runs/digits)")
    parser.add_argument("--plot-every", type=int, default=0, help="redraw the dashboard every N steps (0: only at the end)")
    parser.add_argument("--no-plot", action="store_true", help="skip the dashboard picture")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal anyway)")
    args = parser.parse_args(argv)
    # Two harmless PyTorch notes that BackPACK's hooks and HessMaxEV's double backward trigger.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")

    torch.manual_seed(args.seed)
    train_x, train_y, test_x, test_y = load_digits_tensors(args.seed)
    model = extend(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
    lossfunc = extend(torch.nn.CrossEntropyLoss())
    individual_lossfunc = torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    cockpit = Cockpit(model.parameters(), quantities=make_quantities(), stream_to=args.out, diagnose=True)
    plotter = None
    if not args.no_plot:
        from cockpit_like.plotting import CockpitPlotter

        plotter = CockpitPlotter()

    names = [cockpit.name_of(q) for q in cockpit.quantities]
    print(f"[demo] training an MLP on digits for {args.steps} steps, tracking: {', '.join(names)}")
    start = time.perf_counter()
    batches = minibatches(train_x, train_y, args.batch_size, args.steps)
    batches = progress(batches, args.steps, "[demo] training", enabled=False if args.no_progress else None)
    for step, epoch, epoch_end, inputs, labels in batches:
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        losses = individual_lossfunc(outputs, labels)
        info = {"batch_size": len(labels), "individual_losses": losses, "loss": loss, "optimizer": optimizer}
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
        if plotter is not None and args.plot_every and step % args.plot_every == 0:
            plotter.plot(cockpit, show_plot=False)
    elapsed = time.perf_counter() - start
    print(f"[demo] {args.steps} steps in {elapsed:.1f}s; test accuracy {accuracy(model, test_x, test_y):.3f}")
    active = cockpit.active_findings()
    print(f"[demo] diagnosis: {len(active)} active finding(s)" + "".join(
        f"\n[demo]   {finding.severity}: {finding.rule}: {finding.message}" for finding in active))

    written = {"log": cockpit.write(args.out), "stream": cockpit.stream_path}
    cockpit.close()
    if plotter is not None:
        from cockpit_like.plotting import save_dashboard

        written["dashboard"] = str(save_dashboard(written["log"]))
    for what, path in written.items():
        print(f"[demo] {what}: {path}")
    return written


if __name__ == "__main__":
    main()
