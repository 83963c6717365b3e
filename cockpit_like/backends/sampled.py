"""The Monte-Carlo GGN diagonal on any model, from labels sampled from the model's predictions.

For a cross-entropy loss that is the mean over ``N`` positions (rows, or
rows times tokens), ``L = (1/N) sum_n CE(f_n, y_n)``, the generalized
Gauss-Newton matrix is ``G = (1/N) sum_n J_n^T (diag(p_n) - p_n p_n^T) J_n``
with ``p_n = softmax(f_n)``. With labels ``ŷ_n`` drawn from ``p_n`` (the
cockpit's generator, seeded per step: :mod:`cockpit_like.backends.randomness`), ``s_n = p_n - e_ŷn`` has ``E[s_n s_n^T] = diag(p_n) - p_n p_n^T``, so for
the sampled loss ``L~ = (1/N) sum_n CE(f_n, ŷ_n)`` and its per-row gradients
``gb_i`` (rows ``i``, each summing its positions, ``gb_i = (1/N) sum_t J_it^T s_it``),

    E[ N sum_i gb_i ** 2 ] = diag(G)

(the cross terms between positions of a row vanish in expectation: their
labels are drawn independently). :class:`SampledGGNDiagonal` computes
``N sum_i gb_i ** 2``, averaged over ``samples`` draws, with a second
backward pass through the step's graph in which the hook backend reduces
the per-row gradients to their sum of squares. It reads ``info["outputs"]``
(the logits the loss is computed from, classes in the last dimension).

May import torch and :mod:`cockpit_like.backends`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cockpit_like.backends.per_sample_stats import SumOfSquares
from cockpit_like.backends.randomness import generator

__all__ = ["SampledGGNDiagonal", "GGNDiagonal", "logits_from_info", "sample_cross_entropy", "looks_like_mean_cross_entropy"]


def logits_from_info(info: dict, what: str) -> torch.Tensor:
    """``info["outputs"]`` as ``[N, C]`` logits, or a clear error naming ``what`` needs them."""
    outputs = info.get("outputs")
    if not isinstance(outputs, torch.Tensor) or outputs.dim() < 2 or not outputs.requires_grad:
        raise ValueError(
            f"{what} needs info['outputs']: the logits the cross-entropy loss is computed from, with "
            "their graph, classes in the last dimension (got "
            f"{type(outputs).__name__}"
            f"{'' if not isinstance(outputs, torch.Tensor) else ' of shape ' + str(list(outputs.shape))})"
        )
    return outputs.reshape(-1, outputs.shape[-1])


def sample_cross_entropy(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` ``[N, C]`` with labels drawn from ``softmax(logits)`` by ``generator``."""
    with torch.no_grad():
        labels = torch.multinomial(torch.softmax(logits.detach(), dim=1), 1, generator=generator).squeeze(1)
    return torch.nn.functional.cross_entropy(logits, labels)


@dataclass(frozen=True)
class SampledGGNDiagonal:
    """Need: the one-sample (``samples``-sample) Monte-Carlo GGN diagonal of a mean cross-entropy loss."""

    samples: int = 1

    def compute(self, execution) -> list[torch.Tensor]:
        logits = logits_from_info(execution.info, "curvature='diag_ggn_mc' on a model BackPACK cannot handle")
        positions = logits.shape[0]
        total = None
        # the logits' sum in the seed: each backward pass of the step (micro-batch) draws its own labels
        draws = generator(execution.step, "sampled ggn labels", logits.device, float(logits.detach().sum()))
        for _ in range(self.samples):
            sampled = sample_cross_entropy(logits, draws)
            squares = execution.per_sample_pass(sampled, [SumOfSquares()])[SumOfSquares()]
            total = squares if total is None else [t.add_(s) for t, s in zip(total, squares)]
        return [t.mul_(positions / self.samples) for t in total]

    def across_ranks(self, result, reduction):
        """Under DDP: the batch-weighted mean of the ranks' estimates (each from its own sampled labels:
        an unbiased estimate of the global batch's diagonal, not the one a single process would draw)."""
        parts = [reduction.mean(d) for d in result]
        return lambda: [part() for part in parts]


def looks_like_mean_cross_entropy(loss, outputs: torch.Tensor) -> bool | None:
    """Whether ``loss`` is a mean cross-entropy of ``outputs`` (logits, classes last), from its gradient.

    For ``L = (1/N) sum_n CE(f_n, y_n)`` with any label distributions ``y_n``
    (hard labels, label smoothing), ``∂L/∂f_n = (p_n - y_n) / N``; so over the
    ``N`` rows with a gradient (positions a loss ignores have none),
    ``y_n = p_n - N ∂L/∂f_n`` must be a distribution: entries in ``[0, 1]``,
    summing to 1. One backward pass from ``loss`` to ``outputs`` only (the
    loss's own operations; the graph is kept). ``None``: cannot tell (no loss
    tensor, or ``outputs`` is not the tensor the loss was computed from).
    """
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or loss.numel() != 1:
        return None
    try:
        (gradient,) = torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)
    except RuntimeError:
        return None
    if gradient is None:
        return None
    classes = outputs.shape[-1]
    gradient = gradient.detach().reshape(-1, classes).to(torch.float64)
    probs = torch.softmax(outputs.detach().reshape(-1, classes).to(torch.float64), dim=1)
    used = gradient.abs().amax(1) > 0
    rows = int(used.sum())
    if rows == 0:
        return None
    labels = probs[used] - rows * gradient[used]
    tolerance = 1e-3 if outputs.dtype in (torch.float32, torch.float64) else 5e-2
    return bool(
        (labels > -tolerance).all() and (labels < 1 + tolerance).all()
        and ((labels.sum(1) - 1).abs() < tolerance).all()
    )


def _outside_outputs(outputs: torch.Tensor, params: list) -> list[int]:
    """Indices of the tracked parameters that got a gradient at this step but that ``outputs`` do not depend on
    (a walk of the autograd graph from the outputs to its leaves; nothing is computed)."""
    reached, seen = set(), set()
    stack = [getattr(outputs, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return [i for i, p in enumerate(params) if p.requires_grad and p.grad is not None and id(p) not in reached]


@dataclass(frozen=True)
class GGNDiagonal:
    """Need: the GGN diagonal of a mean cross-entropy loss over ``info["outputs"]``, positive, on any model.

    ``G = (1/N) sum_n J_n^T H_n J_n`` with ``H_n = diag(p_n) - p_n p_n^T`` (``p_n = softmax(f_n)``, ``N``
    positions). A root ``S_n = diag(sqrt p_n) - p_n sqrt(p_n)^T`` (``S_n S_n^T = H_n``) has the columns
    ``s_nc = sqrt(p_nc) (e_c - p_n)``.

    - **exact** where the outputs are ``[B, C]`` (one position per row, so a row's gradient is one
      ``J_n^T s``) and ``C <= max_classes``: one hook-only backward pass per class ``c`` of the surrogate
      ``sum_n <s_nc, f_n>`` (``s_nc`` without graph); the per-row sums of squares summed over ``c`` and
      divided by ``N`` are ``diag(G)``;
    - else **sketched**: ``samples`` draws of ``s_n = S_n xi_n`` with Rademacher ``xi_n`` (entries +-1,
      the cockpit's generator), ``E[s_n s_n^T] = H_n``; one hook-only backward pass of ``sum_n <s_n, f_n>``
      per draw, whose per-row gradients ``gb_i = sum_{t in row i} J_t^T s_t`` give
      ``(1/N) sum_i gb_i ** 2``: unbiased for ``diag(G)`` (the positions of a row draw independently),
      ``>= 0`` for every draw. Unlike labels sampled from ``p_n`` (``"diag_ggn_mc"``: a class ``c`` weighs
      in only when it is drawn, with probability ``p_nc``), every class weighs in at every draw, with
      ``xi_c^2 = 1``: on a single position the head's rows are exact, and the relative spread of rare
      classes does not grow like ``1 / p_nc`` (large vocabularies). ``S_n xi_n`` is
      ``sqrt(p) * xi - p <sqrt(p), xi>``: no ``C x C`` matrix.

    Result: a :class:`~cockpit_like.backends.hvp.DiagonalEstimate` (one tensor per tracked parameter) with
    ``cross_entropy`` (:func:`looks_like_mean_cross_entropy` of ``info["loss"]``: False where the loss is
    not a mean cross-entropy of the outputs, so this GGN is not the loss's), ``exact`` (bool), ``errors`` (``{"block_errors", "trace_error"}``, standard errors of the block traces
    and of the total from the draws; zeros where exact) and ``draws`` (the draws' diagonals, for the
    standard error of a function of the whole diagonal such as TICDiag; ``[]`` where exact). Cost: ``C``
    or ``samples`` hook-only backward passes through the step's graph (``create_graph``); the draws are
    kept until the step's quantities are computed (``samples`` parameter-sized tensors).
    """

    samples: int = 4
    max_classes: int = 10

    def compute(self, execution):
        what = "TIC's GGN diagonal (curvature='auto' on a model BackPACK cannot handle)"
        logits = logits_from_info(execution.info, what)
        outputs = execution.info["outputs"]
        positions, classes = logits.shape
        count = len(execution.params)
        checked = looks_like_mean_cross_entropy(execution.info.get("loss"), outputs)
        outside = _outside_outputs(outputs, execution.params)
        if outside:  # the loss has terms that do not pass through the outputs: this GGN is not its curvature
            from cockpit_like.backends.hvp import DiagonalEstimate

            result = DiagonalEstimate(torch.zeros_like(p) for p in execution.params)
            names = getattr(execution, "names", {}) or {}
            result.outside = [names.get(id(execution.params[i]), f"#{i}") for i in outside]
            result.cross_entropy, result.exact, result.draws, result.errors = checked, False, None, None
            return result
        result = self._diagonal(execution, logits, outputs, positions, classes, count)
        result.cross_entropy = checked
        return result

    def _diagonal(self, execution, logits, outputs, positions, classes, count):
        from cockpit_like.backends.hvp import DiagonalEstimate, _standard_errors
        from cockpit_like.functional.loss_hessian import loss_hessian_sqrt

        if outputs.dim() == 2 and classes <= self.max_classes:
            roots = loss_hessian_sqrt(logits, "cross_entropy")  # [N, C, C], columns s_nc
            total = None
            for c in range(classes):
                squares = execution.per_sample_pass((logits * roots[:, :, c]).sum(), [SumOfSquares()])[SumOfSquares()]
                total = squares if total is None else [t.add_(s) for t, s in zip(total, squares)]
            result = DiagonalEstimate(t.div_(positions) for t in total)
            result.exact, result.draws = True, []
            result.errors = {"block_errors": [0.0] * count, "trace_error": 0.0}
            return result
        with torch.no_grad():
            probs = torch.softmax(logits.detach(), dim=1)
            roots = probs.sqrt()
        draws = generator(execution.step, "ggn diagonal signs", logits.device, float(logits.detach().sum()))
        samples = []
        for _ in range(self.samples):
            with torch.no_grad():
                signs = torch.randint(0, 2, logits.shape, device=logits.device, generator=draws).to(logits.dtype)
                sketch = roots * signs.mul_(2).sub_(1)
                sketch = sketch - probs * sketch.sum(1, keepdim=True)  # S_n xi_n
            squares = execution.per_sample_pass((logits * sketch).sum(), [SumOfSquares()])[SumOfSquares()]
            samples.append([s.div_(positions) for s in squares])
        result = DiagonalEstimate(torch.stack(column).mean(0) for column in zip(*samples))
        blocks = torch.tensor([[float(s.sum()) for s in draw] for draw in samples], dtype=torch.float64)
        result.exact, result.draws = False, samples
        result.errors = _standard_errors(blocks)
        return result

    def across_ranks(self, result, reduction):
        """Under DDP or micro-batches: the batch-weighted mean of the parts' diagonals (each part's own
        draws: unbiased for the whole batch's diagonal); the standard errors are not combined (none kept)."""
        parts = [reduction.mean(d) for d in result]
        return lambda: [part() for part in parts]
