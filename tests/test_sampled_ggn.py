"""curvature='diag_ggn_mc' on any model: labels sampled from the predictions, a second backward pass."""

import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends import randomness
from cockpit_like.quantities import HessTrace, TICDiag
from cockpit_like.utils.schedules import linear
from tests.zoo import ZOO

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")


def _logits(problem, outputs):
    return outputs.logits[:, :-1] if hasattr(outputs, "logits") else outputs


def _twin(problem, inputs, targets, step):
    """``N sum_i gb_i^2`` with the same draws (the cockpit's generator of the step), per-row gradients by a
    loop of autograd.grad."""
    model = problem.model
    params = list(model.parameters())
    logits = _logits(problem, problem.forward(model, inputs))
    flat = logits.reshape(-1, logits.shape[-1])
    draws = randomness.generator(step, "sampled ggn labels", "cpu", float(flat.detach().sum()))
    labels = torch.multinomial(torch.softmax(flat.detach(), dim=1), 1, generator=draws).squeeze(1).reshape(logits.shape[:-1])
    positions = flat.shape[0]
    squares = [torch.zeros_like(p) for p in params]
    for i in range(len(inputs)):
        row = _logits(problem, problem.forward(model, inputs[i : i + 1]))
        loss = nn.functional.cross_entropy(row.reshape(-1, row.shape[-1]), labels[i].reshape(-1), reduction="sum")
        grads = torch.autograd.grad(loss / positions, params, allow_unused=True)
        for s, g in zip(squares, grads):
            if g is not None:
                s += g**2
    return [positions * s for s in squares]


@pytest.mark.parametrize("name", ["gpt2", "layernorm_mlp", "custom", "gru"])
def test_sampled_ggn_diagonal_matches_the_twin(name):
    problem = ZOO[name](0)
    model = problem.model
    inputs, targets = problem.batch(4, 5)
    quantity = HessTrace(linear(1), curvature="diag_ggn_mc")
    cockpit = Cockpit(model.parameters(), quantities=[quantity], model=model)
    assert quantity.method == "sampled_ggn_mc" and cockpit.create_graph(0)
    assert quantity.settings() == {"curvature": "diag_ggn_mc", "computed_with": "sampled_ggn_mc"}
    expected = _twin(problem, inputs, targets, step=0)
    outputs = problem.forward(model, inputs)
    loss = problem.sample_losses(outputs, targets).mean()
    with cockpit(0, info={"batch_size": 4, "loss": loss, "outputs": _logits(problem, outputs)}):
        loss.backward(create_graph=cockpit.create_graph(0))
    assert cockpit.get_output()[0]["HessTrace"] == pytest.approx([float(e.sum()) for e in expected], rel=1e-9, abs=1e-13)
    assert all(p.grad is not None for p in model.parameters())


def test_the_estimate_is_unbiased_on_a_linear_softmax_model():
    """Averaged over draws, the estimate approaches the exact GGN diagonal (1/N) sum_n diag(H_n) x_n^2."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 4, bias=False).double()
    inputs = torch.randn(5, 3, dtype=torch.float64)
    targets = torch.randint(0, 4, (5,))
    quantity = HessTrace(linear(1), curvature="diag_ggn_mc")
    cockpit = Cockpit(layer.parameters(), quantities=[quantity], model=layer)
    draws = []
    for step in range(400):
        outputs = layer(inputs)
        loss = nn.functional.cross_entropy(outputs, targets)
        with cockpit(step, info={"loss": loss, "outputs": outputs}):
            loss.backward(create_graph=cockpit.create_graph(step))
        layer.weight.grad = None
        draws.append(cockpit.get_output()[step]["HessTrace"][0])
    probs = torch.softmax(layer(inputs), 1).detach()
    exact = float(((probs - probs**2).T @ inputs**2).sum() / 5)  # tr of (1/N) sum_n diag(H_n) ⊗ x_n x_n^T
    mean = sum(draws) / len(draws)
    spread = torch.tensor(draws).std().item() / len(draws) ** 0.5
    assert abs(mean - exact) < 4 * spread + 1e-12


def test_missing_outputs_is_a_clear_error():
    problem = ZOO["custom"](0)
    model = problem.model
    cockpit = Cockpit(model.parameters(), quantities=[TICDiag(linear(1), curvature="diag_ggn_mc")], model=model)
    inputs, targets = problem.batch(4, 0)
    loss = problem.sample_losses(model(inputs), targets).mean()
    with pytest.raises(KeyError, match=r"info\['outputs'\]"):
        with cockpit(0, info={"batch_size": 4, "loss": loss}):
            loss.backward(create_graph=True)
    loss = problem.sample_losses(model(inputs), targets).mean()
    with pytest.raises(ValueError, match="logits"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(1, info={"batch_size": 4, "loss": loss, "outputs": loss}):
                loss.backward(create_graph=True)
