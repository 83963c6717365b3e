"""Per-layer rules: a module's per-sample parameter gradients from its input and output gradient.

The hook backend (:mod:`cockpit_like.backends.hooks`) records each call of a
module in the forward pass and, during the backward pass, the gradient of the
**mean** loss w.r.t. the call's outputs (``delta``, which already carries the
``1/B`` of the mean, so every result here is BackPACK's
``grad_batch[i] = g_i / B``). A rule turns one call into one *form* per
parameter:

- :class:`Factors`: ``grad_batch[i] = delta_i x_i^T`` (2-D; the reducer's fast
  factor paths, the same numbers as BackPACK's linear path);
- :class:`Sequence`: ``grad_batch[i] = sum_t a_it b_it^T`` over the positions
  ``t`` of a sample (a linear layer on every token; never materialised by
  statistics with a sequence form, e.g. the gradient tests' Gram summary);
- :class:`Dense`: ``grad_batch`` ``[B, *param.shape]``;
- :class:`Lazy`: ``grad_batch`` made a block of rows at a time
  (:class:`~cockpit_like.backends.per_sample.LazyRows`): convolutions,
  embeddings (``[B, vocab, width]`` would dwarf the layer's input), and the
  sum of a tied parameter's uses (:func:`summed`), so that the reducer's
  memory budget also bounds what the rule itself builds.

Every form also gives ``rows(start, stop, shape)`` (the dense rows
``start:stop``) and ``batch_sum(shape)`` (``sum_i grad_batch[i]``).

Rules (``x`` the first input, ``B`` its leading dimension, a sample = one row):

===========================  =========================================================
module                        per-sample gradient
===========================  =========================================================
``nn.Linear``                 weight ``sum_t delta_t x_t^T`` (any leading dims), bias ``sum_t delta_t``
HF ``Conv1D`` (GPT-2)         the same with the weight stored transposed (``x_t delta_t^T``)
``nn.Conv1d``, ``nn.Conv2d``  ``delta_i X_i^T`` on the unfolded input (``groups == 1``)
``nn.Embedding``              ``sum_t e_{token_t} delta_t^T`` (scatter-add, padding row zero)
``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, eval ``BatchNorm``
                              weight ``sum (delta * x_hat)``, bias ``sum delta`` over non-channel dims
===========================  =========================================================

Anything else (and unsupported settings, e.g. grouped convolutions or
``Embedding(max_norm=...)``) returns ``None`` and goes to the ``torch.func``
fallback of the hook backend.

Recompute rules (:data:`RECOMPUTE_RULES`) need all inputs of a call, not only
the first: ``nn.MultiheadAttention`` recomputes its attention core once for
the whole batch to get the gradients at the projected queries, keys and
values and at the context, then its projections are sequence factors
(``in_proj_weight``: ``sum_t [dq; dk; dv]_t x_t^T``; ``out_proj.weight``:
``sum_t delta_t c_t^T``). The rule checks that its recomputed output equals
the recorded one and otherwise returns ``None`` (options it does not
reproduce: ``bias_k``, ``add_zero_attn``, dropout). Cross attention (a query
length other than the keys') and separate key/value widths (``kdim``, ``vdim``:
``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``, each a sequence factor
of its own input) are covered, and attention weights used in the loss.
``nn.EmbeddingBag`` (``"sum"``/``"mean"``; 2-D ids, or 1-D ids with ``offsets``,
which the re-run cannot split) scatter-adds each id's weighted output gradient
into its bag's row, after checking its reading of the call against the output.

May import torch and :mod:`cockpit_like.backends` helpers only.
"""

from __future__ import annotations

import contextlib
import functools
import math

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.prune import BasePruningMethod

from cockpit_like.backends.conv_unfold import conv2d_bias_grad_batch, conv2d_weight_grad_batch, supports_unfold
from cockpit_like.backends.per_sample import LazyRows, linear_sum, materialize_linear, materialize_sequence, sequence_sum


def finite_parts(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(new, old)`` at the entries where ``old`` is finite, or ``None`` where the two do not agree on the others.

    A step with non-finite values (a NaN row, an overflow) is reproduced when the same entries are NaN, the same
    are infinite with the same sign, and the finite ones agree (compared by the caller): comparing with a
    tolerance taken from ``old``'s largest value would compare against NaN (and ``allclose`` refuses a NaN
    tolerance)."""
    if not old.is_floating_point():
        return new, old
    finite = torch.isfinite(old)
    if bool(finite.all()):
        return new, old
    nan = torch.isnan(old)
    infinite = ~finite & ~nan
    if not (torch.equal(finite, torch.isfinite(new)) and torch.equal(nan, torch.isnan(new))
            and torch.equal(old[infinite], new[infinite])):  # fmt: skip
        return None
    return new[finite], old[finite]

__all__ = ["Factors", "Sequence", "Dense", "Lazy", "summed", "rule_for", "RULES", "RECOMPUTE_RULES", "is_hf_conv1d",
           "sums_positions_in_half"]


class Factors:
    """``grad_batch[i] = delta_i x_i^T`` (``kind="weight"``) or ``delta_i`` (``kind="bias"``)."""

    __slots__ = ("kind", "x", "delta", "known_sum")

    def __init__(self, kind: str, x: torch.Tensor | None, delta: torch.Tensor):
        self.kind, self.x, self.delta = kind, x, delta
        self.known_sum = None

    def dense(self, shape: torch.Size) -> torch.Tensor:
        return materialize_linear(self.kind, self.x, self.delta).reshape(self.delta.shape[0], *shape)

    def feed(self, reducer, param: torch.Tensor) -> None:
        reducer.reduce_factors(param, self.kind, self.x, self.delta, **_known(self))

    @property
    def batch(self) -> int:
        return self.delta.shape[0]

    def rows(self, start: int, stop: int, shape: torch.Size) -> torch.Tensor:
        x = None if self.x is None else self.x[start:stop]
        return materialize_linear(self.kind, x, self.delta[start:stop]).reshape(stop - start, *shape)

    def batch_sum(self, shape: torch.Size) -> torch.Tensor:
        if self.known_sum is not None:
            return self.known_sum.reshape(shape)
        return linear_sum(self.kind, self.x, self.delta).reshape(shape)


class Sequence:
    """``grad_batch[i] = sum_t a[i, t] b[i, t]^T`` reshaped to the parameter's shape."""

    __slots__ = ("a", "b", "known_sum")

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b
        self.known_sum = None

    def dense(self, shape: torch.Size) -> torch.Tensor:
        return materialize_sequence(self.a, self.b, shape)

    def feed(self, reducer, param: torch.Tensor) -> None:
        reducer.reduce_sequence(param, self.a, self.b, **_known(self))

    @property
    def batch(self) -> int:
        return self.a.shape[0]

    def rows(self, start: int, stop: int, shape: torch.Size) -> torch.Tensor:
        return materialize_sequence(self.a[start:stop], self.b[start:stop], shape)

    def batch_sum(self, shape: torch.Size) -> torch.Tensor:
        if self.known_sum is not None:
            return self.known_sum.reshape(shape)
        return sequence_sum(self.a, self.b).reshape(shape)


class Dense:
    """``grad_batch`` ``[B, *param.shape]``."""

    __slots__ = ("grad_batch", "known_sum")

    def __init__(self, grad_batch: torch.Tensor):
        self.grad_batch = grad_batch
        self.known_sum = None

    def dense(self, shape: torch.Size) -> torch.Tensor:
        return self.grad_batch.reshape(self.grad_batch.shape[0], *shape)

    def feed(self, reducer, param: torch.Tensor) -> None:
        reducer.reduce_grad_batch(param, self.grad_batch)

    @property
    def batch(self) -> int:
        return self.grad_batch.shape[0]

    def rows(self, start: int, stop: int, shape: torch.Size) -> torch.Tensor:
        return self.grad_batch[start:stop].reshape(stop - start, *shape)

    def batch_sum(self, shape: torch.Size) -> torch.Tensor:
        if self.known_sum is not None:
            return self.known_sum.reshape(shape)
        return self.grad_batch.sum(0).reshape(shape)


class Lazy:
    """``grad_batch`` made a block of rows at a time (a :class:`~cockpit_like.backends.per_sample.LazyRows`)."""

    __slots__ = ("lazy", "known_sum")

    def __init__(self, lazy: LazyRows):
        self.lazy = lazy
        self.known_sum = None

    def dense(self, shape: torch.Size) -> torch.Tensor:
        return self.lazy.make(0, self.lazy.batch).reshape(self.lazy.batch, *shape)

    def feed(self, reducer, param: torch.Tensor) -> None:
        reducer.reduce_lazy(param, self.lazy, **_known(self))

    @property
    def batch(self) -> int:
        return self.lazy.batch

    def rows(self, start: int, stop: int, shape: torch.Size) -> torch.Tensor:
        return self.lazy.make(start, stop).reshape(stop - start, *shape)

    def batch_sum(self, shape: torch.Size) -> torch.Tensor:
        if self.known_sum is not None:
            return self.known_sum.reshape(shape)
        return self.lazy.batch_sum().reshape(shape)

    def add_rows(self, out: torch.Tensor, start: int, stop: int, shape: torch.Size) -> None:
        if self.lazy.add_into is not None:
            self.lazy.add_into(out, start, stop)
        else:
            out.add_(self.rows(start, stop, shape))


Form = Factors | Sequence | Dense | Lazy


def _known(form) -> dict:
    """``{"batch_sum": ...}`` for a form whose batch sum is known (autograd's gradient of the use, see
    :meth:`~cockpit_like.backends.hooks.HookBackend`), else nothing: the reducer makes it if it needs it."""
    return {} if form.known_sum is None else {"batch_sum": form.known_sum}


def _itemsize(form) -> int:
    for name in ("grad_batch", "delta", "a"):
        tensor = getattr(form, name, None)
        if isinstance(tensor, torch.Tensor):
            return max(4, tensor.element_size())
    return max(4, form.lazy.itemsize) if isinstance(form, Lazy) else 4


def _shares_memory(rows: torch.Tensor, form) -> bool:
    """Whether ``rows`` lie in the memory of one of ``form``'s own tensors (its rows are then a view)."""
    start = rows.untyped_storage().data_ptr()
    tensors = (getattr(form, name, None) for name in ("grad_batch", "delta", "x", "a", "b"))
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == start for t in tensors)


def summed(forms: list, shape: torch.Size) -> "Form":
    """One form for a parameter used by several calls (weight tying): the sum of their forms, made a block
    of rows at a time (never a ``[B, *shape]`` partial sum per use)."""
    if len(forms) == 1:
        return forms[0]
    shape = torch.Size(shape)

    def make(start: int, stop: int) -> torch.Tensor:
        first = forms[0]
        total = first.rows(start, stop, shape)
        if total.element_size() < 4:
            total = total.float()
        elif _shares_memory(total, first):  # a view of the form's tensor (Dense, a bias's factor): never written
            total = total.clone()
        for form in forms[1:]:
            if isinstance(form, Lazy):
                form.add_rows(total, start, stop, shape)  # an embedding adds its rows in place
            else:
                total.add_(form.rows(start, stop, shape))
        return total

    def batch_sum() -> torch.Tensor:
        # a use whose sum autograd made (known_sum) first: copied once (never written: it goes on to
        # p.grad), contiguous (a Linear's is a transposed view); the others are added into the copy
        ordered = sorted(forms, key=lambda form: form.known_sum is None)
        total = ordered[0].batch_sum(shape)
        if ordered[0].known_sum is not None or total.element_size() < 4 or not total.is_contiguous():
            dtype = torch.promote_types(total.dtype, torch.float32)
            total = torch.empty_like(total, dtype=dtype, memory_format=torch.contiguous_format).copy_(total)
        for form in ordered[1:]:
            lazy = getattr(form, "lazy", None)
            if form.known_sum is None and lazy is not None and lazy.add_sum_into is not None:
                lazy.add_sum_into(total)  # an embedding's scatter-add, without a table of its own
            else:
                total.add_(form.batch_sum(shape))
        return total

    return Lazy(LazyRows(forms[0].batch, shape, make, max(_itemsize(f) for f in forms), batch_sum))
#: ``rule(module, x, delta) -> {parameter name: form}`` or ``None`` (use the fallback)
Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], "dict[str, Form] | None"]


def _linear(module: nn.Linear, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form]:
    if x.dim() == 2:
        return {"weight": Factors("weight", x, delta), "bias": Factors("bias", None, delta)}
    batch = x.shape[0]
    a, b = delta.reshape(batch, -1, delta.shape[-1]), x.reshape(batch, -1, x.shape[-1])
    return {"weight": Sequence(a, b), "bias": Dense(a.sum(1))}


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): ``y = x @ weight + bias``, weight ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def _hf_conv1d(module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form]:
    if x.dim() == 2:  # grad_batch[i] = x_i delta_i^T: the factor form with the roles swapped
        return {"weight": Factors("weight", delta, x), "bias": Factors("bias", None, delta)}
    batch = x.shape[0]
    a, b = x.reshape(batch, -1, x.shape[-1]), delta.reshape(batch, -1, delta.shape[-1])
    return {"weight": Sequence(a, b), "bias": Dense(b.sum(1))}


def _conv2d(module: nn.Conv2d, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if not supports_unfold(module, x):
        return None
    return {"weight": Lazy(conv2d_weight_rows(module, x, delta)), "bias": Dense(conv2d_bias_grad_batch(delta))}


def conv2d_weight_rows(module: nn.Conv2d, x: torch.Tensor, delta: torch.Tensor) -> LazyRows:
    """The weight's ``grad_batch`` of a ``Conv2d`` (:func:`conv2d_weight_grad_batch`) a block of rows at a time."""
    return LazyRows(
        x.shape[0], module.weight.shape,
        lambda start, stop: conv2d_weight_grad_batch(module, x[start:stop], delta[start:stop]),
        max(4, delta.element_size()),
    )  # fmt: skip


def _conv1d(module: nn.Conv1d, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if module.groups != 1 or x.dim() != 3 or module.padding_mode != "zeros" or isinstance(module.padding, str):
        return None
    (k,), (d,), (s,), (p,) = module.kernel_size, module.dilation, module.stride, module.padding
    if x.dtype != delta.dtype:  # autocast: the recorded float32 input, a half-precision output gradient
        wide = torch.promote_types(x.dtype, delta.dtype)
        x, delta = x.to(wide), delta.to(wide)
    patches = F.unfold(x.unsqueeze(2), (1, k), dilation=(1, d), padding=(0, p), stride=(1, s))  # [B, C*k, L]
    weight = torch.bmm(delta, patches.transpose(1, 2))  # [B, C_out, C_in * k]
    return {"weight": Dense(weight.reshape(x.shape[0], *module.weight.shape)), "bias": Dense(conv2d_bias_grad_batch(delta))}


def _embedding(module: nn.Embedding, tokens: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if module.max_norm is not None or module.scale_grad_by_freq:  # (``sparse``: the rows are the same, dense)
        return None
    batch, (vocab, width) = tokens.shape[0], module.weight.shape
    tokens, delta = tokens.reshape(batch, -1), delta.reshape(batch, -1, width)

    def make(start: int, stop: int) -> torch.Tensor:
        # sum_t e_{token_t} delta_t^T for rows start:stop: [stop - start, vocab, width], one scatter-add
        count = stop - start
        offsets = vocab * torch.arange(count, device=tokens.device).unsqueeze(1)
        rows = (tokens[start:stop] + offsets).reshape(-1)
        grad_batch = delta.new_zeros(count * vocab, width).index_add_(0, rows, delta[start:stop].reshape(-1, width))
        grad_batch = grad_batch.view(count, vocab, width)
        if module.padding_idx is not None:
            grad_batch[:, module.padding_idx] = 0
        return grad_batch

    def batch_sum() -> torch.Tensor:
        total = delta.new_zeros(vocab, width).index_add_(0, tokens.reshape(-1), delta.reshape(-1, width))
        if module.padding_idx is not None:
            total[module.padding_idx] = 0
        return total

    def add_into(out: torch.Tensor, start: int, stop: int) -> None:
        # out [stop - start, vocab, width] += these rows, without building them (a tied output layer's rows)
        count = stop - start
        ids = tokens[start:stop] + vocab * torch.arange(count, device=tokens.device).unsqueeze(1)
        values = delta[start:stop]
        if module.padding_idx is not None:
            keep = tokens[start:stop] != module.padding_idx
            ids, values = ids[keep], values[keep]
        out.view(count * vocab, width).index_add_(0, ids.reshape(-1), values.reshape(-1, width).to(out.dtype))

    def add_sum_into(out: torch.Tensor) -> None:
        ids, values = tokens.reshape(-1), delta.reshape(-1, width)
        if module.padding_idx is not None:
            keep = ids != module.padding_idx
            ids, values = ids[keep], values[keep]
        out.index_add_(0, ids, values.to(out.dtype))

    lazy = LazyRows(batch, module.weight.shape, make, max(4, delta.element_size()), batch_sum, add_into, add_sum_into)
    return {"weight": Lazy(lazy)}


def _affine(x_hat: torch.Tensor, delta: torch.Tensor, channel_dims: tuple[int, ...]) -> dict[str, Form]:
    """Weight ``sum(delta * x_hat)`` and bias ``sum(delta)`` over every dim but the batch and ``channel_dims``."""
    summed = [d for d in range(1, delta.dim()) if d not in channel_dims]
    weight = (delta * x_hat).sum(summed) if summed else delta * x_hat
    bias = delta.sum(summed) if summed else delta
    return {"weight": Dense(weight), "bias": Dense(bias)}


def _layer_norm(module: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    shape = tuple(module.normalized_shape)
    if x.dim() <= len(shape):
        return None
    x_hat = F.layer_norm(x, shape, None, None, module.eps)
    return _affine(x_hat, delta, tuple(range(x.dim() - len(shape), x.dim())))


def _rms_norm(module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    shape = tuple(module.normalized_shape)
    if x.dim() <= len(shape):
        return None
    x_hat = F.rms_norm(x, shape, None, module.eps)
    return _affine(x_hat, delta, tuple(range(x.dim() - len(shape), x.dim())))


def _group_norm(module: nn.GroupNorm, x: torch.Tensor, delta: torch.Tensor) -> dict[str, Form] | None:
    if x.dim() < 2:
        return None
    return _affine(F.group_norm(x, module.num_groups, None, None, module.eps), delta, (1,))


def _batch_norm_eval(module: nn.modules.batchnorm._BatchNorm, x: torch.Tensor, delta: torch.Tensor):
    # only reached in eval mode with running statistics (the hook backend rejects the rest)
    view = (1, -1) + (1,) * (x.dim() - 2)
    x_hat = (x - module.running_mean.view(view)) / torch.sqrt(module.running_var.view(view) + module.eps)
    return _affine(x_hat, delta, (1,))


#: the layers with a rule whose parameters' gradient autograd sums over every position of every row in the
#: parameters' own precision (measured in bfloat16: a ViT's LayerNorm bias 7-15% off, a ConvNeXt's 22-73%)
_POSITION_SUMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def sums_positions_in_half(module: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> bool:
    """Whether autograd sums the gradient of ``module``'s parameters over the call's positions in half precision
    (half-precision parameters): a norm layer's weight and bias, an embedding called on more positions than it
    has rows (BERT's two token types in fp16: ``p.grad`` 10-15% off). Such a ``p.grad`` is no reference for the
    rows (:meth:`~cockpit_like.checks.invariants.StepChecks.compare_probe`)."""
    if delta.dtype not in (torch.float16, torch.bfloat16):
        return False
    if isinstance(module, nn.Embedding):
        return x.numel() > module.num_embeddings
    return isinstance(module, _POSITION_SUMS)


#: exact module class -> rule (subclasses with their own ``forward`` go to the fallback)
RULES: dict[type, Rule] = {
    nn.Linear: _linear,
    nn.Conv1d: _conv1d,
    nn.Conv2d: _conv2d,
    nn.Embedding: _embedding,
    nn.LayerNorm: _layer_norm,
    nn.GroupNorm: _group_norm,
    nn.BatchNorm1d: _batch_norm_eval,
    nn.BatchNorm2d: _batch_norm_eval,
    nn.BatchNorm3d: _batch_norm_eval,
}
if hasattr(nn, "RMSNorm"):
    RULES[nn.RMSNorm] = _rms_norm


def layer_class(module: nn.Module) -> type:
    """``module``'s class, looking through the class ``fully_shard`` (FSDP2) gives it
    (``FSDPLinear(FSDPModule, Linear)`` -> ``Linear``); any other subclass is its own class."""
    cls = type(module)
    fsdp = _fsdp_module_class()
    if fsdp is not None and issubclass(cls, fsdp):
        for base in cls.__bases__:
            if base is not fsdp:
                return base
    return cls


@functools.cache
def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def pruned(module: nn.Module) -> bool:
    """``torch.nn.utils.prune`` reparametrizes ``module`` (a forward pre-hook computes ``weight = weight_orig *
    weight_mask``): the rules' gradients are the computed tensor's, not the parameter's; the ``torch.func``
    fallback re-runs the hook with the parameter, so it takes these modules."""
    return any(isinstance(hook, BasePruningMethod) for hook in module._forward_pre_hooks.values())


def rule_for(module: nn.Module) -> Rule | None:
    """The per-layer rule of ``module``, or ``None`` (the ``torch.func`` fallback)."""
    if module._forward_pre_hooks and pruned(module):
        return None
    rule = RULES.get(layer_class(module))
    if rule is not None:
        return rule
    if is_hf_conv1d(module):
        return _hf_conv1d
    return None


def _multihead_attention(module: nn.MultiheadAttention, args: tuple, kwargs: dict, output, grads: list):
    """Per-sample gradients of the projection parameters (see the module docstring), or ``None``.

    Self and cross attention (a query length other than the keys'), separate key/value widths
    (``kdim``/``vdim``: ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``), masks, and attention
    weights that get a gradient of their own (``need_weights=True`` with the weights used in the loss).
    """
    if module.bias_k is not None or module.add_zero_attn or module.dropout:
        return None
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights", "is_causal")
    given = dict(zip(names, args))
    given.update(kwargs or {})
    query, key, value = given.get("query"), given.get("key"), given.get("value")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (query, key, value)) or not grads:
        return None
    self_attention = query is key and key is value
    if not module.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    delta = grads[0] if module.batch_first else grads[0].transpose(0, 1)
    recorded = output[0] if isinstance(output, tuple) else output
    recorded_weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
    # the attention weights (always batch first) with a gradient of their own: recomputed explicitly
    d_weights = grads[1] if len(grads) > 1 and isinstance(recorded_weights, torch.Tensor) else None
    if d_weights is not None and not bool(d_weights.any()):
        d_weights = None
    if not module.batch_first:
        recorded = recorded.transpose(0, 1)
    embed, heads = module.embed_dim, module.num_heads
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.detach().chunk(3)
    else:
        w_q, w_k, w_v = (w.detach() for w in (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight))
    b_q, b_k, b_v = (None, None, None) if module.in_proj_bias is None else module.in_proj_bias.detach().chunk(3)
    # an output narrower than the weights: the forward pass ran under autocast; recompute under the same one
    cast = recorded.is_floating_point() and torch.finfo(recorded.dtype).bits < torch.finfo(w_q.dtype).bits
    autocast = torch.autocast(query.device.type, dtype=recorded.dtype) if cast else contextlib.nullcontext()
    rtol = max(1e-4, 16 * torch.finfo(recorded.dtype).eps) if cast else 1e-4
    with torch.enable_grad(), autocast:
        q = F.linear(query.detach(), w_q, b_q).requires_grad_()
        k = F.linear(key.detach(), w_k, b_k).requires_grad_()
        v = F.linear(value.detach(), w_v, b_v).requires_grad_()
        batch, length, source = q.shape[0], q.shape[1], k.shape[1]

        def split(t, n):
            return t.reshape(batch, n, heads, embed // heads).transpose(1, 2)

        mask = _attention_mask(given, batch, heads, length, source, q.dtype)
        causal = bool(given.get("is_causal")) and mask is None
        weights = None
        if d_weights is None:
            context = F.scaled_dot_product_attention(
                split(q, length), split(k, source), split(v, source), attn_mask=mask, is_causal=causal
            )
        else:  # as nn.MultiheadAttention computes its weights: softmax(q k^T / sqrt(d) + mask)
            scores = split(q, length) @ split(k, source).transpose(-2, -1) / math.sqrt(embed // heads)
            if causal:
                scores = scores.masked_fill(torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            if mask is not None:
                scores = scores + mask
            attention = scores.softmax(-1)
            context = attention @ split(v, source)
            weights = attention.mean(1) if given.get("average_attn_weights", True) else attention
        context = context.transpose(1, 2).reshape(batch, length, embed)
        out = F.linear(context, module.out_proj.weight.detach(), None if module.out_proj.bias is None else module.out_proj.bias.detach())
        checks = [(out, recorded)] + ([] if weights is None else [(weights, recorded_weights)])
        for new, old in checks:
            parts = finite_parts(new.detach(), old.detach())
            if parts is None or parts[0].shape != parts[1].shape or (
                parts[1].numel() and not torch.allclose(parts[0].to(parts[1].dtype), parts[1], rtol=rtol,
                                                        atol=1e-2 * rtol * (1 + float(parts[1].abs().max())))
            ):
                return None
        outputs, cotangents = [out], [delta.to(out.dtype)]
        if weights is not None:
            outputs.append(weights)
            cotangents.append(d_weights.to(weights.dtype))
        d_q, d_k, d_v = torch.autograd.grad(outputs, (q, k, v), cotangents)
    context = context.detach()
    forms = {"out_proj.weight": Sequence(delta, context)}
    if not module._qkv_same_embed_dim:
        forms.update(
            q_proj_weight=Sequence(d_q, query.detach()),
            k_proj_weight=Sequence(d_k, key.detach()),
            v_proj_weight=Sequence(d_v, value.detach()),
        )
    elif self_attention:
        forms["in_proj_weight"] = Sequence(torch.cat((d_q, d_k, d_v), dim=2), query.detach())
    else:
        # the rows of in_proj_weight for queries, keys and values, each from its own tokens (length L for the
        # queries, S for the keys and values): one sequence over the L + 2 S tokens, zero outside each block
        blocks = []
        for index, d in enumerate((d_q, d_k, d_v)):
            parts = [torch.zeros_like(d)] * 3
            parts[index] = d
            blocks.append(torch.cat(parts, dim=2))
        forms["in_proj_weight"] = Sequence(
            torch.cat(blocks, dim=1), torch.cat((query.detach(), key.detach(), value.detach()), dim=1)
        )
    if module.in_proj_bias is not None:
        forms["in_proj_bias"] = Dense(torch.cat((d_q.sum(1), d_k.sum(1), d_v.sum(1)), dim=1))
    if module.out_proj.bias is not None:
        forms["out_proj.bias"] = Dense(delta.sum(1))
    return forms


def _attention_mask(given: dict, batch: int, heads: int, length: int, source: int, dtype) -> torch.Tensor | None:
    """``attn_mask`` and ``key_padding_mask`` merged into one additive ``[B, H, L, S]`` mask (``None`` if neither)."""
    mask = None
    attn_mask, padding = given.get("attn_mask"), given.get("key_padding_mask")
    for is_padding, part in ((False, attn_mask), (True, padding)):
        if part is None:
            continue
        part = part.detach()
        additive = torch.zeros(part.shape, dtype=dtype, device=part.device).masked_fill_(part, float("-inf")) if part.dtype == torch.bool else part.to(dtype)
        if is_padding:
            additive = additive.view(batch, 1, 1, source)
        elif additive.dim() == 3:
            additive = additive.view(batch, heads, length, source)
        mask = additive if mask is None else mask + additive
    return None if mask is None else mask.expand(batch, heads, length, source)


def _embedding_bag(module: nn.EmbeddingBag, args: tuple, kwargs: dict, output, grads: list):
    """``weight``'s per-sample gradient of ``nn.EmbeddingBag`` in ``"sum"``/``"mean"`` mode (a sample is a
    bag: a row of a 2-D input, or ``input[offsets[i]:offsets[i + 1]]`` of a 1-D input with ``offsets``):
    ``sum_t w_t e_{id_t} delta_i^T`` over the bag's ids, ``w_t`` its ``per_sample_weights`` (``"sum"``) or
    ``1 / (its ids but padding_idx)`` (``"mean"``), 0 for ``padding_idx``. ``None`` (the re-run) for
    ``"max"`` mode, ``max_norm`` and ``scale_grad_by_freq``, or where the recomputed output differs."""
    if module.mode not in ("sum", "mean") or module.max_norm is not None or module.scale_grad_by_freq or not grads:
        return None
    given = dict(zip(("input", "offsets", "per_sample_weights"), args))
    given.update(kwargs or {})
    ids, offsets, weights = given.get("input"), given.get("offsets"), given.get("per_sample_weights")
    delta, recorded = grads[0], output
    if not isinstance(ids, torch.Tensor) or not isinstance(recorded, torch.Tensor) or delta.dim() != 2:
        return None
    batch, (vocab, width) = delta.shape[0], module.weight.shape
    ids = ids.detach()
    if ids.dim() == 2:  # a bag per row
        if offsets is not None:
            return None
        bags = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1])
        ids = ids.reshape(-1)
    elif ids.dim() == 1 and isinstance(offsets, torch.Tensor):
        starts = offsets.detach().long()
        if module.include_last_offset:
            starts = starts[:-1]
        if starts.numel() != batch:
            return None
        # bag of each id: the number of starts at or before its position, minus 1
        bags = torch.bucketize(torch.arange(ids.numel(), device=ids.device), starts, right=True) - 1
    else:
        return None
    scale = torch.ones(ids.shape, dtype=delta.dtype, device=delta.device)
    if weights is not None:
        scale = weights.detach().reshape(-1).to(delta.dtype)
    if module.padding_idx is not None:
        scale = scale.masked_fill(ids == module.padding_idx, 0)
    if module.mode == "mean":
        counts = torch.zeros(batch, dtype=delta.dtype, device=delta.device).index_add_(0, bags, (scale != 0).to(delta.dtype))
        scale = scale / counts.clamp(min=1)[bags]
    # the rule's own reading of the call must give the recorded output (offsets, padding, modes)
    table = module.weight.detach()
    out = torch.zeros(batch, width, dtype=table.dtype, device=table.device).index_add_(0, bags, table[ids] * scale[:, None].to(table.dtype))
    parts = finite_parts(out, recorded.detach())
    if parts is None or parts[0].shape != parts[1].shape or (
        parts[1].numel() and not torch.allclose(parts[0].to(parts[1].dtype), parts[1], rtol=1e-4,
                                                atol=1e-6 * (1 + float(parts[1].abs().max())))
    ):
        return None
    delta = delta.detach()
    values = scale[:, None] * delta[bags]  # [ids, width]: what each id adds to its bag's row

    def make(start: int, stop: int) -> torch.Tensor:
        keep = (bags >= start) & (bags < stop)
        rows = (bags[keep] - start) * vocab + ids[keep]
        grad_batch = delta.new_zeros((stop - start) * vocab, width).index_add_(0, rows, values[keep])
        return grad_batch.view(stop - start, vocab, width)

    def batch_sum() -> torch.Tensor:
        return delta.new_zeros(vocab, width).index_add_(0, ids, values)

    def add_into(out: torch.Tensor, start: int, stop: int) -> None:
        keep = (bags >= start) & (bags < stop)
        rows = (bags[keep] - start) * vocab + ids[keep]
        out.view(-1, width).index_add_(0, rows, values[keep].to(out.dtype))

    def add_sum_into(out: torch.Tensor) -> None:
        out.index_add_(0, ids, values.to(out.dtype))

    lazy = LazyRows(batch, module.weight.shape, make, max(4, delta.element_size()), batch_sum, add_into, add_sum_into)
    return {"weight": Lazy(lazy)}


#: module class -> ``rule(module, args, kwargs, output, output_grads) -> {param name: form} | None``
RECOMPUTE_RULES: dict[type, Callable] = {nn.MultiheadAttention: _multihead_attention, nn.EmbeddingBag: _embedding_bag}
