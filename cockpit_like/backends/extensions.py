"""Merging BackPACK extensions by value.

Two extensions are the same need when they have the same type *and* the same
hyperparameters (``DiagGGNMC(mc_samples=1)`` twice is one need). Two of the
same type with different hyperparameters write to the same field of the
parameters and cannot run in one backward pass: that is a conflict, and it
raises.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ExtensionConflictError", "extension_key", "describe", "merge_extensions"]

# Attributes of BackPACK extension objects that are machinery, not settings.
_MACHINERY = {"saved_quantities", "_BackpropExtension__module_extensions", "_BackpropExtension__get_module_extension"}
_HIDDEN_DEFAULTS = {"subsampling": None}


class ExtensionConflictError(ValueError):
    """Two requested BackPACK extensions of one type disagree on hyperparameters."""


def _hyperparameters(extension: Any) -> tuple[tuple[str, Any], ...]:
    items = []
    for name, value in sorted(vars(extension).items()):
        if name in _MACHINERY:
            continue
        if isinstance(value, (bool, int, float, str, type(None), tuple)):
            items.append((name.lstrip("_"), value))
        else:
            items.append((name.lstrip("_"), repr(value)))
    return tuple(items)


def extension_key(extension: Any) -> tuple[type, tuple]:
    """Hashable identity of an extension: its type and its hyperparameters."""
    return type(extension), _hyperparameters(extension)


def describe(extension: Any) -> str:
    """Readable ``Type(hyper=value, ...)``, leaving out BackPACK's bookkeeping fields."""
    shown = [
        f"{name}={value!r}"
        for name, value in _hyperparameters(extension)
        if name not in ("savefield", "fail_mode") and _HIDDEN_DEFAULTS.get(name, object()) != value
    ]
    return f"{type(extension).__name__}({', '.join(shown)})"


def merge_extensions(requests: list[tuple[str, Any]]) -> list[Any]:
    """One extension per distinct need, in first-requested order.

    Args:
        requests: ``(requested_by, extension)`` pairs.

    Raises:
        ExtensionConflictError: two extensions of one type differ in hyperparameters.
    """
    by_type: dict[type, tuple[str, Any, tuple]] = {}
    merged = []
    for owner, extension in requests:
        if isinstance(extension, type):
            raise TypeError(
                f"{owner} passed the class {extension.__name__}; BackPACK needs an "
                f"instance, e.g. {extension.__name__}()"
            )
        key = extension_key(extension)
        seen = by_type.get(key[0])
        if seen is None:
            by_type[key[0]] = (owner, extension, key)
            merged.append(extension)
        elif seen[2] != key:
            raise ExtensionConflictError(
                f"conflicting BackPACK extensions at one step: {seen[0]} asks for "
                f"{describe(seen[1])}, {owner} asks for {describe(extension)}. Both write "
                f"to the same parameter field; use the same hyperparameters, or track "
                "these quantities at different steps."
            )
    return merged
