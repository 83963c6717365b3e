"""A resumed cockpit whose output comes back from its stream: the histograms are the arrays they were in memory
(the stream writes them as lists), so ``get_output()`` is the uninterrupted run's, types and dtypes included."""

import io

import numpy as np
import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like import quantities as Q


def _quantities():
    every = lambda step: True  # noqa: E731
    return [Q.GradNorm(every), Q.GradHist1d(every), Q.GradHist2d(every, keep_individual=True)]


def _step(cockpit, model, optimizer, step, generator):
    x = torch.randn(8, 6, generator=generator, dtype=model[0].weight.dtype)
    y = torch.randint(0, 3, (8,), generator=generator)
    optimizer.zero_grad()
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    optimizer.step()


def _same(a, b, where):
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resumed_histograms_are_the_arrays_of_the_uninterrupted_run(tmp_path, dtype):
    def model_and_optimizer():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, optimizer = model_and_optimizer()
    whole = Cockpit(model.parameters(), quantities=_quantities(), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        _step(whole, model, optimizer, step, generator)

    model, optimizer = model_and_optimizer()
    first = Cockpit(model.parameters(), quantities=_quantities(), model=model, stream_to=tmp_path / "run")
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        _step(first, model, optimizer, step, generator)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)  # the output stays in the stream
    resumed = Cockpit(model.parameters(), quantities=_quantities(), model=model, stream_to=tmp_path / "run")
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    for step in range(2, 4):
        _step(resumed, model, optimizer, step, generator)

    expected, got = whole.get_output(), resumed.get_output()
    assert sorted(got) == sorted(expected) == [0, 1, 2, 3]
    for step in expected:
        for name in ("GradHist1d", "GradHist2d", "GradNorm"):
            _same(got[step][name], expected[step][name], f"{step}/{name}")
