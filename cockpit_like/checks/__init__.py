"""Self-checks of a tracked step: invariants that hold whenever its decomposition is right.

Every tracked step verifies, cheaply, what the cockpit would otherwise assume
about the training loop (``docs/your_training_loop.md#self-checks``):

- :mod:`~cockpit_like.checks.probe`: the per-sample gradients, as the
  statistics reduced them, average to the gradient autograd accumulated for
  the step (one random rank-one projection per layer, a per-sample statistic
  of its own);
- :mod:`~cockpit_like.checks.loss_factor`: the factor between what was
  backpropagated and ``info["loss"]``, seen exactly by a hook on the loss
  tensor (an undeclared ``GradScaler``, a loss divided by the number of
  micro-batches), which the cockpit then uses;
- :mod:`~cockpit_like.checks.rows`: each row's loss reads its own row of the
  model's output only (a loss over the batch, InfoNCE, in-batch negatives,
  makes per-sample gradients undefined: the per-sample quantities are left
  out of the step, with a note);
- :mod:`~cockpit_like.checks.graphs`: what a loss tensor's autograd graph holds (label smoothing, row
  weights, a statistic over the batch, a term on the parameters, a ``create_graph`` derivative), read only to
  name the cause where a check that compares two losses failed;
- :mod:`~cockpit_like.checks.invariants`: the mean of ``info["individual_losses"]``
  is ``info["loss"]``; the comparison of the probe with the gradient; the
  ``checks`` record stored with each tracked step.

A step that fails a check is stored as invalid, with the reason, and the
quantities that read its per-sample decomposition store no value for it.

May import torch and :mod:`cockpit_like.backends.per_sample` (the statistic base class).
"""

from cockpit_like.checks.invariants import CHECKS_KEY, StepChecks, check_losses_mean
from cockpit_like.checks.loss_factor import LossFactor
from cockpit_like.checks.probe import GradientProbe
from cockpit_like.checks.rows import coupled_rows

__all__ = ["CHECKS_KEY", "StepChecks", "LossFactor", "GradientProbe", "check_losses_mean", "coupled_rows"]
