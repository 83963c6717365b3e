"""A step with one sample: the quantities that estimate a variance over the samples (divisor ``B - 1``) store no
value and say why, instead of Cockpit's inf / NaN; the rest of the step is stored (float64)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like import quantities as Q

VARIANCE = ("NormTest", "InnerTest", "OrthoTest", "MeanGSNR", "CABS", "EarlyStopping")


def _run(batches, micro_batches=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    every = lambda step: True  # noqa: E731
    classes = (Q.NormTest, Q.InnerTest, Q.OrthoTest, Q.MeanGSNR, Q.CABS, Q.EarlyStopping, Q.Alpha, Q.GradNorm)
    cockpit = Cockpit(model.parameters(), quantities=[cls(track_schedule=every) for cls in classes], model=model)
    generator = torch.Generator().manual_seed(1)
    grads = []
    for step, size in enumerate(batches):
        x = torch.randn(size, 4, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (size,), generator=generator)
        optimizer.zero_grad()
        for part in torch.arange(size).chunk(micro_batches):
            out = model(x[part])
            losses = F.cross_entropy(out, y[part], reduction="none")
            info = {"batch_size": len(part), "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
            if micro_batches > 1:
                info["micro_batches"] = micro_batches
            with cockpit(step, info=info):
                (losses.mean() / micro_batches).backward()
        grads.append([p.grad.norm().item() for p in model.parameters()])
        optimizer.step()
    return cockpit, grads


def test_a_step_with_one_sample_stores_no_variance_quantities():
    cockpit, grads = _run([4, 1, 4, 4])
    output = cockpit.get_output()
    assert cockpit.checks[1]["valid"]
    for name in VARIANCE:
        assert name not in output[1]
        assert math.isfinite(output[0][name]) and math.isfinite(output[2][name])
    note = [n for n in cockpit.checks[1]["notes"] if "1 sample(s)" in n]
    assert note and all(name in note[0] for name in VARIANCE + ("Alpha",))
    # Alpha needs both ends' variances: none for the step that ends at the one-sample step, nor for it
    assert "Alpha" not in output[0] and "Alpha" not in output[1]
    assert math.isfinite(output[2]["Alpha"])
    # the rest of the step is stored, and right
    assert output[1]["GradNorm"] == pytest.approx(grads[1], rel=1e-12)


def test_micro_batches_of_one_sample_make_a_step_of_two():
    cockpit, _ = _run([2, 2, 2], micro_batches=2)
    output = cockpit.get_output()
    for step in range(3):
        assert cockpit.checks[step]["valid"]
        for name in VARIANCE:
            assert math.isfinite(output[step][name]), (step, name)
