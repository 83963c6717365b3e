"""The ``cockpit-like`` command line tool.

Usage::

    cockpit-like plot LOG [-o FILE] [--secondary] [--title TEXT] [--dpi N] [--log-iter]
    cockpit-like summary LOG
    cockpit-like export LOG --to tensorboard|wandb|mlflow DIR [--image-every N]
    cockpit-like watch LOG [--interval S] [--once] [-o FILE]
    cockpit-like influence LOG [--top N] [--step S] [--quantity NAME]
    cockpit-like diagnose LOG [--json] [--active] [--stored-only]
    cockpit-like spikes LOG [--step S] [--last N]

``plot`` renders a saved run (``.json``, ``.jsonl`` or a Cockpit log) to an
image (default: next to the log, same name, ``.png``; the suffix of ``-o``
picks the format). ``summary`` prints the last value of every tracked
quantity. ``export`` writes a saved run to TensorBoard, W&B or MLflow
(:mod:`cockpit_like.integrations.exporters`); ``watch`` follows a growing log
and redraws its dashboard (:mod:`cockpit_like.watch`); ``diagnose`` lists the
check-engine findings of a run (exit status 1 if one is an error,
:mod:`cockpit_like.diagnosis`); ``influence`` lists the most influential
samples that ``SelfInfluence`` stored; ``spikes`` prints the loss-spike
post-mortems that ``PostMortem`` stored (:mod:`cockpit_like.spikes`). Also runs as ``python -m cockpit_like.cli``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["main", "summarize", "summary_rows"]


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return str(int(value))
    value = float(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


#: quantities stored as one L2 norm per parameter block: summarised by the norm over all parameters,
#: ``sqrt(sum_p v_p^2)`` (what the dashboard plots as ||grad L||, ||update||, ...), not by the blocks' sum
BLOCK_NORMS = ("GradNorm", "ParamNorm", "UpdateSize", "Distance")


def summarize(value: Any, name: str | None = None) -> str:
    """A one-line description of a stored value (``name``: the quantity's, to know its kind).

    Numbers as they are; per-parameter norms (:data:`BLOCK_NORMS`) as the norm over all parameters and the
    blocks' mean; other per-parameter lists as ``sum`` and ``mean`` over the blocks; histograms as their total
    count and shape; other dicts by their scalar fields (e.g. KFACTrace's ``trace_total``).
    """
    if value is None:
        return "None"
    if isinstance(value, (int, float, np.integer, np.floating, bool)):
        return _number(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
        return f"{len(value)} record{'s' if len(value) != 1 else ''}"  # e.g. findings
    if isinstance(value, Mapping):
        if value.get("schema") == "cockpit_like.record":  # the recorder's record of a step (docs/recorder.md)
            origin = value.get("first_nonfinite")
            where = f"first non-finite: {origin['op']} in '{origin['module']}'" if origin else "all finite"
            return f"{len(value.get('ops', []))} operations ({value.get('trigger')}), {where}"
        if "hist" in value:
            hist = np.asarray(value["hist"], dtype=float)
            shape = "x".join(str(n) for n in hist.shape)
            text = f"histogram {shape} bins, {int(round(hist.sum()))} counts"
            blocks = sum(1 for key in value if str(key).startswith("param_") and key != "param_groups")
            if blocks:
                text += f", {blocks} per-layer"
            return text
        scalars = [
            f"{key}={_number(item)}" for key, item in value.items()
            if isinstance(item, (int, float, np.integer, np.floating)) and not isinstance(item, bool)
        ]
        return ", ".join(scalars) if scalars else f"dict with keys {sorted(map(str, value))}"
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        if isinstance(value, (list, tuple)):  # ragged, e.g. Parameters (one nested list per block)
            sizes = [int(np.asarray(v, dtype=float).size) for v in value]
            return f"{len(value)} blocks, {sum(sizes)} entries"
        return type(value).__name__
    if array.ndim == 1 and name in BLOCK_NORMS:
        return (f"norm {_number(float(np.sqrt(np.sum(array**2))))} over all parameters (per-block mean "
                f"{_number(float(array.mean()))} over {array.size} params)")
    if array.ndim == 1:
        return f"sum {_number(float(array.sum()))}, mean {_number(float(array.mean()))} over {array.size} params"
    return f"array {array.shape}, mean {_number(float(array.mean()))}"


def summary_rows(steps: Mapping[int, Mapping[str, Any]]) -> list[tuple[str, int, int, str]]:
    """``(name, tracked steps, last step, last value)`` for every stored key."""
    last: dict[str, tuple[int, Any]] = {}
    counts: dict[str, int] = {}
    for step in sorted(steps):
        for name, value in steps[step].items():
            if value is None:
                continue
            counts[name] = counts.get(name, 0) + 1
            last[name] = (step, value)
    return [(name, counts[name], last[name][0], summarize(last[name][1], name)) for name in last]


def _print_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join(str(h).ljust(w) for h, w in zip(header, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _progress(args: argparse.Namespace) -> bool | None:
    """A progress bar while a long log is read: on a terminal, after half a second; never with --no-progress."""
    return False if getattr(args, "no_progress", False) else None


def _cmd_summary(args: argparse.Namespace) -> int:
    from cockpit_like.logs import _resolve, read_log_with_metadata

    path = _resolve(args.log)
    metadata, steps = read_log_with_metadata(path, progress=_progress(args))
    rows = summary_rows(steps)
    if not steps and not metadata:  # an empty .jsonl (docs/logs.md#reading); every other non-log raised
        print(f"{path}: 0 steps: an empty stream (the run stopped before its first step reached the file)")
        return 0
    span = f"{len(steps)} steps ({min(steps)} .. {max(steps)})" if steps else "0 steps"
    library = metadata.get("library", "?")
    print(f"{path}: {span}, written by {library} {metadata.get('version', '')}".rstrip())
    if not rows:
        print("(nothing tracked)")
        return 0
    _print_table([(n, str(c), str(s), v) for n, c, s, v in rows], ("quantity", "tracked", "last step", "last value"))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from cockpit_like.plotting import save_dashboard

    kwargs = {} if args.dpi is None else {"dpi": args.dpi}
    if args.log_iter:
        kwargs["show_log_iter"] = True
    path = save_dashboard(args.log, args.output, secondary_screen=args.secondary, plot_title=args.title,
                          progress=_progress(args), **kwargs)
    print(f"wrote {path}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from cockpit_like.integrations.exporters import MissingPackage, export_log

    try:
        exporter = export_log(args.log, args.to, args.directory, image_every=args.image_every,
                              progress=None if not args.no_progress else False)
    except MissingPackage as error:  # a message with the install command, not a traceback
        print(f"cockpit-like export: error: --to {args.to}: {error}", file=sys.stderr)
        return 2
    where = {"tensorboard": "log_dir", "wandb": "run_dir", "mlflow": "run_id"}[args.to]
    print(f"exported {args.log} to {args.to}: {where} {getattr(exporter, where)}")
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    from cockpit_like.watch import watch

    if args.once:
        import matplotlib

        matplotlib.use("Agg")
    written = watch(args.log, interval=args.interval, once=args.once, output=args.output,
                    secondary_screen=args.secondary, stop_after=args.stop_after, wait=args.wait,
                    verbose=not args.once)
    if written is not None:
        print(f"wrote {written}")
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from cockpit_like.diagnosis import diagnose_log
    from cockpit_like.diagnosis.report import exit_status, format_table, to_json
    from cockpit_like.logs import _resolve

    path = _resolve(args.log)
    report = diagnose_log(path, rules=[] if args.stored_only else None)
    print(to_json(report, str(path)) if args.json else format_table(report, str(path), active_only=args.active))
    return exit_status(report)


def _cmd_influence(args: argparse.Namespace) -> int:
    from cockpit_like.logs import _resolve, read_log_with_metadata
    from cockpit_like.quantities.curvature_statistics import influence_rows

    path = _resolve(args.log)
    _, steps = read_log_with_metadata(path, progress=_progress(args))
    rows = influence_rows(steps, step=args.step, top=args.top, name=args.quantity)
    if not rows:
        named = "" if args.quantity is None else f" named {args.quantity}"
        stored = sorted({row[1] for row in influence_rows(steps, top=sys.maxsize, name=args.quantity)})
        quantities = sorted({row[4] for row in influence_rows(steps, top=sys.maxsize)}) if args.quantity else []
        if stored:  # only not at --step
            print(f"{path}: no SelfInfluence values{named} at step {args.step} (stored at {len(stored)} "
                  f"step{'s' if len(stored) != 1 else ''}: {stored[0]} .. {stored[-1]})")
        elif quantities:  # only not under that name
            print(f"{path}: no SelfInfluence values{named}: the log's SelfInfluence quantities are "
                  f"{', '.join(quantities)} (--quantity takes one of these names)")
        else:
            print(f"{path}: no SelfInfluence values{named} (track cockpit_like.quantities.SelfInfluence, with "
                  "info['sample_ids'] to name the samples; it stores the k most influential samples of each "
                  "tracked step: docs/curvature_statistics.md)")
        return 0
    print(f"{path}: the {len(rows)} most influential samples g_i^T (F + damping I)^-1 g_i (largest first)")
    _print_table([(str(k + 1), str(s), str(i), str(p), _number(v), q) for k, (v, s, i, p, q) in enumerate(rows)],
                 ("rank", "step", "sample id", "position", "self-influence", "quantity"))  # fmt: skip
    return 0


def _cmd_spikes(args: argparse.Namespace) -> int:
    from cockpit_like.logs import _resolve, read_log_with_metadata
    from cockpit_like.spikes.report import format_post_mortem, post_mortems

    path = _resolve(args.log)
    metadata, steps = read_log_with_metadata(path, progress=_progress(args))
    found = [(s, p) for s, p in post_mortems(steps) if args.step is None or s == args.step]
    if args.last is not None:
        found = found[-args.last:]
    if not found:
        stored = [s for s, _ in post_mortems(steps)]
        if stored:  # only not at --step
            print(f"{path}: no post-mortem at step {args.step} (the log has {len(stored)}, at step"
                  f"{'s' if len(stored) != 1 else ''} {', '.join(str(s) for s in stored[:8])}"
                  f"{', ...' if len(stored) > 8 else ''})")
        else:
            print(f"{path}: no post-mortems (track cockpit_like.spikes.PostMortem; it stores one at each spike)")
        return 0
    names = (metadata or {}).get("param_names")
    print(f"{path}: {len(found)} post-mortem(s)")
    for step, post in found:
        print()
        print(format_post_mortem(step, post, names))
    return 0


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (``--top``, ``--last``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1 or more), got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cockpit-like", description="Inspect cockpit_like (and Cockpit) training logs."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plot = commands.add_parser("plot", help="render a saved run as a cockpit dashboard image")
    plot.add_argument("log", metavar="LOG", help="the log file (.json / .jsonl, suffix optional)")
    plot.add_argument("-o", "--output", metavar="FILE",
                      help="image to write; its suffix picks the format (default: LOG's name with .png)")
    plot.add_argument("--secondary", action="store_true", help="include the secondary screen")
    plot.add_argument("--title", help="figure title (default: the log name and last step)")
    plot.add_argument("--dpi", type=float, help="resolution (default: matplotlib's, 100)")
    plot.add_argument("--log-iter", action="store_true", help="logarithmic step axis")
    plot.add_argument("--no-progress", action="store_true", help="no progress bar while a long log is read")
    plot.set_defaults(handler=_cmd_plot)
    summary = commands.add_parser("summary", help="print the last value of every tracked quantity")
    summary.add_argument("log", metavar="LOG", help="the log file (.json / .jsonl, suffix optional)")
    summary.add_argument("--no-progress", action="store_true", help="no progress bar while a long log is read")
    summary.set_defaults(handler=_cmd_summary)
    export = commands.add_parser("export", help="write a saved run to TensorBoard, Weights & Biases or MLflow")
    export.add_argument("log", metavar="LOG", help="the log file (.json / .jsonl, suffix optional)")
    export.add_argument("--to", required=True, choices=("tensorboard", "wandb", "mlflow"), help="where to")
    export.add_argument("directory", metavar="DIR",
                        help="TensorBoard log dir / W&B's dir (the run goes to DIR/wandb/...) / MLflow file store")
    export.add_argument("--image-every", type=int, default=0, metavar="N",
                        help="also store the dashboard image every N steps (default 0: none)")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.set_defaults(handler=_cmd_export)
    watch = commands.add_parser("watch", help="follow a growing log and redraw its dashboard")
    watch.add_argument("log", metavar="LOG", help="the streaming log (.jsonl) or a full log")
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between looks (default 2)")
    watch.add_argument("--once", action="store_true", help="render the current state to an image and exit")
    watch.add_argument("-o", "--output", metavar="FILE",
                       help="image to (re)write (default: LOG's name with .png; windowed backends: a window)")
    watch.add_argument("--secondary", action="store_true", help="include the secondary screen")
    watch.add_argument("--stop-after", type=float, metavar="SECONDS", help="stop after this long")
    watch.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                       help="wait this long for LOG to appear (default 0)")
    watch.set_defaults(handler=_cmd_watch)
    influence = commands.add_parser("influence", help="list the most influential samples (SelfInfluence)")
    influence.add_argument("log", metavar="LOG", help="the log file (.json / .jsonl, suffix optional)")
    influence.add_argument("--top", type=_positive_int, default=20, metavar="N", help="rows to print (default 20)")
    influence.add_argument("--step", type=int, metavar="S", help="only this step")
    influence.add_argument("--quantity", metavar="NAME", help="only this quantity (default: every SelfInfluence)")
    influence.add_argument("--no-progress", action="store_true", help="no progress bar while a long log is read")
    influence.set_defaults(handler=_cmd_influence)
    diagnose = commands.add_parser(
        "diagnose", help="list the run's findings (automatic diagnosis); exit status 1 if one is an error"
    )
    diagnose.add_argument("log", metavar="LOG", help="the log file (.json / .jsonl, suffix optional)")
    diagnose.add_argument("--json", action="store_true", help="print JSON (findings, active, notes, errors)")
    diagnose.add_argument("--active", action="store_true", help="list only findings not cleared by the end")
    diagnose.add_argument("--stored-only", action="store_true",
                          help="only the findings stored in the log (do not run the rules on it)")
    diagnose.set_defaults(handler=_cmd_diagnose)
    spikes = commands.add_parser("spikes", help="print the loss-spike post-mortems (PostMortem)")
    spikes.add_argument("log", metavar="LOG", help="the log file (.json / .jsonl, suffix optional)")
    spikes.add_argument("--step", type=int, metavar="S", help="only the post-mortem of this step")
    spikes.add_argument("--last", type=_positive_int, metavar="N", help="only the last N post-mortems")
    spikes.add_argument("--no-progress", action="store_true", help="no progress bar while a long log is read")
    spikes.set_defaults(handler=_cmd_spikes)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``cockpit-like``; returns the exit status."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's top-level error shows the top-level usage: show the command's own
        sub = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.handler(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"cockpit-like {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`cockpit-like diagnose LOG | head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
