"""The gradient tests: NormTest, InnerTest, OrthoTest (as used by Cockpit).

All three share one statistic, the diagonal and the row sums of the ``B x B``
Gram matrix of the per-sample gradients
(:class:`~cockpit_like.backends.per_sample_stats.GramSummary`, ``O(B D)``),
reduced layer by layer in the backward pass and computed once per step for
all three. ``B`` is ``grad_batch``'s leading dimension; ``||gbar||^2`` is
``sum_p ||p.grad||^2``. Scaling: mean loss, ``grad_batch[i] = g_i / B``.
The math lives in :mod:`cockpit_like.functional.gradient_tests`.
"""

from __future__ import annotations

import torch

from cockpit_like import context
from cockpit_like.backends.per_sample_stats import GramSummary
from cockpit_like.functional import gradient_tests as F
from cockpit_like.functional.tensor_lists import squared_norm
from cockpit_like.quantities.byproducts import gradients_of
from cockpit_like.quantities.quantity import SingleStepQuantity

__all__ = ["NormTest", "InnerTest", "OrthoTest"]


class _GramTest(SingleStepQuantity):
    _test = None
    needs_two_samples = True  # a variance over the samples (divisor B - 1)

    def per_sample_stats(self, global_step: int) -> list:
        return [GramSummary()] if self.should_compute(global_step) else []

    def _compute(self, global_step, params, batch_loss):
        record = context.get_record(global_step)
        diag, row_sums = record.stat(GramSummary())
        grads = gradients_of(params, type(self).__name__)
        grad_sq_norm = squared_norm(grads)
        if F.cancels_to_rounding(diag, grad_sq_norm):  # one note for the three tests
            record.note(
                f"NormTest, InnerTest and OrthoTest at step {global_step}: no value stored: the mean gradient's norm "
                f"({grad_sq_norm.sqrt().item():.3g}) is within rounding of 0 next to the per-sample gradients' (root "
                f"mean square {(diag.shape[0] * diag.sum()).sqrt().item():.3g}): the rows cancel (a symmetric batch, "
                "a model at a symmetric point), and the tests divide by the mean gradient's squared norm, so their "
                "quotient would be rounding noise."
            )
            return None
        return type(self)._test(diag, row_sums, grad_sq_norm)


class NormTest(_GramTest):
    """Norm test (Byrd et al. 2012): ``sqrt(sum_i ||g_i - gbar||^2 / ((B-1) B ||gbar||^2))``.

    The largest test constant for which the test passes; large values ask for
    a larger batch. Stored as a float.
    """

    _test = staticmethod(F.norm_test)


class InnerTest(_GramTest):
    """Inner product test (Bollapragada et al. 2017):
    ``sqrt(sum_i (g_i^T gbar - ||gbar||^2)^2 / ((B-1) B ||gbar||^4))``. Stored as a float.
    """

    _test = staticmethod(F.inner_test)


class OrthoTest(_GramTest):
    """Orthogonality test (Bollapragada et al. 2017):
    ``sqrt(sum_i ||g_i - (g_i^T gbar / ||gbar||^2) gbar||^2 / ((B-1) B ||gbar||^2))``.
    Stored as a float.
    """

    _test = staticmethod(F.ortho_test)
