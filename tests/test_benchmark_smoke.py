"""End-to-end smoke runs of the benchmark scripts that had none: each on its smallest input (one small problem,
one round, a step or two), a few seconds each, so that a refactor that breaks a script's real code path (as one
broke ``trace_estimators.py``) fails a test instead of the next regeneration of a results file."""

import json
import math

import pytest


def test_accumulation_overhead_one_round_on_mlp(tmp_path):
    from benchmarks import accumulation_overhead

    out = tmp_path / "accumulation.json"
    accumulation_overhead.main(["--problems", "mlp", "--rounds", "1", "--steps", "1", "--warmup", "1",
                                "--micro-batches", "2", "--no-fsdp", "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    row = result["summary"]["mlp"]
    assert set(row) == {"economy_k/economy", "economy/plain", "economy_k/plain_k", "plain_k/plain"}
    assert all(math.isfinite(value) and value > 0 for value in row.values())
    assert result["fsdp_economy/plain"] is None and result["meta"]["micro_batches"] == 2


def test_data_stats_cost_one_round_on_mlp(tmp_path):
    from benchmarks import data_stats_cost

    out = tmp_path / "data_stats.json"
    results = data_stats_cost.main(["--archs", "mlp", "--steps", "8", "--warmup", "1", "--rounds", "1",
                                    "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (round_,) = results["mlp"]["rounds"]
    assert round_["with_ms"] > 0 and round_["without_ms"] > 0 and math.isfinite(round_["cost_ms"])
    # every timed step (after the warm-up) is on one side, and both sides are timed: on, off, off, on
    assert sum(round_["steps"]) == 8 - 1 and min(round_["steps"]) > 0
    assert results["mlp"]["cost_ms"] == pytest.approx(round_["with_ms"] - round_["without_ms"])


def test_side_by_side_cockpit_norms_agree_with_torch_func():
    """The cockpit side of the per-sample norm comparison (Opacus, the other side, is a benchmark-only dependency):
    the norms of the last step agree with per-sample gradients from ``torch.func`` after the same SGD steps."""
    import torch
    from torch import nn
    from torch.func import functional_call, grad, vmap

    from benchmarks import side_by_side

    batch_size, steps = 8, 2
    ours = torch.tensor(side_by_side._norms_child("mlp", "cockpit", steps, batch_size)["norms"])
    model, shape = side_by_side.build_problem("mlp", batch_size)
    batches = side_by_side.make_batches("mlp", model, shape, batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    individual = nn.CrossEntropyLoss(reduction="none")

    def sample_loss(params, x, y):
        return individual(functional_call(model, params, (x[None],)), y[None]).sum()

    for step in range(steps + 2):  # the child's two warm-up steps and its timed ones; norms of the last
        inputs, labels = batches[step % len(batches)]
        if step == steps + 1:
            params = {name: p.detach() for name, p in model.named_parameters()}
            grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, inputs, labels)
            reference = sum(g.flatten(1).pow(2).sum(1) for g in grads.values()).sqrt()
        optimizer.zero_grad()
        individual(model(inputs), labels).mean().backward()
        optimizer.step()
    assert ours.shape == (batch_size,)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=0)


def test_side_by_side_curvature_table_on_mlp():
    pytest.importorskip("curvlinops")
    from benchmarks import side_by_side

    table = side_by_side.curvature_table("mlp", 8, 2)
    ours, theirs = table["cockpit"], table["curvlinops"]
    # both top eigenvalues within the 1% HessMaxEV claims (and eigsh at tol 1e-2) of eigsh at tol 1e-10
    assert table["exact_top_eigenvalue"] > 0
    assert ours["top_error"] < 1e-2 and theirs["top_error"] < 1e-2
    assert ours["products"] > 0 and math.isfinite(ours["trace"]) and math.isfinite(theirs["trace"])


def test_tic_cost_runs_its_three_models(capsys):
    from benchmarks import tic_cost

    assert tic_cost.main() == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" {")[0] for line in lines] == [
        "zoo/encoder (3 classes)", "zoo/gpt2 (sequence, vocabulary 40)", "transformer_digits (10 classes)"]
    for line in lines:
        assert "'auto (ggn)': '" in line and "'hutchinson': '" in line and "x plain" in line


def test_diagnosis_outside_forgotten_zero_grad_is_named(capsys):
    """One case of diagnosis_outside.py, shortened (the whole script takes about 40 s): the MLP whose loop forgets
    ``optimizer.zero_grad()`` is diagnosed with ``gradients-accumulate``, the same model and loop with it is not."""
    import torch

    from benchmarks import diagnosis_outside

    torch.set_num_threads(1)
    data = diagnosis_outside._digits()
    make_opt = lambda p: torch.optim.SGD(p, 0.01, momentum=0.9)  # noqa: E731
    torch.manual_seed(0)
    broken = diagnosis_outside.run_case("forgotten", diagnosis_outside._mlp(), make_opt, 20, 32, data, zero_grad=False)
    torch.manual_seed(0)
    healthy = diagnosis_outside.run_case("healthy", diagnosis_outside._mlp(), make_opt, 20, 32, data)
    assert "gradients-accumulate" in {incident.cause for incident in broken}
    assert "gradients-accumulate" not in {incident.cause for incident in healthy}
    assert "forgotten" in capsys.readouterr().out


def test_notebook_update_in_a_real_kernel():
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from benchmarks import notebook_update

    result = notebook_update.main(["--steps", "5", "--updates", "2", "--dpi", "40"])
    assert (result["steps"], result["updates"], result["dpi"]) == (5, 2, 40.0)
    assert result["image_bytes"] > 0
    assert all(math.isfinite(result[key]) and result[key] >= 0 for key in ("read", "draw", "png"))
    assert result["total"] >= result["draw"] > 0


def test_ddp_overhead_one_round_on_mlp(tmp_path):
    """Both modes of ddp_overhead.py (one process; two gloo ranks on this machine), one round of two steps."""
    from benchmarks import ddp_overhead

    out = tmp_path / "ddp.json"
    assert ddp_overhead.main(["--problems", "mlp", "--rounds", "1", "--steps", "2", "--warmup", "1",
                              "--out", str(out)]) in (0, None)  # fmt: skip
    results = json.loads(out.read_text())["results"]["mlp"]
    for mode in ("single", "ddp"):
        assert results[mode]["plain"]["ratio"] == 1.0 and results[mode]["plain"]["step_ms"] > 0
        for config in ("nothing", "economy"):
            assert math.isfinite(results[mode][config]["ratio"]) and results[mode][config]["ratio"] > 0


def test_spike_cost_one_round_writes_where_it_is_told(tmp_path):
    """``spike_cost.py --out``: a smoke run leaves the tracked JSON alone (it always overwrote it)."""
    from pathlib import Path

    from benchmarks import spike_cost

    tracked = Path(spike_cost.__file__).parent / "results" / "spike_cost.json"
    before = tracked.read_text() if tracked.exists() else None
    result = spike_cost.main(rounds=1, warmup=0, out=tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text()) == json.loads(json.dumps(result))
    assert result["overhead_vs_economy"]["economy"] == 0.0
    assert all(math.isfinite(v) and v > 0 for v in result["median_step_seconds"].values())
    assert result["post_mortem_nbytes"] and all(n > 0 for n in result["post_mortem_nbytes"].values())
    assert (tracked.read_text() if tracked.exists() else None) == before


def test_product_modes_one_repeat_on_mlp(tmp_path):
    """Every way of forming a product agrees with the cockpit's (reverse over reverse) on the same vectors, and
    each is timed."""
    from benchmarks import product_modes

    out = tmp_path / "modes.json"
    product_modes.main(["--problems", "mlp", "--repeats", "1", "--json", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["failed"] == {}
    assert set(row["per_vector_plain_steps"]) == set(product_modes.MODES)
    assert all(math.isfinite(v) and v > 0 for v in row["per_vector_plain_steps"].values())
    assert max(row["max_relative_difference"].values()) < 1e-4


def test_power_iteration_claims_one_seed(capsys):
    """benchmarks/power_iteration_claims.py (the figures of docs/curvature.md on accelerate=False), one seed."""
    from benchmarks import power_iteration_claims

    assert power_iteration_claims.main(["--seeds", "1", "--starts", "2"]) == 0
    printed = capsys.readouterr().out
    assert "stops of Cockpit's rule:" in printed and "| 0.01 |" in printed
