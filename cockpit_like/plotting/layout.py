"""Where each instrument sits: groups of panels on one figure.

Primary screen (16 x 9 inches)::

    +-- Step size ---------+-- Gradients ----------+-- Curvature ---------+
    |  Alpha               |  Gradient tests       | λmax     | tr H      |
    | distance | grad norm | hist 1-D | hist 2-D   | KFAC tr  | TIC       |
    +-- Hyperparameters ---+-- Performance ------------------------------+
    | learning rate        |  loss          | accuracy | check engine   |
    +----------------------+---------------------------------------------+

When the run holds a loss-spike post-mortem (``PostMortem``,
:mod:`cockpit_like.spikes`), the bottom band makes room for its panel (the
last post-mortem), and only then: a run without one keeps the layout above::

    +-- Hyperparameters ---+-- Performance -------------------+-- Loss spikes --+
    | learning rate        |  loss     | accuracy | check eng. | last post-mortem|
    +----------------------+----------------------------------+-----------------+

The secondary screen adds a band below (figure 16 x 14): MeanGSNR, CABS,
EarlyStopping, other scalar quantities, the logged-curvature instruments
(EK-FAC spectrum, self-influence, preconditioned gradient norm) when a run
tracks any of them, and one 2-D histogram per parameter block (up to
:data:`MAX_LAYER_PANELS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.patches import FancyBboxPatch

from cockpit_like.plotting.curvature_instruments import CURVATURE_INSTRUMENTS
from cockpit_like.plotting.instruments import PRIMARY, SECONDARY, Instrument, layer_histogram
from cockpit_like.plotting.spike_instruments import SPIKE_INSTRUMENTS

__all__ = ["Layout", "build_layout", "MAX_LAYER_PANELS", "PRIMARY_SIZE", "SECONDARY_SIZE"]

PRIMARY_SIZE = (16.0, 9.0)
SECONDARY_SIZE = (16.0, 14.0)
MAX_LAYER_PANELS = 6

_GROUP_COLORS = {
    "Step size": "#eef4fb",
    "Gradients": "#f3f0fa",
    "Curvature": "#fbf0ee",
    "Hyperparameters": "#eef8ee",
    "Performance": "#f6f6f0",
    "Loss spikes": "#fbf3ea",
    "Secondary screen": "#f2f2f2",
}


@dataclass
class Layout:
    """The axes of one figure, keyed by instrument key, in drawing order."""

    instruments: dict[str, Instrument]
    axes: dict[str, object]
    layer_panels: int
    curvature_row: bool = False
    post_mortem: bool = False


def _group(fig, rect, label: str, pad_in=(0.62, 0.22, 0.62, 0.5)):
    """Draw a group's background and header; return the inner rectangle for its gridspec."""
    x0, y0, x1, y1 = rect
    width, height = fig.get_size_inches()
    fig.patches.append(
        FancyBboxPatch(
            (x0 + 0.003, y0 + 0.004), x1 - x0 - 0.006, y1 - y0 - 0.008,
            boxstyle="round,pad=0,rounding_size=0.006", transform=fig.transFigure,
            facecolor=_GROUP_COLORS.get(label, "#f4f4f4"), edgecolor="#d0d0d0", linewidth=0.8, zorder=-10,
        )
    )
    fig.text(x0 + 0.008, y1 - 0.008, label.upper(), ha="left", va="top", fontsize=9.5, fontweight="bold",
             color="#555555")
    left, right, bottom, top = pad_in
    return dict(
        left=x0 + left / width,
        right=x1 - right / width,
        bottom=y0 + bottom / height,
        top=y1 - top / height,
    )


def build_layout(fig, secondary_screen: bool, layer_panels: int = 0, curvature_row: bool = False,
                 post_mortem: bool = False) -> Layout:
    """Create every axes of the dashboard on an empty figure (``curvature_row``: the
    secondary screen's row of logged-curvature instruments; ``post_mortem``: the loss-spike panel in the
    bottom band)."""
    axes: dict[str, object] = {}
    instruments: dict[str, Instrument] = {}

    def add(key: str, spec, instrument: Instrument | None = None) -> None:
        ax = fig.add_subplot(spec)
        ax.set_gid(f"instrument:{key}")
        axes[key] = ax
        instruments[key] = (instrument or PRIMARY.get(key) or SECONDARY.get(key) or SPIKE_INSTRUMENTS.get(key)
                            or CURVATURE_INSTRUMENTS[key])

    width, height = fig.get_size_inches()
    # Vertical extent (figure fraction) of the primary screen; the title strip sits on top.
    title_strip = 0.42 / height
    primary_bottom = 1.0 - (9.0 / height) if secondary_screen else 0.0
    primary_top = 1.0 - title_strip
    span = primary_top - primary_bottom
    split = primary_bottom + 0.30 * span  # bottom band (hyperparameters, performance)

    for label, x0, x1, keys in (
        ("Step size", 0.0, 0.335, ("alpha", "distance", "grad_norm")),
        ("Gradients", 0.335, 0.667, ("grad_tests", "hist_1d", "hist_2d")),
    ):
        grid = fig.add_gridspec(2, 2, **_group(fig, (x0, split, x1, primary_top), label), hspace=0.5, wspace=0.42,
                                height_ratios=[1.15, 1])
        add(keys[0], grid[0, :])
        add(keys[1], grid[1, 0])
        add(keys[2], grid[1, 1])
    grid = fig.add_gridspec(2, 2, **_group(fig, (0.667, split, 1.0, primary_top), "Curvature"), hspace=0.5,
                            wspace=0.42, height_ratios=[1.15, 1])
    for key, spec in zip(("hess_max_ev", "hess_trace", "kfac_trace", "tic"), (grid[0, 0], grid[0, 1], grid[1, 0], grid[1, 1])):
        add(key, spec)
    # with the post-mortem panel: the learning rate, the loss and the accuracy narrower, the check engine as wide
    hyper_right, performance_right = (0.2, 0.75) if post_mortem else (0.25, 1.0)
    grid = fig.add_gridspec(1, 1, **_group(fig, (0.0, primary_bottom, hyper_right, split), "Hyperparameters"))
    add("learning_rate", grid[0, 0])
    grid = fig.add_gridspec(1, 3, **_group(fig, (hyper_right, primary_bottom, performance_right, split), "Performance"),
                            wspace=0.18 if not post_mortem else 0.24,
                            width_ratios=[1.2, 0.6, 1.6] if post_mortem else [1.45, 0.85, 1.3])
    add("loss", grid[0, 0])
    add("accuracy", grid[0, 1])
    add("findings", grid[0, 2])
    if post_mortem:  # (the y labels name rows and their ids: a wider left margin)
        grid = fig.add_gridspec(1, 1, **_group(fig, (performance_right, primary_bottom, 1.0, split), "Loss spikes",
                                               pad_in=(1.45, 0.22, 0.62, 0.5)))
        add("post_mortem", grid[0, 0])

    if secondary_screen:
        rows = 1 + bool(curvature_row) + bool(layer_panels)
        outer = fig.add_gridspec(rows, 1, **_group(fig, (0.0, 0.0, 1.0, primary_bottom), "Secondary screen"),
                                 hspace=0.62)
        series = outer[0].subgridspec(1, 4, wspace=0.3)
        for index, key in enumerate(("mean_gsnr", "cabs", "early_stopping", "custom")):
            add(key, series[0, index])
        if curvature_row:
            curvature = outer[1].subgridspec(1, 4, wspace=0.3, width_ratios=[1.2, 1.2, 1, 1])
            for index, key in enumerate(CURVATURE_INSTRUMENTS):
                add(key, curvature[0, index])
        if layer_panels:
            layers = outer[rows - 1].subgridspec(1, max(layer_panels, 4), wspace=0.35)
            for index in range(layer_panels):
                instrument = layer_histogram(index)
                add(instrument.key, layers[0, index], instrument)
    return Layout(instruments, axes, layer_panels, curvature_row, post_mortem)
