"""A training run that is checkpointed, killed and resumed (run by ``tests/test_resume.py``).

``python -m tests.resume_run PHASE FOLDER`` trains the float64 MLP of
``tests.helpers`` with SGD + momentum for ``STEPS`` steps, once per preset
(economy, business, full; histograms with bin adaptation), streaming to
``FOLDER/<preset>.jsonl``:

- ``reference``: the uninterrupted run (streams to ``<preset>-reference.jsonl``
  and writes ``<preset>-reference.json``);
- ``interrupted``: saves the user's checkpoint (model, optimizer, cockpit,
  torch RNG) after step ``CHECKPOINT`` to ``<preset>.pt``, streams ``AFTER``
  more steps, leaves half a line in the stream and kills itself (SIGKILL:
  no clean-up of any kind);
- ``resumed``: a new process builds everything anew (other initial weights),
  loads the checkpoint with ``weights_only=True``, trains the remaining steps
  and writes ``<preset>-resumed.json``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from cockpit_like import Cockpit
from cockpit_like.quantities import GradHist1d, GradHist2d
from cockpit_like.quantities.bin_adaptation import GradAbsMax, ParamAbsMax
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.helpers import make_batch, make_problem

PRESETS = ("economy", "business", "full")
STEPS, CHECKPOINT, AFTER = 6, 2, 2
BATCH = 8


def make_quantities(preset: str) -> list:
    """The preset, with its histograms adapting their ranges every other step."""
    made = configuration(preset, track_schedule=linear(1))
    for index, quantity in enumerate(made):
        if type(quantity) is GradHist1d:
            made[index] = GradHist1d(linear(1), adapt=GradAbsMax(linear(2), padding=0.1))
        elif type(quantity) is GradHist2d:
            made[index] = GradHist2d(linear(1), adapt=(GradAbsMax(linear(2)), ParamAbsMax(linear(2, 1), padding=0.2)))
    return made


def setup(preset: str, stream: Path, seed: int = 0):
    model, lossfunc, individual = make_problem("mlp", seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    cockpit = Cockpit(model.parameters(), quantities=make_quantities(preset), stream_to=stream)
    return model, lossfunc, individual, optimizer, cockpit


def step(model, lossfunc, individual, optimizer, cockpit, global_step: int) -> None:
    inputs, labels = make_batch("mlp", BATCH, seed=1000 + global_step)
    optimizer.zero_grad()
    outputs = model(inputs)
    loss = lossfunc(outputs, labels)
    info = {"batch_size": BATCH, "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
    with cockpit(global_step, info=info):
        loss.backward(create_graph=cockpit.create_graph(global_step))
    optimizer.step()


def reference(folder: Path, preset: str) -> None:
    torch.manual_seed(0)
    run = setup(preset, folder / f"{preset}-reference")
    for global_step in range(STEPS):
        step(*run, global_step)
    run[-1].write(folder / f"{preset}-reference")


def interrupted(folder: Path, preset: str) -> Cockpit:
    torch.manual_seed(0)
    model, lossfunc, individual, optimizer, cockpit = run = setup(preset, folder / preset)
    for global_step in range(CHECKPOINT + AFTER + 1):
        step(*run, global_step)
        if global_step == CHECKPOINT:
            checkpoint = {
                "step": global_step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "cockpit": cockpit.state_dict(),
                "rng": torch.get_rng_state(),
            }
            torch.save(checkpoint, folder / f"{preset}.pt")
    return cockpit


def resumed(folder: Path, preset: str) -> None:
    model, lossfunc, individual, optimizer, cockpit = run = setup(preset, folder / preset, seed=1)
    checkpoint = torch.load(folder / f"{preset}.pt", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    cockpit.load_state_dict(checkpoint["cockpit"])
    torch.set_rng_state(checkpoint["rng"])
    for global_step in range(checkpoint["step"] + 1, STEPS):
        step(*run, global_step)
    cockpit.write(folder / f"{preset}-resumed")


def main(phase: str, folder: Path) -> None:
    if phase == "interrupted":
        cockpits = [interrupted(folder, preset) for preset in PRESETS]
        torn = cockpits[-1]._output.stream._handle  # killed while writing a line
        torn.write(b'{"step": 5, "values": {"Loss": 0.12')
        torn.flush()
        print("killing myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    for preset in PRESETS:
        {"reference": reference, "resumed": resumed}[phase](folder, preset)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
