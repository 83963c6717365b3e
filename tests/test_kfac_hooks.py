"""KFACTrace(curvature="empirical") on any model, against factors built from retained autograd gradients."""

import math

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import KFACTrace
from cockpit_like.utils.schedules import linear
from tests.helpers import make_batch, make_problem
from tests.zoo import ZOO, per_sample_grads_loop

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")


def _reference(problem, inputs, targets, batch):
    """Per nn.Linear weight: B * sum delta delta^T ⊗ (1/M) sum x x^T; per other parameter the exact block."""
    model = problem.model
    seen = {}

    def keep(module, args, output):
        output.retain_grad()
        seen.setdefault(module, []).append((args[0].detach(), output))

    handles = [m.register_forward_hook(keep) for m in model.modules() if type(m) is nn.Linear]
    loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
    loss.backward()
    for handle in handles:
        handle.remove()
    params = list(model.parameters())
    grads = per_sample_grads_loop(problem, inputs, targets, params)
    blocks = {}
    for module, uses in seen.items():
        (x, output), = uses
        x2, d2 = x.reshape(-1, x.shape[-1]), output.grad.reshape(-1, output.shape[-1])
        blocks[id(module.weight)] = [batch * d2.T @ d2, x2.T @ x2 / x2.shape[0]]
    # nn.MultiheadAttention's projections come as sequence factors from its rule (tested exactly in
    # test_attention_rule.py), so their blocks are Kronecker approximations: not compared here
    attention = {id(p) for m in model.modules() if isinstance(m, nn.MultiheadAttention) for n, p in m.named_parameters() if "weight" in n}
    result = []
    for p, g in zip(params, grads):
        if id(p) in attention:
            result.append("skip")
        elif id(p) in blocks:
            result.append(blocks[id(p)])
        elif p.numel() <= 4096:
            flat = g.reshape(batch, -1)
            result.append([flat.T @ flat / batch])  # (1/B) sum_i g_i g_i^T
        else:
            result.append(None)
    return result


@pytest.mark.parametrize("name", ["layernorm_mlp", "encoder", "custom", "resnet_groupnorm"])
def test_empirical_kfac_matches_retained_gradients(name):
    problem = ZOO[name](0)
    model = problem.model
    batch = 5
    inputs, targets = problem.batch(batch, 2)
    reference = _reference(problem, inputs, targets, batch)
    model.zero_grad()
    quantity = KFACTrace(linear(1), curvature="empirical", damping=1e-3)
    cockpit = Cockpit(model.parameters(), quantities=[quantity], model=model)
    loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
    with cockpit(0, info={"batch_size": batch, "loss": loss}):
        loss.backward()
    value = cockpit.get_output()[0]["KFACTrace"]
    for k, factors in enumerate(reference):
        if factors == "skip":
            assert value["trace"][k] is not None and value["trace"][k] > 0
            continue
        if factors is None:
            assert value["trace"][k] is None
            continue
        assert value["trace"][k] == pytest.approx(math.prod(float(f.trace()) for f in factors), rel=1e-9, abs=1e-14)
        frob = math.prod(float(torch.linalg.matrix_norm(f)) for f in factors)
        assert value["frobenius"][k] == pytest.approx(frob, rel=1e-9, abs=1e-14)
        dense = factors[0] if len(factors) == 1 else torch.kron(factors[0], factors[1])
        eig = torch.linalg.eigvalsh(dense).clamp(min=0)
        assert value["logdet"][k] == pytest.approx(float(torch.log(eig + 1e-3).sum()), rel=1e-8, abs=1e-9)
    known = [t for t in value["trace"] if t is not None]  # noqa: the attention blocks count too
    assert value["trace_total"] == pytest.approx(math.fsum(known))


def test_empirical_kfac_is_the_empirical_fisher_on_a_single_linear_layer():
    """One linear layer, one position per sample: G ⊗ A has the exact empirical Fisher's trace."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).double()
    inputs = torch.randn(6, 3, dtype=torch.float64)
    targets = torch.randint(0, 2, (6,))
    quantity = KFACTrace(linear(1), curvature="empirical")
    cockpit = Cockpit(layer.parameters(), quantities=[quantity], model=layer)
    loss = nn.functional.cross_entropy(layer(inputs), targets)
    with cockpit(0, info={"batch_size": 6, "loss": loss}):
        loss.backward()
    rows = []
    for i in range(6):
        g = torch.autograd.grad(nn.functional.cross_entropy(layer(inputs[i : i + 1]), targets[i : i + 1]), layer.weight)[0]
        rows.append(g.reshape(-1))
    # tr(G ⊗ A) = (B sum ||delta_i||^2) (1/B sum ||x_i||^2); with g_i = B delta_i x_i^T that is
    # (1/B^2) sum_i ||g_i||^2 / ||x_i||^2 * sum_i ||x_i||^2
    x2 = (inputs**2).sum(1)
    expected = float(sum(r.square().sum() / x for r, x in zip(rows, x2)) * x2.sum() / 36)
    assert cockpit.get_output()[0]["KFACTrace"]["trace"][0] == pytest.approx(expected, rel=1e-10)


def test_empirical_kfac_on_extended_models_uses_the_backpack_factors():
    """The same statistic from BackPACK's linear fast path (extended MLP) and from the hooks (plain MLP)."""
    results = []
    for extended in (True, False):
        model, lossfunc, _ = make_problem("mlp")
        if not extended:
            from tests.helpers import plain_copy

            model = plain_copy(model)
        cockpit = Cockpit(model.parameters(), quantities=[KFACTrace(linear(1), curvature="empirical")], model=model)
        inputs, labels = make_batch("mlp", 6, 0)
        loss = nn.functional.cross_entropy(model(inputs), labels)
        with cockpit(0, info={"batch_size": 6, "loss": loss}):
            loss.backward()
        results.append(cockpit.get_output()[0]["KFACTrace"])
    assert results[0]["trace"] == pytest.approx(results[1]["trace"], rel=1e-10)
    assert results[0]["frobenius"] == pytest.approx(results[1]["frobenius"], rel=1e-10)


def test_unknown_kfac_curvature_names_empirical():
    with pytest.raises(ValueError, match="empirical"):
        KFACTrace(linear(1), curvature="fisher")
