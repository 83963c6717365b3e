"""benchmarks/subbatch_bound.py: its arguments, its bound arithmetic and its top eigenvalue on a tiny MLP."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from benchmarks import subbatch_bound as sb


def test_sub_batch_sizes_are_eighth_quarter_half_and_all_with_at_least_two_rows():
    assert sb.sub_batch_sizes(128) == [16, 32, 64, 128]
    assert sb.sub_batch_sizes(16) == [2, 4, 8, 16]
    assert sb.sub_batch_sizes(8) == [2, 4, 8]
    assert sb.sub_batch_sizes(2) == [2]
    with pytest.raises(ValueError):
        sb.sub_batch_sizes(1)


def test_bound_arithmetic():
    # plain 0.1 s, graph 0.05 s, 20 products of 0.02 s: 0.45 s of curvature = 4.5 plain steps
    assert sb.tracked_step_plain_steps(0.1, 0.05, 0.02, 20) == pytest.approx(5.5)
    assert sb.full_every10_bound(0.1, 0.05, 0.02, 20) == pytest.approx(1.45)
    # the engine's own work (0.1 s per solve) adds one plain step to the tracked step, 0.1 to the bound
    assert sb.tracked_step_plain_steps(0.1, 0.05, 0.02, 20, engine=0.1) == pytest.approx(6.5)
    assert sb.full_every10_bound(0.1, 0.05, 0.02, 20, engine=0.1) == pytest.approx(1.55)
    assert sb.relative_difference(1.1, 1.0) == pytest.approx(0.1)
    assert sb.relative_difference(-0.9, -1.0) == pytest.approx(0.1)
    assert sb.relative_difference(0.0, 0.0) == 0.0


def test_rows_are_picked_without_replacement_and_differ_by_choice():
    first, second = sb.pick_rows(32, 8, step=0, choice=0), sb.pick_rows(32, 8, step=0, choice=1)
    assert len(set(first.tolist())) == 8 and all(0 <= i < 32 for i in first.tolist())
    assert not torch.equal(first, second)
    assert torch.equal(first, sb.pick_rows(32, 8, step=0, choice=0))  # reproducible
    assert torch.equal(sb.pick_rows(32, 32, step=3, choice=2), torch.arange(32))


def test_top_eigenvalue_of_a_sub_batch_hessian_matches_the_dense_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    inputs, targets = torch.randn(12, 4, dtype=torch.float64), torch.randint(0, 3, (12,))
    params = list(model.parameters())
    lossfunc = nn.CrossEntropyLoss()
    rows = sb.pick_rows(12, 4, step=0, choice=1)
    batch = sb.rows_of((inputs, targets), rows)

    def loss_of(batch):
        return lossfunc(model(batch[0]), batch[1])

    result = sb.top_eigenvalue(sb.graph_of(loss_of, params, batch), params, step=0)

    sizes = [p.numel() for p in params]

    def flat_loss(vector):
        pieces = [piece.reshape(p.shape) for piece, p in zip(vector.split(sizes), params)]
        return lossfunc(torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()], pieces)),
                                                   (batch[0],)), batch[1])

    hessian = torch.autograd.functional.hessian(flat_loss, torch.cat([p.detach().reshape(-1) for p in params]))
    values = torch.linalg.eigvalsh(hessian)
    largest_magnitude = values[-1] if abs(values[-1]) >= abs(values[0]) else values[0]
    assert result["converged"] and 2 <= result["products"] <= 100
    assert result["value"] == pytest.approx(float(largest_magnitude), rel=1e-2)


def test_unknown_problems_and_bad_counts_are_refused():
    with pytest.raises(SystemExit):
        sb.parse_args(["--problems", "mlp,vgg"])
    with pytest.raises(SystemExit):
        sb.parse_args(["--choices", "0"])
    args = sb.parse_args(["--problems", "mlp,gpt", "--json", "x.json", "--markdown", "x.md"])
    assert args.problems == ["mlp", "gpt"] and args.json == "x.json" and args.markdown == "x.md"


def test_table_marks_the_targets():
    result = {
        "problem": "mlp", "batch_size": 8, "plain_s": 0.1, "sizes": [
            {"b": 2, "graph_s": 0.05, "hvp_s": 0.01, "graph_per_plain": 0.5, "hvp_per_plain": 0.1,
             "products": [20, 22], "tracked_step_plain_steps": 3.6, "bound_ratio": 1.26,
             "relative_difference_median": 0.5, "relative_difference_max": 0.8, "engine_s": 0.1},
            {"b": 8, "graph_s": 0.2, "hvp_s": 0.2, "graph_per_plain": 2.0, "hvp_per_plain": 2.0,
             "products": [30], "tracked_step_plain_steps": 63.0, "bound_ratio": 7.2},
        ],
    }  # fmt: skip
    text = sb.table([result])
    assert "| mlp | 8 | 100 ms | 2 |" in text and "**3.6**" in text and "**1.26**" in text and "50.0%, 80.0%" in text
    assert "| **3.6** | **1.26** | 100 ms (1.0) | 4.6, 1.36 | 50.0%, 80.0% |" in text
    assert "| 63.0 | 7.20 | - | - | - (reference) |" in text


def test_markdown_is_rendered_from_a_saved_json(tmp_path):
    meta = {"command": "python benchmarks/subbatch_bound.py", "commit": "abc", "threads": 1, "repeats": 1,
            "steps": 1, "choices": 1}
    result = {"problem": "mlp", "batch_size": 2, "plain_s": 0.1, "sizes": [
        {"b": 2, "graph_s": 0.1, "hvp_s": 0.1, "graph_per_plain": 1.0, "hvp_per_plain": 1.0, "products": [10],
         "tracked_step_plain_steps": 12.0, "bound_ratio": 2.1, "engine_s": 0.0}]}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": meta, "results": [result]}))
    out = tmp_path / "table.md"
    assert sb.main(["--render", str(saved), "--markdown", str(out)]) == 0
    assert "| mlp | 2 | 100 ms | 2 |" in out.read_text() and "commit abc" in out.read_text()
