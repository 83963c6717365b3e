"""Any model (issue #13): every per-sample / first-order quantity against float64 brute force on the zoo.

The models of :mod:`tests.zoo` (GPT-2 with tied embeddings, a transformer
encoder, a LayerNorm/GELU MLP, a GRU, ResNets with GroupNorm and eval
BatchNorm, a custom layer with its own ``nn.Parameter``) plus two small
models defined here (one ``nn.Linear`` applied twice; a token-level model
whose loss is the mean over all tokens) are tracked **without**
``backpack.extend``: ``Cockpit(params, quantities, model=model)``.

References never come from cockpit_like: the per-sample gradients
``g_i`` (not divided by ``B``) are computed by
:func:`tests.zoo.per_sample_grads_loop`, one ``torch.autograd.grad`` per row
of the batch on a hook-free copy of the model, right before the step's
forward pass, and every statistic or quantity is evaluated from them by its
definition (the reference functions of the MLP/CNN tests are reused). A
sample is one row (one sequence).

Also: on the MLP and CNN of :mod:`tests.helpers` the hook backend
(``model=``, and discovery without ``model=``) gives BackPACK's numbers;
forward passes outside the step and partly frozen models; the
``business`` / ``full`` presets (curvature by Hutchinson, graph steps) on
every zoo model, and HessMaxEV against the eigenvalues of a dense Hessian.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from cockpit_like import Cockpit, context
from cockpit_like.backends.per_sample_stats import (
    AbsMax,
    DirectionalDots,
    GramSummary,
    Histogram1dCounts,
    Histogram2dCounts,
    SumOfSquares,
)
from cockpit_like.backends.step import is_extended
from cockpit_like.quantities import (
    CABS,
    Alpha,
    HessMaxEV,
    Distance,
    EarlyStopping,
    GradHist1d,
    GradHist2d,
    GradNorm,
    InnerTest,
    Loss,
    MeanGSNR,
    NormTest,
    OrthoTest,
    UpdateSize,
)
from cockpit_like.quantities.quantity import SingleStepQuantity
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests import helpers
from tests.test_alpha import reference_alpha
from tests.test_gradient_noise import reference as reference_noise
from tests.test_gradient_tests import reference_tests
from tests.test_histograms import ref_hist1d, ref_hist2d
from tests.test_per_sample_stats import _assert_same
from tests.zoo import DTYPE, ZOO, Problem, per_sample_grads_loop

pytestmark = [
    # torch.func has no batching rule for the CPU flash-attention kernel (the fallback still runs)
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    pytest.mark.filterwarnings("ignore:Full backward hook"),
    pytest.mark.filterwarnings("ignore:Using backward"),  # torch: create_graph=True and .grad form a cycle
]


# ---- two more models: a layer applied twice, a token-level loss --------------------------
class LinearTwice(nn.Module):
    """``out(tanh(shared(tanh(shared(tanh(inp(x)))))))``: ``shared`` runs twice per forward pass."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.shared = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


def _ce(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def linear_twice(seed: int = 0) -> Problem:
    torch.manual_seed(seed)

    def batch(size, seed):
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(size, 5, generator=generator, dtype=DTYPE)
        return inputs, torch.randint(0, 3, (size,), generator=generator)

    return Problem(LinearTwice().to(DTYPE), batch, _ce)


TOKENS, VOCAB, CLASSES = 5, 20, 3


class TokenTagger(nn.Module):
    """Per token: embedding, ``Linear(16, 16)`` + tanh, ``Linear(16, 3)`` (logits ``[B, T, 3]``).

    With ``T = 5`` the first linear layer's per-sample Gram summary takes the
    ``T x T`` route (``T (R + C) < R C``), the second the dense one.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def token_row_losses(logits, tags):
    """Per row: the mean of its tokens' cross-entropies (``[B]``)."""
    return nn.functional.cross_entropy(logits.transpose(1, 2), tags, reduction="none").mean(1)


def token_mean_loss(logits, tags):
    """The mini-batch loss as people write it: the mean over all ``B * T`` tokens."""
    return nn.functional.cross_entropy(logits.reshape(-1, CLASSES), tags.reshape(-1))


def token_tagger(seed: int = 0) -> Problem:
    torch.manual_seed(seed)

    def batch(size, seed):
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (size, TOKENS), generator=generator)
        return tokens, torch.randint(0, CLASSES, (size, TOKENS), generator=generator)

    return Problem(TokenTagger().to(DTYPE), batch, token_row_losses)


EXTRA = {"linear_twice": linear_twice, "token_tagger": token_tagger}
ALL = {**ZOO, **EXTRA}
HEAVY = {"gpt2"}  # transformers import and the biggest model: a few seconds


def _params(names):
    return [pytest.param(name, marks=pytest.mark.slow) if name in HEAVY else name for name in names]


BATCH = 5
LR = 0.1
STEPS = 3
HIST1D = dict(bins=21, range=(-0.5, 0.5))  # odd bins: zero (frozen entries) is a bin centre, not an edge
HIST2D = dict(bins=(7, 9), range=((-0.35, 0.35), (-0.9, 0.9)))


def trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


# ---- brute force ---------------------------------------------------------------------------
def brute_force(problem: Problem, inputs, targets) -> list[torch.Tensor]:
    """``g_i`` of every trainable parameter by :func:`per_sample_grads_loop`, on a hook-free copy of the model.

    The copy keeps the cockpit from seeing the loop's forward passes (they are
    tested on their own in :func:`test_forward_passes_outside_the_step`).
    """
    copy = dataclasses.replace(problem, model=helpers.plain_copy(problem.model))
    return per_sample_grads_loop(copy, inputs, targets, trainable(copy.model))


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads], 1)


def _near_edges(values: np.ndarray, bins: int, lo: float, hi: float, eps: float) -> int:
    """How many values lie within ``eps`` of an interior bin edge (their bin depends on rounding)."""
    edges = lo + (hi - lo) * np.arange(1, bins) / bins
    distance = np.abs(values.reshape(-1, 1) - edges.reshape(1, -1)).min(1)
    return int((distance < eps).sum())


def _eps(grads) -> float:
    return 1e-9 * max(1.0, max(g.abs().max().item() for g in grads))


def assert_hist1d(counts, grads, bins, range_):
    """Counts of all ``g_i`` entries, exact but for entries within rounding of a bin edge."""
    values = np.concatenate([g.reshape(-1).numpy() for g in grads])
    expected = ref_hist1d(values, bins, *range_)
    counts = np.asarray(counts)
    assert counts.sum() == values.size
    off = int(np.abs(counts - expected).sum())
    assert off <= 2 * _near_edges(values, bins, *range_, _eps(grads)), (counts, expected)


def assert_hist2d(counts, grads, params, bins, ranges):
    """Per block: counts of the pairs ``(g_{i,p,j}, theta_{p,j})``."""
    eps = _eps(grads)
    for index, (got, g, p) in enumerate(zip(counts, grads, params)):
        x = g.reshape(-1).numpy()
        y = p.detach().unsqueeze(0).expand_as(g).reshape(-1).numpy()
        expected = ref_hist2d(x, y, bins, ranges)
        got = np.asarray(got)
        assert got.shape == tuple(bins) and got.sum() == x.size
        ambiguous = _near_edges(x, bins[0], *ranges[0], eps) + _near_edges(y, bins[1], *ranges[1], eps)
        assert int(np.abs(got - expected).sum()) <= 2 * ambiguous, f"block {index}"


def assert_close(actual, expected, rtol=1e-10, scale=None):
    """Relative closeness, with an absolute floor at ``1e-12 * scale`` for entries that cancel to ~0."""
    expected = torch.as_tensor(expected, dtype=DTYPE)
    actual = torch.as_tensor(actual, dtype=DTYPE)
    scale = expected.abs().max().item() if scale is None else scale
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-12 * max(scale, 1e-300))


# ---- running the cockpit on a problem --------------------------------------------------------
def run_problem(
    name,
    make_quantities,
    steps=STEPS,
    batch_size=BATCH,
    info_batch_size=True,
    loss_fn=None,
    extra_forward=False,
    freeze=None,
    factories=None,
):
    """Train ``steps`` SGD steps with the cockpit (model not extended, ``model=model``).

    Before each step's forward pass the brute-force per-sample gradients, the
    parameters and the losses are recorded. ``loss_fn(outputs, targets)``
    gives the mini-batch loss (default: the mean of the problem's per-row losses).
    ``extra_forward``: before the step's forward pass, also run forward passes
    with gradients enabled that are never backpropagated (a "validation" batch
    of the same size, and the brute-force loop on the live model).
    ``freeze(parameter name)``: parameters to set ``requires_grad=False`` (not tracked).
    ``factories``: where ``name`` is looked up (default: :data:`ALL`). Each step also
    records the outputs of the step's forward pass and those of a hook-free copy
    (``"outputs"``, ``"outputs_without_cockpit"``; the copy runs with the math
    attention kernel on steps that need the graph, as the cockpit's forward pass does).
    """
    problem = (ALL if factories is None else factories)[name](0)
    model = problem.model
    if freeze is not None:
        for parameter_name, param in model.named_parameters():
            if freeze(parameter_name):
                param.requires_grad_(False)
    params = trainable(model)
    quantities = make_quantities(params)
    cockpit = Cockpit(params, quantities, model=model)
    optimizer = torch.optim.SGD(params, lr=LR)
    observed = {}
    for step in range(steps):
        inputs, targets = problem.batch(batch_size, 100 + step)
        grads = brute_force(problem, inputs, targets)
        if extra_forward:
            problem.forward(model, problem.batch(batch_size, 999)[0])
            per_sample_grads_loop(problem, inputs, targets, params)
        optimizer.zero_grad()
        without = _forward_without_cockpit(problem, inputs, graph=cockpit.create_graph(step))
        outputs = problem.forward(model, inputs)
        losses = problem.sample_losses(outputs, targets)
        loss = losses.mean() if loss_fn is None else loss_fn(outputs, targets)
        observed[step] = {
            "params": [p.detach().clone() for p in params],
            "grads": grads,
            "loss": loss.item(),
            "losses": losses.detach().clone(),
            "outputs": _tensors(outputs),
            "outputs_without_cockpit": without,
        }
        info = {"loss": loss, "individual_losses": losses, "optimizer": optimizer}
        if info_batch_size:
            info["batch_size"] = batch_size
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    assert not any(is_extended(m) for m in model.modules())
    return cockpit, quantities, observed


def _forward_without_cockpit(problem: Problem, inputs, graph: bool) -> torch.Tensor:
    """The output tensors of a hook-free copy of the model on ``inputs`` (math attention kernel if ``graph``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    copy = helpers.plain_copy(problem.model)
    kernel = sdpa_kernel([SDPBackend.MATH]) if graph else contextlib.nullcontext()
    with kernel:  # with gradients, as the step's forward pass
        return _tensors(problem.forward(copy, inputs))


def _tensors(outputs) -> list[torch.Tensor]:
    """Every tensor in a model's outputs (a tensor, a tuple, a Hugging Face ``ModelOutput``), detached."""
    from torch.utils._pytree import tree_flatten

    return [leaf.detach().clone() for leaf in tree_flatten(outputs)[0] if isinstance(leaf, torch.Tensor)]


class StatsProbe(SingleStepQuantity):
    """Asks for per-sample statistics and keeps their raw results (stores nothing itself)."""

    def __init__(self, track_schedule, stats):
        super().__init__(track_schedule)
        self.stats = list(stats)
        self.results = {}

    def per_sample_stats(self, global_step):
        return list(self.stats) if self.should_compute(global_step) else []

    def _compute(self, global_step, params, batch_loss):
        record = context.get_record(global_step)
        self.results[global_step] = {stat: record.stat(stat) for stat in self.stats}
        return None


# ---- the per-sample statistics ---------------------------------------------------------------
@pytest.mark.parametrize("name", _params(ALL))
def test_per_sample_statistics_match_loop(name):
    directions = {}

    def make(params):
        generator = torch.Generator().manual_seed(7)
        direction = tuple(torch.randn(p.shape, generator=generator, dtype=DTYPE) for p in params)
        directions["d"] = direction
        stats = [
            GramSummary(),
            SumOfSquares(),
            AbsMax(),
            DirectionalDots("probe", direction),
            Histogram1dCounts(HIST1D["bins"], HIST1D["range"]),
            Histogram2dCounts(HIST2D["bins"], HIST2D["range"]),
        ]
        return [StatsProbe(linear(1), stats)]

    # no info["batch_size"]: the hook backend reads B from each call's inputs
    _, (probe,), observed = run_problem(name, make, steps=2, info_batch_size=False)
    assert sorted(probe.results) == [0, 1]
    d_flat = torch.cat([d.reshape(-1) for d in directions["d"]])
    for step, results in probe.results.items():
        grads, params = observed[step]["grads"], observed[step]["params"]
        grad_batch = _flat(grads) / BATCH  # BackPACK's scaling for a mean loss
        gram = grad_batch @ grad_batch.T
        diag, row_sums = results[GramSummary()]
        assert_close(diag, torch.diagonal(gram))
        assert_close(row_sums, gram.sum(1), scale=gram.abs().max().item())
        squares = results[SumOfSquares()]
        assert len(squares) == len(params)
        for s, g, p in zip(squares, grads, params):
            assert s.shape == p.shape
            assert_close(s, (g / BATCH).square().sum(0), scale=(g / BATCH).square().max().item())
        value, batch = results[AbsMax()]
        assert batch == BATCH
        assert batch * value.item() == pytest.approx(max(g.abs().max().item() for g in grads), rel=1e-10)
        dots = grad_batch @ d_flat
        assert_close(results[DirectionalDots("probe")], dots, scale=dots.abs().max().item())
        assert_hist1d(results[Histogram1dCounts(HIST1D["bins"], HIST1D["range"])], grads, HIST1D["bins"], HIST1D["range"])
        counts2d = results[Histogram2dCounts(HIST2D["bins"], HIST2D["range"])]
        assert len(counts2d) == len(params)
        assert_hist2d(counts2d, grads, params, HIST2D["bins"], HIST2D["range"])


# ---- quantity level: one run per model, shared by the tests below ------------------------------
def _all_quantities(params):
    schedule = linear(1)
    return [
        Loss(schedule),
        GradNorm(schedule),
        NormTest(schedule),
        InnerTest(schedule),
        OrthoTest(schedule),
        MeanGSNR(schedule),
        CABS(schedule),
        EarlyStopping(schedule),
        GradHist1d(schedule, **HIST1D),
        GradHist2d(schedule, keep_individual=True, **HIST2D),
        Distance(schedule),
        UpdateSize(schedule),
        Alpha(schedule),
    ]


@pytest.fixture(scope="module", params=_params(ALL))
def tracked(request):
    """``(name, {class name: output}, observed)`` after STEPS steps with every quantity."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit, quantities, observed = run_problem(request.param, _all_quantities)
    assert not [w for w in caught if "cockpit_like" in str(w.message) or "Alpha" in str(w.message)], [
        str(w.message) for w in caught
    ]
    outputs = {type(q).__name__: q.get_output() for q in quantities}
    assert set(cockpit.get_output()[0]) - {"checks"} == set(outputs)
    return request.param, outputs, observed


def test_loss_and_grad_norm(tracked):
    name, out, observed = tracked
    assert sorted(out["Loss"]) == sorted(out["GradNorm"]) == list(range(STEPS))
    for step, obs in observed.items():
        for got, want in zip(obs["outputs"], obs["outputs_without_cockpit"], strict=True):  # never changed
            assert got.shape == want.shape and torch.equal(got, want), step
        assert out["Loss"][step] == pytest.approx(obs["losses"].mean().item(), rel=1e-12)
        mean_grads = [g.mean(0) for g in obs["grads"]]  # (1/B) sum_i g_i from the loop
        assert len(out["GradNorm"][step]) == len(obs["params"])
        for value, g in zip(out["GradNorm"][step], mean_grads):
            assert value == pytest.approx(g.norm().item(), rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("quantity", ["NormTest", "InnerTest", "OrthoTest"])
def test_gradient_tests(tracked, quantity):
    name, out, observed = tracked
    assert sorted(out[quantity]) == list(range(STEPS))
    for step, obs in observed.items():
        expected = reference_tests(obs["grads"])[quantity]
        assert isinstance(out[quantity][step], float)
        assert out[quantity][step] == pytest.approx(expected, rel=1e-9), step


@pytest.mark.parametrize("quantity", ["MeanGSNR", "CABS", "EarlyStopping"])
def test_gradient_noise(tracked, quantity):
    name, out, observed = tracked
    assert sorted(out[quantity]) == list(range(STEPS))
    for step, obs in observed.items():
        expected = reference_noise(obs["grads"], obs["loss"], LR)[quantity]
        assert isinstance(out[quantity][step], float)
        assert out[quantity][step] == pytest.approx(expected, rel=1e-8, abs=1e-12), step


def test_histograms(tracked):
    name, out, observed = tracked
    assert sorted(out["GradHist1d"]) == sorted(out["GradHist2d"]) == list(range(STEPS))
    for step, obs in observed.items():
        grads, params = obs["grads"], obs["params"]
        hist1d = out["GradHist1d"][step]
        assert_hist1d(hist1d["hist"], grads, HIST1D["bins"], HIST1D["range"])
        np.testing.assert_allclose(hist1d["edges"], np.linspace(*HIST1D["range"], HIST1D["bins"] + 1), atol=1e-7)
        hist2d = out["GradHist2d"][step]
        assert hist2d["param_groups"] == len(params)
        blocks = [hist2d[f"param_{i}"]["hist"] for i in range(len(params))]
        assert_hist2d(blocks, grads, params, HIST2D["bins"], HIST2D["range"])
        np.testing.assert_array_equal(hist2d["hist"], sum(blocks))


def test_distance_and_update_size(tracked):
    name, out, observed = tracked
    assert sorted(out["Distance"]) == list(range(STEPS))
    assert sorted(out["UpdateSize"]) == list(range(STEPS - 1))
    for step, obs in observed.items():
        first = observed[0]["params"]
        distance = [(p - p0).norm().item() for p, p0 in zip(obs["params"], first)]
        assert out["Distance"][step] == pytest.approx(distance, rel=1e-12, abs=1e-15)
        if step + 1 < STEPS:
            update = [(b - a).norm().item() for a, b in zip(obs["params"], observed[step + 1]["params"])]
            assert out["UpdateSize"][step] == pytest.approx(update, rel=1e-10, abs=1e-15)
            # plain SGD: the update is -lr times the loop's mean gradient
            expected = [LR * g.mean(0).norm().item() for g in obs["grads"]]
            assert out["UpdateSize"][step] == pytest.approx(expected, rel=1e-10, abs=1e-15)


def test_alpha_two_sgd_steps(tracked):
    name, out, observed = tracked
    assert sorted(out["Alpha"]) == list(range(STEPS - 1))
    for step, value in out["Alpha"].items():
        expected = reference_alpha(observed[step], observed[step + 1], BATCH)
        assert float(value) == pytest.approx(expected, rel=1e-8, abs=1e-10), step


# ---- the economy preset on every model ------------------------------------------------------------
ECONOMY = sorted(["Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest", "OrthoTest", "UpdateSize"])


def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, np.ndarray):
        return bool(np.isfinite(value).all())
    return math.isfinite(float(value))


@pytest.mark.parametrize("name", _params(ZOO))
def test_economy_preset_runs(name):
    cockpit, quantities, observed = run_problem(name, lambda params: configuration("economy"))
    assert sorted(type(q).__name__ for q in quantities) == ECONOMY
    out = cockpit.get_output()
    assert sorted(out) == list(range(STEPS))
    for step in range(STEPS):
        expected = set(ECONOMY) - ({"Alpha", "UpdateSize"} if step == STEPS - 1 else set())
        assert set(out[step]) - {"checks"} == expected, step
        for key, value in out[step].items():
            assert _finite(value), (step, key)
        total = sum(g[0].numel() for g in observed[step]["grads"]) * BATCH
        assert out[step]["GradHist1d"]["hist"].sum() == total
        assert out[step]["NormTest"] == pytest.approx(reference_tests(observed[step]["grads"])["NormTest"], rel=1e-9)


# ---- MLP / CNN: hooks (with model=, or discovered) give BackPACK's numbers ---------------------------
def _parity_quantities():
    return configuration("economy") + [GradHist2d(linear(1))]


def _parity_run(problem, mode):
    if mode == "backpack":
        model, lossfunc, individual = helpers.make_problem(problem)
        cockpit = Cockpit(model.parameters(), _parity_quantities())
    else:
        model = helpers.PROBLEMS[problem][0](bias=True, seed=0)
        lossfunc, individual = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none")
        kwargs = {"model": model} if mode == "hooks" else {}
        cockpit = Cockpit(model.parameters(), _parity_quantities(), **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    helpers.train(model, lossfunc, individual, cockpit, problem, 4, 6, optimizer)
    assert any(is_extended(m) for m in model.modules()) == (mode == "backpack")
    return cockpit.get_output()


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_hooks_match_backpack(problem):
    reference = _parity_run(problem, "backpack")
    assert sorted(reference) == [0, 1, 2, 3]
    assert set(reference[0]) - {"checks"} == set(ECONOMY) | {"GradHist2d"}
    for mode in ("hooks", "discovery"):
        output = _parity_run(problem, mode)
        assert output.keys() == reference.keys(), mode
        for step in reference:
            assert output[step].keys() == reference[step].keys(), (mode, step)
            for key in reference[step]:
                if key == "Time":
                    continue
                _assert_same(output[step][key], reference[step][key])


# ---- weight tying: one layer applied twice --------------------------------------------------------
def test_layer_applied_twice():
    """``shared`` gets the sum of its two calls' per-sample gradients (checked on the raw gradients too)."""
    problem = linear_twice(0)
    model, params = problem.model, trainable(problem.model)
    quantities = [NormTest(linear(1)), StatsProbe(linear(1), [GramSummary(), SumOfSquares()])]
    cockpit = Cockpit(params, quantities, model=model)
    inputs, targets = problem.batch(BATCH, 3)
    grads = brute_force(problem, inputs, targets)
    assert grads[2].abs().max() > 1e-3  # the shared weight's gradient is not trivial
    losses = problem.sample_losses(problem.forward(model, inputs), targets)
    loss = losses.mean()
    with cockpit(0, info={"loss": loss, "batch_size": BATCH}):
        loss.backward()
    assert quantities[0].get_output()[0] == pytest.approx(reference_tests(grads)["NormTest"], rel=1e-10)
    results = quantities[1].results[0]
    for s, g in zip(results[SumOfSquares()], grads):
        assert_close(s, (g / BATCH).square().sum(0))
    grad_batch = _flat(grads) / BATCH
    assert_close(results[GramSummary()][0], (grad_batch**2).sum(1))


# ---- a mean loss over the tokens of equal-length sequences -------------------------------------------
def test_token_mean_loss_norm_test():
    """The loss is the mean over all ``B * T`` tokens; a sample is a row (the mean over its tokens)."""
    quantities = lambda params: [NormTest(linear(1)), InnerTest(linear(1)), OrthoTest(linear(1))]  # noqa: E731
    cockpit, made, observed = run_problem("token_tagger", quantities, loss_fn=token_mean_loss)
    out = made[0].get_output()
    assert sorted(out) == list(range(STEPS))
    for step, obs in observed.items():
        assert obs["loss"] == pytest.approx(obs["losses"].mean().item(), rel=1e-12)  # equal lengths
        expected = reference_tests(obs["grads"])
        for quantity in made:
            value = quantity.get_output()[step]
            assert value == pytest.approx(expected[type(quantity).__name__], rel=1e-9)
        # the per-token test is another number: the check tells rows from tokens
        tokens_as_samples = _per_token_norm_test(obs["params"], step)
        assert abs(out[step] / tokens_as_samples - 1) > 1e-3


def _per_token_norm_test(params, step):
    problem = token_tagger(0)
    with torch.no_grad():
        for p, value in zip(problem.model.parameters(), params):
            p.copy_(value)
    tokens, tags = problem.batch(BATCH, 100 + step)
    rows = [(tokens[i : i + 1], tags[i : i + 1, t : t + 1], t) for i in range(BATCH) for t in range(TOKENS)]
    per_token = []
    for x, y, t in rows:
        logits = problem.model(x)[:, t : t + 1]
        loss = nn.functional.cross_entropy(logits.transpose(1, 2), y).sum()
        per_token.append(torch.autograd.grad(loss, list(problem.model.parameters())))
    grads = [torch.stack([g[k] for g in per_token]) for k in range(len(per_token[0]))]
    return reference_tests(grads)["NormTest"]


# ---- forward passes the cockpit's backward pass does not contain -----------------------------------
@pytest.mark.parametrize("name", _params(ALL))
def test_forward_passes_outside_the_step(name):
    """Forward passes with gradients that are never backpropagated (validation without ``no_grad``,
    the brute-force loop on the live model) between two steps leave the numbers unchanged."""
    make = lambda params: [NormTest(linear(1)), MeanGSNR(linear(1)), GradHist1d(linear(1), **HIST1D)]  # noqa: E731
    _, made, observed = run_problem(name, make, steps=2, extra_forward=True)
    for step, obs in observed.items():
        grads = obs["grads"]
        assert made[0].get_output()[step] == pytest.approx(reference_tests(grads)["NormTest"], rel=1e-9)
        assert made[1].get_output()[step] == pytest.approx(reference_noise(grads, obs["loss"], LR)["MeanGSNR"], rel=1e-8)
        assert_hist1d(made[2].get_output()[step]["hist"], grads, HIST1D["bins"], HIST1D["range"])


def _reduction_forms(monkeypatch, name, extra_forward):
    """``[(reducer method, parameter shape)]`` in the order the hook backend fed the reducer."""
    from cockpit_like.backends.per_sample import PerSampleReducer

    seen = []
    for method in ("reduce_factors", "reduce_sequence", "reduce_grad_batch"):
        original = getattr(PerSampleReducer, method)

        def spy(self, param, *args, _method=method, _original=original):
            seen.append((_method, tuple(param.shape)))
            return _original(self, param, *args)

        monkeypatch.setattr(PerSampleReducer, method, spy)
    run_problem(name, lambda params: [NormTest(linear(1))], steps=1, extra_forward=extra_forward)
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("name", ["layernorm_mlp", "token_tagger"])
def test_forward_passes_outside_the_step_keep_the_layerwise_forms(monkeypatch, name):
    """Calls of forward passes the loss does not depend on are not counted as uses (graph reachability)."""
    clean = _reduction_forms(monkeypatch, name, extra_forward=False)
    assert any(method != "reduce_grad_batch" for method, _ in clean)  # factor / sequence forms exist
    assert _reduction_forms(monkeypatch, name, extra_forward=True) == clean


# ---- tracking part of a model (the rest frozen) --------------------------------------------------------
# MultiheadAttention uses out_proj's weight directly: with in_proj frozen it owns no tracked parameter,
# and its calls must still be recorded for out_proj's per-sample gradients
PARTIAL = [
    pytest.param("encoder", lambda n: "in_proj" in n, id="encoder-in_proj_frozen"),
    pytest.param("encoder", lambda n: "out_proj" not in n, id="encoder-only_out_proj"),
    pytest.param("encoder", lambda n: n.startswith(("embed", "head")), id="encoder-only_encoder"),
    pytest.param("gpt2", lambda n: "wte" in n or ".h.0." in n, marks=pytest.mark.slow, id="gpt2-tied_embedding_frozen"),
    pytest.param("gru", lambda n: "embed" in n, id="gru-embedding_frozen"),
    pytest.param("custom", lambda n: "mix" in n or n.startswith("0."), id="custom-part_of_custom_layer"),
    pytest.param("resnet_batchnorm_eval", lambda n: "conv" in n or "stem" in n, id="resnet_bn-only_norms_and_head"),
]


@pytest.mark.parametrize("name,freeze", PARTIAL)
def test_part_of_the_model_tracked(name, freeze):
    make = lambda params: [NormTest(linear(1)), MeanGSNR(linear(1)), GradHist1d(linear(1), **HIST1D)]  # noqa: E731
    cockpit, made, observed = run_problem(name, make, steps=2, freeze=freeze)
    assert 0 < len(cockpit.params) < len(list(ALL[name](0).model.parameters()))
    for step, obs in observed.items():
        grads = obs["grads"]
        assert made[0].get_output()[step] == pytest.approx(reference_tests(grads)["NormTest"], rel=1e-9)
        assert made[1].get_output()[step] == pytest.approx(reference_noise(grads, obs["loss"], LR)["MeanGSNR"], rel=1e-8)
        assert_hist1d(made[2].get_output()[step]["hist"], grads, HIST1D["bins"], HIST1D["range"])


# ---- curvature on any model: the business and full presets, HessMaxEV against a dense Hessian ------------
PRESET_NAMES = {
    "business": ECONOMY + ["HessTrace", "TICDiag"],
    "full": ECONOMY + ["GradHist2d", "HessMaxEV", "HessTrace", "TICDiag"],
}


@pytest.mark.parametrize("label", ["business", "full"])
@pytest.mark.parametrize("name", _params(ZOO))
def test_curvature_presets_run(name, label):
    """``loss.backward(create_graph=cockpit.create_graph(step))``: every value finite, the
    curvature diagonals by Hutchinson (no model is extended), and the graph leaves the
    per-sample quantities and the gradient as the brute force has them."""
    torch.manual_seed(0)
    cockpit, quantities, observed = run_problem(name, lambda params: configuration(label))
    assert sorted(type(q).__name__ for q in quantities) == sorted(PRESET_NAMES[label])
    assert cockpit.create_graph(0)
    out = cockpit.get_output()
    assert sorted(out) == list(range(STEPS))
    for step, obs in observed.items():
        expected = set(PRESET_NAMES[label]) - ({"Alpha", "UpdateSize"} if step == STEPS - 1 else set())
        if quantities_of(cockpit, "TICDiag") and quantities_of(cockpit, "TICDiag")[0].method == "ggn":
            expected -= {"TICDiag"}  # no info["outputs"]: no positive curvature to divide by, no value (a note)
        assert set(out[step]) - {"checks"} == expected, step
        for key, value in out[step].items():
            assert key == "checks" or _finite(value), (step, key)  # checks: notes (math attention, error bars)
        assert len(out[step]["HessTrace"]) == len(obs["params"])
        grads = obs["grads"]
        for value, g in zip(out[step]["GradNorm"], grads):
            assert value == pytest.approx(g.mean(0).norm().item(), rel=1e-10, abs=1e-14)
        for test in ("NormTest", "InnerTest", "OrthoTest"):
            assert out[step][test] == pytest.approx(reference_tests(grads)[test], rel=1e-9)
        assert_hist1d(out[step]["GradHist1d"]["hist"], grads, 100, (-2.0, 2.0))
        if step + 1 < STEPS:
            assert out[step]["Alpha"] == pytest.approx(reference_alpha(obs, observed[step + 1], BATCH), rel=1e-8, abs=1e-10)
    settings = {q["name"]: q["settings"] for q in cockpit.metadata()["quantities"]}
    assert settings["HessTrace"]["computed_with"] == "hutchinson"
    assert settings["TICDiag"]["computed_with"] == "ggn"  # TIC divides by the GGN (issue 37); no outputs: Hutchinson


def dense_hessian(problem: Problem, inputs, targets) -> torch.Tensor:
    """The Hessian of the mean loss w.r.t. the trainable parameters (flattened in order).

    Reverse over reverse with autograd (``torch.autograd.functional.hessian``): in this
    torch, ``torch.func.hessian`` and ``jacrev(jacrev(...))`` are wrong through
    ``LayerNorm`` (asymmetric, 0.16 off on ``layernorm_mlp``; see tests/test_hutchinson.py).
    Checked here against a finite difference of gradients.
    """
    model = helpers.plain_copy(problem.model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names, shapes = [n for n, _ in named], [p.shape for _, p in named]
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])

    def loss(vector):
        pieces = vector.split([math.prod(s) for s in shapes])
        values = {n: piece.reshape(s) for n, piece, s in zip(names, pieces, shapes)}
        return problem.sample_losses(functional_call(model, values, (inputs,)), targets).mean()

    dense = torch.autograd.functional.hessian(loss, flat, vectorize=True)
    torch.testing.assert_close(dense, dense.T, rtol=1e-10, atol=1e-12)
    v = torch.randn(flat.shape, dtype=flat.dtype, generator=torch.Generator().manual_seed(1))

    def gradient(vector):
        vector = vector.clone().requires_grad_()
        return torch.autograd.grad(loss(vector), vector)[0]

    finite = (gradient(flat + 1e-6 * v) - gradient(flat - 1e-6 * v)) / 2e-6
    torch.testing.assert_close(dense @ v, finite, rtol=1e-6, atol=1e-7)
    return dense


SMALL = ["layernorm_mlp", "custom", "gru", "resnet_batchnorm_eval", "linear_twice"]


@pytest.mark.parametrize("name", SMALL)
def test_hess_max_ev_matches_dense_hessian(name):
    problem = ALL[name](0)
    model = problem.model
    params = trainable(model)
    inputs, targets = problem.batch(4, 11)
    eigenvalues = torch.linalg.eigvalsh(dense_hessian(problem, inputs, targets))
    largest_magnitude = eigenvalues[eigenvalues.abs().argmax()].item()
    power, lanczos = HessMaxEV(linear(1)), HessMaxEV(linear(1), use_power=False, rtol=1e-6)
    cockpit = Cockpit(params, [power, lanczos], model=model)
    torch.manual_seed(0)
    loss = problem.sample_losses(problem.forward(model, inputs), targets).mean()
    with cockpit(0, info={"loss": loss}):
        loss.backward(create_graph=cockpit.create_graph(0))
    # the power iteration's target, the eigenvalue of largest magnitude, within 1% at the default tolerance
    assert power.get_output()[0] == pytest.approx(largest_magnitude, rel=1e-2)
    # the largest algebraic eigenvalue, to a tight tolerance
    assert lanczos.get_output()[0] == pytest.approx(eigenvalues[-1].item(), rel=1e-5)


def quantities_of(cockpit, name):
    """The cockpit's quantities of class ``name``."""
    return [q for q in cockpit.quantities if type(q).__name__ == name]
