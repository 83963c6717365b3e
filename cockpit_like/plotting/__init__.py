"""The cockpit dashboard: instruments drawn from stored cockpit output.

- :class:`CockpitPlotter`: ``plot(source, ...)`` from a live cockpit or a log;
- :func:`save_dashboard`: render a saved log to an image next to it;
- :class:`DashboardFigure`: the figure ``plot`` returns where no window shows it (an image in notebooks);
- :mod:`cockpit_like.plotting.instruments`: the draw functions;
- :mod:`cockpit_like.plotting.layout`: where they sit on the figure.
"""

from cockpit_like.plotting.data import RunData
from cockpit_like.plotting.plotter import CockpitPlotter, DashboardFigure, save_dashboard

__all__ = ["CockpitPlotter", "DashboardFigure", "save_dashboard", "RunData"]
