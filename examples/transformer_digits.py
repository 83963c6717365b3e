"""Any model: a small transformer on scikit-learn's digits, full cockpit, no ``backpack.extend``.

Runs without any download (the 8x8 digits ship with scikit-learn)::

    python examples/transformer_digits.py                 # 300 steps, track every 5th
    python examples/transformer_digits.py --steps 40 --every 4 --no-show

Each 8x8 image is read as a sequence of 8 tokens, one per pixel row (8
features each). The classifier is a linear token embedding plus learned
position embeddings, an ``nn.TransformerEncoder`` (2 layers, width 32, 4
heads, no dropout), mean pooling over the 8 tokens and a linear head.

What it shows:

1. a plain ``nn.Module`` (attention, layer norm, a custom ``forward``) is
   watched without ``backpack.extend``: ``Cockpit(..., model=model)``
   computes per-sample gradients with module hooks, and the ``"full"``
   configuration's ``HessTrace`` (``curvature="auto"``) switches to
   Hutchinson's estimate from Hessian-vector products, and ``TICDiag`` to
   the GGN diagonal of the cross-entropy of ``info["outputs"]`` (exact: one
   backward pass per class; positive), since BackPACK cannot handle this
   model (the log's metadata records the choice, see ``docs/your_model.md``
   and ``docs/curvature.md``);
2. ``loss.backward(create_graph=cockpit.create_graph(step))``: the steps
   whose quantities use Hessian-vector products keep the graph;
3. the live dashboard every ``--plot-every`` steps, the log and the final
   picture in ``runs/`` (``runs/transformer_digits.json`` and
   ``runs/transformer_digits.png`` by default).

Without a display (ssh, ``MPLBACKEND=Agg``) nothing is shown and the picture
is still saved.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from torch import nn

from cockpit_like import Cockpit, CockpitPlotter
from cockpit_like.demo import accuracy, load_digits_tensors, minibatches
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

ROWS, COLUMNS = 8, 8  # an image is ROWS tokens of COLUMNS features


class DigitTransformer(nn.Module):
    """Row tokens -> embedding + positions -> transformer encoder -> mean pooling -> classes."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2, classes: int = 10):
        super().__init__()
        self.tokens = nn.Linear(COLUMNS, width)
        self.positions = nn.Embedding(ROWS, width)
        # ids [1, T], shared by every row of the batch (as in GPT-2)
        self.register_buffer("position_ids", torch.arange(ROWS).unsqueeze(0), persistent=False)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True,
                                           activation=nn.ReLU())  # a module: the dead-units rule watches it
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        sequence = images.reshape(-1, ROWS, COLUMNS)  # [B, 64] -> [B, 8 tokens, 8 features]
        hidden = self.tokens(sequence) + self.positions(self.position_ids)
        return self.head(self.encoder(hidden).mean(1))


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description="transformer on digits with the full cockpit, no backpack.extend")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=5, help="track every N steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--plot-every", type=int, default=50, help="redraw the dashboard every N steps (0: never)")
    parser.add_argument("--out", default="runs/transformer_digits", help="log path without suffix")
    parser.add_argument("--no-show", action="store_true", help="never open a window")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # PyTorch's note on backward(create_graph=True) (the Hessian-vector product steps)
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")

    torch.manual_seed(args.seed)
    train_x, train_y, test_x, test_y = load_digits_tensors(args.seed)
    model = DigitTransformer()  # a plain nn.Module: no backpack.extend
    lossfunc = nn.CrossEntropyLoss()  # mean over the batch
    individual_lossfunc = nn.CrossEntropyLoss(reduction="none")  # one loss per sample (per sequence)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    quantities = configuration("full", track_schedule=linear(args.every))
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model, diagnose=True)
    plotter = CockpitPlotter()
    show = not args.no_show
    picked = [f"{q['name']} -> {q['settings']['computed_with']}" for q in cockpit.metadata()["quantities"]
              if "computed_with" in q["settings"]]
    print(f"[transformer_digits] curvature (also in the log's metadata): {', '.join(picked)}")

    start = time.perf_counter()
    for step, epoch, epoch_end, inputs, labels in minibatches(train_x, train_y, args.batch_size, args.steps):
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        info = {
            "batch_size": len(labels),
            "individual_losses": individual_lossfunc(outputs, labels),
            "loss": loss,
            "optimizer": optimizer,
            "outputs": outputs,  # the logits: TICDiag divides by their cross-entropy's GGN diagonal
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
            plotter.plot(cockpit, show_plot=show, plot_title=f"transformer on digits, live (step {step})")
    elapsed = time.perf_counter() - start

    logpath = cockpit.write(args.out)
    directory, name = os.path.split(args.out)
    plotter.plot(cockpit, show_plot=show, block=show, save_plot=True, savedir=directory or ".", savename=name,
                 plot_title="transformer on digits (no backpack.extend)")
    print(f"[transformer_digits] {args.steps} steps in {elapsed:.1f}s; test accuracy {accuracy(model, test_x, test_y):.3f}")
    print(f"[transformer_digits] log: {logpath}\n[transformer_digits] dashboard: {plotter.last_saved}")
    return {"log": logpath, "dashboard": str(plotter.last_saved)}


if __name__ == "__main__":
    main()
