"""benchmarks/economy_bound.py: every per-sample gradient entry of the economy preset's histogram, once."""

from __future__ import annotations

import pytest

from benchmarks import economy_bound
from benchmarks import overhead


def test_every_entry_is_counted_once_with_a_tied_embedding():
    """GPT-2's input embedding and output layer share one weight: its B x D entries are produced as the
    sum of both uses and binned once (not once per use). The position embedding (called once on a row of
    positions that the batch shares, 7680 entries per sample) is left out of the script's count."""
    result = economy_bound.measure("gpt", repeats=1)
    batch, params = result["batch_size"], overhead.num_params("gpt")
    assert batch * (params - 7680) == result["entries"]  # the tied weight twice would add B x its size
    assert result["bound_ratio"] == pytest.approx(1 + (result["produce_s"] + result["bin_s"]) / result["plain_s"])


def test_linear_layers_on_rows_are_left_out():
    """3c3d's classifier (linear layers on 2-D inputs) is binned from its factors: a lower bound."""
    result = economy_bound.measure("3c3d", repeats=1)
    assert 0 < result["entries"] < result["batch_size"] * overhead.num_params("3c3d")
