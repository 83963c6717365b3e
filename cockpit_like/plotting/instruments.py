"""The instruments: pure draw functions of stored data.

Every instrument has the signature ``draw(ax, data, options)``: it reads a
:class:`~cockpit_like.plotting.data.RunData`, draws on one matplotlib axes
(already cleared by the caller) and touches nothing else. An instrument whose
quantity was not tracked draws a blank panel saying "not tracked" and which
quantity to add.

Artists carry ``gid`` tags so that tests (and curious users) can find what
was drawn: ``"raw:<name>"`` for the raw points of a time series (one point
per tracked step), ``"smooth:<name>"`` for its smoothed curve,
``"nonfinite:<name>:<kind>"`` (kind ``NaN``, ``inf``, ``-inf``) for the marks at
the steps where the series is not finite (:func:`mark_nonfinite`), and
``"not-tracked"`` for the blank-panel label.

Series that share a panel differ by more than colour (:func:`series_style`):
each has its own line style and an open marker every few points, staggered,
slightly transparent, drawn first to last from the bottom up; so two series
with (nearly) the same values stay visible, and tell apart in the legend,
also in grey-scale print.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cockpit_like.plotting.data import RunData, smooth
from cockpit_like.plotting.findings_panel import draw_findings

__all__ = ["DrawOptions", "Instrument", "PRIMARY", "SECONDARY", "layer_histogram", "mark_nonfinite"]

COLORS = {
    "blue": "#1f77b4",
    "orange": "#ff7f0e",
    "green": "#2ca02c",
    "red": "#d62728",
    "purple": "#9467bd",
    "brown": "#8c564b",
    "grey": "#7f7f7f",
}
_TITLE = {"fontsize": 10, "fontweight": "bold"}
_SMALL = 7.5

#: (line style, marker) of the series of one panel, in drawing order: the first is solid, the later ones have
#: gaps through which the earlier ones show where they coincide
SERIES_STYLES = (
    ("-", "o"),
    ("--", "s"),
    ("-.", "^"),
    (":", "D"),
    ((0, (6, 2, 1, 2, 1, 2)), "v"),
    ((0, (1, 3)), "P"),
)


def series_style(index: int, count: int, points: int) -> dict:
    """``Axes.plot`` keywords of series ``index`` of the ``count`` series of one panel (``points`` long).

    One series alone keeps a plain solid line. Several get :data:`SERIES_STYLES`
    (by index), an open marker every ``points // 8`` points, offset by series
    so that the markers of equal series do not cover each other, alpha 0.9,
    and a z-order that grows with the index.
    """
    if count < 2:
        return {}
    linestyle, marker = SERIES_STYLES[index % len(SERIES_STYLES)]
    every = max(1, points // 8)
    return {"linestyle": linestyle, "marker": marker, "markevery": ((index * every) // count, every),
            "markersize": 4.5, "markerfacecolor": "none", "markeredgewidth": 1.1, "alpha": 0.9,
            "zorder": 2.0 + 0.01 * index}


@dataclass(frozen=True)
class DrawOptions:
    """How time series are drawn.

    Attributes:
        log_iter: logarithmic step axis (``show_log_iter``).
        recent_fraction: share of the most recent Alpha values shown apart.
    """

    log_iter: bool = False
    recent_fraction: float = 0.1


@dataclass(frozen=True)
class Instrument:
    """One panel: a key, its title, the quantities it reads, and its draw function."""

    key: str
    title: str
    quantities: tuple[str, ...]
    draw: Callable


# ---- shared pieces ---------------------------------------------------------------
def not_tracked(ax, title: str, needs: Sequence[str], message: str | None = None) -> None:
    """A blank, labelled panel for an instrument without data."""
    ax.set_title(title, **_TITLE)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_facecolor("#f4f4f4")
    for spine in ax.spines.values():
        spine.set_color("#cccccc")
    # (no values: the quantity is not tracked, or none of its steps stored one yet: steps that failed a self-check
    # store nothing, and a two-step quantity's first value comes at its second step)
    hint = message or ("add " + " / ".join(needs) + " to track it, or no step stored one yet (cockpit.checks)")
    ax.text(
        0.5, 0.55, "not tracked", transform=ax.transAxes, ha="center", va="center",
        fontsize=11, color="#888888", gid="not-tracked",
    )
    ax.text(0.5, 0.38, _wrapped(ax, hint, _SMALL), transform=ax.transAxes, ha="center", va="center", fontsize=_SMALL,
            color="#999999", clip_on=True)


def _wrapped(ax, text: str, fontsize: float) -> str:
    """``text`` broken into lines that fit the panel's width (matplotlib's ``wrap=True`` wraps at the figure's
    edge, so a hint ran into the neighbouring panels: outside trial 9): about 0.55 em per character."""
    import textwrap

    figure = ax.get_figure()
    width = ax.get_position().width * figure.get_figwidth() * 72.0 * 0.9  # points, with a margin
    columns = max(12, int(width / (0.55 * fontsize)))
    return textwrap.fill(text, columns)


def _step_axis(ax, options: DrawOptions, label: bool = True) -> None:
    if options.log_iter:
        ax.set_xscale("symlog", linthresh=1.0, linscale=0.4)
    if label:
        ax.set_xlabel("step", fontsize=8, labelpad=1)
    ax.tick_params(labelsize=7.5)
    ax.grid(True, alpha=0.25, linewidth=0.6)


def _log_if_positive(ax, *arrays: np.ndarray) -> None:
    """Log y-axis when the values are non-negative and span more than two decades.

    Zeros (e.g. the distance at the reference step) are left out of the log plot.
    """
    finite = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.array([])
    positive = finite[finite > 0]
    if positive.size > 1 and np.all(finite >= 0) and positive.max() / positive.min() > 100:
        ax.set_yscale("log", nonpositive="mask")


#: The kinds of non-finite values: (name, test, marker, height in the axes (0 bottom, 1 top))
NONFINITE_KINDS = (
    ("NaN", np.isnan, "X", 0.93),
    ("inf", np.isposinf, "^", 0.93),
    ("-inf", np.isneginf, "v", 0.07),
)


def mark_nonfinite(ax, name: str, steps: np.ndarray, values: np.ndarray, color: str,
                   label: str | None = None) -> int:
    """Mark the steps where ``values`` is NaN, inf or -inf; return how many there are.

    A line, a point and a dot are not drawn for a non-finite value, so such a
    step would be invisible. Each kind gets, at its steps, a dotted vertical
    line across the panel (gid ``"nonfinite-line:<name>:<kind>"``), a marker
    near the top (NaN: a cross, inf: a triangle up) or the bottom (-inf: a
    triangle down) with a legend entry ``"<label>: NaN (k steps)"`` (gid
    ``"nonfinite:<name>:<kind>"``), and the text ``NaN`` / ``inf`` / ``-inf``
    (``x k`` for several) beside its first step. The marks use the axes'
    height, so they leave the y range (and a log scale) alone.
    """
    values = np.asarray(values, dtype=float)
    steps = np.asarray(steps, dtype=float)
    label = label or name
    across = ax.get_xaxis_transform()  # x in steps, y in the axes' height
    total = 0
    for kind, test, marker, height in NONFINITE_KINDS:
        where = test(values)
        count = int(where.sum())
        if not count:
            continue
        total += count
        at = steps[where]
        from matplotlib.collections import LineCollection

        ax.add_collection(LineCollection([[(x, 0.0), (x, 1.0)] for x in at], transform=across, colors=color,
                                         linestyles=":", linewidths=1.0, alpha=0.7, zorder=1.5,
                                         gid=f"nonfinite-line:{name}:{kind}"), autolim=False)
        ax.plot(at, np.full(count, height), transform=across, linestyle="none", marker=marker, markersize=5.5,
                color=color, markeredgecolor="black", markeredgewidth=0.5, clip_on=False, zorder=6,
                gid=f"nonfinite:{name}:{kind}", label=f"{label}: {kind} ({count} step{'s' if count > 1 else ''})")
        ax.annotate(kind + (f" ×{count}" if count > 1 else ""), (at[0], height), xycoords=across,
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=_SMALL, color=color,
                    fontweight="bold", gid=f"nonfinite-label:{name}:{kind}")
    return total


def timeseries(ax, name: str, steps: np.ndarray, values: np.ndarray, color: str, label: str | None = None,
               smoothed: bool = True, style: dict | None = None) -> None:
    """Raw points (one per tracked step), a smoothed curve (``style``: :func:`series_style`) that breaks at
    non-finite values, and the marks of those (:func:`mark_nonfinite`)."""
    label = label or name
    style = {"linewidth": 1.6, **(style or {})}
    ax.plot(steps, values, linestyle="none", marker=".", markersize=3, alpha=0.35, color=color, gid=f"raw:{name}",
            zorder=style.get("zorder", 2.0))
    if smoothed and len(values) > 1:
        ax.plot(steps, smooth(values), color=color, label=label, gid=f"smooth:{name}", **style)
    else:
        ax.plot([], [], color=color, label=label, **{k: v for k, v in style.items() if k != "markevery"})
    mark_nonfinite(ax, name, steps, values, color, label)


def _legend(ax, **kwargs) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=_SMALL, framealpha=0.8, borderpad=0.3, handlelength=1.4, **kwargs)


def _has_finite(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).any())


def _error_band(ax, data: RunData, name: str, steps: np.ndarray, values: np.ndarray, color: str,
                first: bool) -> list[np.ndarray]:
    """Shade ``value ± 2`` standard errors where the log keeps them beside ``name`` (estimated values: Hutchinson,
    Hutch++, sketched TIC); returns the band's lower edge ([] where there is none)."""
    errors = data.standard_errors(name, steps)
    shown = np.isfinite(errors) & np.isfinite(values)
    if not shown.any():
        return []
    low, high = values - 2 * errors, values + 2 * errors
    ax.fill_between(steps, low, high, where=shown, color=color, alpha=0.15, linewidth=0, gid=f"band:{name}",
                    label="± 2 standard errors" if first else None, zorder=1.0)
    return [low[shown]]


def _series_panel(ax, data: RunData, options: DrawOptions, title: str, curves, needs, ylabel: str,
                  logy: bool = True) -> bool:
    """Draw several curves ``(name, steps, values, color, label)``; False if none has data."""
    curves = [c for c in curves if len(c[1])]
    if not curves:
        not_tracked(ax, title, needs)
        return False
    ax.set_title(title, **_TITLE)
    bands = []
    for index, (name, steps, values, color, label) in enumerate(curves):
        timeseries(ax, name, steps, values, color, label, style=series_style(index, len(curves), len(steps)))
        bands += _error_band(ax, data, name, steps, values, color, first=not bands)
    if logy:  # a band that reaches 0 (the sign not certain) keeps the axis linear
        _log_if_positive(ax, *[c[2] for c in curves], *bands)
    ax.set_ylabel(ylabel, fontsize=8)
    _step_axis(ax, options)
    if not any(_has_finite(c[2]) for c in curves):
        ax.text(0.5, 0.5, "no finite values", transform=ax.transAxes, ha="center", color=COLORS["grey"])
    return True


# ---- step size -----------------------------------------------------------------------
def draw_alpha(ax, data: RunData, options: DrawOptions) -> None:
    """Distribution of the normalized step size over the quadratic it stands for.

    In normalized coordinates the step starts at -1 on the parabola ``x^2``,
    the fitted minimum is at 0 and the mirrored point at +1; ``alpha`` is where
    the step landed: < 0 undershoots the minimum, > 0 overshoots it.
    """
    title = "Step size α (normalized)"
    steps, values = data.scalar("Alpha")
    if not len(steps):
        not_tracked(ax, title, ["Alpha"])
        return
    ax.set_title(title, **_TITLE)
    finite = values[np.isfinite(values)]
    limit = 1.5
    if finite.size:
        limit = float(np.clip(1.15 * np.quantile(np.abs(finite), 0.95), 1.5, 10.0))
    x = np.linspace(-limit, limit, 200)
    top = limit**2
    ax.axvspan(-limit, 0, color=COLORS["blue"], alpha=0.07, linewidth=0)
    ax.axvspan(0, limit, color=COLORS["red"], alpha=0.07, linewidth=0)
    ax.plot(x, x**2, color="#444444", linewidth=1.2, gid="alpha:parabola")
    ax.plot([-1], [1], marker="o", color="#444444", markersize=4, linestyle="none")
    ax.annotate("start", (-1, 1), xytext=(4, -10), textcoords="offset points", fontsize=_SMALL, color="#444444")
    ax.axvline(0, color="#444444", linewidth=0.8, linestyle=":")
    ax.text(0.02, 0.97, "◀ undershoot\n(step too short)", transform=ax.transAxes, ha="left", va="top",
            fontsize=_SMALL, color=COLORS["blue"])
    ax.text(0.98, 0.97, "overshoot ▶\n(step too long)", transform=ax.transAxes, ha="right", va="top",
            fontsize=_SMALL, color=COLORS["red"])
    if finite.size:
        bins = np.linspace(-limit, limit, 31)
        recent_count = max(1, int(round(options.recent_fraction * finite.size)))
        recent = finite[-recent_count:]
        scale = 0.55 * top
        for subset, color, name, fill in (
            (finite, COLORS["grey"], "all", True),
            (recent, COLORS["orange"], f"last {recent_count}", False),
        ):
            counts, _ = np.histogram(np.clip(subset, -limit, limit), bins=bins)
            heights = counts / counts.max() * scale if counts.max() > 0 else counts.astype(float)
            ax.stairs(heights, bins, fill=fill, alpha=0.45 if fill else 1.0, color=color, linewidth=1.6,
                      label=f"{name}: median {np.median(subset):+.2f}", gid=f"alpha:{name.split()[0]}")
    outside = int(np.sum(np.abs(finite) > limit))
    note = f"{len(steps)} fits"
    if outside:
        note += f", {outside} beyond ±{limit:.1f} in end bins"
    for kind, test, _, _ in NONFINITE_KINDS:
        if test(values).any():
            note += f", {int(test(values).sum())} {kind}"
    ax.set_xlim(-limit, limit)
    ax.set_ylim(0, 1.35 * top)
    ax.set_yticks([])
    ax.set_xlabel("α: where the step landed (0 = minimum of the fitted parabola)", fontsize=8, labelpad=1)
    ax.tick_params(labelsize=7.5)
    _legend(ax, loc="upper center", bbox_to_anchor=(0.5, 0.99), title=note, title_fontsize=_SMALL)


def draw_distance(ax, data: RunData, options: DrawOptions) -> None:
    """Distance from the initial parameters and size of each update (norms over all parameters)."""
    _series_panel(
        ax, data, options, "Distance & update size",
        [
            ("Distance", *data.block_norm("Distance"), COLORS["blue"], "‖θₜ − θ₀‖ distance"),
            ("UpdateSize", *data.block_norm("UpdateSize"), COLORS["orange"], "‖θₜ₊₁ − θₜ‖ update"),
        ],
        ["Distance", "UpdateSize"], "L2 norm",
    )
    _legend(ax, loc="best")


def draw_grad_norm(ax, data: RunData, options: DrawOptions) -> None:
    """Norm of the mini-batch gradient over all parameters."""
    _series_panel(
        ax, data, options, "Gradient norm",
        [("GradNorm", *data.block_norm("GradNorm"), COLORS["green"], "‖∇L‖")],
        ["GradNorm"], "‖∇L‖",
    )
    _legend(ax, loc="best")


# ---- gradients -------------------------------------------------------------------------
def draw_gradient_tests(ax, data: RunData, options: DrawOptions) -> None:
    """Norm, inner-product and orthogonality tests: noise relative to the mean gradient."""
    drawn = _series_panel(
        ax, data, options, "Gradient tests",
        [
            ("NormTest", *data.scalar("NormTest"), COLORS["blue"], "norm"),
            ("InnerTest", *data.scalar("InnerTest"), COLORS["orange"], "inner product"),
            ("OrthoTest", *data.scalar("OrthoTest"), COLORS["green"], "orthogonality"),
        ],
        ["NormTest", "InnerTest", "OrthoTest"], "test value", logy=False,
    )
    if drawn:
        ax.axhline(1.0, color=COLORS["red"], linewidth=0.9, linestyle="--", label="1: noise ≈ signal")
        _legend(ax, loc="upper right", ncol=2)


def _step_note(ax, step: int, color: str = "#555555") -> None:
    ax.text(0.02, 0.97, f"step {step}", transform=ax.transAxes, ha="left", va="top", fontsize=_SMALL, color=color,
            zorder=5)


def _last_hist(data: RunData, name: str):
    last = data.last(name)
    if last is None or not isinstance(last[1], dict) or "hist" not in last[1]:
        return None
    return last[0], last[1]


def draw_hist_1d(ax, data: RunData, options: DrawOptions) -> None:
    """Histogram of all per-sample gradient entries at the last tracked step (log counts)."""
    title = "Gradient element histogram"
    last = _last_hist(data, "GradHist1d")
    if last is None:
        not_tracked(ax, title, ["GradHist1d"])
        return
    step, value = last
    hist = np.asarray(value["hist"], dtype=float)
    edges = np.asarray(value["edges"], dtype=float)
    ax.set_title(title, **_TITLE)
    _step_note(ax, step)
    ax.stairs(np.maximum(hist, 0.5), edges, baseline=0.5, fill=True, color=COLORS["purple"], alpha=0.75,
              gid="hist1d")
    ax.set_yscale("log")
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel("per-sample gradient element gᵢⱼ", fontsize=8, labelpad=1)
    ax.set_ylabel("count", fontsize=8)
    ax.tick_params(labelsize=7.5)
    ax.grid(True, alpha=0.25, linewidth=0.6)
    total = hist.sum()
    if total > 0:
        edge_share = (hist[0] + hist[-1]) / total
        ax.text(0.98, 0.97, f"end bins\n{edge_share:.1%}", transform=ax.transAxes,
                ha="right", va="top", fontsize=_SMALL, color="#555555")


def _log_counts(hist: np.ndarray) -> np.ndarray:
    return np.log10(1.0 + hist)


def _draw_hist_2d(ax, value: dict, title: str, step: int, gid: str, transform: Callable | None = None) -> None:
    """``transform(counts)`` (default ``log10(1 + counts)``) as colours; empty bins left blank."""
    hist = np.asarray(value["hist"], dtype=float)
    x_edges, y_edges = (np.asarray(e, dtype=float) for e in value["edges"])
    shown = np.asarray((transform or _log_counts)(hist), dtype=float)
    ax.set_title(title, **_TITLE)
    _step_note(ax, step, color="#333333")
    ax.pcolormesh(x_edges, y_edges, np.ma.masked_where(hist.T == 0, shown.T), cmap="magma_r", shading="flat", gid=gid,
                  rasterized=True)
    ax.axvline(0, color="#999999", linewidth=0.6)
    ax.set_xlabel("per-sample gradient element", fontsize=8, labelpad=1)
    ax.set_ylabel("parameter value", fontsize=8)
    ax.tick_params(labelsize=7.5)


def draw_hist_2d(ax, data: RunData, options: DrawOptions) -> None:
    """2-D histogram of (per-sample gradient entry, parameter value) pairs, log10(1 + count)."""
    title = "Gradient × parameter"
    last = _last_hist(data, "GradHist2d")
    if last is None:
        not_tracked(ax, title, ["GradHist2d"])
        return
    _draw_hist_2d(ax, last[1], title, last[0], "hist2d")


def layer_histogram(index: int) -> Instrument:
    """The 2-D histogram of parameter block ``index`` (needs ``GradHist2d(keep_individual=True)``)."""

    def draw(ax, data: RunData, options: DrawOptions) -> None:
        title = f"Layer {index}: grad × param"
        last = _last_hist(data, "GradHist2d")
        value = None if last is None else last[1].get(f"param_{index}")
        if not isinstance(value, dict) or "hist" not in value:
            not_tracked(ax, title, ["GradHist2d(keep_individual=True)"])
            return
        _draw_hist_2d(ax, value, title, last[0], f"hist2d:param_{index}")

    return Instrument(f"layer_hist_{index}", f"Layer {index}: grad × param", ("GradHist2d",), draw)


# ---- curvature ----------------------------------------------------------------------------
def draw_hess_max_ev(ax, data: RunData, options: DrawOptions) -> None:
    """Largest Hessian eigenvalue (sharpness); a stable GD step needs lr < 2 / λmax."""
    _series_panel(
        ax, data, options, "Top Hessian eigenvalue",
        [("HessMaxEV", *data.scalar("HessMaxEV"), COLORS["red"], "λmax (sharpness)")],
        ["HessMaxEV"], "λmax",
    )
    _legend(ax, loc="best")


def draw_hess_trace(ax, data: RunData, options: DrawOptions) -> None:
    """Trace of the (diagonal) Hessian, summed over all parameters."""
    _series_panel(
        ax, data, options, "Hessian trace",
        [("HessTrace", *data.block_sum("HessTrace"), COLORS["brown"], "tr ∇²L")],
        ["HessTrace"], "trace",
    )
    _legend(ax, loc="best")


def draw_kfac_trace(ax, data: RunData, options: DrawOptions) -> None:
    """Trace (and Frobenius norm) of the Kronecker-factored curvature, over all parameters."""
    _series_panel(
        ax, data, options, "KFAC trace",
        [
            ("KFACTrace", *data.field("KFACTrace", "trace_total"), COLORS["purple"], "tr(G⊗A)"),
            ("KFACTrace.frobenius", *data.field("KFACTrace", "frobenius_total"), COLORS["grey"], "‖G⊗A‖F"),
        ],
        ["KFACTrace"], "value",
    )
    _legend(ax, loc="best")


def draw_tic(ax, data: RunData, options: DrawOptions) -> None:
    """Takeuchi information criterion: gradient noise over curvature (higher = worse generalization)."""
    _series_panel(
        ax, data, options, "TIC",
        [
            ("TICDiag", *data.scalar("TICDiag"), COLORS["blue"], "diagonal"),
            ("TICTrace", *data.scalar("TICTrace"), COLORS["orange"], "trace"),
        ],
        ["TICDiag", "TICTrace"], "TIC",
    )
    _legend(ax, loc="best")


# ---- hyperparameters and performance --------------------------------------------------------
def draw_learning_rate(ax, data: RunData, options: DrawOptions) -> None:
    """Learning rate as logged with ``cockpit.log(..., learning_rate=...)``, else as tracked by the
    ``LearningRate`` quantity (one value per tracked step; one rate for all parameter groups)."""
    title = "Learning rate"
    steps, values = data.scalar("learning_rate")
    if not len(steps):  # the quantity stores a list where the groups' rates differ: those steps are left out
        tracked, raw = data.values("LearningRate")
        keep = [isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in raw]
        steps = np.asarray([s for s, k in zip(tracked, keep) if k], dtype=float)
        values = np.asarray([v for v, k in zip(raw, keep) if k], dtype=float)
    if not len(steps):
        not_tracked(ax, title, [], "pass learning_rate= to cockpit.log(...)\nor track LearningRate")
        return
    ax.set_title(title, **_TITLE)
    ax.plot(steps, values, drawstyle="steps-post", marker=".", markersize=4, color=COLORS["blue"],
            gid="raw:learning_rate")
    if mark_nonfinite(ax, "learning_rate", steps, values, COLORS["blue"], "lr"):
        _legend(ax, loc="best")
    _log_if_positive(ax, values)
    ax.set_ylabel("lr", fontsize=8)
    _step_axis(ax, options)


def draw_loss(ax, data: RunData, options: DrawOptions) -> None:
    """Mini-batch loss (raw and smoothed) with the epoch losses from ``cockpit.log``."""
    title = "Loss"
    steps, values = data.scalar("Loss")
    logged = [(key, *data.scalar(key)) for key in ("train_loss", "valid_loss", "test_loss")]
    logged = [entry for entry in logged if len(entry[1])]
    if not len(steps) and not logged:
        not_tracked(ax, title, ["Loss"], "add Loss, or pass train_loss= to cockpit.log(...)")
        return
    ax.set_title(title, **_TITLE)
    count = int(bool(len(steps))) + len(logged)
    if len(steps):
        timeseries(ax, "Loss", steps, values, COLORS["grey"], "mini-batch loss", style=series_style(0, count, len(steps)))
    colors = {"train_loss": COLORS["blue"], "valid_loss": COLORS["orange"], "test_loss": COLORS["green"]}
    for index, (key, key_steps, key_values) in enumerate(logged, start=count - len(logged)):
        _logged_line(ax, key, key_steps, key_values, colors[key], key.replace("_", " "), index, count)
    _log_if_positive(ax, values, *[entry[2] for entry in logged])
    ax.set_ylabel("loss", fontsize=8)
    _step_axis(ax, options)
    _legend(ax, loc="best")


def _logged_line(ax, key: str, steps: np.ndarray, values: np.ndarray, color: str, label: str, index: int,
                 count: int) -> None:
    """A figure of ``cockpit.log``: a point per logged step, joined; several in a panel as :func:`series_style`."""
    style = {"marker": "o", "markersize": 3.5, "linewidth": 1.4}
    if count > 1:
        style.update(series_style(index, count, len(steps)), markevery=1)  # few points: mark each
    ax.plot(steps, values, color=color, label=label, gid=f"raw:{key}", **style)
    mark_nonfinite(ax, key, steps, values, color, label)


def draw_accuracy(ax, data: RunData, options: DrawOptions) -> None:
    """Accuracies from ``cockpit.log(..., train_accuracy=..., valid_accuracy=..., test_accuracy=...)``."""
    title = "Accuracy"
    colors = {"train_accuracy": COLORS["blue"], "valid_accuracy": COLORS["orange"], "test_accuracy": COLORS["green"]}
    logged = [(key, *data.scalar(key)) for key in colors]
    logged = [entry for entry in logged if len(entry[1])]
    if not logged:
        not_tracked(ax, title, [], "pass train_accuracy= / valid_accuracy= to cockpit.log(...)")
        return
    ax.set_title(title, **_TITLE)
    for index, (key, key_steps, key_values) in enumerate(logged):
        _logged_line(ax, key, key_steps, key_values, colors[key], key.split("_")[0], index, len(logged))
    ax.set_ylabel("accuracy", fontsize=8)
    _step_axis(ax, options)
    _legend(ax, loc="lower right")


# ---- secondary screen --------------------------------------------------------------------------
def draw_mean_gsnr(ax, data: RunData, options: DrawOptions) -> None:
    """Mean gradient signal-to-noise ratio per entry (higher = cleaner gradient)."""
    _series_panel(
        ax, data, options, "Mean GSNR",
        [("MeanGSNR", *data.scalar("MeanGSNR"), COLORS["green"], "mean ḡ²/var(g)")],
        ["MeanGSNR"], "GSNR",
    )
    _legend(ax, loc="best")


def draw_cabs(ax, data: RunData, options: DrawOptions) -> None:
    """CABS: the batch size that the gradient noise suggests for the current lr."""
    _series_panel(
        ax, data, options, "CABS batch size",
        [("CABS", *data.scalar("CABS"), COLORS["brown"], "suggested batch size")],
        ["CABS"], "batch size",
    )
    _legend(ax, loc="best")


def draw_early_stopping(ax, data: RunData, options: DrawOptions) -> None:
    """Evidence-based early stopping criterion: stop once it stays above 0."""
    drawn = _series_panel(
        ax, data, options, "Early stopping",
        [("EarlyStopping", *data.scalar("EarlyStopping"), COLORS["red"], "criterion")],
        ["EarlyStopping"], "criterion", logy=False,
    )
    if drawn:
        ax.axhline(0.0, color="#444444", linewidth=0.9, linestyle="--", label="> 0: stop training")
        _legend(ax, loc="best")


def draw_custom(ax, data: RunData, options: DrawOptions) -> None:
    """Every other scalar quantity (e.g. your own), one curve each."""
    names = data.custom_scalars()
    palette = list(COLORS.values())
    curves = [(name, *data.scalar(name), palette[i % len(palette)], name) for i, name in enumerate(names[:6])]
    _series_panel(ax, data, options, "Other quantities", curves, ["a custom scalar quantity"], "value")
    _legend(ax, loc="best")


PRIMARY: dict[str, Instrument] = {
    instrument.key: instrument
    for instrument in (
        Instrument("alpha", "Step size α (normalized)", ("Alpha",), draw_alpha),
        Instrument("distance", "Distance & update size", ("Distance", "UpdateSize"), draw_distance),
        Instrument("grad_norm", "Gradient norm", ("GradNorm",), draw_grad_norm),
        Instrument("grad_tests", "Gradient tests", ("NormTest", "InnerTest", "OrthoTest"), draw_gradient_tests),
        Instrument("hist_1d", "Gradient element histogram", ("GradHist1d",), draw_hist_1d),
        Instrument("hist_2d", "Gradient × parameter", ("GradHist2d",), draw_hist_2d),
        Instrument("hess_max_ev", "Top Hessian eigenvalue", ("HessMaxEV",), draw_hess_max_ev),
        Instrument("hess_trace", "Hessian trace", ("HessTrace",), draw_hess_trace),
        Instrument("kfac_trace", "KFAC trace", ("KFACTrace",), draw_kfac_trace),
        Instrument("tic", "TIC", ("TICDiag", "TICTrace"), draw_tic),
        Instrument("learning_rate", "Learning rate", ("learning_rate",), draw_learning_rate),
        Instrument("loss", "Loss", ("Loss", "train_loss", "valid_loss", "test_loss"), draw_loss),
        Instrument("accuracy", "Accuracy", ("train_accuracy", "valid_accuracy", "test_accuracy"), draw_accuracy),
        Instrument("findings", "Check engine", ("findings",), draw_findings),
    )
}

SECONDARY: dict[str, Instrument] = {
    instrument.key: instrument
    for instrument in (
        Instrument("mean_gsnr", "Mean GSNR", ("MeanGSNR",), draw_mean_gsnr),
        Instrument("cabs", "CABS batch size", ("CABS",), draw_cabs),
        Instrument("early_stopping", "Early stopping", ("EarlyStopping",), draw_early_stopping),
        Instrument("custom", "Other quantities", (), draw_custom),
    )
}
