"""The cockpit: schedule -> needs -> backward -> quantities -> store.

Usage::

    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    for step, (x, y) in enumerate(loader):
        loss = lossfunc(model(x), y)
        with cockpit(step, info={"batch_size": len(x), "loss": loss, ...}):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()

Frameworks that own the backward pass use the same step as two calls,
``cockpit.begin(step, info=...)`` before ``loss.backward()`` and
``cockpit.end()`` after it; the ``with`` form is built on them.
"""

from __future__ import annotations

import dataclasses
import inspect

import numbers
import os
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from cockpit_like.backends.distributed import RankGroup
from cockpit_like.backends.hooks import BatchNormInTrainingError
from cockpit_like.backends.internal import in_cockpit_work
from cockpit_like.backends.lean_hooks import ModuleCollector
from cockpit_like.backends.partitions import is_dtensor, micro_batches_of
from cockpit_like.backends.step import NotExtendedError, UnsupportedLayerError
from cockpit_like.backends.tracer import ModelTracer
from cockpit_like.backends.user_state import guard_module_hooks, guard_tensor_hooks, user_state_kept
from cockpit_like.checks.invariants import StepChecks
from cockpit_like.diagnosis import Diagnosis, Finding, Rule, active_findings, findings_in
from cockpit_like.diagnosis.recorder import RECORD_KEY, Record, Recorder
from cockpit_like.logs import EPOCH_KEYS, StreamWriter, now_iso, run_metadata, write_log
from cockpit_like.quantities.quantity import Quantity
from cockpit_like.quiet import QuietStep
from cockpit_like.run_output import RunOutput, StepAlreadyTrackedError
from cockpit_like.checks.prints import any_nonfinite
from cockpit_like.tracked_step import (
    NONFINITE_CHANGE, NoBackwardPassError, StepContext, StepEnvironment, StepRun, TrackedStep, gradients_changed,
    needs_closure, not_stored, parameters_moved,
)

__all__ = ["Cockpit", "NotExtendedError", "UnsupportedLayerError", "BatchNormInTrainingError", "ComplexParameterError",
           "NoBackwardPassError"]  # fmt: skip



def _check_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        raise ValueError("Cockpit(params): pass an iterable of tensors, e.g. model.parameters()")
    if callable(params) and not isinstance(params, Iterable):
        name = getattr(params, "__qualname__", type(params).__name__)
        raise ValueError(
            f"Cockpit(params): got the method/function {name} itself, not the parameters it returns; call it: "
            "Cockpit(model.parameters(), ...), with the parentheses"
        )
    checked = []
    for index, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise ValueError(
                f"Cockpit(params): parameter #{index} is a {type(param).__name__}, not a tensor; "
                "pass model.parameters()"
            )
        checked.append(param)  # frozen parameters (requires_grad=False) are tracked as such (checks["frozen"])
    first: dict[int, int] = {}
    repeats = [(first.setdefault(id(p), i), i) for i, p in enumerate(checked) if first.setdefault(id(p), i) != i]
    if repeats:  # counted twice in GradNorm, the tests, the histograms (outside trial 13: +20% GradNorm, valid)
        shown = ", ".join(f"#{later} is #{earlier}" for earlier, later in repeats[:4])
        raise ValueError(
            f"Cockpit(params): {len(repeats)} parameter(s) given more than once ({shown}"
            f"{' ...' if len(repeats) > 4 else ''}), as chaining a part's parameters with the whole model's does: "
            "each would count twice in the gradient's norm, the tests and the histograms. Pass each parameter "
            "once: model.parameters() alone, or list(dict.fromkeys(params)) to drop the repeats."
        )
    if not checked:
        consumed = " (a generator such as model.parameters() that the optimizer already used up: pass " \
            "list(model.parameters()) to both, or model.parameters() again)" if inspect.isgenerator(params) else ""
        raise ValueError(f"Cockpit(params): no parameters given{consumed}")
    return checked


class ComplexParameterError(TypeError):
    """A watched parameter is complex-valued: the cockpit's statistics are defined for real coordinates only."""


def _refuse_complex_params(params: list[torch.Tensor], model: torch.nn.Module | None) -> None:
    """Refuse complex parameters at construction, before any number could be stored (docs/your_model.md#limits).

    Each quantity's math (inner products without conjugation, histograms, the Alpha fit) is real; rather than
    store a complex or silently wrong value for some quantities and raise a raw error in others, none is stored.
    """
    complex_ones = [index for index, param in enumerate(params) if param.is_complex()]
    if not complex_ones:
        return
    names = {}
    if model is not None:
        names = {id(param): name for name, param in model.named_parameters()}
    described = ", ".join(
        f"{names.get(id(params[index]), f'parameter #{index}')} ({params[index].dtype}, shape {list(params[index].shape)})"
        for index in complex_ones
    )
    raise ComplexParameterError(
        f"Cockpit(params): complex-valued parameters are not supported: {described}. Parametrize each as two real "
        "parameters (e.g. w_re, w_im with torch.complex(w_re, w_im) in forward; each complex entry is then two real "
        "coordinates), or leave these parameters out of Cockpit(params) (docs/your_model.md#limits)"
    )


_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def _parse_bytes(value) -> int | None:
    """``memory_budget`` as bytes: ``None``, a positive int, or a string like ``"256MB"`` / ``"1.5 GB"``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"Cockpit(memory_budget=...) takes bytes (an int) or a string like '256MB', got {value!r}")
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        number = text.rstrip("KMGIB")
        unit = text[len(number):]
        try:
            value = float(number) * _UNITS[unit]
        except (ValueError, KeyError):
            raise ValueError(
                f"Cockpit(memory_budget={value!r}): not a size; write bytes as an int or a string like "
                "'256MB', '64 MiB' or '1GB'"
            ) from None
    if value <= 0:
        raise ValueError(f"Cockpit(memory_budget={value!r}): the budget must be positive (bytes)")
    return int(value)


class Cockpit:
    """Tracks quantities of a training run.

    Args:
        params: the parameters to watch, e.g. ``model.parameters()``. Frozen ones (``requires_grad=False``)
            and ones a step does not use count as zero gradients, and each tracked step's
            ``checks`` record names them (``docs/your_training_loop.md#self-checks``).
        quantities: :class:`~cockpit_like.quantities.quantity.Quantity` instances.
        stream_to: optional path; every tracked step is appended to
            ``stream_to + ".jsonl"`` as soon as it is computed, so a crash
            loses nothing already tracked (read it back with
            :func:`cockpit_like.read_log`).
        model: the ``nn.Module`` that owns ``params`` (optional). Any model
            works without ``backpack.extend``: modules BackPACK cannot handle
            get their per-sample gradients from module hooks
            (:mod:`cockpit_like.backends.hooks`). Without ``model`` the
            cockpit finds the model at its first forward pass after the
            cockpit was created (PyTorch's global module hooks).
        lean_hooks: swap BackPACK's full backward hooks for cheap tensor hooks
            after the first tracked step (see :mod:`cockpit_like.backends.lean_hooks`).
        log_rank: under ``torch.distributed`` (DistributedDataParallel, ``docs/distributed.md``),
            the rank that keeps the output, streams, writes logs and notifies
            listeners (``None``: every rank); every value describes the global
            batch and is computed on every rank, other ranks keep nothing
            (their :meth:`get_output` is ``{}``). Ignored in one process.
        distributed_timeout: seconds a rank waits in one of the cockpit's own
            collectives before it raises :class:`DistributedStepError` (default 120 s,
            so that a cockpit missing on a rank is an error within minutes rather than
            after torch's 30-minute default; ``None``: torch's default), and for the
            other ranks at the first tracked step, where the cockpit creates its
            process group (the constructor runs no collective).
        diagnose: run diagnosis rules after each tracked step and each
            :meth:`log` (``True``: every built-in rule; or a list of
            :class:`~cockpit_like.diagnosis.Rule` instances); nothing runs on
            untracked steps. Findings are stored under
            ``get_output()[step]["findings"]`` (and streamed), once per rule
            and layer until they clear (``docs/diagnosis.md``). The cockpit
            then also tracks, at the steps the given quantities track, the
            cheap inputs of the rules that were not given: ``ParamNorm``,
            ``LearningRate``, ``Momentum``, ``BatchSize`` and, with a model, ``ActivationStats`` and ``DataStats``
            (``diagnosis_feeds=False`` turns that off); the log metadata
            says which rules can run (``metadata["diagnosis"]``).
        on_finding: ``callable(finding)`` called for each new finding, after
            it and everything before it is stored and streamed; it may raise
            (e.g. to stop the run).
        record_nonfinite: record the first step whose loss (``info["loss"]``)
            or gradient (checked on tracked steps) is not finite, once
            (:meth:`record`, ``docs/recorder.md``); ``"tracked"``: check the
            loss on tracked steps only (no device sync on the others).
        record_dir: folder where each record is saved with its replay program;
            ``None``: records stay in memory (:attr:`records`).
        memory_budget: most bytes of per-sample gradients materialised at once (default 256 MB,
            :data:`~cockpit_like.backends.per_sample.DEFAULT_BUDGET_BYTES`): a layer whose
            ``[B, *param.shape]`` exceeds it is reduced a block of rows at a time (the same numbers;
            ``docs/performance.md``), and the factors of BackPACK's ``DiagHessian`` / ``DiagGGNExact``
            are backpropagated a block of columns at a time (``docs/curvature.md``). An int, or a string
            such as ``"64MB"`` or ``"1GB"``.
        self_checks: check at every tracked step that the per-sample decomposition matches the gradient
            autograd accumulated, see the loss factor on ``info["loss"]`` and check
            ``mean(individual_losses) == loss`` (``docs/your_training_loop.md#self-checks``). ``False``
            exists to measure their cost; the numbers are then unverified.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        quantities: list[Quantity] | None = None,
        stream_to: str | os.PathLike | None = None,
        *,
        model: torch.nn.Module | None = None,
        lean_hooks: bool = True,
        log_rank: int | None = 0,
        distributed_timeout: float | None = 120.0,
        diagnose: Any = False,
        on_finding: Callable[[Finding], Any] | None = None,
        record_nonfinite: bool | str = True,
        record_dir: str | os.PathLike | None = None,
        diagnosis_feeds: bool = True,
        memory_budget: int | str | None = None,
        self_checks: bool = True,
    ):
        self.params = _check_params(params)
        self._self_checks = bool(self_checks)
        #: bytes of per-sample gradients materialised at once (``None``: the default, 256 MB)
        self.memory_budget = _parse_bytes(memory_budget)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"Cockpit(model=...) takes the nn.Module that owns params, got {type(model).__name__}")
        if quantities is not None and not isinstance(quantities, (list, tuple)):
            raise ValueError(
                f"Cockpit(quantities=...) takes a list of Quantity instances, got "
                f"{type(quantities).__name__}"
            )
        _refuse_complex_params(self.params, model)
        self._module_collector = ModuleCollector() if lean_hooks else None
        #: the ranks of a DistributedDataParallel run (None in one process)
        self._ranks = RankGroup.detect(log_rank, distributed_timeout)
        #: what the tracked steps share across steps (:class:`~cockpit_like.tracked_step.StepRun`)
        self._run = StepRun()
        self._param_names: dict[int, str] = {}
        # the run's history across resumptions (docs/resume.md): when it began and where it was resumed
        self._history: dict[str, Any] = {"created": now_iso(), "resumptions": []}
        self.quantities: list[Quantity] = []
        self._names: dict[int, str] = {}
        self._initial_settings: dict[int, dict[str, Any]] = {}  # as added, to check a resumed state
        #: cockpit.log figures, findings, skipped steps; the stream and the listeners
        self._output = RunOutput()
        self._open_step: TrackedStep | None = None
        self._hooked_optimizers: list[Any] = []
        # id(info["optimizer"]) -> the step where the update was seen made by something else (_check_unseen_update)
        self._unseen_updaters: dict[int, int] = {}
        self._quiet = QuietStep()  # PyTorch's full-backward-hook warning, while a step is open (quiet.py)
        self._active_cache: tuple[int, list[Quantity]] | None = None
        self._streamed_names: list[str] | None = None  # the layer names in the stream's metadata
        if on_finding is not None and not callable(on_finding):
            raise ValueError(f"Cockpit(on_finding=...) takes a callable(finding), got {type(on_finding).__name__}")
        self.on_finding = on_finding
        #: the :class:`~cockpit_like.diagnosis.Diagnosis` run after tracked steps (None: off)
        self.diagnosis: Diagnosis | None = _make_diagnosis(diagnose)
        guard_tensor_hooks()  # the user's tensor hooks sit out the cockpit's own backward passes (user_state.py)
        self._tracer = ModelTracer(
            self.params,
            wants_graph=self._before_forward,
            on_attach=self._adapt_quantities,
            on_forward=lambda root, args, kwargs: self._recorder.forward_begins(root, args, kwargs, self._next_step),
            tracking=lambda: bool(self._active_at(self._next_step)),
        )
        self._recorder = Recorder(
            self._tracer,
            self.params,
            auto=record_nonfinite,
            folder=record_dir,
            on_record=self._on_record,
            paused=lambda: self._tracer.paused or in_cockpit_work(),
            is_tracked=lambda step: bool(self._active_at(step)),
        )
        #: what a tracked step needs from the cockpit, as one value (:mod:`cockpit_like.tracked_step`)
        self._env = StepEnvironment(
            params=self.params, tracer=self._tracer, collector=self._module_collector, ranks=self._ranks,
            output=self._output, run=self._run, memory_budget=self.memory_budget, self_checks=self._self_checks,
            keeps_output=lambda: self.keeps_output, active_at=self._active_at, create_graph=self.create_graph,
            name_of=self.name_of, param_names=self._names_of_params, param_name_list=self._param_name_list,
            models=self.models, diagnose=self._diagnose, report=self.add_finding,
        )  # fmt: skip
        for quantity in quantities or []:
            self.add(quantity)
        if model is not None:
            self._tracer.attach(model)
        self._tracer.discover()
        #: names of the quantities the cockpit added for the diagnosis rules (``diagnosis_feeds``)
        self.diagnosis_feeds: list[str] = []
        if self.diagnosis is not None and diagnosis_feeds and self.quantities:
            self._add_diagnosis_feeds()
        if stream_to is not None and self.keeps_output:
            self._output.stream = StreamWriter(stream_to, self.metadata())
            self._streamed_names = self._param_name_list()

    # ---- set up ------------------------------------------------------------
    def _add_diagnosis_feeds(self) -> None:
        """Track, at the steps the given quantities track, the cheap inputs of the rules that are
        missing: ``ParamNorm``, ``LearningRate``, ``Momentum``, ``BatchSize`` and (with a model)
        ``ActivationStats`` and ``DataStats``."""
        from cockpit_like.quantities import ActivationStats, BatchSize, DataStats, LearningRate, Momentum, ParamNorm

        schedule = _AnyTracked(list(self.quantities))
        feeds = [ParamNorm, LearningRate, Momentum, BatchSize] + (
            [ActivationStats, DataStats] if self._tracer.roots else [])
        for cls in feeds:
            if not any(isinstance(q, cls) for q in self.quantities):
                self.add(cls(schedule))
                self.diagnosis_feeds.append(cls.__name__)

    def add(self, quantity: Quantity) -> None:
        """Track one more quantity."""
        if isinstance(quantity, type) and issubclass(quantity, Quantity):
            raise ValueError(
                f"Cockpit: got the class {quantity.__name__}; pass an instance, e.g. "
                f"{quantity.__name__}(track_schedule=linear(1))"
            )
        if not isinstance(quantity, Quantity):
            raise ValueError(
                f"Cockpit: {quantity!r} ({type(quantity).__name__}) is not a Quantity; "
                "quantities come from cockpit_like.quantities or subclass "
                "cockpit_like.quantities.quantity.Quantity"
            )
        if any(q is quantity for q in self.quantities):
            raise ValueError(f"Cockpit: {type(quantity).__name__} instance added twice")
        owner = getattr(quantity, "_cockpit_owner", None)
        other = owner() if owner is not None else None
        if quantity.output or (other is not None and other is not self):
            held = sorted(quantity.output)
            what = (f"already holds step{'s' if len(held) > 1 else ''} "
                    f"{held[0]}{f'-{held[-1]}' if len(held) > 1 else ''} of another cockpit" if held
                    else "already belongs to another cockpit")  # fmt: skip
            raise ValueError(
                f"Cockpit: this {type(quantity).__name__} instance {what}: a quantity keeps its outputs (and a "
                "two-step quantity its start between steps), so it belongs to one cockpit. For a new run, make new "
                'quantities too: quantities=configuration("economy") again, or new instances of your own list '
                "(in a notebook, build them in the same cell as the Cockpit)."
            )
        quantity._cockpit_owner = weakref.ref(self)
        base = type(quantity).__name__
        name, count = base, 1
        while name in self._names.values():
            name, count = f"{base}_{count}", count + 1
        self.quantities.append(quantity)
        self._active_cache = None
        self._names[id(quantity)] = name
        self._initial_settings[id(quantity)] = quantity.settings()
        if self._tracer.roots:
            quantity.adapt_to_models(self.models())

    def models(self) -> list[torch.nn.Module]:
        """The models that own the tracked parameters, as far as the cockpit knows them."""
        return [root for root in (ref() for ref in self._tracer.roots) if root is not None]

    def curvature(self, kind: str | None = None, damping: float | None = None, layers=None, quantity=None):
        """The curvature of the last tracked step as an operator (docs/curvature_statistics.md).

        Asks the quantities that hold logged curvature statistics (those with a
        ``curvature_operator`` method, e.g. ``SelfInfluence``) and takes the one
        that tracked last (or ``quantity``: an instance or its name). Its
        statistics are those of the tracked steps up to that step
        (``window="run"``) or of that step alone (``window="step"``).

        Args:
            kind: ``"kfac"`` or ``"ekfac"`` (default: what the statistics allow, EK-FAC if logged).
            damping: ``None``, or ``λ >= 0`` for ``F + λI``.
            layers: names of logged layers to keep (default: all).

        Returns:
            A named :class:`~cockpit_like.operators.BlockDiagonal`, one block per
            covered parameter (``"<layer>.weight"``, ``"<layer>.bias"``) in the
            order of the cockpit's parameters.
        """
        if kind is not None and kind not in ("kfac", "ekfac"):
            raise ValueError(f"cockpit.curvature(kind={kind!r}): kind is 'kfac' or 'ekfac' (or None: EK-FAC where "
                             "its statistics are logged, else KFAC)")  # fmt: skip
        holders = [q for q in self.quantities if callable(getattr(q, "curvature_operator", None))]
        if quantity is not None:
            holders = [q for q in holders if q is quantity or self.name_of(q) == quantity]
        tracked = [q for q in holders if getattr(q, "last_step", None) is not None]
        if not tracked:
            raise RuntimeError(
                "cockpit.curvature(): no quantity holds logged curvature statistics of a tracked step"
                + (f" (quantity={quantity!r} not found among them)" if quantity is not None and not holders else "")
                + ". Track one (e.g. CurvatureStatistics, SelfInfluence, PreconditionedGradNorm, EKFACSpectrum) "
                "and call curvature() after one of its steps."
            )
        holder = max(tracked, key=lambda q: q.last_step)
        kind = holder.curvature_kind() if kind is None else kind
        return holder.curvature_operator(self.params, kind=kind, damping=damping, layers=layers)[0]

    def _adapt_quantities(self) -> None:
        self._param_names = {}  # a new model: names again from all of them
        models = self.models()
        guard_module_hooks(models)
        before = [q.settings() for q in self.quantities]
        for quantity in self.quantities:
            quantity.adapt_to_models(models)
        if self._ranks is not None:
            self._ranks.watch(models, lambda: self.create_graph(self._next_step))
        names = self._param_name_list()
        changed = before != [q.settings() for q in self.quantities] or names != self._streamed_names
        if self._output.stream is not None and changed:  # the layer names findings use, too
            self._output.stream.write_metadata(self.metadata())
            self._streamed_names = names

    def name_of(self, quantity: Quantity) -> str:
        """The key of ``quantity`` in :meth:`get_output` (its class name, or
        ``ClassName_1``, ``ClassName_2``, ... for further instances of a class)."""
        return self._names[id(quantity)]

    def metadata(self) -> dict[str, Any]:
        """Run metadata written with the logs."""
        described = []
        for quantity in self.quantities:
            schedule = getattr(quantity, "_track_schedule", None)
            described.append(
                {
                    "name": self.name_of(quantity),
                    "class": type(quantity).__name__,
                    "settings": quantity.settings(),
                    "schedule": getattr(schedule, "description", repr(schedule)),
                }
            )
            shift = int(getattr(quantity, "SAVE_SHIFT", 0) or 0)
            if shift:  # stored under its start step, known SAVE_SHIFT steps later (a replay feeds it then)
                described[-1]["save_shift"] = shift
        meta = run_metadata(described)
        meta["created"] = self._history.get("created") or meta["created"]  # when the run began
        meta["num_params"] = len(self.params)
        meta["param_shapes"] = [list(p.shape) for p in self.params]
        meta["param_names"] = self._param_name_list()
        meta["stale_gradients_checked"] = self._stale_gradients_checked()
        if self.diagnosis is not None:
            meta["diagnosis"] = self.diagnosis.plan([self.name_of(q) for q in self.quantities],
                                                    getattr(self, "diagnosis_feeds", []))
        return meta

    def _names_of_params(self) -> dict[int, str]:
        """``id(param) -> "module.path.weight"`` for the models the cockpit knows (for messages)."""
        if not self._param_names:
            for ref in self._tracer.roots:
                root = ref()
                if root is not None:
                    for name, param in root.named_parameters():
                        self._param_names.setdefault(id(param), name)
        return self._param_names

    # ---- per step ------------------------------------------------------------
    @property
    def self_checks(self) -> bool:
        """Whether tracked steps run their self-checks (``False`` only to measure their cost: the numbers are then
        unverified). May be set between steps; a step already begun keeps what it began with."""
        return self._self_checks

    @self_checks.setter
    def self_checks(self, value: bool) -> None:
        changed = bool(value) != self._self_checks
        self._self_checks = bool(value)
        self._env = dataclasses.replace(self._env, self_checks=self._self_checks)
        if changed and self._output.stream is not None:  # the log says whether p.grad was checked for stale sums
            self._output.stream.write_metadata(self.metadata())

    def _stale_gradients_checked(self) -> bool:
        """Whether each tracked step checks that p.grad was zero when its first backward pass began (the self-checks
        are on and no parameter is sharded: a DTensor gradient is not read): a forgotten ``zero_grad`` is then
        reported as a conclusive ``gradients-accumulate`` finding at the first tracked step it affects."""
        return self._self_checks and not any(is_dtensor(p) for p in self.params)

    def create_graph(self, global_step: int) -> bool:
        """Whether ``loss.backward`` must be called with ``create_graph=True`` at this step."""
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise ValueError(
                f"cockpit.create_graph(global_step): need the step number, an int >= 0 (the same as in "
                f"`with cockpit(step, ...)`), got {global_step!r} ({type(global_step).__name__})"
            )
        return any(q.create_graph(global_step) for q in self._active_at(global_step))

    def _active_at(self, global_step: int) -> list[Quantity]:
        """The quantities active at ``global_step``, asked once per step (the forward pass, ``begin``
        and ``create_graph`` of one step share the answer; adding a quantity asks again)."""
        cached = self._active_cache
        if cached is not None and cached[0] == global_step:
            return cached[1]
        active = [q for q in self.quantities if q.is_active(global_step)]
        self._active_cache = (global_step, active)
        return active

    def __call__(self, global_step: int, *exts: Any, info: dict | None = None, debug: bool = False):
        """The context manager around ``loss.backward()`` for ``global_step``
        (:meth:`begin` on entry, :meth:`end` on exit)."""
        _check_step_arguments(global_step, info)
        self._refuse_closed(global_step)
        return StepContext(self.begin, self.end, global_step, exts, _inner_optimizer(info or {}), debug)

    def begin(self, global_step: int, *exts: Any, info: dict | None = None, debug: bool = False) -> None:
        """Open ``global_step``: call before ``loss.backward()``, then :meth:`end`.

        The two-call form of ``with cockpit(global_step, *exts, info=info,
        debug=debug):`` for frameworks that own the backward pass (Lightning,
        the Hugging Face ``Trainer``). Only one step is open at a time.
        """
        _check_step_arguments(global_step, info)
        self._refuse_closed(global_step)
        info = _inner_optimizer(info) if info is not None else None
        if self._open_step is not None:
            raise RuntimeError(
                f"cockpit.begin({global_step}): step {self._open_step.step} is still open. "
                "Steps cannot overlap: call cockpit.end() after that step's loss.backward() "
                "before beginning the next one."
            )
        with user_state_kept(self.models()):  # grad mode, RNG: as they were, whatever fails (docs/notebooks.md)
            self._release_loose()
            self._begin(global_step, exts, info, debug)

    def _release_loose(self) -> None:
        """Finish taking down failed steps whose take-down was itself interrupted (a second interrupt)."""
        for loose in list(self._run.loose):
            try:
                loose.release()
            except Exception as error:  # noqa: BLE001 - never block the run's next steps for it
                warnings.warn(f"[cockpit_like] taking down the failed step {loose.step} failed again "
                              f"({type(error).__name__}: {error}); left as it is", RuntimeWarning, stacklevel=3)
            if loose in self._run.loose:
                self._run.loose.remove(loose)

    def _begin(self, global_step: int, exts: tuple, info: dict | None, debug: bool) -> None:
        pending, ignored = self._run.pending, False
        undeclared = "micro_batches" not in (info or {}) and self._run.micro is None
        optimizer = (info or {}).get("optimizer")
        self._watch_optimizer(optimizer)
        # a backward pass inside the optimizer's step(closure): one of the closure's evaluations
        evaluation = optimizer is not None and self._run.stepping is optimizer
        if evaluation:
            self._run.evaluations += 1
        several = evaluation and (self._run.evaluations > 1 or id(optimizer) in self._run.multi_evaluation)
        if several and pending is not None and pending.step == global_step:
            # the step waiting for more backward passes gets another evaluation of the closure: dropped
            pending._execution.free()
            self._run.pending, self._run.partitions = None, None
            self._several_evaluations(global_step, optimizer, set(), evaluation)
            ignored, micro, count = True, 0, 1
        elif pending is not None and pending.step == global_step and undeclared:
            # another backward pass of the step whose end was not declared: one more partition of its rows
            pending._execution.free()
            self._run.pending = None
            micro, count = len(self._run.partitions.partitions), len(self._run.partitions.partitions) + 1
        else:
            self._flush()
            micro, count = self._micro_batch(global_step, info or {})
            if micro == 0:
                self._check_updates_between(global_step)
            if micro == 0 and self._run.stepped is not None and self._run.stepped[0] == global_step:
                raise StepAlreadyTrackedError(
                    f"cockpit step {global_step}: this step was tracked and {self._run.stepped[1]}.step() has run "
                    "since, so "
                    "this block (and the backward pass it holds) belongs to a new optimizer step under the same "
                    "global_step. Give each optimizer step its own number (e.g. count optimizer steps, not epochs "
                    "or batches of an accumulating loop); the micro-batches of one step share a number and come "
                    "before its optimizer.step(). A validation batch needs no block: log its loss with "
                    "cockpit.log(step, valid_loss=...)."
                )
            if micro == 0 and self._active_at(global_step):  # a step is stored once (a notebook cell run again)
                self._output.check_new_step(global_step, (q.output for q in self.quantities), not undeclared)
            finished = self._run.finished
            repeated = undeclared and finished is not None and finished[0] == global_step
            if several or (repeated and needs_closure(optimizer)):
                # the optimizer evaluates its closure several times per step (LBFGS): the step is invalid
                self._several_evaluations(global_step, optimizer, finished[1] if repeated else set(), evaluation)
                ignored = True
            elif repeated and _failed_check(self._output.checks.get(global_step), "backward_passes"):
                self._count_pass(global_step)  # yet another pass of a step already withdrawn
                ignored = True
            elif repeated:
                # a further backward pass of a step already finished as a whole: its values describe only the
                # first pass's rows; they are withdrawn and the step is stored as invalid, and the cockpit now
                # finishes steps when the optimizer steps (the next ones are merged)
                self._invalidate(global_step, finished[1])
                ignored = True
        tracked = TrackedStep(self._env, global_step, exts, info or {}, debug, micro, count, ignored=ignored)
        # the cockpit's own work is not recorded; the loss is checked at most once (one device sync)
        try:
            self._quiet.open()
            declared = tracked.micro_batches if "micro_batches" in tracked.info else None
            with self._recorder.beginning(
                global_step, tracked.info, tracked.loss_finite, micro, declared, tracked.accumulating
            ):
                tracked.__enter__()  # raises before the step counts as open
        except BaseException:
            self._run.micro, self._run.partitions = None, None  # the step is abandoned: the next one starts afresh
            self._run.raised.add(global_step)  # (its two-step values' notes say so)
            tracked.release()  # (what an interrupt between its parts left set up)
            self._recorder.let_go()
            self._quiet.close()
            raise
        self._open_step = tracked

    def end(self, error: BaseException | None = None) -> None:
        """Close the step opened by :meth:`begin`: compute and store its quantities.

        Pass the exception that interrupted the step as ``error`` (then the
        cockpit only frees its buffers and stores nothing for that step).
        """
        tracked = self._open_step
        if tracked is None:
            raise RuntimeError(
                "cockpit.end() without an open step: call cockpit.begin(global_step, info=...) "
                "before loss.backward(), and cockpit.end() once after it."
            )
        self._open_step = None
        try:
            with user_state_kept(self.models()):  # grad mode, RNG: as they were, whatever fails (docs/notebooks.md)
                self._end(tracked, error)
        except BaseException:  # what the failure (or an interrupt in its own take-down) skipped; each runs again safely
            if self._run.pending is not tracked:
                tracked.release()
            self._recorder.let_go()
            self._quiet.close()
            self._write_stream()
            raise

    def _write_stream(self) -> None:
        """Write what the stream could not write (an interrupt in the middle of a line); never raises an
        ``Exception``: what is still not written waits for the next write."""
        try:
            self._output.drain()
        except Exception:  # noqa: BLE001 - the failure being handled is the one to show
            pass

    def _end(self, tracked: TrackedStep, error: BaseException | None) -> None:
        done = tracked.micro + 1
        self._run.micro = None if error is not None or done == tracked.micro_batches else (tracked.step, done, tracked.micro_batches)
        try:
            failure = None
            try:
                self._recorder.step_ends(tracked.step, tracked.info, error)
            except BaseException as caught:  # the step is left all the same, and stores nothing
                failure = caught
            error = error if error is not None else failure
            if error is None:
                tracked.__exit__(None, None, None)
            else:
                tracked.__exit__(type(error), error, error.__traceback__)
            if failure is not None:
                raise failure
        except BaseException:
            self._run.micro = None  # the step is dropped: its next backward pass starts afresh
            # the recorder still re-runs a non-finite loss of this backward pass (it never raises for one)
            self._recorder.after_step(tracked.step, tracked.info, tracked=False)
            raise
        finally:
            self._quiet.close()
        if self._run.pending is tracked:
            self._watch_optimizer(tracked.info.get("optimizer"))
        elif error is None and self._run.micro is None:
            self._withdraw_if_unseen(tracked.step, tracked.info.get("optimizer"))
        self._split_step(tracked.step)
        self._recorder.after_step(
            tracked.step, tracked.info,
            tracked=error is None and (tracked.completed or tracked.skipped or self._run.pending is tracked),
            complete=self._run.micro is None and self._run.pending is not tracked,
        )

    def _split_step(self, step: int) -> None:
        """``step`` found the gradients of the step before it in p.grad, and the declared optimizer did not step in
        between (:meth:`TrackedStep._judge_stale`): that step was a micro-batch of this optimizer step entered under
        its own number, and its values, stored as valid, describe a part of the step: withdrawn, the step invalid
        (outside trial 13: GradNorm 48-79% above the optimizer step's, valid, at every other step)."""
        previous, self._run.split_step = self._run.split_step, None
        if previous is None:
            return
        names = {self.name_of(q) for q in self.quantities}
        for quantity in self.quantities:  # what started there (UpdateSize, Alpha) would span the merged step
            quantity.drop_start(previous, step)
        record = self._failed_after_storing(previous, names, "micro_batch_numbering", lambda withdrawn: (
            f"step {step} began with this step's gradients still in p.grad, and info['optimizer'] did not step "
            f"in between: steps {previous} and {step} are micro-batches of one optimizer step under two numbers, "
            "so the values of this step described a part of it and are withdrawn"
            + (f" ({', '.join(sorted(withdrawn))})" if withdrawn else "")
            + ". Give every micro-batch of an optimizer step the same global_step, with info['micro_batches']."
        ), with_list=False)
        self._store_checks(previous, record)

    def _failed_after_storing(self, step: int, names: set[str], check: str, reason: Callable[[list[str]], str],
                              with_list: bool = True) -> dict:
        """``step``, stored already, fails ``check``: its values of the quantities ``names`` are withdrawn (also
        from the stream), their error bars too; the record to store, with the failure (``reason(withdrawn)``;
        ``with_list``: the names withdrawn under ``"withdrawn"`` too)."""
        record = self._output.checks.get(step)
        withdrawn = self._withdraw_step(step, names)
        record = _without_error_bars(record, withdrawn) if record is not None else StepChecks(step).to_dict()
        record["valid"] = False
        failure = {"check": check, "reason": reason(withdrawn)}
        if with_list:
            failure["withdrawn"] = withdrawn
        record["failed"] = list(record.get("failed", [])) + [failure]
        return record

    def _withdraw_step(self, step: int, decomposed: set[str]) -> list[str]:
        """Withdraw the values ``step`` stored for the quantities named in ``decomposed``; their names."""
        self._run.invalid_steps.add(step)
        withdrawn = []
        for quantity in self.quantities:
            name = self.name_of(quantity)
            if name in decomposed and step in quantity.output:
                del quantity.output[step]
                withdrawn.append(name)
        self._output.retract(step, withdrawn)
        return withdrawn

    def _count_pass(self, step: int) -> None:
        """One more backward pass of a step already stored as invalid: its checks count it."""
        record = dict(self._output.checks[step])
        record["backward_passes"] = record.get("backward_passes", 1) + 1
        self._store_checks(step, record)

    def _several_evaluations(self, step: int, optimizer: Any, decomposed: set[str], counted: bool) -> None:
        """A backward pass of ``step`` inside ``optimizer.step(closure)`` that is not the step's only one (or the
        optimizer was seen to evaluate its closure several times per step): the step is invalid, said once.
        ``counted``: :attr:`StepRun.evaluations` counts the step's passes (the optimizer's hooks saw its step
        begin; not at the first step, whose hooks are set up by its first pass)."""
        run = self._run
        learned = run.multi_evaluation.setdefault(id(optimizer), step)
        record = self._output.checks.get(step)
        if _failed_check(record, "closure_evaluations"):
            self._count_pass(step)
            return
        passes = run.evaluations if counted else (1 if record is None else record.get("backward_passes", 1) + 1)
        name = type(optimizer).__name__
        seen = "" if learned == step else f" (as it did at step {learned}: this step is not computed)"
        record = self._failed_after_storing(step, decomposed, "closure_evaluations", lambda withdrawn: (
            f"{name}.step(closure) evaluates its closure (a forward and backward pass) several times per "
            f"optimizer step{seen}, at parameters it changes in between (LBFGS's iterations and line search): "
            f"such a step cannot be described by one batch's per-sample gradients at one set of parameters, so "
            f"step {step} stores no numbers. Use one evaluation per step (LBFGS(max_iter=1) without "
            "line_search_fn), or enter the cockpit only around the first evaluation of each optimizer step (the "
            "quantities then describe the gradient where the step starts), or leave the cockpit out for this "
            "optimizer."
        ))
        record["backward_passes"] = passes
        self._store_checks(step, record)

    def _invalidate(self, step: int, decomposed: set[str]) -> None:
        """A finished step turned out to have more backward passes: withdraw its values (they describe the
        first pass, not the optimizer step)."""
        self._run.accumulates = True
        passes = self._output.checks.get(step, {}).get("backward_passes", 1) + 1
        # what started at this step from its first pass's gradients (Alpha's predicted update) ends no value either:
        # at the next step it met an update made from all the passes, and said so in general words (trial 34)
        dropped = sorted(self.name_of(q) for q in self.quantities
                         if getattr(q, "predicts_update", False) and q.drop_start(step, step + q.SAVE_SHIFT))
        started = (f" {', '.join(dropped)} of step {step}, which started from the first pass's gradients, will not be "
                   "stored either." if dropped else "")
        record = self._failed_after_storing(step, decomposed, "backward_passes", lambda withdrawn: (
            f"step {step} got another backward pass after it was finished as a whole, so its values described "
            f"only the first pass and were withdrawn.{started} The cockpit has learned that this loop "
            "accumulates: from now on a step ends when info['optimizer'] steps (or the next step begins), and its "
            "backward passes are merged. Declaring info['micro_batches'] merges them from the first step on. "
            "If the passes are an optimizer's evaluations of its closure (LBFGS evaluates it up to max_iter "
            "times per step), pass info['optimizer'] = optimizer: the cockpit then says so."
        ))
        record["backward_passes"] = passes
        self._store_checks(step, record)

    def _flush(self, at_optimizer_step: bool = False) -> None:
        """Finish the step whose end was not declared (its optimizer stepped, the next step begins, or the
        output is read): merge its backward passes, check them and track its quantities."""
        pending, self._run.pending = self._run.pending, None
        if pending is not None:
            with user_state_kept(self.models()):
                pending.finish(at_optimizer_step=at_optimizer_step)
            self._withdraw_if_unseen(pending.step, pending.info.get("optimizer"))

    def _watch_optimizer(self, optimizer: Any) -> None:
        """Step hooks on ``optimizer`` (once): right before it updates the parameters, finish a pending step and
        check that the parameters (and gradients) are those of the last tracked block
        (:meth:`_check_optimizer_step`); while its ``step(closure)`` runs, the backward passes begun are its
        closure's evaluations (:attr:`StepRun.stepping`)."""
        from cockpit_like.utils.optim import has_step_hooks, looking_ahead

        if not has_step_hooks(optimizer):  # (not an Optimizer, or a wrapper without Optimizer.__init__)
            return
        if any(known() is optimizer for known, _ in self._hooked_optimizers):
            return
        import weakref

        me = weakref.ref(self)

        def before_step(opt, args, kwargs) -> None:
            cockpit = me()
            if cockpit is None or looking_ahead():
                return
            if cockpit._open_step is not None:
                # inside the block: the step's parameters and gradients would be read after the update (Distance
                # and UpdateSize one update off, false notes; outside trial 9): refused before anything moves
                raise RuntimeError(
                    f"{type(opt).__name__}.step() was called inside `with cockpit({cockpit._open_step.step}, ...)`: "
                    "the block must hold only the backward pass (the cockpit reads the step's gradients and "
                    "parameters when it ends, before the optimizer moves them). Call optimizer.step() after the "
                    "block. Nothing of this step is stored and the parameters did not move."
                )
            if cockpit._run.pending is not None:
                cockpit._flush(at_optimizer_step=cockpit._run.pending.info.get("optimizer") is opt)
            cockpit._check_optimizer_step(opt)
            closure = args[0] if args else kwargs.get("closure")
            if closure is not None:
                cockpit._run.stepping, cockpit._run.evaluations = opt, 0

        def after_step(opt, args, kwargs) -> None:
            cockpit = me()
            if cockpit is None or looking_ahead():
                return
            if cockpit._run.stepping is opt:
                cockpit._run.stepping, cockpit._run.evaluations = None, 0
            if cockpit._run.finished is not None and cockpit._run.pending is None:
                cockpit._run.stepped = (cockpit._run.finished[0], type(opt).__name__)
            updates = cockpit._run.updates
            if updates is not None and updates[1] == id(opt):
                updates[2] += 1
            watch = cockpit._run.watch
            if watch is not None and watch[1] is opt:
                # not compared before this step: the block ran inside it (a closure's evaluation, at the first
                # step, whose hooks the block itself set up): its parameters were the optimizer's
                cockpit._run.watch = None

        handles = (optimizer.register_step_pre_hook(before_step), optimizer.register_step_post_hook(after_step))
        self._hooked_optimizers.append((weakref.ref(optimizer), handles))

    def _check_optimizer_step(self, optimizer: Any) -> None:
        """``optimizer`` is about to step: the parameters must be those the last tracked block outside its step
        saw (else the quantities that measure the parameters or the update are withdrawn at that step, and a note
        says why), and the gradients of a step finished at the block's end those its backward pass left, or
        these times one factor (else a note, and Alpha, which predicted the update from them, is withdrawn)."""
        watch = self._run.watch
        if watch is None or watch[1] is not optimizer:
            return
        self._run.watch = None
        step, _, before, grads = watch
        moved = parameters_moved(self.params, step, before)
        groups = getattr(optimizer, "param_groups", None) if moved else None
        held = {id(p) for group in groups for p in group["params"]} if groups else set()
        if moved:
            shown = self._shown(moved)
        if moved and held and not any(id(self.params[i]) in held for i in moved):
            # none of them is the declared optimizer's: another optimizer stepped them, after the block (their
            # loss and gradients are of the block's parameters; what they moved is part of the iteration's update)
            name = type(optimizer).__name__
            self._withdraw_motion(
                step, lambda q: getattr(q, "predicts_update", False), ends=False,
                note=(f"the parameters ({shown}) changed between the backward pass of step {step} and {name}.step(), "
                      f"and info['optimizer'] ({name}) does not hold them: another optimizer stepped them (several "
                      "optimizers in one iteration, e.g. Muon for the matrices and AdamW for the rest). The quantities "
                      "that measure the parameters describe the whole iteration's update, but those that predict the "
                      f"update from {name} alone are withdrawn at this step: {{withdrawn}}. To track them, step all the "
                      "parameters with one optimizer (param groups), or leave them out."),
            )  # fmt: skip
        elif moved:
            self._withdraw_readers(
                step,
                note=(f"the parameters ({shown}) changed between the backward pass of step {step} and "
                      f"{type(optimizer).__name__}.step() (e.g. SAM's perturbation, removed after the cockpit's "
                      "block): the step's loss and gradients were taken at other parameters than those the "
                      "optimizer stepped from, so the quantities that measure the parameters or the update are "
                      "withdrawn at this step: {withdrawn}. Enter the cockpit around the backward pass at the "
                      "parameters the optimizer steps from, or leave these quantities out."),
            )  # fmt: skip
        if grads is not None and gradients_changed(self.params, step, grads):
            # those that can predict from the optimizer's gradients learn to wait for its step (Alpha)
            # (not under DDP, whose steps end at the block with the ranks' collectives, nor where the optimizer
            # steps with a closure: there the values stay withdrawn, step by step)
            can_wait = self._ranks is None and not needs_closure(optimizer)
            learned = sorted(self.name_of(q) for q in self.quantities
                             if can_wait and getattr(q, "predicts_update", False) and q.learn_to_wait(step))  # fmt: skip
            waits = (f"; from the next tracked step on, {', '.join(learned)} waits for {type(optimizer).__name__}.step() "
                     "and predicts the update from the gradients it steps with (the step's per-sample rows and the "
                     "backward pass's gradients are kept until then)") if learned else ""  # fmt: skip
            self._withdraw_motion(
                step, lambda q: getattr(q, "predicts_update", False), ends=False,
                note=(f"the gradients changed between the end of the backward pass of step {step} and "
                      f"{type(optimizer).__name__}.step(), and not by one factor ("
                      + (NONFINITE_CHANGE if any_nonfinite(grads) else "e.g. SAM's second backward pass, "
                         "per-parameter clipping by value, gradient noise")
                      + "): the quantities describe the gradient of the "
                      "backward pass, not the one the optimizer used; withdrawn, as they predict the update from it: "
                      "{withdrawn}" + waits + "."),
            )  # fmt: skip

    def _check_updates_between(self, step: int) -> None:
        """A new step begins: where the optimizer of the step tracked last stepped more than once since, the values
        that start there and end here (UpdateSize, Alpha: ``theta_{t+1} - theta_t``) would span several updates:
        they are not computed, and a note at their step says why."""
        updates, self._run.updates = self._run.updates, None
        self._run.unstepped = updates[0] if updates is not None and updates[2] == 0 and updates[3] else None
        if updates is not None and updates[2] == 0:
            self._check_unseen_update(updates[0], updates[1])
        if updates is None or updates[2] <= 1:
            return
        start, _, count, _ = updates
        lost = sorted(self.name_of(q) for q in self.quantities if q.drop_start(start, step))
        if lost:
            self._note(start, (
                f"{not_stored(lost, start)}: the optimizer "
                f"stepped {count} times between the tracked steps {start} and {step}, so theta_{step} - theta_{start} "
                f"spans {count} updates, not the update of step {start}. Enter the cockpit at every optimizer step, "
                "numbered 0, 1, 2, ... (a schedule picks the steps whose quantities are computed)."
            ))  # fmt: skip

    def _check_unseen_update(self, start: int, optimizer_id: int) -> None:
        """A new step begins and ``info["optimizer"]`` of step ``start`` did not step since its block: where the
        parameters moved all the same, something else made the update (a wrapper that steps an optimizer inside
        it, as SAM's ``first_step`` / ``second_step``, or an update by hand), and nothing saw the parameters it
        started from (the check at the optimizer's step did not run), so the quantities that measure the
        parameters or the update at ``start`` are withdrawn, with a note (outside trial 12: a SAM wrapper with
        the block at the perturbed point stored UpdateSize and Distance 13-80% off as valid)."""
        watch = self._run.watch
        if watch is None or watch[0] != start or id(watch[1]) != optimizer_id:
            return
        self._run.watch = None
        if optimizer_id in self._unseen_updaters:
            return  # (withdrawn as the step finished)
        if not getattr(type(watch[1]).step, "hooked", False):
            # its step() does not run the step hooks (a wrapper that never called Optimizer.__init__): that it
            # did not step is not known (its step, if any, is checked by the look-ahead of the quantities)
            return
        moved = parameters_moved(self.params, start, watch[2])
        if not moved:
            return  # no update at all (a GradScaler skipped the step): the values are right
        self._unseen_updaters[optimizer_id] = start
        shown, name = self._shown(moved), type(watch[1]).__name__
        self._withdraw_readers(
            start,
            note=(f"the parameters ({shown}) changed after the block of step {start}, but info['optimizer'] "
                  f"({name}) did not step before the next tracked step: something else made the update (a wrapper "
                  "that steps an optimizer inside it, as SAM's first_step / second_step; an update by hand), so "
                  "nothing checked that it started from the parameters the block saw; the quantities that measure "
                  "the parameters or the update are withdrawn at this step: {withdrawn}. Pass as info['optimizer'] "
                  f"the optimizer whose step() makes the update (for SAM: {name}.base_optimizer)."),
        )  # fmt: skip

    def _shown(self, moved: list[int]) -> str:
        """The names of the first three parameters at the indices ``moved`` (``...`` where there are more)."""
        names = self._env.param_name_list()
        return ", ".join(names[i] for i in moved[:3]) + (" ..." if len(moved) > 3 else "")

    def _withdraw_if_unseen(self, step: int, optimizer: Any) -> None:
        """``step`` finished, and its ``info["optimizer"]`` was seen not to make the updates of this loop (at an
        earlier step, :meth:`_check_unseen_update`): its parameters are not those an update starts from either
        (the last step of a run is never followed by a check), so the same quantities are withdrawn now."""
        first = self._unseen_updaters.get(id(optimizer)) if optimizer is not None else None
        if first is None:
            return
        if self._run.watch is not None and self._run.watch[0] == step:
            self._run.watch = None
        name = type(optimizer).__name__
        self._withdraw_readers(
            step,
            note=(f"info['optimizer'] ({name}) did not make the update after step {first} (see that step's note), "
                  "so the parameters of this step's block are not taken for those an update starts from; the "
                  "quantities that measure the parameters or the update are withdrawn: {withdrawn}. Pass as "
                  f"info['optimizer'] the optimizer whose step() makes the update (for SAM: {name}.base_optimizer)."),
        )  # fmt: skip

    def _withdraw_readers(self, step: int, note: str) -> None:
        """:meth:`_withdraw_motion` of the quantities that measure the parameters or the update, ends included."""
        self._withdraw_motion(step, lambda q: getattr(q, "reads_parameters", False), ends=True, note=note)

    def _note(self, step: int, text: str) -> None:
        """Add ``text`` to the notes of ``step``'s checks (stored already, or stored with it)."""
        self._env.add_note(step, text)

    def _withdraw_motion(self, step: int, which: Callable[[Quantity], bool], ends: bool, note: str) -> None:
        """Withdraw the values of ``step`` of the quantities ``which`` selects (and, with ``ends``, the values whose
        end was ``step``), and add ``note`` (``{withdrawn}``: their names) to the step's checks."""
        withdrawn = []
        for quantity in self.quantities:
            if not which(quantity):
                continue
            name = self.name_of(quantity)
            if quantity.is_active(step):
                withdrawn.append(name)
            for removed in quantity.withdraw(step, ends=ends):
                self._output.retract(removed, [name])
        self._note(step, note.format(withdrawn=", ".join(sorted(set(withdrawn))) or "none was stored"))

    def _micro_batch(self, step: int, info: dict) -> tuple[int, int]:
        """``(index, count)`` of the backward pass that begins: its place among the step's micro-batches."""
        count = micro_batches_of(info, step)
        progress = self._run.micro
        if progress is not None and progress[0] == step:
            if "micro_batches" in info and count != progress[2]:
                raise ValueError(
                    f"cockpit step {step}: info['micro_batches'] is {count} at backward pass {progress[1] + 1}, "
                    f"but was {progress[2]} at the first one; pass the same number on every micro-batch of a step"
                )
            return progress[1], progress[2]
        if progress is not None:
            self._run.micro, self._run.partitions = None, None
            raise RuntimeError(
                f"cockpit step {step} begins, but step {progress[0]} saw only {progress[1]} of its "
                f"info['micro_batches'] = {progress[2]} backward passes. Enter the cockpit around each "
                "micro-batch's backward pass with the same global_step and info['micro_batches'] = the number "
                "of micro-batches of that optimizer step (fewer at the end of an epoch: pass that number)."
            )
        return 0, count

    @property
    def _next_step(self) -> int:
        """The step the next forward pass belongs to."""
        return self._run.next_step

    @_next_step.setter
    def _next_step(self, step: int) -> None:
        self._run.next_step = int(step)

    @property
    def open_step(self) -> int | None:
        """The step opened by :meth:`begin` (or a ``with`` block) and not yet ended."""
        return None if self._open_step is None else self._open_step.step

    # ---- the recorder (docs/recorder.md) ------------------------------------------
    def record(self, global_step: int) -> None:
        """Record the operations of ``global_step``: its forward pass, loss and backward pass.

        Call before that step's forward pass. The record (:attr:`records`) is
        stored in the output under ``"record"`` at that step, saved to
        ``record_dir`` with a standalone replay program if one was given, and
        a non-finite value gets a ``nonfinite-origin`` finding. Works whether
        or not a quantity is tracked at that step.
        """
        self._recorder.arm(global_step, self._next_step)

    @property
    def records(self) -> dict[int, Record]:
        """``{step: Record}`` of the steps recorded so far."""
        return self._recorder.records

    def _on_record(self, step: int, record: Record) -> None:
        self._output.publish(step, {RECORD_KEY: record.to_dict()}, listeners=False)
        for finding in record.findings:
            self.add_finding(finding)

    # ---- output ----------------------------------------------------------------
    def get_output(self) -> dict[int, dict[str, Any]]:
        """``{global_step: {name: value}}`` of everything tracked and logged."""
        self._flush()
        merged: dict[int, dict[str, Any]] = {}
        for quantity in self.quantities:
            name = self.name_of(quantity)
            for step, value in quantity.get_output().items():
                merged.setdefault(step, {})[name] = value
        self._output.merge_into(merged)
        for step, record in self._recorder.records.items():
            merged.setdefault(step, {})[RECORD_KEY] = record.to_dict()
        return dict(sorted(merged.items()))

    @property
    def skipped_steps(self) -> dict[int, dict[str, Any]]:
        """``{step: why}`` of the tracked steps whose optimizer step was skipped (a ``GradScaler`` found
        non-finite gradients): no quantity is stored for them (``docs/your_training_loop.md``)."""
        return {step: dict(why) for step, why in self._output.skipped.items()}

    def _store_checks(self, step: int, checks: dict[str, Any]) -> None:
        self._env.store_checks(step, checks)

    @property
    def checks(self) -> dict[int, dict[str, Any]]:
        """``{step: checks}`` of every tracked step: the self-checks' record (``docs/your_training_loop.md#self-checks``)."""
        self._flush()
        return {step: dict(record) for step, record in self._output.checks.items()}

    @property
    def invalid_steps(self) -> dict[int, list[dict[str, Any]]]:
        """``{step: failed checks}`` of the tracked steps that failed a self-check (their per-sample
        quantities stored no value)."""
        return {step: list(record["failed"]) for step, record in self.checks.items() if not record["valid"]}

    def log(
        self,
        global_step: int,
        epoch_count: Any = None,
        train_loss: Any = None,
        valid_loss: Any = None,
        test_loss: Any = None,
        train_accuracy: Any = None,
        valid_accuracy: Any = None,
        test_accuracy: Any = None,
        learning_rate: Any = None,
    ) -> None:
        """Store epoch-level figures under ``global_step`` (only on the log rank under DDP).

        ``global_step`` is the optimizer step number (an int >= 0). Each figure is a number (a one-element
        tensor or a numpy scalar is stored as a Python float, or int, so no autograd graph is kept), a
        list/tuple/dict of numbers, or None; anything else raises before anything is stored, naming the key.
        """
        given = locals()
        global_step = _log_step(global_step)
        values = {key: _log_value(key, given[key]) for key in EPOCH_KEYS}
        if not self.keeps_output:
            return
        self._output.store_log(global_step, values)
        self._diagnose({global_step: values})

    def write(self, logpath: str | os.PathLike) -> str:
        """Write everything to ``logpath + ".json"`` (folders are created); return the path.

        Under DDP only the log rank writes; other ranks return ``None``.
        """
        if not isinstance(logpath, (str, os.PathLike)):
            raise TypeError(
                f"cockpit.write(logpath): logpath takes a path (a str or pathlib.Path, e.g. 'runs/exp1'; "
                f"'.json' is added), got {logpath!r} ({type(logpath).__name__})"
            )
        self._flush()
        if not self.keeps_output:
            return None
        self._output.drain()  # lines a failed stream write left (a full disk, an interrupt) are tried again
        path = write_log(logpath, self.get_output(), {**self.metadata(), **self._history_metadata()})
        print(f"[cockpit_like] writing output to {path}")
        return str(path)

    @property
    def world_size(self) -> int:
        """The number of ``torch.distributed`` ranks the cockpit spans (1 in one process)."""
        return 1 if self._ranks is None else self._ranks.world

    @property
    def rank(self) -> int:
        """This process's ``torch.distributed`` rank (0 in one process)."""
        return 0 if self._ranks is None else self._ranks.rank

    @property
    def keeps_output(self) -> bool:
        """Whether this rank keeps the output and writes logs (always in one process; ``log_rank`` under DDP)."""
        return self._ranks is None or self._ranks.keeps_output

    @property
    def stream_path(self) -> str | None:
        """The streaming log's path, if streaming."""
        return None if self._output.stream is None else str(self._output.stream.path)

    def add_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        """Call ``listener(step, values)`` with what each tracked step (and each
        :meth:`log`) stores, as it is stored: the same pieces the streaming log
        gets (a two-step quantity's value for step ``k`` arrives one step later).
        Exporters (:mod:`cockpit_like.integrations.exporters`) attach this way."""
        self._output.add_listener(listener)

    def remove_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        """Stop calling ``listener`` (no error if it was not attached)."""
        self._output.remove_listener(listener)

    # ---- resuming a run (docs/resume.md) -------------------------------------------
    def _history_metadata(self) -> dict[str, Any]:
        """The run's history as the stream's reader merges it: ``created`` when the run began (this
        cockpit's creation, or the first run's after a resumption), and a resumed run's ``resumptions``
        and ``resumed_at_step``."""
        history = {} if self._history.get("created") is None else {"created": self._history["created"]}
        resumptions = self._history.get("resumptions", [])
        if resumptions:
            history["resumptions"] = [dict(entry) for entry in resumptions]
            history["resumed_at_step"] = resumptions[-1]["step"]
        return history

    def state_dict(self, with_output: bool | None = None) -> dict[str, Any]:
        """Everything that carries across steps, for the user's checkpoint (plain tensors and values).

        Call it between steps, next to ``model.state_dict()`` and
        ``optimizer.state_dict()``; ``torch.load(..., weights_only=True)`` reads
        it back. Holds each quantity's :meth:`~cockpit_like.quantities.quantity.Quantity.state_dict`
        (caches, references, warm starts, adapted ranges, statistics), the next
        step, and the output so far: in the state itself (``with_output=True``,
        the default without ``stream_to``), or as a pointer to the streaming
        log (the default with ``stream_to``: the checkpoint stays small).
        """
        from cockpit_like.resume import cockpit_state

        self._flush()
        return cockpit_state(self, with_output)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a run from :meth:`state_dict`: call on a new cockpit, before its first step.

        The cockpit must have the same quantities (names, classes, arguments)
        and parameter shapes as the saved one, else a
        :class:`~cockpit_like.resume.StateMismatchError` says what differs. With
        ``stream_to`` the file of the saved run is continued after the
        checkpoint (what the interrupted run streamed after it is dropped, and
        streamed again by this run); another file gets the output so far first.
        """
        self._active_cache = None
        from cockpit_like.resume import load_cockpit_state

        load_cockpit_state(self, state)

    # ---- diagnosis -------------------------------------------------------------------
    @property
    def findings(self) -> list[Finding]:
        """Every finding stored so far (rules and :meth:`add_finding`), by step."""
        return findings_in(self._output.findings)

    def active_findings(self) -> list[Finding]:
        """The stored findings not cleared since (what the dashboard lists)."""
        return active_findings(self._output.findings)

    def add_finding(self, finding: Finding) -> None:
        """Store ``finding`` under its step (and stream it), then call ``on_finding``.

        For producers of findings other than the rules (e.g. the recorder).
        """
        self._output.store_findings([finding], [])
        if self.on_finding is not None:
            self.on_finding(finding)

    def _param_name_list(self) -> list[str]:
        names = self._names_of_params()
        return [names.get(id(param), f"param_{index}") for index, param in enumerate(self.params)]

    def _diagnose(self, new_values: dict[int, dict[str, Any]]) -> None:
        """Run the rules on newly stored values; store, stream, then call ``on_finding``."""
        diagnosis = self.diagnosis
        if diagnosis is None or not new_values:
            return
        added = [diagnosis.update(step, values) for step, values in sorted(new_values.items())]
        if any(added):
            names = self._param_name_list()
            if diagnosis.history.metadata.get("param_names") != names:
                diagnosis.history.metadata.update(
                    param_names=names, param_shapes=[list(p.shape) for p in self.params]
                )
            diagnosis.history.metadata["stale_gradients_checked"] = self._stale_gradients_checked()
            found, cleared = diagnosis.run()
            if found or cleared:
                self._output.store_findings(found, cleared)
            if self.on_finding is not None:
                for finding in found:
                    self.on_finding(finding)

    def _before_forward(self) -> bool:
        """The tracer's call at the start of each forward pass of a known model: quantities
        active at the coming step prepare for it (:meth:`Quantity.prepare_forward`); returns
        whether that step needs the graph."""
        step, graph = self._next_step, False
        active = self._active_at(step)
        if active:  # hooks registered since the last tracked step: guarded before the modules below run (outside
            # trial 31: a backward hook registered after Cockpit(...) ran 9-38 times at step 0)
            guard_module_hooks(self.models())
        for quantity in active:
            quantity.prepare_forward(step)
            graph = graph or quantity.create_graph(step)
        return graph

    def close(self) -> None:
        """End the run: close the streaming log and take the cockpit's hooks off the model (nothing is lost if
        you never call this). A closed cockpit tracks no more steps (a step opened after it raises at once,
        before the backward pass); its output stays readable. Call it before ``torch.save(model)`` of the whole
        module (a model holding the hooks pickles references to cockpit_like; ``model.state_dict()`` never
        does). Calling it again does nothing."""
        self._flush()
        self._output.close()
        self._tracer.remove()
        self._closed = True

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a Cockpit cannot be pickled or copied: it holds hooks on the model, open files and weak references. "
            "Save cockpit.state_dict() (plain tensors and values) in your checkpoint and load it into a new Cockpit "
            "with load_state_dict() (docs/resume.md); for another process, make the Cockpit there."
        )

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)

    def _refuse_closed(self, global_step: Any) -> None:
        if getattr(self, "_closed", False):
            raise RuntimeError(
                f"cockpit step {global_step}: this Cockpit was closed (cockpit.close() ends its run: its stream is "
                "closed and its hooks are off the model). Call close() once, after training; to track more steps, "
                "make a new Cockpit (with a new stream_to), or continue this run from a checkpoint: "
                "new_cockpit.load_state_dict(cockpit.state_dict()) (docs/resume.md)."
            )

    @staticmethod
    def _merge_batch_grad_transform_hooks(batch_grad_transform_hooks: list) -> Any:
        """Cockpit's private merge of ``BatchGradTransformsHook``s, kept for code written against it.

        Returns one ``BatchGradTransformsHook`` with every transform (the same
        function under one name once); two different functions under one name
        raise ``ValueError``. The cockpit itself merges the hooks of a step into
        one per-sample statistic (:mod:`cockpit_like.quantities.utils_transforms`).
        """
        from cockpit_like.quantities.utils_transforms import merge_into_hook

        return merge_into_hook(batch_grad_transform_hooks)


class _AnyTracked:
    """The schedule of the diagnosis feeds: a step is tracked when one of ``quantities`` tracks it."""

    description = "with the tracked quantities"

    def __init__(self, quantities: list[Quantity]):
        self.quantities = quantities

    def __call__(self, global_step: int) -> bool:
        return any(q.should_compute(global_step) for q in self.quantities)

    def __repr__(self) -> str:
        return "any tracked step"


def _make_diagnosis(diagnose: Any) -> Diagnosis | None:
    if diagnose is False or diagnose is None:
        return None
    if diagnose is True:
        return Diagnosis()
    if isinstance(diagnose, Diagnosis):
        return diagnose
    if isinstance(diagnose, Rule) or (isinstance(diagnose, (list, tuple)) and all(isinstance(r, Rule) for r in diagnose)):
        return Diagnosis([diagnose] if isinstance(diagnose, Rule) else list(diagnose))
    raise ValueError(
        "Cockpit(diagnose=...) takes True (every built-in rule), a list of cockpit_like.diagnosis.Rule "
        f"instances, or a Diagnosis; got {diagnose!r}"
    )


def _log_step(global_step: Any) -> int:
    """``cockpit.log``'s step as a Python int, or a ValueError that says why not (before anything is stored)."""
    if not isinstance(global_step, bool) and (
        (isinstance(global_step, torch.Tensor) and global_step.numel() == 1 and not global_step.is_floating_point()
         and not global_step.is_complex())
        or type(global_step).__module__ == "numpy" and hasattr(global_step, "dtype") and global_step.dtype.kind in "iu"
        and getattr(global_step, "size", 0) == 1
    ):
        global_step = int(global_step.item())
    if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
        raise ValueError(
            f"cockpit.log(global_step, ...): global_step must be an int >= 0, the optimizer step number the "
            f"figures belong to (the same number as in `with cockpit(step, ...)`), got {global_step!r} "
            f"({type(global_step).__name__}). Pass a label such as the epoch as epoch_count=..., e.g. "
            "cockpit.log(step, epoch_count=epoch, train_loss=...)."
        )
    return global_step


def _log_value(key: str, value: Any) -> Any:
    """A ``cockpit.log`` figure as a plain, JSON-safe value: one-element tensors and numpy scalars as Python
    numbers (a tensor would keep its autograd graph alive), lists, tuples and dicts element by element."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        kind = "tensor" if isinstance(value, torch.Tensor) else f"numpy {type(value).__name__}"
        size = value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", 1)
        if size == 1 and not (value.is_complex() if isinstance(value, torch.Tensor) else value.dtype.kind == "c"):
            if isinstance(value, torch.Tensor):
                value = value.detach()
            number = value.item()
            if isinstance(number, (bool, int, float)):
                return number
        raise TypeError(
            f"cockpit.log(..., {key}=...): got a {kind} of shape {tuple(value.shape)} and dtype {value.dtype}; "
            f"{key} takes one real number (a Python number or a one-element tensor, e.g. {key}=loss.item())"
            + (", or reduce it first (e.g. .mean())" if size > 1 else "")
        )
    if isinstance(value, (list, tuple)):
        return [_log_value(key, item) for item in value]
    if isinstance(value, dict):
        return {name: _log_value(key, item) for name, item in value.items()}
    if isinstance(value, str):
        raise TypeError(
            f"cockpit.log(..., {key}=...): got the string {value!r}; {key} takes a number. Convert it first "
            f"(e.g. {key}=float(text)); nothing was stored."
        )
    raise TypeError(
        f"cockpit.log(..., {key}=...): got a {type(value).__name__} ({value!r:.80}); {key} takes a number (a Python "
        f"number or a one-element tensor, e.g. {key}=loss.item()); nothing was stored."
    )


def _check_step_arguments(global_step: Any, info: Any) -> None:
    if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
        raise ValueError(f"cockpit(global_step): need a non-negative int, got {global_step!r}")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"cockpit(info=...) takes a dict, got {type(info).__name__}")
    loss = (info or {}).get("loss")
    if loss is not None and not isinstance(loss, (torch.Tensor, numbers.Real)):  # (numpy's numbers are Real)
        hint = (
            " (the loss function itself: pass the value it returns, loss = lossfunc(outputs, labels))"
            if isinstance(loss, torch.nn.Module) or callable(loss) else ""
        )
        raise ValueError(
            f"cockpit(info=...): info['loss'] takes the mini-batch loss tensor (the one loss.backward() is called "
            f"on), got a {type(loss).__name__}{hint}"
        )
    optimizers = (info or {}).get("optimizer")
    if isinstance(optimizers, (list, tuple)):
        names = ", ".join(type(o).__name__ for o in optimizers)
        raise ValueError(
            f"cockpit(info=...): info['optimizer'] takes one optimizer, got a {type(optimizers).__name__} ({names}). "
            "Where several optimizers step in one iteration (e.g. Muon for the matrices, AdamW for the rest), declare "
            "the one that steps last: what the others moved counts as part of the iteration's update (UpdateSize, "
            "Distance), and the quantities that predict the update from the declared optimizer alone (Alpha) are "
            "withdrawn with a note. For those, step all the parameters with one optimizer (param groups)."
        )


def _inner_optimizer(info: dict) -> dict:
    """``info`` with ``info["optimizer"]`` the optimizer that steps the parameters, where it is a wrapper that only
    forwards to one (accelerate's ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without its
    initialisation, so it has no step hooks; Lightning's ``LightningOptimizer``): the wrapped one, in a copy of
    ``info`` (the caller's dict is left as it is). A wrapper with a step of its own that is a whole optimizer
    (Lookahead) stays."""
    optimizer = info.get("optimizer")
    inner = optimizer
    for _ in range(8):  # wrappers of wrappers
        if isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "_optimizer_step_pre_hooks"):
            break
        wrapped = getattr(inner, "optimizer", None)
        if wrapped is None or wrapped is inner:
            break
        inner = wrapped
    if inner is optimizer:
        return info
    return {**info, "optimizer": inner}


def _without_error_bars(record: dict, withdrawn: list[str]) -> dict:
    """A copy of a step's checks without the standard errors of the values withdrawn from it (the log must not
    describe a number it does not store)."""
    record = dict(record)
    errors = record.get("standard_errors")
    if errors:
        kept = {name: entry for name, entry in errors.items() if name not in withdrawn}
        if kept:
            record["standard_errors"] = kept
        else:
            del record["standard_errors"]
    return record


def _failed_check(record: dict[str, Any] | None, check: str) -> bool:
    """Whether a step's checks ``record`` holds a failed ``check``."""
    return record is not None and any(entry.get("check") == check for entry in record.get("failed", []))

