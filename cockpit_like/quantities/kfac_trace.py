"""Trace, Frobenius norm and log-determinant of Kronecker-factored curvature (new).

Each parameter's block is a :class:`~cockpit_like.operators.KroneckerProduct`
of its factors; the summaries are the operator's (``trace()``,
``frobenius_norm()``, eigenvalues for the damped log-determinant).
"""

from __future__ import annotations

import math

import torch
from backpack.extensions import KFAC, KFLR

from cockpit_like.context import get_record
from cockpit_like.operators import KroneckerProduct
from cockpit_like.quantities.quantity import SingleStepQuantity
from cockpit_like.statistics import Covariance, LayerLogs, StatisticsPlan, finalize_logs

__all__ = ["KFACTrace"]

_CHOICES = ("auto", "kfac", "kflr", "empirical")

#: the largest parameter (entries) whose exact empirical block ``curvature="empirical"`` builds
DENSE_LIMIT = 4096


class KFACTrace(SingleStepQuantity):
    """Summaries of BackPACK's Kronecker-factored GGN blocks, per parameter tensor.

    For each tracked parameter ``p`` BackPACK stores factors whose Kronecker
    product approximates the GGN block of ``p``: ``[G, A]`` for weights of
    linear and convolution layers (``G`` from the backpropagated loss
    Hessian, ``A`` from the layer inputs; ``G ⊗ A`` matches torch's
    row-major flattening), ``[G]`` for biases. With ``F_p = ⊗_i F_{p,i}``:

    - ``trace[p] = tr F_p = prod_i tr F_{p,i}``,
    - ``frobenius[p] = ||F_p||_F = prod_i ||F_{p,i}||_F``,
    - ``logdet[p] = log det(F_p + damping I)`` from the factors' eigenvalues
      (only with ``damping``; factor eigenvalues are clamped at 0, since they
      are PSD by construction).

    Curvature (``curvature``):

    - ``"auto"`` (the default): ``"kfac"`` where BackPACK's KFAC can run on
      the model (:func:`~cockpit_like.backends.step.backpack_curvature_compatible`),
      else ``"empirical"``; decided when the cockpit learns the model and
      written to the log metadata (``settings()["computed_with"]``). Without a
      known model, ``"kfac"``.

    - ``"kflr"``: :class:`backpack.extensions.KFLR`, the exact loss Hessian
      is backpropagated (exact for a single linear layer with MSE loss);
    - ``"kfac"``: :class:`backpack.extensions.KFAC`, a Monte-Carlo estimate
      with ``mc_samples`` sampled labels (random: drawn in BackPACK's hook from torch's generator, seeded by
      the cockpit per step and restored after);
    - ``"empirical"`` (any model, no BackPACK): the empirical Fisher of the
      mean loss, ``F = (1/B) sum_n g_n g_n^T``, from the curvature statistics
      logged in the same backward pass (:mod:`cockpit_like.statistics`, a
      plan with ``layers_from="factors"``). A weight whose per-sample
      gradient is a sum of outer products ``g_n / B = sum_t delta_{n,t}
      x_{n,t}^T`` (``nn.Linear`` on any leading dimensions, HF ``Conv1D``,
      ``nn.MultiheadAttention``'s projections) gets ``[G, A]``: the
      ``Covariance`` of its ``backward`` log, ``G = (1/B) sum_{n,t} (B
      delta)(B delta)^T = B sum delta delta^T``, and of its ``forward`` log,
      ``A = (1/M) sum x x^T`` over the ``M = B T`` positions of the batch
      ("expand" convention for layers applied to every token; factors in
      the weight's storage order, so HF ``Conv1D``'s ``[in, out]`` weight
      gets them swapped, with the same product). Every other
      parameter (biases, convolutions, norms, embeddings) gets its exact
      block ``[(1/B) sum_n g_n g_n^T]`` (the ``Covariance`` of its ``grad``
      log) if it has at most ``DENSE_LIMIT = 4096`` entries, else ``None``
      in every list.

    Scaling (BackPACK's, for a **mean** loss over ``B`` samples): for a linear
    layer with inputs ``a_n`` and output loss-Hessian square roots ``S_n``,
    ``A = (1/B) sum_n a_n a_n^T`` and ``G = sum_n S_n S_n^T`` where ``S_n``
    already carries the ``1/sqrt(B)`` of the mean, so ``G ≈ (1/B) sum_n
    ∇²_{f_n} l_n`` and ``G ⊗ A`` approximates the GGN of the mean loss,
    ``(1/B) sum_n J_n^T ∇²_f l_n J_n``. For convolutions,
    ``A = (1/B) sum_n sum_t x_{n,t} x_{n,t}^T`` sums the unfolded input
    patches over the ``T`` output positions and ``G`` is the GGN w.r.t. the
    bias (outputs summed over positions), which BackPACK notes is ``T`` times
    the ``Γ`` of Grosse & Martens (2016).

    Stored value (a dict): ``{"trace": [per-param floats], "trace_total":
    float, "frobenius": [per-param floats], "frobenius_total": float}`` and,
    only when ``damping`` is set, ``"logdet": [per-param floats],
    "logdet_total": float``. Totals are those of the block-diagonal matrix:
    the sum of traces, ``sqrt(sum frobenius^2)`` and the sum of
    log-determinants.

    Args:
        track_schedule: when to compute.
        verbose: print each value.
        curvature: ``"auto"``, ``"kfac"``, ``"kflr"`` or ``"empirical"``.
        mc_samples: Monte-Carlo samples of ``"kfac"`` (ignored by ``"kflr"``).
        damping: ``> 0`` to also report the damped log-determinant.

    Example:
        >>> q = KFACTrace(linear(10), curvature="kflr", damping=1e-3)
    """

    def __init__(
        self,
        track_schedule,
        verbose: bool = False,
        curvature: str = "auto",
        mc_samples: int = 1,
        damping: float | None = None,
    ):
        super().__init__(track_schedule, verbose=verbose)
        if curvature not in _CHOICES:
            raise ValueError(
                f"KFACTrace(curvature={curvature!r}): unknown curvature; choose one of "
                f"{list(_CHOICES)} (BackPACK's Monte-Carlo KFAC or exact-loss-Hessian KFLR, or the "
                "empirical Fisher in Kronecker form from module hooks, on any model)"
            )
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"KFACTrace(mc_samples=...) needs a positive int, got {mc_samples!r}")
        if damping is not None and not (isinstance(damping, (int, float)) and damping > 0):
            raise ValueError(f"KFACTrace(damping=...) must be None or a float > 0, got {damping!r}")
        self._requested = curvature
        #: what is computed: the requested curvature, or for "auto" the one chosen for the model
        self._curvature = "kfac" if curvature == "auto" else curvature
        self._mc_samples = mc_samples
        self._damping = None if damping is None else float(damping)
        #: ``curvature="empirical"``: the step's Kronecker logs (weights given as factors) and exact blocks (the rest)
        self.plan = StatisticsPlan(
            {"forward": [Covariance], "backward": [Covariance], "grad": [Covariance(DENSE_LIMIT, skip_longer=True)]},
            window="step",
            layers_from="factors",
        )
        self._key = f"{type(self).__name__}@{id(self)}"

    def adapt_to_models(self, models: list) -> None:
        self.plan.set_models(models)
        if self._requested == "auto":
            from cockpit_like.backends.step import backpack_curvature_compatible

            self._curvature = "kfac" if backpack_curvature_compatible(models, KFAC()) else "empirical"

    def extensions(self, global_step: int) -> list:
        if not self.should_compute(global_step) or self._curvature == "empirical":
            return []
        from cockpit_like.backends.conv_diagonals import use_any_shape_losses, use_functional_avgpool

        extension = KFAC(mc_samples=self._mc_samples) if self._curvature == "kfac" else KFLR()
        return [use_functional_avgpool(use_any_shape_losses(extension))]

    def per_sample_stats(self, global_step: int) -> list:
        if not self.should_compute(global_step) or self._curvature != "empirical":
            return []
        return [LayerLogs(self._key, self.plan)]

    def settings(self) -> dict:
        settings = {"curvature": self._requested, "mc_samples": self._mc_samples, "damping": self._damping}
        if self._requested == "auto":
            settings["computed_with"] = self._curvature
        return settings

    def _compute(self, global_step, params, batch_loss):
        if self._curvature == "empirical":
            return self._summaries(self._empirical_factors(global_step, params))
        factor_lists = []
        for index, param in enumerate(params):
            factors = getattr(param, self._curvature, None)
            if factors is None:
                raise RuntimeError(
                    f"KFACTrace: BackPACK stored no '{self._curvature}' factors on parameter "
                    f"#{index} (shape {list(param.shape)}); extend the model and the loss "
                    "function with backpack.extend and call backward inside the cockpit context"
                )
            factor_lists.append([f.detach() for f in factors])
        return self._summaries(factor_lists)

    def _empirical_factors(self, global_step: int, params: list) -> list:
        """Per parameter ``[G, A]`` (a weight logged as a layer), ``[F]`` (its exact block) or ``None``."""
        logs = finalize_logs(self.plan.stats, get_record(global_step).stat(LayerLogs(self._key)))
        covariance = Covariance.name
        factor_lists = []
        for name in self.plan.names(params):
            layer, grad = logs["layers"].get(name), logs["grad"].get(name, {}).get(covariance)
            if layer is not None:
                factor_lists.append([layer["backward"][covariance], layer["forward"][covariance]])
            else:
                factor_lists.append(None if grad is None else [grad])
        return factor_lists

    def _summaries(self, factor_lists: list) -> dict:
        """Per-parameter and total summaries; ``None`` entries (no block) are skipped in the totals."""

        operators = [None if factors is None else KroneckerProduct(factors) for factors in factor_lists]

        def each(function):
            return [None if op is None else float(function(op)) for op in operators]

        traces = each(KroneckerProduct.trace)
        norms = each(KroneckerProduct.frobenius_norm)
        value = {
            "trace": traces,
            "trace_total": math.fsum(t for t in traces if t is not None),
            "frobenius": norms,
            "frobenius_total": math.sqrt(math.fsum(n * n for n in norms if n is not None)),
        }
        if self._damping is not None:
            # eigenvalues clamped at 0 (PSD by construction; round-off can make tiny ones negative)
            logdets = each(lambda op: torch.log(op.eigenvalues().clamp(min=0) + self._damping).sum())
            value["logdet"] = logdets
            value["logdet_total"] = math.fsum(d for d in logdets if d is not None)
        return value
