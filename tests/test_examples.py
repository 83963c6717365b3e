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
    from cockpit_like.diagnosis import findings_in

    assert [f.rule for f in findings_in(steps) if f.severity != "info"] == []  # diagnosed live: a healthy run


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


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_transformer_digits(tmp_path, capsys):
    """A transformer that is not extended, with the full configuration: per-sample quantities from
    module hooks, curvature from Hessian-vector products (recorded in the metadata)."""
    from cockpit_like.logs import read_log_with_metadata

    written = load("transformer_digits").main(["--steps", "6", "--every", "2", "--plot-every", "4",
                                                "--out", str(tmp_path / "transformer"), "--no-show",
                                                "--batch-size", "16"])
    metadata, steps = read_log_with_metadata(written["log"])
    assert sorted(steps) == [0, 2, 4, 5]  # tracked steps (Alpha stored under its start step) and the last log
    assert "test_accuracy" in steps[5]
    for step in (0, 2, 4):
        assert {"NormTest", "GradHist2d", "HessMaxEV", "HessTrace", "TICDiag"} <= set(steps[step])
    assert len(steps[4]["HessTrace"]) == len(metadata["param_shapes"])
    picked = {q["name"]: q["settings"].get("computed_with") for q in metadata["quantities"]}
    assert picked["HessTrace"] == "hutchinson" and picked["TICDiag"] == "ggn"  # TIC: a positive curvature
    assert all(steps[step]["TICDiag"] > 0 for step in (0, 2, 4))
    assert Path(written["dashboard"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "HessTrace -> hutchinson" in capsys.readouterr().out
    from cockpit_like.diagnosis import findings_in

    assert [f.rule for f in findings_in(steps) if f.severity != "info"] == []  # diagnosed live: a healthy run
    # its feed-forward ReLU is a module, so the dead-units rule has input (outside trial 26: the default functional
    # relu left ActivationStats empty, with a warning advising model=, which the example passed)
    assert all(steps[step].get("ActivationStats") for step in (0, 2, 4))
    assert "Momentum" in steps[0] and "sharpness-above-stability" in metadata["diagnosis"]["can_run"]


def test_lr_blowup_names_the_cause_on_the_panel(tmp_path, capsys):
    """The learning-rate blow-up example: one incident, the learning rate first, its symptoms after it;
    the same run with a healthy learning rate raises nothing at warning or above."""
    from cockpit_like.diagnosis import diagnose_log

    module = load("lr_blowup")
    # 36 steps: dead units that develop are reported once the run is past dead-units' settling steps (30)
    written = module.main(["--steps", "36", "--out", str(tmp_path / "blowup"), "--no-show"])
    (incident,) = [i for i in written["incidents"] if i.severity != "info"]
    assert incident.cause == "learning-rate-too-large" and incident.step == 0
    assert {"dead-units", "vanishing-gradient"} <= {f.rule for f in incident.symptoms}
    assert "1. ERROR learning-rate-too-large (from step 0)" in capsys.readouterr().out
    assert Path(written["dashboard"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = diagnose_log(written["log"])
    assert report.incidents[0].cause == "learning-rate-too-large" and not report.notes.keys() - {
        "sharpness-above-stability", "overfitting", "loss-spike"}  # every other rule could run on the economy preset
    healthy = module.main(["--steps", "30", "--lr", "0.3", "--out", str(tmp_path / "healthy"), "--no-show"])
    assert [i.cause for i in healthy["incidents"] if i.severity != "info"] == []
