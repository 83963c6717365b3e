"""Outside trial 25 (scientific ML, reinforcement learning and graph loops, float64 brute force).

- A physics-informed net whose loss is a residual of ``d2u/dx2`` (``torch.autograd.grad(..., create_graph=True)``):
  every step failed the gradient check (the rows miss the part of each row's gradient that the derivative's graph
  carries), the reason named a learnable loss weight first, and HessMaxEV / HessTrace, which need no rows, were
  withheld with them. Now the loss's graph is walked up to the module calls' outputs before the backward pass: a
  path to a tracked parameter around them leaves the per-sample quantities out with a note, and the rest is stored.
- A node-level graph network (``A @ H``) with the loss on every node (the documented recipe for labelled subsets):
  ``UncoveredParameterError`` about a graph's ``batch`` vector stopped training. The ``[B, B]`` argument relates the
  rows to each other: a note now, the rest stored. With the loss on the labelled nodes only, and a TD critic called
  once on ``T + 1`` states for ``T`` losses, the error said the (correct) batch size was likely wrong.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends.hooks import BatchSizeMismatchError
from cockpit_like.quantities import GradNorm, HessMaxEV, Loss, NormTest
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


class Sine(nn.Module):
    def forward(self, x):
        return torch.sin(x)


def pinn(activation) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 8), activation, nn.Linear(8, 8), activation, nn.Linear(8, 1)).double()


def residuals(model, x):
    """``(-u'' - pi^2 sin(pi x))^2`` per collocation point: each row's loss reads its own point only."""
    x = x.clone().requires_grad_(True)
    u = model(x)
    (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
    (d2u,) = torch.autograd.grad(du.sum(), x, create_graph=True)
    return ((-d2u - math.pi**2 * torch.sin(math.pi * x)) ** 2).squeeze(1)


def dense_hessian(model, loss_of) -> torch.Tensor:
    params = list(model.parameters())
    def flat(tensors):
        return torch.cat([torch.zeros_like(p).reshape(-1) if t is None else t.reshape(-1) for p, t in zip(params, tensors)])

    grads = flat(torch.autograd.grad(loss_of(), params, create_graph=True, allow_unused=True))
    rows = [flat(torch.autograd.grad(grads[i], params, retain_graph=True, allow_unused=True))
            if grads[i].requires_grad else torch.zeros_like(grads) for i in range(grads.numel())]
    return torch.stack(rows)


@pytest.mark.parametrize("activation", [nn.Tanh(), Sine()], ids=["tanh", "sine"])
def test_a_physics_informed_residual_keeps_curvature_and_says_why_rows_are_out(activation):
    model = pinn(activation)
    x = torch.linspace(0.05, 0.95, 10, dtype=torch.float64).unsqueeze(1)
    every = linear(1)
    cockpit = Cockpit(model.parameters(), model=model,
                      quantities=[Loss(every), GradNorm(every), NormTest(every), HessMaxEV(every)])
    losses = residuals(model, x)
    loss = losses.mean()
    params = list(model.parameters())
    expected_grads = [torch.zeros_like(p) if g is None else g  # (the last bias does not reach u'')
                      for p, g in zip(params, torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True))]
    with cockpit(0, info={"batch_size": 10, "individual_losses": losses, "loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    values, checks = cockpit.get_output()[0], cockpit.checks[0]
    assert checks["valid"] and not checks["failed"], checks
    note = " ".join(checks["notes"])
    assert "NormTest" in note and "other than through the module calls" in note and "physics-informed" in note
    assert "NormTest" not in values  # no rows: no number
    assert values["Loss"] == pytest.approx(float(loss), rel=1e-14)
    assert values["GradNorm"] == pytest.approx([float(g.norm()) for g in expected_grads], rel=1e-12)
    eigenvalues = torch.linalg.eigvalsh(dense_hessian(model, lambda: residuals(model, x).mean()))
    top = float(eigenvalues[eigenvalues.abs().argmax()])
    assert values["HessMaxEV"] == pytest.approx(top, rel=1e-2)


def test_a_penalty_read_through_the_outputs_or_a_hidden_call_keeps_the_rows():
    """No false alarm: a loss on the outputs and on a hidden layer's output (each row its own) reaches every
    parameter through the calls; the rows are stored and exact."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden, self.head = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = torch.tanh(self.hidden(x))
            return self.head(h), h

    model = Net().double()
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))

    def rows(net):
        logits, h = net(x)
        return F.cross_entropy(logits, y, reduction="none") + 0.1 * h.square().mean(1)

    losses = rows(model)
    per_sample = []
    for i in range(8):
        logits, h = model(x[i : i + 1])
        row = F.cross_entropy(logits, y[i : i + 1]) + 0.1 * h.square().mean()
        per_sample.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(row, list(model.parameters()))]))
    g = torch.stack(per_sample)
    mean = g.mean(0)
    spread = g.square().sum(1).sum() - 8 * mean.square().sum()  # sum_i ||g_i - mean||^2
    expected = (spread / ((8 - 1) * 8 * mean.square().sum())).sqrt()  # QUANTITIES.md
    with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    assert cockpit.checks[0]["valid"] and not cockpit.checks[0]["notes"], cockpit.checks[0]
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(float(expected), rel=1e-10)


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x, A):
        return A @ self.l2(torch.relu(A @ self.l1(x)))


def _graph(nodes=10):
    torch.manual_seed(0)
    A = torch.eye(nodes, dtype=torch.float64)
    for i in range(nodes):
        A[i, (i + 1) % nodes] = A[(i + 1) % nodes, i] = 1.0
    A = A / A.sum(1, keepdim=True)
    x, y = torch.randn(nodes, 4, dtype=torch.float64), torch.randint(0, 3, (nodes,))
    labelled = torch.zeros(nodes, dtype=torch.bool)
    labelled[[0, 2, 3, 6, 8, 9]] = True
    return GCN().double(), A, x, y, labelled


def test_a_node_level_graph_network_leaves_the_rows_out_with_a_note():
    model, A, x, y, labelled = _graph()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        losses = F.cross_entropy(model(x, A), y, reduction="none") * labelled * (10 / labelled.sum())
        expected = torch.autograd.grad(losses.mean(), list(model.parameters()), retain_graph=True)
        info = {"batch_size": 10, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
        with cockpit(step, info=info):
            losses.mean().backward()
        values, checks = cockpit.get_output()[step], cockpit.checks[step]
        assert checks["valid"], checks
        assert "a matrix over the batch's 10 rows" in " ".join(checks["notes"])
        assert "NormTest" not in values
        assert values["GradNorm"] == pytest.approx([float(g.norm()) for g in expected], rel=1e-12)
        optimizer.step()


def test_fewer_losses_than_rows_names_the_labelled_rows_recipe():
    model, A, x, y, labelled = _graph()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    losses = F.cross_entropy(model(x, A)[labelled], y[labelled], reduction="none")
    with pytest.raises(BatchSizeMismatchError, match="labelled nodes of a graph") as error:
        with cockpit(0, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
    assert "'batch_size': 10" in str(error.value)


def test_a_td_critic_called_once_on_t_plus_one_states_names_the_two_call_form():
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    cockpit = Cockpit(critic.parameters(), quantities=configuration("economy"), model=critic)
    states, rewards = torch.randn(11, 3, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    v = critic(states).squeeze(1)
    losses = (rewards + 0.9 * v[1:] - v[:-1]) ** 2
    with pytest.raises(BatchSizeMismatchError, match=r"model\(s\[:-1\]\), model\(s\[1:\]\)"):
        with cockpit(0, info={"batch_size": 10, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
