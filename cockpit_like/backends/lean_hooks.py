"""Cheaper backward hooks for modules extended by BackPACK.

``backpack.extend`` gives every module a *full* backward hook
(``register_full_backward_hook``) that runs the active extensions once the
gradients of the module's inputs are known. PyTorch implements full backward
hooks by wrapping the inputs and the output of every call in an extra
autograd ``Function`` (``BackwardHook``), in the forward pass and again in the
backward pass, whether or not any extension is active. On a small MLP that
machinery is about a third of a plain training step: the price a cockpit
would charge at every step where nothing is tracked (Finding 7 in
``docs/performance.md``).

BackPACK's hook reads only the gradient of the module's *output*
(``g_out``; no extension uses ``g_inp``) and what the forward pass stored on
the module (``module.input0``, ``module.output``). A tensor hook on the output
(``output.register_hook``), installed by a plain forward hook, receives
exactly that gradient, once it is complete, and costs a few microseconds.
It fires before the module's own backward nodes rather than after them,
which does not change the order between modules: the hook on a module's
output fires only when every consumer of that output has finished its
backward, so every consumer's hook (and every quantity it saved for this
module) comes first, as with full hooks.

:func:`make_lean` swaps BackPACK's full backward hook of a module for such a
tensor hook; :func:`restore` undoes it. The cockpit swaps the modules it saw in
BackPACK's pass at its first tracked step (``Cockpit(..., lean_hooks=True)``,
the default). A module is left as it is when the swap could change what
BackPACK sees:

- it has other backward hooks or backward pre-hooks than BackPACK's;
- it returns a tuple (``nn.RNNBase``: the gradients of all outputs would be
  needed) or works in place (``inplace=True``);
- it is not extended (no ``hook_store_io`` forward hook).
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from backpack import hook_run_extensions, hook_store_io, memory_cleanup
from backpack.context import CTX
from backpack.utils.hooks import no_op
from torch import nn

from cockpit_like.backends.internal import cockpit_work

__all__ = ["make_lean", "restore", "is_lean", "can_make_lean", "ModuleCollector"]


def _on_output_grad(module_ref: weakref.ref, grad: torch.Tensor) -> None:
    module = module_ref()
    if module is None:
        return
    if not CTX.active_exts and CTX.extension_hook is no_op and not CTX.debug:
        # outside ``with backpack(...)`` BackPACK's hook only frees the stored input/output
        if not CTX.retain_graph:
            memory_cleanup(module)
        return
    with cockpit_work():  # not part of a recorded step
        hook_run_extensions(module, (None,), (grad,))


def _on_forward(module: nn.Module, _inputs, output) -> None:
    # module-level functions, no closures: a deep copy or a pickled model is lean too,
    # and the output's hook holds the module only weakly
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(partial(_on_output_grad, weakref.ref(module)))


def is_lean(module: nn.Module) -> bool:
    """Whether :func:`make_lean` has swapped the module's backward hook."""
    return any(hook is _on_forward for hook in module._forward_hooks.values())


def can_make_lean(module: nn.Module) -> bool:
    """Whether the module carries BackPACK's hooks and nothing that a swap would change."""
    if isinstance(module, nn.RNNBase) or getattr(module, "inplace", False):
        return False
    if module._backward_pre_hooks or not module._backward_hooks:
        return False
    if any(hook is not hook_run_extensions for hook in module._backward_hooks.values()):
        return False
    return any(hook is hook_store_io for hook in module._forward_hooks.values()) and not is_lean(module)


def make_lean(module: nn.Module) -> bool:
    """Swap BackPACK's full backward hook of ``module`` for a tensor hook on its output.

    Returns whether the module is lean afterwards. The results of every
    BackPACK extension are unchanged; the forward and backward passes no longer
    go through PyTorch's ``BackwardHook`` wrappers.
    """
    if not is_lean(module):
        if not can_make_lean(module):
            return False
        # the new hook before the old one goes: a swap cut short (an interrupt) leaves both, which this function
        # called again completes (ModuleCollector.settle), never a module with neither
        CTX.add_hook_handle(module.register_forward_hook(_on_forward))  # BackPACK's CTX.remove_hooks() drops it too
    for key in [k for k, hook in module._backward_hooks.items() if hook is hook_run_extensions]:
        del module._backward_hooks[key]
    return True


def restore(module: nn.Module) -> None:
    """Undo :func:`make_lean`: BackPACK's full backward hook again (no-op if not lean)."""
    if not is_lean(module):
        return
    for key in [k for k, hook in module._forward_hooks.items() if hook is _on_forward]:
        del module._forward_hooks[key]
    CTX.add_hook_handle(module.register_full_backward_hook(hook_run_extensions))


class ModuleCollector:
    """An ``extension_hook`` that notes the modules of BackPACK's pass not yet lean.

    Holds weak references only. :meth:`make_lean` swaps the hooks of the
    modules noted since its last call (those still alive) and returns how many
    it swapped; a module that cannot be swapped is not noted again.
    """

    def __init__(self) -> None:
        self._pending: list[weakref.ref] = []
        self._done: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

    def __call__(self, module: nn.Module) -> None:
        if module not in self._done:
            self._done.add(module)
            self._pending.append(weakref.ref(module))

    def make_lean(self) -> int:
        swapped = 0
        while self._pending:  # (a module leaves the list once swapped: one cut short is still in it)
            module = self._pending[0]()
            if module is not None:
                swapped += make_lean(module)
            del self._pending[0]
        return swapped

    def settle(self) -> None:
        """Complete the swaps an interrupt cut short (a module with both hooks), then :meth:`forget`."""
        for ref in self._pending:
            module = ref()
            if module is not None and is_lean(module):
                make_lean(module)
        self.forget()

    def forget(self) -> None:
        """Drop the modules noted since the last :meth:`make_lean` (a failed step)."""
        for ref in self._pending:
            module = ref()
            if module is not None:
                self._done.discard(module)
        self._pending = []
