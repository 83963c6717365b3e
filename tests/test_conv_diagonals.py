"""Chunked Conv2d curvature diagonals (cockpit_like.backends.conv_diagonals), float64.

Each diagonal is compared with (a) BackPACK's own extension where BackPACK can
compute it and (b) a brute force independent of BackPACK: the diagonal of the
dense Hessian of the mean loss (``torch.func.hessian``) for ``diag_h``, and
``diag(J^T H_f J)`` with the network Jacobian ``J`` (``torch.func.jacrev``) and
the loss Hessian w.r.t. the network output ``H_f`` for ``diag_ggn_exact``.
``diag_ggn_mc`` is random: it must equal BackPACK's ``DiagGGNMC`` under the
same torch seed.
"""

from __future__ import annotations

import pytest
import torch
from backpack import backpack, extend
from backpack.extensions import DiagGGNExact, DiagGGNMC, DiagHessian, KFAC
from torch import nn
from torch.func import functional_call, hessian, jacrev

from cockpit_like import Cockpit
from cockpit_like.backends import conv_diagonals
from cockpit_like.backends.conv_diagonals import (
    ChunkedDiagHConv2d,
    _ReducedCrossEntropyDerivatives,
    conv2d_weight_diagonal,
    diag_ggn_exact,
    diag_ggn_mc,
    diag_hessian,
    use_chunked_conv2d,
)
from cockpit_like.backends.extensions import describe, merge_extensions
from cockpit_like.quantities import HessTrace, KFACTrace, TICDiag
from cockpit_like.quantities.curvature import CURVATURES
from cockpit_like.utils import schedules
from tests.helpers import make_batch, make_problem, plain_copy, train

DTYPE = torch.float64
CLASSES = 3


def _net(name: str, bias: bool = True) -> tuple[nn.Module, tuple[int, ...]]:
    """Small conv nets, each ending in ``CLASSES`` outputs, and their input shape."""
    torch.manual_seed(7)
    nets = {
        # stride 2 and padding; Sigmoid gives DiagHessian residual terms of both signs
        "stride": (lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=bias), nn.Sigmoid(),
            nn.Conv2d(3, 2, 2, stride=1, bias=bias), nn.Flatten(), nn.LazyLinear(CLASSES, bias=bias),
        ), (2, 7, 7)),
        # 'same' padding with an odd kernel (BackPACK cannot backpropagate through 'same', so first)
        "same_odd": (lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding="same", bias=bias), nn.Tanh(), nn.Flatten(), nn.LazyLinear(CLASSES, bias=bias),
        ), (2, 5, 5)),
        # 'same' padding with an even kernel and dilation (asymmetric padding)
        "same_even_dilated": (lambda: nn.Sequential(
            nn.Conv2d(2, 3, 4, padding="same", dilation=2, bias=bias), nn.Tanh(),
            nn.Flatten(), nn.LazyLinear(CLASSES, bias=bias),
        ), (2, 6, 5)),
        # dilation with explicit padding, then ReLU, MaxPool and a Linear layer
        "dilated_pool": (lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, dilation=2, padding=2, bias=bias), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 3, 2, bias=bias), nn.ReLU(), nn.Flatten(), nn.LazyLinear(CLASSES, bias=bias),
        ), (2, 8, 8)),
    }
    factory, shape = nets[name]
    model = factory().to(DTYPE)
    model(torch.zeros(1, *shape, dtype=DTYPE))  # materialize the lazy layer
    return model, shape


def _data(shape, batch_size: int, loss: str, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, *shape, generator=generator, dtype=DTYPE)
    if loss == "ce":
        targets = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    else:
        targets = torch.randn(batch_size, CLASSES, generator=generator, dtype=DTYPE)
    return inputs, targets


def _lossfunc(loss: str) -> nn.Module:
    return nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss()


def _backpack_diagonals(model, inputs, targets, loss, extension, seed=0):
    """The extension's savefield on every parameter after one backward pass of the mean loss."""
    model = extend(model)
    lossfunc = extend(_lossfunc(loss))
    model.zero_grad()
    value = lossfunc(model(inputs), targets)
    torch.manual_seed(seed)
    with backpack(extension):
        value.backward()
    diagonals = [getattr(p, extension.savefield).detach().clone() for p in model.parameters()]
    for param in model.parameters():
        delattr(param, extension.savefield)
    return diagonals


def _brute_force(model, inputs, targets, loss, curvature):
    """Per-parameter diagonals of the dense Hessian or of the exact GGN, without BackPACK."""
    model = plain_copy(model)
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lossfunc = _lossfunc(loss)

    def outputs(vector):
        params = {n: piece.reshape(s) for n, piece, s in zip(names, vector.split(sizes), shapes)}
        return functional_call(model, params, (inputs,))

    if curvature == "diag_h":
        diagonal = hessian(lambda vector: lossfunc(outputs(vector), targets))(flat).diagonal()
    else:
        logits = outputs(flat).detach()
        jac = jacrev(outputs)(flat).reshape(logits.numel(), -1)  # [B * C, D]
        hess_f = hessian(lambda f: lossfunc(f.reshape(logits.shape), targets))(logits.reshape(-1))
        diagonal = torch.einsum("id,ij,jd->d", jac, hess_f, jac)
    return [piece.reshape(s) for piece, s in zip(diagonal.split(sizes), shapes)]


def _assert_all_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-13)


NETS = ["stride", "same_odd", "same_even_dilated", "dilated_pool"]
BACKPACK_CANNOT = {"same_odd", "same_even_dilated"}  # BackPACK's unfold rejects padding='same'


@pytest.mark.parametrize("batch_size", [1, 5])
@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("net", NETS)
@pytest.mark.parametrize(
    "curvature,ours,theirs", [("diag_h", diag_hessian, DiagHessian), ("diag_ggn_exact", diag_ggn_exact, DiagGGNExact)]
)
def test_against_backpack_and_brute_force(curvature, ours, theirs, net, loss, batch_size):
    model, shape = _net(net, bias=net != "dilated_pool" or batch_size == 1)
    inputs, targets = _data(shape, batch_size, loss)
    mine = _backpack_diagonals(model, inputs, targets, loss, ours())
    _assert_all_close(mine, _brute_force(model, inputs, targets, loss, curvature))
    if net not in BACKPACK_CANNOT:
        _assert_all_close(mine, _backpack_diagonals(model, inputs, targets, loss, theirs()))


@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("net,bias,batch_size", [("stride", True, 5), ("dilated_pool", False, 1), ("dilated_pool", True, 4)])
def test_diag_ggn_mc_equals_backpack_under_the_same_seed(net, bias, batch_size, loss):
    model, shape = _net(net, bias=bias)
    inputs, targets = _data(shape, batch_size, loss)
    for seed in (0, 1):
        mine = _backpack_diagonals(model, inputs, targets, loss, diag_ggn_mc(), seed=seed)
        theirs = _backpack_diagonals(model, inputs, targets, loss, DiagGGNMC(mc_samples=1), seed=seed)
        _assert_all_close(mine, theirs)
    two = _backpack_diagonals(model, inputs, targets, loss, diag_ggn_mc(mc_samples=2), seed=5)
    _assert_all_close(two, _backpack_diagonals(model, inputs, targets, loss, DiagGGNMC(mc_samples=2), seed=5))


class _Spy:
    """Counts calls of conv2d_weight_diagonal (the chunked path)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = conv_diagonals.conv2d_weight_diagonal

        def spy(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(conv_diagonals, "conv2d_weight_diagonal", spy)


@pytest.mark.parametrize("curvature,ours,theirs", [("diag_h", diag_hessian, DiagHessian), ("diag_ggn_exact", diag_ggn_exact, DiagGGNExact)])
def test_grouped_conv_falls_back_to_backpack(monkeypatch, curvature, ours, theirs):
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, bias=False), nn.Sigmoid(), nn.Conv2d(4, 4, 2, groups=2), nn.Flatten(), nn.Linear(36, CLASSES)
    ).to(DTYPE)
    inputs, targets = _data((2, 6, 6), 3, "ce")
    spy = _Spy(monkeypatch)
    mine = _backpack_diagonals(model, inputs, targets, "ce", ours())
    assert spy.calls == 1  # the groups=1 conv only
    _assert_all_close(mine, _brute_force(model, inputs, targets, "ce", curvature))
    _assert_all_close(mine, _backpack_diagonals(model, inputs, targets, "ce", theirs()))


def test_non_zero_padding_mode_falls_back_to_backpack(monkeypatch):
    """BackPACK treats 'reflect' like zero padding; both extensions must still agree."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(75, CLASSES))
    model = model.to(DTYPE)
    inputs, targets = _data((2, 5, 5), 4, "ce")
    spy = _Spy(monkeypatch)
    for ours, theirs in [(diag_hessian, DiagHessian), (diag_ggn_exact, DiagGGNExact)]:
        mine = _backpack_diagonals(model, inputs, targets, "ce", ours())
        _assert_all_close(mine, _backpack_diagonals(model, inputs, targets, "ce", theirs()))
    assert spy.calls == 0


def _einsum_reference(unfolded, factors, signs):
    total = 0
    for factor, sign in zip(factors, signs):
        factor = factor.flatten(start_dim=3)
        total = total + sign * torch.einsum("vbol,bkl->vbok", factor, unfolded).pow(2).sum((0, 1))
    return total


@pytest.mark.parametrize("num_v,batch", [(3, 5), (7, 2), (1, 1)])
@pytest.mark.parametrize("chunk_bytes", [1, 200, 10**9])
def test_weight_diagonal_in_chunks(num_v, batch, chunk_bytes):
    """Any chunk size (one column per chunk up to everything at once), V < B and V > B, signed sums."""
    generator = torch.Generator().manual_seed(num_v + batch)
    unfolded = torch.randn(batch, 6, 10, generator=generator, dtype=DTYPE)
    factors = [torch.randn(num_v, batch, 4, 2, 5, generator=generator, dtype=DTYPE) for _ in range(2)]
    factors.append(torch.randn(num_v, batch, 4, 2, 5, generator=generator, dtype=DTYPE).transpose(0, 1).contiguous().transpose(0, 1))
    signs = [1.0, -1.0, 1.0]
    result = conv2d_weight_diagonal(unfolded, factors, signs, 4, chunk_bytes=chunk_bytes)
    torch.testing.assert_close(result, _einsum_reference(unfolded, factors, signs), rtol=1e-12, atol=1e-12)


def test_factories_keep_backpack_types_settings_and_other_layers():
    for make, cls, field in [
        (diag_hessian, DiagHessian, "diag_h"),
        (diag_ggn_exact, DiagGGNExact, "diag_ggn_exact"),
        (diag_ggn_mc, DiagGGNMC, "diag_ggn_mc"),
    ]:
        extension = make()
        assert type(extension) is cls and extension.savefield == field
        assert describe(extension) == describe(cls())
        # one need with BackPACK's own object, whichever comes first
        assert merge_extensions([("user", cls()), ("quantity", make())])[0].__class__ is cls
        assert len(merge_extensions([("quantity", make()), ("user", cls())])) == 1
    assert describe(diag_hessian()) == "DiagHessian()"
    assert describe(diag_ggn_mc()) == describe(DiagGGNMC(mc_samples=1))
    assert describe(diag_ggn_mc(3)) == describe(DiagGGNMC(mc_samples=3))
    assert [describe(factory()) for factory in CURVATURES.values()] == [
        describe(DiagHessian()), describe(DiagGGNExact()), describe(DiagGGNMC(mc_samples=1))
    ]


def test_only_the_returned_object_is_changed(monkeypatch):
    """use_chunked_conv2d replaces the Conv2d entry of one object, not of BackPACK's class."""
    spy = _Spy(monkeypatch)
    model, shape = _net("stride")
    inputs, targets = _data(shape, 2, "ce")
    use_chunked_conv2d(DiagHessian())
    for extension in (DiagHessian(), DiagGGNExact(), DiagGGNMC()):
        _backpack_diagonals(model, inputs, targets, "ce", extension)
    assert spy.calls == 0
    for extension in (diag_hessian(), diag_ggn_exact(), diag_ggn_mc(), use_chunked_conv2d(DiagGGNMC(2))):
        _backpack_diagonals(model, inputs, targets, "ce", extension)
    assert spy.calls == 4 * 2  # two Conv2d layers


def test_use_chunked_conv2d_rejects_other_extensions():
    with pytest.raises(TypeError, match="expected DiagHessian, DiagGGNExact or DiagGGNMC, got KFAC"):
        use_chunked_conv2d(KFAC())


@pytest.mark.parametrize("curvature", ["diag_h", "diag_ggn_exact"])
def test_user_passes_backpacks_own_extension_too(curvature):
    """HessTrace plus BackPACK's plain extension in *exts: one pass, equal numbers, the user's buffers kept."""
    plain = {"diag_h": DiagHessian, "diag_ggn_exact": DiagGGNExact}[curvature]
    model, lossfunc, _ = make_problem("cnn", bias=True)
    cockpit = Cockpit(model.parameters(), quantities=[HessTrace(schedules.linear(1), curvature=curvature)])
    reference = Cockpit(model.parameters(), quantities=[HessTrace(schedules.linear(1), curvature=curvature)])
    inputs, labels = make_batch("cnn", 4, seed=1)
    loss = lossfunc(model(inputs), labels)
    with cockpit(0, plain(), info={"batch_size": 4, "loss": loss}):
        loss.backward()
    kept = [getattr(p, curvature).clone() for p in model.parameters()]
    model.zero_grad()
    for param in model.parameters():
        delattr(param, curvature)
    loss = lossfunc(model(inputs), labels)
    with reference(0, info={"batch_size": 4, "loss": loss}):
        loss.backward()
    assert not any(hasattr(p, curvature) for p in model.parameters())
    expected = reference.get_output()[0]["HessTrace"]
    assert cockpit.get_output()[0]["HessTrace"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert [d.sum().item() for d in kept] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_quantities_on_a_cnn_use_the_chunked_path_with_kfac_alongside(monkeypatch):
    """HessTrace/TICDiag still run through the chunked path next to KFACTrace over a short training run."""
    spy = _Spy(monkeypatch)
    model, lossfunc, individual = make_problem("cnn", bias=True)
    schedule = schedules.linear(1)
    quantities = [HessTrace(schedule), TICDiag(schedule, curvature="diag_ggn_exact"), KFACTrace(schedule)]
    cockpit = Cockpit(model.parameters(), quantities=quantities)
    train(model, lossfunc, individual, cockpit, "cnn", steps=2, batch_size=3)
    output = cockpit.get_output()
    assert sorted(output) == [0, 1]
    assert spy.calls == 2 * 2  # one Conv2d, two curvature extensions, two steps
    for values in output.values():
        assert len(values["HessTrace"]) == 4 and isinstance(values["TICDiag"], float)
        assert "KFACTrace" in values


@pytest.mark.parametrize("chunk_bytes", [1, 3000])
@pytest.mark.parametrize("net,loss", [("stride", "ce"), ("dilated_pool", "mse")])
def test_small_chunks_inside_the_extension(monkeypatch, chunk_bytes, net, loss):
    """Chunks of one or a few sqrt columns give the same diagonals as BackPACK."""
    monkeypatch.setattr(conv_diagonals, "CPU_CHUNK_BYTES", chunk_bytes)
    model, shape = _net(net)
    inputs, targets = _data(shape, 5, loss)
    for ours, theirs in [(diag_hessian, DiagHessian), (diag_ggn_exact, DiagGGNExact)]:
        mine = _backpack_diagonals(model, inputs, targets, loss, ours())
        _assert_all_close(mine, _backpack_diagonals(model, inputs, targets, loss, theirs()))


def test_broadcast_elementwise_jac_t_is_bitwise_backpacks(monkeypatch):
    """The activations' ``jac_t`` as ``mat * df`` gives BackPACK's einsum results bit for bit (float32).

    Every elementwise activation in the net must take the broadcast path, and
    BackPACK's own extension objects must not.
    """
    calls = []
    original = conv_diagonals._BroadcastJacT._jac_t_mat_prod
    monkeypatch.setattr(
        conv_diagonals._BroadcastJacT, "_jac_t_mat_prod", lambda self, *a, **k: calls.append(type(self).__name__) or original(self, *a, **k)
    )
    torch.manual_seed(2)
    activations = [nn.ReLU(), nn.Tanh(), nn.Sigmoid(), nn.LeakyReLU(0.2), nn.ELU(), nn.SELU()]
    layers = [nn.Flatten(), nn.Linear(12, 8)]
    for act in activations:
        layers += [act, nn.Linear(8, 8)]
    model = nn.Sequential(*layers, nn.Linear(8, CLASSES))
    inputs, targets = torch.randn(6, 3, 4), torch.randint(0, CLASSES, (6,))
    for theirs in (DiagHessian, DiagGGNExact):
        calls.clear()
        expected = _backpack_diagonals(model, inputs, targets, "ce", theirs())
        assert calls == []
        # alone: the factories' C - 1 column loss factor changes the last bits (tested below)
        actual = _backpack_diagonals(model, inputs, targets, "ce", conv_diagonals.use_broadcast_elementwise(theirs()))
        assert len(calls) >= len(activations)
        assert {f"Broadcast{type(act).__name__}Derivatives" for act in activations} <= set(calls)
        for a, e in zip(actual, expected):
            assert torch.equal(a, e)


@pytest.mark.parametrize("classes", [2, 3, 10])
def test_reduced_cross_entropy_factor_has_c_minus_1_columns_and_the_same_hessian(classes):
    """``reduced_sqrt_hessian``: ``[C - 1, N, C]`` with ``R R^T = diag(p) - p p^T`` (mean: ``/ N``).

    Rows include a nearly one-hot softmax (a probability near 1, where the
    reflection must not pick that class) and a uniform one.
    """
    generator = torch.Generator().manual_seed(classes)
    logits = 3 * torch.randn(6, classes, generator=generator, dtype=torch.float64)
    logits[0] = 0.0
    logits[1, 0] = 40.0
    loss = nn.CrossEntropyLoss()
    loss.input0 = logits
    factor = _ReducedCrossEntropyDerivatives()._sqrt_hessian(loss, None, None)
    assert factor.shape == (classes - 1, 6, classes)
    probs = torch.softmax(logits, dim=1)
    hessian = (torch.diag_embed(probs) - probs.unsqueeze(2) * probs.unsqueeze(1)) / 6
    torch.testing.assert_close(torch.einsum("vnc,vnd->ncd", factor, factor), hessian, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_factories_use_the_reduced_factor_and_match_backpack(loss):
    """The factories' DiagHessian / DiagGGNExact backpropagate ``C - 1`` columns from a cross-entropy
    (``C`` from MSE, whose factor is full rank) and give BackPACK's diagonals (float64)."""
    model, shape = _net("dilated_pool")
    inputs, targets = _data(shape, 5, loss)
    seen = []
    original = ChunkedDiagHConv2d.weight

    def spy(self, ext, module, g_inp, g_out, backproped):
        seen.append(backproped["matrices"][0].shape[0])
        return original(self, ext, module, g_inp, g_out, backproped)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChunkedDiagHConv2d, "weight", spy)
        mine = _backpack_diagonals(model, inputs, targets, loss, diag_hessian())
    assert seen and set(seen) == {CLASSES - 1 if loss == "ce" else CLASSES}
    _assert_all_close(mine, _backpack_diagonals(model, inputs, targets, loss, DiagHessian()))
    mine = _backpack_diagonals(model, inputs, targets, loss, diag_ggn_exact())
    _assert_all_close(mine, _backpack_diagonals(model, inputs, targets, loss, DiagGGNExact()))


# ---- average pooling: the cockpit's functional Jacobian products (no module built per call) ---------------
def _pool_net(name: str, dtype=DTYPE) -> tuple[nn.Module, tuple[int, ...]]:
    """Average pooling after a convolution; sizes the stride does not divide (ConvTranspose's output padding)."""
    torch.manual_seed(11)
    nets = {
        "avgpool1d": (lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3), nn.Sigmoid(), nn.AvgPool1d(3, stride=2, padding=1), nn.Flatten(), nn.LazyLinear(CLASSES),
        ), (2, 10)),
        "avgpool2d": (lambda: nn.Sequential(
            nn.Conv2d(2, 3, 2), nn.Tanh(), nn.AvgPool2d((3, 2), stride=(2, 1), padding=(1, 0)), nn.Flatten(),
            nn.LazyLinear(CLASSES),
        ), (2, 8, 6)),
        "avgpool3d": (lambda: nn.Sequential(
            nn.Conv3d(1, 2, 2), nn.Sigmoid(), nn.AvgPool3d(2), nn.Flatten(), nn.LazyLinear(CLASSES),
        ), (1, 6, 5, 5)),
    }
    factory, shape = nets[name]
    model = factory().to(dtype)
    model(torch.zeros(1, *shape, dtype=dtype))
    return model, shape


@pytest.mark.parametrize("loss", ["ce", "mse"])
@pytest.mark.parametrize("net", ["avgpool1d", "avgpool2d", "avgpool3d"])
@pytest.mark.parametrize("curvature,ours", [("diag_h", diag_hessian), ("diag_ggn_exact", diag_ggn_exact)])
def test_average_pooling_in_float64_against_brute_force_without_touching_the_rng(curvature, ours, net, loss):
    """BackPACK's own average-pooling products fail on a float64 model (its convolution module has the default
    dtype) and draw a random initial weight per call; the cockpit's are the dense Hessian's / GGN's diagonal, and
    torch's generator is where it was."""
    model, shape = _pool_net(net)
    inputs, targets = _data(shape, 4, loss)
    state = torch.get_rng_state()
    extension = ours()
    model = extend(model)
    lossfunc = extend(_lossfunc(loss))
    model.zero_grad()
    value = lossfunc(model(inputs), targets)
    with backpack(extension):
        value.backward()
    assert torch.equal(state, torch.get_rng_state())
    mine = [getattr(p, extension.savefield).detach().clone() for p in model.parameters()]
    _assert_all_close(mine, _brute_force(model, inputs, targets, loss, curvature))


@pytest.mark.parametrize("net", ["avgpool1d", "avgpool2d", "avgpool3d"])
def test_average_pooling_equals_backpacks_own_in_float32(net):
    model, shape = _pool_net(net, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    inputs, targets = torch.randn(4, *shape, generator=generator), torch.randint(0, CLASSES, (4,), generator=generator)
    mine = _backpack_diagonals(model, inputs, targets, "ce", diag_hessian())
    theirs = _backpack_diagonals(model, inputs, targets, "ce", DiagHessian())
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
