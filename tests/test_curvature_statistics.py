"""Logged curvature statistics (cockpit_like.statistics) and the quantities on them, against independent references.

References: curvlinops' KFACLinearOperator / EKFACLinearOperator (empirical
Fisher, KFAC-expand, float64; a test-only oracle), per-sample gradients from
a loop of torch.autograd.grad, dense matrices and torch.linalg.solve.
"""

import json
import math
import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.ihvp import ihvp_ekfac, ihvp_kfac
from cockpit_like.quantities import CurvatureStatistics, EKFACSpectrum, PreconditionedGradNorm, SelfInfluence
from cockpit_like.statistics import (
    Covariance,
    KroneckerEigenvalues,
    Log,
    Mean,
    NotLoggedError,
    Statistic,
    StatisticsMergeError,
    StatisticsPlan,
    finalize_logs,
    layer_curvatures,
    merge_logs,
    parse_statistics,
)
from cockpit_like.utils.schedules import linear
from tests.helpers import make_cnn, make_mlp

curvlinops = pytest.importorskip("curvlinops")
from curvlinops import EKFACLinearOperator, KFACLinearOperator  # noqa: E402
from curvlinops.kfac import FisherType, KFACType  # noqa: E402

DT = torch.float64


class TinyTransformer(nn.Module):
    """One attention block of nn.Linear layers on [B, T, 3] inputs, mean-pooled, 3 classes (curvlinops sees every layer)."""

    def __init__(self, d_in=3, width=4, classes=3):
        super().__init__()
        self.embed = nn.Linear(d_in, width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        attention = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5, dim=-1)
        h = self.norm(h + self.o(attention @ self.v(h)))
        h = h + self.down(torch.tanh(self.up(h)))
        return self.head(h.mean(1))


def _problem(name, batch=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if name == "mlp":
        model, shape, classes = make_mlp(seed=seed), (3, 4), 4
    elif name == "cnn":
        model, shape, classes = make_cnn(seed=seed), (2, 6, 6), 5
    else:
        torch.manual_seed(seed)
        model, shape, classes = TinyTransformer().to(DT), (5, 3), 3
    inputs = torch.randn(batch, *shape, generator=generator, dtype=DT)
    labels = torch.randint(0, classes, (batch,), generator=generator)
    return model, inputs, labels


def _step(quantities, model, inputs, labels, step=0, info=None, cockpit=None):
    cockpit = cockpit or Cockpit(list(model.parameters()), quantities=quantities, model=model)
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(inputs), labels)
    with cockpit(step, info={"batch_size": len(inputs), "loss": loss, **(info or {})}):
        loss.backward()
    return cockpit


def _curvlinops_dense(kind, model, inputs, labels):
    params = list(model.parameters())
    cls = KFACLinearOperator if kind == "kfac" else EKFACLinearOperator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op = cls(model, nn.CrossEntropyLoss(), params, [(inputs, labels)], fisher_type=FisherType.EMPIRICAL,
                 kfac_approx=KFACType.EXPAND, check_deterministic=False)  # fmt: skip
        return op @ torch.eye(sum(p.numel() for p in params), dtype=DT)


def _per_sample_grads(model, inputs, labels, params):
    """[B, D] gradients of each sample's loss (a loop of autograd)."""
    rows = []
    for x, y in zip(inputs, labels):
        loss = nn.functional.cross_entropy(model(x.unsqueeze(0)), y.unsqueeze(0))
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


# ---- KFAC / EK-FAC against curvlinops -------------------------------------------------------
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_operator_matches_curvlinops(name, kind):
    model, inputs, labels = _problem(name)
    quantity = CurvatureStatistics(linear(1), statistics=kind)
    cockpit = _step([quantity], model, inputs, labels)
    operator = cockpit.curvature(kind=kind)
    reference = _curvlinops_dense(kind, model, inputs, labels)
    assert operator.names == [f"{n}" for n, _ in model.named_parameters()]  # every layer covered, in param order
    torch.testing.assert_close(operator.to_dense(), reference, rtol=1e-9, atol=1e-12)


def test_exact_case_one_linear_layer_mse():
    """One linear layer, MSE, every sample with the same input: the empirical Fisher is exactly G ⊗ A (and EK-FAC)."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2, bias=False).to(DT)
    batch = 5
    inputs = torch.randn(1, 3, dtype=DT).expand(batch, 3).clone()
    targets = torch.randn(batch, 2, dtype=DT)
    rows = []
    for x, t in zip(inputs, targets):
        loss = ((layer(x) - t) ** 2).sum() / 2
        rows.append(torch.autograd.grad(loss, layer.weight)[0].reshape(-1))
    grads = torch.stack(rows)
    fisher = grads.T @ grads / batch  # (1/B) sum_n g_n g_n^T, brute force
    for kind in ("kfac", "ekfac"):
        quantity = CurvatureStatistics(linear(1), statistics=kind)
        cockpit = Cockpit([layer.weight], quantities=[quantity], model=layer)
        loss = ((layer(inputs) - targets) ** 2).sum(1).mean() / 2
        with cockpit(0, info={"batch_size": batch, "loss": loss}):
            loss.backward()
        torch.testing.assert_close(cockpit.curvature(kind=kind).to_dense(), fisher, rtol=1e-10, atol=1e-13)
        layer.zero_grad()


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_ihvp_and_damped_operator_on_cockpit_factors_match_solve(kind):
    model, inputs, labels = _problem("cnn")
    quantity = CurvatureStatistics(linear(1), statistics=kind)
    cockpit = _step([quantity], model, inputs, labels)
    params = list(model.parameters())
    dense = cockpit.curvature(kind=kind).to_dense()
    damping = 1e-2
    shifted = dense + damping * torch.eye(len(dense), dtype=DT)
    torch.testing.assert_close(cockpit.curvature(kind=kind, damping=damping).to_dense(), shifted, rtol=1e-9, atol=1e-12)
    records, covered = layer_curvatures(quantity.plan, params, kind)
    inverse = (ihvp_ekfac if kind == "ekfac" else ihvp_kfac)(records, damping, params=covered)
    vectors = torch.randn(3, len(dense), dtype=DT, generator=torch.Generator().manual_seed(1))
    expected = torch.linalg.solve(shifted, vectors.T).T
    torch.testing.assert_close(inverse(vectors), expected, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(inverse(vectors[0]), expected[0], rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="expected a vector of size"):
        inverse(torch.ones(len(dense) + 1, dtype=DT))


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_preconditioned_grad_norm_and_self_influence_brute_force(name, kind):
    model, inputs, labels = _problem(name, batch=7)
    damping = 1e-2
    norm = PreconditionedGradNorm(linear(1), curvature=kind, damping=damping)
    influence = SelfInfluence(linear(1), curvature=kind, damping=damping, k=3)
    ids = [f"sample-{i}" for i in range(7)]
    cockpit = _step([norm, influence], model, inputs, labels, info={"sample_ids": ids})
    shifted = _curvlinops_dense(kind, model, inputs, labels) + damping * torch.eye(sum(p.numel() for p in model.parameters()), dtype=DT)
    params = list(model.parameters())
    grads = _per_sample_grads(model, inputs, labels, params)
    g = grads.mean(0)
    value = cockpit.get_output()[0]["PreconditionedGradNorm"]
    assert value["value"] == pytest.approx(float(g @ torch.linalg.solve(shifted, g)), rel=1e-9)
    assert value["grad_norm_squared"] == pytest.approx(float(g @ g), rel=1e-12)
    assert math.fsum(value["layers"].values()) == pytest.approx(value["value"], rel=1e-12)
    scores = (grads * torch.linalg.solve(shifted, grads.T).T).sum(1)
    stored = cockpit.get_output()[0]["SelfInfluence"]
    assert stored["mean"] == pytest.approx(float(scores.mean()), rel=1e-9)
    assert stored["max"] == pytest.approx(float(scores.max()), rel=1e-9)
    assert stored["batch"] == 7
    order = torch.argsort(scores, descending=True)[:3].tolist()
    assert [entry["id"] for entry in stored["top"]] == [ids[i] for i in order]
    assert [entry["value"] for entry in stored["top"]] == pytest.approx(scores[order].tolist(), rel=1e-9)
    json.dumps(cockpit.get_output())
    json.dumps(cockpit.metadata())


def test_self_influence_ranks_a_flipped_label_in_the_top_k():
    """Two well-separated blobs, a model trained on clean labels; one label of the batch flipped."""
    generator = torch.Generator().manual_seed(0)
    centers = torch.tensor([[3.0, 0.0, 0.0, 0.0], [-3.0, 0.0, 0.0, 0.0]], dtype=DT)
    labels = torch.randint(0, 2, (64,), generator=generator)
    inputs = centers[labels] + torch.randn(64, 4, generator=generator, dtype=DT)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(30):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    batch_inputs, batch_labels = inputs[:16], labels[:16].clone()
    flipped = 5
    batch_labels[flipped] = 1 - batch_labels[flipped]
    influence = SelfInfluence(linear(1), damping=1e-3, k=3)
    ids = list(range(100, 116))
    cockpit = _step([influence], model, batch_inputs, batch_labels, info={"sample_ids": ids})
    top = cockpit.get_output()[0]["SelfInfluence"]["top"]
    assert top[0]["id"] == ids[flipped] and top[0]["position"] == flipped
    # the same batch without the flip: that sample is no longer ranked first
    cockpit = _step([SelfInfluence(linear(1), damping=1e-3, k=3)], model, batch_inputs, labels[:16])
    assert cockpit.get_output()[0]["SelfInfluence"]["top"][0]["position"] != flipped


# ---- statistics: merge, custom statistics, the logs -----------------------------------------
FULL = {"forward": [Covariance, Mean], "backward": [Covariance, Mean], "grad": [Mean, Covariance]}


def _close_logs(left, right):
    assert left["layers"].keys() == right["layers"].keys() and left["grad"].keys() == right["grad"].keys()
    for name in left["layers"]:
        for log in ("forward", "backward"):
            for stat, value in left["layers"][name][log].items():
                torch.testing.assert_close(value, right["layers"][name][log][stat], rtol=1e-10, atol=1e-13)
    for name in left["grad"]:
        for stat, value in left["grad"][name].items():
            torch.testing.assert_close(value, right["grad"][name][stat], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_statistics_of_two_halves_merge_to_those_of_the_whole(name):
    model, inputs, labels = _problem(name, batch=8)
    whole = CurvatureStatistics(linear(1), statistics=FULL)
    _step([whole], model, inputs, labels)
    # one run over two steps (running statistics) ...
    running = CurvatureStatistics(linear(1), statistics=FULL)
    cockpit = _step([running], model, inputs[:3], labels[:3])
    _step(None, model, inputs[3:], labels[3:], step=1, cockpit=cockpit)
    _close_logs(running.statistics(), whole.statistics())
    # ... and two runs' statistics merged
    first, second = CurvatureStatistics(linear(1), statistics=FULL), CurvatureStatistics(linear(1), statistics=FULL)
    _step([first], model, inputs[:5], labels[:5])
    _step([second], model, inputs[5:], labels[5:])
    merged = merge_logs(first.plan.stats, first.plan.running, second.plan.running)
    _close_logs(finalize_logs(first.plan.stats, merged), whole.statistics())
    counts = cockpit.get_output()[1]["CurvatureStatistics"]["layers"]
    tokens = 8 * (5 if name == "transformer" else 1)  # the transformer's layers but its head see 5 tokens a sample
    assert counts == {n: {"forward": 8 if n in ("head", "1", "3", "5") else tokens, "backward": 8} for n in whole.statistics()["layers"]}


def test_statistics_against_hooks_and_the_per_sample_loop():
    model, inputs, labels = _problem("cnn", batch=5)
    quantity = CurvatureStatistics(linear(1), statistics={"forward": [Mean, Covariance, Log], "backward": [Mean], "grad": [Mean, Covariance]})
    _step([quantity], model, inputs, labels)
    values = quantity.statistics()
    conv = model[0]
    patches = nn.functional.unfold(inputs, conv.kernel_size)  # [B, C kh kw, L]
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    torch.testing.assert_close(values["layers"]["0"]["forward"]["covariance"], rows.T @ rows / len(rows))
    torch.testing.assert_close(values["layers"]["0"]["forward"]["mean"], rows.mean(0))
    torch.testing.assert_close(values["layers"]["0"]["forward"]["log"], rows)
    params = list(model.parameters())
    grads = _per_sample_grads(model, inputs, labels, params)
    start = 0
    for (pname, param) in model.named_parameters():
        g = grads[:, start : start + param.numel()]
        start += param.numel()
        torch.testing.assert_close(values["grad"][pname]["mean"], g.mean(0))
        torch.testing.assert_close(values["grad"][pname]["covariance"], g.T @ g / len(g))
    # backward mean of the last layer: the per-sample output gradients' mean = the bias gradient
    torch.testing.assert_close(values["layers"]["4"]["backward"]["mean"], grads[:, -5:].mean(0))


class MeanOfSquares(Statistic):
    """The diagonal of the uncentered covariance (the example in docs/curvature_statistics.md)."""

    name = "mean_of_squares"

    def update(self, state, values, count):
        return self.add_sum(state, (values * values).sum(0), count)


def test_a_statistic_of_ones_own():
    model, inputs, labels = _problem("mlp", batch=6)
    quantity = CurvatureStatistics(linear(1), statistics={"forward": [Covariance, MeanOfSquares], "backward": [Covariance], "grad": [MeanOfSquares]})
    _step([quantity], model, inputs, labels)
    values = quantity.statistics()
    x = inputs.reshape(6, -1)
    torch.testing.assert_close(values["layers"]["1"]["forward"]["mean_of_squares"], (x * x).mean(0))
    grads = _per_sample_grads(model, inputs, labels, [model[1].weight])
    torch.testing.assert_close(values["grad"]["1.weight"]["mean_of_squares"], (grads * grads).mean(0))


def test_window_step_keeps_only_the_last_step():
    model, inputs, labels = _problem("mlp", batch=8)
    last = CurvatureStatistics(linear(1), statistics=FULL)
    _step([last], model, inputs[4:], labels[4:])
    quantity = CurvatureStatistics(linear(1), statistics=FULL, window="step")
    cockpit = _step([quantity], model, inputs[:4], labels[:4])
    _step(None, model, inputs[4:], labels[4:], step=1, cockpit=cockpit)
    _close_logs(quantity.statistics(), last.statistics())
    state = quantity.plan.state_dict()
    fresh = StatisticsPlan(FULL)
    fresh.load_state_dict(state)
    _close_logs(fresh.finalized(), last.statistics())


def test_hf_conv1d_equals_its_linear_twin():
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = nn.Sequential(Conv1D(4, 3), nn.Tanh(), Conv1D(2, 4)).to(DT)
    twin = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    with torch.no_grad():
        for c, t in ((conv[0], twin[0]), (conv[2], twin[2])):
            t.weight.copy_(c.weight.T)
            t.bias.copy_(c.bias)
    inputs = torch.randn(6, 5, 3, dtype=DT)
    labels = torch.randint(0, 2, (6, 5))
    dense, influence, names = {}, {}, {}
    for name, model in (("conv", conv), ("twin", twin)):
        quantity = CurvatureStatistics(linear(1), statistics="ekfac")
        scores = [SelfInfluence(linear(1), curvature=kind, damping=1e-3) for kind in ("kfac", "ekfac")]
        cockpit = Cockpit(list(model.parameters()), quantities=[quantity, *scores], model=model)
        loss = nn.functional.cross_entropy(model(inputs).reshape(-1, 2), labels.reshape(-1))
        with cockpit(0, info={"batch_size": 6, "loss": loss}):
            loss.backward()
        dense[name] = {kind: cockpit.curvature(kind=kind, quantity=quantity).to_dense() for kind in ("kfac", "ekfac")}
        names[name] = cockpit.curvature().names
        influence[name] = [q.last_values for q in scores]
    for ours, theirs in zip(influence["conv"], influence["twin"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=0)
    # the twin's order of the weight entries: Linear [out, in] row-major vs Conv1D [in, out] row-major
    order = []
    offset = 0
    for c in (conv[0], conv[2]):
        n_in, n_out = c.weight.shape
        order += (offset + torch.arange(n_in * n_out).reshape(n_out, n_in).T.reshape(-1)).tolist()
        offset += n_in * n_out
        order += list(range(offset, offset + n_out))
        offset += n_out
    for kind in ("kfac", "ekfac"):
        torch.testing.assert_close(dense["conv"][kind], dense["twin"][kind][order][:, order], rtol=1e-9, atol=1e-12)
    assert names["conv"] == names["twin"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_ekfac_spectrum_counts_the_ekfac_eigenvalues():
    model, inputs, labels = _problem("cnn")
    spectrum = EKFACSpectrum(linear(2), bins=12)
    cockpit = _step([spectrum], model, inputs, labels)
    value = cockpit.get_output()[0]["EKFACSpectrum"]
    eigenvalues = torch.linalg.eigvalsh(_curvlinops_dense("ekfac", model, inputs, labels))
    assert value["num"] == sum(p.numel() for p in model.parameters())
    assert sum(value["counts"]) + value["zeros"] == value["num"]
    assert sum(layer["num"] for layer in value["layers"].values()) == value["num"]
    assert value["max"] == pytest.approx(float(eigenvalues.max()), rel=1e-8)
    assert value["min"] == pytest.approx(float(eigenvalues.min()), abs=1e-12)
    assert len(value["edges"]) == 13 and value["edges"][0] > 0
    assert value["edges"][1] / value["edges"][0] == pytest.approx(value["edges"][-1] / value["edges"][-2])
    json.dumps(value)
    _step(None, model, inputs, labels, step=1, cockpit=cockpit)  # not scheduled: nothing computed
    assert 1 not in cockpit.get_output()


# ---- bad input ------------------------------------------------------------------------------
def test_bad_input_errors():
    with pytest.raises(ValueError, match="unknown logs"):
        parse_statistics({"inputs": [Covariance]})
    with pytest.raises(ValueError, match="unknown short form"):
        parse_statistics("kflr")
    with pytest.raises(ValueError, match="is not a Statistic"):
        parse_statistics({"forward": [torch.mean]})
    with pytest.raises(ValueError, match="needs Covariance in 'forward'"):
        parse_statistics({"forward": [Mean], "backward": [Covariance], "grad": [KroneckerEigenvalues]})
    with pytest.raises(ValueError, match="damping"):
        SelfInfluence(linear(1), damping=-1.0)
    with pytest.raises(ValueError, match="curvature"):
        PreconditionedGradNorm(linear(1), curvature="kflr")
    with pytest.raises(ValueError, match="window"):
        CurvatureStatistics(linear(1), window="epoch")
    # merging statistics of different shapes
    stat = Covariance()
    small = stat.update(stat.init(), torch.ones(2, 3, dtype=DT), 2)
    large = stat.update(stat.init(), torch.ones(2, 4, dtype=DT), 2)
    with pytest.raises(StatisticsMergeError, match="same layers"):
        stat.merge(small, large)
    with pytest.raises(StatisticsMergeError, match="changed size"):
        stat.update(small, torch.ones(1, 4, dtype=DT), 1)


def test_curvature_errors():
    model, inputs, labels = _problem("mlp", batch=3)  # 3 samples, 12 inputs: A is singular
    cockpit = Cockpit(list(model.parameters()), quantities=[CurvatureStatistics(linear(1))], model=model)
    with pytest.raises(RuntimeError, match="no quantity holds logged curvature"):
        cockpit.curvature()
    with pytest.raises(ValueError, match=r"kind='kafc'\): kind is 'kfac' or 'ekfac'"):  # a typo, named
        cockpit.curvature("kafc")
    _step(None, model, inputs, labels, cockpit=cockpit)
    with pytest.raises(NotLoggedError, match="were not logged"):
        cockpit.curvature(layers=["nope"])
    with pytest.raises(NotLoggedError, match="EK-FAC needs"):
        cockpit.curvature(kind="ekfac")
    with pytest.raises(ValueError, match="damping"):
        cockpit.curvature(damping=-1.0)
    assert cockpit.curvature(layers=["3"]).names == ["3.weight", "3.bias"]
    with pytest.raises(ValueError, match="singular"):
        cockpit.curvature().inverse(damping=0.0)
    norm = PreconditionedGradNorm(linear(1), damping=0.0)
    with pytest.raises(ValueError, match="singular"):
        _step([norm], model, inputs, labels)
    with pytest.raises(ValueError, match="singular"):
        _step([SelfInfluence(linear(1), damping=0.0)], model, inputs, labels)
    with pytest.raises(ValueError, match="sample_ids"):
        _step([SelfInfluence(linear(1))], model, inputs, labels, info={"sample_ids": [1, 2]})


# ---- log, instruments, command line -----------------------------------------------------------
def test_log_instruments_and_influence_listing(tmp_path, capsys):
    from matplotlib.figure import Figure

    from cockpit_like import instruments
    from cockpit_like.cli import main

    model, inputs, labels = _problem("mlp", batch=6)
    quantities = [EKFACSpectrum(linear(1), bins=8), SelfInfluence(linear(2), k=2), PreconditionedGradNorm(linear(1))]
    cockpit = Cockpit(list(model.parameters()), quantities=quantities, model=model, stream_to=tmp_path / "run")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        _step(None, model, inputs, labels, step=step, cockpit=cockpit, info={"sample_ids": [f"s{i}" for i in range(6)]})
        optimizer.step()
    path = cockpit.write(tmp_path / "run")
    fig = Figure(figsize=(9, 3))
    grid = fig.add_gridspec(1, 3)
    ax = instruments.ekfac_spectrum_gauge(path, fig, grid[0, 0])
    assert {a.get_gid() for a in ax.patches} >= {"ekfac:all", "ekfac:1", "ekfac:5"}
    ax = instruments.self_influence_gauge(path, fig, grid[0, 1])
    raw = [line for line in ax.lines if line.get_gid() == "raw:SelfInfluence.max"]
    assert len(raw) == 1 and len(raw[0].get_xdata()) == 2  # steps 0 and 2
    ax = instruments.preconditioned_grad_norm_gauge(path, fig, grid[0, 2])
    assert any(line.get_gid() == "raw:PreconditionedGradNorm" for line in ax.lines)
    fig.savefig(tmp_path / "gauges.png")
    capsys.readouterr()
    assert main(["influence", str(path), "--top", "3"]) == 0
    printed = capsys.readouterr().out.splitlines()
    stored = cockpit.get_output()
    best = max((entry["value"], step, entry["id"]) for step in (0, 2) for entry in stored[step]["SelfInfluence"]["top"])
    first = printed[3].split()
    assert first[:3] == ["1", str(best[1]), best[2]] and len(printed) == 6
    assert main(["influence", str(path), "--step", "1"]) == 0
    assert "no SelfInfluence values at step 1 (stored at 2 steps: 0 .. 2)" in capsys.readouterr().out
    assert main(["influence", str(path), "--quantity", "Nope"]) == 0  # a name the log does not have: its names
    assert "no SelfInfluence values named Nope: the log's SelfInfluence quantities are SelfInfluence" in capsys.readouterr().out


def test_heuristic_damping_is_pi_damping_of_the_factors():
    """strategy="heuristic": (G + π√λ I)^{-1} ⊗ (A + √λ/π I)^{-1} per block, π² = (tr G / out) / (tr A / in)."""
    model, inputs, labels = _problem("mlp", batch=7)
    damping = 1e-2
    norm = PreconditionedGradNorm(linear(1), damping=damping, strategy="heuristic")
    stats = CurvatureStatistics(linear(1))
    cockpit = _step([norm, stats], model, inputs, labels)
    logs = stats.statistics()["layers"]
    total = 0.0
    for name in ("1", "3", "5"):
        A, G = logs[name]["forward"]["covariance"], logs[name]["backward"]["covariance"]
        pi = math.sqrt((G.trace() / len(G)) / (A.trace() / len(A)))
        root = math.sqrt(damping)
        g_w, g_b = model[int(name)].weight.grad, model[int(name)].bias.grad
        dense = torch.kron(G + pi * root * torch.eye(len(G), dtype=DT), A + root / pi * torch.eye(len(A), dtype=DT))
        total += float(g_w.reshape(-1) @ torch.linalg.solve(dense, g_w.reshape(-1)))
        bias_block = G + damping * torch.eye(len(G), dtype=DT)  # a single factor: π = 1
        total += float(g_b @ torch.linalg.solve(bias_block, g_b))
    assert cockpit.get_output()[0]["PreconditionedGradNorm"]["value"] == pytest.approx(total, rel=1e-9)
    with pytest.raises(ValueError, match="strategy"):
        SelfInfluence(linear(1), strategy="pi")


def test_kronecker_quadratic_forms_against_dense():
    from cockpit_like.functional.kronecker_quadratic import (
        quadratic_forms_dense,
        quadratic_forms_factors,
        quadratic_forms_sequence,
    )

    generator = torch.Generator().manual_seed(3)
    rows, cols, batch, positions = 3, 4, 5, 6
    left = torch.linalg.qr(torch.randn(rows, rows, generator=generator, dtype=DT))[0]
    right = torch.linalg.qr(torch.randn(cols, cols, generator=generator, dtype=DT))[0]
    weights = torch.rand(rows, cols, generator=generator, dtype=DT)
    metric = torch.kron(left, right) @ torch.diag(weights.reshape(-1)) @ torch.kron(left, right).T
    u = torch.randn(batch, positions, rows, generator=generator, dtype=DT)
    v = torch.randn(batch, positions, cols, generator=generator, dtype=DT)
    g = torch.einsum("ntr,ntc->nrc", u, v)
    expected = torch.einsum("ni,ij,nj->n", g.reshape(batch, -1), metric, g.reshape(batch, -1))
    torch.testing.assert_close(quadratic_forms_sequence(u, v, left, right, weights), expected)
    torch.testing.assert_close(quadratic_forms_dense(g, left, right, weights), expected)
    outer = torch.einsum("nr,nc->nrc", u[:, 0], v[:, 0]).reshape(batch, -1)
    torch.testing.assert_close(quadratic_forms_factors(u[:, 0], v[:, 0], left, right, weights),
                               torch.einsum("ni,ij,nj->n", outer, metric, outer))  # fmt: skip
    with pytest.raises(ValueError, match="weights"):
        quadratic_forms_dense(g, left, right, weights.T)


def test_ekfac_over_two_steps_uses_the_running_basis_and_the_last_steps_eigenvalues():
    """window="run": basis of the factors of both steps, corrected eigenvalues from the second step's samples."""
    model, inputs, labels = _problem("mlp", batch=10)
    union = CurvatureStatistics(linear(1))
    _step([union], model, inputs, labels)
    quantity = CurvatureStatistics(linear(1), statistics="ekfac")
    cockpit = _step([quantity], model, inputs[:4], labels[:4])
    _step(None, model, inputs[4:], labels[4:], step=1, cockpit=cockpit)
    operator = cockpit.curvature(kind="ekfac")
    logs = union.statistics()["layers"]
    later = list(model.parameters())
    grads = _per_sample_grads(model, inputs[4:], labels[4:], later)
    start = 0
    for pname, param in model.named_parameters():
        layer, role = pname.rsplit(".", 1)
        g = grads[:, start : start + param.numel()]
        start += param.numel()
        q_g = torch.linalg.eigh(logs[layer]["backward"]["covariance"])[1]
        q = torch.kron(q_g, torch.linalg.eigh(logs[layer]["forward"]["covariance"])[1]) if role == "weight" else q_g
        values = ((g @ q) ** 2).mean(0)
        torch.testing.assert_close(operator.block(pname).to_dense(), q @ torch.diag(values) @ q.T, rtol=1e-8, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_mc_fisher_is_the_empirical_fisher_of_labels_sampled_from_the_model(name):
    """fisher="mc": a second backward pass with labels drawn from softmax(outputs); reproduced with the same seed."""
    from cockpit_like.context import MissingInfoError

    model, inputs, labels = _problem(name, batch=8)
    quantity = CurvatureStatistics(linear(1), statistics="ekfac", fisher="mc")
    influence = SelfInfluence(linear(1), fisher="mc", k=2)
    cockpit = Cockpit(list(model.parameters()), quantities=[quantity, influence], model=model)
    outputs = model(inputs)
    loss = nn.functional.cross_entropy(outputs, labels)
    with pytest.raises(MissingInfoError, match="outputs"):
        with cockpit(0, info={"batch_size": 8, "loss": loss}):
            pass
    with cockpit(0, info={"batch_size": 8, "loss": loss, "outputs": outputs}):
        loss.backward(create_graph=cockpit.create_graph(0))
    # each quantity draws its own labels from the cockpit's generator, seeded by the step, its key and the logits
    # (issue 37: the user's random stream is not used)
    from cockpit_like.backends.randomness import generator

    def draw(owner):
        seeded = generator(0, "sampled fisher labels", outputs.device, owner._key, float(outputs.detach().sum()))
        return torch.multinomial(torch.softmax(outputs.detach(), dim=1), 1, generator=seeded).squeeze(1)

    sampled, sampled_again = draw(quantity), draw(influence)
    for kind in ("kfac", "ekfac"):
        reference = _curvlinops_dense(kind, model, inputs, sampled)
        torch.testing.assert_close(cockpit.curvature(kind=kind, quantity=quantity).to_dense(), reference, rtol=1e-9, atol=1e-12)
    # SelfInfluence: the true labels' per-sample gradients, its own sampled labels' KFAC
    grads = _per_sample_grads(model, inputs, labels, list(model.parameters()))
    shifted = _curvlinops_dense("kfac", model, inputs, sampled_again) + 1e-3 * torch.eye(grads.shape[1], dtype=DT)
    expected = (grads * torch.linalg.solve(shifted, grads.T).T).sum(1)
    torch.testing.assert_close(influence.last_values, expected, rtol=1e-8, atol=0)
    assert quantity.settings()["fisher"] == "mc"
    with pytest.raises(ValueError, match="fisher"):
        CurvatureStatistics(linear(1), fisher="type3")


def test_self_influence_defaults_on_2c2d_clip_zero_eigenvalues():
    """DeepOBS 2c2d (float32, 3.3M parameters, batch 4): the Kronecker factor of the 3136 -> 1024 layer has
    rank <= 4, so most of its eigenvalues are 0 or round-off negative. With the default damping the
    eigenvalues are clipped at zero before damping (it used to raise "F + damping I is singular"), and
    every s_i lies between ||g_i||^2 / (lambda_max + damping) and ||g_i||^2 / damping."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Linear(7 * 7 * 64, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )  # fmt: skip
    inputs, labels = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    influence = SelfInfluence(linear(1))
    cockpit = _step([influence], model, inputs, labels)
    value = cockpit.get_output()[0]["SelfInfluence"]
    values = influence.last_values.double()
    assert bool(torch.isfinite(values).all()) and value["batch"] == 4
    params = list(model.parameters())
    norms = torch.stack([
        sum((g.double() ** 2).sum() for g in torch.autograd.grad(nn.functional.cross_entropy(model(x[None]), y[None]), params))
        for x, y in zip(inputs, labels)
    ])  # fmt: skip
    assert bool((values <= norms / 1e-3 * (1 + 1e-4)).all())
    assert bool((values > 0).all())
    assert value["max"] == pytest.approx(float(values.max()), rel=1e-6)
