"""Warnings the user cannot act on, hidden while a cockpit step is open (and only those).

PyTorch warns ``"Full backward hook is firing when gradients are computed
with respect to module outputs since no inputs require gradients"`` from
``torch/utils/hooks.py`` whenever a module with a full backward hook gets no
input that requires a gradient. BackPACK's ``extend`` registers such a hook
on every layer, and the first layer's input is data, so every ``extend``-ed
model triggers it at its first backward pass. Nothing is wrong (BackPACK
reads the gradient of the layer's output, which exists) and nothing can be
done about it, so while a step is open (from :meth:`Cockpit.begin` to the
end of :meth:`Cockpit.end`: the user's backward pass and the cockpit's own
work) this one message is ignored. Any other warning, and this one outside
a tracked step, is shown as usual.

Only the standard library is imported here.
"""

from __future__ import annotations

import re
import warnings

__all__ = ["FULL_BACKWARD_HOOK_MESSAGE", "QuietStep"]

#: the start of PyTorch's message (``torch.utils.hooks.BackwardHook``)
FULL_BACKWARD_HOOK_MESSAGE = (
    "Full backward hook is firing when gradients are computed with respect to module outputs since no inputs "
    "require gradients"
)


class QuietStep:
    """Ignores :data:`FULL_BACKWARD_HOOK_MESSAGE` (a ``UserWarning``) from :meth:`open` to :meth:`close`.

    Adds one filter in front of ``warnings.filters`` and removes exactly that
    filter again, so that filters the user changes in between survive (unlike
    ``warnings.catch_warnings``, whose restore would undo them, and which
    cannot span ``begin``/``end`` calls that other context managers
    interleave with). A filter the user already had is left alone.
    """

    def __init__(self) -> None:
        self._added: tuple | None = None

    def open(self) -> QuietStep:
        if self._added is not None:
            return self
        pattern = re.escape(FULL_BACKWARD_HOOK_MESSAGE)
        if any(f[0] == "ignore" and f[1] is not None and f[1].pattern == pattern and f[2] is UserWarning
               for f in warnings.filters):
            return self  # the user's own filter
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
        self._added = warnings.filters[0]
        return self

    def close(self) -> None:
        added, self._added = self._added, None
        if added is None:
            return
        try:
            warnings.filters.remove(added)
        except ValueError:  # the user reset the filters meanwhile
            return
        mutated = getattr(warnings, "_filters_mutated", None)  # what filterwarnings calls: the "once"/"default"
        if mutated is not None:                                 # registries must see the change
            mutated()
