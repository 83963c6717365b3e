"""Hessian-vector products through the graph of ``p.grad``, and the estimators built on them.

After ``loss.backward(create_graph=True)`` each ``p.grad`` carries its graph,
so ``H v = grad_theta <grad_theta L, v>`` is one more backward pass through
it (:func:`hessian_vector_product`). This works on any model, with no BackPACK
extension: the curvature of models BackPACK cannot handle comes from here.

:class:`HutchinsonDiagonal` is a step need (merged by value like the
per-sample statistics, computed once per step after the backward pass, read
with ``record.stat(need)``): Hutchinson's estimate of the Hessian diagonal,

    d = (1/m) sum_k v_k * (H v_k),     v_k i.i.d. Rademacher (entries +-1),

unbiased for ``diag(H)``; summed over a parameter's entries it is
Hutchinson's unbiased estimate of the trace of that parameter's Hessian
block, ``E[v^T H_pp v] = tr H_pp``. Its variance per entry ``j`` is
``(1/m) sum_{k != j} H_jk^2``. The vectors come from the cockpit's own
generator, seeded per step (:mod:`cockpit_like.backends.randomness`).

May import torch only.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch

from cockpit_like.backends.user_state import held_tensor_hooks
from cockpit_like.functional.krylov import probe_asymmetry

__all__ = [
    "MissingGraphError", "NoSecondDerivativeError", "hessian_vector_product", "HutchinsonDiagonal", "DiagonalEstimate", "graph_limit",
    "curvature_params", "scatter_blocks", "fused_weight_norms",
]


class MissingGraphError(RuntimeError):
    """The gradients carry no graph, so no Hessian-vector product can be formed."""


class GraphModifiedError(RuntimeError):
    """The graph of ``p.grad`` cannot be differentiated again: parameters or gradients were changed in place after
    the backward pass (a SAM step that moves the weights and back, clipping in place) before the products ran."""


#: what a twice differentiable replacement of an operation without second derivative is, by its name's part
_REPLACEMENTS = {
    "embedding_bag": "nn.EmbeddingBag: nn.Embedding followed by .sum(1) or .mean(1) over the bag (2-D ids, "
                     "per_sample_weights as a product) computes the same and has one",
}


class NoSecondDerivativeError(RuntimeError):
    """An operation of the step's forward pass has no second derivative: no Hessian-vector product
    can go through the graph of ``p.grad``. ``operation`` is its name as PyTorch gives it (or ``None``)."""

    def __init__(self, owner: str, error: BaseException, quantities: tuple[str, ...] | None = None, step=None):
        # PyTorch says "the derivative for 'op' is not implemented" or "derivative for aten::op is not implemented"
        match = re.search(r"derivative for (?:'([^']+)'|(?:aten::)?([\w.]+))", str(error))
        self.owner, self.error, self.quantities, self.step = owner, error, quantities, step
        self.operation = (match.group(1) or match.group(2)) if match else None
        super().__init__(self._message())

    @property
    def kernel(self) -> bool:
        """Whether the operation is an attention or cuDNN kernel that the math kernels replace."""
        name = self.operation or ""
        return "attention" in name or "cudnn" in name or "miopen" in name

    def for_step(self, step: int, quantities: tuple[str, ...]) -> "NoSecondDerivativeError":
        """The same error naming the quantities of ``step`` that need Hessian-vector products."""
        return NoSecondDerivativeError(self.owner, self.error, tuple(quantities), step)

    def _message(self) -> str:
        operation = f"the operation '{self.operation}'" if self.operation else "an operation"
        where = f" of step {self.step}" if self.step is not None else ""
        head = f"{self.owner}: {operation} of this step's forward pass has no second derivative ({self.error})."
        kernel_advice = (
            " For attention the cockpit runs the forward pass of steps that need "
            "the graph with PyTorch's math attention kernel and without cuDNN (recurrent "
            "layers), which have one: pass "
            "Cockpit(..., model=model), create the cockpit before the first forward pass and "
            "number the steps 0, 1, 2, ... (the cockpit expects step s + 1 after step s). "
            "Or wrap the forward pass in `torch.nn.attention.sdpa_kernel("
            "torch.nn.attention.SDPBackend.MATH)` (and `torch.backends.cudnn.flags(enabled=False)` "
            "for recurrent layers on a GPU) yourself."
        )
        if self.kernel:
            return head + kernel_advice
        if self.quantities:
            who = f"The quantities{where} that need them: {', '.join(self.quantities)}."
        else:
            who = ("Quantities that need them: HessMaxEV, HessTrace / TICDiag / TICTrace with curvature "
                   "'hutchinson' (or 'auto' on a model BackPACK does not extend), HessEigenvalues, "
                   "HessSpectralDensity, HessTraceEstimate.")
        replacement = next((text for part, text in _REPLACEMENTS.items() if part in (self.operation or "")), None)
        return head + (
            " Hessian-vector products differentiate the backward pass again, so the curvature quantities "
            f"that use them cannot be computed on this model. {who} Leave them out (e.g. "
            "configuration('economy') has none), or track them on a model without this operation"
            + (f" ({replacement})." if replacement else ".")
            + (kernel_advice if self.operation is None else "")  # unknown: it may be an attention kernel
        )


def curvature_params(params: list[torch.Tensor]) -> list[int]:
    """The indices of the parameters the Hessian is taken with respect to: the trainable ones.

    A frozen parameter (``requires_grad=False``) has no gradient in the run, so
    the loss's derivatives with respect to it are not defined by the training:
    the curvature quantities describe the Hessian of the loss as a function of
    the trainable parameters, the frozen ones held fixed. Its eigenvalues,
    spectral density and trace are those of that matrix (no spurious zero
    eigenvalues for the frozen entries); per-parameter results (a diagonal,
    a block's trace) are zero for a frozen parameter, as its gradient is (the
    step's ``checks["frozen"]`` names it). A parameter that requires a gradient
    but gets none at the step (unused) stays in: its rows of the Hessian are zero.
    """
    return [i for i, p in enumerate(params) if p.requires_grad]


def _no_gradient(grad: torch.Tensor | None) -> bool:
    """Whether a parameter got no gradient at the step: ``p.grad`` None, or zero everywhere (a stand-in)."""
    if grad is None:
        return True
    values = grad.coalesce().values() if grad.is_sparse else grad
    return not bool(values.detach().any())


def operator_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """The dtype of the operator's vectors: the widest of the trainable parameters' (a bfloat16 body with a float32
    head: float32; each product runs in its parameter's dtype and comes back in this one)."""
    dtypes = [params[i].dtype for i in curvature_params(params)] or [params[0].dtype]
    wide = dtypes[0]
    for dtype in dtypes[1:]:
        wide = torch.promote_types(wide, dtype)
    return wide


def scatter_blocks(pieces: list[torch.Tensor], indices: list[int], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per parameter, shaped like it: ``pieces`` (flat, of ``params[indices]``) in place, zeros elsewhere."""
    out = [torch.zeros_like(p) for p in params]
    for index, piece in zip(indices, pieces):
        out[index] = piece.view_as(params[index])
    return out


def hessian_vector_product(params: list[torch.Tensor], owner: str = "HessMaxEV", *, local: bool = False):
    """``v -> H v`` by double backprop through ``p.grad``, ``v`` and ``H v`` flat over the trainable parameters
    (:func:`curvature_params`, in params order; frozen ones are left out of the operator).

    Under DistributedDataParallel (:mod:`cockpit_like.backends.distributed`)
    ``H`` is the Hessian of the global batch's mean loss: each rank's product
    through its local gradients' graph, averaged over the ranks (one
    all-reduce per product; every rank must pass the same ``v``), unless
    ``local`` (this rank's ``H_r v``, for estimators that combine their
    results once, like :class:`HutchinsonDiagonal`).

    Raises:
        MissingGraphError: no ``p.grad`` carries a graph (backward ran without
            ``create_graph=True``).
    """
    from cockpit_like.backends.distributed import global_product, graph_grads

    grads = graph_grads(params)
    trainable = curvature_params(params)
    missing = [i for i in trainable if grads[i] is None]
    if missing:
        raise RuntimeError(
            f"{owner}: parameters {missing} have no gradient after backward; pass only "
            "parameters that the loss depends on to Cockpit(params)"
        )
    live = [k for k, i in enumerate(trainable) if grads[i].requires_grad]
    if not live:
        raise MissingGraphError(
            f"{owner} needs Hessian-vector products, but the gradients carry no graph. Call "
            "`loss.backward(create_graph=cockpit.create_graph(global_step))` inside the "
            "cockpit context. (If it was called so, the gradients do not depend on the parameters: the loss is "
            "linear in them, its Hessian 0; leave the curvature quantities out for such a model.)"
        )
    inputs = [params[i] for i in trainable]
    sizes = [p.numel() for p in inputs]
    # a parameter that got no gradient at all from the step (p.grad None or zero: left out of the backward pass by
    # inputs=, or unused) is held fixed: its rows are zero, and the products are not differentiated with respect
    # to it, so the operator stays symmetric (outside trial 13: loss.backward(inputs=head) made the products
    # asymmetric and HessTrace's head block half its value). One with a gradient but no graph (a reentrant
    # activation checkpoint detaches it) is differentiated as before: PyTorch then refuses with the cause, where
    # leaving it out would give another operator silently (outside trial 14: HessMaxEV 1.77 for 5.18)
    with_graph = set(live)
    positions = [k for k, i in enumerate(trainable) if k in with_graph or not _no_gradient(grads[i])]
    differentiated = [inputs[k] for k in positions]

    def matvec(vector: torch.Tensor) -> torch.Tensor:
        pieces = vector.split(sizes)
        with warnings.catch_warnings():
            # BackPACK's (inactive) module hooks fire during double backprop and
            # torch warns that no module input requires a gradient: harmless here.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            try:
                with held_tensor_hooks(inputs):
                    found = torch.autograd.grad(
                        [grads[trainable[k]] for k in live],
                        differentiated,
                        grad_outputs=[pieces[k].reshape(inputs[k].shape).to(inputs[k].dtype) for k in live],
                        retain_graph=True,
                        allow_unused=True,
                    )
                products = [None] * len(inputs)
                for k, hv in zip(positions, found):
                    products[k] = hv
            except RuntimeError as error:
                limit = graph_limit(error, [owner])
                if limit is not None:
                    raise RuntimeError(f"{owner}: {limit}") from error
                if "derivative for" in str(error) and "not implemented" in str(error):
                    raise NoSecondDerivativeError(owner, error) from error
                if "modified by an inplace operation" not in str(error):
                    raise
                raise GraphModifiedError(
                    f"{owner}: the graph of p.grad is invalid because parameters or gradients "
                    "were modified in place after backward (by code or a quantity that runs "
                    f"before {owner} at this step). Hessian-vector products need them unchanged "
                    f"until {owner} is tracked. Original error: {error}"
                ) from error
        product = torch.cat(
            [
                (torch.zeros_like(p) if hv is None else hv.detach().to_dense() if hv.is_sparse else hv.detach())
                .reshape(-1).to(vector.dtype)
                for p, hv in zip(inputs, products)
            ]
        )
        return product if local else global_product(product)

    return matvec


def fused_weight_norms(models: list) -> list[str]:
    """Names of the weights that PyTorch's fused weight norm computes in ``models``: its double backward is wrong.

    ``torch._weight_norm(v, g, dim)`` (``torch.nn.utils.parametrizations.weight_norm`` and the older
    ``torch.nn.utils.weight_norm``) runs the fused ``_weight_norm_interface`` where ``dim`` is 0 or the last
    dimension, whose second derivative treats the norms ``||v||`` as constants: the Hessian-vector products
    through it are neither the Hessian's nor symmetric (``dim=None`` takes differentiable operations and is
    right). Named in what the curvature quantities say where their products are not symmetric.
    """
    from torch.nn.utils.parametrizations import _WeightNorm
    from torch.nn.utils.weight_norm import WeightNorm

    def fused(dim: int, v: torch.Tensor) -> bool:
        return dim == 0 or dim == v.dim() - 1

    found: list[str] = []
    for model in models:
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            for tensor, parts in getattr(module, "parametrizations", {}).items():
                v = getattr(parts, "original1", None)
                if v is not None and any(isinstance(p, _WeightNorm) and fused(p.dim, v) for p in parts):
                    found.append(prefix + tensor)
            for hook in module._forward_pre_hooks.values():
                v = getattr(module, f"{getattr(hook, 'name', '')}_v", None)
                if isinstance(hook, WeightNorm) and isinstance(v, torch.Tensor) and fused(hook.dim, v):
                    found.append(prefix + hook.name)
    return list(dict.fromkeys(found))


def graph_limit(
    error: BaseException, owners=(), what: str = "Hessian-vector products differentiate p.grad"
) -> str | None:
    """What a PyTorch feature of the model prevents, if ``error`` says that a backward pass through the step's
    graph cannot run; ``owners``: the quantities that need it (named in the advice), ``what``: the pass."""
    text = str(error)
    named = ", ".join(sorted(owners)) or "HessMaxEV, HessTrace, TICTrace with curvature='hutchinson'"
    leave = f"or leave out the quantities that need the graph ({named}; configuration('economy') needs none)."
    if "does not currently support double backward" in text or "requires create_graph=False" in text:
        return (
            "these quantities need a second backward pass through the model, which torch.compile's AOTAutograd "
            "backends (the default 'inductor', 'aot_eager') do not support. Compile with torch.compile(model, backend='eager') while these quantities are tracked, "
            + leave
        )
    if "use_reentrant=True" in text:
        return (
            f"{what} with torch.autograd.grad, which PyTorch does not allow through a reentrant activation "
            "checkpoint. Use torch.utils.checkpoint(..., use_reentrant=False) (Hugging Face: "
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), "
            + leave
        )
    return None


#: probes whose products a Hutchinson estimate compares pairwise (``v_i^T H v_j`` against ``v_j^T H v_i``), and the
#: share of their symmetric part the difference may reach (the Lanczos engine's default ``rtol``)
SYMMETRY_PROBES = 8
SYMMETRY_RTOL = 1e-2


class DiagonalEstimate(list):
    """One estimated diagonal tensor per parameter; ``errors``: the estimator's standard errors (or None);
    ``asymmetry``: ``(delta, tolerance)`` of its products (:func:`~cockpit_like.functional.krylov.probe_asymmetry`;
    None: not checked)."""

    errors: dict | None = None
    asymmetry: tuple[float, float] | None = None


def _standard_errors(blocks: torch.Tensor) -> dict:
    """``{"block_errors", "trace_error"}`` from ``[samples, params]`` i.i.d. block sums (NaN from one sample):
    the samples' standard deviation over ``sqrt(samples)``."""
    count = blocks.shape[0]
    if count < 2:
        return {"block_errors": [float("nan")] * blocks.shape[1], "trace_error": float("nan")}
    return {
        "block_errors": (blocks.std(dim=0) / count**0.5).tolist(),
        "trace_error": float(blocks.sum(1).std() / count**0.5),
    }


def product_standard_errors(blocks: torch.Tensor, energies: torch.Tensor) -> dict:
    """Standard errors of Hutchinson's block traces from the squared norms of the products, not only the samples.

    ``blocks[k, p] = v_k,p^T (A v_k)_p`` (the block sums of ``v_k * (A v_k)``,
    Rademacher ``v_k``, ``A`` symmetric) and ``energies[k, p] = ||(A v_k)_p||^2``
    (the block sums of ``(v_k * (A v_k))**2``: ``v_k`` is ``+-1``). The
    variance of one sample of block ``p`` is at most ``2 ||A_p,:||_F^2``
    (``2 (||A||_F^2 - sum_j A_jj^2)`` for the total) and
    ``E ||(A v)_p||^2 = ||A_p,:||_F^2``, so ``sqrt(2 mean_k energies[k, p] / K)``
    is a conservative standard error of the mean of ``K`` samples. It averages
    ``D`` squared entries per product instead of ``K`` numbers, so it is far
    steadier than the samples' standard deviation (which, from 4 samples,
    makes ``value / error`` heavy-tailed like a Student t with 3 degrees of
    freedom or worse: benchmarks/trace_estimators.py). Each error is the larger
    of the two (the samples' where the bound's draws happen to miss a
    direction); with one sample, the bound alone.

    Returns:
        ``{"block_errors", "trace_error"}`` and, for comparison, ``"sample_errors"``
        (:func:`_standard_errors`) and ``"product_errors"`` (the bound alone), each
        ``{"block_errors", "trace_error"}``.
    """
    count = blocks.shape[0]
    sample = _standard_errors(blocks)
    if count < 1:
        return {**sample, "sample_errors": sample, "product_errors": dict(sample)}
    energies = energies.to(torch.float64)
    products = {
        "block_errors": (2 * energies.mean(0) / count).sqrt().tolist(),
        "trace_error": float((2 * energies.sum(1).mean() / count).sqrt()),
    }
    return {
        "block_errors": [_larger(a, b) for a, b in zip(sample["block_errors"], products["block_errors"])],
        "trace_error": _larger(sample["trace_error"], products["trace_error"]),
        "sample_errors": sample,
        "product_errors": products,
    }


def _larger(sample: float, bound: float) -> float:
    """The larger of two standard errors, the bound where the samples give none (one sample)."""
    return bound if sample != sample else max(sample, bound)


@dataclass(frozen=True)
class HutchinsonDiagonal:
    """Need: Hutchinson's estimate of the Hessian diagonal of the mean loss from ``samples`` products.

    Result: one tensor per tracked parameter, shaped like it (see the module docstring), in a
    :class:`DiagonalEstimate` whose ``errors`` are the standard errors of the block traces and of the total.
    """

    samples: int = 4

    #: computed once per optimizer step, after its last backward pass: the products go through the
    #: graph of the accumulated ``p.grad`` (every micro-batch of the step)
    whole_step = True

    def compute(self, execution) -> list[torch.Tensor]:
        """The estimate for the tracked parameters of ``execution`` (a :class:`~cockpit_like.backends.step.StepExecution`)."""
        params = execution.params
        matvec = hessian_vector_product(params, "Hutchinson's estimator (curvature='hutchinson')", local=True)
        indices = curvature_params(params)  # the operator's parameters: frozen ones get zeros
        sizes = [params[i].numel() for i in indices]
        size = sum(sizes)
        total = torch.zeros(size, dtype=operator_dtype(params), device=params[0].device)
        from cockpit_like.backends.randomness import generator

        draws = generator(execution.step, "hutchinson diagonal", total.device)
        blocks, energies = [], []
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # the first probes and products: the symmetry check
        zeros = [total.new_zeros(())] * len(params)  # a frozen parameter's block: zero, exactly
        for _ in range(self.samples):
            v = torch.randint(0, 2, (size,), device=total.device, generator=draws).to(total.dtype).mul_(2).sub_(1)
            product = matvec(v)
            if len(kept) < SYMMETRY_PROBES:
                kept.append((v, product))
            sample = v * product
            total.add_(sample)
            pieces = sample.split(sizes)
            blocks.append(torch.stack(scatter_blocks([piece.sum() for piece in pieces], indices, zeros)))
            energies.append(torch.stack(scatter_blocks([piece.square().sum() for piece in pieces], indices, zeros)))
        total.div_(self.samples)
        result = DiagonalEstimate(scatter_blocks(list(total.split(sizes)), indices, params))
        result.blocks = torch.stack(blocks)  # [samples, params]: each sample's block sums
        result.energies = torch.stack(energies)  # [samples, params]: each product's squared norm per block
        result.errors = product_standard_errors(result.blocks.to(torch.float64).cpu(), result.energies.cpu())
        if len(kept) > 1:
            result.asymmetry = probe_asymmetry(torch.stack([v for v, _ in kept]), torch.stack([hv for _, hv in kept]),
                                               SYMMETRY_RTOL)
        return result

    def across_ranks(self, result, reduction):
        """Under DDP: the batch-weighted mean of the ranks' estimates (``v * (H v)`` is linear in ``H``),
        and of each sample's block sums, from which the samples' standard errors follow as in one process.

        Every rank draws the same ``v_k`` (the cockpit's generator is seeded by
        the step), so the result is the estimate of one process on the global
        batch with these ``v_k``. The products' squared norms are the ranks'
        own, ``||H_r v||^2``, merged by the same weighted mean: by convexity
        ``||sum_r w_r H_r v||^2 <= sum_r w_r ||H_r v||^2``, so the bound of
        :func:`product_standard_errors` stays conservative (wider than one
        process's) without sending the products.
        """
        parts = [reduction.mean(d) for d in result]
        blocks = getattr(result, "blocks", None)
        merged = None if blocks is None else reduction.mean(blocks)
        energies = getattr(result, "energies", None)
        merged_energies = None if energies is None or blocks is None else reduction.mean(energies)

        def finish():
            estimate = DiagonalEstimate(part() for part in parts)
            if merged is not None:
                estimate.blocks = merged()
                if merged_energies is None:
                    estimate.errors = _standard_errors(estimate.blocks.to(torch.float64).cpu())
                else:
                    estimate.energies = merged_energies()
                    estimate.errors = product_standard_errors(estimate.blocks.to(torch.float64).cpu(),
                                                              estimate.energies.cpu())
            estimate.asymmetry = getattr(result, "asymmetry", None)  # (this rank's products: each a Hessian's)
            return estimate

        return finish
