"""The overhead benchmark script runs and writes well-formed results (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "overhead.py"

sys.path.insert(0, str(ROOT / "benchmarks"))
import overhead  # noqa: E402


def _run(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out, table = tmp_path / "overhead.json", tmp_path / "table.md"
    command = [
        sys.executable, str(SCRIPT), "--problems", "mlp", "--rounds", "1", "--steps", "2",
        "--warmup", "1", "--min-time", "0", "--batch-size", "8", "--out", str(out),
        "--table", str(table), "--no-docs", *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), table.read_text()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    return _run(tmp_path, "--configs", "nothing,full_every10", "--quantities", "GradNorm")


def test_json_structure(tiny):
    data, _ = tiny
    assert set(data) == {"meta", "targets", "results", "runs"}
    assert data["meta"]["rounds"] == 1 and data["meta"]["batch_size"] == 8
    mlp = data["results"]["mlp"]
    assert mlp["num_params"] == 784 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert mlp["per_sample_grads_mb"] == pytest.approx(8 * mlp["num_params"] * 4 / 2**20)
    configs = mlp["configs"]
    assert set(configs) == {"plain", "nothing", "full_every10", "q:GradNorm"}
    for name, entry in configs.items():
        assert "errors" not in entry, (name, entry)
        assert entry["rounds"] == (2 if name == "plain" else 1)  # plain at the start and end of the round
        assert entry["time_s"] > 0 and entry["ratio"] > 0
        assert isinstance(entry["added_memory_mb"], float)
    # plain's two runs average to the round's reference
    assert configs["plain"]["ratio"] == pytest.approx(1.0)
    assert configs["plain"]["ratio_min"] <= 1.0 <= configs["plain"]["ratio_max"]
    assert configs["full_every10"]["statistic"] == "mean"
    assert configs["nothing"]["statistic"] == "median"
    # every child process ran with one thread; full_every10 timed a whole period
    assert all(run["threads"] == 1 for run in data["runs"] if run["round"] != "live")
    assert [run["steps"] for run in data["runs"] if run["config"] == "full_every10" and run["round"] == 0] == [10]
    assert {run["round"] for run in data["runs"]} == {0, "live"}
    # the exact added memory: one profiled process for plain and each main configuration but nothing
    assert {run["config"] for run in data["runs"] if run["round"] == "live"} == {"plain", "full_every10"}
    assert configs["full_every10"]["live_added_mb"] == pytest.approx(
        configs["full_every10"]["live_peak_mb"] - configs["plain"]["live_peak_mb"]
    )
    assert "live_added_mb" not in configs["nothing"] and "live_added_mb" not in configs["q:GradNorm"]


def test_table_structure(tiny):
    _, table = tiny
    assert "| mlp |" in table
    for title in ("nothing scheduled at the step", "full every 10th step (amortised)"):
        assert f"| {title} |" in table
    assert "business, every step" not in table  # not run
    assert "| GradNorm |" in table
    assert "<= 1.3" in table and "<= 8" in table  # MLP targets from issue 6
    assert "peak memory of live tensors added" in table.lower()


def test_update_doc_replaces_only_between_markers(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"intro\n{overhead.BEGIN}\nold table\n{overhead.END}\noutro\n")
    assert overhead.update_doc("new table\n", doc)
    assert doc.read_text() == f"intro\n{overhead.BEGIN}\nnew table\n{overhead.END}\noutro\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers")
    assert not overhead.update_doc("x\n", plain) and plain.read_text() == "no markers"


def test_every_quantity_is_benchmarked():
    from cockpit_like import quantities

    names = {c[2:] for c in overhead.all_quantity_configs()}
    assert names == set(quantities.__all__) - overhead.BASE_CLASSES
    assert "Parameters" in names


@pytest.mark.parametrize("problem, shape", [("mlp", (1, 28, 28)), ("3c3d", (3, 32, 32)), ("2c2d", (1, 28, 28))])
def test_problems_build_and_run_with_backpack(problem, shape):
    """The networks have the DeepOBS shapes, and BackPACK's BatchGrad runs on them."""
    import torch
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad

    model, got = overhead.build_problem(problem, 2)
    assert got == shape
    model = extend(model)
    loss = extend(torch.nn.CrossEntropyLoss())(model(torch.randn(2, *shape)), torch.tensor([0, 1]))
    with backpack(BatchGrad()):
        loss.backward()
    for param in model.parameters():
        assert param.grad_batch.shape == (2, *param.shape)
    expected = {"mlp": 109_386, "3c3d": 895_210, "2c2d": 3_274_634}[problem]
    assert sum(p.numel() for p in model.parameters()) == expected


def test_unknown_names_are_rejected(tmp_path):
    for flag, value in (("--problems", "vgg"), ("--configs", "premium"), ("--quantities", "Nope")):
        done = subprocess.run(
            [sys.executable, str(SCRIPT), flag, value, "--no-docs", "--out", str(tmp_path / "x.json")],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode != 0 and "unknown" in done.stderr


@pytest.mark.parametrize("problem", [p for p in overhead.HOOK_PROBLEMS if p not in overhead.OPT_IN_PROBLEMS])
def test_hook_problems_build_and_run_one_step(problem):
    """gpt and resnet (small sizes) train one economy step with Cockpit(model=model), not extended."""
    import torch

    from cockpit_like import Cockpit
    from cockpit_like.backends.step import is_extended
    from cockpit_like.utils.configuration import configuration
    from cockpit_like.utils.schedules import linear

    model, shape = overhead.build_problem(problem, 4, small=True)
    assert not any(is_extended(module) for module in model.modules())
    (inputs, targets), *_ = overhead.make_batches(problem, model, shape, 4, count=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = Cockpit(model.parameters(), configuration("economy", linear(1)), model=model)
    outputs = model(inputs)
    if problem == "gpt":
        assert model.lm_head.weight is model.transformer.wte.weight  # tied embeddings
        per_token = overhead.token_losses(outputs.logits, targets)
        assert per_token.shape == (4, shape[0] - 1)
        loss, individual = per_token.mean(), per_token.detach().mean(1)
    else:
        loss = torch.nn.functional.cross_entropy(outputs, targets)
        individual = torch.nn.functional.cross_entropy(outputs, targets, reduction="none")
    assert torch.allclose(individual.mean(), loss)
    info = {"batch_size": 4, "individual_losses": individual, "loss": loss, "optimizer": optimizer}
    with cockpit(0, info=info):
        loss.backward(create_graph=cockpit.create_graph(0))
    optimizer.step()
    output = cockpit.get_output()[0]
    assert {"NormTest", "GradHist1d", "GradNorm"} <= set(output)


def test_gpt2_small_is_the_hugging_face_default_configuration(gpt2_small_built_once):
    """124M parameters (tied embedding), batch 8 x 256 tokens, dropout off; opt-in (not in the default run).
    The model is ``_gpt2_small()``'s, built once for the module (the fixture below)."""
    model, shape = overhead.build_problem("gpt2-small", 8)
    config = model.config
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size, shape) == (12, 768, 12, 50257, (256,))
    assert 124_000_000 < sum(p.numel() for p in model.parameters()) < 125_000_000
    assert overhead.batch_size_of("gpt2-small", None) == 8 and "gpt2-small" not in overhead.PROBLEMS


def test_full_size_hook_problems():
    """The documented sizes: GPT-2 with 4 layers, width 128, 4 heads, 64 tokens, vocabulary 512; the ResNet."""
    model, shape = overhead.build_problem("gpt", 16)
    config = model.config
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size, shape) == (4, 128, 4, 512, (64,))
    assert (config.attn_pdrop, config.resid_pdrop, config.embd_pdrop) == (0, 0, 0)
    assert overhead.batch_size_of("gpt", None) == 16 and overhead.batch_size_of("gpt", 8) == 8
    model, shape = overhead.build_problem("resnet", 128)
    assert shape == (3, 32, 32)
    norms = [m for m in model.modules() if isinstance(m, torch_nn().GroupNorm)]
    assert norms and not any(isinstance(m, torch_nn().modules.batchnorm._BatchNorm) for m in model.modules())
    assert overhead.batch_size_of("resnet", None) == 128


def torch_nn():
    from torch import nn

    return nn


def torch_rng():
    import torch

    return torch


@pytest.fixture(scope="module")
def _gpt2_small_cache():
    cache = []
    yield cache
    cache.clear()  # 500 MB: not kept past this module


@pytest.fixture
def gpt2_small_built_once(_gpt2_small_cache, monkeypatch):
    """GPT-2 small takes about 10 s to build (124M parameters initialised): built once for this module, each
    child loop gets a copy (the same weights and random stream as a fresh build: ``build_problem`` seeds before it)."""
    import copy

    original = overhead._gpt2_small

    def built(small: bool = False):
        if not _gpt2_small_cache:
            _gpt2_small_cache.append((original(), torch_rng().get_rng_state()))
        (model, shape), after = _gpt2_small_cache[0]
        torch_rng().set_rng_state(after)  # the random stream where a fresh build leaves it
        return copy.deepcopy(model), (overhead.gpt2_small_length(small),)

    monkeypatch.setattr(overhead, "_gpt2_small", built)


@pytest.mark.parametrize("problem", overhead.HOOK_PROBLEMS)
@pytest.mark.parametrize("config", ["plain", "nothing", "economy"])
def test_hook_problem_child_loop(problem, config, gpt2_small_built_once):
    """The child's training loop (in this process) on the small models: one timed step. gpt2-small keeps its
    124M parameters with ``--small`` (sequences of 16 tokens instead of 256): batches of 2 and no warm-up step
    (a step of batch 4 x 256 tokens took 7-20 s and 3 GB; the warm-up step is tested on the others)."""
    import torch

    threads = torch.get_num_threads()
    batch, warmup = ("2", "0") if problem in overhead.OPT_IN_PROBLEMS else ("4", "1")
    args = overhead.parse_args(
        ["--child", "--problem", problem, "--config", config, "--small", "--steps", "1", "--warmup", warmup,
         "--batch-size", batch, "--budget", "10", "--min-time", "0", "--min-steps", "1", "--max-steps", "1"]
    )  # fmt: skip
    try:
        result = overhead.run_child(args)
    finally:
        torch.set_num_threads(threads)
    assert (result["problem"], result["config"], result["batch_size"]) == (problem, config, int(batch))
    assert len(result["times"]) == 1 and result["median_s"] > 0
    if problem == "gpt2-small":
        assert overhead.gpt2_small_length(small=True) == 16 and overhead.gpt2_small_length() == 256


def test_hook_problem_child_process(tmp_path):
    """The script end to end on the small resnet: JSON and table of the hook-backend problems."""
    command = [
        sys.executable, str(SCRIPT), "--problems", "resnet", "--small", "--configs", "economy",
        "--quantities", "none", "--rounds", "1", "--steps", "1", "--warmup", "1", "--min-time", "0",
        "--out", str(tmp_path / "resnet.json"), "--table", str(tmp_path / "resnet.md"), "--no-docs",
        "--no-live-memory",  # the live-memory children end to end: test_json_structure (mlp)
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "resnet.json").read_text())
    resnet = data["results"]["resnet"]
    assert resnet["batch_size"] == 128 and data["meta"]["small"]
    assert resnet["num_params"] == overhead.num_params("resnet", small=True)
    assert resnet["per_sample_grads_mb"] == pytest.approx(128 * resnet["num_params"] * 4 / 2**20)
    for name in ("plain", "economy"):
        assert "errors" not in resnet["configs"][name], resnet["configs"][name]
        assert resnet["configs"][name]["ratio"] > 0
    table = (tmp_path / "resnet.md").read_text()
    assert "Any model (hook backend, not extended)" in table
    assert "<= 2.5" in table  # the economy target of the hook-backend problems
    assert "target <= 50%" in table


def test_merge_keeps_earlier_problems(tmp_path):
    earlier = {
        "meta": {"date": "2000-01-01", "rounds": 2, "steps": 10},
        "results": {"mlp": {"num_params": 1, "batch_size": 128, "per_sample_grads_mb": 1.0, "configs": {}},
                    "gpt": {"num_params": 2, "batch_size": 16, "per_sample_grads_mb": 1.0, "configs": {}}},
        "runs": [{"problem": "mlp", "config": "plain"}, {"problem": "gpt", "config": "plain"}],
    }  # fmt: skip
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    now = {"gpt": {"num_params": 3, "batch_size": 16, "per_sample_grads_mb": 1.0, "configs": {}}}
    results, runs = overhead.merge_earlier(path, now, [{"problem": "gpt", "config": "economy"}])
    assert list(results) == ["mlp", "gpt"] and results["gpt"]["num_params"] == 3
    assert results["mlp"]["measured"]["date"] == "2000-01-01"
    assert [(r["problem"], r["config"]) for r in runs] == [("mlp", "plain"), ("gpt", "economy")]


def test_live_peak_counts_the_allocations_made_during_the_profile():
    def event(ts, address, size):
        return {"ts": ts, "args": {"Addr": address, "Bytes": size}}

    events = [
        event(4, 1, -100),  # out of order: sorted by time
        event(0, 1, 100),
        event(1, 2, 50),  # 150 live: the peak
        event(2, 9, -400),  # a block from before the profile: ignored
        event(5, 1, 30),  # the address is reused
        event(6, 3, 70),  # 50 + 30 + 70
        event(7, 2, -50),
    ]
    assert overhead.live_peak(events) == 150
    assert overhead.live_peak(events + [event(8, 4, 51)]) == 151
    assert overhead.live_peak([]) == 0


def test_profiled_live_peak_sees_tensors_freed_before_the_end():
    import torch

    kept = torch.zeros(1)  # allocated before: not counted, and its free is not either

    def work():
        nonlocal kept
        a = torch.empty(1 << 18)  # 1 MiB
        b = torch.empty(1 << 19)  # 2 MiB: 3 MiB live
        del a, kept
        c = torch.empty(1 << 17)  # 0.5 MiB: 2.5 MiB live
        del b, c

    assert overhead.profiled_live_peak(work) == 3 << 20


@pytest.mark.parametrize("config", ["plain", "economy", "full_every10"])
def test_live_child_measures_the_peak_of_the_first_steps(config):
    import torch

    threads = torch.get_num_threads()
    args = overhead.parse_args(
        ["--child", "--live", "--problem", "resnet", "--config", config, "--small", "--steps", "1",
         "--warmup", "0", "--batch-size", "4", "--live-steps", "2"]
    )  # fmt: skip
    try:
        result = overhead.run_live_child(args)
    finally:
        torch.set_num_threads(threads)
    assert result["live_steps"] == (12 if config == "full_every10" else 2)
    assert result["live_peak_mb"] > 0
