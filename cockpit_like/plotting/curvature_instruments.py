"""Instruments of the curvature quantities: Hessian spectral density, EK-FAC spectrum, self-influence, preconditioned gradient norm.

Pure draw functions of stored data with the signature ``draw(ax, data, options)``
(:mod:`cockpit_like.plotting.instruments`); not in the fixed dashboard
layout, offered as gauges for dashboards of your own in :mod:`cockpit_like.instruments`
(``hess_spectral_density_gauge``, ``ekfac_spectrum_gauge``, ``self_influence_gauge``,
``preconditioned_grad_norm_gauge``).
"""

from __future__ import annotations

import numpy as np

from cockpit_like.plotting.data import RunData
from cockpit_like.plotting.instruments import (
    _SMALL,
    _TITLE,
    COLORS,
    SERIES_STYLES,
    DrawOptions,
    Instrument,
    _legend,
    _series_panel,
    _step_note,
    not_tracked,
)

__all__ = ["draw_hess_spectral_density", "draw_ekfac_spectrum", "draw_self_influence", "draw_preconditioned_grad_norm", "CURVATURE_INSTRUMENTS"]


#: how many earlier tracked steps the spectral density instrument draws (faded) behind the last one
_DENSITY_HISTORY = 4


def draw_hess_spectral_density(ax, data: RunData, options: DrawOptions) -> None:
    """Hessian spectral density (SLQ): the last tracked step's density, a few earlier ones faded.

    Each step's Gauss quadrature (nodes ``theta_i``, weights ``w_i``) is smoothed
    with a Gaussian of width ``2%`` of the spectral range of the drawn steps,
    ``phi(x) = sum_i w_i N(x; theta_i, width^2)``, on a log scale (the bulk near 0
    and the outliers both show). Dashed lines: the last step's extreme nodes.
    """
    title = "Hessian spectral density"
    steps, values = data.values("HessSpectralDensity")
    kept = [(s, v) for s, v in zip(steps, values) if isinstance(v, dict) and v.get("nodes")]
    if not kept:
        not_tracked(ax, title, ["HessSpectralDensity"])
        return
    kept = kept[-(_DENSITY_HISTORY + 1):]
    nodes = np.concatenate([np.asarray(v["nodes"], dtype=float) for _, v in kept])
    low, high = float(nodes.min()), float(nodes.max())
    span = max(high - low, 1e-12 * max(abs(low), abs(high), 1.0))
    width = 0.02 * span
    grid = np.linspace(low - 5 * width, high + 5 * width, 400)
    ax.set_title(title, **_TITLE)
    for index, (step, value) in enumerate(kept):
        x = np.asarray(value["nodes"], dtype=float)
        w = np.asarray(value["weights"], dtype=float)
        density = (w[None, :] * np.exp(-0.5 * ((grid[:, None] - x[None, :]) / width) ** 2)).sum(1)
        density /= width * np.sqrt(2 * np.pi)
        last = index == len(kept) - 1
        ax.plot(grid, np.maximum(density, 1e-12), color=COLORS["purple"] if last else COLORS["grey"],
                alpha=1.0 if last else 0.25 + 0.5 * index / max(len(kept), 1), linewidth=1.4 if last else 0.8,
                gid=f"density:{step}", label=f"step {step}" if last else None)  # fmt: skip
    step, value = kept[-1]
    for edge in (min(value["nodes"]), max(value["nodes"])):
        ax.axvline(edge, color=COLORS["red"], linestyle="--", linewidth=0.8, gid="density:extreme")
    _step_note(ax, step)
    ax.set_yscale("log")
    ax.set_ylim(bottom=max(1e-6, ax.get_ylim()[0]))
    ax.set_xlabel("eigenvalue", fontsize=8, labelpad=1)
    ax.set_ylabel("density", fontsize=8)
    ax.tick_params(labelsize=7.5)
    ax.grid(True, alpha=0.25, linewidth=0.6)
    _legend(ax, loc="upper right")


def draw_ekfac_spectrum(ax, data: RunData, options: DrawOptions) -> None:
    """EK-FAC eigenvalues of the last tracked step: all layers (bars) and each layer (lines), log-spaced bins."""
    title = "EK-FAC spectrum"
    last = data.last("EKFACSpectrum")
    if last is None or not isinstance(last[1], dict) or "edges" not in last[1]:
        not_tracked(ax, title, ["EKFACSpectrum"])
        return
    step, value = last
    edges = np.asarray(value["edges"], dtype=float)
    counts = np.asarray(value["counts"], dtype=float)
    ax.set_title(title, **_TITLE)
    _step_note(ax, step)
    ax.stairs(np.maximum(counts, 0.5), edges, baseline=0.5, fill=True, color=COLORS["purple"], alpha=0.5,
              gid="ekfac:all", label="all layers")  # fmt: skip
    palette = [c for k, c in COLORS.items() if k != "purple"]
    for index, (name, layer) in enumerate(list(value.get("layers", {}).items())[:6]):
        ax.stairs(np.maximum(np.asarray(layer["counts"], dtype=float), 0.5), edges, baseline=0.5,
                  color=palette[index % len(palette)], linewidth=1.2, gid=f"ekfac:{name}", label=name,
                  linestyle=SERIES_STYLES[index % len(SERIES_STYLES)][0], alpha=0.9, zorder=2.0 + 0.01 * index)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("eigenvalue", fontsize=8, labelpad=1)
    ax.set_ylabel("count", fontsize=8)
    ax.tick_params(labelsize=7.5)
    ax.grid(True, alpha=0.25, linewidth=0.6)
    if value.get("zeros"):
        ax.text(0.98, 0.97, f"{value['zeros']} ≤ 0", transform=ax.transAxes, ha="right", va="top",
                fontsize=_SMALL, color="#555555")  # fmt: skip
    _legend(ax, loc="upper left", bbox_to_anchor=(0.0, 0.9))


def draw_self_influence(ax, data: RunData, options: DrawOptions) -> None:
    """Per-sample self-influence g_iᵀ(F+λI)⁻¹g_i: batch mean and maximum per step, the top sample of the last step."""
    title = "Self-influence"
    drawn = _series_panel(
        ax, data, options, title,
        [
            ("SelfInfluence.max", *data.field("SelfInfluence", "max"), COLORS["red"], "max"),
            ("SelfInfluence.mean", *data.field("SelfInfluence", "mean"), COLORS["blue"], "mean"),
        ],
        ["SelfInfluence"], "gᵢᵀ(F+λI)⁻¹gᵢ",
    )  # fmt: skip
    if not drawn:
        return
    last = data.last("SelfInfluence")
    if last is not None and isinstance(last[1], dict) and last[1].get("top"):
        top = last[1]["top"][0]
        ax.text(0.02, 0.97, f"step {last[0]}: top id {top['id']}", transform=ax.transAxes, ha="left", va="top",
                fontsize=_SMALL, color="#555555")  # fmt: skip
    _legend(ax, loc="best")


def draw_preconditioned_grad_norm(ax, data: RunData, options: DrawOptions) -> None:
    """gᵀ(F+λI)⁻¹g (KFAC / EK-FAC), with gᵀg for comparison."""
    _series_panel(
        ax, data, options, "Preconditioned gradient norm",
        [
            ("PreconditionedGradNorm", *data.field("PreconditionedGradNorm", "value"), COLORS["green"], "gᵀ(F+λI)⁻¹g"),
            ("PreconditionedGradNorm.plain", *data.field("PreconditionedGradNorm", "grad_norm_squared"),
             COLORS["grey"], "gᵀg"),
        ],
        ["PreconditionedGradNorm"], "value",
    )  # fmt: skip
    _legend(ax, loc="best")


CURVATURE_INSTRUMENTS: dict[str, Instrument] = {
    instrument.key: instrument
    for instrument in (
        Instrument("hess_spectral_density", "Hessian spectral density", ("HessSpectralDensity",),
                   draw_hess_spectral_density),  # fmt: skip
        Instrument("ekfac_spectrum", "EK-FAC spectrum", ("EKFACSpectrum",), draw_ekfac_spectrum),
        Instrument("self_influence", "Self-influence", ("SelfInfluence",), draw_self_influence),
        Instrument("preconditioned_grad_norm", "Preconditioned gradient norm", ("PreconditionedGradNorm",),
                   draw_preconditioned_grad_norm),  # fmt: skip
    )
}
