"""ihvp_kfac / ihvp_ekfac against torch.linalg.solve with the dense operator (float64)."""

from __future__ import annotations

import doctest

import pytest
import torch

from cockpit_like.ihvp import InverseProduct, ihvp_ekfac, ihvp_kfac
from cockpit_like.ihvp import products as products_module
from cockpit_like.operators import LayerCurvature, ekfac_operator, kfac_operator

from tests.operator_helpers import DT, param, spd
from tests.operator_helpers import gen as _gen


def make_layers(ekfac=True):
    w1, b1 = param(3, 4, seed=1), param(3, seed=2)
    wc = param(2, 2, 2, 2, seed=3)
    w2, b2 = param(2, 3, seed=4), param(2, seed=5)
    layers = [
        LayerCurvature("fc1", w1, spd(4, 10), spd(3, 11), bias=b1),
        LayerCurvature("conv", wc, spd(8, 12), spd(2, 13)),
        LayerCurvature("fc2", w2, spd(4, 14), spd(2, 15), bias=b2, join_bias=True),
    ]
    if ekfac:
        for seed, layer in enumerate(layers):
            n = 5
            wg = torch.randn(n, *layer.weight.shape, dtype=DT, generator=_gen(20 + seed))
            bg = None if layer.bias is None else torch.randn(n, layer.out_features, dtype=DT, generator=_gen(30 + seed))
            layer.correct_eigenvalues(wg, bg, scale=n)
    params = [wc, b1, b2, w2, w1]  # shuffled relative to the layers
    return layers, params


def dense_solve(dense, damping, v_columns):
    return torch.linalg.solve(dense + damping * torch.eye(len(dense), dtype=DT), v_columns)


@pytest.mark.parametrize("kind", ["kfac", "kfac-heuristic", "ekfac"])
@pytest.mark.parametrize("damping", [0.0, 0.05])
def test_ihvp_against_solve_flat_and_listed(kind, damping):
    layers, params = make_layers()
    if kind == "ekfac":
        dense = ekfac_operator(layers, params).to_dense()
        ihvp = ihvp_ekfac(layers, damping, params=params)
        reference = lambda v: dense_solve(dense, damping, v)  # noqa: E731
    elif kind == "kfac":
        dense = kfac_operator(layers, params).to_dense()
        ihvp = ihvp_kfac(layers, damping, params=params)
        reference = lambda v: dense_solve(dense, damping, v)  # noqa: E731
    else:
        # the heuristic's dense twin: block by block, (G + π√λ I) ⊗ (A + √λ/π I) with π from the traces
        ihvp = ihvp_kfac(layers, damping, params=params, strategy="heuristic")
        blocks = []
        for op_block in kfac_operator(layers, params).blocks:
            inner = getattr(op_block, "operator", op_block)
            damped = []
            if len(inner.factors) == 1:
                damped = [inner.factors[0] + damping * torch.eye(inner.sizes[0], dtype=DT)]
            else:
                g, a = inner.factors
                pi = ((g.trace() / len(g)) / (a.trace() / len(a))).sqrt()
                root = damping**0.5
                damped = [g + pi * root * torch.eye(len(g), dtype=DT), a + root / pi * torch.eye(len(a), dtype=DT)]
            block = damped[0] if len(damped) == 1 else torch.kron(damped[0], damped[1])
            if inner is not op_block:  # the joined layer's re-ordering
                p = op_block.permutation
                block = block[p][:, p]
            blocks.append(block)
        dense = torch.block_diag(*blocks)
        reference = lambda v: torch.linalg.solve(dense, v)  # noqa: E731
    assert isinstance(ihvp, InverseProduct) and ihvp.dimension == sum(p.numel() for p in params)
    d = ihvp.dimension
    v = torch.randn(d, dtype=DT, generator=_gen(40))
    batch = torch.randn(4, d, dtype=DT, generator=_gen(41))
    torch.testing.assert_close(ihvp(v), reference(v[:, None])[:, 0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ihvp(batch), reference(batch.T).T, rtol=1e-9, atol=1e-9)
    # list forms: one tensor per parameter, in the parameters' shapes
    sizes = [p.numel() for p in params]
    listed = [part.reshape(p.shape) for part, p in zip(v.split(sizes), params)]
    out = ihvp(listed)
    assert [o.shape for o in out] == [p.shape for p in params]
    torch.testing.assert_close(torch.cat([o.flatten() for o in out]), ihvp(v), rtol=1e-12, atol=1e-12)
    listed_batch = [part.reshape(4, *p.shape) for part, p in zip(batch.split(sizes, dim=1), params)]
    out_batch = ihvp(listed_batch)
    assert [o.shape for o in out_batch] == [(4, *p.shape) for p in params]
    flat_out = torch.cat([o.reshape(4, -1) for o in out_batch], dim=1)
    torch.testing.assert_close(flat_out, ihvp(batch), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("builder", [ihvp_kfac, ihvp_ekfac])
def test_ihvp_on_a_subset_of_parameters(builder):
    layers, _ = make_layers()
    fc1, conv, _ = layers
    subset = [fc1.bias, conv.weight]
    damping = 0.1
    ihvp = builder(layers, damping, params=subset)
    assert ihvp.names == ["fc1.bias", "conv.weight"]
    build = kfac_operator if builder is ihvp_kfac else ekfac_operator
    full = build(layers).to_dense()
    # the subset's blocks, picked from the full model's dense matrix by index
    starts, start = {}, 0
    for layer in layers:
        for role, p in zip(("weight", "bias"), layer.parameters()):
            starts[f"{layer.name}.{role}"] = (start, p.numel())
            start += p.numel()
    index = torch.cat([torch.arange(s, s + n) for s, n in (starts["fc1.bias"], starts["conv.weight"])])
    dense = full[index][:, index]
    v = torch.randn(len(index), 2, dtype=DT, generator=_gen(50))
    torch.testing.assert_close(ihvp(v.T).T, dense_solve(dense, damping, v), rtol=1e-9, atol=1e-9)
    by_name = builder(layers, damping, params=["fc1.bias", "conv.weight"])
    torch.testing.assert_close(by_name(v.T), ihvp(v.T), rtol=0, atol=0)


def test_ihvp_from_an_operator():
    layers, params = make_layers()
    op = ekfac_operator(layers, params)
    damping = 0.2
    dense = op.to_dense()
    ihvp = ihvp_ekfac(op, damping)
    v = torch.randn(op.shape[0], dtype=DT, generator=_gen(60))
    torch.testing.assert_close(ihvp(v), dense_solve(dense, damping, v[:, None])[:, 0], rtol=1e-9, atol=1e-9)
    sub = ihvp_kfac(kfac_operator(layers, params), damping, params=["fc1.weight"])
    fc1 = layers[0]
    w = torch.randn(3, 4, dtype=DT, generator=_gen(61))
    expected = dense_solve(torch.kron(fc1.G, fc1.A), damping, w.reshape(-1, 1)).reshape(3, 4)
    torch.testing.assert_close(sub([w])[0], expected, rtol=1e-9, atol=1e-9)


def test_ihvp_layerwise_matrix_form():
    """EK-FAC: Q_G [(Q_Gᵀ V Q_A) ⊘ (Λ + λ)] Q_Aᵀ on the [out, in] block, written out here."""
    layers, _ = make_layers()
    fc1 = layers[0]
    damping = 0.03
    v = torch.randn(3, 4, dtype=DT, generator=_gen(70))
    q_g, q_a = fc1.eigvecs_G, fc1.eigvecs_A
    expected = q_g @ ((q_g.T @ v @ q_a) / (fc1.eigenvalues.reshape(3, 4) + damping)) @ q_a.T
    torch.testing.assert_close(ihvp_ekfac(layers, damping, params=[fc1.weight])([v])[0], expected)


def test_ihvp_errors():
    layers, params = make_layers()
    ihvp = ihvp_kfac(layers, 0.1, params=params)
    d = ihvp.dimension
    with pytest.raises(ValueError, match=rf"expected a vector of size {d} .* or a batch \[k, {d}\], got shape \[5\]"):
        ihvp(torch.ones(5, dtype=DT))
    with pytest.raises(ValueError, match="got 2 tensors for 5 parameters"):
        ihvp([torch.ones(8, dtype=DT), torch.ones(3, dtype=DT)])
    with pytest.raises(ValueError, match=r"the entry for 'conv.weight' has shape \[7\]; expected 16 entries"):
        ihvp([torch.ones(7, dtype=DT)] + [torch.ones(p.shape, dtype=DT) for p in params[1:]])
    with pytest.raises(ValueError, match="mix of single vectors and batches"):
        ihvp([torch.ones(2, *params[0].shape, dtype=DT)] + [torch.ones(p.shape, dtype=DT) for p in params[1:]])
    with pytest.raises(TypeError, match="must be a tensor"):
        ihvp("v")
    stray = param(3, seed=80)
    with pytest.raises(ValueError, match=r"parameter #1 \(shape \[3\]\) is not covered by any logged layer"):
        ihvp_kfac(layers, 0.1, params=[params[0], stray])
    with pytest.raises(KeyError, match="no logged layer has the parameter 'fc9.weight'"):
        ihvp_kfac(layers, 0.1, params=["fc9.weight"])
    with pytest.raises(KeyError, match="layer 'fc9' was not logged"):
        ihvp_kfac(kfac_operator(layers), 0.1, params=["fc9"])
    with pytest.raises(TypeError, match="an operator holds no parameters"):
        ihvp_kfac(kfac_operator(layers), 0.1, params=[params[0]])
    with pytest.raises(ValueError, match="damping must be a float >= 0"):
        ihvp_kfac(layers, -1.0)
    with pytest.raises(ValueError, match="no corrected eigenvalues"):
        ihvp_ekfac(make_layers(ekfac=False)[0], 0.1)
    singular = [LayerCurvature("s", param(2, 2, seed=81), torch.zeros(2, 2, dtype=DT), torch.eye(2, dtype=DT))]
    with pytest.raises(ValueError, match=r"block 's.weight': .*factor 1 .* is singular.*damping > 0"):
        ihvp_kfac(singular, 0.0)
    with pytest.raises(ValueError, match="dtype"):
        ihvp(torch.ones(d, dtype=torch.float32))


def test_docstring_examples():
    names = {"torch": torch, "LayerCurvature": LayerCurvature}
    assert doctest.testmod(products_module, extraglobs=names).failed == 0
