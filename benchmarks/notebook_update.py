"""The cost of one in-place dashboard update in a Jupyter notebook (docs/performance.md, docs/notebooks.md).

    python benchmarks/notebook_update.py [--steps 200] [--updates 10] [--dpi 80]

Runs in a real kernel (nbclient + ipykernel, the default inline backend): the
README loop on scikit-learn's digits with the economy cockpit for ``--steps``
steps, then ``--updates`` calls of ``plotter.plot(cockpit)`` in one cell (one
display, updated in place), each timed; prints the median of each part
(``read``: the cockpit's output, ``draw``: the instruments, ``png``: the
image of the display, ``total``: the whole call) and the image size, as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETUP = """
import statistics, time, torch
from backpack import extend
from cockpit_like import Cockpit, CockpitPlotter
from cockpit_like.demo import load_digits_tensors, minibatches
from cockpit_like.utils.configuration import configuration
torch.manual_seed(0)
train_x, train_y, _, _ = load_digits_tensors()
model = extend(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
lossfunc, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
plotter = CockpitPlotter(notebook_dpi=DPI)
for step, _, _, inputs, labels in minibatches(train_x, train_y, 64, STEPS):
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": len(labels), "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    optimizer.step()
"""

MEASURE = """
parts = {"read": [], "draw": [], "png": [], "total": []}
for _ in range(UPDATES):
    began = time.perf_counter()
    plotter.plot(cockpit)
    parts["total"].append(time.perf_counter() - began)
    for key in ("read", "draw"):
        parts[key].append(plotter.last_timing[key])
    parts["png"].append(plotter.last_timing["notebook_png"])
print("RESULT " + json.dumps({**{key: statistics.median(values) for key, values in parts.items()},
                              "image_bytes": plotter.last_image_bytes, "steps": STEPS, "dpi": DPI,
                              "updates": UPDATES}))
"""


def main(argv: list[str] | None = None) -> dict:
    import nbformat
    from nbclient import NotebookClient

    from examples.make_notebook import kernel_environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--dpi", type=float, default=80)
    args = parser.parse_args(argv)
    parameters = f"import json\nSTEPS, UPDATES, DPI = {args.steps}, {args.updates}, {args.dpi}"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)
                                               for source in (parameters, SETUP, MEASURE)])
    with tempfile.TemporaryDirectory() as folder:
        NotebookClient(notebook, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": folder}}).execute(env=kernel_environment())
    printed = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    result = json.loads(printed.split("RESULT ", 1)[1])
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
