#!/usr/bin/env python
"""Operations per training step, with and without the cockpit: the GPU's cost measured on a CPU.

On a GPU a small network's step is bound by kernel launches (and the Python dispatch before each),
not by arithmetic: on an H200 the economy preset's tracked step of the resnet benchmark took 156 ms
against a 7 ms plain step while it issued 8583 operations against 304 (docs/performance.md, "On a
GPU"). This script counts the aten operations a step dispatches (``TorchDispatchMode``; views,
detaches and other operations that launch no kernel are left out), for the problems of
:mod:`benchmarks.overhead`, in one process on the CPU, deterministically (no timing), so a change's
effect on a GPU can be seen where no GPU is lent:

- ``plain``: a training step without the cockpit;
- each configuration (``economy``, ``business``, ``full``: every step tracked) at its third step
  (the first two warm the cockpit up), with the operations grouped by the cockpit's source line
  that issued them (the innermost frame in ``cockpit_like``).

``--device-chunk`` makes the histogram counters take the accelerator's chunk
(:func:`cockpit_like.backends.fast_histograms.default_chunk` of a CUDA device), so the count is
the one a GPU would run; without it, the CPU's.

    python benchmarks/launch_count.py --problems resnet,gpt --configs economy --device-chunk
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: operations that launch no kernel (views and metadata)
NO_KERNEL = frozenset(
    {
        "aten.view", "aten.detach", "aten.slice", "aten.select", "aten._unsafe_view", "aten.expand", "aten.t",
        "aten.transpose", "aten.permute", "aten.unsqueeze", "aten.squeeze", "aten.reshape", "aten.alias",
        "aten.as_strided", "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.narrow",
        "aten.view_as_real", "aten.view_as_complex", "aten.lift_fresh", "aten._reshape_alias",
    }
)  # fmt: skip


class OperationCount(TorchDispatchMode):
    """Counts the kernel-launching aten operations dispatched inside it, by the cockpit line that issued them."""

    def __init__(self):
        super().__init__()
        self.by_source: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_source.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) not in NO_KERNEL:
            self.by_source[_source()] += 1
        return func(*args, **(kwargs or {}))


def _source() -> str:
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.endswith(str(Path("checks", "roots.py"))) and frame.name == "backward":
            continue  # the user's backward pass, called through the cockpit's watch of its root
        if f"{Path('cockpit_like')}/" in frame.filename and "benchmarks" not in frame.filename:
            return f"{frame.filename.split('cockpit_like/')[-1]}:{frame.lineno} ({frame.name})"
    return "(the training step itself)"


def count(problem: str, config: str, batch_size: int | None = None) -> OperationCount:
    """The operations of the third training step of ``problem`` under ``config`` (``plain``: no cockpit)."""
    import overhead

    argv = ["--child", "--problem", problem, "--config", config, "--steps", "3", "--warmup", "0"]
    args = overhead.parse_args(argv + (["--batch-size", str(batch_size)] if batch_size else []))
    args.batch_size = overhead.batch_size_of(problem, args.batch_size)
    args.budget, args.min_time = 5.0, 0.0
    train_step, *_ = overhead._training(args)
    train_step(0)
    train_step(1)
    with OperationCount() as counted:
        train_step(2)
    return counted


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", default="resnet,gpt", help="comma-separated problems of overhead.py")
    parser.add_argument("--configs", default="economy", help="comma-separated: economy, business, full")
    parser.add_argument("--batch-size", type=int, default=None, help="default: each problem's own")
    parser.add_argument("--device-chunk", action="store_true", help="the histogram chunk of an accelerator")
    parser.add_argument("--top", type=int, default=10, help="sources listed per problem and configuration")
    parser.add_argument("--json", default=None, help="write the counts here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import overhead

    problems = args.problems.split(",")
    configs = args.configs.split(",")
    for problem in problems:
        if problem not in overhead.PROBLEMS + overhead.OPT_IN_PROBLEMS:
            raise SystemExit(f"unknown problem {problem!r}; choose from {','.join(overhead.PROBLEMS)}")
    for config in configs:
        if config not in ("economy", "business", "full"):
            raise SystemExit(f"unknown configuration {config!r}; choose from economy, business, full")
    torch.set_num_threads(1)
    if args.device_chunk:
        from cockpit_like.backends import fast_histograms

        fast_histograms.default_chunk = lambda device: fast_histograms.DEVICE_CHUNK
    results = {}
    for problem in problems:
        plain = count(problem, "plain", args.batch_size).total
        results[problem] = {"plain": plain}
        for config in configs:
            counted = count(problem, config, args.batch_size)
            results[problem][config] = {"total": counted.total, "top": counted.by_source.most_common(args.top)}
            print(f"{problem} {config}: {counted.total} operations per step (plain: {plain})", flush=True)
            for source, n in counted.by_source.most_common(args.top):
                print(f"  {n:7d}  {source}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device_chunk": args.device_chunk, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
