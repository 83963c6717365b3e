"""fisher="type-2": the exact type-2 Fisher (GGN) logged from one backward pass per column of the loss Hessian's root.

References: the loss Hessian from torch.autograd.functional.hessian; curvlinops'
KFACLinearOperator / EKFACLinearOperator with FisherType.TYPE2 (float64, a
test-only oracle); the dense GGN J^T H J from torch.autograd.functional.jacobian /
hessian and the dense Hessian of the loss w.r.t. the parameters (one linear
layer with MSE, where KFAC is exact).
"""

import math
import warnings

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.context import MissingInfoError
from cockpit_like.functional.loss_hessian import loss_hessian_sqrt
from cockpit_like.quantities import CurvatureStatistics, EKFACSpectrum, PreconditionedGradNorm, SelfInfluence
from cockpit_like.utils.schedules import linear
from tests.helpers import make_mlp
from tests.test_curvature_statistics import _per_sample_grads, _problem

curvlinops = pytest.importorskip("curvlinops")
from curvlinops import EKFACLinearOperator, KFACLinearOperator  # noqa: E402
from curvlinops.kfac import FisherType, KFACType  # noqa: E402

DT = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")


def _type2_reference(kind, model, loss_func, data):
    """curvlinops' KFAC / EK-FAC of the type-2 Fisher, as a dense matrix."""
    params = list(model.parameters())
    cls = KFACLinearOperator if kind == "kfac" else EKFACLinearOperator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op = cls(model, loss_func, params, data, fisher_type=FisherType.TYPE2, kfac_approx=KFACType.EXPAND,
                 check_deterministic=False)  # fmt: skip
        return op @ torch.eye(sum(p.numel() for p in params), dtype=DT)


def _type2_step(quantities, model, inputs, targets, loss_fn, step=0, cockpit=None):
    cockpit = cockpit or Cockpit(list(model.parameters()), quantities=quantities, model=model)
    model.zero_grad()
    outputs = model(inputs)
    loss = loss_fn(outputs, targets)
    with cockpit(step, info={"batch_size": len(inputs), "loss": loss, "outputs": outputs}):
        loss.backward(create_graph=cockpit.create_graph(step))
    return cockpit


# ---- the loss Hessian's root ------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_loss_hessian_sqrt_squares_to_the_autograd_hessian(loss):
    torch.manual_seed(0)
    outputs = torch.randn(4, 5, dtype=DT) * 2
    roots = loss_hessian_sqrt(outputs, loss)
    for f, root in zip(outputs, roots):
        if loss == "cross_entropy":
            target = torch.tensor([2])
            hessian = torch.autograd.functional.hessian(lambda g: nn.functional.cross_entropy(g[None], target), f)
        else:
            target = torch.randn(1, 5, dtype=DT)
            hessian = torch.autograd.functional.hessian(lambda g: nn.functional.mse_loss(g[None], target), f)
        torch.testing.assert_close(root @ root.T, hessian, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="known for"):
        loss_hessian_sqrt(outputs, "hinge")


# ---- against curvlinops' type-2 KFAC / EK-FAC -------------------------------------------------------
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_cross_entropy_type2_matches_curvlinops(name):
    model, inputs, labels = _problem(name)
    quantity = CurvatureStatistics(linear(1), statistics="ekfac", fisher="type-2", loss="cross_entropy")
    cockpit = _type2_step([quantity], model, inputs, labels, nn.functional.cross_entropy)
    for kind in ("kfac", "ekfac"):
        reference = _type2_reference(kind, model, nn.CrossEntropyLoss(), [(inputs, labels)])
        operator = cockpit.curvature(kind=kind)
        assert operator.names == [n for n, _ in model.named_parameters()]
        torch.testing.assert_close(operator.to_dense(), reference, rtol=1e-9, atol=1e-12)
    assert quantity.settings()["loss"] == "cross_entropy"


def test_mse_type2_matches_curvlinops_and_two_steps_merge():
    """MSELoss(reduction="mean") on an MLP with 4 outputs; KFAC over two tracked steps = curvlinops on both batches."""
    model = make_mlp(seed=1)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(12, 3, 4, generator=generator, dtype=DT)
    targets = torch.randn(12, 4, generator=generator, dtype=DT)
    quantity = CurvatureStatistics(linear(1), statistics="ekfac", fisher="type-2", loss="mse")
    cockpit = _type2_step([quantity], model, inputs[:6], targets[:6], nn.functional.mse_loss)
    for kind in ("kfac", "ekfac"):
        reference = _type2_reference(kind, model, nn.MSELoss(), [(inputs[:6], targets[:6])])
        torch.testing.assert_close(cockpit.curvature(kind=kind).to_dense(), reference, rtol=1e-9, atol=1e-12)
    _type2_step(None, model, inputs[6:], targets[6:], nn.functional.mse_loss, step=1, cockpit=cockpit)
    both = _type2_reference("kfac", model, nn.MSELoss(), [(inputs[:6], targets[:6]), (inputs[6:], targets[6:])])
    torch.testing.assert_close(cockpit.curvature(kind="kfac").to_dense(), both, rtol=1e-9, atol=1e-12)


class _ClassesSecond(nn.Module):
    """The same model with outputs [B, C, T] (curvlinops' layout for a cross-entropy over positions)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).transpose(1, 2)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_outputs_with_positions_are_curvlinops_over_positions(loss):
    """Outputs [B, T, C]: the loss is the mean over B T rows; each sequence is one sample (curvlinops: T terms each)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    batch, positions = 5, 4
    inputs = torch.randn(batch, positions, 3, dtype=DT)
    if loss == "mse":
        targets, loss_fn, reference_model, loss_func = torch.randn(batch, positions, 3, dtype=DT), nn.functional.mse_loss, model, nn.MSELoss()
    else:
        targets, reference_model, loss_func = torch.randint(0, 3, (batch, positions)), _ClassesSecond(model), nn.CrossEntropyLoss()

        def loss_fn(outputs, labels):
            return nn.functional.cross_entropy(outputs.reshape(-1, 3), labels.reshape(-1))

    quantity = CurvatureStatistics(linear(1), statistics="ekfac", fisher="type-2", loss=loss)
    cockpit = _type2_step([quantity], model, inputs, targets, loss_fn)
    reference = _type2_reference("kfac", reference_model, loss_func, [(inputs, targets)])
    torch.testing.assert_close(cockpit.curvature(kind="kfac").to_dense() * positions, reference, rtol=1e-9, atol=1e-12)
    # EK-FAC (curvlinops' EK-FAC takes 2d outputs only): in the eigenbasis of the factors just checked, the
    # corrected eigenvalues (1/B) sum_n sum_c (Q_G^T g_nc Q_A)^2 from a loop of autograd over samples and columns,
    # g_nc the gradient of sample n's surrogate (1/T) sum_t f_nt . S_nt[:, c]
    logs = quantity.statistics()["layers"]
    operator = cockpit.curvature(kind="ekfac")
    for layer in ("0", "2"):
        module = model[int(layer)]
        q_g = torch.linalg.eigh(logs[layer]["backward"]["covariance"])[1]
        q_a = torch.linalg.eigh(logs[layer]["forward"]["covariance"])[1]
        weight_values, bias_values = 0, 0
        for x in inputs:
            rows = model(x[None]).reshape(positions, 3)
            roots = loss_hessian_sqrt(rows, loss)
            for c in range(3):
                surrogate = (rows * roots[:, :, c]).sum() / positions
                g_w, g_b = torch.autograd.grad(surrogate, [module.weight, module.bias], retain_graph=True)
                weight_values = weight_values + (q_g.T @ g_w @ q_a) ** 2 / batch
                bias_values = bias_values + (q_g.T @ g_b) ** 2 / batch
        q = torch.kron(q_g, q_a)
        expected = q @ torch.diag(weight_values.reshape(-1)) @ q.T
        torch.testing.assert_close(operator.block(f"{layer}.weight").to_dense(), expected, rtol=1e-9, atol=1e-12)
        expected = q_g @ torch.diag(bias_values) @ q_g.T
        torch.testing.assert_close(operator.block(f"{layer}.bias").to_dense(), expected, rtol=1e-9, atol=1e-12)


def test_gpt2_conv1d_ekfac_against_an_autograd_loop_over_columns():
    """Tiny GPT-2 (HF Conv1D layers, weight [in, out]; logits[:, :-1] over 40 tokens): every EK-FAC block's
    quadratic form v^T F v = sum (1/B) sum_n sum_c (Q_G^T g_nc^T Q_A)^2 (Q_G^T v^T Q_A)^2, with g_nc from an
    autograd loop over sequences and columns, and its trace (1/B) sum_n sum_c ||g_nc||^2 (basis-free)."""
    pytest.importorskip("transformers")
    from tests.zoo import gpt2

    problem = gpt2()
    model = problem.model
    tokens, _ = problem.batch(2, 0)
    quantity = CurvatureStatistics(linear(1), statistics="ekfac", fisher="type-2", loss="cross_entropy")
    cockpit = Cockpit(list(model.parameters()), quantities=[quantity], model=model)
    outputs = model(tokens).logits[:, :-1]
    loss = nn.functional.cross_entropy(outputs.reshape(-1, 40), tokens[:, 1:].reshape(-1))
    with cockpit(0, info={"batch_size": 2, "loss": loss, "outputs": outputs}):
        loss.backward(create_graph=cockpit.create_graph(0))
    operator = cockpit.curvature(kind="ekfac")
    covered = {n: p for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] in ("c_attn", "c_proj", "c_fc")}
    assert sorted(operator.names) == sorted(covered)  # the Conv1D layers (the tied lm_head is left out)
    grads = {name: [] for name in covered}
    for sequence in tokens:
        logits = model(sequence[None]).logits[0, :-1]
        roots = loss_hessian_sqrt(logits, "cross_entropy")
        for c in range(40):
            surrogate = (logits * roots[:, :, c]).sum() / logits.shape[0]
            for name, g in zip(covered, torch.autograd.grad(surrogate, list(covered.values()), retain_graph=True)):
                grads[name].append(g)
    logs = quantity.statistics()["layers"]
    generator = torch.Generator().manual_seed(0)
    for name, param in covered.items():
        layer, role = name.rsplit(".", 1)
        q_g = torch.linalg.eigh(logs[layer]["backward"]["covariance"])[1]
        q_a = torch.linalg.eigh(logs[layer]["forward"]["covariance"])[1]
        g = torch.stack(grads[name])
        v = torch.randn(param.shape, generator=generator, dtype=DT)
        if role == "weight":  # [in, out]: the [out, in] matrix is the transpose
            values = (q_g.T @ g.transpose(1, 2) @ q_a).pow(2).sum(0) / len(tokens)
            expected = float((values * (q_g.T @ v.T @ q_a) ** 2).sum())
        else:
            values = (g @ q_g).pow(2).sum(0) / len(tokens)
            expected = float((values * (v @ q_g) ** 2).sum())
        block = operator.block(name)
        assert math.isclose(float(v.reshape(-1) @ (block @ v.reshape(-1))), expected, rel_tol=1e-9), name
        assert math.isclose(float(block.trace()), float(g.pow(2).sum()) / len(tokens), rel_tol=1e-9), name


# ---- the exact case: one linear layer, MSE ------------------------------------------------------
def test_exact_case_one_linear_layer_mse_equals_dense_ggn_and_hessian():
    torch.manual_seed(0)
    layer = nn.Linear(3, 2, bias=False).to(DT)
    batch = 5
    inputs, targets = torch.randn(batch, 3, dtype=DT), torch.randn(batch, 2, dtype=DT)
    weight = layer.weight.detach().clone()

    def outputs_of(w):
        return nn.functional.linear(inputs, w.reshape(weight.shape))

    jacobian = torch.autograd.functional.jacobian(outputs_of, weight.reshape(-1)).reshape(batch * 2, -1)
    loss_hessian = torch.autograd.functional.hessian(
        lambda f: nn.functional.mse_loss(f.reshape(batch, 2), targets), outputs_of(weight.reshape(-1)).reshape(-1)
    )
    ggn = jacobian.T @ loss_hessian @ jacobian  # J^T H J, brute force
    hessian = torch.autograd.functional.hessian(lambda w: nn.functional.mse_loss(outputs_of(w), targets), weight.reshape(-1))
    torch.testing.assert_close(ggn, hessian, rtol=1e-12, atol=1e-14)  # linear model: GGN = Hessian
    for statistics in ("kfac", "ekfac"):
        quantity = CurvatureStatistics(linear(1), statistics=statistics, fisher="type-2", loss="mse")
        cockpit = _type2_step([quantity], layer, inputs, targets, nn.functional.mse_loss)
        dense = cockpit.curvature(kind=statistics).to_dense()
        torch.testing.assert_close(dense, ggn, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(dense, hessian, rtol=1e-10, atol=1e-13)
    assert torch.linalg.matrix_rank(ggn) == 6  # a full-rank, non-trivial curvature


# ---- the other quantities on the type-2 logs ------------------------------------------------------
def test_self_influence_and_preconditioned_grad_norm_with_type2():
    model, inputs, labels = _problem("mlp", batch=8)
    damping = 1e-3
    influence = SelfInfluence(linear(1), damping=damping, k=3, fisher="type-2", loss="cross_entropy")
    norm = PreconditionedGradNorm(linear(1), curvature="ekfac", damping=damping, fisher="type-2", loss="cross_entropy")
    spectrum = EKFACSpectrum(linear(1), fisher="type-2", loss="cross_entropy")
    cockpit = _type2_step([influence, norm, spectrum], model, inputs, labels, nn.functional.cross_entropy)
    eye = torch.eye(sum(p.numel() for p in model.parameters()), dtype=DT)
    grads = _per_sample_grads(model, inputs, labels, list(model.parameters()))
    kfac = _type2_reference("kfac", model, nn.CrossEntropyLoss(), [(inputs, labels)]) + damping * eye
    torch.testing.assert_close(influence.last_values, (grads * torch.linalg.solve(kfac, grads.T).T).sum(1), rtol=1e-8, atol=0)
    ekfac = _type2_reference("ekfac", model, nn.CrossEntropyLoss(), [(inputs, labels)])
    g = torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])
    expected = float(g @ torch.linalg.solve(ekfac + damping * eye, g))
    assert math.isclose(cockpit.get_output()[0]["PreconditionedGradNorm"]["value"], expected, rel_tol=1e-8)
    stored = cockpit.get_output()[0]["EKFACSpectrum"]
    eigenvalues = torch.linalg.eigvalsh(ekfac)
    assert stored["num"] == eye.shape[0]
    assert math.isclose(stored["max"], float(eigenvalues.max()), rel_tol=1e-8)


def test_other_statistics_are_summed_over_the_columns():
    """Mean / Log on the logs: forward once, backward and grad summed over the columns (count once), Log concatenated."""
    from cockpit_like.statistics import Covariance, Log, Mean, Statistic

    model, inputs, labels = _problem("mlp", batch=5)
    config = {"forward": [Covariance, Mean], "backward": [Covariance, Mean, Log], "grad": [Mean]}
    quantity = CurvatureStatistics(linear(1), statistics=config, fisher="type-2", loss="cross_entropy")
    _type2_step([quantity], model, inputs, labels, nn.functional.cross_entropy)
    logs = quantity.statistics()
    roots = loss_hessian_sqrt(model(inputs).detach(), "cross_entropy")  # [B, C, C]
    batch, classes = roots.shape[:2]
    head = logs["layers"]["5"]  # the last layer: its output gradients are the roots' columns
    torch.testing.assert_close(head["backward"]["log"], torch.cat([roots[:, :, c] for c in range(classes)]), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(head["backward"]["mean"], roots.sum((0, 2)) / batch, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logs["layers"]["1"]["forward"]["mean"], inputs.reshape(batch, -1).mean(0), rtol=1e-12, atol=1e-14)
    params = list(model.parameters())
    means = [torch.zeros_like(p) for p in params]
    for x, root in zip(inputs, roots):  # autograd loop over samples and columns
        out = model(x[None])[0]
        for c in range(classes):
            for mean, g in zip(means, torch.autograd.grad(out @ root[:, c], params, retain_graph=True)):
                mean += g / batch
    for (name, _), mean in zip(model.named_parameters(), means):
        torch.testing.assert_close(logs["grad"][name]["mean"], mean.reshape(-1), rtol=1e-10, atol=1e-13)

    class Largest(Statistic):  # a state without "sum" cannot be summed over the columns
        name = "largest"

        def init(self):
            return {"value": None}

        def update(self, state, values, count):
            return {"value": values.abs().max()}

    odd = CurvatureStatistics(linear(1), statistics={"forward": [Covariance], "backward": [Covariance, Largest]},
                              fisher="type-2", loss="cross_entropy")  # fmt: skip
    with pytest.raises(TypeError, match="Largest.*'sum' and 'count'"):
        _type2_step([odd], model, inputs, labels, nn.functional.cross_entropy)


# ---- bad input ------------------------------------------------------------------------------------
def test_type2_errors():
    with pytest.raises(ValueError, match="loss='hinge'.*'cross_entropy'.*'mse'"):
        CurvatureStatistics(linear(1), fisher="type-2", loss="hinge")
    with pytest.raises(ValueError, match="loss=None"):
        SelfInfluence(linear(1), fisher="type-2")
    with pytest.raises(ValueError, match="fisher='type-2' only"):
        CurvatureStatistics(linear(1), loss="mse")
    torch.manual_seed(0)
    layer = nn.Linear(3, 2).to(DT)
    inputs, targets = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)

    def run(outputs_for_info, batch_size=4, model=layer, loss_name="mse"):
        quantity = CurvatureStatistics(linear(1), fisher="type-2", loss=loss_name)
        cockpit = Cockpit(list(model.parameters()), quantities=[quantity], model=model)
        outputs = model(inputs)
        loss = nn.functional.mse_loss(outputs, targets)
        info = {"batch_size": batch_size, "loss": loss}
        if outputs_for_info is not None:
            info["outputs"] = outputs_for_info(outputs)
        with cockpit(0, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))

    with pytest.raises(MissingInfoError, match="outputs"):
        run(None)
    with pytest.raises(ValueError, match="with their graph"):
        run(lambda out: out.detach())
    with pytest.raises(ValueError, match="with their graph"):
        run(lambda out: out.tolist())
    with pytest.raises(ValueError, match=r"batch_size'\] is 5"):
        run(lambda out: out, batch_size=5)
    with pytest.raises(ValueError, match=r"shape \[8\].*\[B, 1\]"):
        run(lambda out: out.reshape(-1))
    with pytest.raises(ValueError, match=r"class dimension"):
        run(lambda out: out.reshape(-1), loss_name="cross_entropy")
