"""examples/flipped_labels.py runs end to end (few steps) and ranks flipped digits labels far above chance."""

from __future__ import annotations

import pytest

from cockpit_like import read_log
from tests.test_examples import load


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flipped_labels_example(tmp_path, capsys):
    result = load("flipped_labels").main(["--steps", "100", "--out", str(tmp_path / "flipped")])
    steps = read_log(result["log"])
    audit = [s for s in steps if s >= 100]
    assert len(audit) == 23 and all(len(steps[s]["SelfInfluence"]["top"]) >= 1 for s in audit)
    assert sorted(s for s in steps if s < 100) == [0, 50]
    # 72 of 1437 flipped (5%): far more of them among the 72 largest self-influences than chance
    assert len(result["flipped"]) == 72
    assert result["precision"] > 0.4
    # every training sample got a score, and the log's top ids are dataset indices with their scores
    entry = steps[audit[0]]["SelfInfluence"]["top"][0]
    assert result["scores"][entry["id"]] == pytest.approx(entry["value"], rel=1e-5)
    assert "training labels flipped" in capsys.readouterr().out
