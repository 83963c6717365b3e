"""TIC with the GGN of ``info["outputs"]``: which losses it holds for, and steps it cannot compute.

``curvature="auto"`` on a model BackPACK cannot handle divides by the GGN
diagonal of the *plain* mean cross-entropy of ``info["outputs"]``
(:class:`~cockpit_like.backends.sampled.GGNDiagonal`). That is the loss's own
GGN only where the loss is that cross-entropy (hard labels, soft labels, label
smoothing, ignored positions). A weighted cross-entropy with weights ``<= 1``
(``0.5 * CE``, class weights) and distillation have the gradient of a
cross-entropy with other labels, so the gradient check alone passed them and
TIC came out wrong without a note (an outside trial: TICDiag 16.84 where the
loss's own GGN gives 33.68). The loss's value tells them apart
(:func:`~cockpit_like.backends.sampled.mean_cross_entropy_check`).

Brute force in float64: per-sample gradients by a loop of ``autograd.grad``
over rows, the Jacobian of the outputs, and the Hessian of each row's *own*
loss in its outputs (``torch.autograd.functional.hessian``), so the twin is
the TIC of the loss's own GGN, whatever the loss.

Also: a layer not called at a step (a skipped branch, an expert without
tokens) has zero rows and zero curvature there (before: a NotExtendedError
from the GGN's per-sample pass), and BatchNorm in training mode leaves TIC
out with a note (before: a BatchNormInTrainingError raised from the step).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cockpit_like import Cockpit
from cockpit_like.backends.sampled import looks_like_mean_cross_entropy, mean_cross_entropy_check
from cockpit_like.quantities import GradNorm, HessTrace, TICDiag, TICTrace
from cockpit_like.utils.configuration import configuration
from cockpit_like.utils.schedules import linear
from tests.helpers import backward_in

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:Using backward")

EPS = 1e-7
B, FEATURES, CLASSES = 8, 6, 3
DTYPE = torch.float64
WEIGHTS = torch.tensor([0.25, 0.5, 1.0], dtype=DTYPE)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, CLASSES)).to(DTYPE)


def _batch(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(B, FEATURES, generator=generator, dtype=DTYPE)
    return x, torch.randint(0, CLASSES, (B,), generator=generator)


def _teacher_logits(x):
    with torch.no_grad():
        return _mlp(5)(x)


def _row_losses(kind: str, x, y):
    """``outputs [b, C] -> [b]`` row losses whose mean is the loss (``b`` rows of ``x``)."""
    teacher = _teacher_logits(x)
    soft = torch.softmax(torch.randn(len(y), CLASSES, generator=torch.Generator().manual_seed(3), dtype=DTYPE), 1)
    ignored = y.clone()
    ignored[1] = -100
    counted = int((ignored != -100).sum())

    def kd(out, temperature):
        kl = F.kl_div(F.log_softmax(out / temperature, -1), F.log_softmax(teacher / temperature, -1),
                      reduction="none", log_target=True).sum(-1)  # fmt: skip
        return kl * temperature**2

    losses = {
        "hard labels": lambda out: F.cross_entropy(out, y, reduction="none"),
        "label smoothing": lambda out: F.cross_entropy(out, y, reduction="none", label_smoothing=0.1),
        "soft labels": lambda out: F.cross_entropy(out, soft, reduction="none"),
        # each row its share: its loss times B / N, N the counted rows (0 for the ignored one)
        "ignored row": lambda out: F.cross_entropy(out, ignored, reduction="none") * len(y) / counted,
        "kl divergence": lambda out: kd(out, 1.0),  # KL(q || softmax(f)) = CE(q, f) - H(q)
        "0.5 * CE": lambda out: 0.5 * F.cross_entropy(out, y, reduction="none"),
        "class weights": lambda out: WEIGHTS[y] * F.cross_entropy(out, y, reduction="none"),
        "distillation": lambda out: 0.5 * kd(out, 2.0) + 0.5 * F.cross_entropy(out, y, reduction="none"),
    }
    return losses[kind]


PLAIN = ["hard labels", "label smoothing", "soft labels", "ignored row"]
WEIGHTED = ["0.5 * CE", "class weights", "distillation"]


def _brute_force_tic(model, parts) -> tuple[float, float, float, float]:
    """``(TICDiag, TICTrace)`` of the loss's own GGN and of the plain cross-entropy's GGN, float64, dense.

    ``parts``: ``(forward, row_losses)`` of equal micro-batches; ``forward(params) -> outputs``. The step's
    loss is the mean of all rows' losses; ``m2 = (1/B) sum_i g_i^2``, ``G = (1/B) sum_i J_i^T H_i J_i`` with
    ``H_i`` the Hessian of row ``i``'s loss in its outputs (or ``diag(p) - p p^T``, times the row's share)."""
    names = [name for name, _ in model.named_parameters()]
    theta = [p.detach() for p in model.parameters()]
    m2, own, plain, rows = 0.0, 0.0, 0.0, 0
    for forward, row_losses in parts:
        call = lambda *values: forward(dict(zip(names, values)))  # noqa: E731
        outputs = call(*theta).detach()
        jacobian = torch.autograd.functional.jacobian(call, tuple(theta))
        jacobian = torch.cat([j.reshape(*outputs.shape, -1) for j in jacobian], dim=-1)  # [b, C, D]
        leaves = [t.clone().requires_grad_(True) for t in theta]
        losses = row_losses(call(*leaves))
        gradients = []
        for n in range(outputs.shape[0]):
            grads = torch.autograd.grad(losses[n], leaves, retain_graph=True, allow_unused=True)
            gradients.append(torch.cat([(torch.zeros_like(t) if g is None else g).reshape(-1) for t, g in zip(theta, grads)]))
        counted = sum(1 for g in gradients if g.abs().max() > 0)  # an ignored row has no loss, no curvature
        for n, flat in enumerate(gradients):
            m2 = m2 + flat**2
            hessian = torch.autograd.functional.hessian(lambda o: row_losses(o)[n], outputs)[n, :, n, :]
            own = own + torch.einsum("cd,ce,ed->d", jacobian[n], hessian, jacobian[n])
            p = torch.softmax(outputs[n], 0)
            share = 0.0 if flat.abs().max() == 0 else len(gradients) / counted  # a row's share: its loss times B / N
            plain = plain + share * torch.einsum("cd,ce,ed->d", jacobian[n], torch.diag(p) - torch.outer(p, p), jacobian[n])
        rows += outputs.shape[0]
    m2, own, plain = m2 / rows, own / rows, plain / rows
    return (float((m2 / (own + EPS)).sum()), float(m2.sum() / (own.sum() + EPS)),
            float((m2 / (plain + EPS)).sum()), float(m2.sum() / (plain.sum() + EPS)))  # fmt: skip


def _forward(model, x, **kwargs):
    return lambda params: torch.func.functional_call(model, params, (x,), kwargs)


def _notes(cockpit, step=0) -> list[str]:
    return cockpit.get_output().get(step, {}).get("checks", {}).get("notes", [])


# ---- the check itself --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", PLAIN + WEIGHTED)
def test_the_check_passes_plain_cross_entropies_and_refuses_weighted_ones(kind):
    """With and without info['individual_losses']: a plain cross-entropy passes, a weighted one (whose
    labels y' = p - N dL/df are distributions, so the gradient check alone passed it) does not."""
    x, y = _batch()
    logits = _mlp()(x)
    losses = _row_losses(kind, x, y)(logits)
    verdict, why = mean_cross_entropy_check(losses.mean(), logits)
    row_verdict, row_why = mean_cross_entropy_check(losses.mean(), logits, losses)
    if kind in PLAIN:
        assert verdict is True and row_verdict is True, (why, row_why)
        assert why is None and row_why is None
    else:
        assert verdict is False and row_verdict is False
        assert "its gradient fits the labels" in why and "is not their mean cross-entropy" in why


def test_the_check_reads_each_rows_loss():
    """Rows' losses off their labels' cross-entropies by amounts that cancel in the mean: the mean passes,
    the rows do not (and the reason names a row); the same losses in the right rows pass."""
    x, y = _batch()
    logits = _mlp()(x)
    losses = F.cross_entropy(logits, y, reduction="none")
    shifted = losses + torch.tensor([0.3, -0.3] * (B // 2), dtype=DTYPE)  # constant per row: the same gradient
    assert mean_cross_entropy_check(shifted.mean(), logits)[0] is True
    verdict, why = mean_cross_entropy_check(shifted.mean(), logits, shifted)
    assert verdict is False and "(row " in why and "info['individual_losses']" in why
    assert looks_like_mean_cross_entropy(losses.mean(), logits, losses) is True
    # a KL divergence to soft labels has the cross-entropy's curvature, but its value is the cross-entropy less a
    # constant, which the check cannot tell from a weight: refused (no value, never a wrong one)
    divergence = _row_losses("kl divergence", x, y)(logits)
    assert looks_like_mean_cross_entropy(divergence.mean(), logits, divergence) is False


def test_the_check_on_sequences_batch_first_and_sequence_first():
    """Per-position labels (hard, label smoothing, ignored positions); a row's loss its positions' sum times
    B / N (its mean where every position counts). Sequence first ``[T, B, C]`` too; 0.5 * CE is refused."""
    torch.manual_seed(0)
    rows, length, classes = 3, 4, 5
    logits = torch.randn(rows, length, classes, dtype=DTYPE, requires_grad=True)
    tokens = torch.randint(0, classes, (rows, length))
    tokens[0, 2] = -100
    for smoothing in (0.0, 0.1):
        per_token = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none", label_smoothing=smoothing)
        counted = int((tokens != -100).sum())
        losses = per_token.sum(1) * rows / counted
        assert mean_cross_entropy_check(losses.mean(), logits, losses) == (True, None)
        first = logits.detach().transpose(0, 1).clone().requires_grad_(True)  # [T, B, C]
        per_token = F.cross_entropy(first.permute(1, 2, 0), tokens, reduction="none", label_smoothing=smoothing)
        losses = per_token.sum(1) * rows / counted
        assert mean_cross_entropy_check(losses.mean(), first, losses) == (True, None)
        assert mean_cross_entropy_check(0.5 * losses.mean(), first, 0.5 * losses)[0] is False


# ---- TIC against the loss's own GGN ------------------------------------------------------------


def _track_tic(model, x, row_losses, quantities, step=0):
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    outputs = model(x)
    losses = row_losses(outputs)
    info = {"batch_size": len(x), "loss": losses.mean(), "individual_losses": losses, "outputs": outputs}
    with cockpit(step, info=info):
        losses.mean().backward(create_graph=cockpit.create_graph(step))
    return cockpit


@pytest.mark.parametrize("kind", PLAIN)
def test_tic_of_a_plain_cross_entropy_is_the_tic_of_its_own_ggn(kind):
    model = _mlp()
    x, y = _batch()
    row_losses = _row_losses(kind, x, y)
    tic_diag, tic_trace, plain_diag, plain_trace = _brute_force_tic(model, [(_forward(model, x), row_losses)])
    assert tic_diag == pytest.approx(plain_diag, rel=1e-9) and tic_trace == pytest.approx(plain_trace, rel=1e-9)
    quantities = [TICDiag(linear(1)), TICTrace(linear(1))]
    cockpit = _track_tic(model, x, row_losses, quantities)
    output = cockpit.get_output()[0]
    assert quantities[0].settings()["computed_with"] == "ggn"
    assert output["TICDiag"] == pytest.approx(tic_diag, rel=1e-9)
    assert output["TICTrace"] == pytest.approx(tic_trace, rel=1e-9)
    assert not any("TIC" in note for note in _notes(cockpit)), _notes(cockpit)


@pytest.mark.parametrize("kind", WEIGHTED)
def test_tic_of_a_weighted_cross_entropy_stores_no_value_and_says_why(kind):
    """The outside trial's losses: the plain cross-entropy's GGN gives another TIC than the loss's own (so a
    stored value would be wrong: the test can fail), and the step stores none, with a note."""
    model = _mlp()
    x, y = _batch()
    row_losses = _row_losses(kind, x, y)
    tic_diag, tic_trace, plain_diag, plain_trace = _brute_force_tic(model, [(_forward(model, x), row_losses)])
    assert abs(plain_diag / tic_diag - 1) > 0.005 and abs(plain_trace / tic_trace - 1) > 0.005
    quantities = [TICDiag(linear(1)), TICTrace(linear(1)), GradNorm(linear(1))]
    cockpit = _track_tic(model, x, row_losses, quantities)
    output = cockpit.get_output()[0]
    assert "TICDiag" not in output and "TICTrace" not in output and "GradNorm" in output
    notes = _notes(cockpit)
    for name in ("TICDiag", "TICTrace"):
        assert any(note.startswith(f"{name} at step 0: no value stored") and "is not a mean cross-entropy" in note
                   and "its gradient fits the labels" in note and "'hutchinson'" in note for note in notes), notes


def test_micro_batches_refuse_a_weighted_cross_entropy_too():
    """Each micro-batch's check counts (before, the merge of the micro-batches' diagonals dropped the verdict,
    and a weighted cross-entropy got a value without a note)."""
    model = _mlp()
    x, y = _batch()
    tic = TICTrace(linear(1))
    cockpit = Cockpit(model.parameters(), quantities=[tic], model=model)
    for micro in range(2):
        part = slice(4 * micro, 4 * micro + 4)
        outputs = model(x[part])
        losses = _row_losses("0.5 * CE", x[part], y[part])(outputs)
        info = {"batch_size": 4, "loss": losses.mean(), "individual_losses": losses, "outputs": outputs,
                "micro_batches": 2}  # fmt: skip
        with cockpit(0, info=info):
            (losses.mean() / 2).backward(create_graph=cockpit.create_graph(0))
    assert 0 not in tic.get_output()
    assert any(note.startswith("TICTrace at step 0: no value stored") for note in _notes(cockpit)), _notes(cockpit)


# ---- layers not called at a step ---------------------------------------------------------------


class _Branchy(nn.Module):
    """A branch that runs only when asked (a skipped block; an expert that got no tokens)."""

    def __init__(self):
        super().__init__()
        self.body, self.branch, self.head = nn.Linear(FEATURES, 4), nn.Linear(4, 4), nn.Linear(4, CLASSES)

    def forward(self, x, branch: bool = False):
        h = torch.tanh(self.body(x))
        if branch:
            h = torch.tanh(self.branch(h))
        return self.head(h)


def test_a_layer_not_called_has_zero_rows_and_zero_curvature():
    """Before: NotExtendedError 'got no gradient ... pass only parameters the loss depends on' from the GGN's
    per-sample pass. Now TIC is exact, the branch's entries 0 / (0 + eps) = 0."""
    torch.manual_seed(0)
    model = _Branchy().to(DTYPE)
    x, y = _batch()
    row_losses = _row_losses("hard labels", x, y)
    tic_diag, tic_trace, _, _ = _brute_force_tic(model, [(_forward(model, x), row_losses)])
    quantities = [TICDiag(linear(1)), TICTrace(linear(1)), HessTrace(linear(1), curvature="ggn")]
    cockpit = _track_tic(model, x, row_losses, quantities)
    output = cockpit.get_output()[0]
    assert output["TICDiag"] == pytest.approx(tic_diag, rel=1e-9)
    assert output["TICTrace"] == pytest.approx(tic_trace, rel=1e-9)
    assert output["HessTrace"][2:4] == [0.0, 0.0] and output["HessTrace"][0] > 0
    assert output["checks"]["no_gradient"] == ["branch.weight", "branch.bias"]


def test_micro_batches_where_a_layer_runs_in_one_only():
    """The branch runs in the first micro-batch, not in the second: it has a gradient from the first, so the
    second's 'outside the outputs' test must ask the loss's graph, not p.grad (before: no value, and a note
    blaming an auxiliary loss). TIC of the whole batch, exact."""
    torch.manual_seed(0)
    model = _Branchy().to(DTYPE)
    x, y = _batch()
    parts = [(slice(0, 4), True), (slice(4, 8), False)]
    brute = [(_forward(model, x[part], branch=branch), _row_losses("label smoothing", x[part], y[part]))
             for part, branch in parts]  # fmt: skip
    tic_diag, tic_trace, _, _ = _brute_force_tic(model, brute)
    quantities = [TICDiag(linear(1)), TICTrace(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    for (part, branch), (_, row_losses) in zip(parts, brute):
        outputs = model(x[part], branch=branch)
        losses = row_losses(outputs)
        info = {"batch_size": 4, "loss": losses.mean(), "individual_losses": losses, "outputs": outputs,
                "micro_batches": 2}  # fmt: skip
        with cockpit(0, info=info):
            (losses.mean() / 2).backward(create_graph=cockpit.create_graph(0))
    output = cockpit.get_output()[0]
    assert output["TICDiag"] == pytest.approx(tic_diag, rel=1e-9), _notes(cockpit)
    assert output["TICTrace"] == pytest.approx(tic_trace, rel=1e-9)


@pytest.mark.parametrize("preset", ["business", "full"])
def test_presets_with_a_skipped_layer_and_outputs_run(preset):
    torch.manual_seed(0)
    model = _Branchy().to(DTYPE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), model=model)
    for step in range(2):
        x, y = _batch(step)
        optimizer.zero_grad()
        outputs = model(x, branch=step == 1)
        losses = F.cross_entropy(outputs, y, reduction="none")
        info = {"batch_size": B, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer,
                "outputs": outputs}  # fmt: skip
        with cockpit(step, info=info):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    assert cockpit.checks[0]["valid"] and cockpit.checks[0]["no_gradient"] == ["branch.weight", "branch.bias"]
    assert "TICDiag" in cockpit.get_output()[0] and "TICDiag" in cockpit.get_output()[1]


# ---- BatchNorm in training mode ----------------------------------------------------------------


def test_batch_norm_in_training_mode_leaves_tic_out_with_a_note():
    """Before: BatchNormInTrainingError raised from the GGN's per-sample pass (only with info['outputs']).
    Now TIC (and a HessTrace on the same GGN) are left out with a note, the rest stored; in eval mode TIC
    is back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)
    quantities = [TICDiag(linear(1)), TICTrace(linear(1)), HessTrace(linear(1), curvature="ggn"), GradNorm(linear(1))]
    cockpit = Cockpit(model.parameters(), quantities=quantities, model=model)
    generator = torch.Generator().manual_seed(0)
    for step, train in enumerate((True, False)):
        model.train(train)
        x, y = torch.randn(6, 4, generator=generator, dtype=DTYPE), torch.randint(0, 3, (6,), generator=generator)
        outputs = model(x)
        backward_in(cockpit, step, F.cross_entropy(outputs, y, reduction="none"), outputs=outputs)
        model.zero_grad()
    first, second = cockpit.get_output()[0], cockpit.get_output()[1]
    assert "GradNorm" in first and not {"TICDiag", "TICTrace", "HessTrace"} & set(first)
    notes = _notes(cockpit, 0)
    assert any("'TICDiag'" in n and "'TICTrace'" in n and "BatchNorm1d in training mode" in n for n in notes), notes
    assert any(n.startswith("['HessTrace'] left out") and "BatchNorm1d in training mode" in n for n in notes), notes
    assert {"TICDiag", "TICTrace", "HessTrace", "GradNorm"} <= set(second)


def test_business_preset_with_batch_norm_in_training_mode_and_outputs_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model.parameters(), quantities=configuration("business"), model=model)
    x, y = torch.randn(6, 4, dtype=DTYPE), torch.randint(0, 3, (6,))
    outputs = model(x)
    losses = F.cross_entropy(outputs, y, reduction="none")
    info = {"batch_size": 6, "individual_losses": losses, "loss": losses.mean(), "optimizer": optimizer,
            "outputs": outputs}  # fmt: skip
    with cockpit(0, info=info):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    output = cockpit.get_output()[0]
    assert {"Loss", "GradNorm"} <= set(output) and "TICDiag" not in output
    assert any("TICDiag" in note and "left out" in note for note in _notes(cockpit)), _notes(cockpit)


# ---- ignored positions ---------------------------------------------------------------------------


def test_ignored_positions_of_sequences_have_no_curvature():
    """Outputs ``[B, T, C]`` (sketched) with padded positions (label -100): the GGN is the mean over the
    counted positions only. Before, every position's curvature was counted and divided by all positions
    (on ``[B, C]`` with one ignored row of 8, TICDiag 49.50 where the loss's GGN gives 47.79). Twin: the
    cockpit's draws, masked, per-row gradients by a loop, divided by the counted positions."""
    from cockpit_like.backends import randomness

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, CLASSES)).to(DTYPE)
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 4, generator=generator, dtype=DTYPE)  # [B, T, F]
    tokens = torch.randint(0, CLASSES, (3, 4), generator=generator)
    tokens[0, 2:] = -100
    tokens[2, 3] = -100
    counted = int((tokens != -100).sum())
    logits = model(x).detach().reshape(-1, CLASSES)
    draws = randomness.generator(0, "ggn diagonal signs", "cpu", float(logits.sum()))
    p = torch.softmax(logits, 1)
    roots = torch.diag_embed(p.sqrt()) - p.unsqueeze(2) * p.sqrt().unsqueeze(1)
    mask = (tokens != -100).reshape(-1, 1).to(DTYPE)
    traces = []
    for _ in range(4):
        signs = torch.randint(0, 2, logits.shape, generator=draws).to(DTYPE) * 2 - 1
        sketch = (torch.einsum("ncd,nd->nc", roots, signs) * mask).reshape(3, 4, CLASSES)
        squares = [torch.zeros_like(q) for q in params]
        for i in range(3):
            for s, g in zip(squares, torch.autograd.grad((model(x[i : i + 1]) * sketch[i : i + 1]).sum(), params)):
                s += g**2
        traces.append([float(s.sum()) / counted for s in squares])
    expected = torch.tensor(traces, dtype=DTYPE).mean(0).tolist()
    unmasked = [t * counted / tokens.numel() for t in expected]  # for comparison only: the old rule differs
    quantity = HessTrace(linear(1), curvature="ggn")
    cockpit = Cockpit(model.parameters(), quantities=[quantity], model=model)
    outputs = model(x)
    per_token = F.cross_entropy(outputs.transpose(1, 2), tokens, reduction="none")
    losses = per_token.sum(1) * 3 / counted
    with cockpit(0, info={"batch_size": 3, "loss": losses.mean(), "individual_losses": losses, "outputs": outputs}):
        losses.mean().backward(create_graph=cockpit.create_graph(0))
    assert quantity.get_output()[0] == pytest.approx(expected, rel=1e-9)
    assert quantity.get_output()[0] != pytest.approx(unmasked, rel=1e-3)


@pytest.mark.parametrize("weight", [1.0, 0.5])
def test_half_precision_confident_rows_pass_the_cross_entropy_check(weight):
    """fp16 logits of a well-trained classifier: a confident row's gradient (p - y) / N lies below float16's normal
    range, so the labels rebuilt from it are off by its spacing. Before, a plain mean cross-entropy was refused at
    such rows (found outside the tests: TICDiag dropped late in an fp16 run, a row loss of 2.7e-4 read as 4.4e-4);
    now that rounding is allowed for. A weight on the loss is still refused."""
    from cockpit_like.backends.sampled import _cross_entropy_check

    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (128,), generator=generator)
    margins = 6.0 + 6.0 * torch.rand(128, generator=generator)  # confident rows: losses from 1e-5 to 1e-2
    logits = (torch.randn(128, 10, generator=generator) + torch.nn.functional.one_hot(labels, 10) * margins[:, None])
    logits = logits.half().requires_grad_(True)
    losses = weight * torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    with torch.autocast("cpu", dtype=torch.float16):
        verdict, why, _ = _cross_entropy_check(losses.mean(), logits, losses)
    if weight == 1.0:
        assert verdict is True, why
    else:
        assert verdict is False
