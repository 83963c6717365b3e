"""cockpit_like: a debugger for neural network training (drop-in for Cockpit).

Public names: :class:`Cockpit`, :class:`CockpitPlotter`, :mod:`quantities`,
:mod:`utils` (schedules and configurations), :func:`read_log`.
"""

__version__ = "0.1.0"

from cockpit_like import quantities, utils  # noqa: E402
from cockpit_like.cockpit import Cockpit  # noqa: E402
from cockpit_like.logs import read_log  # noqa: E402

__all__ = ["Cockpit", "CockpitPlotter", "quantities", "utils", "read_log", "__version__"]


def __getattr__(name):
    # The plotter imports matplotlib; load it only when asked for.
    if name == "CockpitPlotter":
        from cockpit_like.plotting import CockpitPlotter

        return CockpitPlotter
    raise AttributeError(f"module 'cockpit_like' has no attribute {name!r}")
