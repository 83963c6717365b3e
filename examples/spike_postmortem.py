"""A loss-spike post-mortem: which rows, which layers, what cause.

An MLP is trained on scikit-learn's digits in which one training sample is
corrupted (its pixels replaced by noise 30x their scale, its label wrong: a
data bug). The cockpit tracks ``PostMortem`` at every step with the dataset
index of each row as ``info["sample_ids"]``; whenever the corrupted sample
lands in a batch the loss spikes, and the post-mortem names the rows by their
share of the step's gradient (``<g_i / B, G> / ||G||^2``, exact from the
per-sample factors), the layers that moved first, and the likeliest cause::

    python examples/spike_postmortem.py                       # 150 steps
    python examples/spike_postmortem.py --picture docs/images/spike_postmortem.png
    python examples/spike_postmortem.py --dashboard docs/images/spike_dashboard.png   # the cockpit's dashboard
    cockpit-like spikes runs/spike_postmortem                 # the post-mortems, from the log
    cockpit-like diagnose runs/spike_postmortem               # the loss-spike findings

Runs in a few seconds on one CPU thread, without downloads.
"""

from __future__ import annotations

import argparse

import torch

from cockpit_like import Cockpit
from cockpit_like.demo import load_digits_tensors
from cockpit_like.quantities import Loss
from cockpit_like.spikes import PostMortem
from cockpit_like.spikes.report import format_post_mortem, post_mortems
from cockpit_like.utils.schedules import linear


def corrupt(inputs: torch.Tensor, labels: torch.Tensor, index: int, seed: int) -> None:
    """Replace sample ``index`` by noise 30x the data's scale with a wrong label (in place)."""
    generator = torch.Generator().manual_seed(seed)
    inputs[index] = torch.randn(inputs.shape[1], generator=generator) * 30 * inputs.std()
    labels[index] = (labels[index] + 1) % 10


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="loss-spike post-mortems on digits with one corrupted sample")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bad", type=int, default=123, help="dataset index of the corrupted sample (default 123)")
    parser.add_argument("--out", default="runs/spike_postmortem", help="log path without suffix")
    parser.add_argument("--picture", help="also save a picture of the last post-mortem (e.g. a .png path)")
    parser.add_argument("--dashboard", help="also save the cockpit's dashboard (its post-mortem panel) to this path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train_x, train_y, _, _ = load_digits_tensors(args.seed)
    corrupt(train_x, train_y, args.bad, args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    post = PostMortem(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[post, Loss(linear(1))], model=model, diagnose=True)

    generator = torch.Generator().manual_seed(args.seed + 1)
    order = torch.empty(0, dtype=torch.long)
    for step in range(args.steps):
        if len(order) < args.batch_size:  # a new epoch: every sample once, shuffled
            order = torch.cat([order, torch.randperm(len(train_y), generator=generator)])
        rows, order = order[: args.batch_size], order[args.batch_size:]
        optimizer.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(train_x[rows]), train_y[rows], reduction="none")
        loss = losses.mean()
        info = {"batch_size": len(rows), "individual_losses": losses, "loss": loss, "optimizer": optimizer,
                "sample_ids": rows}
        with cockpit(step, info=info):
            loss.backward()
        optimizer.step()

    log = cockpit.write(args.out)
    found = post_mortems(cockpit.get_output())
    bad_in = [step for step, p in found if any(r["id"] == args.bad for r in p["rows_by_share"][:3])]
    print(f"{len(found)} post-mortem(s); sample {args.bad} among the top 3 rows in {len(bad_in)} of them "
          f"(steps {bad_in}); memory kept across steps: {post.nbytes} bytes")
    if found:
        print()
        print(format_post_mortem(*found[0], cockpit._param_name_list()))
    written = {"log": log, "post_mortems": found, "bad_in_top3": bad_in}
    if args.picture:
        written["picture"] = picture(cockpit.get_output(), args.picture, args.bad)
    if args.dashboard:
        written["dashboard"] = dashboard(cockpit, args.dashboard)
    return written


def picture(output: dict, path: str, bad: int) -> str:
    """The loss with the post-mortems marked, beside the last post-mortem's gauge."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from cockpit_like import instruments

    steps = sorted(s for s, v in output.items() if "Loss" in v)
    spikes = [s for s, v in output.items() if "PostMortem" in v]
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    grid = fig.add_gridspec(1, 2, width_ratios=[1, 1.3])
    ax = fig.add_subplot(grid[0, 0])
    ax.plot(steps, [output[s]["Loss"] for s in steps], color="#1f77b4", lw=1)
    ax.scatter(spikes, [output[s]["Loss"] for s in spikes], color="#d62728", zorder=3, label="post-mortem")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title(f"Loss (sample {bad} corrupted)", fontsize=10, fontweight="bold")
    ax.legend(fontsize=8)
    instruments.post_mortem_gauge(output, fig, grid[0, 1])
    fig.savefig(path, dpi=110)
    return path


def dashboard(cockpit: Cockpit, path: str) -> str:
    """The cockpit's dashboard: with a post-mortem stored, its bottom band shows the last one."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    from cockpit_like import CockpitPlotter

    folder, name = os.path.split(os.path.abspath(path))
    stem, suffix = os.path.splitext(name)
    plotter = CockpitPlotter()
    plotter.plot(cockpit, show_plot=False, save_plot=True, savedir=folder, savename=stem,
                 savefig_kwargs={"format": (suffix.lstrip(".") or "png"), "dpi": 90})
    return str(plotter.last_saved)


if __name__ == "__main__":
    main()
