"""Schedules and preset configurations."""

import pytest
import torch

from cockpit_like import quantities
from cockpit_like.utils import configuration, schedules


def steps_of(schedule, up_to):
    return [t for t in range(up_to) if schedule(t)]


def test_linear_interval_and_offset():
    assert steps_of(schedules.linear(1), 5) == [0, 1, 2, 3, 4]
    assert steps_of(schedules.linear(3), 10) == [0, 3, 6, 9]
    assert steps_of(schedules.linear(2, offset=1), 8) == [1, 3, 5, 7]


def test_logarithmic_documented_example():
    schedule = schedules.logarithmic(0, 3, steps=10)
    assert steps_of(schedule, 2000) == [0, 1, 2, 4, 10, 21, 46, 100, 215, 464, 1000]
    assert steps_of(schedules.logarithmic(0, 3, steps=10, init=False), 2000)[0] == 1


@pytest.mark.parametrize(
    "start, end, steps, base",
    [(0, 3, 10, 10), (0, 4, 300, 10), (1, 5, 50, 10), (0, 6, 1000, 10), (0, 10, 40, 2), (2, 2, 5, 10)],
)
def test_logarithmic_matches_torch_logspace(start, end, steps, base):
    expected = set(torch.logspace(start, end, steps, base=base, dtype=torch.int64).tolist()) | {0}
    schedule = schedules.logarithmic(start, end, steps=steps, base=base)
    upper = base**end + 1
    assert set(steps_of(schedule, upper)) == expected


def test_logarithmic_truncates_exponents_and_single_step():
    assert steps_of(schedules.logarithmic(0.5, 1.9, steps=1, init=False), 50) == [1]
    assert steps_of(schedules.logarithmic(-1.5, 1, steps=3, init=False), 50) == [0, 1, 10]


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: schedules.linear(0), "positive int"),
        (lambda: schedules.linear(2.5), "positive int"),
        (lambda: schedules.linear(1, offset=1.5), "needs an int"),
        (lambda: schedules.logarithmic(0, 2, steps=0), "positive int"),
    ],
)
def test_bad_schedule_arguments(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_schedule_that_is_not_callable():
    with pytest.raises(TypeError, match="track_schedule must be a callable int -> bool"):
        quantities.GradNorm(track_schedule=5)


def test_schedule_with_wrong_signature():
    with pytest.raises(TypeError, match="must accept one int"):
        quantities.GradNorm(track_schedule=lambda: True)


def test_unknown_configuration_lists_valid_labels():
    with pytest.raises(KeyError, match=r"unknown configuration 'luxury'.*business.*economy.*full"):
        configuration.configuration("luxury")


@pytest.mark.filterwarnings("ignore:configuration")
@pytest.mark.parametrize("label", ["economy", "business", "full"])
def test_configurations_share_schedule(label):
    schedule = schedules.linear(4)
    made = configuration.configuration(label, track_schedule=schedule)
    names = [type(q).__name__ for q in made]
    available = [n for n in configuration.PRESETS[label] if hasattr(quantities, n)]
    assert names == available
    assert all(q._track_schedule is schedule for q in made)


def test_presets_nest():
    presets = configuration.PRESETS
    assert presets["business"] == presets["economy"] + ["TICDiag", "HessTrace"]
    assert presets["full"] == presets["business"] + ["HessMaxEV", "GradHist2d"]
