"""The examples run end to end with tiny step counts (headless) and leave a log and a picture."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from cockpit_like import read_log  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_basic_digits(tmp_path, capsys):
    written = load("basic_digits").main(["--steps", "8", "--plot-every", "4", "--out", str(tmp_path / "basic"),
                                          "--no-show", "--batch-size", "32"])
    steps = read_log(written["log"])
    assert sorted(steps) == list(range(8))
    assert all("Loss" in values and "GradHist1d" in values for values in steps.values())
    assert steps[7]["learning_rate"] == pytest.approx(0.3)
    assert written["dashboard"] == str(tmp_path / "basic.png")
    assert Path(written["dashboard"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 live redraws" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_advanced_digits(tmp_path):
    module = load("advanced_digits")
    written = module.main(["--steps", "5", "--every", "2", "--plot-every", "4", "--out", str(tmp_path / "adv"),
                           "--no-show", "--batch-size", "32"])
    steps = read_log(written["stream"])
    assert steps == read_log(written["log"])
    assert sorted(k for k, v in steps.items() if "ParameterNorm" in v) == [0, 2, 4]
    assert "param_1" in steps[4]["GradHist2d"]  # per-layer histograms for the secondary screen
    assert Path(written["dashboard"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
