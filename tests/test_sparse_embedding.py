"""``nn.Embedding(sparse=True)``: its gradient is a sparse tensor. The per-sample rows are the dense rule's and
the quantities read the gradient dense, so every number equals the same model's with ``sparse=False``; the
user's sparse ``p.grad`` is left as it was (float64)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration


class _Bag(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.emb = nn.Embedding(11, 4, sparse=sparse, padding_idx=0)
        self.lin = nn.Linear(4, 3)

    def forward(self, ids):
        return self.lin(torch.tanh(self.emb(ids)).mean(1))


def _run(sparse: bool, preset: str | None, steps: int = 3):
    torch.manual_seed(0)
    model = _Bag(sparse).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)  # plain SGD takes sparse gradients
    quantities = [] if preset is None else configuration(preset)
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    generator = torch.Generator().manual_seed(1)
    layouts = []
    for step in range(steps):
        ids = torch.randint(0, 11, (6, 5), generator=generator)
        y = torch.randint(0, 3, (6,), generator=generator)
        optimizer.zero_grad()
        out = model(ids)
        losses = F.cross_entropy(out, y, reduction="none")
        loss = losses.mean()
        if preset is None:  # no cockpit
            loss.backward()
        else:
            with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": loss, "optimizer": optimizer}):
                loss.backward(create_graph=cockpit.create_graph(step))
        layouts.append(model.emb.weight.grad.layout)
        optimizer.step()
    return cockpit, model, layouts


def _close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):  # numpy arrays (histograms)
        return a.shape == b.shape and abs(a - b).max() <= 1e-9 * max(1.0, abs(b).max())
    if isinstance(a, float):
        return a == pytest.approx(b, rel=1e-9, abs=1e-12)
    return a == b


@pytest.mark.parametrize("preset", ["economy", "business", "full"])
def test_a_sparse_embedding_gives_the_dense_embeddings_numbers(preset):
    sparse, sparse_model, layouts = _run(True, preset)
    dense, dense_model, _ = _run(False, preset)
    assert layouts == [torch.sparse_coo] * 3  # the user's gradient stays sparse
    for step in range(3):
        assert sparse.checks[step]["valid"], sparse.checks[step]
    got, expected = sparse.get_output(), dense.get_output()
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step].keys() == expected[step].keys(), step
        for name in expected[step]:
            if name in ("Time", "checks"):
                continue
            assert _close(got[step][name], expected[step][name]), (step, name)
    _, alone, _ = _run(True, None)  # the run is the user's: the same parameters as without the cockpit
    for a, b in zip(sparse_model.parameters(), alone.parameters()):
        assert torch.equal(a, b)
