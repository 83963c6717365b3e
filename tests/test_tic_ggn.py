"""TIC on any model with a positive curvature: the GGN diagonal (issue 37, item 4).

Where BackPACK cannot run, ``curvature="auto"`` makes TICDiag and TICTrace
divide by the GGN diagonal of the cross-entropy of ``info["outputs"]``
(:class:`~cockpit_like.backends.sampled.GGNDiagonal`): exact for outputs
``[B, C]`` with few classes, else sketched with Rademacher signs. Checked in float64 against
brute-force twins: the dense GGN ``(1/N) sum_n J_n^T (diag p_n - p_n p_n^T) J_n``
from a loop of ``autograd.grad`` over the logits' entries, per-sample
gradients from a loop over rows, and the sketched estimate with the same draws.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from cockpit_like import Cockpit
from cockpit_like.backends import randomness
from cockpit_like.quantities import HessTrace, TICDiag, TICTrace
from cockpit_like.utils.schedules import linear
from tests.zoo import ZOO, per_sample_grads_loop

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")

EPS = 1e-7


def _logits(outputs):
    """The logits of the problem's mean cross-entropy (the LM loss predicts token t + 1 from tokens <= t)."""
    return outputs.logits[:, :-1] if hasattr(outputs, "logits") else outputs


def _dense_ggn_diagonal(problem, inputs, params) -> list[torch.Tensor]:
    with sdpa_kernel([SDPBackend.MATH]):
        logits = _logits(problem.forward(problem.model, inputs))
    flat = logits.reshape(-1, logits.shape[-1])
    rows, classes = flat.shape
    jacobian = []  # [N * C, D]
    for entry in flat.reshape(-1):
        grads = torch.autograd.grad(entry, params, retain_graph=True, allow_unused=True)
        jacobian.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)]))
    jacobian = torch.stack(jacobian).reshape(rows, classes, -1)
    p = torch.softmax(flat.detach(), dim=1)
    hessians = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)  # [N, C, C]
    diagonal = torch.einsum("ncd,nce,ned->d", jacobian, hessians, jacobian) / rows
    return list(diagonal.split([q.numel() for q in params]))


def _squares(problem, inputs, targets, params) -> list[torch.Tensor]:
    """``(1/B) sum_i g_i^2`` from per-sample gradients by a loop over rows."""
    with sdpa_kernel([SDPBackend.MATH]):
        grads = per_sample_grads_loop(problem, inputs, targets, params)
    return [(g**2).mean(0).reshape(-1) for g in grads]


def _track(problem, inputs, targets, quantities, outputs=True, step=0):
    model = problem.model
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    forward = problem.forward(model, inputs)
    loss = problem.sample_losses(forward, targets).mean()
    info = {"batch_size": len(inputs), "loss": loss}
    if outputs:
        info["outputs"] = _logits(forward)
    with cockpit(step, info=info):
        loss.backward(create_graph=cockpit.create_graph(step))
    return cockpit


@pytest.mark.parametrize("name", ["custom", "layernorm_mlp", "encoder"])
def test_auto_tic_is_the_tic_of_the_exact_ggn(name):
    """Outputs [B, C], 3-4 classes: one backward pass per class gives the GGN diagonal exactly."""
    problem = ZOO[name](0)
    params = list(problem.model.parameters())
    inputs, targets = problem.batch(4, 7)
    ggn = _dense_ggn_diagonal(problem, inputs, params)
    squares = _squares(problem, inputs, targets, params)
    tic_diag = float(sum((s / (c.reshape(-1) + EPS)).sum() for s, c in zip(squares, ggn)))
    tic_trace = float(sum(s.sum() for s in squares) / (sum(c.sum() for c in ggn) + EPS))
    quantities = [TICDiag(linear(1)), TICTrace(linear(1)), HessTrace(linear(1), curvature="ggn")]
    cockpit = _track(problem, inputs, targets, quantities)
    output = cockpit.get_output()[0]
    for quantity in quantities[:2]:
        assert quantity.settings()["computed_with"] == "ggn"
        assert quantity.standard_errors[0] == 0.0 and quantity.reliable[0] is True
    assert all(float(c.min()) >= 0 for c in ggn) and tic_diag > 0 and tic_trace > 0
    assert output["TICDiag"] == pytest.approx(tic_diag, rel=1e-9)
    assert output["TICTrace"] == pytest.approx(tic_trace, rel=1e-9)
    assert output["HessTrace"] == pytest.approx([float(c.sum()) for c in ggn], rel=1e-9, abs=1e-13)
    notes = output.get("checks", {}).get("notes", [])
    assert not any("TIC" in note for note in notes), notes  # the loss is the outputs' mean cross-entropy


def _sketched_twin(problem, inputs, params, step, samples, rows=None):
    """The sketched estimate with the cockpit's draws: per draw ``s_n = S_n xi_n`` (the dense root
    ``diag(sqrt p) - p sqrt(p)^T`` times Rademacher signs) and ``(1/N) sum_i gb_i^2``, rows by a loop."""
    model = problem.model
    with sdpa_kernel([SDPBackend.MATH]):
        logits = _logits(problem.forward(model, inputs))
    flat = logits.reshape(-1, logits.shape[-1]).detach()
    draws = randomness.generator(step, "ggn diagonal signs", "cpu", float(flat.sum()))
    positions = flat.shape[0]
    p = torch.softmax(flat, 1)
    roots = torch.diag_embed(p.sqrt()) - p.unsqueeze(2) * p.sqrt().unsqueeze(1)  # [N, C, C], S S^T = H
    result = []
    for _ in range(samples):
        signs = torch.randint(0, 2, flat.shape, generator=draws).to(flat.dtype) * 2 - 1
        sketch = torch.einsum("ncd,nd->nc", roots, signs).reshape(logits.shape)
        squares = [torch.zeros_like(q) for q in params]
        norms = []
        for i in range(len(inputs)):
            with sdpa_kernel([SDPBackend.MATH]):
                row = _logits(problem.forward(model, inputs[i : i + 1]))
            norms.append(0.0)
            for s, g in zip(squares, torch.autograd.grad((row * sketch[i : i + 1]).sum(), params, allow_unused=True)):
                if g is not None:
                    s += g**2
                    norms[-1] += float((g**2).sum()) / positions
        result.append([s.reshape(-1) / positions for s in squares])
        if rows is not None:
            rows.append(norms)  # each row's part of the draw's trace
    return result


def test_auto_tic_on_sequences_is_the_sketched_ggn_with_its_error_bar():
    """Outputs [B, T, V]: the mean of 4 sketched draws, every draw >= 0; TICDiag with the second-order
    correction of 1/c̄; the standard errors from the draws."""
    problem = ZOO["gpt2"](0)
    params = list(problem.model.parameters())
    inputs, targets = problem.batch(3, 2)
    rows = []
    draws = _sketched_twin(problem, inputs, params, step=0, samples=4, rows=rows)
    squares = _squares(problem, inputs, targets, params)
    mean = [torch.stack(column).mean(0) for column in zip(*draws)]
    variance = [torch.stack(column).var(0) / 4 for column in zip(*draws)]
    tic_diag = float(sum((s / (c + EPS) * (1 - v / (c + EPS) ** 2).clamp(min=0)).sum()
                         for s, c, v in zip(squares, mean, variance)))
    numerator = float(sum(s.sum() for s in squares))
    traces = torch.tensor([float(sum(c.sum() for c in draw)) for draw in draws], dtype=torch.float64)
    tic_trace = numerator / (float(traces.mean()) + EPS)
    deviations = torch.tensor(
        [float(sum((s * (c - d) / (c + EPS) ** 2).sum() for s, c, d in zip(squares, mean, draw))) for draw in draws],
        dtype=torch.float64,
    )
    quantities = [TICDiag(linear(1)), TICTrace(linear(1))]
    cockpit = _track(problem, inputs, targets, quantities)
    output = cockpit.get_output()[0]
    assert all(float(c.min()) >= 0 for draw in draws for c in draw)
    assert output["TICDiag"] == pytest.approx(tic_diag, rel=1e-9)
    assert output["TICTrace"] == pytest.approx(tic_trace, rel=1e-9)
    # the errors: the draws' standard errors widened by Student-t's factor for 3 degrees of freedom; the trace's the
    # larger of that and the rows' pooled variance widened by the factor of its Satterthwaite degrees of freedom
    # (sixth outside round: the 4 draws' spread alone put the exact TIC up to 22 errors away)
    t_factor = lambda dof: float(stats.t.ppf(stats.norm.cdf(2), dof)) / 2  # noqa: E731
    assert quantities[0].standard_errors[0] == pytest.approx(float(deviations.std() / 2) * t_factor(3), rel=1e-7)
    spreads = torch.tensor(rows, dtype=torch.float64).var(0)
    pooled = float((spreads.sum() / 4).sqrt()) * t_factor(int(float(spreads.sum()) ** 2 / float((spreads**2 / 3).sum())))
    trace_error = max(float(traces.std() / 2) * t_factor(3), pooled)
    assert quantities[1].standard_errors[0] == pytest.approx(numerator / float(traces.mean()) ** 2 * trace_error, rel=1e-7)
    # the draws differ (the test can fail): the error bar is not zero
    assert quantities[0].standard_errors[0] > 0 and quantities[1].standard_errors[0] > 0


def test_the_sketched_ggn_trace_is_unbiased():
    """Over the cockpit's seeds the sketched GGN trace averages to the dense one (within 4 standard errors)."""
    problem = ZOO["gpt2"](0)
    params = list(problem.model.parameters())
    inputs, targets = problem.batch(2, 3)
    exact = float(sum(c.sum() for c in _dense_ggn_diagonal(problem, inputs, params)))
    values = []
    try:
        for seed in range(12):
            randomness.set_seed(seed)
            quantity = HessTrace(linear(1), curvature="ggn")
            _track(problem, inputs, targets, [quantity])
            for p in params:
                p.grad = None
            values.append(sum(quantity.get_output()[0]))
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    values = torch.tensor(values, dtype=torch.float64)
    spread = float(values.std() / len(values) ** 0.5)
    assert spread > 0 and abs(float(values.mean()) - exact) < 4 * spread


def test_auto_without_outputs_falls_back_and_says_so():
    problem = ZOO["custom"](0)
    inputs, targets = problem.batch(4, 0)
    quantities = [TICDiag(linear(1)), TICTrace(linear(1))]
    cockpit = _track(problem, inputs, targets, quantities, outputs=False)
    notes = cockpit.get_output()[0]["checks"]["notes"]
    # TICDiag divides entry by entry: an indefinite, noisy Hessian diagonal gives a value that means nothing, so
    # none is stored (an outside trial saw 294 for 79 and -16 for -77 with no error bar); TICTrace (a sum) falls
    # back to Hutchinson's estimate, with its error bar
    assert any("TICDiag at step 0: no value stored" in note for note in notes), notes
    assert 0 not in quantities[0].get_output()
    assert any("TICTrace at step 0: curvature='auto' divides by the GGN diagonal" in note for note in notes), notes
    assert 0 in quantities[1].get_output() and 0 in quantities[1].standard_errors
    assert quantities[0].settings()["computed_with"] == "ggn"


def test_explicit_ggn_needs_the_outputs():
    from cockpit_like.context import MissingInfoError

    problem = ZOO["custom"](0)
    inputs, targets = problem.batch(4, 0)
    with pytest.raises(MissingInfoError):
        _track(problem, inputs, targets, [TICDiag(linear(1), curvature="ggn")], outputs=False)


def test_an_unreliable_estimate_says_so():
    """A HessTrace total within 2 standard errors of zero is flagged: reliable[step] False and a note; one
    Hutchinson sample has an error bar too (the bound from its product's squared norm)."""
    flags = []
    try:
        # the tiny GPT-2's trace is small against its noise (flagged); the ResNet's large against it (not flagged)
        for name, seed, samples in [("gpt2", 0, 1), ("gpt2", 0, 2), ("gpt2", 1, 2), ("gpt2", 4, 8),
                                    ("resnet_groupnorm", 0, 4), ("resnet_groupnorm", 1, 1)]:
            problem = ZOO[name](0)
            inputs, targets = problem.batch(4, 1)
            randomness.set_seed(seed)
            quantity = HessTrace(linear(1), curvature="hutchinson", hutchinson_samples=samples)
            cockpit = _track(problem, inputs, targets, [quantity])
            for p in problem.model.parameters():
                p.grad = None
            total, error = sum(quantity.get_output()[0]), quantity.total_errors[0]
            notes = cockpit.get_output()[0].get("checks", {}).get("notes", [])
            flagged = any(note.startswith("HessTrace at step 0") for note in notes)
            assert quantity.reliable[0] is (abs(total) > 2 * error) is (not flagged)
            assert 0 < error < float("inf")
            flags.append(flagged)
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    assert any(flags) and not all(flags)  # the test can fail both ways


def test_micro_batches_give_the_whole_batch_tic():
    """Two micro-batches of 2 rows: the GGN diagonal is the row-weighted mean of theirs, so TIC equals the
    whole batch's (exact GGN, float64), with its standard error 0 as in one pass."""
    problem = ZOO["custom"](0)
    params = list(problem.model.parameters())
    inputs, targets = problem.batch(4, 5)
    ggn = _dense_ggn_diagonal(problem, inputs, params)
    squares = _squares(problem, inputs, targets, params)
    tic_trace = float(sum(s.sum() for s in squares) / (sum(c.sum() for c in ggn) + EPS))
    quantity = TICTrace(linear(1))
    cockpit = Cockpit(problem.model.parameters(), quantities=[quantity], model=problem.model)
    for micro in range(2):
        part = slice(2 * micro, 2 * micro + 2)
        outputs = problem.forward(problem.model, inputs[part])
        loss = problem.sample_losses(outputs, targets[part]).mean()
        info = {"batch_size": 2, "loss": loss, "outputs": outputs, "micro_batches": 2}
        with cockpit(0, info=info):
            (loss / 2).backward(create_graph=cockpit.create_graph(0))
    assert cockpit.get_output()[0]["TICTrace"] == pytest.approx(tic_trace, rel=1e-9)
    assert quantity.standard_errors[0] == 0.0 and quantity.reliable[0] is True


def test_a_loss_that_is_not_the_cross_entropy_of_the_outputs_stores_no_value_and_says_so():
    """The GGN is the cross-entropy's: with an MSE loss on the same outputs the step stores no TIC (an outside
    trial saw 540.5 where the MSE's own GGN gives 87.5) and says why; with the cross-entropy (also with label
    smoothing) nothing is said."""
    from cockpit_like.backends.sampled import looks_like_mean_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 1, 1, 2])
    assert looks_like_mean_cross_entropy(nn.functional.cross_entropy(logits, labels), logits) is True
    smoothed = nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)
    assert looks_like_mean_cross_entropy(smoothed, logits) is True
    assert looks_like_mean_cross_entropy(nn.functional.cross_entropy(logits, labels, reduction="sum"), logits) is False
    assert looks_like_mean_cross_entropy(nn.functional.mse_loss(logits, torch.zeros(5, 4, dtype=torch.float64)), logits) is False
    assert looks_like_mean_cross_entropy(logits.sum() * 0 + 1.0, torch.randn(2, 2, requires_grad=True)) is None

    problem = ZOO["custom"](0)
    model = problem.model
    inputs, _ = problem.batch(4, 0)
    quantity = TICTrace(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[quantity], model=model)
    outputs = model(inputs)
    loss = nn.functional.mse_loss(outputs, torch.zeros_like(outputs))
    with cockpit(0, info={"batch_size": 4, "loss": loss, "outputs": outputs}):
        loss.backward(create_graph=cockpit.create_graph(0))
    notes = cockpit.get_output()[0]["checks"]["notes"]
    assert any("no value stored" in note and "is not a mean cross-entropy" in note for note in notes), notes
    assert 0 not in quantity.get_output()


def test_auto_without_outputs_beside_the_engine_takes_hutch_plus_plus_and_says_which():
    """Without ``info["outputs"]`` TIC's 'auto' falls back to the Hessian diagonal: Hutch++ on the engine's space
    where HessMaxEV runs at the step (the same as an explicit 'hutch++'), and the note names the estimator."""
    from cockpit_like.quantities import HessMaxEV

    problem = ZOO["custom"](0)
    inputs, targets = problem.batch(4, 0)
    auto = TICTrace(linear(1))
    cockpit = _track(problem, inputs, targets, [HessMaxEV(linear(1)), auto], outputs=False)
    explicit = TICTrace(linear(1), curvature="hutch++")
    _track(ZOO["custom"](0), inputs, targets, [HessMaxEV(linear(1)), explicit], outputs=False)
    assert auto.estimators[0] == "hutch++"
    assert auto.get_output()[0] == pytest.approx(explicit.get_output()[0], rel=1e-10)
    notes = cockpit.get_output()[0]["checks"]["notes"]
    assert any("did not give; computed with an estimate of the Hessian diagonal instead (hutch++" in note
               for note in notes), notes  # fmt: skip


def test_a_loss_with_a_term_outside_the_outputs_stores_no_tic_and_says_so():
    """An auxiliary head in the loss that info['outputs'] does not go through: its parameters would get a GGN
    diagonal of 0 and TIC would divide by epsilon; before, the step raised a NotExtendedError that blamed the
    forward pass. Now no TIC, a note naming the parameters, and the step's other quantities stored."""
    from cockpit_like.quantities import NormTest, TICDiag

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head, self.aux = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 1)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return self.head(h), self.aux(h)

    torch.manual_seed(0)
    model = TwoHeads().double()
    tic, norm_test = TICDiag(linear(1)), NormTest(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[tic, norm_test], model=model)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    logits, aux = model(x)
    losses = nn.functional.cross_entropy(logits, y, reduction="none") + 0.1 * aux.squeeze(1) ** 2
    with cockpit(0, info={"batch_size": 6, "individual_losses": losses, "loss": losses.mean(), "outputs": logits}):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    notes = cockpit.get_output()[0]["checks"]["notes"]
    assert any("no value stored" in n and "aux.weight, aux.bias" in n for n in notes), notes
    assert 0 not in tic.get_output() and 0 in norm_test.get_output()


def test_the_sketched_tic_error_bars_hold_the_exact_value():
    """Sixth outside round: 15 classes (sketched), 30 cockpit seeds at the same parameters and batch. The 4 draws'
    spread alone put the exact TICTrace 21.7 errors away and within 2 errors on 25-26 of 30; now TICTrace within 3
    errors on every seed (dense float64 GGN and per-row gradients by a loop)."""
    from torch.func import functional_call

    classes, batch = 15, 6
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, classes)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (batch,), generator=g)
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    jac = torch.autograd.functional.jacobian(lambda *v: functional_call(model, dict(zip(names, v)), (x,)), tuple(params))
    jac = torch.cat([j.reshape(batch, classes, -1) for j in jac], 2)
    p = torch.softmax(model(x).detach(), -1)
    ggn = torch.einsum("ncd,nce,ned->d", jac, torch.diag_embed(p) - p[:, :, None] * p[:, None, :], jac) / batch
    grads = torch.stack([
        torch.cat([t.flatten() for t in torch.autograd.grad(
            nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))])
        for i in range(batch)
    ])
    m2 = (grads**2).mean(0)
    exact = {"TICDiag": float((m2 / (ggn + EPS)).sum()), "TICTrace": float(m2.sum() / (ggn.sum() + EPS))}
    misses = {"TICDiag": [], "TICTrace": []}
    try:
        for seed in range(30):
            randomness.set_seed(seed)
            cockpit = Cockpit(model.parameters(), quantities=[TICDiag(linear(1)), TICTrace(linear(1))], model=model)
            for q in model.parameters():
                q.grad = None
            out = model(x)
            losses = nn.functional.cross_entropy(out, y, reduction="none")
            loss = losses.mean()
            with cockpit(0, info={"batch_size": batch, "individual_losses": losses, "loss": loss, "outputs": out}):
                loss.backward(create_graph=cockpit.create_graph(0))
            output = cockpit.get_output()[0]
            for name in misses:
                error = output["checks"]["standard_errors"][name]["standard_error"]
                misses[name].append(abs(output[name] - exact[name]) / error)
    finally:
        randomness.set_seed(randomness.DEFAULT_SEED)
    trace, diag = misses["TICTrace"], misses["TICDiag"]
    assert max(trace) <= 3 and sum(v <= 2 for v in trace) >= 28, sorted(trace)
    # TICDiag's error has no rows' bound (its deviations weigh each entry by 1 / c̄_j^2, known only after the
    # draws): the Student-t factor alone; 27 within 2 and 29 within 3 here (docs/curvature.md)
    assert sum(v <= 2 for v in diag) >= 27 and sum(v <= 3 for v in diag) >= 28, sorted(diag)
