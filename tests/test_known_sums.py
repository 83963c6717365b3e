"""Batch sums of rows taken from the backward pass (``HookBackend._watch_sums``), float64.

A tied parameter's rows (an embedding that is also the output layer) and a
layer over the memory budget are reduced a block of rows at a time, and some
statistics (the Gram row sums of the gradient tests, Alpha's predicted
update) read the batch sum of the rows before the first block. Where a use's
gradient is passed to the parameter by one node of the call's own graph, that
gradient is the batch sum, computed by the backward pass anyway. These tests
compare every logged number against the same runs with the watch turned off
(sums made from the rows), on cases where taking the wrong gradient would
show: a regularizer on the tied weight (the parameter's gradient is not the
sum of the rows), a weight cast shared by two calls under autocast, micro-
batches with a ``GradScaler``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.backends import hooks, module_rules, per_sample
from cockpit_like.quantities import GradHist2d
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.helpers import assert_nested_close

VOCAB, WIDTH, ROWS, LENGTH, STEPS = 23, 6, 4, 5, 3


class TiedLM(nn.Module):
    """Embedding (with a padding token), a linear layer on the sequence, an output layer that is the embedding (weight tying)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)  # token 0 adds nothing to the embedding
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class Twice(nn.Module):
    """One linear layer applied twice (a parameter with two uses) on rows."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(5, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.shared(self.inp(x)))))


def _quantities():
    return configuration("economy") + [GradHist2d(linear(1))]


@pytest.fixture
def watch(monkeypatch):
    """``set(False)`` turns the watch off; ``fired()``: the shapes of the sums read from the backward pass;
    ``made()``: how many batch sums of sequence factors were made from the rows."""
    fired, made = [], []
    on_sum = hooks.HookBackend._on_sum

    def spy(self, key, index, grad_inputs, grad_outputs):
        if grad_inputs[index] is not None and self._sums.get(key) is hooks._WAITING:
            fired.append(tuple(grad_inputs[index].shape))
        return on_sum(self, key, index, grad_inputs, grad_outputs)

    monkeypatch.setattr(hooks.HookBackend, "_on_sum", spy)
    for module in (module_rules, per_sample):
        original = module.sequence_sum
        monkeypatch.setattr(module, "sequence_sum", lambda a, b, original=original: made.append(1) or original(a, b))
    watched = hooks.HookBackend._watch_sums

    class Control:
        def set(self, on: bool):
            monkeypatch.setattr(hooks.HookBackend, "_watch_sums", watched if on else (lambda self: None))
            fired.clear()
            made.clear()

        def fired(self):
            return list(fired)

        def made(self):
            return len(made)

    return Control()


def _run_lm(budget=None, optimizer_class=torch.optim.Adam, regularizer=0.0, micro_batches=1, scale=None, seed=0):
    model = TiedLM(seed).double()
    args = {} if budget is None else {"memory_budget": budget}
    cockpit = Cockpit(model.parameters(), quantities=_quantities(), model=model, **args)
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    generator = torch.Generator().manual_seed(seed + 100)
    size = ROWS // micro_batches
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
        tokens[:, -1] = 0  # a padding token in every row
        targets = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
        optimizer.zero_grad()
        for micro in range(micro_batches):
            part = slice(micro * size, (micro + 1) * size)
            logits = model(tokens[part])
            token_losses = nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), targets[part].reshape(-1), reduction="none"
            ).reshape(size, LENGTH)
            losses = token_losses.mean(1)
            loss = losses.mean()
            total = loss + regularizer * model.embed.weight.square().sum()
            info = {"batch_size": size, "individual_losses": losses.detach(), "loss": loss, "optimizer": optimizer}
            if micro_batches > 1:
                info["micro_batches"] = micro_batches
            backward = total / micro_batches
            if scaler is not None:
                info["grad_scaler"] = scaler
                backward = scaler.scale(backward)
            with cockpit(step, info=info):
                backward.backward()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return {step: {k: v for k, v in values.items() if k != "Time"} for step, values in cockpit.get_output().items()}


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.SGD])
def test_sums_from_the_backward_pass_equal_sums_from_the_rows(watch, optimizer_class):
    watch.set(False)
    reference = _run_lm(budget=1, optimizer_class=optimizer_class)
    assert watch.made() > 0  # without the watch, the tied weight's and the mixing layer's sums are made
    watch.set(True)
    watched = _run_lm(budget=1, optimizer_class=optimizer_class)
    # every step: the output layer's use of the tied weight and the mixing layer (over the 1-byte budget)
    assert sorted(set(watch.fired())) == [(WIDTH, WIDTH), (VOCAB, WIDTH)]
    assert len(watch.fired()) == 2 * STEPS
    assert watch.made() == 0  # no batch sum of sequence factors made from the rows
    assert {"Alpha", "InnerTest", "OrthoTest", "NormTest", "GradHist1d", "GradHist2d"} <= set(reference[0]) | set(reference[1])
    assert_nested_close(watched, reference, "watched sums, budget 1 byte", rtol=1e-10, atol=1e-13)
    assert_nested_close(watched, _run_lm(optimizer_class=optimizer_class), "watched sums vs default budget", rtol=1e-10, atol=1e-13)


def test_the_default_budget_watches_only_the_tied_weight(watch):
    watch.set(True)
    _run_lm()
    assert set(watch.fired()) == {(VOCAB, WIDTH)}


def test_a_regularizer_on_the_tied_weight_is_not_in_the_sum(watch, monkeypatch):
    """p.grad holds the penalty's gradient, the rows do not: the sum read is the output layer's use."""
    watch.set(False)
    reference = _run_lm(budget=1, regularizer=1e-3)
    watch.set(True)
    watched = _run_lm(budget=1, regularizer=1e-3)
    assert (VOCAB, WIDTH) in watch.fired()
    assert_nested_close(watched, reference, "watched sums with a penalty on the tied weight", rtol=1e-10, atol=1e-13)

    # the sum read for the output layer is delta^T h of that layer alone (not p.grad, not the embedding's use)
    read = []
    on_sum = hooks.HookBackend._on_sum

    def keep(self, key, index, grad_inputs, grad_outputs):
        read.append(grad_inputs[index].detach().clone())
        return on_sum(self, key, index, grad_inputs, grad_outputs)

    monkeypatch.setattr(hooks.HookBackend, "_on_sum", keep)
    model = TiedLM(5).double()
    cockpit = Cockpit(model.parameters(), quantities=_quantities(), model=model)
    seen = {}
    model.out.register_forward_hook(lambda module, args, output: seen.update(h=args[0], logits=output))
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    logits = model(tokens)
    logits.register_hook(lambda grad: seen.update(delta=grad))
    losses = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1), reduction="none")
    losses = losses.reshape(ROWS, LENGTH).mean(1)
    penalty = 0.5 * model.embed.weight.square().sum()
    with cockpit(0, info={"batch_size": ROWS, "individual_losses": losses.detach(), "loss": losses.mean()}):
        (losses.mean() + penalty).backward()
    expected = seen["delta"].reshape(-1, VOCAB).T @ seen["h"].reshape(-1, WIDTH)
    assert len(read) == 1
    torch.testing.assert_close(read[0], expected, rtol=1e-12, atol=1e-14)
    assert (model.embed.weight.grad - expected).norm() > 0.1 * expected.norm()  # p.grad is something else


def test_micro_batches_with_a_grad_scaler(watch):
    watch.set(False)
    reference = _run_lm()
    watch.set(True)
    scaled = _run_lm(budget=1, micro_batches=2, scale=2.0**8)
    assert (VOCAB, WIDTH) in watch.fired()
    assert_nested_close(scaled, reference, "watched sums, 2 micro-batches, GradScaler", rtol=1e-8, atol=1e-12)


def _run_twice(autocast: bool, dtype=torch.float32):
    model = Twice(3).to(dtype)
    cockpit = Cockpit(model.parameters(), quantities=_quantities(), model=model, memory_budget=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        x, y = torch.randn(ROWS, 5, generator=generator).to(dtype), torch.randint(0, 3, (ROWS,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outputs = model(x)
        losses = nn.functional.cross_entropy(outputs.to(dtype), y, reduction="none")
        info = {"batch_size": ROWS, "individual_losses": losses.detach(), "loss": losses.mean(), "optimizer": optimizer}
        with cockpit(step, info=info):
            losses.mean().backward()
        optimizer.step()
    return {step: {k: v for k, v in values.items() if k != "Time"} for step, values in cockpit.get_output().items()}


def test_a_weight_cast_shared_by_two_calls_is_not_watched(watch):
    """Under autocast both calls of ``shared`` read one cached bfloat16 copy of its weight: the node that
    passes the gradient to the weight sums both uses, so neither use's sum may be taken from it."""
    watch.set(False)
    reference = _run_twice(autocast=True)
    watch.set(True)
    watched = _run_twice(autocast=True)
    assert (WIDTH, WIDTH) not in watch.fired()  # the shared layer's weight: not watched
    assert (3, WIDTH) in watch.fired()  # the head's weight (over the budget, its own cast): watched
    # the head's sum comes from autograd's float32 product instead of ours: equal up to float32 rounding
    # (exactly equal on one CPU, not on another); a shared layer's sum taken from the node would hold
    # both calls' gradients and move every statistic by far more
    assert_nested_close(watched, reference, "autocast, shared cast", rtol=1e-5, atol=1e-7)


def test_a_layer_applied_twice_in_full_precision(watch):
    """Without autocast each call has its own edge to the weight: both uses are watched, numbers unchanged."""
    watch.set(False)
    reference = _run_twice(autocast=False, dtype=torch.float64)
    watch.set(True)
    watched = _run_twice(autocast=False, dtype=torch.float64)
    assert watch.fired().count((WIDTH, WIDTH)) == 2 * STEPS
    assert_nested_close(watched, reference, "a layer applied twice", rtol=1e-10, atol=1e-13)


def test_a_layer_applied_twice_with_a_tiny_budget_equals_the_default_and_the_brute_force():
    """The rows of a parameter's two uses are summed a block at a time; a use whose rows are a view of
    its own tensor (the bias: its output gradient) must not be written (it was, before: wrong row sums)."""
    blocked = _run_twice(autocast=False, dtype=torch.float64)  # memory_budget=1
    model = Twice(3).double()
    cockpit = Cockpit(model.parameters(), quantities=_quantities(), model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(ROWS, 5, generator=generator).double(), torch.randint(0, 3, (ROWS,), generator=generator)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    info = {"batch_size": ROWS, "individual_losses": losses.detach(), "loss": losses.mean(), "optimizer": optimizer}
    with cockpit(0, info=info):
        losses.mean().backward()
    default = cockpit.get_output()[0]

    def loss_of_row(p, xi, yi):
        return nn.functional.cross_entropy(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    per_row = torch.func.vmap(torch.func.grad(loss_of_row), in_dims=(None, 0, 0))(params, x, y)
    grad_batch = torch.cat([g.reshape(ROWS, -1) / ROWS for g in per_row.values()], 1)
    mean = grad_batch.sum(0)
    pi = ROWS * grad_batch @ mean
    norm2 = mean @ mean
    variance = ((pi**2).sum() - ROWS * norm2**2) / (ROWS - 1)
    expected = (variance / (ROWS * norm2**2)).sqrt().item()
    assert default["InnerTest"] == pytest.approx(expected, rel=1e-10)
    assert blocked[0]["InnerTest"] == pytest.approx(expected, rel=1e-10)
