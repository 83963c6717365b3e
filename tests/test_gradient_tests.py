"""NormTest, InnerTest, OrthoTest against float64 brute force (per-sample gradients from torch.func)."""

import warnings

import pytest
import torch
from tests.helpers import make_problem, per_sample_grads, train

from cockpit_like import Cockpit
from cockpit_like.functional import gradient_tests as F
from cockpit_like.quantities import InnerTest, NormTest, OrthoTest
from cockpit_like.utils.schedules import linear, logarithmic


def reference_tests(grads):
    """Definitions (not Cockpit's evaluation order): g_i flattened per sample."""
    g = torch.cat([x.reshape(x.shape[0], -1) for x in grads], dim=1)
    B = g.shape[0]
    mean = g.mean(0)
    sq = mean @ mean
    pi = g @ mean
    norm = ((g - mean) ** 2).sum() / ((B - 1) * B * sq)
    inner = ((pi - sq) ** 2).sum() / ((B - 1) * B * sq**2)
    ortho = ((g - (pi / sq)[:, None] * mean) ** 2).sum() / ((B - 1) * B * sq)
    return {"NormTest": norm.sqrt().item(), "InnerTest": inner.sqrt().item(), "OrthoTest": ortho.sqrt().item()}


def run(problem, bias, batch_size, optimizer, schedule, steps=4, extra=()):
    model, lossfunc, individual = make_problem(problem, bias=bias)
    quantities = [NormTest(schedule), InnerTest(schedule), OrthoTest(schedule), *extra]
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    refs = {}

    def record(step, model, inputs, labels):
        refs[step] = reference_tests(per_sample_grads(model, inputs, labels))

    opt = (
        torch.optim.SGD(model.parameters(), lr=0.2)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook")
        train(model, lossfunc, individual, cockpit, problem, steps, batch_size, opt, record)
    return cockpit, refs


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch_size,optimizer", [(3, "sgd"), (8, "adam"), (5, "sgd")])
def test_matches_brute_force(problem, bias, batch_size, optimizer):
    cockpit, refs = run(problem, bias, batch_size, optimizer, linear(1))
    out = cockpit.get_output()
    assert sorted(out) == [0, 1, 2, 3]
    for step, values in out.items():
        for name in ("NormTest", "InnerTest", "OrthoTest"):
            assert isinstance(values[name], float)
            assert values[name] == pytest.approx(refs[step][name], rel=1e-10)


@pytest.mark.parametrize("schedule,steps", [(linear(2, offset=1), [1, 3]), (logarithmic(0, 1, 3), [0, 1, 3])])
def test_schedules(schedule, steps):
    cockpit, refs = run("mlp", True, 6, "sgd", schedule, steps=5)
    out = cockpit.get_output()
    assert sorted(out) == steps
    for step in steps:
        assert out[step]["NormTest"] == pytest.approx(refs[step]["NormTest"], rel=1e-10)


def test_gram_statistic_shared_once():
    schedule = linear(1)
    needs = [q.per_sample_stats(0) for q in (NormTest(schedule), InnerTest(schedule), OrthoTest(schedule))]
    assert needs[0] == needs[1] == needs[2] and len(needs[0]) == 1
    assert len({s for n in needs for s in n}) == 1


def test_functional_scaling_invariance():
    """The tests are invariant to scaling all gradients (scaled loss)."""
    torch.manual_seed(0)
    gb = torch.randn(6, 20, dtype=torch.float64) / 6
    gram, sq = gb @ gb.T, gb.sum(0) @ gb.sum(0)
    for fn in (F.norm_test, F.inner_test, F.ortho_test):
        assert fn(*F.gram_summary(9 * gram), 9 * sq).item() == pytest.approx(fn(*F.gram_summary(gram), sq).item(), rel=1e-12)
    # permuting the batch changes nothing
    perm = torch.randperm(6)
    gbp = gb[perm]
    for fn in (F.norm_test, F.inner_test, F.ortho_test):
        assert fn(*F.gram_summary(gbp @ gbp.T), sq).item() == pytest.approx(fn(*F.gram_summary(gram), sq).item(), rel=1e-12)


def test_inner_test_of_nearly_equal_gradients_in_float64_keeps_its_digits():
    """Per-sample gradients that nearly agree (a spread of 1e-3 around a common gradient): InnerTest's variance
    as Cockpit evaluates it (sum pi_i^2 - B ||gbar||^4) lost 4 digits (9e-5 relative off an autograd loop, outside
    trial 8); in float64 it is the centred sum, within 1e-9 of the definition. Float32 keeps Cockpit's order."""
    torch.manual_seed(0)
    common = torch.randn(40, dtype=torch.float64)
    g = common + 1e-3 * torch.randn(6, 40, dtype=torch.float64)
    gb = g / 6
    gram, sq = gb @ gb.T, g.mean(0) @ g.mean(0)
    expected = reference_tests([g])["InnerTest"]
    assert F.inner_test(*F.gram_summary(gram), sq).item() == pytest.approx(expected, rel=1e-9)
    # Cockpit's order in float64 is what lost the digits (so the test above can fail)
    projections = 6 * gram.sum(1)
    cockpits = (((projections**2).sum() - 6 * sq**2) / 5 / 6 / sq**2).sqrt().item()
    assert abs(cockpits - expected) > 1e-9 * expected
    # float32 keeps Cockpit's evaluation order (its numbers)
    g32, sq32 = gram.float(), sq.float()
    p32 = 6 * g32.sum(1)
    assert F.inner_test(*F.gram_summary(g32), sq32).item() == (((p32**2).sum() - 6 * sq32**2) / 5 / 6 / sq32**2).sqrt().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_that_cancel_store_no_test_and_say_why(dtype):
    """A symmetric batch (rows ``x`` and ``-x`` with the same labels, the weights at 0): the per-sample gradients
    cancel, ``||gbar||`` is rounding noise, and the tests' quotient was stored as 3.5e7 (float32). Now no value,
    one note for the three; a batch whose rows almost cancel, far above rounding, keeps its values (checked
    against the brute-force definitions)."""
    from torch import nn
    from torch.nn import functional as Fn

    model = nn.Sequential(nn.Linear(3, 2, bias=False)).to(dtype)
    with torch.no_grad():
        model[0].weight.zero_()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1)), InnerTest(linear(1)), OrthoTest(linear(1))])
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0), dtype=dtype)
    labels = torch.tensor([0, 1, 0, 1] * 2)
    for step, inputs in enumerate([torch.cat([x, -x]), torch.cat([x, -x + 1e-2 * x.flip(0)])]):
        model.zero_grad()
        losses = Fn.cross_entropy(model(inputs), labels, reduction="none")
        with cockpit(step, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        if step == 1:
            grads = [torch.stack([torch.autograd.grad(Fn.cross_entropy(model(inputs[i:i + 1]), labels[i:i + 1]),
                                                      model[0].weight)[0] for i in range(8)]).double()]
    out = cockpit.get_output()
    assert not {"NormTest", "InnerTest", "OrthoTest"} & set(out[0])
    notes = cockpit.checks[0]["notes"]
    assert len(notes) == 1 and "within rounding of 0" in notes[0] and "NormTest, InnerTest and OrthoTest" in notes[0]
    reference = reference_tests(grads)
    for name, value in reference.items():
        assert out[1][name] == pytest.approx(value, rel=1e-3 if dtype == torch.float32 else 1e-9)


def test_cancels_to_rounding_against_the_rows_scale():
    diag = torch.full((4,), 1.0, dtype=torch.float64) / 16  # ||g_i|| = 1, B = 4
    eps = torch.finfo(torch.float64).eps
    assert F.cancels_to_rounding(diag, torch.tensor((500 * eps) ** 2, dtype=torch.float64))
    assert not F.cancels_to_rounding(diag, torch.tensor((2000 * eps) ** 2, dtype=torch.float64))
