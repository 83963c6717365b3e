"""The recorder: an algebraic log of one training step.

What lives here:

- :mod:`.tape`: :class:`Tape`, a ``TorchDispatchMode`` that notes each aten
  operation of the forward pass, the loss and the backward pass with its
  module, phase, arguments and summary values (PyTorch's own tracing);
- :mod:`.record`: :class:`Record`, the neutral, JSON-ready record built from
  a tape (plus, in memory, the tensors a replay needs), the first non-finite
  value and its ``nonfinite-origin`` finding; :func:`read_record`;
- :mod:`.program`: the exporter :func:`export_program`, a standalone Python
  program (torch only) that replays the recorded forward pass and loss from
  one ``.pt`` file and checks that it reproduces them;
- :mod:`.fx`: the exporter :func:`to_graph_module`, the same replay as a
  ``torch.fx.GraphModule`` (inputs: the step's external values);
- :mod:`.control`: :class:`Recorder`, which the cockpit uses to record a step
  on demand (``cockpit.record(step)``) or automatically at the first step
  with a non-finite loss or gradient.

May import torch, :mod:`cockpit_like.logs` and
:mod:`cockpit_like.diagnosis.findings`; never the quantities, the backends or
the plotting (the cockpit hands it what it needs).
"""

from cockpit_like.diagnosis.recorder.control import RECORD_KEY, Recorder
from cockpit_like.diagnosis.recorder.fx import to_graph_module
from cockpit_like.diagnosis.recorder.program import NotReplayableError, export_program
from cockpit_like.diagnosis.recorder.record import CONTROL_FLOW_NOTE, Record, read_record
from cockpit_like.diagnosis.recorder.tape import Tape, summarize

__all__ = [
    "Tape",
    "Record",
    "Recorder",
    "RECORD_KEY",
    "CONTROL_FLOW_NOTE",
    "read_record",
    "export_program",
    "to_graph_module",
    "NotReplayableError",
    "summarize",
]
