"""cockpit_like.operators against dense float64 matrices: every method, inverses, save/load, errors."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

from cockpit_like import operators
from cockpit_like.operators import (
    BlockDiagonal,
    Eigh,
    KroneckerProduct,
    LinearOperator,
    Permuted,
    ScaledIdentity,
    load,
)
from cockpit_like.operators import base, block_diagonal, eigh, kronecker

DT = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def spd(n, seed, shift=0.1):
    m = torch.randn(n, n, dtype=DT, generator=_gen(seed))
    return m @ m.T + shift * torch.eye(n, dtype=DT)


def symmetric(n, seed):
    """A symmetric, usually indefinite, invertible matrix."""
    m = torch.randn(n, n, dtype=DT, generator=_gen(seed))
    return m + m.T


def orthogonal(n, seed):
    return torch.linalg.qr(torch.randn(n, n, dtype=DT, generator=_gen(seed)))[0]


def vectors(n, k, seed):
    return torch.randn(n, k, dtype=DT, generator=_gen(seed))


def dense_kron(factors):
    out = factors[0].contiguous()
    for f in factors[1:]:
        out = torch.kron(out, f.contiguous())
    return out


def eye(n):
    return torch.eye(n, dtype=DT)


def check_against_dense(op: LinearOperator, dense: torch.Tensor, seed=0, symmetric_op=True):
    """Every method of ``op`` against the dense matrix it stands for."""
    n = dense.shape[0]
    assert op.shape == (n, n) and op.dtype == DT and op.device == dense.device
    torch.testing.assert_close(op.to_dense(), dense, rtol=1e-10, atol=1e-10)
    x = vectors(n, 3, seed)
    torch.testing.assert_close(op @ x, dense @ x, rtol=1e-10, atol=1e-10)  # a batch of columns
    torch.testing.assert_close(op @ x[:, 0], dense @ x[:, 0], rtol=1e-10, atol=1e-10)  # one vector
    torch.testing.assert_close(op.matvec(x[:, 1]), dense @ x[:, 1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(op.T @ x, dense.T @ x, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.T @ op, x.T @ dense, rtol=1e-10, atol=1e-10)  # rows
    torch.testing.assert_close(x[:, 0] @ op, x[:, 0] @ dense, rtol=1e-10, atol=1e-10)
    for value in (op.trace(), op.det(), op.logdet(), op.frobenius_norm()):
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == DT
    torch.testing.assert_close(op.trace(), dense.trace(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(op.frobenius_norm(), torch.linalg.matrix_norm(dense), rtol=1e-10, atol=0)
    sign, logabs = torch.linalg.slogdet(dense)
    op_sign, op_logabs = op.slogdet()
    assert float(op_sign) == float(sign)
    torch.testing.assert_close(op_logabs, logabs, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(op.det(), torch.linalg.det(dense), rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(op.logdet(), torch.logdet(dense), rtol=1e-9, atol=1e-9, equal_nan=True)
    if symmetric_op:
        torch.testing.assert_close(op.eigenvalues(), torch.linalg.eigvalsh(dense), rtol=1e-9, atol=1e-9)


def check_inverse(op: LinearOperator, dense: torch.Tensor, damping: float, strategy="exact", symmetric_op=True):
    n = dense.shape[0]
    inverse = op.inverse(damping=damping, strategy=strategy)
    assert isinstance(inverse, LinearOperator)
    expected = torch.linalg.inv(dense + damping * eye(n))
    check_against_dense(inverse, expected, seed=7, symmetric_op=symmetric_op)
    x = vectors(n, 4, 8)
    torch.testing.assert_close(inverse @ x, torch.linalg.solve(dense + damping * eye(n), x), rtol=1e-9, atol=1e-9)
    return inverse


# ---------------------------------------------------------------- Kronecker


@pytest.mark.parametrize("sizes", [[3, 4], [2, 3, 2], [5]])
def test_kronecker_spd_against_dense(sizes):
    factors = [spd(n, seed) for seed, n in enumerate(sizes)]
    op = KroneckerProduct(factors)
    dense = dense_kron(factors)
    check_against_dense(op, dense)
    # the identities, on the factors themselves
    big = math.prod(sizes)
    torch.testing.assert_close(op.trace(), torch.stack([f.trace() for f in factors]).prod())
    torch.testing.assert_close(op.frobenius_norm(), torch.stack([torch.linalg.matrix_norm(f) for f in factors]).prod())
    logdet = sum(big // f.shape[0] * torch.logdet(f) for f in factors)
    torch.testing.assert_close(op.logdet(), logdet, rtol=1e-12, atol=1e-10)
    check_inverse(op, dense, 0.0)
    exact = check_inverse(op, dense, 0.3)
    assert isinstance(exact, Eigh) and isinstance(exact.vectors, KroneckerProduct)


@pytest.mark.parametrize("sizes", [[2, 3], [3, 2, 2]])
def test_kronecker_general_symmetric(sizes):
    factors = [symmetric(n, 10 + seed) for seed, n in enumerate(sizes)]
    op = KroneckerProduct(factors)
    dense = dense_kron(factors)
    check_against_dense(op, dense)
    check_inverse(op, dense, 0.0)
    check_inverse(op, dense, 0.25)  # exact damping through the (indefinite) factors' eigendecompositions


def test_kronecker_logdet_sign_cases():
    """det < 0 gives nan (as torch.logdet), an even power of a negative factor determinant gives det > 0."""
    neg = torch.diag(torch.tensor([-1.0, 2.0], dtype=DT))
    pos3 = spd(3, 1)
    odd = KroneckerProduct([neg, torch.diag(torch.tensor([3.0], dtype=DT))])  # det = (-2)^1 * 3^2
    assert float(odd.det()) == pytest.approx(-18.0) and math.isnan(float(odd.logdet()))
    even = KroneckerProduct([neg, spd(2, 2)])  # power 2 of det(neg) < 0
    dense = dense_kron(even.factors)
    assert float(even.det()) > 0
    torch.testing.assert_close(even.logdet(), torch.logdet(dense))
    mixed = KroneckerProduct([neg, pos3])  # power 3: negative
    assert float(mixed.slogdet()[0]) == -1.0 == float(torch.linalg.slogdet(dense_kron(mixed.factors))[0])


def test_kronecker_rank_deficient_factors_exact_damping():
    """Fewer samples than inputs: PSD factors with (round-off) zero eigenvalues; F + λI is invertible."""
    x = torch.randn(3, 6, dtype=DT, generator=_gen(70))
    d = torch.randn(3, 4, dtype=DT, generator=_gen(71))
    factors = [d.T @ d, x.T @ x / 3]  # ranks 3 of 4 and 3 of 6
    op = KroneckerProduct(factors)
    dense = dense_kron(factors)
    for damping in (1e-5, 1e-2):
        inverse = op.inverse(damping)
        x_in = vectors(24, 2, 72)
        expected = torch.linalg.solve(dense + damping * eye(24), x_in)
        torch.testing.assert_close(inverse @ x_in, expected, rtol=1e-7, atol=1e-9 * float(expected.abs().max()))
        assert bool((inverse.values > 0).all())
    with pytest.raises(ValueError, match=r"factor 0 \(shape \[4, 4\]\) is singular"):
        op.inverse()
    # float32, damping tiny relative to the scale: still an inverse, no error
    single = KroneckerProduct([f.float() * 1e3 for f in factors]).inverse(1e-3)
    assert bool(torch.isfinite(single.values).all()) and float(single.values.max()) <= 1e3 * (1 + 1e-5)
    # an indefinite factor with damping = minus one of its eigenvalues
    indefinite = KroneckerProduct([torch.diag(torch.tensor([-1.0, 2.0], dtype=DT)), eye(2)])
    with pytest.raises(ValueError, match="eigenvalue -1.0 .*singular; choose another damping"):
        indefinite.inverse(1.0)
    with pytest.raises(ValueError, match="heuristic'\\): damped factor 0 is singular"):
        KroneckerProduct([torch.diag(torch.tensor([-1.0, 2.0], dtype=DT))]).inverse(1.0, strategy="heuristic")
    zero_eigh = Eigh(torch.tensor([0.0, 2.0], dtype=DT), eye(2))
    torch.testing.assert_close(zero_eigh.inverse(0.5).values, torch.tensor([2.0, 0.4], dtype=DT))


def test_kronecker_nonsymmetric_factors_transpose_and_inverse():
    factors = [orthogonal(3, 1), torch.randn(2, 2, dtype=DT, generator=_gen(2)) + 3 * eye(2)]
    op = KroneckerProduct(factors)
    dense = dense_kron(factors)
    check_against_dense(op, dense, symmetric_op=False)
    check_against_dense(op.T, dense.T, symmetric_op=False)
    check_inverse(op, dense, 0.0, symmetric_op=False)
    with pytest.raises(ValueError, match="needs symmetric factors; factor 0 is not symmetric"):
        op.inverse(damping=0.1)
    with pytest.raises(ValueError, match="symmetric"):
        op.eigenvalues()


@pytest.mark.parametrize("sizes", [[3, 4], [2, 3, 2]])
def test_kronecker_heuristic_damping_against_its_dense_formula(sizes):
    factors = [spd(n, 20 + seed) * (seed + 1) for seed, n in enumerate(sizes)]
    op = KroneckerProduct(factors)
    damping = 0.4
    m = len(factors)
    means = [float(f.trace()) / f.shape[0] for f in factors]
    geo = math.prod(means) ** (1 / m)
    damped = [f + (t / geo) * damping ** (1 / m) * eye(f.shape[0]) for f, t in zip(factors, means)]
    if m == 2:  # Martens & Grosse's form: (A + pi sqrt(lambda) I) ⊗ (B + sqrt(lambda)/pi I)
        a, b = factors
        pi = math.sqrt((float(a.trace()) / a.shape[0]) / (float(b.trace()) / b.shape[0]))
        damped_mg = [a + pi * math.sqrt(damping) * eye(a.shape[0]), b + math.sqrt(damping) / pi * eye(b.shape[0])]
        for mine, theirs in zip(damped, damped_mg):
            torch.testing.assert_close(mine, theirs)
    expected = torch.linalg.inv(dense_kron(damped))
    inverse = op.inverse(damping=damping, strategy="heuristic")
    assert isinstance(inverse, KroneckerProduct)
    check_against_dense(inverse, expected)
    # it is not the exact damped inverse
    exact = torch.linalg.inv(dense_kron(factors) + damping * eye(op.shape[0]))
    assert (inverse.to_dense() - exact).abs().max() > 1e-3
    # without damping both strategies are the plain inverse
    torch.testing.assert_close(
        op.inverse(0.0, strategy="heuristic").to_dense(), torch.linalg.inv(dense_kron(factors)), rtol=1e-9, atol=1e-9
    )


# --------------------------------------------------------------------- Eigh


def test_eigh_with_tensor_q():
    q = orthogonal(5, 3)
    values = torch.tensor([3.0, 0.5, 2.0, 1.5, 0.25], dtype=DT)
    op = Eigh(values, q)
    dense = q @ torch.diag(values) @ q.T
    check_against_dense(op, dense)
    check_inverse(op, dense, 0.0)
    inverse = check_inverse(op, dense, 0.7)
    torch.testing.assert_close(inverse.values, 1 / (values + 0.7))
    # the strategy makes no difference for an eigen-decomposed operator
    torch.testing.assert_close(op.inverse(0.7, strategy="heuristic").to_dense(), inverse.to_dense())


def test_eigh_with_kronecker_q_is_not_a_kronecker_of_eigenvalues():
    q_g, q_a = orthogonal(3, 4), orthogonal(4, 5)
    values = torch.rand(12, dtype=DT, generator=_gen(6)) + 0.1  # a full vector (EK-FAC), not λ_G ⊗ λ_A
    op = Eigh(values, KroneckerProduct([q_g, q_a]))
    q = torch.kron(q_g, q_a)
    dense = q @ torch.diag(values) @ q.T
    check_against_dense(op, dense)
    check_inverse(op, dense, 0.0)
    check_inverse(op, dense, 0.05)
    # the matrix form Q_G [(Q_Gᵀ V Q_A) ⊙ Λ] Q_Aᵀ
    v = vectors(12, 1, 9)[:, 0]
    matrix = q_g @ ((q_g.T @ v.reshape(3, 4) @ q_a) * values.reshape(3, 4)) @ q_a.T
    torch.testing.assert_close(op @ v, matrix.reshape(-1))


def test_eigh_indefinite_det_and_logdet():
    q = orthogonal(4, 11)
    values = torch.tensor([-2.0, 1.0, 3.0, 0.5], dtype=DT)
    op = Eigh(values, q)
    dense = q @ torch.diag(values) @ q.T
    check_against_dense(op, dense)  # det < 0: logdet nan, as torch.logdet
    assert math.isnan(float(op.logdet()))
    check_inverse(op, dense, 0.0)
    check_inverse(op, dense, 1.0)  # eigenvalues -1, 2, 4, 1.5: invertible


# ------------------------------------------------------ BlockDiagonal & co


def mixed_blocks():
    g, a = spd(2, 30), spd(3, 31)
    kron = KroneckerProduct([g, a])
    q_g, q_a = torch.linalg.eigh(g)[1], torch.linalg.eigh(a)[1]
    ekfac = Eigh(torch.rand(6, dtype=DT, generator=_gen(32)) + 0.2, KroneckerProduct([q_g, q_a]))
    tensor_eigh = Eigh(torch.tensor([1.0, 2.5, 0.3], dtype=DT), orthogonal(3, 33))
    single = KroneckerProduct([spd(4, 34)])
    identity = ScaledIdentity(2, 1.5, DT)
    perm = torch.tensor([2, 0, 1, 5, 3, 4])
    permuted = Permuted(KroneckerProduct([spd(3, 35), spd(2, 36)]), perm)
    blocks = [kron, ekfac, tensor_eigh, single, identity, permuted]
    names = ["fc1.weight", "fc2.weight", "fc3.weight", "fc1.bias", "other", "joined"]
    return blocks, names


def test_permuted_against_dense():
    inner = KroneckerProduct([spd(3, 35), spd(2, 36)])
    perm = torch.tensor([2, 0, 1, 5, 3, 4])
    op = Permuted(inner, perm)
    p = torch.eye(6, dtype=DT)[perm]  # (P A Pᵀ)[i, j] = A[p_i, p_j]
    dense = p @ inner.to_dense() @ p.T
    check_against_dense(op, dense)
    check_inverse(op, dense, 0.0)
    check_inverse(op, dense, 0.2)


def test_scaled_identity_against_dense():
    op = ScaledIdentity(3, -2.0, DT)
    dense = -2.0 * eye(3)
    check_against_dense(op, dense)
    check_inverse(op, dense, 0.0)
    check_inverse(op, dense, 0.5)
    assert ScaledIdentity(2, 1.0, DT).to(torch.float32).dtype == torch.float32


def test_block_diagonal_of_mixed_blocks():
    blocks, names = mixed_blocks()
    op = BlockDiagonal(blocks, names)
    dense = torch.block_diag(*(b.to_dense() for b in blocks))
    check_against_dense(op, dense)
    check_inverse(op, dense, 0.0)
    check_inverse(op, dense, 0.1)
    torch.testing.assert_close(
        op.inverse(0.1, strategy="heuristic").to_dense(),
        torch.block_diag(*(b.inverse(0.1, strategy="heuristic").to_dense() for b in blocks)),
    )
    assert op.block("fc3.weight") is blocks[2] and op.block(0) is blocks[0]
    x = vectors(op.shape[0], 2, 40)
    s = op.slice("fc1.bias")
    torch.testing.assert_close((op @ x)[s], blocks[3] @ x[s])
    nested = BlockDiagonal([op, KroneckerProduct([spd(2, 41)])])
    check_against_dense(nested, torch.block_diag(dense, spd(2, 41)))


# ------------------------------------------------------------- save / load


def test_save_load_round_trips(tmp_path):
    blocks, names = mixed_blocks()
    op = BlockDiagonal(blocks + [BlockDiagonal([KroneckerProduct([spd(2, 50)])])], names + ["nested"])
    dense = op.to_dense()
    # plain torch.save of the object (no model inside)
    torch.save(op, tmp_path / "op.pt")
    back = torch.load(tmp_path / "op.pt", weights_only=False)
    torch.testing.assert_close(back.to_dense(), dense, rtol=0, atol=0)
    assert back.names == names + ["nested"]
    # op.save writes a plain dict: weights_only=True works
    op.save(tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert isinstance(state, dict) and state["type"] == "BlockDiagonal"
    for loaded in (load(tmp_path / "state.pt"), LinearOperator.load(tmp_path / "state.pt"), LinearOperator.from_state_dict(state)):
        torch.testing.assert_close(loaded.to_dense(), dense, rtol=0, atol=0)
        assert [type(b).__name__ for b in loaded.blocks] == [type(b).__name__ for b in op.blocks]
        x = vectors(op.shape[0], 2, 51)
        torch.testing.assert_close(loaded.inverse(0.2) @ x, op.inverse(0.2) @ x, rtol=0, atol=0)
    # the inverse (an Eigh over a Kronecker basis) round-trips too
    inverse = KroneckerProduct([spd(2, 52), spd(3, 53)]).inverse(0.5)
    inverse.save(tmp_path / "inv.pt")
    torch.testing.assert_close(load(tmp_path / "inv.pt").to_dense(), inverse.to_dense(), rtol=0, atol=0)
    # dtype conversion
    single = op.to(torch.float32)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.to_dense(), dense.float())
    assert single.block("joined").permutation.dtype == torch.long  # index tensors keep their dtype


# ----------------------------------------------------------------- errors


def test_error_messages():
    op = KroneckerProduct([spd(2, 60), spd(3, 61)])
    with pytest.raises(ValueError, match=r"shape \(6, 6\) cannot multiply a tensor of shape \[5\]: expected a vector of size 6"):
        op @ torch.ones(5, dtype=DT)
    with pytest.raises(ValueError, match=r"expected a vector of size 6 or a matrix \[6, k\]"):
        op @ torch.ones(2, 3, dtype=DT)
    with pytest.raises(ValueError, match="dtype"):
        op @ torch.ones(6, dtype=torch.float32)
    with pytest.raises(ValueError, match="is on cpu but the vector is on meta"):
        op @ torch.ones(6, dtype=DT, device="meta")
    with pytest.raises(TypeError, match="products of operators"):
        op @ op
    singular = KroneckerProduct([spd(2, 62), torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=DT)])
    with pytest.raises(ValueError, match=r"factor 1 \(shape \[2, 2\]\) is singular.*pass damping > 0"):
        singular.inverse()
    with pytest.raises(ValueError, match=r"factor 1 \(shape \[2, 2\]\) is singular"):
        singular.inverse(0.0, strategy="heuristic")
    singular.inverse(damping=0.1)  # fine with damping
    with pytest.raises(ValueError, match="damping must be a float >= 0"):
        op.inverse(damping=-1.0)
    with pytest.raises(ValueError, match="unknown strategy"):
        op.inverse(damping=1.0, strategy="pi")
    with pytest.raises(ValueError, match="must be a square matrix"):
        KroneckerProduct([torch.ones(2, 3, dtype=DT)])
    with pytest.raises(ValueError, match="non-empty list"):
        KroneckerProduct([])
    with pytest.raises(ValueError, match="eigenvalue 1 plus damping is 0.*pass damping > 0"):
        Eigh(torch.tensor([1.0, 0.0], dtype=DT), eye(2)).inverse()
    with pytest.raises(ValueError, match="3 eigenvalues but eigenvectors of shape"):
        Eigh(torch.ones(3, dtype=DT), eye(2))
    blocks = BlockDiagonal([op, singular], ["fc1.weight", "fc2.weight"])
    with pytest.raises(KeyError, match=r"operator has blocks \['fc1.weight', 'fc2.weight'\]; layer 'fc3' was not logged"):
        blocks.block("fc3")
    with pytest.raises(KeyError, match=r"layer 'fc1' has the blocks \['fc1.weight'\]: ask for one"):
        blocks.block("fc1")
    with pytest.raises(ValueError, match="block 'fc2.weight': .*factor 1.*singular"):
        blocks.inverse()
    with pytest.raises(ValueError, match="names must be unique"):
        BlockDiagonal([op, op], ["a", "a"])
    with pytest.raises(TypeError, match="not a LinearOperator"):
        BlockDiagonal([eye(2)])
    with pytest.raises(ValueError, match="permutation of range"):
        Permuted(op, torch.tensor([0, 0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="unknown operator type"):
        LinearOperator.from_state_dict({"type": "Nope", "version": 1})
    with pytest.raises(ValueError, match="ScaledIdentity.*singular"):
        ScaledIdentity(2, 0.0, DT).inverse()


@pytest.mark.parametrize("module", [operators, base, kronecker, eigh, block_diagonal])
def test_docstring_examples(module):
    names = {"torch": torch, **{name: getattr(operators, name) for name in operators.__all__}}
    result = doctest.testmod(module, extraglobs=names, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
