"""Progress bars for the cockpit's own long work (reading a long log, the demo's training, ``cockpit-like
export``, the diagnosis corpus): tqdm on stderr, in terminals and in notebooks."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable

from cockpit_like.utils.jupyter import in_jupyter_kernel

__all__ = ["progress"]


def _tqdm_class():
    """``tqdm.auto``'s bar (a widget in a notebook with ipywidgets), but the text bar in a kernel without
    ipywidgets, where ``tqdm.auto`` would warn that IProgress is missing."""
    if in_jupyter_kernel() and importlib.util.find_spec("ipywidgets") is None:
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm


def progress(iterable: Iterable, total: int | None, description: str, enabled: bool | None = None,
             unit: str = "step", delay: float = 0.0) -> Iterable:
    """``iterable`` with a tqdm bar on stderr (left behind: nothing).

    Args:
        enabled: True: always; False: never; None: when stderr is a terminal
            (tqdm's own rule) or in a Jupyter kernel. Without tqdm installed: never.
        unit: what is counted (``"step"``, ``"line"``, ``"run"``).
        delay: show the bar only once the work has taken this many seconds
            (short work shows nothing).
    """
    if enabled is False:
        return iterable
    try:
        tqdm = _tqdm_class()
    except ImportError:  # pragma: no cover - tqdm is in requirements.txt
        return iterable
    disable = False if enabled or in_jupyter_kernel() else None
    return tqdm(iterable, total=total, desc=description, unit=unit, file=sys.stderr, leave=False, disable=disable,
                delay=delay)
