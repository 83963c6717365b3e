"""The logs of the Monte-Carlo (type-2) Fisher: a second backward pass with labels sampled from the model.

For a cross-entropy loss that is the mean over ``N`` positions, with labels
``ŷ_n`` drawn from the model's predictive distribution ``softmax(f_n)``
(the cockpit's generator, seeded per step and key: :mod:`cockpit_like.backends.randomness`), the output gradients of the sampled loss ``(1/N) sum_n CE(f_n, ŷ_n)``
have ``E[s s^T] = diag(p) - p p^T``, the loss Hessian w.r.t. the logits: their
covariance (``backward`` log) is KFAC's ``G`` of the Fisher (= GGN for
cross-entropy), one sample per position, instead of the empirical Fisher's.
The ``forward`` log is unchanged (same inputs), and ``grad`` statistics read
the sampled loss's per-sample gradients (EK-FAC of the Monte-Carlo Fisher).
Like :class:`~cockpit_like.backends.sampled.SampledGGNDiagonal` it reads
``info["outputs"]`` (the logits, classes last, with their graph) and runs
after the step's backward pass, through its kept graph
(``loss.backward(create_graph=cockpit.create_graph(step))``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cockpit_like.backends.randomness import generator
from cockpit_like.backends.sampled import logits_from_info, sample_cross_entropy
from cockpit_like.statistics.collect import LayerLogs, StatisticsPlan

__all__ = ["SampledLayerLogs"]


@dataclass(frozen=True)
class SampledLayerLogs:
    """Need: one step's logs from a backward pass of the loss with sampled labels (one draw per position)."""

    key: str
    plan: StatisticsPlan = field(compare=False, hash=False, repr=False, default=None)

    def compute(self, execution) -> dict:
        logits = logits_from_info(execution.info, "fisher='mc'")
        seed_parts = (self.key, float(logits.detach().sum()))  # each backward pass (micro-batch) draws its own
        sampled = sample_cross_entropy(logits, generator(execution.step, "sampled fisher labels", logits.device, *seed_parts))
        stat = LayerLogs(self.key, self.plan)
        return execution.per_sample_pass(sampled, [stat])[stat]

    def across_ranks(self, result, reduction):
        """Under DDP: the ranks' logs summed (:meth:`LayerLogs.across_ranks`); each rank draws its own
        labels, so the result estimates the global batch's Fisher without being the draw of one process."""
        return LayerLogs(self.key, self.plan).across_ranks(result, reduction)
