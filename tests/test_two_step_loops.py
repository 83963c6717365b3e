"""The two-step quantities (Alpha, UpdateSize) in loops found outside the tests (a fourth round): a head without a
gradient at some steps, gradients changed by other than one factor before ``optimizer.step()``, the cockpit
entered at some optimizer steps only or with step numbers that skip, and a step a GradScaler skipped. Float64,
against brute force: the updates from parameter snapshots, Alpha from its definition (``reference_alpha``)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from cockpit_like import Cockpit
from cockpit_like.quantities import Alpha, Distance, GradNorm, UpdateSize
from cockpit_like.utils.schedules import linear
from tests.test_alpha import reference_alpha

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook")
DT = torch.float64
B = 6


class TwoHeads(nn.Module):
    """A trunk and two heads; the second is used only where ``use2`` (a task absent from some batches)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(5, 6), nn.ReLU())
        self.h1, self.h2 = nn.Linear(6, 3), nn.Linear(6, 3)
        self.use2 = True
        self.to(DT)

    def forward(self, x):
        z = self.trunk(x)
        return self.h1(z) + self.h2(z) if self.use2 else self.h1(z)


def per_sample_grads(model, x, y):
    """``[grad_batch_p]`` of the mean loss's rows (zeros for a parameter the rows do not use), by torch.func."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def row_loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(row_loss), (None, 0, 0))(params, x, y)
    return [grads[name] for name in params]


def batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, 5, dtype=DT, generator=generator), torch.randint(0, 3, (B,), generator=generator)


def quantities():
    return [Alpha(linear(1)), UpdateSize(linear(1)), Distance(linear(1)), GradNorm(linear(1))]


def train(model, optimizer, iterations, tracked=lambda it: it, between=None, use2=None, scaler=None, poison=()):
    """``iterations`` optimizer steps; the cockpit entered where ``tracked(it)`` is a step number (not None).
    ``between(it)``: runs after the block, before the optimizer's step. The observations of each tracked step
    (parameters before it, per-sample gradients, losses) and the parameters after the loop."""
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    observed = {}
    for it in range(iterations):
        if use2 is not None:
            model.use2 = use2[it]
        x, y = batch(it)
        if it in poison:
            x[0] = 1e306  # a row far off, labelled as its least likely class: the scaled gradients overflow
            with torch.no_grad():
                y[0] = model(x)[0].argmin()
        step = tracked(it)
        optimizer.zero_grad()
        outputs = model(x)
        losses = F.cross_entropy(outputs, y, reduction="none")
        loss = losses.mean()
        if step is not None:
            observed[step] = {"params": [p.detach().clone() for p in model.parameters()], "loss": loss.item(),
                              "losses": losses.detach(), "grads": per_sample_grads(model, x, y)}  # fmt: skip
            info = {"batch_size": B, "individual_losses": losses, "loss": loss, "optimizer": optimizer}
            with cockpit(step, info=info):
                (loss if scaler is None else scaler.scale(loss)).backward()
        else:
            (loss if scaler is None else scaler.scale(loss)).backward()
        if between is not None:
            between(it, model)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    final = [p.detach().clone() for p in model.parameters()]
    return cockpit, observed, final


def norms(a, b):
    return [float((x - y).norm()) for x, y in zip(a, b)]


def notes(cockpit, step):
    return cockpit.checks.get(step, {}).get("notes", [])


HEAD_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9, weight_decay=0.01),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(HEAD_OPTIMIZERS))
def test_a_head_without_a_gradient_is_left_alone_by_alphas_look_ahead(name):
    """zero_grad(set_to_none=True) and a head unused at steps 0, 2, 3: torch's optimizers skip a parameter whose
    .grad is None (no weight decay, no momentum for it). Before, Alpha's look-ahead stepped the head on a zero
    gradient (the cockpit counts a parameter without a gradient as zero), the prediction missed, and Alpha was
    withdrawn with a note blaming the loop; now its look-ahead skips it as the optimizer does: exact."""
    model = TwoHeads()
    optimizer = HEAD_OPTIMIZERS[name](model.parameters())
    use2 = [False, True, False, False, True, True]
    cockpit, observed, _ = train(model, optimizer, 6, use2=use2)
    alpha = cockpit.get_output()
    for step in range(5):
        expected = reference_alpha(observed[step], observed[step + 1], B)
        assert alpha[step].get("Alpha") == pytest.approx(expected, rel=1e-8, abs=1e-10), step
        assert not [n for n in notes(cockpit, step) if "Alpha" in n], step
    # the other statistics still count the head's gradient as zero, and say so
    assert cockpit.checks[0]["no_gradient"] == ["h2.weight", "h2.bias"]
    assert alpha[0]["GradNorm"][-2:] == [0.0, 0.0]


def _clip_value(it, model):
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)


def _add_noise(it, model):
    generator = torch.Generator().manual_seed(7 + it)
    with torch.no_grad():
        for p in model.parameters():
            p.grad.add_(0.01 * torch.randn(p.shape, dtype=DT, generator=generator))


@pytest.mark.parametrize("change", [_clip_value, _add_noise], ids=["clip_grad_value", "gradient_noise"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_gradients_changed_before_the_step_store_no_alpha_once_then_alpha_waits_and_is_exact(change, name):
    """clip_grad_value_ (or gradient noise) after the block: the optimizer steps with other gradients than those
    the backward pass left, and not by one factor. Before, Alpha was withdrawn at every step (the check at the
    optimizer step dropped its start before Alpha could learn to wait); now the first step stores none and says
    why, the later steps wait for the optimizer's step and predict from the gradients it gets: exact. The other
    quantities describe the backward pass's gradient (as before)."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3) if name == "sgd" else torch.optim.Adam(model.parameters(), lr=0.02)
    cockpit, observed, _ = train(model, optimizer, 5, between=change)
    output = cockpit.get_output()
    assert "Alpha" not in output[0]
    assert "from the next tracked step on" in notes(cockpit, 0)[0] and "Alpha" in notes(cockpit, 0)[0]
    for step in range(1, 4):
        expected = reference_alpha(observed[step], observed[step + 1], B)
        assert output[step]["Alpha"] == pytest.approx(expected, rel=1e-8, abs=1e-10), step
        assert cockpit.checks[step]["valid"], step
        assert any("not by one factor" in n for n in notes(cockpit, step)), step
        mean = [g.mean(0) for g in observed[step]["grads"]]  # the backward pass's gradient, not the changed one
        assert output[step]["GradNorm"] == pytest.approx([float(g.norm()) for g in mean], rel=1e-10), step
        update = norms(observed[step + 1]["params"], observed[step]["params"])
        assert output[step]["UpdateSize"] == pytest.approx(update, rel=1e-12), step


def test_updatesize_and_alpha_store_nothing_where_the_optimizer_stepped_several_times_between_tracked_steps():
    """The block entered every 4th iteration, numbered 0, 1, 2 by the loop, the optimizer stepping every iteration.
    Before, UpdateSize[0] was the norm of four updates, stored as valid without a note (and Alpha's note blamed
    the gradients, and Alpha then waited for the step); now both store nothing, a note at the step says why.
    Distance (from the first parameters) is unaffected."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    cockpit, observed, _ = train(model, optimizer, 9, tracked=lambda it: it // 4 if it % 4 == 0 else None)
    output = cockpit.get_output()
    for step in (0, 1):
        assert "UpdateSize" not in output[step] and "Alpha" not in output[step], step
        said = [n for n in notes(cockpit, step) if "UpdateSize" in n]
        assert len(said) == 1 and "Alpha" in said[0] and "4 times" in said[0], step
        assert cockpit.checks[step]["valid"]
    for step in (0, 1, 2):
        distance = norms(observed[step]["params"], observed[0]["params"])
        assert output[step]["Distance"] == pytest.approx(distance, rel=1e-12, abs=1e-15)
    assert not [n for s in (0, 1, 2) for n in notes(cockpit, s) if "direction" in n]  # no misleading Alpha note


def test_a_plain_loop_gets_every_value_and_no_note():
    """One optimizer step per tracked step, consecutive numbers: the values of Cockpit, exact, nothing noted."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cockpit, observed, _ = train(model, optimizer, 4)
    output = cockpit.get_output()
    for step in range(4):
        assert not notes(cockpit, step)
    for step in range(3):
        assert output[step]["UpdateSize"] == pytest.approx(norms(observed[step + 1]["params"], observed[step]["params"]), rel=1e-12)
        assert output[step]["Alpha"] == pytest.approx(reference_alpha(observed[step], observed[step + 1], B), rel=1e-8)


def test_step_numbers_that_skip_store_no_two_step_values_and_say_why_once():
    """global_step 0, 2, 4, 6, one optimizer step each: as in Cockpit, UpdateSize and Alpha of step t need the
    cockpit entered at t + 1, so none is stored. Before, nothing said why; now a note at the step where it is
    noticed and one warning."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit, observed, _ = train(model, optimizer, 4, tracked=lambda it: 2 * it)
    output = cockpit.get_output()
    assert not [s for s in output if {"UpdateSize", "Alpha"} & set(output[s])]
    for step in (2, 4, 6):
        said = [n for n in notes(cockpit, step) if f"of step {step - 2}" in n]
        assert len(said) == 1 and "UpdateSize" in said[0] and "Alpha" in said[0], step
        assert f"entered at step {step - 1}" in said[0], step
    gaps = [w for w in caught if "consecutive" in str(w.message)]
    assert len(gaps) == 1
    assert gaps[0].filename == __file__  # it names the training loop's line (here), not the package's
    assert output[4]["Distance"] == pytest.approx(norms(observed[4]["params"], observed[0]["params"]), rel=1e-12)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_step_the_grad_scaler_skipped_ends_updatesize_but_not_alpha(name):
    """A GradScaler skips step 2 (its gradients overflow). The update from step 1 to step 2 was made and the
    parameters at step 2 are fine: UpdateSize[1] is stored (before: dropped without a note); Alpha[1] needs step
    2's loss and gradients, which are not finite: not stored, and a note says why. Step 2 stays stored as skipped."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2) if name == "sgd" else torch.optim.Adam(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    cockpit, observed, _ = train(model, optimizer, 6, scaler=scaler, poison=(2,))
    output = cockpit.get_output()
    assert cockpit.skipped_steps == {2: {"reason": "grad_scaler", "scale": 2.0**16}} and output[2] == {"skipped": cockpit.skipped_steps[2]}
    for step in (0, 1, 3, 4):
        update = norms(observed[step + 1]["params"], observed[step]["params"])
        assert output[step]["UpdateSize"] == pytest.approx(update, rel=1e-12, abs=1e-15), step
    assert "Alpha" not in output[1]
    said = [n for n in notes(cockpit, 1) if "Alpha of step 1" in n]
    assert len(said) == 1 and "skipped step 2" in said[0]
    for step in (0, 3, 4):
        assert output[step]["Alpha"] == pytest.approx(reference_alpha(observed[step], observed[step + 1], B), rel=1e-8)


def test_distance_is_measured_from_the_first_step_also_where_it_failed_a_check():
    """Step 0 fails a self-check (a gradient left by a backward pass before the block, no zero_grad after it): it
    stores nothing, but its parameters are theta_0, the first the cockpit saw; Distance at the later steps is
    measured from them (before: from theta_1, zeros at step 1)."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    snapshots = {}
    for step in range(4):
        x, y = batch(step)
        optimizer.zero_grad()
        if step == 0:  # a one-off check before training, its gradients not cleared
            F.cross_entropy(model(x), y).backward()
        snapshots[step] = [p.detach().clone() for p in model.parameters()]
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward()
        optimizer.step()
    output = cockpit.get_output()
    assert not cockpit.checks[0]["valid"] and "Distance" not in output[0]
    for step in (1, 2, 3):
        assert output[step]["Distance"] == pytest.approx(norms(snapshots[step], snapshots[0]), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_declared_micro_batches_and_clipping_with_adamw_alpha_waits_and_is_exact(micro_batches):
    """info['micro_batches'] declared (as the Hugging Face Trainer's callback does, 1 without accumulation) and
    clip_grad_norm_ before AdamW's step (the Trainer's defaults): before, Alpha learned to wait for the optimizer but
    a step with declared micro-batches always ended at its last backward pass, so no Alpha was ever stored; now the
    last micro-batch waits for the optimizer's step: none at step 0 (a note), exact from step 1."""
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    observed = {}
    for step in range(5):
        x, y = batch(step)
        observed[step] = {"params": [p.detach().clone() for p in model.parameters()], "grads": per_sample_grads(model, x, y)}
        with torch.no_grad():
            losses = F.cross_entropy(model(x), y, reduction="none")
        observed[step].update(loss=losses.mean().item(), losses=losses)
        optimizer.zero_grad()
        for part in torch.arange(B).chunk(micro_batches):
            part_losses = F.cross_entropy(model(x[part]), y[part], reduction="none")
            info = {"batch_size": len(part), "individual_losses": part_losses, "loss": part_losses.mean(),
                    "optimizer": optimizer, "micro_batches": micro_batches}  # fmt: skip
            with cockpit(step, info=info):
                (part_losses.mean() / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
    output = cockpit.get_output()
    assert "Alpha" not in output[0]
    for step in range(1, 4):
        expected = reference_alpha(observed[step], observed[step + 1], B)
        assert output[step]["Alpha"] == pytest.approx(expected, rel=1e-8, abs=1e-10), step
        assert cockpit.checks[step]["valid"], step
        update = norms(observed[step + 1]["params"], observed[step]["params"])
        assert output[step]["UpdateSize"] == pytest.approx(update, rel=1e-12), step


def test_a_waiting_step_keeps_the_graph_for_hessian_vector_products():
    """clip_grad_value_ after the block makes Alpha wait for the optimizer's step, and the step keeps a copy of the
    backward pass's gradients for the quantities. The copy was detached, so HessMaxEV at such a step raised
    MissingGraphError out of optimizer.step(); now it keeps the graph: HessMaxEV equals the dense Hessian's."""
    from cockpit_like.quantities import HessMaxEV

    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    hess = HessMaxEV(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[Alpha(linear(1)), hess], model=model)
    names = [name for name, _ in model.named_parameters()]
    for step in range(4):
        x, y = batch(step)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        shapes = [p.shape for p in model.parameters()]

        def mean_loss(vector, x=x, y=y):
            pieces = torch.split(vector, [s.numel() for s in shapes])
            values = {n: piece.reshape(s) for n, piece, s in zip(names, pieces, shapes)}
            return F.cross_entropy(functional_call(model, values, (x,)), y)

        eigenvalues = torch.linalg.eigvalsh(torch.autograd.functional.hessian(mean_loss, flat))
        expected = float(eigenvalues[eigenvalues.abs().argmax()])
        optimizer.zero_grad()
        losses = F.cross_entropy(model(x), y, reduction="none")
        with cockpit(step, info={"batch_size": B, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer}):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        optimizer.step()  # raised MissingGraphError at the waiting steps before
        got = cockpit.get_output()[step]["HessMaxEV"]
        assert got == pytest.approx(expected, rel=1e-2), step
    assert "Alpha" in cockpit.get_output()[2]  # the later steps waited (and stored Alpha)


@pytest.mark.parametrize("where", ["block", "begin"])
def test_a_step_that_raised_is_named_in_the_note_of_the_values_it_ended(where):
    """Step 2 raises (the loop catches it and goes on): in its block, or as the block begins (a wrong info, or an
    interrupt there). UpdateSize and Alpha of step 1, which end at step 2, are not stored. Before, the note said the
    cockpit was not entered at step 2 and the loop's step numbers skip (and warned so); now it says that step 2
    raised, and nothing warns of skipping numbers."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    cockpit = Cockpit(model.parameters(), quantities=quantities(), model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            x, y = batch(step)
            optimizer.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            refused = where == "begin" and step == 2
            try:
                with cockpit(step, info={"batch_size": 0 if refused else B, "individual_losses": losses,
                                         "loss": losses.mean(), "optimizer": optimizer}):  # fmt: skip
                    losses.mean().backward()
                    if where == "block" and step == 2:
                        raise KeyError("the loop's own error")
            except (KeyError, ValueError):
                continue
            optimizer.step()
    output = cockpit.get_output()
    assert "UpdateSize" not in output[1] and "Alpha" not in output[1]
    said = [n for n in notes(cockpit, 3) if "of step 1" in n]
    assert len(said) == 1 and "step 2, whose block raised" in said[0]
    assert not [w for w in caught if "consecutive" in str(w.message)]
    assert "UpdateSize" in output[0]
