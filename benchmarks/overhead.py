#!/usr/bin/env python
"""Overhead benchmark: time and memory of a cockpit relative to plain training.

For each problem (synthetic data, made here; nothing is downloaded) the script
measures the time per training step (``zero_grad``, forward, backward,
``optimizer.step()``; SGD with lr 0.01) of

- ``plain``: the model is *not* extended and there is no cockpit (what a user
  runs without us),
- ``nothing``: model and loss extended (on the hook-backend problems
  ``gpt`` and ``resnet``: not extended, ``Cockpit(..., model=model)``), a
  cockpit with the economy configuration whose schedule fires only at step 0
  (a warm-up step), timed at later steps: the per-step price of leaving a
  cockpit in the loop between tracked steps,
- ``economy`` / ``business`` / ``full``: the presets tracking every step,
- ``full_every10``: the full preset tracking every 10th step; the *mean* over
  a multiple of 10 steps (amortised),
- ``q:<Name>``: every quantity of ``cockpit_like.quantities.__all__`` (not the
  base classes) alone, default arguments, tracking every step.

Problems: ``mlp``, ``3c3d``, ``2c2d`` (DeepOBS-like networks, extended with
``backpack.extend``: BackPACK computes their per-sample gradients and
curvature), and ``gpt`` (a Hugging Face GPT-2 causal language model, batch
16 sequences of 64 tokens) and ``resnet`` (a ResNet with GroupNorm on
3x32x32 images, batch 128), which are *not* extended: the cockpit gets
``model=model`` and computes everything with its hook backend (module hooks
and ``torch.func``). A sample is one row of the batch (one sequence).

Every configuration runs in its own process (this script, called with
``--child``), with one thread (``torch.set_num_threads(1)``,
``OMP_NUM_THREADS=1``). Configurations are interleaved, in a shuffled order,
over several rounds; each round runs ``plain`` for every problem at its start
and at its end, and every ratio is taken to the mean of these two ``plain``
times of the same round and problem; the
reported ratio is the median over rounds. Memory: each child reports its
peak resident set size (``ru_maxrss``); a configuration's added memory is
its peak minus the peak of the ``plain`` process of the same round (all
children import the same modules, so the baseline cancels). RSS carries
what the C allocator keeps of freed blocks; the exact figure comes from one
more child per problem and main configuration (``--live``, after the timed
rounds; ``--no-live-memory`` skips it): the peak bytes of live tensors over
the first steps, from ``torch.profiler``'s allocation events
(:func:`live_peak`), minus plain's.

On a GPU (``--device cuda``) the model, the data and the cockpit's work run
on the first CUDA device; each timed step ends with ``torch.cuda.synchronize()``,
and each child also reports ``torch.cuda.max_memory_allocated()`` over its
steps (``cuda_peak_mb``; a configuration's ``cuda_added_mb`` is its peak minus
that of the same round's ``plain``). The live-tensor profile is CPU only and
is skipped. ``--dry-run`` prints the child commands of the plan and exits
(no CUDA needed: how the arguments are tested on a CPU machine).

Usage::

    python benchmarks/overhead.py            # full run, updates docs/performance.md
    python benchmarks/overhead.py --device cuda --problems gpt,resnet --configs economy,full_every10 --no-docs
    python benchmarks/overhead.py --quick    # about a minute, MLP only, prints the table
    python benchmarks/overhead.py --problems gpt,resnet --merge benchmarks/results/overhead.json
        # measure two problems, keep the others' figures from the previous run
    python benchmarks/overhead.py --problems gpt2-small --configs economy --rounds 1 --steps 2 --no-docs
        # GPT-2 small (124M parameters, batch 8 x 256 tokens; opt-in: a CPU step takes seconds)

Results: ``benchmarks/results/overhead.json`` (``overhead_quick.json`` with
``--quick``) and a markdown table (also in ``docs/performance.md`` between
the ``BEGIN/END overhead table`` markers unless ``--quick``/``--no-docs``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "overhead.json"
QUICK_JSON = ROOT / "benchmarks" / "results" / "overhead_quick.json"
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- BEGIN overhead table -->", "<!-- END overhead table -->"

PROBLEMS = ("mlp", "3c3d", "2c2d", "gpt", "resnet")
#: problems measured only when named in ``--problems`` (one CPU step takes many seconds)
OPT_IN_PROBLEMS = ("gpt2-small",)
#: problems whose model is not extended: ``Cockpit(..., model=model)``, the hook backend
HOOK_PROBLEMS = ("gpt", "resnet", "gpt2-small")
#: causal language models: token ids in, mean next-token cross-entropy, a sample is a sequence
LANGUAGE_MODELS = ("gpt", "gpt2-small")
#: batch size of a problem unless ``--batch-size`` is given (128 for the others)
BATCH_SIZES = {"gpt": 16, "gpt2-small": 8}
DEFAULT_BATCH_SIZE = 128
MAIN_CONFIGS = ("nothing", "economy", "business", "full", "full_every10")
QUICK_QUANTITIES = ("NormTest", "GradHist1d", "HessTrace")
BASE_CLASSES = {"Quantity", "SingleStepQuantity", "TwoStepQuantity", "ByproductQuantity"}

#: Targets of issue 6 (ratio to plain training); None: no target.
TARGETS = {
    "3c3d": {"nothing": 1.05, "economy": 2.5, "business": 4.0, "full": 10.0, "full_every10": 1.5},
    "mlp": {"nothing": 1.3, "economy": 30.0, "business": 35.0, "full": 80.0, "full_every10": 8.0},
    "gpt": {"nothing": 1.05, "economy": 2.5, "full_every10": 3.0},
    "gpt2-small": {"economy": 1.5},
    "resnet": {"nothing": 1.05, "economy": 2.5, "full_every10": 3.0},
}
#: Memory target: added peak memory <= this fraction of B x D x 4 bytes.
MEMORY_TARGET = {"economy": 0.5, "business": 0.5}
#: On the hook-backend problems: in every main configuration that tracks (the peak of
#: ``nothing`` is its tracked step 0, an economy step).
HOOK_MEMORY_TARGET = {"economy": 0.5, "business": 0.5, "full": 0.5, "full_every10": 0.5}


def memory_targets(problem: str) -> dict:
    return HOOK_MEMORY_TARGET if problem in HOOK_PROBLEMS else MEMORY_TARGET


def batch_size_of(problem: str, given: int | None) -> int:
    """``--batch-size`` if given, else the problem's own batch size."""
    return given if given is not None else BATCH_SIZES.get(problem, DEFAULT_BATCH_SIZE)

ROW_TITLES = {
    "nothing": "nothing scheduled at the step",
    "economy": "economy, every step",
    "business": "business, every step",
    "full": "full, every step",
    "full_every10": "full every 10th step (amortised)",
}


# ---------------------------------------------------------------------------
# child: one configuration on one problem, in its own process
# ---------------------------------------------------------------------------
def _gpt(small: bool = False):
    """A GPT-2 causal LM (Hugging Face, tied input/output embedding, no dropout), built from a config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, width, heads, length, vocab = (2, 32, 2, 16, 64) if small else (4, 128, 4, 64, 512)
    config = GPT2Config(
        vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers, n_head=heads,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config).train()
    return model, (length,)


def _gpt2_small(small: bool = False):
    """GPT-2 small: the Hugging Face ``GPT2Config()`` defaults (12 layers, width 768, 12 heads, vocabulary
    50257, 124M parameters, tied embedding) with dropout off, built from the config (no download);
    sequences of 256 tokens (``small``: the same model on sequences of 16 tokens, for tests)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return GPT2LMHeadModel(config).train(), (gpt2_small_length(small),)


def gpt2_small_length(small: bool = False) -> int:
    """gpt2-small's sequence length: 256 tokens, 16 with ``--small``."""
    return 16 if small else 256


def _resnet(small: bool = False):
    """A CIFAR-style ResNet with GroupNorm: stem, 3 stages of 2 basic blocks (16/32/64 channels), 10 classes."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, groups: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
            self.norm1 = nn.GroupNorm(groups, cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, padding=1, bias=False)
            self.norm2 = nn.GroupNorm(groups, cout)
            self.relu = nn.ReLU()
            self.shortcut = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))

        def forward(self, x):
            out = self.relu(self.norm1(self.conv1(x)))
            return self.relu(self.norm2(self.conv2(out)) + self.shortcut(x))

    class ResNet(nn.Module):
        def __init__(self, widths, blocks: int, groups: int, classes: int = 10):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.GroupNorm(groups, widths[0]), nn.ReLU())
            stages, cin = [], widths[0]
            for k, width in enumerate(widths):
                for b in range(blocks):
                    stages.append(Block(cin, width, 2 if (k > 0 and b == 0) else 1, groups))
                    cin = width
            self.stages = nn.Sequential(*stages)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.head = nn.Linear(cin, classes)

        def forward(self, x):
            return self.head(self.pool(self.stages(self.stem(x))).flatten(1))

    if small:
        return ResNet((4, 8, 8), 1, 2), (3, 8, 8)
    return ResNet((16, 32, 64), 2, 8), (3, 32, 32)


def build_problem(name: str, batch_size: int, small: bool = False):
    """``(model, input_shape)`` of a problem; weights from a fixed seed.

    ``gpt``'s input shape is ``(sequence length,)`` (token ids). ``small``:
    tiny versions of ``gpt`` and ``resnet``, and ``gpt2-small`` on short sequences (for tests).
    """
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "gpt":
        return _gpt(small)
    if name == "gpt2-small":
        return _gpt2_small(small)
    if name == "resnet":
        return _resnet(small)
    if name == "mlp":
        model = nn.Sequential(
            nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
        )
        shape = (1, 28, 28)
    elif name == "3c3d":
        # DeepOBS net_cifar10_3c3d. DeepOBS pools with TensorFlow 'same'
        # padding (asymmetric: 0 before, 1 after); MaxPool2d(3, 2, padding=1)
        # pads 1 on both sides and gives the same shapes (28->14, 12->6, 6->3),
        # and BackPACK supports it.
        model = nn.Sequential(
            nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
            nn.Conv2d(64, 96, 3), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
            nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
            nn.Flatten(),
            nn.Linear(3 * 3 * 128, 512), nn.ReLU(),
            nn.Linear(512, 256), nn.ReLU(),
            nn.Linear(256, 10),
        )  # fmt: skip
        shape = (3, 32, 32)
    elif name == "2c2d":
        # DeepOBS net_fmnist_2c2d ('same' convolutions, 2x2 pooling).
        model = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Flatten(),
            nn.Linear(7 * 7 * 64, 1024), nn.ReLU(),
            nn.Linear(1024, 10),
        )  # fmt: skip
        shape = (1, 28, 28)
    else:
        raise ValueError(f"unknown problem {name!r}; choose from {PROBLEMS + OPT_IN_PROBLEMS}")
    return model, shape


def num_params(name: str, small: bool = False) -> int:
    model, _ = build_problem(name, 1, small)
    return sum(p.numel() for p in model.parameters())


def make_batches(name: str, model, shape: tuple, batch_size: int, count: int = 4) -> list[tuple]:
    """``count`` fixed synthetic batches ``(inputs, targets)`` (random token ids for ``gpt``)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    if name in LANGUAGE_MODELS:
        vocab = model.config.vocab_size
        batches = []
        for _ in range(count):
            tokens = torch.randint(0, vocab, (batch_size, *shape), generator=generator)
            batches.append((tokens, tokens))
        return batches
    return [
        (torch.randn(batch_size, *shape, generator=generator),
         torch.randint(0, 10, (batch_size,), generator=generator))
        for _ in range(count)
    ]  # fmt: skip


def token_losses(logits, tokens):
    """Next-token cross-entropy ``[B, T - 1]`` of a causal LM (logits at ``t`` predict token ``t + 1``)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")


def make_quantities(config: str):
    """``(quantities, first_timed_step_multiple)`` of a configuration (None for plain)."""
    from cockpit_like import quantities as q
    from cockpit_like.utils.configuration import configuration
    from cockpit_like.utils.schedules import linear

    if config == "plain":
        return None
    if config == "nothing":

        def first_only(step: int) -> bool:
            return step == 0  # an untimed warm-up step; every timed step has nothing scheduled

        first_only.description = "step 0 only"
        return configuration("economy", track_schedule=first_only)
    if config in ("economy", "business", "full"):
        return configuration(config, track_schedule=linear(1))
    if config == "full_every10":
        return configuration("full", track_schedule=linear(10))
    if config.startswith("q:"):
        name = config[2:]
        if name in BASE_CLASSES or name not in q.__all__:
            raise ValueError(f"unknown quantity {name!r}")
        return [getattr(q, name)(track_schedule=linear(1))]
    raise ValueError(f"unknown configuration {config!r}")


def _training(args):
    """The child's model, data and cockpit: ``(train_step, warmup, steps, period)``; ``train_step(step)``
    runs one whole training step (zero_grad, forward, backward inside the cockpit, ``optimizer.step()``)."""
    import torch
    from backpack import extend
    from torch import nn

    from cockpit_like import Cockpit

    torch.set_num_threads(1)
    model, shape = build_problem(args.problem, args.batch_size, args.small)
    quantities = make_quantities(args.config)
    warmup, steps = args.warmup, args.steps
    if args.config == "full_every10":
        # amortised: start timing at a tracked step, time whole periods of 10
        warmup = max(10, -(-warmup // 10) * 10)
        steps = max(10, -(-steps // 10) * 10)
    if args.config == "nothing":
        warmup = max(warmup, 1)  # step 0, the only tracked one, is never timed

    device = torch.device(getattr(args, "device", "cpu") or "cpu")
    model = model.to(device)
    batches = [
        (inputs.to(device), targets.to(device))
        for inputs, targets in make_batches(args.problem, model, shape, args.batch_size)
    ]
    lossfunc = nn.CrossEntropyLoss()
    individual = nn.CrossEntropyLoss(reduction="none")
    language_model = args.problem in LANGUAGE_MODELS
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cockpit = None
    if quantities is not None:
        import os

        checks = os.environ.get("COCKPIT_LIKE_SELF_CHECKS", "1") != "0"  # --no-self-checks: their cost
        if args.problem in HOOK_PROBLEMS:  # not extended: the hook backend
            cockpit = Cockpit(model.parameters(), quantities=quantities, model=model, self_checks=checks)
        else:
            model, lossfunc = extend(model), extend(lossfunc)
            cockpit = Cockpit(model.parameters(), quantities=quantities, self_checks=checks)

    def train_step(step: int) -> None:
        inputs, labels = batches[step % len(batches)]
        optimizer.zero_grad()
        outputs = model(inputs)
        if language_model:  # mean token cross-entropy; a sample is a sequence
            per_token = token_losses(outputs.logits, labels)
            loss = per_token.mean()
        else:
            loss = lossfunc(outputs, labels)
        if cockpit is None:
            loss.backward()
        else:
            info = {
                "batch_size": args.batch_size,
                "individual_losses": (
                    per_token.detach().mean(1) if language_model else individual(outputs, labels)
                ),
                "loss": loss,
                "optimizer": optimizer,
            }
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()

    period = 10 if args.config == "full_every10" else 1
    train_step.cockpit = cockpit  # for measurements inside one process (self_checks_cost.py --interleaved)
    return train_step, warmup, steps, period


def run_child(args) -> dict:
    """Train ``warmup + steps`` steps and return per-step times and peak memory."""
    import torch

    train_step, warmup, steps, period = _training(args)
    cuda = (getattr(args, "device", "cpu") or "cpu").startswith("cuda")
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    spent = 0.0
    step = 0
    while True:
        if step >= warmup and len(times) % period == 0:
            if len(times) >= args.min_steps and spent > args.budget:
                break  # slow configuration: enough steps for a median within the time budget
            if len(times) >= steps and (spent >= args.min_time or len(times) >= args.max_steps):
                break  # fast configurations run more steps, for at least --min-time seconds
        synchronize()
        start = time.perf_counter()
        train_step(step)
        synchronize()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
            spent += elapsed
        elif step == 0 and elapsed > args.budget / 4 and period == 1:
            warmup = 1  # very slow steps: one warm-up step is enough
        step += 1
    result = {
        "problem": args.problem,
        "config": args.config,
        "batch_size": args.batch_size,
        "times": times,
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "threads": torch.get_num_threads(),
    }
    if cuda:
        result["device"] = torch.cuda.get_device_name()
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def live_peak(events: list[dict]) -> int:
    """Peak bytes of the tensors allocated during a profile and not yet freed.

    ``events``: the ``"[memory]"`` events of a chrome trace exported by ``torch.profiler`` with
    ``profile_memory=True`` (``args``: ``Addr``, ``Bytes``, positive for an allocation, negative for
    a free). Frees of blocks allocated before the profile started are ignored.
    """
    live: dict = {}
    current = peak = 0
    for event in sorted(events, key=lambda e: e["ts"]):
        address, size = event["args"]["Addr"], event["args"]["Bytes"]
        if size > 0:
            current += size - live.get(address, 0)
            live[address] = size
            peak = max(peak, current)
        elif address in live:
            current -= live.pop(address)
    return peak


def profiled_live_peak(work) -> int:
    """Run ``work()`` under ``torch.profiler`` (CPU allocations recorded) and return :func:`live_peak` of it."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = [e for e in json.load(handle)["traceEvents"] if e.get("name") == "[memory]"]
    return live_peak(events)


def run_live_child(args) -> dict:
    """Peak bytes of live tensors over the first steps, from the allocator's own events (exact; see ``live_peak``).

    Everything the training loop and the cockpit allocate from step 0 on is seen (the model's
    parameters, made before, are not, for every configuration alike): ``--live-steps`` steps, or for
    ``full_every10`` through the end step of the second tracked step (steps 0-11).
    """
    train_step, _, _, period = _training(args)
    count = 12 if period == 10 else max(1, args.live_steps)

    def work():
        for step in range(count):
            train_step(step)

    return {
        "problem": args.problem,
        "config": args.config,
        "live_steps": count,
        "live_peak_mb": profiled_live_peak(work) / 2**20,
    }


# ---------------------------------------------------------------------------
# parent: schedule children, aggregate, write JSON and tables
# ---------------------------------------------------------------------------
def all_quantity_configs() -> list[str]:
    from cockpit_like import quantities as q

    return [f"q:{name}" for name in q.__all__ if name not in BASE_CLASSES]


def child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def child_command(problem: str, config: str, steps: int, warmup: int, args, live: bool = False) -> list[str]:
    """The command line of one child process."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child",
        "--problem", problem, "--config", config,
        "--steps", str(steps), "--warmup", str(warmup),
        "--batch-size", str(batch_size_of(problem, args.batch_size)),
        "--budget", str(args.budget), "--min-steps", str(min(args.min_steps, steps)),
        "--min-time", str(args.min_time), "--max-steps", str(args.max_steps),
    ]  # fmt: skip
    if args.small:
        command.append("--small")
    if live:
        command += ["--live", "--live-steps", str(args.live_steps)]
    if getattr(args, "device", "cpu") != "cpu":
        command += ["--device", args.device]
    return command


def spawn(problem: str, config: str, steps: int, warmup: int, args, live: bool = False) -> dict:
    command = child_command(problem, config, steps, warmup, args, live)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"problem": problem, "config": config, "error": f"timed out after {args.timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"problem": problem, "config": config, "error": " | ".join(tail) or f"exit {done.returncode}"}


def aggregate(runs: list[dict], problems: list[str], batch_size: int | None, small: bool = False) -> dict:
    """Per problem and configuration: median time, ratios and added memory from same-round plain runs."""
    results = {}
    live = {(r["problem"], r["config"]): r for r in runs if r.get("round") == "live" and "live_peak_mb" in r}
    runs = [r for r in runs if r.get("round") != "live"]
    for problem in problems:
        per_round_plain: dict[int, dict] = {}  # plain ran at the start and at the end of a round
        for rnd in sorted({r["round"] for r in runs}):
            plains = [r for r in runs if r["round"] == rnd and r["problem"] == problem and r["config"] == "plain"]
            plains = [r for r in plains if "error" not in r]
            if plains:
                per_round_plain[rnd] = {
                    "median_s": statistics.fmean(r["median_s"] for r in plains),
                    "maxrss_mb": min(r["maxrss_mb"] for r in plains),
                }
        configs = []
        for r in runs:
            if r["problem"] == problem and r["config"] not in configs:
                configs.append(r["config"])
        entries = {}
        for config in configs:
            mine = [r for r in runs if r["problem"] == problem and r["config"] == config]
            errors = [r["error"] for r in mine if "error" in r]
            ok = [r for r in mine if "error" not in r]
            key = "mean_s" if config == "full_every10" else "median_s"
            entry: dict = {"rounds": len(ok), "statistic": "mean" if key == "mean_s" else "median"}
            if errors:
                entry["errors"] = errors
            if ok:
                entry["time_s"] = statistics.median(r[key] for r in ok)
                ratios = [r[key] / per_round_plain[r["round"]]["median_s"] for r in ok if r["round"] in per_round_plain]
                added = [r["maxrss_mb"] - per_round_plain[r["round"]]["maxrss_mb"] for r in ok if r["round"] in per_round_plain]
                if ratios:
                    entry["ratio"] = statistics.median(ratios)
                    entry["ratio_min"], entry["ratio_max"] = min(ratios), max(ratios)
                    entry["added_memory_mb"] = statistics.median(added)
                entry["maxrss_mb"] = statistics.median(r["maxrss_mb"] for r in ok)
                if all("cuda_peak_mb" in r for r in ok):
                    entry["cuda_peak_mb"] = statistics.median(r["cuda_peak_mb"] for r in ok)
                    plain_peaks = [r["cuda_peak_mb"] for r in runs if r["problem"] == problem
                                   and r["config"] == "plain" and "cuda_peak_mb" in r]
                    if plain_peaks:
                        entry["cuda_added_mb"] = entry["cuda_peak_mb"] - statistics.median(plain_peaks)
            entries[config] = entry
        base = live.get((problem, "plain"))
        for (p, config), measured in live.items():
            if p == problem and config in entries and base is not None:
                entries[config]["live_peak_mb"] = measured["live_peak_mb"]
                entries[config]["live_added_mb"] = measured["live_peak_mb"] - base["live_peak_mb"]
        d, b = num_params(problem, small), batch_size_of(problem, batch_size)
        results[problem] = {
            "num_params": d,
            "batch_size": b,
            "backend": "hooks (model=model, not extended)" if problem in HOOK_PROBLEMS else "BackPACK (extend)",
            "per_sample_grads_mb": b * d * 4 / 2**20,
            "configs": entries,
        }
    return results


def _fmt_ratio(entry: dict | None) -> str:
    if not entry or "ratio" not in entry:
        return "error" if entry and entry.get("errors") else "-"
    text = f"{entry['ratio']:.2f}"
    if entry["rounds"] > 1:
        text += f" ({entry['ratio_min']:.2f}-{entry['ratio_max']:.2f})"
    return text


def _verdict(value: float | None, target: float | None) -> str:
    if target is None or value is None:
        return ""
    return "met" if value <= target else "**missed**"


def _measured(result: dict, meta: dict) -> dict:
    """When and how a problem's figures were measured (its own entry for figures merged from an older run)."""
    return result.get("measured") or {k: meta.get(k) for k in ("date", "rounds", "steps", "commit")}


def _memory_table(results: dict, problems: list[str], key: str, form: str, title: str) -> list[str]:
    """A table of added memory ``key`` (MB, and % of ``B x D x 4`` against its target) for the main
    configurations that have it on some problem; no lines if none has."""
    if key == "live_added_mb":  # measured for some configurations only (not plain itself, not nothing)
        configs = [c for c in MAIN_CONFIGS if c != "plain" and any(key in (results[p]["configs"].get(c) or {}) for p in problems)]
    else:
        configs = [c for c in MAIN_CONFIGS if any(c in results[p]["configs"] for p in problems)]
    if not configs:
        return []
    lines = ["", title, "", "| configuration |" + "".join(f" {p} |" for p in problems), "|---|" + "---|" * len(problems)]
    for config in configs:
        row = f"| {ROW_TITLES[config]} |"
        for p in problems:
            entry = results[p]["configs"].get(config) or {}
            if key not in entry:
                row += " error |" if entry.get("errors") else " - |"
                continue
            frac = entry[key] / results[p]["per_sample_grads_mb"]
            text = f"{form.format(entry[key])} ({100 * frac:.0f}% of B x D x 4"
            target = memory_targets(p).get(config)
            if target is not None:
                text += f"; target <= {100 * target:.0f}%: {_verdict(frac, target)}"
            row += f" {text}) |"
        lines.append(row)
    return lines


def _ratio_and_memory_tables(results: dict, problems: list[str], title: str, source: str) -> list[str]:
    time_title = f"{title}time per step" if title else "Time per step"
    lines = ["", f"{time_title}, ratio to plain training (target from {source} in the next column):", ""]
    header = "| configuration |" + "".join(f" {p} | {p} target |" for p in problems)
    lines += [header, "|---|" + "---|---|" * len(problems)]
    for config in MAIN_CONFIGS:
        if not any(config in results[p]["configs"] for p in problems):
            continue
        row = f"| {ROW_TITLES[config]} |"
        for p in problems:
            entry = results[p]["configs"].get(config)
            target = TARGETS.get(p, {}).get(config)
            verdict = _verdict(entry.get("ratio") if entry else None, target)
            row += f" {_fmt_ratio(entry)} | {'<= %g %s' % (target, verdict) if target else '-'} |"
        lines.append(row)
    memory_title = f"{title}peak memory" if title else "Peak memory"
    lines += _memory_table(
        results, problems, "added_memory_mb", "{:.0f}",
        f"{memory_title} added over plain training (MB; max RSS of the process minus plain's):",
    )  # fmt: skip
    lines += _memory_table(
        results, problems, "live_added_mb", "{:.1f}",
        f"{memory_title} of live tensors added over plain training (MB; exact, from the allocator's "
        "events over the first steps, see `live_peak`):",
    )  # fmt: skip
    return lines


def _cuda_memory_table(results: dict, problems: list[str], meta: dict) -> list[str]:
    """Peak ``torch.cuda.max_memory_allocated`` per configuration (``--device cuda`` runs only)."""
    configs = []
    for p in problems:
        for config, entry in results[p]["configs"].items():
            if "cuda_peak_mb" in entry and config not in configs:
                configs.append(config)
    if not configs:
        return []
    lines = [
        "",
        f"GPU memory on {meta.get('device', 'cuda')}: peak `torch.cuda.max_memory_allocated()` over the timed "
        "steps in MB (added over plain's in brackets).",
        "",
        "| problem | " + " | ".join(configs) + " |",
        "|---|" + "---|" * len(configs),
    ]
    for p in problems:
        cells = []
        for config in configs:
            entry = results[p]["configs"].get(config, {})
            if "cuda_peak_mb" not in entry:
                cells.append("-")
                continue
            added = entry.get("cuda_added_mb")
            cells.append(f"{entry['cuda_peak_mb']:.0f}" + (f" (+{added:.0f})" if added is not None and config != "plain" else ""))
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines


def markdown(results: dict, meta: dict) -> str:
    """The markdown tables: main configurations (BackPACK problems, then hook-backend problems), then each quantity alone."""
    problems = list(results)
    when = {p: _measured(results[p], meta) for p in problems}
    merged = len({(w.get("date"), w.get("commit"), w.get("rounds")) for w in when.values()}) > 1
    batches = sorted({results[p].get("batch_size", meta.get("batch_size")) for p in problems})
    lines = [
        f"Measured {meta['date']} on {meta['machine']}"
        + (f", device {meta['device']}" if meta.get("device", "cpu") != "cpu" else "")
        + f", torch {meta['torch']}, one thread per process; "
        f"{meta['rounds']} round(s) of {meta['steps']} timed steps (quantities alone: "
        f"{meta['quantity_rounds']} round(s) of {meta['quantity_steps']} steps), "
        + (f"batch {batches[0]}. " if len(batches) == 1 else "batch size B per problem below. ")
        + ("Figures of some problems come from an earlier run (column 'measured'). " if merged else "")
        + "Ratio: time per step over plain training's in the same round, median over rounds "
        "(min-max over rounds in brackets)."
        + (f" **Partial: {meta['partial']['done']} of {meta['partial']['planned']} child processes of this run had "
           "finished** (the run was cut off or is still going; a ratio needs the round's plain run)."
           if meta.get("partial") else ""),
        "",
        "| problem | per-sample backend | D | B | plain step (ms) | B x D x 4 bytes (MB) |" + (" measured |" if merged else ""),
        "|---|---|---|---|---|---|" + ("---|" if merged else ""),
    ]
    for p in problems:
        plain = results[p]["configs"].get("plain", {})
        ms = f"{1000 * plain['time_s']:.1f}" if "time_s" in plain else "-"
        backend = results[p].get("backend") or ("hooks" if p in HOOK_PROBLEMS else "BackPACK (extend)")
        row = (
            f"| {p} | {backend} | {results[p]['num_params']:,} | {results[p].get('batch_size', meta.get('batch_size'))} "
            f"| {ms} | {results[p]['per_sample_grads_mb']:.0f} |"
        )
        if merged:
            w = when[p]
            row += f" {w.get('date')}, {w.get('rounds')} round(s){', ' + w['commit'] if w.get('commit') else ''} |"
        lines.append(row)
    groups = [
        ([p for p in problems if p not in HOOK_PROBLEMS], "", "issue 6"),
        ([p for p in problems if p in HOOK_PROBLEMS], "Any model (hook backend, not extended): ", "issue 13"),
    ]
    for group, title, source in groups:
        if group:
            lines += _ratio_and_memory_tables(results, group, title, source)
    lines += _cuda_memory_table(results, problems, meta)
    quantity_configs = []
    for p in problems:
        quantity_configs += [c for c in results[p]["configs"] if c.startswith("q:") and c not in quantity_configs]
    order = meta.get("quantity_order") or []
    quantity_configs.sort(key=lambda c: (order.index(c) if c in order else len(order), c))
    if quantity_configs:
        qproblems = [p for p in problems if any(c.startswith("q:") for c in results[p]["configs"])]
        lines += ["", "Each quantity alone, tracking every step (ratio to plain; added peak memory in MB):", ""]
        lines += ["| quantity |" + "".join(f" {p} | {p} MB |" for p in qproblems)]
        lines += ["|---|" + "---|---|" * len(qproblems)]
        for config in quantity_configs:
            row = f"| {config[2:]} |"
            for p in qproblems:
                entry = results[p]["configs"].get(config)
                mem = f"{entry['added_memory_mb']:.0f}" if entry and "added_memory_mb" in entry else "-"
                row += f" {_fmt_ratio(entry)} | {mem} |"
            lines.append(row)
    errors = [
        f"- {p} / {c}: {e['errors'][0]}"
        for p in problems
        for c, e in results[p]["configs"].items()
        if e.get("errors")
    ]
    if errors:
        lines += ["", "Failed runs:", ""] + errors
    return "\n".join(lines) + "\n"


def git_commit() -> str | None:
    """The short hash of the checked-out commit (``+dirty`` with local changes), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def merge_earlier(path: Path, results: dict, runs: list[dict], quiet: bool = False) -> tuple[dict, list[dict]]:
    """Add the problems of an earlier results JSON that this run did not measure (results and raw runs)."""
    if not path.exists():
        if not quiet:
            print(f"--merge: {path} does not exist; nothing merged")
        return results, runs
    earlier = json.loads(path.read_text())
    old_meta = earlier.get("meta", {})
    merged = {}
    for problem, result in earlier.get("results", {}).items():
        if problem in results:
            continue
        result = dict(result)
        result["measured"] = _measured(result, old_meta)
        merged[problem] = result
    kept = [dict(run, merged_from=str(path.name)) for run in earlier.get("runs", []) if run.get("problem") in merged]
    order = [p for p in PROBLEMS if p in merged or p in results] + [p for p in merged if p not in PROBLEMS]
    combined = {p: (results[p] if p in results else merged[p]) for p in order}
    return combined, kept + runs


def update_doc(table: str, path: Path = DOC) -> bool:
    """Replace the text between the table markers of ``path``; False if the markers are missing."""
    if not path.exists():
        return False
    text = path.read_text()
    if BEGIN not in text or END not in text:
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")
    return True


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a minute: MLP, few steps, 1 round")
    parser.add_argument(
        "--problems", default=None,
        help=f"comma-separated subset of {','.join(PROBLEMS)} (default: all), or {','.join(OPT_IN_PROBLEMS)}",
    )  # fmt: skip
    parser.add_argument(
        "--configs", default=None,
        help="comma-separated main configurations (plain is always run) out of "
        f"{','.join(MAIN_CONFIGS)}; 'none' for no main configuration",
    )  # fmt: skip
    parser.add_argument(
        "--quantities", default=None,
        help="comma-separated quantity names to time alone ('all' = every quantity, 'none')",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the main configurations")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--quantity-rounds", type=int, default=None, help="rounds of the quantities alone")
    parser.add_argument("--quantity-steps", type=int, default=None, help="timed steps of the quantities alone")
    parser.add_argument(
        "--batch-size", type=int, default=None,
        help=f"batch size of every problem (default: {DEFAULT_BATCH_SIZE}; "
        + ", ".join(f"{p} {b}" for p, b in BATCH_SIZES.items()) + ")",
    )  # fmt: skip
    parser.add_argument("--small", action="store_true", help="tiny gpt/resnet models, gpt2-small on 16 tokens (for tests)")
    parser.add_argument(
        "--no-self-checks", action="store_true",
        help="cockpits without their self-checks (Cockpit(self_checks=False)): to measure what the checks cost",
    )
    parser.add_argument(
        "--merge", default=None,
        help="a results JSON of an earlier run: its problems not measured now are kept "
        "(in the JSON and the table), e.g. benchmarks/results/overhead.json",
    )  # fmt: skip
    parser.add_argument(
        "--budget", type=float, default=None,
        help="seconds of timed steps per process: a slow configuration stops after --min-steps "
        "steps once over budget (not full_every10, which times whole periods)",
    )  # fmt: skip
    parser.add_argument("--min-steps", type=int, default=3, help="timed steps at least (see --budget)")
    parser.add_argument(
        "--min-time", type=float, default=None,
        help="fast configurations time more than --steps steps, until this many seconds (at most --max-steps)",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=1000, help="timed steps at most (see --min-time)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/overhead[_quick].json)")
    parser.add_argument("--table", default=None, help="also write the markdown table to this path")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/performance.md")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled order")
    parser.add_argument(
        "--from-json", default=None,
        help="measure nothing: rebuild the table (and docs, unless --no-docs) from a results JSON",
    )  # fmt: skip
    parser.add_argument(
        "--no-live-memory", action="store_true",
        help="skip the exact measure of added memory (one more process per problem and main "
        "configuration, profiling the first steps' allocations)",
    )  # fmt: skip
    parser.add_argument("--live-steps", type=int, default=3, help="steps profiled for the live-tensor peak")
    parser.add_argument(
        "--device", default="cpu",
        help="cpu, or cuda / cuda:N: run model, data and cockpit there (synchronised timing, "
        "torch.cuda.max_memory_allocated per child; the live-tensor profile is skipped)",
    )  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="print the planned child commands and exit")
    # child mode (internal)
    parser.add_argument("--live", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--problem", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def save(runs: list[dict], problems: list[str], args, argv, started: float, plan: dict, planned) -> None:
    """Aggregate ``runs``, merge ``--merge``, write the JSON (and ``--table``).

    ``planned = (done, total)`` while the run goes on: the files are written quietly after every child
    process and say they are partial, so a run cut off by a time limit (``benchmarks/gpu_check.sh``)
    keeps every figure measured so far; ``None`` at the end: the table is printed and, unless
    ``--no-docs`` or ``--quick``, put into the docs."""
    import torch

    quick = plan["quick"]
    results = aggregate(runs, problems, args.batch_size, args.small)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''} ({os.cpu_count()} cores)".replace("  ", " "),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": args.device if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name()})",
        "rounds": plan["rounds"],
        "steps": plan["steps"],
        "warmup": plan["warmup"],
        "quantity_rounds": plan["qrounds"] if plan["qconfigs"] else 0,
        "quantity_steps": plan["qsteps"],
        "batch_size": args.batch_size if args.batch_size is not None else DEFAULT_BATCH_SIZE,
        "batch_sizes": {p: batch_size_of(p, args.batch_size) for p in problems},
        "small": args.small,
        "commit": git_commit(),
        "budget_s": args.budget,
        "quick": quick,
        "seconds": round(time.time() - started, 1),
        "quantity_order": plan["known"],
        "command": " ".join(["benchmarks/overhead.py"] + (sys.argv[1:] if argv is None else list(argv))),
    }
    if planned is not None:
        meta["partial"] = {"done": planned[0], "planned": planned[1]}
    for p in problems:
        results[p]["measured"] = {k: meta[k] for k in ("date", "rounds", "steps", "commit")}
    if args.merge:
        results, runs = merge_earlier(Path(args.merge), results, runs, quiet=planned is not None)
    table = markdown(results, meta)
    out = Path(args.out) if args.out else (QUICK_JSON if quick else DEFAULT_JSON)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "targets": TARGETS, "results": results, "runs": runs}, indent=1))
    if args.table:
        Path(args.table).write_text(table)
    if planned is not None:
        return
    print()
    print(table)
    print(f"wrote {out}")
    if not quick and not args.no_docs:
        if update_doc(table):
            print(f"updated the table in {DOC}")
        else:
            print(f"{DOC} has no {BEGIN} ... {END} markers; table not inserted")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.no_self_checks:
        os.environ["COCKPIT_LIKE_SELF_CHECKS"] = "0"  # the children inherit it (child_env)
    if args.child:
        args.batch_size = batch_size_of(args.problem, args.batch_size)
        args.steps = args.steps or 10
        args.warmup = 2 if args.warmup is None else args.warmup
        args.budget = 10.0 if args.budget is None else args.budget
        args.min_time = 0.0 if args.min_time is None else args.min_time
        print(json.dumps(run_live_child(args) if args.live else run_child(args)))
        return 0

    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        data["meta"].setdefault("quantity_order", all_quantity_configs())
        table = markdown(data["results"], data["meta"])
        if args.table:
            Path(args.table).write_text(table)
        print(table)
        if not args.no_docs and not data["meta"].get("quick"):
            print(f"updated the table in {DOC}" if update_doc(table) else f"{DOC}: no table markers")
        return 0

    quick = args.quick
    problems = args.problems.split(",") if args.problems else (["mlp"] if quick else list(PROBLEMS))
    for p in problems:
        if p not in PROBLEMS + OPT_IN_PROBLEMS:
            raise SystemExit(f"unknown problem {p!r}; choose from {','.join(PROBLEMS + OPT_IN_PROBLEMS)}")
    if args.configs is None:
        configs = list(MAIN_CONFIGS)
    elif args.configs == "none":
        configs = []
    else:
        configs = [c for c in args.configs.split(",") if c != "plain"]
        for c in configs:
            if c not in MAIN_CONFIGS:
                raise SystemExit(f"unknown configuration {c!r}; choose from {','.join(MAIN_CONFIGS)}")
    known = all_quantity_configs()
    if args.quantities in (None, "all"):
        qconfigs = known
    elif args.quantities == "none":
        qconfigs = []
    else:
        qconfigs = [f"q:{name}" for name in args.quantities.split(",")]
        for c in qconfigs:
            if c not in known:
                raise SystemExit(f"unknown quantity {c[2:]!r}; choose from {[k[2:] for k in known]}")
    rounds = args.rounds or (1 if quick else 3)
    steps = args.steps or (5 if quick else 10)
    warmup = args.warmup if args.warmup is not None else 2
    qrounds = min(args.quantity_rounds or 1, rounds)
    qsteps = args.quantity_steps or (3 if quick else 5)
    if args.budget is None:
        args.budget = 3.0 if quick else 8.0
    if args.min_time is None:
        args.min_time = 0.5 if quick else 1.0
    if quick and args.quantities is None:
        qconfigs = [f"q:{name}" for name in QUICK_QUANTITIES if f"q:{name}" in known]

    import torch

    if args.device != "cpu":
        if not args.device.startswith("cuda"):
            raise SystemExit(f"--device: expected cpu, cuda or cuda:N, got {args.device!r}")
        args.no_live_memory = True  # the allocator profile below is of CPU allocations
        if not args.dry_run and not torch.cuda.is_available():
            raise SystemExit(
                f"--device {args.device}: torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}); run it where a GPU is, or use --dry-run to check the plan"
            )
    rng = random.Random(args.seed)
    runs = []
    started = time.time()
    plan = []
    for rnd in range(rounds):
        jobs = [(p, c, steps) for p in problems for c in configs]
        if rnd < qrounds:
            jobs += [(p, c, qsteps) for p in problems for c in qconfigs]
        rng.shuffle(jobs)
        # plain at the start and at the end of the round, the rest interleaved in between
        plain = [(p, "plain", steps) for p in problems]
        plan.append(plain + jobs + (plain[::-1] if jobs else []))
    total = sum(len(jobs) for jobs in plan)
    if args.dry_run:
        for rnd, jobs in enumerate(plan):
            for problem, config, n in jobs:
                print(" ".join(child_command(problem, config, n, warmup, args)))
        print(f"{total} child processes planned ({rounds} rounds, device {args.device})")
        return 0
    done = 0
    for rnd, jobs in enumerate(plan):
        for problem, config, n in jobs:
            result = spawn(problem, config, n, warmup, args)
            result["round"] = rnd
            runs.append(result)
            done += 1
            key = "mean_s" if config == "full_every10" else "median_s"
            shown = (
                f"{1000 * result[key]:.1f} ms ({len(result['times'])} steps)"
                if key in result
                else result["error"][:120]
            )
            print(f"[{done}/{total} {time.time() - started:.0f}s] round {rnd} {problem} {config}: {shown}", flush=True)
            if "times" in result:
                result["steps"] = len(result.pop("times"))
            if done < total:  # what is measured so far is on disk: a run cut off (a time limit) keeps it
                save(runs, problems, args, argv, started, dict(rounds=rounds, steps=steps, warmup=warmup,
                     qrounds=qrounds, qsteps=qsteps, qconfigs=qconfigs, quick=quick, known=known),
                     planned=(done, total))

    if configs and not args.no_live_memory:
        for problem in problems:  # deterministic: one process per configuration, after the timed rounds
            for config in ["plain"] + [c for c in configs if c != "nothing"]:
                result = spawn(problem, config, steps, warmup, args, live=True)
                result["round"] = "live"
                runs.append(result)
                shown = f"{result['live_peak_mb']:.1f} MB" if "live_peak_mb" in result else result["error"][:120]
                print(f"[live {time.time() - started:.0f}s] {problem} {config}: peak of live tensors {shown}", flush=True)

    save(runs, problems, args, argv, started, dict(rounds=rounds, steps=steps, warmup=warmup, qrounds=qrounds,
         qsteps=qsteps, qconfigs=qconfigs, quick=quick, known=known), planned=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
