"""Connections to the tools people train and log with.

- :mod:`~cockpit_like.integrations.lightning`: ``CockpitCallback`` for
  ``lightning.Trainer`` (and ``pytorch_lightning.Trainer``) and the
  ``CockpitModule`` mixin (per-sample losses, ``create_graph``);
- :mod:`~cockpit_like.integrations.transformers`: ``CockpitCallback`` and
  ``CockpitTrainer`` / ``CockpitTrainerMixin`` for the Hugging Face ``Trainer``;
- :mod:`~cockpit_like.integrations.exporters`: tracked values to TensorBoard,
  Weights & Biases and MLflow, live (attached to a cockpit) or from a saved log;
- :mod:`~cockpit_like.integrations.flatten`: stored values as named scalars and
  histograms (pure, no optional dependency).

May import the rest of ``cockpit_like``. The optional packages (lightning,
transformers, tensorboard, wandb, mlflow) are imported only inside the
functions and classes that use them, never when ``cockpit_like`` or this
package is imported; install them with the extras
(``pip install cockpit_like[lightning]``, ``[transformers]``,
``[tensorboard]``, ``[wandb]``, ``[mlflow]``, or ``[all]``).
"""
