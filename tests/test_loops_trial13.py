"""Outside trial 13's loop findings.

F1: a term whose value is 0 but whose gradient is not (``a - a.detach()``) added to the backpropagated loss: the
value backpropagated equals ``info["loss"]``, so the value check passed, and the rows follow the real backward
pass, so the gradient check passed; Alpha fitted the declared loss's values with the other loss's slopes (4 of 4
steps, -0.0455 for -0.0166) and GradNorm was 1.7-11.6% off the declared loss's, on valid steps. F2: parameters
given twice to ``Cockpit(params)`` (a part's parameters chained with the whole model's) counted twice (GradNorm
+20%, valid), or raised a raw error from Alpha.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration

DT = torch.float64


def entropy_rows(out):
    logp = torch.log_softmax(out, -1)
    return -(logp.exp() * logp).sum(-1)


def dominant(matrix):
    """The eigenvalue of largest magnitude of a dense symmetric matrix."""
    eigenvalues = torch.linalg.eigvalsh(matrix)
    return eigenvalues[eigenvalues.abs().argmax()].item()


def track_one_step(cockpit, losses, **backward):
    """Step 0 of ``cockpit`` around ``losses.mean().backward(**backward)`` (the graph where the step needs it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": len(losses), "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward(create_graph=cockpit.create_graph(0), **backward)


def run(form: str, preset: str = "economy", steps: int = 4, dtype=DT):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration(preset), model=model)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(steps):
            x, y = torch.randn(12, 6, generator=generator, dtype=dtype), torch.randint(0, 4, (12,), generator=generator)
            opt.zero_grad()
            out = model(x)
            losses = F.cross_entropy(out, y, reduction="none")
            loss = losses.mean()
            info = {"batch_size": 12, "individual_losses": losses, "loss": loss, "optimizer": opt}
            with cockpit(step, info=info):
                cg = cockpit.create_graph(step)
                if form == "zero_valued_term":
                    extra = 0.5 * entropy_rows(out).mean()
                    (loss + (extra - extra.detach())).backward(create_graph=cg)
                elif form == "declared_term":  # the same gradient, declared: valid
                    raise AssertionError("not used")
                elif form == "scaled":
                    (3.0 * loss).backward(create_graph=cg)
                elif form == "rows_vector":
                    losses.backward(torch.full((12,), 1.0 / 12, dtype=dtype), create_graph=cg)
                elif form == "retained_twice":
                    (0.5 * loss).backward(retain_graph=True, create_graph=cg)
                    (0.5 * loss).backward(create_graph=cg)
                else:
                    loss.backward(create_graph=cg)
            opt.step()
    return cockpit


@pytest.mark.parametrize("preset", ["economy", "full"])
def test_a_zero_valued_term_with_a_gradient_fails_the_step(preset):
    cockpit = run("zero_valued_term", preset)
    for step in range(4):
        checks = cockpit.checks[step]
        failed = {f["check"]: f["reason"] for f in checks["failed"]}
        assert "backpropagated_loss" in failed and "value is 0 but whose gradient is not" in failed["backpropagated_loss"]
    assert not any("Alpha" in out or "GradNorm" in out for out in cockpit.get_output().values())


@pytest.mark.parametrize("form", ["plain", "scaled", "rows_vector", "retained_twice"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_forms_that_propagate_the_declared_loss_stay_valid(form, dtype):
    """The output check passes where the gradient at the output is the factor times the declared loss's: a
    factor, the rows' vector as the root, two passes through the loss (which the cockpit merges once learned)."""
    cockpit = run(form, dtype=dtype)
    for step in range(1 if form == "retained_twice" else 0, 4):
        failed = [f["check"] for f in cockpit.checks[step]["failed"]]
        assert "backpropagated_loss" not in failed and cockpit.checks[step]["valid"], (step, failed)


def test_the_same_loss_twice_in_a_block_is_merged_with_the_summed_factor():
    """``(0.5 * loss).backward(retain_graph=True); (0.5 * loss).backward()``: once learned, the block's passes are
    merged, and their rows are divided by the factors' sum (1), not by the first pass's (0.5): the steps failed
    the gradient check (rows twice the gradient). Now the numbers of one plain pass."""
    merged, plain = run("retained_twice").get_output(), run("plain").get_output()
    for step in (1, 2):
        for name in ("GradNorm", "NormTest", "InnerTest", "OrthoTest", "Alpha"):
            assert merged[step][name] == pytest.approx(plain[step][name], rel=1e-10), (step, name)


def test_parameters_given_twice_are_refused_with_the_repeats_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"2 parameter\(s\) given more than once \(#2 is #0, #3 is #1\)"):
        Cockpit(list(model[0].parameters()) + list(model.parameters()), quantities=configuration("economy"))
    Cockpit(list(dict.fromkeys(list(model[0].parameters()) + list(model.parameters()))))  # the advice works


def test_quantization_aware_training_leaves_the_rows_out_until_the_observers_are_disabled():
    """F3: eager-mode QAT (``prepare_qat``): the activation observers take their scale from the whole batch, so
    the row-by-row re-run did not reproduce the outputs and every tracked step raised (naming ``Linear`` and
    causes that did not apply). Now the per-sample quantities are left out with a note naming the observer, as
    for BatchNorm; with the observers disabled they come back, equal to an autograd loop over the rows."""
    torch.manual_seed(0)
    model = nn.Sequential(torch.ao.quantization.QuantStub(), nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4),
                          torch.ao.quantization.DeQuantStub())
    model.train()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.ao.quantization.prepare_qat(model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    cockpit = Cockpit(params, quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            if step == 2:
                model.apply(torch.ao.quantization.disable_observer)
            x, y = torch.randn(12, 6, generator=generator), torch.randint(0, 4, (12,), generator=generator)
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, info={"batch_size": 12, "individual_losses": losses, "loss": losses.mean(), "optimizer": opt}):
                losses.mean().backward(retain_graph=True)
            if step == 2:
                rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], params, retain_graph=True)])
                                    for i in range(12)]).double()
            opt.step()
    out = cockpit.get_output()
    for step in (0, 1):
        assert cockpit.checks[step]["valid"] and "NormTest" not in out[step] and "GradNorm" in out[step]
        assert any("FakeQuantize observer (activation_post_process:" in n for n in cockpit.checks[step]["notes"])
    mean = rows.mean(0)
    norm_test = (((rows - mean) ** 2).sum() / (11 * 12 * (mean @ mean))).sqrt().item()
    assert out[2]["NormTest"] == pytest.approx(norm_test, rel=1e-4)


def test_micro_batches_numbered_as_steps_withdraw_the_first_and_say_why():
    """F4: two micro-batches per optimizer step, the cockpit entered with a counter per micro-batch (0, 1, 2, ...),
    no ``micro_batches``: the second micro-batch failed ``stale_gradient`` telling to call zero_grad (which the loop
    did), and the first was stored as valid with its six rows' numbers (GradNorm 48-79% above the optimizer step's).
    Now the first is withdrawn (``micro_batch_numbering``) once the second shows it, and both reasons name the
    numbering."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(2)
    counter = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            opt.zero_grad()
            for _ in range(2):
                x, y = torch.randn(6, 6, generator=generator, dtype=DT), torch.randint(0, 4, (6,), generator=generator)
                losses = F.cross_entropy(model(x), y, reduction="none")
                with cockpit(counter, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean(),
                                            "optimizer": opt}):
                    (losses.mean() / 2).backward()
                counter += 1
            opt.step()
    out = cockpit.get_output()
    for first in (0, 2, 4):
        failed = {f["check"]: f["reason"] for f in cockpit.checks[first]["failed"]}
        assert not cockpit.checks[first]["valid"] and "micro_batch_numbering" in failed
        assert not {"GradNorm", "NormTest", "Loss", "GradHist1d"} & set(out.get(first, {}))
        second = {f["check"]: f["reason"] for f in cockpit.checks[first + 1]["failed"]}
        assert "micro-batches of one optimizer step" in second["stale_gradient"]
    assert {0, 1, 2, 3, 4, 5} <= set(cockpit.invalid_steps)


def test_a_forgotten_zero_grad_is_not_taken_for_micro_batches():
    """The optimizer steps between the tracked steps and p.grad is not zeroed: the plain stale-gradient reason,
    and the step before keeps its values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(DT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    generator = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            x, y = torch.randn(6, 6, generator=generator, dtype=DT), torch.randint(0, 4, (6,), generator=generator)
            losses = F.cross_entropy(model(x), y, reduction="none")
            with cockpit(step, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean(), "optimizer": opt}):
                losses.mean().backward()
            opt.step()
    assert cockpit.checks[0]["valid"] and "GradNorm" in cockpit.get_output()[0]
    reason = {f["check"]: f["reason"] for f in cockpit.checks[1]["failed"]}["stale_gradient"]
    assert "a forgotten optimizer.zero_grad()" in reason and "entered under two step numbers" not in reason


def test_backward_with_inputs_takes_the_curvature_of_the_parameters_it_differentiates():
    """F5: ``loss.backward(inputs=head)`` under the full preset: the first layer requires a gradient but got none,
    and the Hessian-vector products differentiated the head's gradients with respect to it as well, an asymmetric
    operator: HessMaxEV was refused ("not symmetric ... a wrong second derivative") and HessTrace's head block was
    stored at half its value, 2.4-4.7 of its standard errors off. The parameters whose gradient has no graph are
    now left out of the differentiation (zeros, as frozen ones): HessMaxEV is the head block's top eigenvalue."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)).to(DT)
    params, head = list(model.parameters()), list(model[2].parameters())
    cockpit = Cockpit(params, quantities=configuration("full"), model=model)
    x, y = torch.randn(12, 6, dtype=DT), torch.randint(0, 4, (12,))

    def head_loss(*flat):
        out = torch.tanh(x @ params[0].detach().T + params[1].detach()) @ flat[0].T + flat[1]
        return F.cross_entropy(out, y)

    blocks = torch.autograd.functional.hessian(head_loss, tuple(p.detach() for p in head))
    sizes = [p.numel() for p in head]
    dense = torch.cat([torch.cat([blocks[i][j].reshape(sizes[i], sizes[j]) for j in range(2)], 1) for i in range(2)])
    top = dominant(dense)
    track_one_step(cockpit, F.cross_entropy(model(x), y, reduction="none"), inputs=head)
    out = cockpit.get_output()[0]
    assert not any("not symmetric" in n for n in cockpit.checks[0]["notes"])
    assert out["HessMaxEV"] == pytest.approx(top, rel=1e-2)


def test_parameters_of_two_dtypes_get_their_curvature():
    """F7: a float32 body with a float64 head (as a bfloat16 body with a float32 head): the full preset raised a raw
    ``addmv`` dtype error from the Lanczos engine at step 0. The operator's vectors now take the widest dtype and
    each product its parameter's: HessMaxEV equals the dense Hessian's (float64 reference), and the KFAC operator,
    which needs one dtype, says so."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(6, 10), nn.Linear(10, 4).double()

        def forward(self, x):
            return self.head(torch.tanh(self.body(x.float())).double())

    torch.manual_seed(0)
    model = Mixed()
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=configuration("full"), model=model)
    x, y = torch.randn(12, 6, dtype=DT), torch.randint(0, 4, (12,))
    sizes, shapes = [p.numel() for p in params], [p.shape for p in params]

    def loss_of(flat):
        w1, b1, w2, b2 = [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]
        return F.cross_entropy(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)

    dense = torch.autograd.functional.hessian(loss_of, torch.cat([p.detach().double().reshape(-1) for p in params]))
    track_one_step(cockpit, F.cross_entropy(model(x), y, reduction="none"))
    assert cockpit.get_output()[0]["HessMaxEV"] == pytest.approx(dominant(dense), rel=1e-2)

    from cockpit_like.quantities import PreconditionedGradNorm

    cockpit = Cockpit(params, quantities=[PreconditionedGradNorm(track_schedule=lambda step: True)], model=model)
    model.zero_grad()
    losses = F.cross_entropy(model(x), y, reduction="none")
    with pytest.raises(ValueError, match="several dtypes"):
        with cockpit(0, info={"batch_size": 12, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()


@pytest.mark.parametrize("where", ["inside", "no_grad"])
def test_an_evaluation_forward_inside_the_block_of_an_extended_model_is_named(where):
    """F6: the README's extended model, a metrics forward pass on an evaluation batch of the same size with
    gradients on, inside the block before ``backward()``: BackPACK's kept inputs were the evaluation batch's, every
    step failed the gradient check with ten causes none of which applied. Now it fails ``forward_in_block``, which
    names the cause (GradNorm and Loss kept, as for the gradient check); under ``torch.no_grad()`` it is exact."""
    from backpack import extend

    torch.manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)).to(DT))
    lossfunc = extend(nn.CrossEntropyLoss())
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=generator, dtype=DT), torch.randint(0, 4, (8,), generator=generator)
    xv, yv = torch.randn(8, 6, generator=generator, dtype=DT), torch.randint(0, 4, (8,), generator=generator)
    out = model(x)
    losses, loss = F.cross_entropy(out, y, reduction="none"), lossfunc(out, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": loss}):
            if where == "inside":
                F.cross_entropy(model(xv), yv).item()
            else:
                with torch.no_grad():
                    F.cross_entropy(model(xv), yv).item()
            loss.backward()
    checks, out = cockpit.checks[0], cockpit.get_output()[0]
    if where == "no_grad":
        assert checks["valid"] and "NormTest" in out
        return
    failed = {f["check"]: f["reason"] for f in checks["failed"]}
    assert "ran again inside the cockpit's block" in failed["forward_in_block"]
    assert "NormTest" not in out and "GradNorm" in out and "Loss" in out


def test_a_second_forward_pass_backpropagated_is_named_as_the_cause():
    """F8: the declared losses from one forward call, the backpropagated loss from a second call on the same batch:
    no parameter got rows, and the reason blamed parameters read outside any module call. It now names the
    second forward pass first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)).to(DT)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    x, y = torch.randn(8, 6, dtype=DT), torch.randint(0, 4, (8,))
    losses = F.cross_entropy(model(x), y, reduction="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cockpit(0, info={"batch_size": 8, "individual_losses": losses, "loss": losses.mean()}):
            F.cross_entropy(model(x), y).backward()
    reason = {f["check"]: f["reason"] for f in cockpit.checks[0]["failed"]}["gradient"]
    assert "did not go through the forward call that info['loss']" in reason


def test_the_legacy_weight_norm_is_named_with_its_replacement():
    """M2: the legacy ``torch.nn.utils.weight_norm`` computes the weight in a forward pre-hook the re-runs do not
    run; the gradient check's reason blamed a parameter read outside any module call, and now names the legacy
    hook and ``torch.nn.utils.parametrizations.weight_norm``."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(6, 10)), nn.Tanh(), nn.Linear(10, 4)).to(DT)
    cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
    x, y = torch.randn(8, 6, dtype=DT), torch.randint(0, 4, (8,))
    track_one_step(cockpit, F.cross_entropy(model(x), y, reduction="none"))
    reason = {f["check"]: f["reason"] for f in cockpit.checks[0]["failed"]}["gradient"]
    assert "legacy torch.nn.utils.weight_norm" in reason and "parametrizations.weight_norm" in reason


@pytest.mark.parametrize("piece", [7, 1 << 20])
def test_the_output_reference_measures_the_gradients_distance(piece, monkeypatch):
    """The projections (made piece by piece, rows straddling the pieces) stand for the gradients: the same gradient
    times the factor passes, one off by a known relative distance is measured at about that distance."""
    from cockpit_like.checks.invariants import tolerance_for
    from cockpit_like.checks.loss_factor import OutputReference

    monkeypatch.setattr(OutputReference, "PIECE", piece)
    generator = torch.Generator().manual_seed(3)
    output = torch.randn(6, 5, 3, dtype=DT, requires_grad=True) * 1.0  # a non-leaf: it has a node
    node = output.grad_fn
    gradient = torch.randn(6, 5, 3, generator=generator, dtype=DT)
    other = torch.randn(6, 5, 3, generator=generator, dtype=DT)
    for delta, expected in ((3.0 * gradient / 6, None), (3.0 * gradient / 6 + 0.3 * other.norm() ** -1 * (3.0 * gradient / 6).norm() * other, 0.3)):
        reference = OutputReference(seed=11, batch=6)
        reference.keep([(output, gradient)])
        assert reference.wants(node, 0)
        reference.see(node, 0, delta)
        found = reference.mismatch(3.0, tolerance_for)
        if expected is None:
            assert found is None
        else:
            assert 0.1 < found < 0.6
