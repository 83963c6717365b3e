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
