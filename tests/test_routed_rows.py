"""Calls whose outputs have the batch's shape but not its rows (:mod:`cockpit_like.backends.row_paths`).

A hand-written top-k mixture of experts flattens the tokens of all rows and
gathers them per expert by index (``expert(tokens[idx])``, then
``index_add`` back). An expert that gets exactly ``B`` tokens (the batch
size) has outputs ``[B, d]`` whose row ``r`` belongs to the sample of token
``idx[r]``; the hooks took them for the batch's rows, and the sum over rows
(the batch gradient, which the self-check compares) did not change, so
NormTest, InnerTest, OrthoTest, histograms, Alpha and TIC were silently off
(3 % on InnerTest) on a valid step. The rows of a call now count as the
samples' only if the graph from its outputs to the model's outputs keeps
them; the expert's parameters climb to the enclosing call that carries the
batch, whose re-run computes them through the routing, exactly.

References never come from cockpit_like: per-sample gradients by a loop of
``torch.autograd.grad`` over the rows, in float64.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

import cockpit_like.backends.hooks as hooks
from cockpit_like import Cockpit
from cockpit_like.backends.per_sample_stats import GramSummary, SumOfSquares
from cockpit_like.backends.row_paths import RowPaths
from cockpit_like.context import get_record
from cockpit_like.quantities import InnerTest, NormTest, OrthoTest
from cockpit_like.quantities.quantity import SingleStepQuantity

DTYPE = torch.float64
TOKENS, WIDTH = 3, 3


class _Probe(SingleStepQuantity):
    """The Gram summary (``||g_i||^2 / B^2``, ``g_i^T gbar / B``) and the per-parameter sums of squares."""

    def per_sample_stats(self, step):
        return [GramSummary(), SumOfSquares()]

    def _compute(self, step, params, loss):
        record = get_record(step)
        diag, row_sums = record.stat(GramSummary())
        return {"diag": diag.clone(), "row_sums": row_sums.clone(), "squares": [s.clone() for s in record.stat(SumOfSquares())]}


class _Expert(nn.Module):
    """A linear map with its own parameters and no per-layer rule (the ``torch.func`` fallback's path)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, WIDTH, dtype=DTYPE) * 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight.T)


class MoE(nn.Module):
    """Top-2 of 4 experts per token; the tokens of all rows flattened and gathered per expert by index."""

    def __init__(self, expert=nn.Linear, experts: int = 4, k: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(WIDTH, experts).to(DTYPE)
        self.experts = nn.ModuleList(
            (expert(WIDTH, 4) if expert is nn.Linear else expert()).to(DTYPE) for _ in range(experts)
        )
        self.head = nn.Linear(4, 3).to(DTYPE)
        self.k = k

    def routes(self, x):
        weights, chosen = self.router(x.reshape(-1, WIDTH)).softmax(-1).topk(self.k, -1)
        return weights, chosen

    def counts(self, x) -> list[int]:
        with torch.no_grad():
            chosen = self.routes(x)[1]
        return [int((chosen == e).sum()) for e in range(len(self.experts))]

    def forward(self, x):  # x [B, T, d]
        rows, tokens, _ = x.shape
        flat = x.reshape(-1, WIDTH)
        weights, chosen = self.routes(x)
        out = torch.zeros(flat.shape[0], 4, dtype=x.dtype)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        return self.head(torch.tanh(out).reshape(rows, tokens, 4).mean(1))


def _batch(rows: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, TOKENS, WIDTH, generator=generator, dtype=DTYPE)
    return x, torch.randint(0, 3, (rows,), generator=generator)


def _per_sample(model, x, labels) -> torch.Tensor:
    """``G[i]``: the gradient of row ``i``'s loss (not divided by ``B``), all parameters flattened."""
    params = list(model.parameters())
    losses = nn.functional.cross_entropy(model(x), labels, reduction="none")
    rows = []
    for i in range(len(labels)):
        grads = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]))
    return torch.stack(rows)


def _track(model, x, labels, quantities):
    cockpit = Cockpit(list(model.parameters()), quantities=quantities, model=model)
    losses = nn.functional.cross_entropy(model(x), labels, reduction="none")
    loss = losses.mean()
    info = {"batch_size": len(labels), "individual_losses": losses, "loss": loss}
    with cockpit(0, info=info):
        loss.backward()
    return cockpit


# (rows, batch seed): an expert gets exactly `rows` tokens, or none does
# (at (5, 2) the expert's 5 tokens come one from each row, in order: right before the fix too)
EQUAL = [(4, 4), (5, 5), (5, 2), (6, 0), (7, 0), (8, 0)]
OTHER = [(4, 0), (5, 1), (7, 1)]


@pytest.mark.parametrize("expert", [nn.Linear, _Expert], ids=["linear_rule", "fallback"])
@pytest.mark.parametrize("rows,seed", EQUAL + OTHER, ids=[f"B{b}_seed{s}_{'equal' if (b, s) in EQUAL else 'other'}" for b, s in EQUAL + OTHER])
def test_experts_at_any_batch_size_match_the_loop(expert, rows, seed):
    model = MoE(expert)
    x, labels = _batch(rows, seed)
    assert (rows in model.counts(x)) == ((rows, seed) in EQUAL)  # the premise: an expert gets exactly B tokens
    G = _per_sample(model, x, labels)
    probe = _Probe(lambda step: True)
    cockpit = _track(model, x, labels, [probe])
    assert cockpit.checks[0].get("valid", True), cockpit.checks[0]
    got = probe.output[0]
    gbar = G.mean(0)
    torch.testing.assert_close(torch.as_tensor(got["diag"]), (G**2).sum(1) / rows**2, rtol=1e-10, atol=1e-16)
    torch.testing.assert_close(torch.as_tensor(got["row_sums"]), G @ gbar / rows, rtol=1e-10, atol=1e-16)
    sizes = [p.numel() for p in model.parameters()]
    for block, squares in zip(torch.split((G**2).sum(0) / rows**2, sizes), got["squares"]):
        torch.testing.assert_close(torch.as_tensor(squares).reshape(-1), block, rtol=1e-10, atol=1e-16)


@pytest.mark.parametrize("rows,seed", [(5, 5), (7, 1)], ids=["B5_equal", "B7_other"])
def test_gradient_tests_of_the_report(rows, seed):
    """The outside tester's numbers: NormTest, InnerTest, OrthoTest against their definitions."""
    model = MoE()
    x, labels = _batch(rows, seed)
    G = _per_sample(model, x, labels)
    quantities = [NormTest(lambda step: True), InnerTest(lambda step: True), OrthoTest(lambda step: True)]
    cockpit = _track(model, x, labels, quantities)
    gbar = G.mean(0)
    g2, pi = gbar @ gbar, G @ gbar
    expected = {
        "NormTest": (((G - gbar) ** 2).sum() / ((rows - 1) * rows * g2)).sqrt(),
        "InnerTest": (((pi - g2) ** 2).sum() / ((rows - 1) * rows * g2**2)).sqrt(),
        "OrthoTest": (((G - torch.outer(pi / g2, gbar)) ** 2).sum() / ((rows - 1) * rows * g2)).sqrt(),
    }
    output = cockpit.get_output()[0]
    for name, value in expected.items():
        assert output[name] == pytest.approx(float(value), rel=1e-10), name


class _Reordered(nn.Module):
    """Row ``i`` of the output comes from input row ``B - 1 - i``: the hidden layer's rows are not the samples'."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(WIDTH, 5).to(DTYPE)
        self.head = nn.Linear(5, 3).to(DTYPE)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).flip(0))


def test_rows_reordered_inside_the_model_never_give_a_wrong_number():
    """The per-sample gradient of row ``i``'s loss reads input row ``B - 1 - i``; the model's own rows cannot
    be re-run one at a time (a row's re-run is not the recorded row), so the step says so instead of crediting
    the hidden layer's rows to the wrong samples."""
    model = _Reordered()
    x, labels = torch.randn(4, WIDTH, dtype=DTYPE), torch.tensor([0, 1, 2, 0])
    probe = _Probe(lambda step: True)
    cockpit = _track(model, x, labels, [probe])  # (an error until 2026-11-29; the step's note since, and no number)
    assert probe.output.get(0) is None
    assert any("reproduce" in note for note in cockpit.checks[0]["notes"]), cockpit.checks[0]["notes"]


class _SequenceFirst(nn.Module):
    """A layer on ``[T, B, d]`` (sequence first): with ``T == B`` its leading dimension is the batch size, but its
    rows are the time steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.step = nn.Linear(WIDTH, 6).to(DTYPE)
        self.head = nn.Linear(6, 3).to(DTYPE)

    def forward(self, x):  # [B, T, d]
        return self.head(torch.tanh(self.step(x.transpose(0, 1))).mean(0))


@pytest.mark.parametrize("tokens", [4, 3], ids=["T_equals_B", "T_other"])
def test_a_sequence_first_layer_with_as_many_steps_as_rows_matches_the_loop(tokens):
    model = _SequenceFirst()
    x, labels = torch.randn(4, tokens, WIDTH, dtype=DTYPE), torch.tensor([0, 1, 2, 0])
    G = _per_sample(model, x, labels)
    probe = _Probe(lambda step: True)
    _track(model, x, labels, [probe])
    torch.testing.assert_close(torch.as_tensor(probe.output[0]["diag"]), (G**2).sum(1) / 16, rtol=1e-10, atol=1e-16)
    torch.testing.assert_close(torch.as_tensor(probe.output[0]["row_sums"]), G @ G.mean(0) / 4, rtol=1e-10, atol=1e-16)


class _Encoder(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(WIDTH, 8).to(DTYPE)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).to(DTYPE)
        self.flat = nn.Linear(8, 8).to(DTYPE)
        self.head = nn.Linear(8, 3).to(DTYPE)

    def forward(self, x):  # [B, T, d]
        h = self.layer(self.embed(x))
        rows, tokens, width = h.shape
        h = torch.tanh(self.flat(h.reshape(rows * tokens, width))).reshape(rows, tokens, width)  # flattened rows
        return self.head(h[torch.arange(rows), -1] + h.mean(1))  # x[arange(B), ...] keeps the rows


@pytest.mark.parametrize("rows", [3, 4])
def test_layers_on_the_batchs_rows_keep_their_rules(monkeypatch, rows):
    """The common case costs what it cost: no call of a plain transformer climbs to a re-run (rows equal to the
    sequence length included), and the numbers are the loop's."""
    model = _Encoder()
    x, labels = torch.randn(rows, 4, WIDTH, dtype=DTYPE), torch.arange(rows) % 3
    G = _per_sample(model, x, labels)

    def no_rerun(*args, **kwargs):
        raise AssertionError("a call was re-run row by row: its rows were not recognised as the batch's")

    monkeypatch.setattr(hooks, "per_sample_grads", no_rerun)
    probe = _Probe(lambda step: True)
    _track(model, x, labels, [probe])
    torch.testing.assert_close(torch.as_tensor(probe.output[0]["diag"]), (G**2).sum(1) / rows**2, rtol=1e-10, atol=1e-16)


# ---- the walk itself, operation by operation ----------------------------------------------
B, T, D = 4, 3, 5


def _edges(root) -> dict[int, list]:
    edges, stack, seen = defaultdict(list), [root], {id(root)}
    while stack:
        node = stack.pop()
        for position, (child, nr) in enumerate(node.next_functions):
            if child is None:
                continue
            edges[id(child)].append((node, position, nr))
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return edges


_W = torch.randn(D, D, dtype=DTYPE)
_PERM = torch.tensor([2, 0, 3, 1])
KEPT = {
    "elementwise": lambda h: torch.tanh(h) * 2 + 1,
    "flatten_and_back": lambda h: (h.reshape(B * T, D) @ _W).reshape(B, T, D),
    "transpose_and_back": lambda h: h.transpose(0, 1).transpose(0, 1),
    "last_dims": lambda h: h.softmax(-1).cumsum(1).flip(2).mean(1),
    "matmul_first_operand": lambda h: h @ _W,
    "arange_index": lambda h: h[torch.arange(B), torch.tensor([0, 2, 1, 0])],
    "index_along_another_dim": lambda h: h[:, torch.tensor([2, 0])],
    "unsqueeze_select": lambda h: h.unsqueeze(0)[0],
    "cat_first": lambda h: torch.cat([h, torch.randn(2, T, D, dtype=DTYPE)], 0)[:B],
    "cat_other_dim": lambda h: torch.cat([h, h], -1),
    "index_add_identity": lambda h: torch.zeros(B, T, D, dtype=DTYPE).index_add(0, torch.arange(B), h),
    "to_a_number": lambda h: h.sum(),
    "linear_3d": lambda h: nn.functional.linear(h, _W, _W[0]),
    "added_to_a_product": lambda h: torch.addmm(h.reshape(B, T * D), torch.randn(B, 2, dtype=DTYPE), torch.randn(2, T * D, dtype=DTYPE)),
    "broadcast_from_the_right": lambda h: h[:, 0] + torch.zeros(B, D, dtype=DTYPE),
    "per_row_losses": lambda h: nn.functional.cross_entropy(h.mean(1), torch.arange(B) % D, reduction="none"),
}
BROKEN = {
    "gather_by_index": lambda h: h[_PERM],
    "index_add": lambda h: torch.zeros(B, T, D, dtype=DTYPE).index_add(0, _PERM, h),
    "index_select": lambda h: h.index_select(0, _PERM),
    "cat_second": lambda h: torch.cat([h * 2, h], 0)[B:],
    "flip": lambda h: h.flip(0),
    "roll": lambda h: h.roll(1, 0),
    "softmax_over_rows": lambda h: h.softmax(0),
    "batch_mean": lambda h: h - h.mean(0),
    "contracted": lambda h: torch.randn(B, B, dtype=DTYPE) @ h.reshape(B, T * D),
    "transposed": lambda h: h.transpose(0, 1),  # [T, B, D] at the model's output, whose rows are its dim 0
    "reshape_splitting_samples": lambda h: h.reshape(T, B, D),
    "second_split": lambda h: torch.cat([h, h]).split(B)[1],
    "masked_rows": lambda h: h[torch.tensor([True, False, True, True])],
    "sorted_rows": lambda h: h.sort(0)[0],
    "rows_as_weights": lambda h: nn.functional.linear(torch.randn(2, T * D, dtype=DTYPE), h.reshape(B, T * D)),
    "broadcast_in_front": lambda h: h[:, 0] + torch.zeros(B, B, D, dtype=DTYPE),
    "gram": lambda h: h.reshape(B, T * D) @ h.reshape(B, T * D).T,
}


@pytest.mark.parametrize("name", sorted(KEPT) + sorted(BROKEN))
def test_the_walk_knows_which_operations_keep_the_rows(name):
    h = torch.randn(B, T, D, dtype=DTYPE, requires_grad=True) * 1.0  # the rows of a call's output
    out = (KEPT.get(name) or BROKEN[name])(h)
    if out.dim() > 0:
        out = out * 1.0
    paths = RowPaths(_edges(out.grad_fn), {id(out.grad_fn): {0: 0}})
    broken = paths.broken([(h.grad_fn, 0, (0, 1))])
    if name in KEPT:
        assert broken is None, broken
    else:
        assert broken is not None


def test_an_output_the_loss_does_not_read_may_come_from_reordered_rows():
    """Outside trial 9: a model that also returns its own loss computed from the logits through a transpose and a
    view (ProphetNet called with labels=), which the user's per-row loss does not read: every step raised
    UncoveredParameterError ('ViewBackward0 (a reshape that splits the samples)'), though nothing of it reaches the
    loss. The walk now follows only what the loss depends on."""
    import torch.nn.functional as F

    from cockpit_like import Cockpit
    from cockpit_like.quantities import NormTest
    from cockpit_like.utils.schedules import linear

    class Own(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(5, 4)

        def forward(self, x, y):
            logits = self.layer(x)  # [B, S, C]
            own = F.cross_entropy(logits.transpose(0, 1).contiguous().view(-1, 4), y.transpose(0, 1).reshape(-1))
            return logits, own

    torch.manual_seed(0)
    model = Own().double()
    x, y = torch.randn(3, 2, 5, dtype=torch.float64), torch.randint(0, 4, (3, 2))
    cockpit = Cockpit(model.parameters(), quantities=[NormTest(linear(1))], model=model)
    logits, _ = model(x, y)
    losses = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
    with cockpit(0, info={"batch_size": 3, "individual_losses": losses, "loss": losses.mean()}):
        losses.mean().backward()
    rows = []
    for b in range(3):
        grads = torch.autograd.grad(
            F.cross_entropy(model.layer(x[b : b + 1]).transpose(1, 2), y[b : b + 1], reduction="none").mean(),
            list(model.parameters()))
        rows.append(torch.cat([g.flatten() for g in grads]))
    rows = torch.stack(rows)
    mean = rows.mean(0)
    expected = (((rows - mean) ** 2).sum() / (3 * 2) / (mean @ mean)).sqrt()  # sqrt(sum ||g_n - g||^2 / (B(B-1)) / ||g||^2)
    assert cockpit.get_output()[0]["NormTest"] == pytest.approx(float(expected), rel=1e-9)
