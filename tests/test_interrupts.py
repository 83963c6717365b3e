"""An exception anywhere in the cockpit's own work leaves the cockpit usable (docs/notebooks.md#interrupting-a-cell).

Jupyter's "Interrupt kernel" raises ``KeyboardInterrupt`` wherever the kernel
is, often inside the cockpit's work around ``loss.backward()``. Each case
here makes one internal function raise (a ``KeyboardInterrupt`` subclass,
on its first call at step 1) and checks, right after the failure, that the
user's state is as it was (grad mode, RNG, ``torch.autograd.backward``,
BackPACK's context, the hooks on the model and the loss, the warning
filters), then that the next two steps give the numbers of a run that was
never interrupted, and that memory and stream agree. Cases marked ``dirty``
also leave grad mode off, draw from the global generator and leave a
``cockpit_work`` region open before raising, as an interrupt landing inside a
``torch.no_grad()`` or a seeded block can.
"""

from __future__ import annotations

import importlib
import math
import warnings

import numpy as np
import pytest
import torch
from backpack import extend
from backpack.context import CTX

from cockpit_like import Cockpit, read_log
from cockpit_like.backends import internal
from cockpit_like.checks import roots
from cockpit_like.utils import optim
from cockpit_like.utils.configuration import configuration

STEPS, ARMED, BATCH = 4, 1, 8
TWO_STEP = {"Alpha", "UpdateSize"}  # values of step t completed at step t + 1


class Injected(KeyboardInterrupt):
    """The interrupt a case raises."""


#: ``(module, attribute, presets, how)``: where an interrupt lands, in the order a step runs through them. ``how``:
#: ``dirty`` (see the module docstring), ``after`` (right after the function returned, before its caller goes on),
#: ``first`` (at step 0, not :data:`ARMED`), ``forward`` (armed for the forward pass). Points whose work does not
#: depend on the preset run with economy only.
POINTS = [
    # the first step's exit swaps BackPACK's full backward hooks for lean ones (lean_hooks.py)
    ("cockpit_like.backends.lean_hooks", "make_lean", "economy", "dirty first"),
    ("torch.nn.modules.module", "Module.register_forward_hook", "economy full", "dirty first"),  # the lean hook's
    ("backpack.context", "CTX.add_hook_handle", "economy full", "dirty first"),  # between the new hook and the old's removal
    ("cockpit_like.quantities.gradient_tests", "_GramTest._compute", "economy", "dirty first"),  # Distance's reference
    # the forward pass (the tracer's hooks; outside the step, but the cockpit's code)
    ("cockpit_like.cockpit", "Cockpit._before_forward", "economy", "forward"),
    ("cockpit_like.backends.tracer", "_record", "economy full", "forward after"),  # a layer's call noted, then cut
    # cockpit.begin
    ("cockpit_like.diagnosis.recorder.control", "Recorder.step_begins", "economy", "dirty"),
    ("cockpit_like.tracked_step", "_stale_gradients", "economy", "dirty"),
    ("cockpit_like.backends.step", "StepExecution.__init__", "economy", "dirty after"),
    ("cockpit_like.checks.loss_factor", "LossFactor.start", "economy", "dirty"),
    ("cockpit_like.checks.loss_factor", "LossFactor.start", "economy", "dirty after"),
    ("cockpit_like.backends.hooks", "HookBackend.enter", "economy full", "dirty"),
    ("cockpit_like.backends.step", "StepExecution.enter", "economy full", "dirty after"),  # BackPACK's context entered
    ("cockpit_like.checks.roots", "_install", "economy", "dirty after"),  # torch.autograd.backward wrapped
    # the user's loss.backward()
    ("cockpit_like.checks.roots", "BackwardRoots._record", "economy full", ""),
    ("cockpit_like.checks.loss_factor", "LossFactor._seen", "economy", ""),
    ("cockpit_like.backends.per_sample", "PerSampleReducer._reduce_factors", "economy full", ""),
    ("cockpit_like.backends.column_blocks", "ColumnReplay.record", "full", ""),
    # cockpit.end: leaving the backward pass
    ("cockpit_like.diagnosis.recorder.control", "Recorder.step_ends", "economy full", "dirty"),
    ("cockpit_like.checks.loss_factor", "LossFactor.remove", "economy full", "dirty"),
    ("cockpit_like.checks.roots", "BackwardRoots.remove", "economy full", "dirty"),
    ("cockpit_like.backends.step", "StepExecution.exit", "economy full", "dirty"),
    ("cockpit_like.backends.column_blocks", "ColumnReplay.run", "full", "dirty"),
    ("cockpit_like.backends.hooks", "HookBackend.finish", "economy", "dirty"),
    ("cockpit_like.backends.step", "StepExecution.partition", "economy", "dirty"),
    # the step's computation
    ("cockpit_like.tracked_step", "TrackedStep._step_scale", "economy", "dirty"),
    ("cockpit_like.utils.optim", "_shadow_step", "economy", "dirty"),
    ("cockpit_like.checks.invariants", "StepChecks.compare_probe", "economy", "dirty"),
    ("cockpit_like.functional.krylov", "_norm", "full", "dirty"),
    ("cockpit_like.context", "_activate", "economy full", "dirty"),
    ("cockpit_like.quantities.alpha", "Alpha._compute_start", "economy full", "dirty"),
    ("cockpit_like.quantities.gradient_tests", "_GramTest._compute", "economy full", "dirty"),
    ("cockpit_like.quantities.parameter_motion", "Distance._store", "economy", "dirty after"),  # stored, then cut
    ("cockpit_like.quantities.parameter_motion", "UpdateSize._compute_start", "economy full", "dirty"),
    ("cockpit_like.quantities.histograms", "GradHist2d._compute", "full", "dirty"),
    # storing and publishing
    ("cockpit_like.run_output", "RunOutput.store_checks", "economy", "dirty"),
    ("cockpit_like.run_output", "RunOutput.note_tracked", "economy", "dirty"),
    ("cockpit_like.run_output", "RunOutput.publish", "economy full", "dirty"),
    ("cockpit_like.logs", "StreamWriter._write", "economy full", "dirty"),
    ("cockpit_like.cockpit", "Cockpit._diagnose", "economy", "dirty"),
    ("cockpit_like.tracked_step", "TrackedStep._watch_parameters", "economy", "dirty"),
    ("cockpit_like.diagnosis.recorder.control", "Recorder.after_step", "economy", "dirty"),
    ("cockpit_like.quiet", "QuietStep.close", "economy", "dirty"),
]
CASES = [(preset, module, attribute, how) for module, attribute, presets, how in POINTS for preset in presets.split()]


class Injector:
    """Makes ``module.attribute`` raise :class:`Injected` on its first call once armed (see :data:`POINTS`)."""

    def __init__(self, monkeypatch, module: str, attribute: str, how: str):
        self.armed, self.fired, self.forward = False, False, "forward" in how.split()
        if monkeypatch is None:  # the uninterrupted run
            return
        owner = importlib.import_module(module)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = owner.__dict__.get(name, getattr(owner, name)) if isinstance(owner, type) else getattr(owner, name)
        self.where = f"{module}.{attribute} ({how or 'on call'})"
        injector, dirty, after = self, "dirty" in how.split(), "after" in how.split()

        def wrapper(*args, **kwargs):
            if not injector.armed:
                return original(*args, **kwargs)
            injector.armed, injector.fired = False, True
            if after:
                original(*args, **kwargs)
            if dirty:  # as an interrupt inside torch.no_grad().__enter__ or a seeded block would leave them
                torch._C._set_grad_enabled(False)
                torch.rand(3)
                internal._STATE.depth = getattr(internal._STATE, "depth", 0) + 1
            raise Injected(injector.where)

        monkeypatch.setattr(owner, name, wrapper)


@pytest.fixture(autouse=True)
def _reset_global_state():
    """A failing case must not fail the next ones: grad mode and the cockpit's marks put back."""
    yield
    torch._C._set_grad_enabled(True)
    internal._STATE.depth = 0


def _problem():
    torch.manual_seed(0)
    model = extend(torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)).double())
    inputs = torch.randn(STEPS, BATCH, 5, dtype=torch.float64)
    labels = torch.randint(0, 3, (STEPS, BATCH))
    return model, inputs, labels


def _hooks(modules: dict, loss=None) -> list:
    """The hooks on the modules and on the loss; BackPACK's extension hook counted, whichever form it has (the
    full backward hook, or the lean forward hook that replaces it at the first tracked step)."""
    from backpack import hook_run_extensions

    from cockpit_like.backends.lean_hooks import _on_forward

    found = []
    for name, module in modules.items():
        hooks = [(kind, hook) for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                 for hook in getattr(module, kind).values()]  # fmt: skip
        runs = sum(hook is hook_run_extensions or hook is _on_forward for _, hook in hooks)
        found.append((name, runs, [h for h in hooks if h[1] is not hook_run_extensions and h[1] is not _on_forward]))
    return found + [list((getattr(loss, "_backward_hooks", None) or {}).values())]


def _user_state(model, lossfunc, optimizer, loss) -> dict:
    return {
        "grad enabled": torch.is_grad_enabled(),
        "torch.autograd.backward": torch.autograd.backward,
        "backward watchers": list(roots._WATCHERS),
        "BackPACK extensions": tuple(CTX.get_active_exts()),
        "BackPACK extension hook": CTX.get_extension_hook(),
        "in cockpit work": internal.in_cockpit_work(),
        "looking ahead": optim.looking_ahead(),
        "param groups": [id(group) for group in optimizer.param_groups],
        "hooks": _hooks({**dict(model.named_modules()), "lossfunc": lossfunc}, loss),
        "warning filters": list(warnings.filters),
    }


def _train(preset: str, stream, injector: Injector | None = None, armed: int = ARMED):
    """Steps 0..3; at step ``armed`` the injector is armed. After the interrupt the loop does what a notebook user
    does: runs the cell again (the step again, from its forward pass) where the step stored nothing, else finishes
    the optimizer step without the cockpit (its gradient again) and goes on with the next step."""
    model, inputs, labels = _problem()
    lossfunc, individual = extend(torch.nn.CrossEntropyLoss()), torch.nn.CrossEntropyLoss(reduction="none")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = Cockpit(model.parameters(), quantities=configuration(preset), stream_to=stream)

    def tracked(step: int) -> None:
        optimizer.zero_grad()
        injector.armed = step == armed and not injector.fired and injector.forward
        try:
            outputs = model(inputs[step])
        except Injected:  # the cell runs again
            return tracked(step)
        loss = lossfunc(outputs, labels[step])
        info = {"batch_size": BATCH, "individual_losses": individual(outputs, labels[step]), "loss": loss,
                "optimizer": optimizer}  # fmt: skip
        before, rng = _user_state(model, lossfunc, optimizer, loss), torch.get_rng_state()
        injector.armed = step == armed and not injector.fired and not injector.forward
        try:
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
        except Injected:
            after = _user_state(model, lossfunc, optimizer, loss)
            changed = {k: (before[k], v) for k, v in after.items() if before[k] != v}
            assert not changed, f"{injector.where} left these changed: {changed}"
            assert torch.equal(torch.get_rng_state(), rng), f"{injector.where} changed the user's RNG state"
            assert cockpit.open_step is None
            if step in cockpit.get_output():  # stored before the interrupt
                optimizer.zero_grad()
                lossfunc(model(inputs[step]), labels[step]).backward()
            else:  # nothing of it stored, not even its self-checks, nor a hook on the optimizer: tracked again
                assert step not in cockpit.checks, cockpit.checks[step]
                own = {handle.id for _, handles in cockpit._hooked_optimizers for handle in handles}
                hooks = [*optimizer._optimizer_step_pre_hooks, *optimizer._optimizer_step_post_hooks]
                assert set(hooks) <= own, f"{injector.where} left a hook on the optimizer"
                tracked(step)

    injector = injector or Injector(None, "", "", "")
    for step in range(STEPS):
        tracked(step)
        optimizer.step()
    return cockpit


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


def _close(a, b) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    return a == b


def _values(output: dict, step: int) -> dict:
    """A step's quantity values (its self-check record aside: its notes may tell of the interrupted step)."""
    return {name: value for name, value in output.get(step, {}).items() if name != "checks"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    return {preset: _train(preset, folder / preset).get_output() for preset in ("economy", "full")}


@pytest.mark.parametrize("preset,module,attribute,how", CASES,
                         ids=[f"{p}-{a}" + "".join(f"-{w}" for w in h.split() if w != "dirty") for p, m, a, h in CASES])
def test_an_interrupt_anywhere_leaves_the_cockpit_usable(reference, tmp_path, monkeypatch, preset, module, attribute,
                                                         how):  # fmt: skip
    original_backward = torch.autograd.backward
    armed = 0 if "first" in how.split() else ARMED
    injector = Injector(monkeypatch, module, attribute, how)
    cockpit = _train(preset, tmp_path / "run", injector, armed)
    assert injector.fired, f"{injector.where} was not called at step {armed} of the {preset} preset"
    assert torch.autograd.backward is original_backward and torch.is_grad_enabled()
    got, expected = cockpit.get_output(), reference[preset]
    for step in range(STEPS):
        values, wanted = _values(got, step), _values(expected, step)
        if step == armed - 1:  # its values of two steps end with the interrupted step (taken back, or not computed)
            lost = set(wanted) - set(values)
            assert lost <= TWO_STEP, f"step {step} lost {sorted(lost)}"
            wanted = {name: wanted[name] for name in values}
        assert _close(values, wanted), f"step {step} differs from the uninterrupted run"
    for step in range(armed, STEPS):
        assert cockpit.checks[step]["valid"], cockpit.checks[step]
    cockpit.close()
    assert _close(read_log(tmp_path / "run.jsonl"), got), "memory and stream differ"


def test_an_interrupt_in_the_look_ahead_leaves_the_optimizer_its_own_groups():
    """The look-ahead (Alpha's predicted update) steps the optimizer on shadow copies swapped into its param groups:
    an interrupt in its clean-up puts the optimizer's own groups back first."""
    from collections import defaultdict

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # (momentum buffers: state the look-ahead copies for its shadows)

    class Interrupting(defaultdict):
        def pop(self, *args):
            raise KeyboardInterrupt

    groups, optimizer.state = optimizer.param_groups, Interrupting(dict, optimizer.state)
    with pytest.raises(KeyboardInterrupt):
        optim.lookahead_update(optimizer, list(model.parameters()))
    assert optimizer.param_groups is groups and not optim.looking_ahead()
