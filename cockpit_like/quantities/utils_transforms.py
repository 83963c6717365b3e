"""Transforms of per-sample gradients: Cockpit's ``BatchGradTransformsHook``.

A quantity written for Cockpit asks for functions of each parameter's
per-sample gradients by returning a hook from ``extension_hooks(step)``::

    def extension_hooks(self, global_step):
        return [BatchGradTransformsHook({"batch_l2": batch_l2_transform})]

    def _compute(self, global_step, params, batch_loss):
        return sum(p.grad_batch_transforms["batch_l2"] for p in params)

Here the hook is not run by BackPACK: the cockpit turns every such hook of a
step into one per-sample statistic, :class:`GradBatchTransforms`, which the
:class:`~cockpit_like.backends.per_sample.PerSampleReducer` feeds with each
parameter's ``grad_batch`` during the backward pass, whichever backend
produced it (BackPACK, or module hooks for a model that is not extended).
The results are set as ``param.grad_batch_transforms = {name: fn(grad_batch)}``
as soon as the parameter's per-sample gradients exist (so later extension
hooks and the quantities' ``_compute`` see them) and deleted when the step's
quantities have run. Several hooks are merged into one dict; two different
functions under one name raise ``ValueError``.

What the functions receive, as in Cockpit: ``grad_batch`` of shape
``[B, *param.shape]`` with ``grad_batch[i] = g_i / B`` for a mean loss
(``g_i`` the gradient of sample ``i``'s loss), and
``grad_batch._param_weakref()`` is the parameter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cockpit_like.backends.per_sample import GRAD_BATCH_TRANSFORMS, PerSampleStat, publish_transform_results

__all__ = [
    "BatchGradTransformsHook",
    "GradBatchTransforms",
    "merge_transform_hooks",
    "merge_into_hook",
    "split_transform_hooks",
    "BatchGradTransformsHook_BatchL2Grad",
    "BatchGradTransformsHook_BatchDotGrad",
    "BatchGradTransformsHook_SumGradSquared",
    "batch_l2_transform",
    "batch_dot_transform",
    "sum_grad_squared_transform",
]

SAVEFIELD = GRAD_BATCH_TRANSFORMS


def _apply(transforms: Iterable[tuple[str, Callable]], param: torch.Tensor, grad_batch: torch.Tensor) -> dict:
    """``{name: fn(grad_batch)}``; ``grad_batch._param_weakref()`` is ``param`` while they run."""
    view = grad_batch.detach()  # an alias (no copy) that may carry the attribute
    view._param_weakref = weakref.ref(param)
    return {name: function(view) for name, function in transforms}


@dataclass(frozen=True)
class GradBatchTransforms(PerSampleStat):
    """``{name: fn(grad_batch)}`` per parameter, also set as ``param.grad_batch_transforms``.

    ``transforms`` is a tuple of ``(name, function)`` pairs sorted by name, so
    equal requests are one statistic. Result: a list with one dict per
    parameter (``None`` for parameters without per-sample gradients).
    """

    transforms: tuple[tuple[str, Callable], ...]

    #: fields this statistic writes onto the parameters; freed after the step
    param_fields: ClassVar[tuple[str, ...]] = (SAVEFIELD,)

    def init(self, params):
        return [None] * len(params)

    def accumulate(self, state, index, param, grad_batch):
        results = _apply(self.transforms, param, grad_batch)
        publish_transform_results(param, results)  # next to what built-in statistics publish there
        state[index] = results
        return state


class BatchGradTransformsHook:
    """Ask for transforms of the per-sample gradients (Cockpit's hook of the same name).

    Args:
        transforms: ``{name: function}``; each function maps a parameter's
            ``grad_batch`` ``[B, *param.shape]`` (``g_i / B``) to anything, and
            the results are collected in ``param.grad_batch_transforms[name]``.
        savefield: kept for Cockpit's signature; the results always go to
            ``grad_batch_transforms``.

    Returned from a quantity's ``extension_hooks(step)``, it is met by the
    cockpit's per-sample reducer (see the module docstring). Called directly
    as a BackPACK extension hook (``with backpack(BatchGrad(), extension_hook=hook)``)
    it applies the transforms to the ``grad_batch`` that BackPACK left on the
    parameters of each leaf module.
    """

    def __init__(self, transforms: dict[str, Callable], savefield: str | None = None):
        if not isinstance(transforms, dict) or not all(callable(f) for f in transforms.values()):
            raise TypeError(
                "BatchGradTransformsHook(transforms=...) takes a dict {name: function of grad_batch}, got "
                f"{transforms!r}"
            )
        self._transforms = dict(transforms)
        self.savefield = savefield
        self.processed: set[int] = set()

    def __call__(self, module: torch.nn.Module) -> None:
        if next(module.children(), None) is not None:
            return
        for param in module.parameters(recurse=False):
            grad_batch = getattr(param, "grad_batch", None)
            if id(param) in self.processed or not param.requires_grad or grad_batch is None:
                continue
            setattr(param, SAVEFIELD, _apply(self._transforms.items(), param, grad_batch))
            self.processed.add(id(param))

    def __repr__(self) -> str:
        return f"BatchGradTransformsHook({sorted(self._transforms)})"


def _merged_transforms(hooks: Iterable[BatchGradTransformsHook]) -> dict[str, Callable]:
    """``{name: function}`` of all ``hooks``; one name must name equal functions (for plain functions
    and lambdas: the same object, as Cockpit checks by ``id``; equal bound methods count as one)."""
    merged: dict[str, Callable] = {}
    for hook in hooks:
        for name, function in hook._transforms.items():
            if name in merged and merged[name] != function:
                raise ValueError(
                    f"BatchGradTransformsHook: two different transforms under the name {name!r} "
                    f"({merged[name]!r} and {function!r}); give them different names"
                )
            merged[name] = function
    return merged


def merge_transform_hooks(hooks: Iterable[BatchGradTransformsHook]) -> GradBatchTransforms:
    """One statistic with the transforms of all ``hooks``.

    Raises:
        ValueError: two different functions under one name.
    """
    merged = _merged_transforms(hooks)
    return GradBatchTransforms(tuple(sorted(merged.items(), key=lambda item: item[0])))


def merge_into_hook(hooks: Iterable[BatchGradTransformsHook]) -> BatchGradTransformsHook:
    """One ``BatchGradTransformsHook`` with the transforms of all ``hooks`` (Cockpit's merge).

    The same name with the same function is kept once; the merged hook
    holds the very function objects it was given (the first of equal ones).

    Raises:
        ValueError: two different functions under one name.

    Example:
        >>> merged = merge_into_hook([BatchGradTransformsHook_BatchL2Grad(), BatchGradTransformsHook_BatchL2Grad()])
        >>> sorted(merged._transforms)
        ['batch_l2']
    """
    return BatchGradTransformsHook(_merged_transforms(hooks))


def split_transform_hooks(hooks: Iterable[Any]) -> tuple[list, list[BatchGradTransformsHook]]:
    """``(other hooks, BatchGradTransformsHook instances)`` of a list of extension hooks."""
    others, transforms = [], []
    for hook in hooks:
        (transforms if isinstance(hook, BatchGradTransformsHook) else others).append(hook)
    return others, transforms


# ---- Cockpit's ready-made transforms ------------------------------------------------------------
def batch_l2_transform(grad_batch: torch.Tensor) -> torch.Tensor:
    """``[||grad_batch[i]||^2 for i]`` (``[B]``; ``||g_i||^2 / B^2`` for a mean loss)."""
    return grad_batch.reshape(grad_batch.shape[0], -1).pow(2).sum(1)


def batch_dot_transform(grad_batch: torch.Tensor) -> torch.Tensor:
    """The Gram matrix ``[<grad_batch[i], grad_batch[k]>]`` (``[B, B]``)."""
    flat = grad_batch.reshape(grad_batch.shape[0], -1)
    return flat @ flat.T


def sum_grad_squared_transform(grad_batch: torch.Tensor) -> torch.Tensor:
    """``sum_i grad_batch[i]**2`` (shaped like the parameter)."""
    return grad_batch.pow(2).sum(0)


def BatchGradTransformsHook_BatchL2Grad() -> BatchGradTransformsHook:  # noqa: N802 - Cockpit's name
    """The hook for ``grad_batch_transforms["batch_l2"]`` (:func:`batch_l2_transform`)."""
    return BatchGradTransformsHook({"batch_l2": batch_l2_transform})


def BatchGradTransformsHook_BatchDotGrad() -> BatchGradTransformsHook:  # noqa: N802 - Cockpit's name
    """The hook for ``grad_batch_transforms["batch_dot"]`` (:func:`batch_dot_transform`)."""
    return BatchGradTransformsHook({"batch_dot": batch_dot_transform})


def BatchGradTransformsHook_SumGradSquared() -> BatchGradTransformsHook:  # noqa: N802 - Cockpit's name
    """The hook for ``grad_batch_transforms["sum_grad_squared"]`` (:func:`sum_grad_squared_transform`)."""
    return BatchGradTransformsHook({"sum_grad_squared": sum_grad_squared_transform})
