"""A BackPACK first-order extension that feeds per-sample statistics without ``grad_batch``.

:class:`PerSampleStatistics` replaces ``BatchGrad`` when per-sample
statistics are needed but nobody asked for the raw ``grad_batch``:

- ``nn.Linear`` with 2-D input: the per-sample gradients are outer products
  (weight: ``delta_i x_i^T``, bias: ``delta_i``, with ``x = module.input0``
  and ``delta`` the output gradient, which for a mean loss already carries
  the ``1/B``). The factors ``(x, delta)`` go to the
  :class:`~cockpit_like.backends.per_sample.PerSampleReducer`; statistics
  with a factor form never see a ``[B, out, in]`` tensor.
- ``nn.Conv2d`` (groups 1, zero padding): ``grad_batch`` from the unfolded
  input and one batched matmul (:mod:`cockpit_like.backends.conv_unfold`),
  several times faster than ``BatchGrad``'s and without its large intermediate,
  made a block of rows at a time under the reducer's memory budget.
- every other layer BackPACK's ``BatchGrad`` supports (convolutions,
  batch norm, RNNs, embeddings, linear layers with extra input dimensions):
  BatchGrad's own per-module computation, handed to the reducer as
  ``grad_batch`` instead of being stored on the parameter.

Nothing is stored on the parameters; the reducer (BackPACK's extension
hook, run right after this extension on each module) reduces and frees.
"""

from __future__ import annotations

from torch.nn import Conv2d, Linear, Module

from backpack.extensions import BatchGrad
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension, FirstOrderModuleExtension

from cockpit_like.backends.conv_unfold import conv2d_bias_grad_batch, supports_unfold
from cockpit_like.backends.module_rules import conv2d_weight_rows
from cockpit_like.backends.per_sample import PerSampleReducer
from cockpit_like.backends.step import backpack_computes_per_sample

__all__ = ["PerSampleStatistics"]


def _batch_grad_module_extensions() -> dict:
    """BatchGrad's module extensions (``{module class: extension}``)."""
    return dict(getattr(BatchGrad(), "_BackpropExtension__module_extensions"))


def _param_names(module_extension) -> tuple[str, ...]:
    return tuple(getattr(module_extension, "_ModuleExtension__params", None) or ("weight", "bias"))


class _GradBatchToReducer(FirstOrderModuleExtension):
    """Runs BatchGrad's module extension and offers the result to the reducer."""

    def __init__(self, inner):
        self._inner = inner
        self._names = _param_names(inner)
        super().__init__(params=None)

    def __call__(self, extension: "PerSampleStatistics", module: Module, g_inp, g_out) -> None:
        if not backpack_computes_per_sample(module):
            return  # a configuration BackPACK gets wrong: the hooks take its rows
        _check_kept_call(module, g_out)
        reducer = extension.reducer
        todo = []
        for name in self._names:
            param = getattr(module, name, None)
            if param is not None and param.requires_grad and reducer.tracks(param):
                todo.append((name, param))
        if not todo:
            return
        self._inner.check_hyperparameters_module_extension(extension, module, g_inp, g_out)
        for name, param in todo:
            reducer.offer_grad_batch(param, getattr(self._inner, name)(extension, module, g_inp, g_out, None))


def _check_kept_call(module: Module, g_out) -> None:
    """BackPACK's forward hook keeps the last call's input and output on the module: they must be those of the
    call this backward pass reaches, else a clear error (an extra forward pass with gradients on, or a backward
    pass outside the cockpit's block that freed them; without ``Cockpit(..., model=model)`` the cockpit cannot
    see the calls and let its hooks take the rows instead)."""
    output = getattr(module, "output", None)
    if hasattr(module, "input0") and output is not None and output.shape == g_out[0].shape:
        return
    found = "nothing (freed)" if output is None else f"an output of shape {tuple(output.shape)}"
    raise ValueError(
        f"the BackPACK-extended {type(module).__name__} kept {found} where the backward pass brings an output "
        f"gradient of shape {tuple(g_out[0].shape)}: the module ran again after the forward pass of the loss "
        "being backpropagated (a forward pass with gradients enabled: an evaluation batch, a probe), or a backward "
        "pass outside the cockpit's block (torch.autograd.grad) freed what BackPACK kept. BackPACK keeps one call "
        "per module. Run other forward passes under torch.no_grad() or before the training forward pass, or pass "
        "Cockpit(..., model=model): its hooks then take the rows of such modules."
    )


class _LinearFactors(_GradBatchToReducer):
    """``nn.Linear``: offers ``(x, delta)`` for 2-D inputs, ``grad_batch`` otherwise."""

    def __call__(self, extension: "PerSampleStatistics", module: Module, g_inp, g_out) -> None:
        if not backpack_computes_per_sample(module):
            return  # a configuration BackPACK gets wrong (pruned): the hooks take its rows
        _check_kept_call(module, g_out)
        x, delta = module.input0, g_out[0]
        if x.dim() != 2 or delta.dim() != 2 or extension.get_subsampling() is not None:
            super().__call__(extension, module, g_inp, g_out)
            return
        reducer = extension.reducer
        x, delta = x.detach(), delta.detach()
        weight, bias = module.weight, module.bias
        if weight is not None and weight.requires_grad and reducer.tracks(weight):
            reducer.offer_factors(weight, "weight", x, delta)
        if bias is not None and bias.requires_grad and reducer.tracks(bias):
            reducer.offer_factors(bias, "bias", None, delta)


class _Conv2dUnfold(_GradBatchToReducer):
    """``nn.Conv2d``: ``grad_batch`` by unfolding the input and one ``bmm`` (:mod:`~cockpit_like.backends.conv_unfold`).

    Falls back to BatchGrad's computation for what the unfold does not cover
    (grouped convolutions, subsampling).
    """

    def __call__(self, extension: "PerSampleStatistics", module: Module, g_inp, g_out) -> None:
        if not backpack_computes_per_sample(module):
            return  # a configuration BackPACK gets wrong (pruned): the hooks take its rows
        _check_kept_call(module, g_out)
        x = module.input0
        if extension.get_subsampling() is not None or not supports_unfold(module, x):
            super().__call__(extension, module, g_inp, g_out)
            return
        reducer, delta = extension.reducer, g_out[0].detach()
        weight, bias = module.weight, module.bias
        if weight.requires_grad and reducer.tracks(weight):
            reducer.offer_lazy(weight, conv2d_weight_rows(module, x.detach(), delta))
        if bias is not None and bias.requires_grad and reducer.tracks(bias):
            reducer.offer_grad_batch(bias, conv2d_bias_grad_batch(delta))


class PerSampleStatistics(FirstOrderBackpropExtension):
    """Per-sample information for a :class:`PerSampleReducer`, layer by layer.

    Args:
        reducer: receives the factors / ``grad_batch`` (it must also be the
            extension hook of the same ``backpack(...)`` context).
        factors: use the fast paths, outer-product factors for ``nn.Linear`` and the
            unfold + ``bmm`` ``grad_batch`` for ``nn.Conv2d`` (``False``: BatchGrad's own
            ``grad_batch`` for every layer, e.g. to compare both paths).
    """

    def __init__(self, reducer: PerSampleReducer, factors: bool = True):
        module_exts = {cls: _GradBatchToReducer(ext) for cls, ext in _batch_grad_module_extensions().items()}
        if factors:
            module_exts[Linear] = _LinearFactors(module_exts[Linear]._inner)
            module_exts[Conv2d] = _Conv2dUnfold(module_exts[Conv2d]._inner)
        # savefield "grad_batch": the engine checks coverage via reducer.seen; nothing is ever stored
        super().__init__(savefield="grad_batch", module_exts=module_exts)
        self.reducer = reducer
        self.factors = factors


def statistics_backend(stats: list, params: list, raw_batch_grad: bool) -> tuple:
    """The BackPACK extension and the extension hook that compute ``stats`` at one step.

    With ``raw_batch_grad`` (a quantity or the user asked for BackPACK's
    ``BatchGrad``): ``BatchGrad()`` and a reducer that reads and keeps
    ``param.grad_batch``. Otherwise :class:`PerSampleStatistics` (the linear
    fast path; nothing stored on the parameters) and its reducer.

    Returns:
        ``(extension, reducer)``; the reducer must be the extension hook.
    """
    if raw_batch_grad:
        return BatchGrad(), PerSampleReducer(stats, params, keep_grad_batch=True)
    reducer = PerSampleReducer(stats, params, keep_grad_batch=False)
    return PerSampleStatistics(reducer), reducer
