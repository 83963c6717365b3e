"""Marks the cockpit's own computations during a training step.

Code that runs inside the user's backward pass on the cockpit's behalf
(BackPACK's extensions, per-sample reductions) wraps itself in
:func:`cockpit_work`; :func:`in_cockpit_work` tells observers of the step
(the recorder, :mod:`cockpit_like.diagnosis.recorder`) to leave it out.
Thread-local (the autograd engine may run hooks on its own threads; each
thread marks its own work).

Imports nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["cockpit_work", "in_cockpit_work"]

_STATE = threading.local()


@contextlib.contextmanager
def cockpit_work():
    """Everything run inside is the cockpit's own work, not the user's step."""
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def in_cockpit_work() -> bool:
    return getattr(_STATE, "depth", 0) > 0
