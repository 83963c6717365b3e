"""A module whose forward pass replaces a tensor's ``.data`` (``Module.to`` inside forward, as Hugging Face's
SwitchTransformers router does: ``self.classifier = self.classifier.to(self.dtype)``), re-run row by row by the
``torch.func`` fallback. The re-run used to crash the process (a segmentation fault inside ``vmap(vjp(...))``
where the tensor was a constant of the re-run); now an assignment that changes nothing is skipped (exact
per-sample gradients) and any other leaves the per-sample values out with a note naming the module (a clear
:class:`UncoveredParameterError` that stopped training before outside trial 33). Each scenario runs in a
child process, so that a crash fails its test instead of killing the test run."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROWS = 5


class _Router(nn.Module):
    """A router-like module: a raw parameter (``scale``, no layer rule: the module is re-run) and a linear
    classifier (covered by the Linear rule: a constant of the re-run) that its forward pass converts."""

    def __init__(self, assignment: str):
        super().__init__()
        self.assignment = assignment
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.classifier = nn.Linear(4, 3)

    def forward(self, x):
        if self.assignment == "to":
            self.classifier = self.classifier.to(torch.float64)  # already float64: changes nothing
        elif self.assignment == "equal":
            self.classifier.weight.data = self.classifier.weight.data.clamp(-10, 10)  # an equal tensor
        elif self.assignment == "decay":
            self.classifier.weight.data = self.classifier.weight.data * 0.999  # changes the weight each call
        return self.classifier(torch.tanh(x) * self.scale)


def _scenario(assignment: str) -> None:
    """One tracked step; exact per-sample statistics (or, for ``decay``, the clear error)."""
    from cockpit_like import Cockpit
    from cockpit_like.backends.rerun import UncoveredParameterError
    from tests.helpers import row_stats_probe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), _Router(assignment)).double()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (ROWS,), generator=generator)
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    losses = F.cross_entropy(model(x), y, reduction="none")
    rows = [torch.autograd.grad(losses[i] / ROWS, params, retain_graph=True) for i in range(ROWS)]
    probe = row_stats_probe(lambda step: True)
    cockpit = Cockpit(params, quantities=[probe], model=model)
    loss = F.cross_entropy(model(x), y)
    if assignment == "decay":  # (training stopped here with UncoveredParameterError before outside trial 33)
        decayed = [p.detach().clone() for p in params]  # as the training's own forward passes left them
        with cockpit(0, info={"loss": loss, "batch_size": ROWS}):
            loss.backward()
        notes = " ".join(cockpit.checks[0]["notes"])
        assert "_Router: its forward pass replaces a tensor's `.data`" in notes, notes
        assert 0 not in probe.output  # no per-sample value at the step
        for p, b in zip(params, decayed):
            assert torch.equal(p.detach(), b)  # the re-run stopped before the assignment
        print("noted")
        return
    with cockpit(0, info={"loss": loss, "batch_size": ROWS}):
        loss.backward()
    assert cockpit.checks[0]["valid"], cockpit.checks[0]["failed"]
    squares, norms = probe.output[0]
    for k, got in enumerate(squares):
        torch.testing.assert_close(torch.as_tensor(got), sum(r[k] ** 2 for r in rows), rtol=1e-9, atol=1e-15)
    expected = torch.stack([sum(g.square().sum() for g in r) for r in rows])
    torch.testing.assert_close(torch.as_tensor(norms), expected, rtol=1e-9, atol=1e-15)
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)  # the re-run left the parameters alone
    print("exact")


def _run(code: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300)


@pytest.mark.parametrize("assignment, expected", [("to", "exact"), ("equal", "exact"), ("decay", "noted")])
def test_a_data_assignment_in_a_rerun_is_skipped_or_noted_never_a_crash(assignment, expected):
    done = _run(f"from tests.test_rerun_data_assignment import _scenario; _scenario({assignment!r})")
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.split()[-1] == expected


_SWITCH = """
import torch, torch.nn.functional as F, transformers as tf
from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration
torch.manual_seed(0)
cfg = tf.SwitchTransformersConfig(vocab_size=40, d_model=16, d_kv=8, d_ff=24, expert_capacity=2, num_layers=2,
    num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=2, num_experts=4,
    router_jitter_noise=0.0, dropout_rate=0.0, relative_attention_num_buckets=8, decoder_start_token_id=0,
    pad_token_id=0)
model = tf.SwitchTransformersForConditionalGeneration(cfg).to(torch.float64).train()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
cockpit = Cockpit(list(model.parameters()), quantities=configuration("economy"), model=model)
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, 40, (4, 6), generator=g); labels = torch.randint(3, 40, (4, 5), generator=g)
out = model(input_ids=ids, labels=labels)
losses = F.cross_entropy(out.logits.transpose(1, 2), labels, reduction="none").mean(1)
with cockpit(0, info={"batch_size": 4, "individual_losses": losses, "loss": out.loss, "optimizer": opt}):
    out.loss.backward()
print(cockpit.checks[0]["valid"], sorted(cockpit.get_output()[0]))
"""


def test_switch_transformers_router_is_re_run():
    """The router converts its classifier to float32 in every forward pass; the model is float64."""
    pytest.importorskip("transformers")
    done = _run(_SWITCH)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.startswith("True") and "NormTest" in done.stdout
