"""A layer called twice in a step (a block applied twice): its calls' rows are positions of the same samples
("expand" over calls, docs/curvature_statistics.md): ``A = (1/(B T)) sum x x^T`` over both calls' inputs and
``G = (1/B) sum (B delta)(B delta)^T`` over both calls' output gradients, the backward count ``B`` (it was
``2 B``, halving G and doubling the KFAC block's inverse). Float64, against hooks written here."""

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import CurvatureStatistics
from cockpit_like.utils.schedules import linear


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_layer_called_twice_counts_its_samples_once(micro_batches):
    torch.manual_seed(0)
    model = _Twice().double()
    batch = 6
    x = torch.randn(batch, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (batch,))
    inputs, grads = [], []

    def hook(module, args, output):
        inputs.append(args[0].detach())
        output.register_hook(lambda g: grads.append(g.detach()))

    handle = model.a.register_forward_hook(hook)
    quantity = CurvatureStatistics(linear(1))
    cockpit = Cockpit(list(model.parameters()), quantities=[quantity], model=model)
    for part in torch.arange(batch).chunk(micro_batches):
        loss = nn.functional.cross_entropy(model(x[part]), y[part])
        info = {"batch_size": len(part), "loss": loss}
        if micro_batches > 1:
            info["micro_batches"] = micro_batches
        with cockpit(0, info=info):
            (loss / micro_batches).backward()
    handle.remove()
    # the rows' gradients of the mean loss of the whole batch: each pass's output gradient is of its part's mean,
    # divided by the micro-batches
    rows = len(x) // micro_batches
    X = torch.cat(inputs)
    D = torch.cat(grads) * rows * micro_batches
    A, G = X.T @ X / len(X), D.T @ D / batch
    logged = quantity.statistics()["layers"]["a"]
    assert quantity.get_output()[0]["layers"]["a"] == {"forward": 2 * batch, "backward": batch}
    torch.testing.assert_close(logged["forward"]["covariance"], A, rtol=1e-12, atol=0)
    torch.testing.assert_close(logged["backward"]["covariance"], G, rtol=1e-12, atol=0)
