"""The value a step's backward passes propagate is ``f * info["loss"]`` (:mod:`cockpit_like.checks.roots`).

Found outside the tests (a fifth round): a second loss backpropagated in the same block
(``L1.backward(retain_graph=True); L2.backward()``) with ``info`` declaring ``L1`` was refused at the first
step only; from the next one the per-sample rows summed both passes, the gradient check passed, and Alpha
mixed ``L1``'s values with the slopes of ``L1 + L2`` (0.592 stored where the declared loss gives -0.126),
valid, no note. The same held for one pass of ``L1 + L2``. Float64, against brute force."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import Alpha, GradNorm, Loss, NormTest
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.test_alpha import reference_alpha

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")
DT = torch.float64
B = 6


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
        self.h1, self.h2 = nn.Linear(6, 3), nn.Linear(6, 1)
        self.to(DT)

    def forward(self, x):
        h = self.trunk(x)
        return self.h1(h), self.h2(h).squeeze(1)


def batch(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(B, 5, dtype=DT, generator=g), torch.randint(0, 3, (B,), generator=g), torch.randn(B, dtype=DT, generator=g)


def run(backward, declare="main", steps=4, quantities=None):
    """``backward(L1, L2, o1)`` inside the block; ``declare``: ``"main"`` (L1, l1) or ``"sum"`` (L1 + L2, l1 + l2)."""
    model = TwoTasks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    quantities = quantities or [Alpha(linear(1)), GradNorm(linear(1)), NormTest(linear(1)), Loss(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    observed = []
    for step in range(steps):
        x, y, t = batch(step)
        optimizer.zero_grad()
        o1, o2 = model(x)
        l1, l2 = F.cross_entropy(o1, y, reduction="none"), (o2 - t) ** 2
        losses = l1 if declare == "main" else l1 + l2
        info = {"batch_size": B, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
        observed.append({"params": [p.detach().clone() for p in model.parameters()], "loss": float(losses.mean()),
                         "losses": losses.detach().clone(), "x": x, "y": y, "t": t})  # fmt: skip
        with cockpit(step, info=info):
            backward(l1.mean(), l2.mean(), o1)
        optimizer.step()
    return cockpit, model, observed


def failed(cockpit, step):
    return [f["check"] for f in cockpit.checks[step]["failed"]]


def two_passes(L1, L2, o1):
    L1.backward(retain_graph=True)
    L2.backward()


@pytest.mark.parametrize("backward", [
    two_passes,
    lambda L1, L2, o1: (L1 + L2).backward(),                                 # one pass, a term through another output
    lambda L1, L2, o1: (L1 + 0.1 * (o1**2).mean()).backward(),               # a term on the same output
    lambda L1, L2, o1: torch.autograd.backward([L1, L2]),
], ids=["two_passes", "sum_other_output", "term_same_output", "autograd_backward_list"])  # fmt: skip
def test_undeclared_terms_leave_every_step_invalid(backward):
    cockpit, _, _ = run(backward)
    output = cockpit.get_output()
    for step in range(4):
        assert "backpropagated_loss" in failed(cockpit, step), cockpit.checks[step]
        assert "Alpha" not in output.get(step, {}) and "NormTest" not in output.get(step, {})
    reason = next(f["reason"] for f in cockpit.checks[2]["failed"] if f["check"] == "backpropagated_loss")
    assert "info['loss']" in reason and "Declare the loss you backpropagate" in reason


def test_the_declared_sum_of_two_passes_is_exact():
    """Declaring what is propagated (the rows of l1 + l2): from the second step on (the first teaches the cockpit that
    the block runs two passes) every step is valid and Alpha is its definition's."""
    cockpit, model, observed = run(two_passes, declare="sum")
    assert "backward_passes" in failed(cockpit, 0)
    params = list(model.parameters())
    for step in (1, 2):
        assert failed(cockpit, step) == [], cockpit.checks[step]
        start, end = ({**observed[s], "grads": _row_grads(model, params, observed[s])} for s in (step, step + 1))
        assert cockpit.get_output()[step]["Alpha"] == pytest.approx(reference_alpha(start, end, B), rel=1e-8)


def _row_grads(model, params, obs):
    """Per-row gradients of l1 + l2 at the observed parameters, by a loop of autograd.grad."""
    current = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, value in zip(params, obs["params"]):
            p.copy_(value)
    rows = []
    for i in range(B):
        o1, o2 = model(obs["x"][i : i + 1])
        loss = F.cross_entropy(o1, obs["y"][i : i + 1]) + ((o2 - obs["t"][i : i + 1]) ** 2).mean()
        rows.append(torch.autograd.grad(loss, params))
    with torch.no_grad():
        for p, value in zip(params, current):
            p.copy_(value)
    return [torch.stack([row[k] for row in rows]) for k in range(len(params))]


@pytest.mark.parametrize("backward", [
    lambda L1, L2, o1: L1.backward(),
    lambda L1, L2, o1: (L1 * 1024.0).backward(),                             # an undeclared GradScaler-like factor
    lambda L1, L2, o1: (L1 / 4).backward(),
    lambda L1, L2, o1: (L1 + 0.0 * L2).backward(),                           # a zero term (DDP's unused-parameter trick)
], ids=["plain", "times_1024", "divided_by_4", "zero_term"])  # fmt: skip
def test_a_multiple_of_the_declared_loss_passes(backward):
    cockpit, _, _ = run(backward, steps=3)
    for step in range(3):
        assert "backpropagated_loss" not in failed(cockpit, step), cockpit.checks[step]
    assert "Alpha" in cockpit.get_output()[1]


def test_detached_declarations_of_a_sum_backward_are_invalid_not_off_by_the_batch_size():
    """``losses.sum().backward()`` while ``info`` holds the mean as numbers: once a note and GradNorm B times too
    large; the propagated value (B x the mean) shows it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).to(DT)
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))], model=model)
    x = torch.randn(B, 5, dtype=DT)
    losses = (model(x) ** 2).sum(1)
    with cockpit(0, info={"batch_size": B, "individual_losses": losses.detach(), "loss": float(losses.mean())}):
        losses.sum().backward()
    assert "backpropagated_loss" in failed(cockpit, 0)
    assert "GradNorm" not in cockpit.get_output().get(0, {})


def test_the_watch_is_removed_after_the_block_even_after_an_error():
    original = torch.autograd.backward
    cockpit, _, _ = run(lambda L1, L2, o1: L1.backward(), steps=1)
    assert torch.autograd.backward is original
    model = TwoTasks()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    x, y, _ = batch(0)
    o1, _ = model(x)
    losses = F.cross_entropy(o1, y, reduction="none")
    with pytest.raises(RuntimeError, match="boom"):
        with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean()}):
            assert torch.autograd.backward is not original  # watching
            raise RuntimeError("boom")
    assert torch.autograd.backward is original


def test_another_threads_backward_pass_is_not_counted():
    """A backward pass that another thread runs meanwhile (a data-loading or evaluation thread) is not this step's."""
    other = nn.Linear(3, 1).to(DT)
    started, done = threading.Event(), threading.Event()

    def elsewhere():
        started.wait(10)
        other(torch.randn(4, 3, dtype=DT)).pow(2).sum().backward()
        done.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()

    def backward(L1, L2, o1):
        started.set()
        done.wait(10)
        L1.backward()

    cockpit, _, _ = run(backward, steps=1)
    thread.join()
    assert done.is_set() and failed(cockpit, 0) == [], cockpit.checks[0]


def test_a_two_stage_backward_through_detached_features_says_it_is_not_a_loss():
    """GradCache-style: the head's loss on detached features, then ``features.backward(features.grad)`` inside the
    block: the root is a tensor with a gradient of the user's, not a loss."""
    model = TwoTasks()
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    x, y, _ = batch(0)
    features = model.trunk(x)
    detached = features.detach().requires_grad_(True)
    losses = F.cross_entropy(model.h1(detached), y, reduction="none")
    losses.mean().backward()
    with cockpit(0, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean()}):
        features.backward(detached.grad)
    reason = next(f["reason"] for f in cockpit.checks[0]["failed"] if f["check"] == "backpropagated_loss")
    assert "features.backward(grad)" in reason and "not a loss" in reason


def test_micro_batches_with_an_undeclared_term_fail_the_step_once():
    model = TwoTasks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"), model=model)
    optimizer.zero_grad()
    for micro in range(3):
        x, y, t = batch(micro)
        o1, o2 = model(x)
        losses = F.cross_entropy(o1, y, reduction="none")
        info = {"batch_size": B, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer,
                "micro_batches": 3}  # fmt: skip
        with cockpit(0, info=info):
            ((losses.mean() + ((o2 - t) ** 2).mean()) / 3).backward()
    optimizer.step()
    failures = [f for f in cockpit.checks[0]["failed"] if f["check"] == "backpropagated_loss"]
    assert len(failures) == 1 and "backward pass 1 of 3" in failures[0]["reason"]


def test_a_declared_factor_is_called_declared():
    """With detached declarations the factor is the declared one, not one seen at info['loss']: the reason says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).to(DT)
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1))], model=model)
    losses = (model(torch.randn(B, 5, dtype=DT)) ** 2).sum(1)
    with cockpit(0, info={"batch_size": B, "individual_losses": losses.detach(), "loss": float(losses.mean())}):
        losses.sum().backward()
    reason = next(f["reason"] for f in cockpit.checks[0]["failed"] if f["check"] == "backpropagated_loss")
    # (a whole multiple of info['loss'], the sum of its rows: the reason names the multiple too)
    assert "the factor declared at it 1" in reason and f"{B} x info['loss']" in reason
