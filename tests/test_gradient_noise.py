"""MeanGSNR, CABS, EarlyStopping against float64 brute force, and their optimizer checks."""

import warnings

import pytest
import torch

from cockpit_like import Cockpit
from cockpit_like.context import MissingInfoError
from cockpit_like.quantities import CABS, EarlyStopping, MeanGSNR
from cockpit_like.utils.schedules import linear
from tests.helpers import make_batch, make_problem, per_sample_grads, train

EPS = 1e-5


def reference(grads, loss, lr):
    g = torch.cat([x.reshape(x.shape[0], -1) for x in grads], dim=1)
    B = g.shape[0]
    mean = g.mean(0)
    biased = ((g - mean) ** 2).mean(0)
    unbiased = ((g - mean) ** 2).sum(0) / (B - 1)
    return {
        "MeanGSNR": (mean**2 / (biased + EPS)).mean().item(),
        "CABS": (lr * ((g - mean) ** 2).sum() / (B * loss)).item(),
        "EarlyStopping": 1 - B * (mean**2 / (unbiased + EPS)).mean().item(),
    }


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message="Full backward hook")
    return ctx


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("bias,batch_size", [(True, 4), (False, 7)])
def test_matches_brute_force(problem, bias, batch_size):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    lr = 0.3
    quantities = [MeanGSNR(linear(1)), CABS(linear(1)), EarlyStopping(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    refs = {}

    def record(step, model, inputs, labels):
        grads = per_sample_grads(model, inputs, labels)
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        refs[step] = reference(grads, loss, lr)

    ctx = _quiet()
    train(model, lossfunc, individual, cockpit, problem, 3, batch_size, torch.optim.SGD(model.parameters(), lr=lr), record)
    ctx.__exit__(None, None, None)
    out = cockpit.get_output()
    assert sorted(out) == [0, 1, 2]
    for step, values in out.items():
        for name in ("MeanGSNR", "CABS", "EarlyStopping"):
            assert isinstance(values[name], float)
            assert values[name] == pytest.approx(refs[step][name], rel=1e-9), name


def test_mean_gsnr_with_adam_and_epsilon():
    model, lossfunc, individual = make_problem("mlp")
    q = MeanGSNR(linear(2), epsilon=0.5)
    refs = {}

    def record(step, model, inputs, labels):
        g = torch.cat([x.reshape(x.shape[0], -1) for x in per_sample_grads(model, inputs, labels)], 1)
        mean = g.mean(0)
        refs[step] = (mean**2 / (((g - mean) ** 2).mean(0) + 0.5)).mean().item()

    ctx = _quiet()
    train(model, lossfunc, individual, Cockpit(model.parameters(), [q]), "mlp", 3, 5, torch.optim.Adam(model.parameters()), record)
    ctx.__exit__(None, None, None)
    assert sorted(q.get_output()) == [0, 2]
    for step, value in q.get_output().items():
        assert value == pytest.approx(refs[step], rel=1e-9)
    assert q.settings() == {"epsilon": 0.5}


def _one_step(quantity, optimizer_factory, info_drop=()):
    model, lossfunc, individual = make_problem("mlp")
    optimizer = optimizer_factory(model)
    cockpit = Cockpit(model.parameters(), [quantity])
    inputs, labels = make_batch("mlp", 4, 0)
    out = model(inputs)
    loss = lossfunc(out, labels)
    info = {"batch_size": 4, "loss": loss, "individual_losses": individual(out, labels), "optimizer": optimizer}
    for key in info_drop:
        del info[key]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        with cockpit(0, info=info):
            loss.backward()
    return quantity


@pytest.mark.parametrize("cls", [CABS, EarlyStopping])
@pytest.mark.parametrize(
    "factory,message",
    [
        (lambda m: torch.optim.Adam(m.parameters()), "only defined for plain SGD"),
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), "momentum=0.9"),
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01), "weight_decay=0.01"),
        (
            lambda m: torch.optim.SGD([{"params": list(m.parameters())[:2], "lr": 0.2}, {"params": list(m.parameters())[2:]}], lr=0.1),
            "non-unique learning rates",
        ),
    ],
)
def test_non_plain_sgd_raises(cls, factory, message):
    with pytest.raises(ValueError, match=message):
        _one_step(cls(linear(1)), factory)


@pytest.mark.parametrize("cls", [CABS, EarlyStopping])
def test_plain_sgd_variants_accepted(cls):
    # maximize and dampening (without momentum) do not change plain SGD's statistics
    q = _one_step(cls(linear(1)), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, dampening=0.5, maximize=True))
    assert isinstance(q.get_output()[0], float)


@pytest.mark.parametrize(
    "cls,key", [(CABS, "optimizer"), (CABS, "batch_size"), (EarlyStopping, "optimizer"), (MeanGSNR, "batch_size")]
)
def test_missing_info_fails_before_backward(cls, key):
    model, lossfunc, individual = make_problem("mlp")
    cockpit = Cockpit(model.parameters(), [cls(linear(1))])
    inputs, labels = make_batch("mlp", 4, 0)
    loss = lossfunc(model(inputs), labels)
    info = {"batch_size": 4, "loss": loss, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    del info[key]
    with pytest.raises(MissingInfoError, match=rf"{cls.__name__} needs info\['{key}'\]"):
        with cockpit(0, info=info):
            raise AssertionError("the body must not run")
