"""Every tensor the cockpit makes during a tracked step names its device: the bug class a GPU found, caught on a CPU.

On an H200 the cockpit raised into the training loop at every tracked step (``index is on cpu, different from
other tensors on cuda:0``): the self-check's probe made an index with ``torch.tensor(indices)``, and the
attention rule its additive mask with ``torch.zeros(shape)``, both on the default device (the CPU) while the
rows were on the GPU. A CPU run cannot see such a bug (every device is the CPU), and GPUs are rarely at hand.
So this test records every tensor factory (``torch.tensor``, ``zeros``, ``randn``, ...) that the cockpit
calls without a ``device`` during tracked steps, over the zoo, every quantity and ``nn.MultiheadAttention``
with both masks, and allows only the factories whose result is meant to be on the CPU whatever the rows'
device (listed below, each with its reason).
"""

from __future__ import annotations

import collections
import traceback
import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from cockpit_like import Cockpit
from cockpit_like import quantities as Q
from cockpit_like.utils.configuration import configuration
from tests.test_recorder_context import _Attention as _PlainAttention
from tests.zoo import ZOO

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.eye,
    torch.randn, torch.rand, torch.randint, torch.linspace,
}  # fmt: skip

#: source file -> factories allowed there without a device, and why their result belongs on the CPU
ALLOWED = {
    "functional/histograms.py": ({"linspace"}, "the bin edges, stored on the CPU as Cockpit stores them"),
}

#: every quantity beyond the full preset that takes only a schedule
EXTRA = (
    "CABS", "EarlyStopping", "MeanGSNR", "TICTrace", "HessEigenvalues", "HessSpectralDensity", "HessTraceEstimate",
    "KFACTrace", "EKFACSpectrum", "PreconditionedGradNorm", "SelfInfluence", "ParamNorm", "ActivationStats",
    "DataStats", "LearningRate", "Momentum", "BatchSize", "Time", "Parameters",
)  # fmt: skip


class DevicelessFactories(TorchFunctionMode):
    """Counts the factory calls without ``device`` made from the cockpit's code, by the innermost cockpit frame."""

    def __init__(self):
        super().__init__()
        self.found: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copies_a_tensor = func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
        if func in FACTORIES and kwargs.get("device") is None and not copies_a_tensor:
            for frame in reversed(traceback.extract_stack()[:-1]):
                if "cockpit_like/" in frame.filename:
                    self.found[(frame.filename.split("cockpit_like/")[-1], frame.lineno, func.__name__)] += 1
                    break
        return func(*args, **kwargs)


def _quantities(leave_out=()):
    every = lambda step: True  # noqa: E731
    return configuration("full") + [getattr(Q, name)(track_schedule=every) for name in EXTRA if name not in leave_out]


def _disallowed(found) -> list:
    return [key for key in found if key[2] not in ALLOWED.get(key[0], (set(), ""))[0]]


class _Attention(_PlainAttention):
    """``nn.MultiheadAttention`` with a key padding mask and a causal float mask (the attention rule's masks)."""

    def forward(self, x):
        padding = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
        padding[:, -1] = True
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        out = self.attention(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)[0]
        return self.head(out.mean(1))


def _track(model, batches, sample_losses) -> DevicelessFactories:
    params = list(model.parameters())
    cockpit = Cockpit(params, quantities=_quantities(), model=model)
    optimizer = torch.optim.SGD(params, lr=0.01)
    audit = DevicelessFactories()
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad()
        losses = sample_losses(model, inputs, targets)
        loss = losses.mean()
        info = {"batch_size": len(losses), "loss": loss, "individual_losses": losses.detach(), "optimizer": optimizer}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with audit, cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return audit


@pytest.mark.parametrize("name", ["gpt2", "encoder", "gru", "resnet_groupnorm", "custom"])
def test_every_tensor_of_a_tracked_step_names_its_device(name):
    problem = ZOO[name](0)
    audit = _track(
        problem.model,
        [problem.batch(5, seed) for seed in (1, 2, 3)],
        lambda model, inputs, targets: problem.sample_losses(problem.forward(model, inputs), targets),
    )
    assert audit.found, "the audit saw no factory at all (it would pass whatever the code did)"
    assert _disallowed(audit.found) == [], (
        "tensors made without a device in a tracked step (on a GPU they land on the CPU beside the rows): "
        f"{sorted(_disallowed(audit.found))}"
    )


def test_the_attention_rules_masks_name_their_device():
    torch.manual_seed(0)
    model = _Attention()
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 5, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)) for _ in range(2)]
    audit = _track(model, batches, lambda m, x, y: nn.functional.cross_entropy(m(x), y, reduction="none"))
    assert _disallowed(audit.found) == [], sorted(_disallowed(audit.found))


def test_the_audit_sees_a_factory_without_a_device():
    """The mechanism itself: the probe's index as it was before the fix is reported."""
    import cockpit_like.checks.probe as probe_module

    audit = DevicelessFactories()
    source = "def made(indices):\n    return torch.tensor(indices)\n"
    scope = {"torch": torch}
    exec(compile(source, probe_module.__file__, "exec"), scope)  # noqa: S102 - a function "in" the probe's file
    with audit:
        scope["made"]([1, 2])
        torch.zeros(2, device="cpu")
    assert _disallowed(audit.found) == [("checks/probe.py", 2, "tensor")]


def _track_loop(make_cockpit, model, batches, lossfunc, micro_batches: int = 1) -> DevicelessFactories:
    """A loop with ``micro_batches`` backward passes per optimizer step (the cockpit entered around each)."""
    params = list(model.parameters())
    cockpit = make_cockpit(params)
    optimizer = torch.optim.SGD(params, lr=0.01)
    audit = DevicelessFactories()
    for step in range(len(batches) // micro_batches):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            inputs, targets = batches[step * micro_batches + micro]
            outputs = model(inputs)
            losses = nn.functional.cross_entropy(outputs, targets, reduction="none")
            loss = lossfunc(outputs, targets)
            info = {"batch_size": len(targets), "loss": loss, "individual_losses": losses.detach(), "optimizer": optimizer}
            if micro_batches > 1:
                info["micro_batches"] = micro_batches
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with audit, cockpit(step, info=info):
                    (loss / micro_batches).backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    return audit


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_backpack_models_and_micro_batches_name_their_devices(micro_batches):
    """The BackPACK path (an extended model: BackPACK's own curvature and per-sample extensions) and the merge
    of micro-batches, which the zoo's hook path above does not take."""
    from tests.helpers import make_batch, make_problem

    model, lossfunc, _ = make_problem("cnn")
    batches = [make_batch("cnn", 6, seed) for seed in range(3 * micro_batches)]
    leave_out = ("EKFACSpectrum", "SelfInfluence") if micro_batches > 1 else ()  # one backward pass (next test)
    audit = _track_loop(lambda params: Cockpit(params, quantities=_quantities(leave_out)), model, batches, lossfunc,
                        micro_batches)
    assert audit.found and _disallowed(audit.found) == [], sorted(_disallowed(audit.found))


@pytest.mark.parametrize("name,said", [("EKFACSpectrum", "statistics='kfac'"), ("SelfInfluence", "one backward pass")])
def test_quantities_that_need_one_backward_pass_say_so_with_micro_batches(name, said):
    """They said "under DistributedDataParallel ... in one process" to a user in one process."""
    from tests.helpers import make_batch, make_problem

    model, lossfunc, _ = make_problem("cnn")
    batches = [make_batch("cnn", 6, seed) for seed in range(2)]
    make = lambda params: Cockpit(params, quantities=[getattr(Q, name)(track_schedule=lambda step: True)])  # noqa: E731
    with pytest.raises(NotImplementedError, match="split into micro-batches") as raised:
        _track_loop(make, model, batches, lossfunc, micro_batches=2)
    assert said in str(raised.value) and "DistributedDataParallel" not in str(raised.value)
