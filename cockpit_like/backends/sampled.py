"""The Monte-Carlo GGN diagonal on any model, from labels sampled from the model's predictions.

For a cross-entropy loss that is the mean over the ``N`` positions it counts (rows, or
rows times tokens; an ignored position has no gradient and is left out), ``L = (1/N) sum_n CE(f_n, y_n)``, the generalized
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

from cockpit_like.backends.per_sample_stats import SquaredNorms, SumOfSquares
from cockpit_like.backends.randomness import generator
from cockpit_like.functional.student_t import student_t_factor

__all__ = ["SampledGGNDiagonal", "GGNDiagonal", "sketch_standard_errors", "logits_from_info", "sample_cross_entropy", "looks_like_mean_cross_entropy",
           "mean_cross_entropy_check"]


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


def sample_cross_entropy(logits: torch.Tensor, generator: torch.Generator | None = None, counted=None) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` ``[N, C]`` with labels drawn from ``softmax(logits)`` by ``generator``
    (with ``counted``, a ``[N]`` bool mask: the mean over those positions; a label is drawn for every one)."""
    with torch.no_grad():
        labels = torch.multinomial(torch.softmax(logits.detach(), dim=1), 1, generator=generator).squeeze(1)
    if counted is None:
        return torch.nn.functional.cross_entropy(logits, labels)
    return torch.nn.functional.cross_entropy(logits, labels.masked_fill(~counted.to(labels.device), -100))


@dataclass(frozen=True)
class SampledGGNDiagonal:
    """Need: the one-sample (``samples``-sample) Monte-Carlo GGN diagonal of a mean cross-entropy loss."""

    samples: int = 1
    #: computed from per-sample rows of a backward pass of its own (none where a module couples the rows)
    per_sample_rows = True

    def compute(self, execution) -> list[torch.Tensor]:
        logits = logits_from_info(execution.info, "curvature='diag_ggn_mc' on a model BackPACK cannot handle")
        checks, counted = _loss_checks(execution, execution.info["outputs"])
        refused = _refused(checks, execution.params)  # not this loss's curvature: nothing computed
        if refused is not None:
            return _with_checks(refused, checks)
        positions = logits.shape[0] if counted is None else int(counted.sum())
        total = None
        # the logits' sum in the seed: each backward pass of the step (micro-batch) draws its own labels
        draws = generator(execution.step, "sampled ggn labels", logits.device, float(logits.detach().sum()))
        for _ in range(self.samples):
            sampled = sample_cross_entropy(logits, draws, counted)
            squares = execution.per_sample_pass(sampled, [SumOfSquares()])[SumOfSquares()]
            total = squares if total is None else [t.add_(s) for t, s in zip(total, squares)]
        from cockpit_like.backends.hvp import DiagonalEstimate

        return _with_checks(DiagonalEstimate(t.mul_(positions / self.samples) for t in total), checks)

    def across_ranks(self, result, reduction):
        """Under DDP: the batch-weighted mean of the ranks' estimates (each from its own sampled labels:
        an unbiased estimate of the global batch's diagonal, not the one a single process would draw), with
        the checks of every part (:func:`_merged_verdict`)."""
        return _merged_verdict(result, reduction)


def looks_like_mean_cross_entropy(loss, outputs: torch.Tensor, losses=None) -> bool | None:
    """Whether ``loss`` is a plain mean cross-entropy of ``outputs`` (logits, classes last), from its gradient
    and its value; the verdict of :func:`mean_cross_entropy_check` (which also says why not)."""
    return mean_cross_entropy_check(loss, outputs, losses)[0]


def mean_cross_entropy_check(loss, outputs: torch.Tensor, losses=None) -> tuple[bool | None, str | None]:
    """``(verdict, why not)`` of :func:`_cross_entropy_check` (see there)."""
    return _cross_entropy_check(loss, outputs, losses)[:2]


def _unused_outputs(outputs: torch.Tensor, losses) -> tuple[bool | None, str | None, None]:
    """The verdict where ``info["loss"]`` does not depend on ``info["outputs"]`` (see :func:`_cross_entropy_check`):
    ``False`` with why where ``outputs`` cannot be the logits of the batch's loss, else ``None`` (cannot tell)."""
    shape = list(outputs.shape)  # (outputs without a graph never get here: logits_from_info refuses them)
    if isinstance(losses, torch.Tensor) and losses.dim() == 1 and losses.numel() not in shape[:-1]:
        return False, (
            f"info['outputs'] has shape {shape}, and no dimension but the last holds the batch's "
            f"{losses.numel()} rows (info['individual_losses']): pass the logits of the whole batch, the tensor the "
            "loss function received"
        ), None
    values = outputs.detach().reshape(-1, shape[-1]).to(torch.float64)
    if values.numel() and bool((values >= 0).all()) and bool(((values.sum(1) - 1).abs() <= 1e-6).all()):
        return False, (
            "info['outputs'] are probabilities (every row non-negative and summing to 1), not logits: pass the "
            "logits (before softmax)"
        ), None
    return None, None, None


def _cross_entropy_check(loss, outputs: torch.Tensor, losses=None) -> tuple[bool | None, str | None, torch.Tensor | None]:
    """``(verdict, why not)``: whether ``loss`` is a plain mean cross-entropy of ``outputs`` (logits, classes last).

    For ``L = (1/N) sum_n CE(f_n, y_n)`` with any label distributions ``y_n``
    (hard labels, label smoothing, soft labels), ``∂L/∂f_n = (p_n - y_n) / N``; so over the
    ``N`` rows with a gradient (positions a loss ignores have none),

    1. **the gradient**: ``y'_n = p_n - N ∂L/∂f_n`` must be a distribution: entries in ``[0, 1]``, summing
       to 1 (an MSE or a sum-reduced loss fails here);
    2. **the value**: the loss must be the cross-entropy of those labels, ``(1/N) sum_n -<y'_n, log p_n>``,
       and with ``losses`` (``info["individual_losses"]``, ``[B]``) each row's loss its share
       ``(B/N) sum_{t in row} -<y'_t, log p_t>`` (``[B, C]`` outputs: the row's own cross-entropy; ``[B, T, C]``:
       its positions' mean where every position counts). A weighted cross-entropy (class weights, ``0.5 * CE``)
       ``w_n CE(f_n, y_n)`` with ``w_n <= 1`` has the gradient of the labels ``(1 - w_n) p_n + w_n y_n``, a
       distribution, but the loss is ``(1 - w_n) H(p_n)`` below their cross-entropy, and its curvature is
       ``w_n`` times the cross-entropy's; distillation ``a T^2 KL(q_T || softmax(f / T)) + (1 - a) CE`` passes
       step 1 too. Step 2 tells them apart (to the tolerance of step 1, relative to the row's loss plus the
       entropy of ``p_n``; in half precision, 5%, a weight within a few percent of 1 can pass). A loss that
       differs from the cross-entropy by a constant has its curvature but fails too (a KL divergence to
       soft labels, ``CE - H(y)``): the value cannot tell a constant from a weight, so it is refused.

    One backward pass from ``loss`` to ``outputs`` only (the loss's own operations; the graph is kept).
    ``None``: cannot tell (no loss tensor, or ``outputs`` is not the tensor the loss was computed from).
    The reason is a sentence fragment for the step's note (``None`` where the verdict is not False); the
    third entry the positions the loss counts (``[N_all]`` bool, those with a gradient; ``None`` where the
    verdict is ``None``): the mean is over them, so the GGN is ``(1/N) sum`` over them only.
    """
    return cross_entropy_verdict(loss, outputs, losses, outputs_gradient(loss, outputs))


def outputs_gradient(loss, outputs: torch.Tensor, create_graph: bool = False) -> torch.Tensor | None:
    """``dL/doutputs`` by one backward pass through the loss's own operations (the step's graph is kept; the
    user's hooks sit it out), with its own graph where ``create_graph``; ``None`` where ``loss`` is not a
    scalar with a graph or does not depend on ``outputs``."""
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or loss.numel() != 1:
        return None
    from cockpit_like.backends.user_state import own_backward

    try:
        with own_backward():  # the user's hooks on the loss and the outputs sit it out (outside trial 31)
            (gradient,) = torch.autograd.grad(
                loss, outputs, retain_graph=True, create_graph=create_graph, allow_unused=True
            )
    except RuntimeError:
        return None
    return gradient


def _spacing(dtype: torch.dtype) -> float:
    """The relative spacing of a floating dtype (0 for the others: they never set the precision)."""
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


#: how :func:`cross_entropy_verdict`'s reason starts where the loss is a mean cross-entropy of the outputs with
#: their dimension 1 moved last (the cause found: the notes say nothing else)
CLASSES_IN_DIM_1 = "its classes are in dimension 1"


def cross_entropy_verdict(loss, outputs: torch.Tensor, losses, gradient: torch.Tensor | None):
    """:func:`_cross_entropy_check` given the gradient :func:`outputs_gradient` found (the same three entries).

    Where float64 logits fail it but pass at float32's tolerance, the loss was most likely computed in float32 from
    them and cast back (``F.cross_entropy(out.float(), y).double()``: its dtype does not tell): still refused (a
    weighted cross-entropy within 1e-6 of the plain one passes that tolerance too, outside trial 10), with that
    reason and its fix (outside trial 34: the generic reason's advice could not help)."""
    verdict = _cross_entropy_verdict(loss, outputs, losses, gradient)
    if verdict[0] is False and outputs.dim() >= 3 and gradient is not None and outputs.shape[1] > 1:
        # classes in dim 1, F.cross_entropy's layout for sequences and images (outside trial 39: told only among the
        # losses it could be, "(classes last)" the one hint)
        moved = _cross_entropy_verdict(loss, outputs.movedim(1, -1), losses, gradient.movedim(1, -1))
        if moved[0] is True:
            return False, (
                f"{CLASSES_IN_DIM_1} (shape {list(outputs.shape)}, F.cross_entropy's layout for "
                "sequences and images), where the GGN reads them last: the loss is a mean cross-entropy of "
                "info['outputs'].movedim(1, -1). Pass that as info['outputs'] (out.transpose(1, 2) for [B, C, T])"
            ), verdict[2]
    if verdict[0] is False and outputs.dtype == torch.float64 and gradient is not None and gradient.dtype == torch.float64:
        coarse = _cross_entropy_verdict(loss, outputs, losses, gradient, tolerance=1e-3)
        if coarse[0] is True:
            return False, (
                "it fits a mean cross-entropy of these float64 logits only to float32's rounding (within 1e-3, not "
                "the 1e-9 of float64): most likely the loss was computed in float32 from them (.float(), autocast) "
                "and cast back, whose dtype does not show it. Pass the float32 tensor the loss reads as "
                "info['outputs'] (logits32 = out.float(); loss from logits32), or compute the loss in float64"
            ), verdict[2]
    return verdict


def _cross_entropy_verdict(loss, outputs: torch.Tensor, losses, gradient: torch.Tensor | None, tolerance=None):
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None or loss.numel() != 1:
        return None, None, None
    if gradient is None:
        # info['outputs'] is not upstream of info['loss']: a view of the logits the loss read (an LM's
        # logits[:, :-1], shifted again inside the loss) is fine; what is not (outside trial 10: 8 of 16 rows, or
        # softmax probabilities, gave a TIC 100x off and no note) is told apart where it can be
        return _unused_outputs(outputs, losses)
    classes = outputs.shape[-1]
    # the loss's precision is the coarsest of the outputs', the gradient's and the loss's own: Hugging Face computes
    # its loss from logits.float(), a float32 loss of float64 logits whose gradient carries float32's rounding
    # (outside trial 33: every step of a float64 GPT-2 said its loss was not a mean cross-entropy)
    precision = max((outputs.dtype, gradient.dtype, loss.dtype), key=_spacing)
    half = precision in (torch.float16, torch.bfloat16)
    finfo = torch.finfo(precision)
    gradient = gradient.detach().reshape(-1, classes).to(torch.float64)
    log_probs = torch.log_softmax(outputs.detach().reshape(-1, classes).to(torch.float64), dim=1)
    probs = log_probs.exp()
    used = gradient.abs().amax(1) > 0
    rows = int(used.sum())
    if rows == 0:
        return None, None, None
    labels = probs[used] - rows * gradient[used]
    # float64: the loss's own operations round at 1e-16, so 1e-9 (a weighted cross-entropy on confident rows
    # differs from the labels' by (1 - w) H(p), 1e-6 of the loss at logits of 30: outside trial 10 passed 1e-3)
    if tolerance is None:
        tolerance = {torch.float64: 1e-9, torch.float32: 1e-3}.get(precision, 5e-2)
    if not (
        (labels > -tolerance).all() and (labels < 1 + tolerance).all()
        and ((labels.sum(1) - 1).abs() < tolerance).all()
    ):
        positions = (
            "; with [B, T, C] logits also the mean of each row's own token mean where rows count different numbers "
            "of positions (ignored or padded tokens), which weighs a position by 1 / (B T_b), not 1 / N: give each "
            "row its token sum times B / N, N the batch's counted positions (docs/your_model.md, 'Padding or "
            "ignored tokens')"
        ) if outputs.dim() >= 3 else ""
        return False, (
            "its gradient in the outputs is not (softmax - labels) / N for any labels, soft labels included (an "
            f"MSE, a sum-reduced loss, another loss{positions})"
        ), used
    # the value: the labels' cross-entropy at every position with a gradient
    cross = torch.zeros(used.shape[0], dtype=torch.float64, device=labels.device)
    cross[used] = -(labels * log_probs[used]).sum(1)
    spread = torch.zeros_like(cross)  # H(p_n): what a weighted cross-entropy's value lacks, (1 - w) H(p_n)
    spread[used] = -(probs[used] * log_probs[used]).sum(1)
    value = float(loss.detach().to(torch.float64))
    scale = abs(value) + float(spread.sum()) / rows
    mean_cross = float(cross.sum()) / rows
    if abs(mean_cross - value) > tolerance * scale:
        return False, (
            f"its gradient fits the labels y' = softmax - N dL/doutputs, but the loss, {value:.6g}, is not their "
            f"mean cross-entropy, {mean_cross:.6g}"
        ), used
    if not (isinstance(losses, torch.Tensor) and losses.dim() == 1 and losses.numel() > 0):
        return True, None, used
    batch = losses.numel()
    shape = tuple(outputs.shape[:-1])
    dims = [d for d, size in enumerate(shape) if size == batch]
    if not dims:  # no dimension of the outputs holds the rows (flattened positions): the mean is checked
        return True, None, used
    given = losses.detach().to(torch.float64).to(cross.device)
    # what the gradient's own rounding does to a position's labels' cross-entropy: in half precision a confident
    # row's (p - y) / N is below float16's normal range (subnormal: a few bits), so its labels are off by up to N
    # times the spacing there, each weighted by |log p| (a row loss of 3e-4 read as 4e-4, found outside the tests)
    resolution = torch.zeros_like(cross)
    if half:
        spacing = torch.maximum(finfo.eps * gradient[used].abs(), gradient.new_tensor(finfo.smallest_normal * finfo.eps))
        resolution[used] = (rows * spacing * log_probs[used].abs()).sum(1)
    worst = None
    for dim in dims:  # the rows' dimension (batch first, or sequence first where that fits)
        others = [d for d in range(len(shape)) if d != dim]

        def per_row(values):
            values = values.reshape(shape)
            return (values.sum(others) if others else values) * (batch / rows)

        row_cross, row_spread = per_row(cross), per_row(spread)
        off = (row_cross - given).abs() - tolerance * (given.abs() + row_spread) - per_row(resolution)
        if bool((off <= 0).all()):
            return True, None, used
        row = int(off.argmax())
        if worst is None:
            worst = (row, float(given[row]), float(row_cross[row]))
    row, given_row, cross_row = worst
    return False, (
        f"its gradient fits the labels y' = softmax - N dL/doutputs, but the rows' losses are not their "
        f"cross-entropies (row {row}: info['individual_losses'] {given_row:.6g}, the labels' cross-entropy "
        f"{cross_row:.6g})"
    ), used


def _leaves(tensor) -> set[int]:
    """``id`` of every leaf tensor the autograd graph of ``tensor`` reaches (a walk; nothing is computed)."""
    reached, seen = set(), set()
    stack = [getattr(tensor, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return reached


def _outside_outputs(outputs: torch.Tensor, params: list, loss=None) -> list[int]:
    """Indices of the tracked parameters that the loss depends on (its graph reaches them; without a loss
    tensor: they got a gradient) but that ``outputs`` do not (walks of the autograd graphs; nothing is
    computed). A parameter this pass does not use (an expert without tokens in this micro-batch) is not one."""
    reached = _leaves(outputs)
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
        used = _leaves(loss)
        return [i for i, p in enumerate(params) if p.requires_grad and id(p) in used and id(p) not in reached]
    return [i for i, p in enumerate(params) if p.requires_grad and p.grad is not None and id(p) not in reached]


def _loss_checks(execution, outputs: torch.Tensor) -> dict:
    """Whether the GGN of the cross-entropy of ``outputs`` is the loss's curvature at this pass: the
    attributes the result carries (``cross_entropy``: :func:`mean_cross_entropy_check`'s verdict,
    ``not_cross_entropy``: why not, ``outside_indices`` / ``outside``: the parameters the loss reaches other
    than through the outputs, ``names``: every tracked parameter's, for the merge), and the positions the
    loss counts (``None``: all)."""
    info, params = execution.info, execution.params
    checked, why_not, counted = _cross_entropy_check(info.get("loss"), outputs, info.get("individual_losses"))
    outside = _outside_outputs(outputs, params, info.get("loss"))
    names = getattr(execution, "names", {}) or {}
    labels = [names.get(id(p), f"#{i}") for i, p in enumerate(params)]
    checks = {"cross_entropy": checked, "not_cross_entropy": why_not, "outside_indices": outside,
              "outside": [labels[i] for i in outside], "names": labels}  # fmt: skip
    return checks, counted


def _refused(checks: dict, params: list):
    """Zeros where ``checks`` say this GGN is not the loss's curvature (no value is stored at the step, so
    nothing is computed), else ``None``."""
    if checks["cross_entropy"] is not False and not checks["outside_indices"]:
        return None
    from cockpit_like.backends.hvp import DiagonalEstimate

    result = DiagonalEstimate(torch.zeros_like(p) for p in params)
    result.exact, result.draws, result.errors = False, None, None
    return result


def _with_checks(result, checks: dict):
    for key, value in checks.items():
        setattr(result, key, value)
    return result


def _merged_verdict(result, reduction, draws: int = 0):
    """The batch-weighted mean of the parts' diagonals, and their checks: the loss is not a mean cross-entropy
    of the outputs if it is not in one part (micro-batch or rank), and a parameter outside the outputs in one
    part is outside in the merged result (one small sum rides along with the diagonals).

    ``draws``: the number of sketched draws of every part (0: the estimator is exact, or has no draws). Draw
    ``k`` of the step is then the batch-weighted mean of the parts' draws ``k``: the parts draw independently,
    so the step's ``draws`` are i.i.d. and unbiased for its diagonal as one batch's are, and their spread (and
    the rows' parts of each, concatenated) gives the step its standard errors (outside trial 28: a sketched
    TIC under gradient accumulation was stored with none, 8.5% off in the median and 35% at worst). A part
    that computed nothing (refused: the merged result is then refused too) adds zeros."""
    from cockpit_like.backends.hvp import DiagonalEstimate

    parts = [reduction.mean(d) for d in result]
    own = getattr(result, "draws", None) or []
    merged_draws, merged_rows = [], None
    if draws:
        sketched = len(own) == draws
        for k in range(draws):
            merged_draws.append([reduction.mean(t if sketched else torch.zeros_like(d)) for t, d in
                                 zip(own[k] if sketched else result, result)])
        rows = getattr(result, "row_traces", None) if sketched else None
        if rows is None:
            rows = torch.zeros(draws, reduction.local_batch, dtype=torch.float64)
        merged_rows = reduction.cat(rows.to(torch.float64).T * reduction.local_batch)  # [rows, draws]
    count = len(result)
    flags = torch.zeros(count + 2, dtype=torch.float64)
    for index in getattr(result, "outside_indices", ()):
        flags[index] = 1.0
    verdict = getattr(result, "cross_entropy", None)
    flags[count], flags[count + 1] = float(verdict is False), float(verdict is None)
    merged_flags = reduction.sum(flags)
    names = getattr(result, "names", None) or [f"#{i}" for i in range(count)]
    reason = getattr(result, "not_cross_entropy", None)

    def finish():
        merged = DiagonalEstimate(part() for part in parts)
        seen = merged_flags.value
        outside = [i for i in range(count) if float(seen[i]) > 0]
        merged.outside_indices, merged.outside, merged.names = outside, [names[i] for i in outside], names
        merged.cross_entropy = False if float(seen[count]) > 0 else (None if float(seen[count + 1]) > 0 else True)
        merged.not_cross_entropy = None
        if draws:
            merged.draws = [[part() for part in draw] for draw in merged_draws]
            merged.row_traces = merged_rows.value.T / reduction.batch
            blocks = torch.tensor([[float(t.sum()) for t in draw] for draw in merged.draws], dtype=torch.float64)
            merged.exact, merged.errors = False, sketch_standard_errors(blocks, merged.row_traces)
        elif getattr(result, "exact", None):
            merged.exact, merged.draws = True, []
            merged.errors = {"block_errors": [0.0] * count, "trace_error": 0.0}
        if merged.cross_entropy is False:
            merged.not_cross_entropy = reason or (
                "in another micro-batch or rank of the step it is not (its gradient in the outputs or its value "
                "does not fit a cross-entropy of them)"
            )
        return merged

    return finish


def sketch_standard_errors(blocks: torch.Tensor, row_traces: torch.Tensor | None = None) -> dict:
    """Standard errors of the sketched GGN's block traces and total from ``K`` draws, honest at ``K = 4``.

    ``blocks``: ``[K, params]`` each draw's block traces; ``row_traces``: ``[K, rows]`` each row's part of
    each draw's total (the rows draw their signs independently, so the total's variance is the sum of the
    rows'). The samples' standard deviation over ``sqrt(K)`` from 4 numbers is itself so noisy that the
    exact value fell outside 3 errors on 8-10% of the draws (once 22 errors away), while the mean over
    draws is unbiased. So each error is widened by the Student-t factor of ``K - 1`` degrees of freedom
    (:func:`~cockpit_like.functional.student_t.student_t_factor`: ``+- 2`` errors is then the t interval of
    95.45%; 1.65 for 4 draws), and the total's is the larger of that and the rows' pooled variance
    ``sum_i var_k(row_traces[:, i]) / K``, widened by the factor of its Satterthwaite degrees of freedom
    ``(sum_i v_i)^2 / sum_i (v_i^2 / (K - 1))`` (steadier: it averages the rows' spreads). NaN below 2 draws.

    Returns:
        ``{"block_errors", "trace_error", "sample_errors", "row_errors"}`` (the last two for comparison: the
        samples' plain standard errors, and the rows' pooled one, unwidened).
    """
    count = blocks.shape[0]
    if count < 2:
        nan = float("nan")
        plain = {"block_errors": [nan] * blocks.shape[1], "trace_error": nan}
        return {**plain, "sample_errors": plain, "row_errors": nan}
    factor = student_t_factor(count)
    plain = {"block_errors": (blocks.std(dim=0) / count**0.5).tolist(),
             "trace_error": float(blocks.sum(1).std() / count**0.5)}
    trace_error = factor * plain["trace_error"]
    row_error = float("nan")
    if row_traces is not None and row_traces.shape[0] == count:
        spreads = row_traces.to(torch.float64).var(dim=0)  # [rows]
        total = float(spreads.sum())
        row_error = (total / count) ** 0.5
        if total > 0:
            dof = total**2 / float((spreads.square() / (count - 1)).sum())
            trace_error = max(trace_error, row_error * student_t_factor(max(2, int(dof) + 1)))
    return {
        "block_errors": [factor * e for e in plain["block_errors"]],
        "trace_error": trace_error,
        "sample_errors": plain,
        "row_errors": row_error,
    }


@dataclass(frozen=True)
class GGNDiagonal:
    """Need: the GGN diagonal of a mean cross-entropy loss over ``info["outputs"]``, positive, on any model.

    ``G = (1/N) sum_n J_n^T H_n J_n`` with ``H_n = diag(p_n) - p_n p_n^T`` (``p_n = softmax(f_n)``, over the
    ``N`` positions the loss counts: those with a gradient; an ignored position, label ``-100``, has no
    curvature either). A root ``S_n = diag(sqrt p_n) - p_n sqrt(p_n)^T`` (``S_n S_n^T = H_n``) has the columns
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
    ``cross_entropy`` (:func:`mean_cross_entropy_check` of ``info["loss"]`` and ``info["individual_losses"]``:
    False where the loss is not a plain mean cross-entropy of the outputs, so this GGN is not the loss's; then
    ``not_cross_entropy`` says why and nothing is computed), ``exact`` (bool), ``errors`` (``{"block_errors", "trace_error"}``, standard errors of the block traces
    and of the total from the draws; zeros where exact) and ``draws`` (the draws' diagonals, for the
    standard error of a function of the whole diagonal such as TICDiag; ``[]`` where exact). Cost: ``C``
    or ``samples`` hook-only backward passes through the step's graph (``create_graph``); the draws are
    kept until the step's quantities are computed (``samples`` parameter-sized tensors).
    """

    samples: int = 4
    max_classes: int = 10
    #: computed from per-sample rows of backward passes of its own (none where a module couples the rows)
    per_sample_rows = True

    def compute(self, execution):
        what = "TIC's GGN diagonal (curvature='auto' on a model BackPACK cannot handle)"
        logits = logits_from_info(execution.info, what)
        outputs = execution.info["outputs"]
        classes = logits.shape[1]
        count = len(execution.params)
        checks, counted = _loss_checks(execution, outputs)
        result = _refused(checks, execution.params)  # not this loss's curvature: nothing computed
        if result is None:
            result = self._diagonal(execution, logits, outputs, classes, count, counted)
        # sketched or exact: the same for every part of a step (the outputs' form), refused or not
        result.sketched = not (outputs.dim() == 2 and classes <= self.max_classes) and self.samples > 0
        return _with_checks(result, checks)

    def _diagonal(self, execution, logits, outputs, classes, count, counted=None):
        from cockpit_like.backends.hvp import DiagonalEstimate
        from cockpit_like.functional.loss_hessian import loss_hessian_sqrt

        # the loss is the mean over the positions it counts (ignored ones have no gradient): G = (1/N) sum over them
        positions = logits.shape[0] if counted is None else int(counted.sum())
        weights = None if counted is None or bool(counted.all()) else counted.to(logits.dtype).unsqueeze(1)
        if outputs.dim() == 2 and classes <= self.max_classes:
            roots = loss_hessian_sqrt(logits, "cross_entropy")  # [N, C, C], columns s_nc
            if weights is not None:
                roots = roots * weights.unsqueeze(2)
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
        samples, rows = [], []
        for _ in range(self.samples):
            with torch.no_grad():
                signs = torch.randint(0, 2, logits.shape, device=logits.device, generator=draws).to(logits.dtype)
                sketch = roots * signs.mul_(2).sub_(1)
                sketch = sketch - probs * sketch.sum(1, keepdim=True)  # S_n xi_n
                if weights is not None:
                    sketch = sketch * weights
            reduced = execution.per_sample_pass((logits * sketch).sum(), [SumOfSquares(), SquaredNorms()])
            samples.append([s.div_(positions) for s in reduced[SumOfSquares()]])
            rows.append(reduced[SquaredNorms()].to(torch.float64).cpu() / positions)
        result = DiagonalEstimate(torch.stack(column).mean(0) for column in zip(*samples))
        blocks = torch.tensor([[float(s.sum()) for s in draw] for draw in samples], dtype=torch.float64)
        result.exact, result.draws = False, samples
        result.row_traces = torch.stack(rows)  # [draws, rows]: each row's part of each draw's trace
        result.errors = sketch_standard_errors(blocks, result.row_traces)
        return result

    def across_ranks(self, result, reduction):
        """Under DDP or micro-batches: the batch-weighted mean of the parts' diagonals (each part's own
        draws: unbiased for the whole batch's diagonal), and of their draws one by one where sketched (the
        step's standard errors from them; ``samples`` more parameter-sized parts to merge, at the steps that
        sketch), with the checks of every part (:func:`_merged_verdict`)."""
        return _merged_verdict(result, reduction, self.samples if getattr(result, "sketched", False) else 0)
