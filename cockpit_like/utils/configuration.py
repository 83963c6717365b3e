"""Preset sets of quantities: ``"economy"``, ``"business"`` and ``"full"``.

- economy: Alpha, Distance, GradHist1d, GradNorm, InnerTest, Loss, NormTest,
  OrthoTest, UpdateSize
- business: economy + TICDiag, HessTrace
- full: business + HessMaxEV, GradHist2d

Every quantity of a preset uses its default arguments and the same schedule,
except the curvature diagonals (HessTrace, TICDiag), which use
``curvature="auto"``: BackPACK's exact Hessian diagonal where BackPACK can
compute it on the model, else Hutchinson's estimate from Hessian-vector
products (any model; in ``full``, where HessMaxEV runs the Lanczos engine at
the same steps, Hutch++ on its space from the same products) and the GGN
diagonal for TIC; the log metadata says which.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

__all__ = ["configuration", "quantities_cls_for_configuration", "PRESETS"]

_ECONOMY = ["Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest", "OrthoTest", "UpdateSize"]
_BUSINESS = _ECONOMY + ["TICDiag", "HessTrace"]
_FULL = _BUSINESS + ["HessMaxEV", "GradHist2d"]

#: Class names of every preset, in order.
PRESETS: dict[str, list[str]] = {"economy": _ECONOMY, "business": _BUSINESS, "full": _FULL}


def quantities_cls_for_configuration(label: str) -> list[type]:
    """The quantity classes of a preset.

    Raises:
        KeyError: unknown label (the message lists the valid ones).
    """
    from cockpit_like import quantities

    if not isinstance(label, str):
        raise TypeError(
            f"configuration(label): label takes one preset name, a str, one of {sorted(PRESETS)}; got "
            f"{label!r} ({type(label).__name__}). For several presets' quantities pass one label (they nest: "
            "'full' holds 'business', which holds 'economy'); to choose quantities yourself pass "
            "Cockpit(..., quantities=[...])"
        )
    if label not in PRESETS:
        raise KeyError(
            f"unknown configuration {label!r}; choose one of {sorted(PRESETS)}"
        )
    names = PRESETS[label]
    missing = [name for name in names if not hasattr(quantities, name)]
    if missing:
        warnings.warn(
            f"configuration {label!r}: {missing} are not implemented yet in this version of "
            "cockpit_like and are left out; pass Cockpit(..., quantities=[...]) to choose the quantities yourself",
            UserWarning,
            stacklevel=2,
        )
    return [getattr(quantities, name) for name in names if name not in missing]


def configuration(
    label: str, track_schedule: Callable[[int], bool] | None = None, verbose: bool = False
) -> list:
    """Instantiated quantities of a preset, all with ``track_schedule`` (default ``linear(1)``)."""
    from cockpit_like.utils.schedules import linear

    schedule = linear(1) if track_schedule is None else track_schedule
    made = []
    for cls in quantities_cls_for_configuration(label):
        extra = {"curvature": "auto"} if cls.__name__ in _AUTO_CURVATURE else {}
        made.append(cls(track_schedule=schedule, verbose=verbose, **extra))
    return made


#: preset quantities that pick their curvature for the model
_AUTO_CURVATURE = ("HessTrace", "TICDiag", "TICTrace")
