"""The Student-t factor that widens error bars estimated from a few draws, against scipy's quantiles."""

import math

import pytest
from scipy import stats

from cockpit_like.functional.student_t import student_t_factor, student_t_quantile


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 7, 15, 60, 1000])
@pytest.mark.parametrize("probability", [0.9, 0.97725, 0.99865])
def test_quantiles_equal_scipys(dof, probability):
    assert student_t_quantile(probability, dof) == pytest.approx(float(stats.t.ppf(probability, dof)), rel=1e-9)


def test_the_factor_makes_two_errors_the_t_interval_of_two_sigma():
    assert student_t_factor(4) == pytest.approx(float(stats.t.ppf(stats.norm.cdf(2), 3)) / 2, rel=1e-9)
    assert student_t_factor(4) == pytest.approx(1.6534, abs=1e-4)
    assert math.isnan(student_t_factor(1))
    with pytest.raises(ValueError, match="dof >= 1"):
        student_t_quantile(0.9, 0)
