"""cockpit_like: a debugger for neural network training (drop-in for Cockpit).

Public names: :class:`Cockpit`, :class:`CockpitPlotter`, :mod:`quantities`,
:mod:`utils` (schedules, configurations, optimizer helpers), :func:`read_log`,
:mod:`instruments` (the gauges for dashboards of your own).
"""

__version__ = "0.1.0"

from cockpit_like import quantities, utils  # noqa: E402
from cockpit_like.cockpit import Cockpit  # noqa: E402
from cockpit_like.logs import read_log  # noqa: E402

__all__ = ["Cockpit", "CockpitPlotter", "quantities", "utils", "read_log", "instruments", "__version__"]


def __getattr__(name):
    # The plotter and the instruments import matplotlib; load them only when asked for.
    if name == "CockpitPlotter":
        from cockpit_like.plotting import CockpitPlotter

        return CockpitPlotter
    if name == "instruments":
        import importlib

        return importlib.import_module("cockpit_like.instruments")
    raise AttributeError(f"module 'cockpit_like' has no attribute {name!r}")
