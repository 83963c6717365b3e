"""What Cockpit's own test suite (f-dangel/cockpit v1.0.2, ``tests/``) relies on beyond API.md.

Each test here mirrors one of Cockpit's tests that ran against cockpit_like
and failed (issue 34, item 6), checked against brute force where there are
numbers:

- TICDiag/TICTrace with default arguments: a subclass written for Cockpit
  reads ``self._curvature`` and finds Cockpit's default, ``"diag_h"``
  (Cockpit's ``tests/test_quantities/test_tic.py``);
- ``Cockpit._merge_batch_grad_transform_hooks``, the private merge that
  Cockpit's ``tests/test_cockpit/test_multiple_batch_grad_transforms.py`` calls;
- BackPACK buffers around the ``with`` block: the quantities' buffers and
  ``grad_batch_transforms["sum_grad_squared"]`` inside it, only the user's
  ``*exts`` buffers after it (Cockpit's
  ``tests/test_cockpit/test_backpack_extensions.py``).
"""

from __future__ import annotations

import pytest
import torch
from backpack.extensions import BatchGrad, DiagHessian
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.context import get_individual_losses
from cockpit_like.quantities import CABS, HessTrace, TICDiag, TICTrace
from cockpit_like.quantities.utils_transforms import (
    BatchGradTransformsHook,
    BatchGradTransformsHook_SumGradSquared,
    sum_grad_squared_transform,
)
from cockpit_like.utils.schedules import linear
from tests.helpers import dense_hessian, make_batch, make_problem, per_sample_grads
from tests.zoo import ZOO

pytestmark = pytest.mark.filterwarnings("ignore:Using backward", "ignore:Full backward hook")

BATCH = 6


def _loop(quantities, exts=(), steps=2, inside=None, after=None, problem="mlp"):
    """Cockpit's test harness: train ``steps`` steps; ``inside``/``after`` see the parameters in and after the block."""
    model, lossfunc, individual = make_problem(problem)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    cockpit = Cockpit(params, quantities=quantities)
    refs = {}
    for step in range(steps):
        inputs, labels = make_batch(problem, BATCH, seed=10 + step)
        refs[step] = (per_sample_grads(model, inputs, labels), dense_hessian(model, inputs, labels))
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = lossfunc(outputs, labels)
        info = {"batch_size": BATCH, "individual_losses": individual(outputs, labels), "loss": loss, "optimizer": optimizer}
        with cockpit(step, *exts, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
            if inside is not None:
                inside(step, params)
        if after is not None:
            after(step, params)
        optimizer.step()
    return cockpit, refs


# ---- TIC's default curvature, as a subclass written for Cockpit sees it -----------------------------
class CockpitStyleTICDiag(TICDiag):
    """Cockpit's ``AutogradTICDiag`` (tests/test_quantities/test_tic.py): brute force, reading ``self._curvature``."""

    def extensions(self, global_step):
        return []

    def extension_hooks(self, global_step):
        return []

    def create_graph(self, global_step):
        return self.should_compute(global_step)

    def _compute(self, global_step, params, batch_loss):
        if self._curvature != "diag_h":
            raise NotImplementedError("Only Hessian diagonal is implemented")
        losses = get_individual_losses(global_step)
        rows = [torch.cat([g.flatten() for g in torch.autograd.grad(l, params, retain_graph=True)]) for l in losses]
        grads = torch.stack(rows)
        first = torch.autograd.grad(batch_loss, params, create_graph=True)
        flat = torch.cat([g.flatten() for g in first])
        diagonal = torch.stack([
            torch.cat([h.flatten() for h in torch.autograd.grad(flat[j], params, retain_graph=True)])[j]
            for j in range(flat.numel())
        ])
        return ((grads**2).mean(0) / (diagonal + self._epsilon)).sum().item()


def test_tic_defaults_read_as_cockpits_diag_h_and_match_a_cockpit_style_twin():
    cockpit, refs = _loop([TICDiag(linear(1)), CockpitStyleTICDiag(linear(1)), TICTrace(linear(1))])
    for quantity in cockpit.quantities:
        assert quantity._curvature == "diag_h"  # Cockpit's default, what "auto" chose on this model
        assert quantity.curvature == "auto"
        assert quantity.settings()["computed_with"] == "diag_h"
    output = cockpit.get_output()
    for step, (grads, hessian) in refs.items():
        second_moment = torch.cat([(g**2).mean(0).flatten() for g in grads])  # (1/B) sum_i g_ij^2
        diagonal = hessian.diagonal()
        expected_diag = (second_moment / (diagonal + 1e-7)).sum().item()
        assert output[step]["TICDiag"] == pytest.approx(expected_diag, rel=1e-8)
        assert output[step]["CockpitStyleTICDiag"] == pytest.approx(expected_diag, rel=1e-8)
        assert output[step]["TICTrace"] == pytest.approx((second_moment.sum() / (diagonal.sum() + 1e-7)).item(), rel=1e-8)


@pytest.mark.parametrize("cls", [HessTrace, TICDiag, TICTrace])
def test_curvature_attribute_reads_cockpits_names(cls):
    assert cls(linear(1))._curvature == "diag_h"  # before the model is known: Cockpit's default
    # (TICDiag refuses an estimate of the Hessian's diagonal from products: tests/test_hutchinson.py)
    for explicit in ("diag_h", "diag_ggn_exact", "diag_ggn_mc") + (() if cls is TICDiag else ("hutchinson",)):
        quantity = cls(linear(1), curvature=explicit)
        assert quantity._curvature == explicit and quantity.curvature == explicit
    quantity = cls(linear(1))
    quantity._curvature = "diag_ggn_exact"  # Cockpit-style code may set it
    assert (quantity.curvature, quantity.method, quantity._curvature) == ("diag_ggn_exact",) * 3
    with pytest.raises(ValueError, match="unknown curvature"):
        quantity._curvature = "nope"


def test_tic_default_curvature_reads_ggn_where_backpack_cannot_run():
    problem = ZOO["encoder"](0)
    inputs, targets = problem.batch(4, 0)
    quantity = TICDiag(linear(1))
    cockpit = Cockpit(problem.model.parameters(), quantities=[quantity], model=problem.model)
    outputs = problem.model(inputs)
    loss = problem.sample_losses(outputs, targets).mean()
    info = {"batch_size": 4, "individual_losses": problem.sample_losses(outputs, targets), "loss": loss,
            "outputs": outputs}  # the logits, for the GGN
    with cockpit(0, info=info):
        loss.backward(create_graph=cockpit.create_graph(0))
    assert quantity._curvature == "ggn" and quantity.curvature == "auto"  # TIC's positive curvature (issue 37)
    assert cockpit.get_output()[0]["TICDiag"] > 0


# ---- Cockpit._merge_batch_grad_transform_hooks -----------------------------------------------------
def test_merge_batch_grad_transform_hooks_as_in_cockpit():
    def same(t):
        return t

    first = BatchGradTransformsHook({"x": lambda t: t, "y": same})
    second = BatchGradTransformsHook({"v": lambda t: t, "y": same})
    merged = Cockpit._merge_batch_grad_transform_hooks([first, second])
    assert isinstance(merged, BatchGradTransformsHook)
    assert sorted(merged._transforms) == ["v", "x", "y"]
    assert merged._transforms["x"] is first._transforms["x"] and merged._transforms["v"] is second._transforms["v"]
    assert merged._transforms["y"] is same  # the same function under one name: kept once
    with pytest.raises(ValueError, match="two different transforms under the name 'x'"):
        Cockpit._merge_batch_grad_transform_hooks([first, BatchGradTransformsHook({"x": lambda t: t})])
    ready_made = Cockpit._merge_batch_grad_transform_hooks(
        [BatchGradTransformsHook_SumGradSquared(), BatchGradTransformsHook_SumGradSquared()]
    )
    assert ready_made._transforms == {"sum_grad_squared": sum_grad_squared_transform}


# ---- BackPACK buffers in and after the block -------------------------------------------------------
def test_tic_puts_sum_grad_squared_on_the_params_and_user_exts_keep_theirs():
    """Cockpit's test_backpack_extensions: TICDiag and the user's own DiagHessian in ``*exts``."""
    seen_inside, seen_after = {}, {}

    def inside(step, params):
        seen_inside[step] = [
            (p.diag_h.detach().clone(), p.grad_batch_transforms["sum_grad_squared"].detach().clone()) for p in params
        ]

    def after(step, params):
        seen_after[step] = [(hasattr(p, "diag_h"), hasattr(p, "grad_batch_transforms")) for p in params]

    _, refs = _loop([TICDiag(linear(1))], (DiagHessian(),), inside=inside, after=after)
    for step, (grads, hessian) in refs.items():
        diagonals = hessian.diagonal().split([g[0].numel() for g in grads])
        for (diag_h, squares), g, diagonal in zip(seen_inside[step], grads, diagonals):
            torch.testing.assert_close(squares, (g**2).sum(0) / BATCH**2, rtol=1e-10, atol=1e-14)  # Cockpit's scaling
            torch.testing.assert_close(diag_h.flatten(), diagonal, rtol=1e-10, atol=1e-12)
        assert seen_after[step] == [(True, False)] * len(grads)  # the user's diag_h stays, the transforms go


def test_user_batch_grad_in_exts_stays_on_the_params_after_the_step():
    """A user's own ``BatchGrad`` in ``*exts``: ``p.grad_batch`` (``g_i / B``) is left on the parameters."""
    kept = {}

    def after(step, params):
        kept[step] = [p.grad_batch.detach().clone() for p in params]

    _, refs = _loop([CABS(linear(1)), TICDiag(linear(1))], (BatchGrad(),), after=after)
    for step, (grads, _) in refs.items():
        for grad_batch, g in zip(kept[step], grads):
            torch.testing.assert_close(grad_batch, g / BATCH, rtol=1e-10, atol=1e-14)


def test_a_quantitys_own_sum_grad_squared_transform_is_not_overwritten():
    """A transform a quantity asked for under the name "sum_grad_squared" keeps its value next to TIC's."""

    def ones(grad_batch):
        return torch.ones(())

    class Own(TICDiag):
        def extension_hooks(self, global_step):
            return [BatchGradTransformsHook({"sum_grad_squared": ones})]

        def _compute(self, global_step, params, batch_loss):
            return [float(p.grad_batch_transforms["sum_grad_squared"]) for p in params]

    cockpit, _ = _loop([TICDiag(linear(1)), Own(linear(1))], steps=1)
    assert cockpit.get_output()[0]["Own"] == [1.0] * len(cockpit.params)
