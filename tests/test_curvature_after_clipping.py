"""Curvature at a step whose gradients the loop scaled in place after the backward pass.

``clip_grad_norm_`` (or a ``GradScaler``'s ``unscale_``) between the block and ``optimizer.step()``, with Alpha
waiting for the optimizer's step: the cockpit divides the gradients by the factor it sees, but the in-place
change (under ``no_grad``) is not in the gradients' graph, so the Hessian-vector products through ``p.grad``
were divided by it too: HessMaxEV and HessTrace 1 / (clip factor) too large, on valid steps (seventh round of
outside trials: 4.32 for 0.968). References: the dense float64 Hessian of the step's mean loss.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.quantities import Alpha, HessMaxEV
from cockpit_like.utils.schedules import linear

DTYPE = torch.float64


def _dense_top(model, x, y):
    from torch.func import functional_call

    names = [n for n, _ in model.named_parameters()]
    values = [p.detach() for _, p in model.named_parameters()]
    sizes, shapes = [v.numel() for v in values], [v.shape for v in values]

    def loss(flat):
        params = {n: c.view(s) for n, c, s in zip(names, flat.split(sizes), shapes)}
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    H = torch.autograd.functional.hessian(loss, torch.cat([v.reshape(-1) for v in values]))
    eigenvalues = torch.linalg.eigvalsh((H + H.T) / 2)
    return float(eigenvalues[-1] if eigenvalues[-1].abs() >= eigenvalues[0].abs() else eigenvalues[0])


@pytest.mark.parametrize("loop", ["clip", "scaler_unscale_clip"])
def test_hessmaxev_after_in_place_clipping_is_the_dense_one(loop):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=0.05)
    hess = HessMaxEV(linear(1))
    cockpit = Cockpit(params, quantities=[Alpha(linear(1)), hess], model=model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if loop == "scaler_unscale_clip" else None
    generator = torch.Generator().manual_seed(1)
    clipped = 0
    for step in range(4):
        x = torch.randn(8, 5, dtype=DTYPE, generator=generator)
        y = torch.randint(0, 3, (8,), generator=generator)
        expected = _dense_top(model, x, y)
        optimizer.zero_grad()
        losses = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = losses.mean()
        info = {"batch_size": 8, "individual_losses": losses, "loss": loss, "optimizer": optimizer}
        with cockpit(step, info=info):
            (loss if scaler is None else scaler.scale(loss)).backward(create_graph=cockpit.create_graph(step))
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, 0.1)
        clipped += bool(norm > 0.1)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        for p in params:
            p.grad = None  # the graph kept by create_graph
        assert cockpit.checks[step]["valid"], cockpit.checks[step]
        assert hess.output[step] == pytest.approx(expected, rel=1e-2), (step, hess.output[step], expected)  # the stop rule
    assert clipped >= 3  # the clipping changed the gradients at the steps compared


def test_a_graph_dropped_before_the_optimizer_step_stores_no_curvature_and_training_goes_on():
    """The full preset, a weight-decay schedule set after the backward pass (Alpha then waits for the optimizer's
    step) and ``p.grad = p.grad.detach()`` before ``optimizer.step()``: a ``MissingGraphError`` asking for
    ``create_graph`` (which the loop passed) was raised out of ``optimizer.step()`` (seventh round of outside
    trials). Now the quantities that need Hessian-vector products store nothing there, with a note, and the rest
    are stored."""
    from cockpit_like.utils.configuration import configuration

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(model.parameters(), quantities=configuration("full"), model=model)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randn(8, 5, dtype=DTYPE, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        out = model(x)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        info = {"batch_size": 8, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer, "outputs": out}
        with cockpit(step, info=info):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        optimizer.param_groups[0]["weight_decay"] = 0.05 * step
        for p in model.parameters():
            p.grad = p.grad.detach()
        optimizer.step()
    output = cockpit.get_output()
    dropped = [s for s in output if any("no Hessian-vector products" in n for n in output[s].get("checks", {}).get("notes", []))]
    assert dropped, output
    for step in dropped:
        assert "HessMaxEV" not in output[step] and "GradNorm" in output[step]


def test_a_sam_step_that_moves_the_weights_and_back_stores_no_late_curvature_and_training_goes_on():
    """Hand-written SAM: the block around the first backward pass, then ``p.add_(e)``, a second backward pass outside
    the block, ``p.sub_(e)`` and ``optimizer.step()``. From step 1 Alpha waits for the optimizer's step, and by then
    the parameters were changed in place: a RuntimeError out of ``optimizer.step()`` ended training (outside trial 8).
    Now the products' quantities store nothing there, with a note; the run is the one without the cockpit; the
    curvature of step 0 (taken at the block's end, before SAM moved the weights) is the dense Hessian's."""
    from cockpit_like.utils.configuration import configuration

    def run(with_cockpit):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4)).to(DTYPE)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        cockpit = Cockpit(model.parameters(), quantities=configuration("full"), model=model) if with_cockpit else None
        generator = torch.Generator().manual_seed(3)
        first = None
        for step in range(3):
            x, y = torch.randn(6, 8, dtype=DTYPE, generator=generator), torch.randint(0, 4, (6,), generator=generator)
            if step == 0:
                first = (x, y, [p.detach().clone() for p in model.parameters()])
            optimizer.zero_grad()
            losses = nn.functional.cross_entropy(model(x), y, reduction="none")
            if cockpit is None:
                losses.mean().backward()
            else:
                info = {"batch_size": 6, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}
                with cockpit(step, info=info):
                    losses.mean().backward(create_graph=cockpit.create_graph(step))
            with torch.no_grad():
                norm = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters()))
                shifts = [0.05 * p.grad / norm for p in model.parameters()]
                for p, e in zip(model.parameters(), shifts):
                    p.add_(e)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p, e in zip(model.parameters(), shifts):
                    p.sub_(e)
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()], cockpit, model, first

    plain, _, _, _ = run(False)
    tracked, cockpit, model, (x, y, theta0) = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, tracked))
    output = cockpit.get_output()
    late = [s for s in output if any("could not be differentiated again" in n for n in output[s].get("checks", {}).get("notes", []))]
    assert late == [1, 2]
    for step in late:
        assert "HessMaxEV" not in output[step] and "GradNorm" in output[step]
    with torch.no_grad():
        for p, value in zip(model.parameters(), theta0):
            p.copy_(value)
    assert output[0]["HessMaxEV"] == pytest.approx(_dense_top(model, x, y), rel=2e-2)
