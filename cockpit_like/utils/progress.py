"""Progress bars for long work (the demo's training, ``cockpit-like export``): tqdm on stderr if installed."""

from __future__ import annotations

import sys
from collections.abc import Iterable

__all__ = ["progress"]


def progress(iterable: Iterable, total: int | None, description: str, enabled: bool | None = None) -> Iterable:
    """``iterable`` with a tqdm bar on stderr.

    Args:
        enabled: True: always; False: never; None: only when stderr is a
            terminal (tqdm's own rule). Without tqdm installed: never.
    """
    if enabled is False:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in requirements.txt
        return iterable
    return tqdm(iterable, total=total, desc=description, unit="step", file=sys.stderr, leave=False,
                disable=None if enabled is None else False)
