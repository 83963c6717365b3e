"""What the model was fed and what it returned: :class:`DataStats`.

A forward hook on the models the cockpit knows (the roots, not their
submodules), installed like
:class:`~cockpit_like.quantities.activations.ActivationStats`' only for the
forward passes of tracked steps, read the model's first positional input and
its output. With ``info["individual_losses"]`` (optional) the per-sample
losses are summarized too. The cost is a few reductions over the input and
the output per tracked forward pass.

Why the diagnosis reads it: the scale of the raw input is hidden from
``ActivationStats`` when a normalization layer follows the first layer, a
batch whose inputs are all equal (a data bug) shows only as a spread of 0,
and the number of classes (the output's last dimension) says where chance
level and the floor of a cross-entropy over probabilities lie.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from cockpit_like import context
from cockpit_like.backends.distributed import unwrap
from cockpit_like.quantities.quantity import SingleStepQuantity
from cockpit_like.backends.user_state import in_rerun

__all__ = ["DataStats"]


class _Tally:
    __slots__ = ("rows", "sumsq", "entries", "col_sum", "col_sumsq", "mixed", "var", "var_rows", "integer", "outputs",
                 "out_min", "out_max", "probabilities")

    def __init__(self):
        self.rows = 0
        self.sumsq = 0.0
        self.entries = 0
        # per feature, the sum and the sum of squares over every row of the step's calls (micro-batches
        # of one optimizer step give the spread of the whole batch); ``mixed``: calls of different
        # feature counts (sequence lengths), where the spread is the rows-weighted mean of each call's
        self.col_sum: torch.Tensor | None = None
        self.col_sumsq: torch.Tensor | None = None
        self.mixed = False
        self.var = 0.0
        self.var_rows = 0
        self.integer = False
        self.outputs = None
        self.out_min = math.inf
        self.out_max = -math.inf
        self.probabilities = True

    def add_input(self, x: torch.Tensor) -> None:
        if x.dim() == 0 or x.shape[0] == 0:
            return
        self.integer = self.integer or not (x.is_floating_point() or x.is_complex())
        x = x.detach().to(torch.float64).reshape(x.shape[0], -1)
        finite = torch.isfinite(x)
        x = torch.where(finite, x, x.new_zeros(()))
        self.rows += x.shape[0]
        self.entries += x.numel()
        self.sumsq += float((x * x).sum())
        if x.shape[0] > 1:
            self.var += float(x.var(dim=0, unbiased=False).mean()) * x.shape[0]
            self.var_rows += x.shape[0]
        if self.col_sum is None and not self.mixed:
            self.col_sum, self.col_sumsq = x.sum(dim=0), (x * x).sum(dim=0)
        elif self.col_sum is not None and self.col_sum.shape == x.shape[1:]:
            self.col_sum, self.col_sumsq = self.col_sum + x.sum(dim=0), self.col_sumsq + (x * x).sum(dim=0)
        else:
            self.mixed, self.col_sum, self.col_sumsq = True, None, None

    def _std(self) -> float:
        if self.col_sum is not None and self.rows > 1:
            mean = self.col_sum / self.rows
            return math.sqrt(max(float((self.col_sumsq / self.rows - mean * mean).clamp_min(0).mean()), 0.0))
        return math.sqrt(self.var / self.var_rows) if self.var_rows else math.nan

    def add_output(self, y: torch.Tensor) -> None:
        if y.dim() == 0 or not y.is_floating_point():
            return
        y = y.detach()
        # one output per row ([B]: a single logit or a regression target) is 1 output, not B classes (outside trial
        # 10: a batch of 32 single logits was read as 32 classes, and loss-at-chance compared the loss with log 32)
        self.outputs = int(y.shape[-1]) if y.dim() > 1 else 1
        finite = y[torch.isfinite(y)]
        if finite.numel():
            self.out_min = min(self.out_min, float(finite.min()))
            self.out_max = max(self.out_max, float(finite.max()))
        if self.probabilities:
            sums = y.to(torch.float64).sum(dim=-1)
            self.probabilities = bool(y.shape[-1] > 1 and (y >= 0).all() and ((sums - 1).abs() < 1e-3).all())

    def result(self) -> dict[str, Any]:
        rms = math.sqrt(self.sumsq / self.entries) if self.entries else math.nan
        std = self._std()
        return {
            "samples": self.rows,
            "input_integer": self.integer,
            "input_rms": math.nan if self.integer else rms,
            "input_spread": std / rms if rms > 0 else math.nan,
            "outputs": self.outputs,
            "output_min": self.out_min if self.outputs is not None else math.nan,
            "output_max": self.out_max if self.outputs is not None else math.nan,
            "output_probabilities": bool(self.outputs is not None and self.probabilities),
        }


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    if isinstance(value, Mapping):  # a Hugging Face ModelOutput (its "loss" comes first), or a dict of outputs
        logits = value.get("logits")
        if isinstance(logits, torch.Tensor):
            return logits
        return next((v for k, v in value.items() if k != "loss" and isinstance(v, torch.Tensor)), None)
    return None


#: keyword arguments that hold a model's input, as Hugging Face models name them (``model(input_ids=...)``)
_INPUT_KEYWORDS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "x", "input")


def _input_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The model's input: its first positional tensor, else the keyword argument that names the input."""
    first = _first_tensor(args)
    if first is not None or not kwargs:
        return first
    return next((kwargs[k] for k in _INPUT_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)), None)


class DataStats(SingleStepQuantity):
    """The model's input and output, and the per-sample losses, at each tracked step.

    Value (a dict), over the forward passes with gradients of the step's
    known models:

    - ``input_rms``: ``sqrt(mean(x**2))`` of the raw input (NaN for integer
      inputs such as token ids): above about 10, the inputs are not
      normalized, whatever layers follow;
    - ``input_spread``: the standard deviation over the batch (averaged over
      the features, as a root mean square) divided by ``input_rms`` (for
      integer inputs, of the ids): 0 when every row of the batch is the same
      (NaN for batches of one row);
    - ``input_integer``, ``samples`` (rows);
    (The input is the first positional tensor, or a keyword argument that
    names it, ``input_ids``, ``pixel_values``, ...; the output a tensor, the
    first of a tuple, or a mapping's ``logits``: a Hugging Face ``ModelOutput``.)

    - ``outputs``: the last dimension of the output (the number of classes
      of a classifier), ``output_min``, ``output_max``, and
      ``output_probabilities``: every row non-negative and summing to 1 (a
      softmax inside the model);
    - with ``info["individual_losses"]``: ``loss_min``, ``loss_median``,
      ``loss_max`` of the per-sample losses.

    Example::

        DataStats(linear(10))  # {"input_rms": 0.49, "input_spread": 0.71, "outputs": 10, ...}
    """

    _STATE_SKIP = SingleStepQuantity._STATE_SKIP + ("_models", "_handles", "_tally", "_armed_step")

    def __init__(self, track_schedule, verbose: bool = False):
        super().__init__(track_schedule, verbose=verbose)
        self._models: list[weakref.ref] = []
        self._handles: list[Any] = []
        self._tally: _Tally | None = None
        self._armed_step: int | None = None

    def adapt_to_models(self, models: list) -> None:
        self._remove_hooks()
        self._models = [weakref.ref(model) for model in models]

    def prepare_forward(self, global_step: int) -> None:
        """Install the hooks for ``global_step`` (once per step)."""
        if self._armed_step != global_step:
            self._armed_step, self._tally = global_step, _Tally()
        if self._handles:
            return
        for model in (ref() for ref in self._models):
            if model is None:
                continue
            module = unwrap(model)
            # (a forward hook: it sees the call's inputs too, and it is installed in time for the first
            # call of the step, which a pre-hook added from the root's own pre-hook would miss)
            self._handles.append(module.register_forward_hook(self._after, with_kwargs=True))

    def _after(self, module, args, kwargs, output):
        if in_rerun() or not torch.is_grad_enabled() or self._tally is None:  # (not the cockpit's own re-runs)
            return
        x, y = _input_of(args, kwargs), _first_tensor(output)
        if x is not None:
            self._tally.add_input(x)
        if y is not None:
            self._tally.add_output(y)

    def skip(self, global_step: int) -> None:
        self._remove_hooks()
        self._tally, self._armed_step = None, None

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _compute(self, global_step, params, batch_loss):
        tally = self._tally if self._armed_step == global_step else None
        self._remove_hooks()
        self._tally, self._armed_step = None, None
        value = tally.result() if tally is not None and tally.rows else {}
        record = context.get_record(global_step)
        losses = record.info.get("individual_losses") if isinstance(record.info, dict) else None
        if isinstance(losses, torch.Tensor) and losses.numel():
            flat = losses.detach().reshape(-1).to(torch.float64)
            flat = flat[torch.isfinite(flat)]
            if flat.numel():
                value.update(loss_min=float(flat.min()), loss_median=float(flat.median()),
                             loss_max=float(flat.max()))
        return value or None
