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
