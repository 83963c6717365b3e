"""The any-model path on a GPU (skipped without CUDA; CI has none, run on a GPU machine).

Every zoo model in float64 on CUDA: the per-sample statistics against a loop
of ``torch.autograd.grad``, and the ``full`` preset (Hessian-vector products
through attention and recurrent layers, whose fused kernels have no second
derivative on a GPU) for three steps.
"""

import warnings

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.backends.per_sample_stats import GramSummary, SumOfSquares
from cockpit_like.context import get_record
from cockpit_like.quantities.quantity import SingleStepQuantity
from cockpit_like.utils.configuration import configuration
from tests.zoo import ZOO, per_sample_grads_loop

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore"),
]


class _Probe(SingleStepQuantity):
    def per_sample_stats(self, step):
        return [GramSummary(), SumOfSquares()]

    def _compute(self, step, params, loss):
        record = get_record(step)
        return {"diag": record.stat(GramSummary())[0].clone(), "squares": [s.clone() for s in record.stat(SumOfSquares())]}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_on_cuda(name):
    device = torch.device("cuda")
    problem = ZOO[name](0)
    model = problem.model.to(device)
    params = list(model.parameters())

    def batch(seed):
        return [t.to(device) for t in problem.batch(5, seed)]

    probe = _Probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe] + configuration("full"), model=model)
    optimizer = torch.optim.SGD(params, lr=0.01)
    first = batch(1)
    reference = per_sample_grads_loop(problem, *first, params)
    for step in range(3):
        inputs, targets = first if step == 0 else batch(step + 1)
        optimizer.zero_grad()
        losses = problem.sample_losses(problem.forward(model, inputs), targets)
        loss = losses.mean()
        info = {"batch_size": 5, "loss": loss, "individual_losses": losses.detach(), "optimizer": optimizer}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    flat = torch.cat([g.reshape(5, -1) for g in reference], 1) / 5
    got = probe.output[0]
    torch.testing.assert_close(torch.as_tensor(got["diag"]).to(device), (flat * flat).sum(1), rtol=1e-10, atol=1e-14)
    for squares, g in zip(got["squares"], reference):
        torch.testing.assert_close(torch.as_tensor(squares).to(device), (g / 5).pow(2).sum(0), rtol=1e-10, atol=1e-14)
    output = cockpit.get_output()
    for key in ("HessMaxEV", "HessTrace", "TICDiag", "GradHist2d", "Alpha", "NormTest"):
        assert key in output[1]


def _dropout_run(preset, device, steps=3):
    """Parameters after ``steps`` steps of an MLP with dropout on random data, and the next CPU and CUDA draws."""
    from backpack import extend
    from torch import nn

    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model = extend(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3)).to(device))
    lossfunc = extend(nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = None if preset is None else Cockpit(model.parameters(), quantities=configuration(preset))
    for step in range(steps):
        inputs, labels = torch.rand(5, 6, device=device), torch.randint(0, 3, (5,), device=device)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        if cockpit is None:
            loss.backward()
        else:
            info = {"loss": loss, "batch_size": 5, "optimizer": optimizer,
                    "individual_losses": torch.nn.functional.cross_entropy(outputs, labels, reduction="none")}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with cockpit(step, info=info):
                    loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], torch.rand(3), torch.rand(3, device=device)


@pytest.mark.parametrize("preset", ["economy", "business", "full"])
def test_the_cockpit_leaves_cpu_and_cuda_rng_alone(preset):
    """Issue 37: dropout masks and random data on the GPU are the same with and without the cockpit."""
    device = torch.device("cuda")
    reference, again = _dropout_run(None, device), _dropout_run(None, device)
    if not all(torch.equal(a, b) for a, b in zip(reference[0], again[0])):
        pytest.skip("plain training is not bitwise reproducible on this GPU (nondeterministic kernels)")
    tracked = _dropout_run(preset, device)
    for expected, actual in zip(reference[0], tracked[0]):
        assert torch.equal(expected, actual), (expected - actual).abs().max()
    assert torch.equal(reference[1], tracked[1]) and torch.equal(reference[2], tracked[2])
