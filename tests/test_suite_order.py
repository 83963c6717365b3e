"""The suite's own scheduling list (tests/conftest.py) names modules that exist: a renamed or removed module would
silently drop out of the heaviest-first order that keeps the two workers of ``make test`` finishing together."""

from pathlib import Path

from tests.conftest import HEAVY_MODULES_FIRST

HERE = Path(__file__).parent


def test_heavy_modules_first_names_existing_test_modules_once():
    missing = [name for name in HEAVY_MODULES_FIRST if not (HERE / name).is_file()]
    assert missing == []
    assert len(set(HEAVY_MODULES_FIRST)) == len(HEAVY_MODULES_FIRST)
