"""Outside trial 39 (2026-11-29): Cockpit's own users' path, BackPACK-extended chains x loss modules and options.

456 runs on 38 model/loss set-ups: every finished run bitwise the run without a cockpit, 4,003 exact values
checked, 0 wrong. What stopped training or advised wrongly, each tested here against float64 brute force
(MSELoss on outputs of any shape: ``tests/test_any_shape_losses.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import extend
from torch import nn
from torch.func import functional_call, hessian

from cockpit_like import Cockpit
from cockpit_like.backends.column_blocks import _in_data_order
from cockpit_like.utils.configuration import configuration

DTYPE = torch.float64


def _chain(middle):
    torch.manual_seed(0)
    layers = [nn.Conv1d(1, 2, 3), nn.Tanh(), nn.Flatten(), *middle, nn.Linear(8, 4)]
    return nn.Sequential(*layers).to(DTYPE)


def _dense_traces(model, x, y, passes: int):
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    twin = _chain([nn.Identity() for _ in range(passes)])  # the same function and names, never extended
    flat = torch.cat([params[n].reshape(-1) for n in names])
    sizes = [params[n].numel() for n in names]

    def loss(vector):
        pieces = dict(zip(names, (v.reshape(params[n].shape) for n, v in zip(names, vector.split(sizes)))))
        return nn.functional.cross_entropy(functional_call(twin, pieces, (x,)), y)

    diagonal = hessian(loss)(flat).diagonal()
    return [float(piece.sum()) for piece in diagonal.split(sizes)]


@pytest.mark.parametrize("middle", [lambda: [nn.Dropout(p=0.0)], lambda: [nn.Flatten()],
                                    lambda: [nn.Flatten(), nn.Dropout(p=0.0)]], ids=["dropout0", "flatten", "both"])  # fmt: skip
@pytest.mark.parametrize("lean_hooks", [True, False])
def test_a_pass_through_module_after_flatten_on_every_step(middle, lean_hooks):
    """Step 0 was stored, step 1 raised "a later module reads a part of its output" (the backward hooks of the
    modules sharing one tensor fired in another order): every step is stored, equal to the dense Hessian."""
    modules = middle()
    model, lossfunc = extend(_chain(modules)), extend(nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("business"), lean_hooks=lean_hooks)
    generator = torch.Generator().manual_seed(1)
    references = {}
    for step in range(4):
        x = torch.randn(6, 1, 6, generator=generator, dtype=DTYPE)
        y = torch.randint(0, 4, (6,), generator=generator)
        references[step] = _dense_traces(model, x, y, len(modules))
        optimizer.zero_grad()
        out = model(x)
        loss = lossfunc(out, y)
        info = {"batch_size": 6, "individual_losses": nn.functional.cross_entropy(out, y, reduction="none"),
                "loss": loss, "optimizer": optimizer}  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    output = cockpit.get_output()
    tracked = [step for step in references if "HessTrace" in output.get(step, {})]
    assert len(tracked) >= 2
    for step in tracked:
        assert output[step]["HessTrace"] == pytest.approx(references[step], rel=1e-9, abs=1e-12)


class _Recorded:
    def __init__(self, name, output, *inputs):
        self.name, self.io, self.inputs = name, {"output": output}, list(inputs)


def test_calls_are_put_in_data_order_whatever_order_the_hooks_fired():
    """Backward order puts every consumer before what made its input; pass-throughs of one tensor keep theirs."""
    base = torch.zeros(6, 2, 4, requires_grad=True) * 1.0
    flat = base.view(6, 8)  # Flatten's output: the same memory, another shape
    linear = _Recorded("linear", torch.zeros(6, 4), flat)
    dropout = _Recorded("dropout", flat, flat)  # Dropout(p=0): its input, as it is
    flatten = _Recorded("flatten", flat, base)
    tanh = _Recorded("tanh", base, torch.zeros(6, 2, 4, requires_grad=True))
    expected = ["linear", "dropout", "flatten", "tanh"]
    for fired in ([linear, dropout, flatten, tanh], [linear, flatten, dropout, tanh]):
        assert [c.name for c in _in_data_order(fired)] == expected
    second = _Recorded("identity", flat, flat)  # two pass-throughs of one tensor: their recorded order is kept
    assert [c.name for c in _in_data_order([linear, second, dropout, flatten, tanh])] == ["linear", "identity", "dropout", "flatten", "tanh"]
    assert [c.name for c in _in_data_order([linear, dropout, second, flatten, tanh])] == ["linear", "dropout", "identity", "flatten", "tanh"]


def _sequence_step(transpose: bool):
    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Conv1d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv1d(5, 4, 1)).to(DTYPE))
    lossfunc = extend(nn.CrossEntropyLoss())
    from cockpit_like.quantities import TICDiag

    quantity = TICDiag(track_schedule=lambda s: True, curvature="ggn")
    cockpit = Cockpit(model.parameters(), quantities=[quantity])
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 5, generator=generator, dtype=DTYPE), torch.randint(0, 4, (4, 5), generator=generator)
    out = model(x)
    loss = lossfunc(out, y)
    rows = nn.functional.cross_entropy(out, y, reduction="none").mean(1)
    info = {"batch_size": 4, "individual_losses": rows, "loss": loss,
            "outputs": out.transpose(1, 2) if transpose else out}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info=info):
            loss.backward(create_graph=cockpit.create_graph(0))
    return cockpit.get_output().get(0, {}), cockpit.checks[0]


def test_sequence_logits_with_classes_in_dim_1_are_named_and_the_advice_works():
    """``[B, C, T]`` logits as ``info["outputs"]`` for the GGN: the note listed losses it could be (MSE, sum, weights);
    it names the layout and ``movedim(1, -1)``, and the transposed outputs give a value with its error bar."""
    values, checks = _sequence_step(transpose=False)
    assert "TICDiag" not in values
    (note,) = [n for n in checks["notes"] if n.startswith("TICDiag")]
    assert "its classes are in dimension 1 (shape [4, 4, 5]" in note and "movedim(1, -1)" in note
    assert "MSE" not in note and "weighted" not in note
    values, checks = _sequence_step(transpose=True)
    assert isinstance(values["TICDiag"], float) and not [n for n in checks["notes"] if n.startswith("TICDiag")]


def test_weighted_cross_entropy_is_not_advised_the_ggn():
    """``CrossEntropyLoss(weight=W)`` on an extended chain: the error advised TICDiag ``curvature='ggn'`` for a
    cross-entropy, which stores nothing for a weighted one; it now says which cross-entropy."""
    from cockpit_like.backends.step import UnsupportedLayerError

    model = extend(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE))
    lossfunc = extend(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=DTYPE)))
    cockpit = Cockpit(model.parameters(), quantities=configuration("business"))
    x, y = torch.randn(5, 4, dtype=DTYPE), torch.tensor([0, 1, 2, 1, 0])
    out = model(x)
    loss = lossfunc(out, y)
    with pytest.raises(UnsupportedLayerError, match="for a mean cross-entropy without class weights"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows = nn.functional.cross_entropy(out, y, weight=lossfunc.weight, reduction="none") * 5 / lossfunc.weight[y].sum()
            with cockpit(0, info={"batch_size": 5, "loss": loss, "individual_losses": rows,
                                  "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}):  # fmt: skip
                loss.backward(create_graph=cockpit.create_graph(0))
