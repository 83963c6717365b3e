"""Build ``examples/notebook_digits.ipynb`` from the cells below and execute it with its outputs.

    python examples/make_notebook.py          # needs nbformat, nbclient, ipykernel (requirements.txt)

The notebook runs in a fresh kernel with the default ``inline`` backend
(``MPLBACKEND`` unset), in a temporary folder (its ``runs/`` is thrown away),
and is saved with what the kernel showed: one dashboard image per cell,
updated in place while the cell ran (the saved file keeps its last state).
``tests/test_notebooks.py`` executes the same notebook and checks the messages.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "notebook_digits.ipynb"

CELLS: list[tuple[str, str]] = [
    ("markdown", """# A live cockpit in a notebook

The README's loop, as you would run it in Jupyter, JupyterLab or VS Code: an MLP on scikit-learn's 8x8 digits
(no download) with the `economy` cockpit. No `%matplotlib` magic is needed: `plotter.plot(cockpit)` shows **one**
dashboard image in the cell and replaces it in place at every call (the title says which step it shows).
See `docs/notebooks.md`."""),
    ("code", """import torch
from backpack import extend

from cockpit_like import Cockpit, CockpitPlotter
from cockpit_like.demo import load_digits_tensors, minibatches
from cockpit_like.utils.configuration import configuration

torch.manual_seed(0)
train_x, train_y, test_x, test_y = load_digits_tensors()
model = extend(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
lossfunc = extend(torch.nn.CrossEntropyLoss())                 # mean reduction
individual_lossfunc = torch.nn.CrossEntropyLoss(reduction="none")
optimizer = torch.optim.SGD(model.parameters(), lr=0.3)

cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), stream_to="runs/notebook")
plotter = CockpitPlotter(notebook_dpi=50, notebook_colors=128)  # a small image for this file (default: 80 dpi, full colour)"""),
    ("markdown", """## Train, watching the dashboard

The image below the cell is created by the first `plot` call and updated by the later ones."""),
    ("code", """for step, epoch, epoch_end, inputs, labels in minibatches(train_x, train_y, batch_size=64, steps=STEPS):
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    losses = individual_lossfunc(outputs, labels)
    info = {"batch_size": len(labels), "individual_losses": losses, "loss": loss, "optimizer": optimizer}
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    optimizer.step()
    if step % PLOT_EVERY == 0 or step == STEPS - 1:
        plotter.plot(cockpit)          # live dashboard, updated in place
print(f"one update took {plotter.last_timing['total']:.2f} s ({plotter.last_image_bytes / 1e3:.0f} kB image)")"""),
    ("markdown", """## Running the training cell again

Running the cell above a second time would track steps 0, 1, ... again on the same cockpit. The cockpit refuses
(`StepAlreadyTrackedError`, before the backward pass) instead of replacing what it stored, so that the log in
memory and the stream `runs/notebook.jsonl` always agree. To go on training, continue the step numbers; to start
over, run the first cell again (a new `Cockpit`, a new `stream_to`). Here the same step, caught:"""),
    ("code", """from cockpit_like.run_output import StepAlreadyTrackedError

try:
    with cockpit(0, info=info):
        loss.backward()
except StepAlreadyTrackedError as error:
    print(error)"""),
    ("markdown", """## Afterwards

The log is on disk (`runs/notebook.json`, and the stream `runs/notebook.jsonl` written all along);
`cockpit-like plot runs/notebook` draws it again. `plotter.fig` as the last line of a later cell shows a still copy
of the last dashboard."""),
    ("code", """cockpit.write("runs/notebook")"""),
]

#: the steps and the redraw period of the saved example (the test runs fewer)
PARAMETERS = {"STEPS": 60, "PLOT_EVERY": 20}


def build(parameters: dict[str, int] | None = None):
    """The notebook (nbformat), with a first cell that sets ``parameters``."""
    import nbformat

    values = {**PARAMETERS, **(parameters or {})}
    cells = [nbformat.v4.new_code_cell("\n".join(f"{key} = {value!r}" for key, value in values.items()),
                                       metadata={"tags": ["parameters"]})]
    for kind, source in CELLS:
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cells.append(make(source))
    cells.insert(0, cells.pop(1))  # the title first, then the parameters
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


def kernel_environment() -> dict[str, str]:
    """This process's environment without ``MPLBACKEND`` (the kernel picks its own default, ``inline``),
    one thread per library, and this checkout first on the path."""
    env = {key: value for key, value in os.environ.items() if key != "MPLBACKEND"}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH")) if p)
    return env


def main() -> Path:
    import nbformat
    from nbclient import NotebookClient

    notebook = build()
    with tempfile.TemporaryDirectory() as folder:
        client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": folder}})
        client.execute(env=kernel_environment())
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(notebook, NOTEBOOK)
    print(f"wrote {NOTEBOOK} ({NOTEBOOK.stat().st_size / 1e3:.0f} kB)")
    return NOTEBOOK


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
