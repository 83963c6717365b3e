"""The user's process-wide state that the cockpit's own work leaves as it found it, also when that work fails.

The cockpit's work in :meth:`~cockpit_like.Cockpit.begin` and
:meth:`~cockpit_like.Cockpit.end` turns gradients off (``torch.no_grad()``),
seeds torch's global generators for a block and puts them back (BackPACK's
Monte-Carlo extensions, the optimizer's look-ahead), and marks its own
computations (:func:`~cockpit_like.backends.internal.cockpit_work`), each in
a ``with`` statement that restores what it changed. An exception that lands
inside such a statement's own entry or exit skips the restore: Jupyter's
"Interrupt kernel" raises ``KeyboardInterrupt`` wherever the kernel is (an
interrupt inside ``torch.no_grad().__enter__``, after it turned gradients
off, leaves them off for the rest of the session). :func:`restored_on_failure`
captures this state before the work and puts it back when the work raises,
whatever raised and wherever.

May import torch and :mod:`cockpit_like.backends.internal` (and, at call time,
:func:`cockpit_like.utils.optim.emptied`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from cockpit_like.backends import internal

__all__ = ["UserState", "held_tensor_hooks", "restored_on_failure"]


class UserState:
    """Grad mode, torch's CPU generator (and those of the CUDA devices once CUDA is initialised), the depth of
    the cockpit's own work and of the optimizer look-aheads, as they were at :meth:`capture`."""

    __slots__ = ("grad_enabled", "cpu_rng", "cuda_rng", "work_depth", "looking_ahead")

    @classmethod
    def capture(cls) -> UserState:
        from cockpit_like.utils import optim

        state = cls()
        state.grad_enabled = torch.is_grad_enabled()
        state.cpu_rng = torch.default_generator.get_state()
        state.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        state.work_depth = getattr(internal._STATE, "depth", 0)
        state.looking_ahead = optim._LOOKING_AHEAD
        return state

    def restore(self) -> None:
        from cockpit_like.utils import optim

        torch._C._set_grad_enabled(self.grad_enabled)
        torch.default_generator.set_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        internal._STATE.depth = self.work_depth
        optim._LOOKING_AHEAD = self.looking_ahead


@contextlib.contextmanager
def restored_on_failure() -> Iterator[UserState]:
    """Run the cockpit's work; if it raises (anything, ``KeyboardInterrupt`` included), put the
    :class:`UserState` captured before it back, then let the exception go on."""
    state = UserState.capture()
    try:
        yield state
    except BaseException:
        state.restore()
        raise


@contextlib.contextmanager
def held_tensor_hooks(tensors) -> Iterator[None]:
    """The user's gradient hooks on ``tensors`` (``p.register_hook``: gradient noise, clipping, a counter) do not run
    inside: the cockpit's own backward passes (Hessian-vector products, per-row re-runs) compute gradients of the
    parameters too, and a hook ran there dozens of times per tracked step, drawing from the user's random numbers
    (seventh round of outside trials). They are put back as they were, also when the work raises."""
    from cockpit_like.utils.optim import emptied  # (at call time: cockpit_like.utils imports the quantities)

    with emptied(getattr(tensor, "_backward_hooks", None) for tensor in tensors):
        yield
