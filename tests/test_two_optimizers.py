"""Two optimizers stepped in one iteration (a Muon-style split: one for the matrices, AdamW for the rest).

``info["optimizer"]`` takes one optimizer: a list or tuple is refused with an error that says what to do.
Declaring the one that steps last, the parameters the other one moved before its step are not taken for
SAM's perturbation: UpdateSize and Distance describe the whole iteration's update (brute force from the run's
own snapshots), and Alpha, which predicts the update from the declared optimizer alone, is withdrawn with a
note that names the cause. The run is bitwise the run without the cockpit.
"""

import warnings

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.quantities import Alpha, Distance, UpdateSize
from tests.helpers import make_batch, make_problem

BATCH, STEPS = 6, 4


def optimizers(model):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return torch.optim.SGD(matrices, lr=0.1, momentum=0.9), torch.optim.AdamW(rest, lr=0.01)


def run(with_cockpit: bool, declare: str = "last"):
    model, lossfunc, individual = make_problem("mlp")
    first, last = optimizers(model)
    declared = last if declare == "last" else first
    quantities = [Alpha(lambda t: True), UpdateSize(lambda t: True), Distance(lambda t: True)]
    cockpit = Cockpit(model.parameters(), quantities) if with_cockpit else None
    snapshots = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        for step in range(STEPS):
            inputs, labels = make_batch("mlp", BATCH, seed=100 + step)
            first.zero_grad()
            last.zero_grad()
            out = model(inputs)
            loss, losses = lossfunc(out, labels), individual(out, labels)
            snapshots.append([p.detach().clone() for p in model.parameters()])
            if cockpit is None:
                loss.backward()
            else:
                with cockpit(step, info={"batch_size": BATCH, "individual_losses": losses, "loss": loss,
                                         "optimizer": declared}):  # fmt: skip
                    loss.backward()
            first.step()
            last.step()
    snapshots.append([p.detach().clone() for p in model.parameters()])
    return model, cockpit, snapshots


def norms(a, b):
    return [(y - x).norm().item() for x, y in zip(a, b)]


def test_declaring_the_last_optimizer_keeps_the_motion_and_withdraws_alpha_naming_the_cause():
    plain, (model, cockpit, snapshots) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0].parameters(), model.parameters()))
    output = cockpit.get_output()
    matrices = ", ".join(name for name, p in model.named_parameters() if p.ndim == 2)  # what the other one moved
    for t in range(STEPS - 1):
        assert output[t]["UpdateSize"] == pytest.approx(norms(snapshots[t], snapshots[t + 1]), rel=1e-12, abs=1e-15)
    for t in range(STEPS):
        assert output[t]["Distance"] == pytest.approx(norms(snapshots[0], snapshots[t]), rel=1e-12, abs=1e-15)
        assert "Alpha" not in output[t]
        (note,) = cockpit.checks[t]["notes"]
        assert "info['optimizer'] (AdamW) does not hold them: another optimizer stepped them" in note
        assert f"the parameters ({matrices}) changed" in note and "withdrawn at this step: Alpha" in note and "SAM" not in note


def test_declaring_the_first_optimizer_stores_no_alpha_and_names_the_cause():
    """The first optimizer steps before the other moved anything: the end step sees parameters it does not hold
    moved (not "the gradients changed before the optimizer's step"), and Alpha does not start waiting for it."""
    plain, (model, cockpit, snapshots) = run(False), run(True, declare="first")
    assert all(torch.equal(a, b) for a, b in zip(plain[0].parameters(), model.parameters()))
    output = cockpit.get_output()
    unheld = [i for i, p in enumerate(model.parameters()) if p.ndim != 2]
    for t in range(STEPS - 1):
        assert output[t]["UpdateSize"] == pytest.approx(norms(snapshots[t], snapshots[t + 1]), rel=1e-12, abs=1e-15)
        assert "Alpha" not in output[t]
        (note,) = cockpit.checks[t + 1]["notes"]
        assert f"Alpha of step {t} is not stored: {len(unheld)} of the tracked parameters (indices {unheld})" in note
        assert "info['optimizer'] (SGD) does not hold them" in note and "declare the one that steps last" in note
    assert not cockpit.quantities[0]._waits


@pytest.mark.parametrize("container", [list, tuple])
def test_a_list_of_optimizers_is_refused_with_what_to_do(container):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), [UpdateSize(lambda t: True)])
    inputs, labels = make_batch("mlp", BATCH, seed=0)
    out = model(inputs)
    info = {"batch_size": BATCH, "individual_losses": individual(out, labels), "loss": lossfunc(out, labels),
            "optimizer": container(optimizers(model))}  # fmt: skip
    with pytest.raises(ValueError, match=r"takes one optimizer, got a (list|tuple) \(SGD, AdamW\).*steps last"):
        cockpit(0, info=info)
    with pytest.raises(ValueError, match="takes one optimizer"):
        cockpit.begin(0, info=info)
