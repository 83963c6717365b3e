"""A model re-run row by row at its first tracked step, where the state its forward pass changes has no start value
yet (outside trial 33's F7): the re-runs are checked against the forward pass's own outputs where they are still
alive, and the whole batch's re-run (where they are not) runs before the rows, from the state the rows start from.
Both set-ups below ended in a failed gradient check whose causes did not apply (a second backward pass, a penalty,
a forgotten ``zero_grad``); now each leaves the per-sample values out with the note that says what happened, and
the run is bitwise the run without a cockpit."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from cockpit_like.backends.tracer import _shell
from cockpit_like.utils.configuration import configuration
from tests.test_loops_trial32 import B, DTYPE, _loop, _same


def _batch(g):
    return (torch.randn(B, 6, generator=g, dtype=DTYPE),), torch.randint(0, 4, (B,), generator=g)


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


class BatchStatisticsTeacher(nn.Module):
    """A teacher BatchNorm (eval mode) whose running statistics move toward the batch's (``h.var(0)``: NaN for one
    row) inside ``forward``; a temperature of its own, so the cockpit re-runs the whole model row by row."""

    def __init__(self):
        super().__init__()
        self.student = _mlp()
        self.teacher = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4))
        self.teacher.eval().requires_grad_(False)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        norm = self.teacher[1]
        with torch.no_grad():
            h = self.teacher[0](x)
            norm.running_mean.mul_(0.8).add_(h.mean(0), alpha=0.2)
            norm.running_var.mul_(0.8).add_(h.var(0), alpha=0.2)
        return (self.student(x) + 0.5 * self.teacher(x)) * self.temperature


class ReloadedTeacher(nn.Module):
    """A DQN-style refresh: a call counter, and every second call the teacher is loaded from the student."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = _mlp(), _mlp().requires_grad_(False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        self.calls += 1
        if int(self.calls) % 2 == 0:
            self.teacher.load_state_dict(self.student.state_dict())
        return (self.student(x) + 0.5 * self.teacher(x)) * self.temperature


def _runs(make, steps=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = make().to(DTYPE)
        params = [p for p in model.parameters() if p.requires_grad]
        out, state, _ = _loop(model, configuration("economy"), steps, _batch, params=params)
        torch.manual_seed(0)
        model = make().to(DTYPE)
        _, plain, _ = _loop(model, None, steps, _batch, params=[p for p in model.parameters() if p.requires_grad])
    assert _same(state, plain)
    return out


def test_rows_that_a_batch_statistic_makes_nan_are_named_at_the_first_step():
    out = _runs(BatchStatisticsTeacher)
    checks = out[0]["checks"]
    assert checks["valid"] and not checks["failed"], checks  # a failed gradient check before
    notes = " ".join(checks["notes"])
    assert "NormTest" not in out[0] and "GradNorm" in out[0]
    assert "gave" in notes and "inf or NaN where the training step's forward pass on the batch was finite" in notes


def test_state_read_after_the_forward_pass_changed_it_is_seen_at_the_first_step():
    out = _runs(ReloadedTeacher)
    checks = out[0]["checks"]
    assert checks["valid"] and not checks["failed"], checks  # a failed gradient check before (rows 0.31, 0.19)
    assert "NormTest" not in out[0] and "GradNorm" in out[0]
    assert "did not reproduce the outputs of the training step's forward pass" in " ".join(checks["notes"])


def test_a_recorded_output_gives_its_values_while_alive_and_unwritten():
    output = torch.randn(3, 2)
    shell = _shell(output)
    assert shell.values() is output
    output.add_(1.0)  # written in place after the call (h += y): not the call's values any more
    assert shell.values() is None
    gone = _shell(torch.randn(2))  # (the tensor freed at the end of this statement)
    assert gone.values() is None
