"""The loss-spike post-mortem (issue 38): which rows, which layers, what cause.

What lives here:

- :mod:`~cockpit_like.spikes.rows`: each tracked step's per-row summary
  (loss, gradient norm, share of the step's gradient, with the rows' ids
  from ``info["sample_ids"]``), :class:`RowBuffer` (the bounded ring buffer
  of the last steps' top rows) and the :class:`RowSummaries` quantity;
- :mod:`~cockpit_like.spikes.detector`: :class:`SpikeDetector`, spikes of the
  loss and of the gradient norm against the run's own noise;
- :mod:`~cockpit_like.spikes.causes`: :func:`name_cause`, the likeliest
  cause of a spike from the post-mortem's evidence (plain data in, plain
  data out);
- :mod:`~cockpit_like.spikes.postmortem`: the :class:`PostMortem` quantity,
  stored at each spike under ``"PostMortem"``;
- :mod:`~cockpit_like.spikes.report`: reading post-mortems back from a log
  and printing them (``cockpit-like spikes LOG``).

What it may import: torch, numpy, :mod:`cockpit_like.functional`,
:mod:`cockpit_like.context`, the quantity base classes and the per-sample
statistics it reads (:class:`~cockpit_like.backends.per_sample_stats.GramSummary`).
Never the cockpit: the cockpit knows these only as quantities. The diagnosis
turns a stored post-mortem into a finding (rule ``loss-spike``) by reading
the stored value, like every rule.
"""

from cockpit_like.spikes.causes import CAUSES, name_cause
from cockpit_like.spikes.detector import SpikeDetector
from cockpit_like.spikes.postmortem import PostMortem
from cockpit_like.spikes.rows import RowBuffer, RowSummaries, row_summary

__all__ = ["RowSummaries", "RowBuffer", "row_summary", "SpikeDetector", "PostMortem", "name_cause", "CAUSES"]
