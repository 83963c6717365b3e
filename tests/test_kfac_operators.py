"""KFAC / EK-FAC model-level operators and EK-FAC's corrected eigenvalues against dense float64 twins.

The dense twins are assembled here independently: ``G ⊗ A`` blocks placed by
parameter index with explicit index loops, the EK-FAC eigenvalues as
``diag(Qᵀ F Q)`` of the dense empirical Fisher, and exact cases against
``torch.autograd.functional.hessian`` (one linear layer with MSE).
"""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

from cockpit_like.functional import ekfac as ekfac_module
from cockpit_like.functional.ekfac import ekfac_eigenvalues, ekfac_eigenvalues_sequence
from cockpit_like.operators import BlockDiagonal, LayerCurvature, ScaledIdentity, ekfac_operator, kfac_operator
from cockpit_like.operators import kfac as kfac_module

from tests.operator_helpers import DT, orthogonal, param, spd
from tests.operator_helpers import gen as _gen


class Model:
    """Three layers: Linear with a separate bias, Conv2d without bias, Linear with a joined bias."""

    def __init__(self):
        self.w1, self.b1 = param(3, 4, seed=1), param(3, seed=2)
        self.wc = param(2, 3, 2, 2, seed=3)  # in = 3 * 2 * 2 = 12
        self.w2, self.b2 = param(2, 3, seed=4), param(2, seed=5)
        self.fc1 = LayerCurvature("fc1", self.w1, spd(4, 10), spd(3, 11), bias=self.b1)
        self.conv = LayerCurvature("conv", self.wc, spd(12, 12), spd(2, 13))
        self.fc2 = LayerCurvature("fc2", self.w2, spd(4, 14), spd(2, 15), bias=self.b2, join_bias=True)
        self.layers = [self.fc1, self.conv, self.fc2]
        # the cockpit's parameter order, shuffled relative to the layers (fc2's bias before its weight)
        self.params = [self.b2, self.w2, self.wc, self.b1, self.w1]

    def add_ekfac(self, n=6):
        """Corrected eigenvalues from random per-sample gradients; returns them per layer."""
        grads = {}
        for seed, layer in enumerate(self.layers):
            out, inp = layer.out_features, layer.in_features
            wg = torch.randn(n, *layer.weight.shape, dtype=DT, generator=_gen(40 + seed))
            bg = None if layer.bias is None else torch.randn(n, out, dtype=DT, generator=_gen(50 + seed))
            layer.correct_eigenvalues(wg, bg, scale=n)
            grads[layer.name] = (wg.reshape(n, out, inp), bg)
        return grads


def place(dense, rows, block):
    """``dense[rows[i], rows[j]] = block[i, j]`` by explicit loops."""
    for i, r in enumerate(rows):
        for j, c in enumerate(rows):
            dense[r, c] = block[i, j]


def offsets(params):
    out, start = [], 0
    for p in params:
        out.append(start)
        start += p.numel()
    return out, start


def dense_model_operator(model, weight_block, bias_block, joined_block):
    """The block-diagonal matrix over ``model.params``, from per-layer dense blocks, by index loops."""
    starts, total = offsets(model.params)
    where = {id(p): s for p, s in zip(model.params, starts)}
    dense = torch.zeros(total, total, dtype=DT)
    for layer in model.layers:
        out, inp = layer.out_features, layer.in_features
        w0 = where[id(layer.weight)]
        if layer.join_bias:
            b0 = where[id(layer.bias)]
            rows = []  # block index o * (in + 1) + i  ->  parameter-vector position
            for o in range(out):
                for i in range(inp + 1):
                    rows.append(w0 + o * inp + i if i < inp else b0 + o)
            place(dense, rows, joined_block(layer))
            continue
        place(dense, [w0 + k for k in range(out * inp)], weight_block(layer))
        if layer.bias is not None:
            place(dense, [where[id(layer.bias)] + o for o in range(out)], bias_block(layer))
    return dense


def test_kfac_operator_against_dense_assembly():
    model = Model()
    assert repr(model.fc2) == (
        "LayerCurvature(name='fc2', weight=[2, 3], bias=[2], A=[4, 4], G=[2, 2], join_bias=True, "
        "corrected_eigenvalues=False)"
    )
    assert model.conv.in_features == 12 and model.conv.weight_shape == (2, 3, 2, 2) and model.conv.bias_shape is None
    op = kfac_operator(model.layers, model.params)
    assert isinstance(op, BlockDiagonal)
    assert op.names == ["fc2", "conv.weight", "fc1.bias", "fc1.weight"]
    dense = dense_model_operator(
        model,
        lambda layer: torch.kron(layer.G, layer.A),
        lambda layer: layer.G,
        lambda layer: torch.kron(layer.G, layer.A),
    )
    torch.testing.assert_close(op.to_dense(), dense, rtol=1e-12, atol=1e-12)
    x = torch.randn(dense.shape[0], 3, dtype=DT, generator=_gen(60))
    torch.testing.assert_close(op @ x, dense @ x)
    torch.testing.assert_close(op.trace(), dense.trace())
    torch.testing.assert_close(op.logdet(), torch.logdet(dense))
    torch.testing.assert_close(op.frobenius_norm(), torch.linalg.matrix_norm(dense))
    torch.testing.assert_close(op.inverse(0.1).to_dense(), torch.linalg.inv(dense + 0.1 * torch.eye(len(dense), dtype=DT)))
    # names instead of tensors, and the layers' own order by default
    by_name = kfac_operator(model.layers, ["fc2.bias", "fc2.weight", "conv.weight", "fc1.bias", "fc1.weight"])
    torch.testing.assert_close(by_name.to_dense(), dense, rtol=0, atol=0)
    default = kfac_operator(model.layers)
    assert default.names == ["fc1.weight", "fc1.bias", "conv.weight", "fc2"]


def test_ekfac_operator_against_projection_formula():
    """EK-FAC = Q diag(diag(Qᵀ F Q)) Qᵀ per block, F the dense empirical Fisher of the per-sample gradients."""
    model = Model()
    n = 6
    grads = model.add_ekfac(n)

    def fisher(g):  # scale * sum_n vec(g_n) vec(g_n)ᵀ with scale = n
        flat = g.reshape(g.shape[0], -1)
        return n * flat.T @ flat

    def projected(q, f):
        return q @ torch.diag(torch.diagonal(q.T @ f @ q)) @ q.T

    def bases(layer):
        q_g = torch.linalg.eigh(layer.G)[1]
        q_a = torch.linalg.eigh(layer.A)[1]
        return q_g, q_a

    def weight_block(layer):
        q_g, q_a = bases(layer)
        return projected(torch.kron(q_g, q_a), fisher(grads[layer.name][0]))

    def bias_block(layer):
        return projected(bases(layer)[0], fisher(grads[layer.name][1]))

    def joined_block(layer):
        wg, bg = grads[layer.name]
        q_g, q_a = bases(layer)
        return projected(torch.kron(q_g, q_a), fisher(torch.cat([wg, bg[:, :, None]], dim=2)))

    op = ekfac_operator(model.layers, model.params)
    dense = dense_model_operator(model, weight_block, bias_block, joined_block)
    # eigh is deterministic: the test's eigenvectors are the records' (signs included)
    torch.testing.assert_close(model.fc1.eigvecs_A, bases(model.fc1)[1], rtol=0, atol=0)
    torch.testing.assert_close(op.to_dense(), dense, rtol=1e-10, atol=1e-12)
    x = torch.randn(dense.shape[0], 2, dtype=DT, generator=_gen(61))
    torch.testing.assert_close(op @ x, dense @ x)
    torch.testing.assert_close(op.trace(), dense.trace())
    damped = dense + 0.01 * torch.eye(len(dense), dtype=DT)
    torch.testing.assert_close(op.inverse(0.01) @ x, torch.linalg.solve(damped, x))
    torch.testing.assert_close(op.logdet(), torch.logdet(dense), rtol=1e-8, atol=1e-8)
    # the EK-FAC diagonal in the eigenbasis is the Fisher's: trace(EKFAC) = trace(F)
    for layer in (model.fc1,):
        torch.testing.assert_close(layer.eigenvalues.sum(), fisher(grads["fc1"][0]).trace())


@pytest.mark.parametrize("joined", [False, True])
def test_single_linear_layer_mse_kfac_is_the_hessian(joined):
    """One linear layer, loss (1/N) sum_n ||W x_n + b - y_n||²: H = 2 I ⊗ (1/N) sum [x;1][x;1]ᵀ exactly."""
    n, inp, out = 7, 3, 2
    x = torch.randn(n, inp, dtype=DT, generator=_gen(70))
    y = torch.randn(n, out, dtype=DT, generator=_gen(71))
    weight, bias = param(out, inp, seed=72), param(out, seed=73)

    def loss(w_flat, b):
        return ((x @ w_flat.reshape(out, inp).T + b - y) ** 2).sum() / n

    hess = torch.autograd.functional.hessian(loss, (weight.detach().flatten(), bias.detach()))
    full = torch.cat([torch.cat([hess[0][0], hess[0][1]], 1), torch.cat([hess[1][0], hess[1][1]], 1)], 0)
    g = 2 * torch.eye(out, dtype=DT)
    if joined:
        xa = torch.cat([x, torch.ones(n, 1, dtype=DT)], 1)
        layer = LayerCurvature("fc", weight, xa.T @ xa / n, g, bias=bias, join_bias=True)
        torch.testing.assert_close(kfac_operator([layer], [weight, bias]).to_dense(), full)
    else:
        layer = LayerCurvature("fc", weight, x.T @ x / n, g, bias=bias)
        expected = torch.block_diag(hess[0][0], hess[1][1])
        torch.testing.assert_close(kfac_operator([layer], [weight, bias]).to_dense(), expected)


def test_conv2d_mse_kfac_is_the_hessian():
    """A Conv2d weight [out, C, kh, kw] flattens as [out, C*kh*kw]: G ⊗ A with A from the unfolded patches."""
    n, c, out, k = 3, 2, 2, 2
    x = torch.randn(n, c, 4, 4, dtype=DT, generator=_gen(80))
    weight = param(out, c, k, k, seed=81)
    y = torch.randn(n, out, 3, 3, dtype=DT, generator=_gen(82))

    def loss(w_flat):
        return ((F.conv2d(x, w_flat.reshape(weight.shape)) - y) ** 2).sum() / n

    hess = torch.autograd.functional.hessian(loss, weight.detach().flatten())
    patches = F.unfold(x, k).transpose(1, 2).reshape(-1, c * k * k)  # [N * T, C*kh*kw]
    layer = LayerCurvature("conv", weight, patches.T @ patches / n, 2 * torch.eye(out, dtype=DT))
    torch.testing.assert_close(kfac_operator([layer], [weight]).to_dense(), hess)


def test_one_sample_ekfac_reproduces_the_rotated_fisher_diagonal():
    """One sample of one linear layer: G = δδᵀ, A = xxᵀ, F = g gᵀ = G ⊗ A; EK-FAC = KFAC = F."""
    out, inp = 3, 4
    x = torch.randn(inp, dtype=DT, generator=_gen(90))
    delta = torch.randn(out, dtype=DT, generator=_gen(91))
    weight = param(out, inp, seed=92)
    g = torch.outer(delta, x)  # the per-sample gradient of <delta, W x>
    fisher = torch.outer(g.flatten(), g.flatten())
    layer = LayerCurvature("fc", weight, torch.outer(x, x), torch.outer(delta, delta))
    layer.correct_eigenvalues(g[None])
    q = torch.kron(layer.eigvecs_G, layer.eigvecs_A)
    torch.testing.assert_close(layer.eigenvalues.flatten(), torch.diagonal(q.T @ fisher @ q), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ekfac_operator([layer]).to_dense(), fisher, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kfac_operator([layer]).to_dense(), fisher, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ functional


def test_ekfac_eigenvalues_dense_and_conv_shapes():
    n, out = 5, 3
    grads = torch.randn(n, out, 2, 2, 2, dtype=DT, generator=_gen(100))  # a conv weight's per-sample grads
    q_g, q_a = orthogonal(out, 101), orthogonal(8, 102)
    flat = grads.reshape(n, -1)
    q = torch.kron(q_g, q_a)
    expected = torch.diagonal(q.T @ (flat.T @ flat / n) @ q).reshape(out, 8)
    torch.testing.assert_close(ekfac_eigenvalues(grads, q_g, q_a), expected)
    torch.testing.assert_close(ekfac_eigenvalues(grads, q_g, q_a, scale=2.0, chunk_bytes=1), 2 * n * expected)


@pytest.mark.parametrize("positions", [1, 3])
def test_ekfac_eigenvalues_sequence_form(positions):
    n, out, inp = 4, 3, 5
    b = torch.randn(n, positions, out, dtype=DT, generator=_gen(110))
    a = torch.randn(n, positions, inp, dtype=DT, generator=_gen(111))
    q_g, q_a = orthogonal(out, 112), orthogonal(inp, 113)
    grads = torch.einsum("nto,nti->noi", b, a)
    expected = ekfac_eigenvalues(grads, q_g, q_a, scale=n)
    # independent: the loop over samples
    loop = sum((q_g.T @ grads[i] @ q_a) ** 2 for i in range(n)) * n
    torch.testing.assert_close(expected, loop)
    torch.testing.assert_close(ekfac_eigenvalues_sequence(b, a, q_g, q_a, scale=n), loop)
    torch.testing.assert_close(ekfac_eigenvalues_sequence(b, a, q_g, q_a, scale=n, chunk_bytes=1), loop)
    if positions == 1:
        torch.testing.assert_close(ekfac_eigenvalues_sequence(b[:, 0], a[:, 0], q_g, q_a), loop / n**2)


def test_correct_eigenvalues_sequence_and_joined():
    n, t, out, inp = 3, 2, 2, 3
    b = torch.randn(n, t, out, dtype=DT, generator=_gen(120))
    a = torch.randn(n, t, inp, dtype=DT, generator=_gen(121))
    w, bias = param(out, inp, seed=122), param(out, seed=123)
    wg = torch.einsum("nto,nti->noi", b, a)
    bg = b.sum(1)
    sep_seq = LayerCurvature("s", w, spd(inp, 124), spd(out, 125), bias=bias).correct_eigenvalues(b=b, a=a)
    sep = LayerCurvature("s", w, spd(inp, 124), spd(out, 125), bias=bias).correct_eigenvalues(wg, bg)
    torch.testing.assert_close(sep_seq.eigenvalues, sep.eigenvalues)
    torch.testing.assert_close(sep_seq.bias_eigenvalues, sep.bias_eigenvalues)
    loop = sum((sep.eigvecs_G.T @ bg[i]) ** 2 for i in range(n)) / n
    torch.testing.assert_close(sep.bias_eigenvalues, loop)
    joined_seq = LayerCurvature("j", w, spd(inp + 1, 126), spd(out, 127), bias=bias, join_bias=True)
    joined_seq.correct_eigenvalues(b=b, a=a)
    joined = LayerCurvature("j", w, spd(inp + 1, 126), spd(out, 127), bias=bias, join_bias=True)
    joined.correct_eigenvalues(wg, bg)
    aug = torch.cat([wg, bg[:, :, None]], 2)
    loop = sum((joined.eigvecs_G.T @ aug[i] @ joined.eigvecs_A) ** 2 for i in range(n)) / n
    torch.testing.assert_close(joined.eigenvalues, loop)
    torch.testing.assert_close(joined_seq.eigenvalues, loop)


# ---------------------------------------------------------------- errors


def test_assembly_errors_and_missing_blocks():
    model = Model()
    stray = param(4, seed=130)
    with pytest.raises(ValueError, match=r"parameter #1 \(shape \[4\]\) is not covered by any logged layer.*missing='identity'"):
        kfac_operator(model.layers, [model.w1, stray])
    op = kfac_operator(model.layers, [model.w1, stray, model.b1], missing="identity")
    assert isinstance(op.blocks[1], ScaledIdentity) and op.names[1] == "<uncovered #1>"
    torch.testing.assert_close(op.to_dense()[12:16, 12:16], torch.eye(4, dtype=DT))
    zero = kfac_operator(model.layers, [stray, model.w1], missing="zero")
    torch.testing.assert_close(zero.inverse(0.5).to_dense()[:4, :4], 2 * torch.eye(4, dtype=DT))
    with pytest.raises(ValueError, match="missing='skip'"):
        kfac_operator(model.layers, [model.w1], missing="skip")
    with pytest.raises(ValueError, match="join_bias=True.*both must be in params, next to each other"):
        kfac_operator(model.layers, [model.w2, model.w1, model.b2])
    with pytest.raises(ValueError, match="join_bias=True.*both must be in params"):
        kfac_operator(model.layers, [model.w2])
    with pytest.raises(ValueError, match="lists a parameter twice"):
        kfac_operator(model.layers, [model.w1, model.w1])
    with pytest.raises(KeyError, match="no logged layer has the parameter 'fc3.weight'"):
        kfac_operator(model.layers, ["fc3.weight"])
    with pytest.raises(ValueError, match="covered by two layers"):
        kfac_operator([model.fc1, LayerCurvature("again", model.w1, spd(4, 1), spd(3, 2))])
    with pytest.raises(ValueError, match="layer names must be unique"):
        kfac_operator([model.fc1, LayerCurvature("fc1", model.w2, spd(3, 1), spd(2, 2))])
    with pytest.raises(ValueError, match=r"factor A must be \[12, 12\] for a weight of shape \[2, 3, 2, 2\], got \[4, 4\]"):
        LayerCurvature("conv", model.wc, spd(4, 1), spd(2, 2))
    with pytest.raises(ValueError, match=r"factor A must be \[4, 4\].*augmented factor"):
        LayerCurvature("fc2", model.w2, spd(3, 1), spd(2, 2), bias=model.b2, join_bias=True)
    with pytest.raises(ValueError, match=r"factor G must be \[3, 3\]"):
        LayerCurvature("fc1", model.w1, spd(4, 1), spd(2, 2))
    with pytest.raises(ValueError, match=r"bias must have shape \[3\]"):
        LayerCurvature("fc1", model.w1, spd(4, 1), spd(3, 2), bias=model.b2)
    with pytest.raises(ValueError, match="eigenvalues must have 3 x 4 = 12 entries"):
        LayerCurvature("fc1", model.w1, spd(4, 1), spd(3, 2), eigenvalues=torch.ones(5, dtype=DT))
    with pytest.raises(ValueError, match="layer 'fc2' has no corrected eigenvalues.*correct_eigenvalues"):
        ekfac_operator(model.layers, model.params)
    with pytest.raises(ValueError, match="join_bias=True needs a bias"):
        LayerCurvature("x", model.w1, spd(5, 1), spd(3, 2), join_bias=True)
    with pytest.raises(ValueError, match="ekfac_eigenvalues: eigvecs_A must be"):
        ekfac_eigenvalues(torch.ones(2, 3, 4, dtype=DT), torch.eye(3, dtype=DT), torch.eye(3, dtype=DT))
    with pytest.raises(ValueError, match="b must be"):
        ekfac_eigenvalues_sequence(torch.ones(2, 3, 4, dtype=DT), torch.ones(2, 2, 4, dtype=DT), torch.eye(4), torch.eye(4))


def test_module_docstring_examples():
    for module in (kfac_module, ekfac_module):
        names = {"torch": torch, "LayerCurvature": LayerCurvature, "kfac_operator": kfac_operator}
        assert doctest.testmod(module, extraglobs=names, optionflags=doctest.ELLIPSIS).failed == 0
