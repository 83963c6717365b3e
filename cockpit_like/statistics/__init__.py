"""Statistics of layer inputs, output gradients and per-sample gradients, logged during the cockpit's backward pass.

What lives here:

- :mod:`~cockpit_like.statistics.base`: the statistic contract (``init``,
  ``update`` from one step, ``merge``, ``finalize``; states are sums and
  counts in plain dicts) and :class:`Mean`, :class:`Covariance`
  (uncentered), :class:`Log` (the raw values of a step);
- :mod:`~cockpit_like.statistics.logs`: the three logs per layer,
  ``forward`` (layer inputs), ``backward`` (output gradients) and ``grad``
  (per-sample gradients), their normalisation, the configuration
  (``{"forward": [Covariance], "backward": [Covariance], "grad": []}`` or the
  short forms ``"kfac"`` / ``"ekfac"``) and EK-FAC's
  :class:`KroneckerEigenvalues`;
- :mod:`~cockpit_like.statistics.collect`: :class:`LayerLogs`, the
  per-sample statistic that fills the logs in the same backward pass as the
  cockpit's other needs (hook backend), and :class:`StatisticsPlan`, a
  requester's configuration and running logs;
- :mod:`~cockpit_like.statistics.sampled`: the logs of the Monte-Carlo
  (type-2) Fisher, from a second backward pass with sampled labels (optional);
- :mod:`~cockpit_like.statistics.type2`: the logs of the exact type-2 Fisher
  (GGN) of a cross-entropy or MSE loss, one backward pass per output
  dimension (optional);
- :mod:`~cockpit_like.statistics.curvature`: KFAC / EK-FAC operators of the
  logs (:mod:`cockpit_like.operators` records).

May import torch, :mod:`cockpit_like.backends`, :mod:`cockpit_like.functional`
and :mod:`cockpit_like.operators`. Docs: ``docs/curvature_statistics.md``.
"""

from cockpit_like.statistics.base import Covariance, Log, Mean, Statistic, StatisticsMergeError
from cockpit_like.statistics.collect import LayerLogs, StatisticsPlan, finalize_logs, merge_logs
from cockpit_like.statistics.curvature import NotLoggedError, curvature_operator, layer_curvatures, layer_eigen
from cockpit_like.statistics.logs import LOGS, KroneckerEigenvalues, parse_statistics

__all__ = [
    "Statistic",
    "Mean",
    "Covariance",
    "Log",
    "KroneckerEigenvalues",
    "StatisticsMergeError",
    "NotLoggedError",
    "LOGS",
    "parse_statistics",
    "StatisticsPlan",
    "LayerLogs",
    "merge_logs",
    "finalize_logs",
    "layer_curvatures",
    "layer_eigen",
    "curvature_operator",
]
