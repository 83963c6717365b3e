"""``cockpit-like watch``: a live dashboard in its own process, following a log as it grows.

The training run streams its log (``Cockpit(..., stream_to=path)`` writes
``path.jsonl`` line by line); the viewer reads only the bytes appended since
its last look, every ``interval`` seconds, and redraws the dashboard when
new steps came in, so drawing costs the training loop nothing. A last line
that is still being written (no newline yet) waits for the next look. A log
that shrinks (a new run writing to the same path) is read again from the
start. A full ``.json`` log is re-read whenever it changes.

Where it draws: a window with an interactive matplotlib backend; headless
(Agg, no display), or with ``output`` given, it rewrites an image file at
every redraw (``output``, default: the log's name with ``.png``).
``once=True`` renders the current state to the image and returns.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["LogFollower", "watch"]


class LogFollower:
    """Reads a cockpit log incrementally.

    Args:
        path: the log (``.jsonl`` or ``.json``; the suffix may be left out).

    Attributes:
        steps: ``{step: {name: value}}`` read so far.
        metadata: the latest metadata of the log.
    """

    def __init__(self, path: str | os.PathLike):
        from cockpit_like.logs import _resolve

        self.path = _resolve(path)
        self.steps: dict[int, dict[str, Any]] = {}
        self.metadata: dict = {}
        self._offset = 0
        self._pending = b""
        self._lines = 0  # complete lines read so far (for the line numbers of errors)
        self._stamp: tuple[int, int] | None = None

    def poll(self) -> bool:
        """Read what was added since the last call; return whether new values came in."""
        from cockpit_like.logs import read_log_with_metadata

        if self.path.suffix != ".jsonl":
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            self.metadata, self.steps = read_log_with_metadata(self.path)
            return True
        size = self.path.stat().st_size
        if size < self._offset:  # rewritten from the start
            self.steps, self.metadata, self._offset, self._pending, self._lines = {}, {}, 0, b"", 0
        if size == self._offset:
            return False
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read(size - self._offset)
        self._offset += len(chunk)
        text = self._pending + chunk
        complete, _, self._pending = text.rpartition(b"\n")
        if not complete:
            return False
        return self._add(complete.decode("utf-8").split("\n"))

    def _add(self, lines: list[str]) -> bool:
        from cockpit_like.logs import _read_stream, merge_metadata

        metadata, steps = _read_stream(lines, self.path, first_line=self._lines + 1)
        self._lines += len(lines)
        if metadata:
            self.metadata = merge_metadata(self.metadata, metadata)
        for step, values in steps.items():
            self.steps.setdefault(step, {}).update(values)
        return bool(steps) or bool(metadata)


def _default_output(path: Path) -> Path:
    return path.with_suffix(".png")


def watch(
    log: str | os.PathLike,
    interval: float = 2.0,
    once: bool = False,
    output: str | os.PathLike | None = None,
    secondary_screen: bool = False,
    stop_after: float | None = None,
    wait: float = 0.0,
    verbose: bool = False,
) -> Path | None:
    """Follow ``log`` and redraw the dashboard whenever it grew (see the module docstring).

    Args:
        log: the streaming log (``.jsonl``) or a full log.
        interval: seconds between looks at the file.
        once: render the current state to ``output`` and return its path.
        output: the image to (re)write; default: the log's name with ``.png``.
            With an interactive backend and no ``output``, draws in a window only.
        secondary_screen: include the secondary screen.
        stop_after: return after this many seconds (default: run until
            interrupted, or until the window is closed).
        wait: seconds to wait for the log file to appear.
        verbose: print a line at every redraw (the last step, and the image).

    Returns:
        The image written last (None if none was written).
    """
    if interval <= 0:
        raise ValueError(f"watch: interval must be positive seconds, got {interval}")
    if stop_after is not None and not stop_after > 0:
        raise ValueError(f"watch: stop_after must be positive seconds (or None: until interrupted), got {stop_after}")
    deadline = time.monotonic() + wait
    while True:
        try:
            follower = LogFollower(log)
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(min(interval, 0.2))
    from cockpit_like.plotting import CockpitPlotter
    from cockpit_like.plotting.plotter import interactive_backend

    windowed = not once and output is None and interactive_backend()
    target = Path(output) if output is not None else _default_output(follower.path)
    plotter = CockpitPlotter(secondary_screen=secondary_screen)
    title = f"Cockpit: {follower.path.name}"
    written: Path | None = None

    def draw() -> None:
        nonlocal written
        last = max(follower.steps) if follower.steps else None
        label = f"{title} (step {last})" if last is not None else f"{title} (no data yet)"
        plotter.plot(follower.steps, show_plot=windowed, plot_title=label)
        if not windowed:
            fmt = target.suffix.lstrip(".").lower() or "png"
            target.parent.mkdir(parents=True, exist_ok=True)
            temporary = target.with_name(f".{target.name}.tmp")
            plotter.fig.savefig(temporary, format=fmt, facecolor="white")
            os.replace(temporary, target)  # a reader never sees a half-written image
            written = target
        if verbose:
            where = "window" if windowed else str(target)
            print(f"[cockpit-like watch] {len(follower.steps)} steps, last {last}: {where}", flush=True)

    follower.poll()
    draw()
    if once:
        return written
    started = time.monotonic()
    try:
        while stop_after is None or time.monotonic() - started < stop_after:
            if windowed:
                import matplotlib.pyplot as plt

                if plotter.fig is None or not plt.fignum_exists(plotter.fig.number):
                    break  # the window was closed
                plt.pause(interval)
            else:
                time.sleep(interval)
            if follower.poll():
                draw()
    except KeyboardInterrupt:
        pass
    return written
