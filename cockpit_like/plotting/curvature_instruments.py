"""Instruments of the logged-curvature quantities: EK-FAC spectrum, self-influence, preconditioned gradient norm.

Pure draw functions of stored data with the signature ``draw(ax, data, options)``
(:mod:`cockpit_like.plotting.instruments`); not in the fixed dashboard
layout, offered as gauges for dashboards of your own in :mod:`cockpit_like.instruments`
(``ekfac_spectrum_gauge``, ``self_influence_gauge``, ``preconditioned_grad_norm_gauge``).
"""

from __future__ import annotations

import numpy as np

from cockpit_like.plotting.data import RunData
from cockpit_like.plotting.instruments import (
    _SMALL,
    _TITLE,
    COLORS,
    DrawOptions,
    Instrument,
    _legend,
    _series_panel,
    _step_note,
    not_tracked,
)

__all__ = ["draw_ekfac_spectrum", "draw_self_influence", "draw_preconditioned_grad_norm", "CURVATURE_INSTRUMENTS"]


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
                  color=palette[index % len(palette)], linewidth=1.0, gid=f"ekfac:{name}", label=name)  # fmt: skip
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
        Instrument("ekfac_spectrum", "EK-FAC spectrum", ("EKFACSpectrum",), draw_ekfac_spectrum),
        Instrument("self_influence", "Self-influence", ("SelfInfluence",), draw_self_influence),
        Instrument("preconditioned_grad_norm", "Preconditioned gradient norm", ("PreconditionedGradNorm",),
                   draw_preconditioned_grad_norm),  # fmt: skip
    )
}
