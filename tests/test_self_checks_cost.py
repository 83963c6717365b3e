"""benchmarks/self_checks_cost.py: the arithmetic of its summary and its argument errors (no timing)."""

import pytest

from benchmarks import self_checks_cost


def test_summary_takes_same_round_ratios_and_the_checks_share():
    runs = {"gpt": {"plain": [1.0, 2.0, 1.0], "checked": [2.02, 4.0, 2.1], "unchecked": [2.0, 4.0, 2.0]}}
    row = self_checks_cost.summarise(runs)["gpt"]
    assert row["plain_ms"] == 1000.0 and row["rounds"] == 3
    assert row["economy_ratio"] == pytest.approx(2.02)  # median of 2.02, 2.0, 2.1
    assert row["economy_unchecked_ratio"] == pytest.approx(2.0)
    assert row["checks_share"] == pytest.approx(0.01)  # median of +1%, 0%, +5%
    assert "| gpt | 1000.0 ms | 2.02 | 2.00 | +1.0% |" in self_checks_cost.table({"gpt": row})


@pytest.mark.parametrize("argv", [["--problems", "nonsense"], ["--rounds", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        self_checks_cost.main(argv)


def test_interleaved_mode_switches_the_checks_step_by_step(monkeypatch):
    """--interleaved: one process, the checks on for steps 0 and 3 of every 4 and off for 1 and 2 (no timing asserted)."""
    from cockpit_like import Cockpit

    seen = []
    original = Cockpit.self_checks.fset

    def record(self, value):
        seen.append(bool(value))
        original(self, value)

    monkeypatch.setattr(Cockpit, "self_checks", property(Cockpit.self_checks.fget, record))
    summary = self_checks_cost.measure_interleaved(["mlp"], rounds=2, steps=4, warmup=1, small=True)
    assert seen == [True, False, False, True] * 2 + [True]
    row = summary["mlp"]
    assert row["rounds"] == 2 and len(row["shares"]) == 2 and row["checked_ms"] > 0 and row["unchecked_ms"] > 0
    assert "| mlp |" in self_checks_cost.table_interleaved(summary)


def test_setting_self_checks_between_steps_reaches_the_next_step():
    import torch

    from cockpit_like import Cockpit
    from cockpit_like.quantities import GradNorm, NormTest
    from cockpit_like.utils.schedules import linear

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    cockpit = Cockpit(model.parameters(), quantities=[GradNorm(linear(1)), NormTest(linear(1))], model=model)
    for step, checked in enumerate([True, False, True]):
        cockpit.self_checks = checked
        x, y = torch.randn(4, 3), torch.randn(4, 2)
        losses = ((model(x) - y) ** 2).sum(1)
        with cockpit(step, info={"batch_size": 4, "individual_losses": losses, "loss": losses.mean()}):
            losses.mean().backward()
        model.zero_grad()
    compared = [step for step, record in sorted(cockpit.checks.items()) if "gradient" in record]
    assert compared == [0, 2]
