"""Cockpit's instruments as public gauges, for dashboards of your own.

Every gauge has Cockpit's signature ``gauge(plotter, fig, gridspec)``: it adds
its axes to ``fig`` in the cell ``gridspec`` (a ``SubplotSpec``, e.g.
``grid[0, 1]`` of ``fig.add_gridspec(...)``) and draws the data that
``plotter`` read, with the same draw functions as the
:class:`~cockpit_like.CockpitPlotter` dashboard
(:mod:`cockpit_like.plotting.instruments`). ``plotter`` is a
``CockpitPlotter`` after :meth:`~cockpit_like.CockpitPlotter.read` or
:meth:`~cockpit_like.CockpitPlotter.plot` (its ``show_log_iter`` applies), or
directly a source: a ``Cockpit``, a log path, an output dict or a ``RunData``.
A gauge whose quantity was not tracked draws a blank "not tracked" panel
(Cockpit leaves the cell empty). Each gauge returns its main axes.

Example::

    from matplotlib.figure import Figure
    from cockpit_like import CockpitPlotter, instruments

    plotter = CockpitPlotter()
    plotter.read("logs/run")                      # or plotter.plot(cockpit, show_plot=False)
    fig = Figure(figsize=(10, 6))
    grid = fig.add_gridspec(2, 2)
    instruments.alpha_gauge(plotter, fig, grid[0, 0])
    instruments.grad_norm_gauge(plotter, fig, grid[0, 1])
    instruments.histogram_2d_gauge(plotter, fig, grid[1, :], idx=0)
    fig.savefig("my_dashboard.png")

Gauges (Cockpit's names; the quantities they read in brackets):
``alpha_gauge`` (Alpha), ``distance_gauge`` (Distance, UpdateSize),
``grad_norm_gauge`` (GradNorm), ``gradient_tests_gauge`` (NormTest,
InnerTest, OrthoTest), ``histogram_1d_gauge`` (GradHist1d),
``histogram_2d_gauge`` (GradHist2d), ``max_ev_gauge`` (HessMaxEV),
``trace_gauge`` (HessTrace), ``tic_gauge`` (TICDiag, TICTrace),
``hyperparameter_gauge`` (logged learning rate), ``performance_gauge``
(Loss, logged losses and accuracies), ``mean_gsnr_gauge`` (MeanGSNR),
``cabs_gauge`` (CABS), ``early_stopping_gauge`` (EarlyStopping); and ours:
``kfac_trace_gauge`` (KFACTrace), ``hess_spectral_density_gauge`` (HessSpectralDensity),
``ekfac_spectrum_gauge`` (EKFACSpectrum),
``self_influence_gauge`` (SelfInfluence), ``preconditioned_grad_norm_gauge``
(PreconditionedGradNorm), ``post_mortem_gauge`` (the last loss-spike post-mortem, PostMortem),
``custom_gauge`` (other scalar quantities).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cockpit_like.plotting import instruments as _drawn
from cockpit_like.plotting.data import RunData, load_source
from cockpit_like.plotting.curvature_instruments import CURVATURE_INSTRUMENTS
from cockpit_like.plotting.instruments import PRIMARY, SECONDARY, DrawOptions
from cockpit_like.plotting.plotter import CockpitPlotter
from cockpit_like.plotting.spike_instruments import SPIKE_INSTRUMENTS

__all__ = [
    "alpha_gauge",
    "distance_gauge",
    "grad_norm_gauge",
    "gradient_tests_gauge",
    "histogram_1d_gauge",
    "histogram_2d_gauge",
    "hyperparameter_gauge",
    "max_ev_gauge",
    "performance_gauge",
    "tic_gauge",
    "trace_gauge",
    "mean_gsnr_gauge",
    "early_stopping_gauge",
    "cabs_gauge",
    "kfac_trace_gauge",
    "hess_spectral_density_gauge",
    "ekfac_spectrum_gauge",
    "self_influence_gauge",
    "post_mortem_gauge",
    "preconditioned_grad_norm_gauge",
    "custom_gauge",
]


def _data_and_options(plotter: Any) -> tuple[RunData, DrawOptions]:
    log_iter = bool(getattr(plotter, "show_log_iter", False))
    if isinstance(plotter, RunData):
        return plotter, DrawOptions()
    if isinstance(plotter, CockpitPlotter):
        if plotter.data is None:
            raise ValueError(
                "this CockpitPlotter has no data yet: call plotter.read(source) (or plotter.plot(source)) "
                "before drawing gauges"
            )
        return plotter.data, DrawOptions(log_iter=log_iter)
    data, _ = load_source(plotter)
    return data, DrawOptions(log_iter=log_iter)


def _axes(fig, gridspec, key: str):
    ax = fig.add_subplot(gridspec)
    ax.set_gid(f"instrument:{key}")
    return ax


def _gauge(key: str, plotter: Any, fig, gridspec):
    data, options = _data_and_options(plotter)
    instrument = PRIMARY.get(key) or SECONDARY.get(key) or CURVATURE_INSTRUMENTS.get(key) or SPIKE_INSTRUMENTS[key]
    ax = _axes(fig, gridspec, key)
    instrument.draw(ax, data, options)
    return ax


# ---- step size ----------------------------------------------------------------------------
def alpha_gauge(plotter, fig, gridspec):
    """Distribution of the normalized step size α over the parabola it stands for (Alpha)."""
    return _gauge("alpha", plotter, fig, gridspec)


def distance_gauge(plotter, fig, gridspec):
    """Distance from the initial parameters and update size per step (Distance, UpdateSize)."""
    return _gauge("distance", plotter, fig, gridspec)


def grad_norm_gauge(plotter, fig, gridspec):
    """Norm of the mini-batch gradient (GradNorm)."""
    return _gauge("grad_norm", plotter, fig, gridspec)


# ---- gradients -------------------------------------------------------------------------------
def gradient_tests_gauge(plotter, fig, gridspec):
    """Norm, inner-product and orthogonality tests in one panel (NormTest, InnerTest, OrthoTest)."""
    return _gauge("grad_tests", plotter, fig, gridspec)


def histogram_1d_gauge(plotter, fig, gridspec, y_scale: str = "log"):
    """Histogram of the per-sample gradient entries at the last tracked step (GradHist1d).

    Args:
        y_scale: matplotlib scale of the count axis (``"log"``, as in Cockpit, or ``"linear"``).
    """
    ax = _gauge("hist_1d", plotter, fig, gridspec)
    if y_scale != "log" and any(artist.get_gid() == "hist1d" for artist in ax.patches):
        ax.set_yscale(y_scale)
        ax.set_ylim(bottom=0)
    return ax


def histogram_2d_gauge(
    plotter, fig, gridspec, transformation: Callable | None = None, marginals: bool = True, idx: int | None = None
):
    """2-D histogram of (per-sample gradient entry, parameter value) at the last tracked step (GradHist2d).

    x: gradient entry, y: parameter value (Cockpit draws them the other way round).

    Args:
        transformation: maps the counts (an array) to the colour values;
            default ``log10(1 + counts)``. Empty bins stay blank.
        marginals: also draw the two 1-D histograms (summed counts) above and
            to the right of the joint one, with logarithmic counts.
        idx: the parameter tensor whose histogram to draw (needs
            ``GradHist2d(keep_individual=True)``); ``None``: all parameters.
    """
    data, _ = _data_and_options(plotter)
    title = "Gradient × parameter" if idx is None else f"Layer {idx}: grad × param"
    last = _drawn._last_hist(data, "GradHist2d")
    value = None if last is None else (last[1] if idx is None else last[1].get(f"param_{idx}"))
    if not isinstance(value, dict) or "hist" not in value:
        ax = _axes(fig, gridspec, "hist_2d")
        needs = ["GradHist2d"] if idx is None else ["GradHist2d(keep_individual=True)"]
        _drawn.not_tracked(ax, title, needs)
        return ax
    gid = "hist2d" if idx is None else f"hist2d:param_{idx}"
    if not marginals:
        ax = _axes(fig, gridspec, "hist_2d")
        _drawn._draw_hist_2d(ax, value, title, last[0], gid, transformation)
        return ax
    grid = gridspec.subgridspec(4, 4, wspace=0.0, hspace=0.0)
    joint = _axes(fig, grid[1:, :3], "hist_2d")
    _drawn._draw_hist_2d(joint, value, title, last[0], gid, transformation)
    joint.set_title("")
    hist = np.asarray(value["hist"], dtype=float)
    x_edges, y_edges = (np.asarray(e, dtype=float) for e in value["edges"])
    top = fig.add_subplot(grid[0, :3], sharex=joint)
    top.stairs(hist.sum(1), x_edges, fill=True, color=_drawn.COLORS["purple"], alpha=0.75, gid=f"{gid}:marginal:x")
    top.set_title(title, **_drawn._TITLE)
    right = fig.add_subplot(grid[1:, 3], sharey=joint)
    right.stairs(hist.sum(0), y_edges, orientation="horizontal", fill=True, color=_drawn.COLORS["purple"], alpha=0.75,
                 gid=f"{gid}:marginal:y")
    for margin, axis in ((top, "y"), (right, "x")):
        if hist.sum() > 0:
            (margin.set_yscale if axis == "y" else margin.set_xscale)("symlog", linthresh=1.0)
        margin.tick_params(labelbottom=False, labelleft=False, labelsize=6)
    return joint


# ---- curvature ----------------------------------------------------------------------------------
def max_ev_gauge(plotter, fig, gridspec):
    """Largest Hessian eigenvalue (HessMaxEV)."""
    return _gauge("hess_max_ev", plotter, fig, gridspec)


def trace_gauge(plotter, fig, gridspec):
    """Trace of the Hessian (diagonal), summed over the parameters (HessTrace)."""
    return _gauge("hess_trace", plotter, fig, gridspec)


def tic_gauge(plotter, fig, gridspec):
    """Takeuchi information criterion (TICDiag, TICTrace)."""
    return _gauge("tic", plotter, fig, gridspec)


def kfac_trace_gauge(plotter, fig, gridspec):
    """Trace of the Kronecker-factored curvature (KFACTrace; not in Cockpit)."""
    return _gauge("kfac_trace", plotter, fig, gridspec)


def hess_spectral_density_gauge(plotter, fig, gridspec):
    """Hessian spectral density by stochastic Lanczos quadrature, last tracked steps (HessSpectralDensity; not in Cockpit)."""
    return _gauge("hess_spectral_density", plotter, fig, gridspec)


def ekfac_spectrum_gauge(plotter, fig, gridspec):
    """Histogram of EK-FAC eigenvalues of the last tracked step, all layers and each (EKFACSpectrum; not in Cockpit)."""
    return _gauge("ekfac_spectrum", plotter, fig, gridspec)


def post_mortem_gauge(plotter, fig, gridspec):
    """The last loss-spike post-mortem: its rows by share of the step's gradient, its cause (PostMortem)."""
    return _gauge("post_mortem", plotter, fig, gridspec)


def self_influence_gauge(plotter, fig, gridspec):
    """Per-sample self-influence, batch mean and maximum per step (SelfInfluence; not in Cockpit)."""
    return _gauge("self_influence", plotter, fig, gridspec)


def preconditioned_grad_norm_gauge(plotter, fig, gridspec):
    """gᵀ(F+λI)⁻¹g next to gᵀg (PreconditionedGradNorm; not in Cockpit)."""
    return _gauge("preconditioned_grad_norm", plotter, fig, gridspec)


# ---- hyperparameters and performance ---------------------------------------------------------------
def hyperparameter_gauge(plotter, fig, gridspec):
    """Learning rate as logged with ``cockpit.log(..., learning_rate=...)``."""
    return _gauge("learning_rate", plotter, fig, gridspec)


def performance_gauge(plotter, fig, gridspec):
    """Mini-batch loss with the logged losses, and the logged accuracies beside it when there are any.

    Returns the loss axes.
    """
    data, options = _data_and_options(plotter)
    if not any(data.has(key) for key in ("train_accuracy", "valid_accuracy", "test_accuracy")):
        return _gauge("loss", plotter, fig, gridspec)
    grid = gridspec.subgridspec(1, 2, wspace=0.25, width_ratios=[1.7, 1])
    loss = _axes(fig, grid[0, 0], "loss")
    PRIMARY["loss"].draw(loss, data, options)
    accuracy = _axes(fig, grid[0, 1], "accuracy")
    PRIMARY["accuracy"].draw(accuracy, data, options)
    return loss


# ---- secondary screen ------------------------------------------------------------------------------
def mean_gsnr_gauge(plotter, fig, gridspec):
    """Mean gradient signal-to-noise ratio (MeanGSNR)."""
    return _gauge("mean_gsnr", plotter, fig, gridspec)


def cabs_gauge(plotter, fig, gridspec):
    """Batch size suggested by CABS (CABS)."""
    return _gauge("cabs", plotter, fig, gridspec)


def early_stopping_gauge(plotter, fig, gridspec):
    """Evidence-based early-stopping criterion (EarlyStopping)."""
    return _gauge("early_stopping", plotter, fig, gridspec)


def custom_gauge(plotter, fig, gridspec):
    """Every other scalar quantity, e.g. your own (not in Cockpit)."""
    return _gauge("custom", plotter, fig, gridspec)
