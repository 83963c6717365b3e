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

import math
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from backpack.extensions import BatchGrad

from cockpit_like import context
from cockpit_like.backends.hooks import BatchNormInTrainingError, ModelTracer
from cockpit_like.backends.lean_hooks import ModuleCollector
from cockpit_like.backends.step import NotExtendedError, StepExecution, UnsupportedLayerError
from cockpit_like.logs import EPOCH_KEYS, StreamWriter, run_metadata, write_log
from cockpit_like.quantities.quantity import Quantity
from cockpit_like.quantities.utils_transforms import merge_transform_hooks, split_transform_hooks

__all__ = ["Cockpit", "NotExtendedError", "UnsupportedLayerError", "BatchNormInTrainingError"]


def _check_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        raise ValueError("Cockpit(params): pass an iterable of tensors, e.g. model.parameters()")
    checked = []
    for index, param in enumerate(params):
        if not isinstance(param, torch.Tensor):
            raise ValueError(
                f"Cockpit(params): parameter #{index} is a {type(param).__name__}, not a tensor; "
                "pass model.parameters()"
            )
        if not param.requires_grad:
            raise ValueError(
                f"Cockpit(params): parameter #{index} (shape {list(param.shape)}) has "
                "requires_grad=False, so it gets no gradient. Pass only trainable parameters, "
                "e.g. [p for p in model.parameters() if p.requires_grad]."
            )
        checked.append(param)
    if not checked:
        raise ValueError("Cockpit(params): no parameters given")
    return checked


class Cockpit:
    """Tracks quantities of a training run.

    Args:
        params: the parameters to watch (all need ``requires_grad=True``).
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
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        quantities: list[Quantity] | None = None,
        stream_to: str | os.PathLike | None = None,
        *,
        model: torch.nn.Module | None = None,
        lean_hooks: bool = True,
    ):
        self.params = _check_params(params)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"Cockpit(model=...) takes the nn.Module that owns params, got {type(model).__name__}")
        if quantities is not None and not isinstance(quantities, (list, tuple)):
            raise ValueError(
                f"Cockpit(quantities=...) takes a list of Quantity instances, got "
                f"{type(quantities).__name__}"
            )
        self._module_collector = ModuleCollector() if lean_hooks else None
        self._next_step = 0
        self._param_names: dict[int, str] = {}
        self.quantities: list[Quantity] = []
        self._names: dict[int, str] = {}
        self._initial_settings: dict[int, dict[str, Any]] = {}  # as added, to check a resumed state
        self._epoch_logs: dict[int, dict[str, Any]] = {}
        self._stream: StreamWriter | None = None
        self._open_step: _TrackedStep | None = None
        self._listeners: list[Callable[[int, dict[str, Any]], None]] = []
        self._tracer = ModelTracer(
            self.params, wants_graph=lambda: self.create_graph(self._next_step), on_attach=self._adapt_quantities
        )
        for quantity in quantities or []:
            self.add(quantity)
        if model is not None:
            self._tracer.attach(model)
        self._tracer.discover()
        if stream_to is not None:
            self._stream = StreamWriter(stream_to, self.metadata())

    # ---- set up ------------------------------------------------------------
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
        base = type(quantity).__name__
        name, count = base, 1
        while name in self._names.values():
            name, count = f"{base}_{count}", count + 1
        self.quantities.append(quantity)
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
        that tracked last (or ``quantity``: an instance or its name).

        Args:
            kind: ``"kfac"`` or ``"ekfac"`` (default: what the statistics allow, EK-FAC if logged).
            damping: ``None``, or ``λ >= 0`` for ``F + λI``.
            layers: names of logged layers to keep (default: all).

        Returns:
            A named :class:`~cockpit_like.operators.BlockDiagonal`, one block per
            covered parameter (``"<layer>.weight"``, ``"<layer>.bias"``) in the
            order of the cockpit's parameters.
        """
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
        before = [q.settings() for q in self.quantities]
        for quantity in self.quantities:
            quantity.adapt_to_models(models)
        if self._ranks is not None:
            self._ranks.watch(models, lambda: self.create_graph(self._next_step))
        if self._stream is not None and before != [q.settings() for q in self.quantities]:
            self._stream.write_metadata(self.metadata())

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
        meta = run_metadata(described)
        meta["num_params"] = len(self.params)
        meta["param_shapes"] = [list(p.shape) for p in self.params]
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
    def create_graph(self, global_step: int) -> bool:
        """Whether ``loss.backward`` must be called with ``create_graph=True`` at this step."""
        return any(
            q.create_graph(global_step) for q in self.quantities if q.is_active(global_step)
        )

    def __call__(self, global_step: int, *exts: Any, info: dict | None = None, debug: bool = False):
        """The context manager around ``loss.backward()`` for ``global_step``
        (:meth:`begin` on entry, :meth:`end` on exit)."""
        _check_step_arguments(global_step, info)
        return _StepContext(self, global_step, exts, info or {}, debug)

    def begin(self, global_step: int, *exts: Any, info: dict | None = None, debug: bool = False) -> None:
        """Open ``global_step``: call before ``loss.backward()``, then :meth:`end`.

        The two-call form of ``with cockpit(global_step, *exts, info=info,
        debug=debug):`` for frameworks that own the backward pass (Lightning,
        the Hugging Face ``Trainer``). Only one step is open at a time.
        """
        _check_step_arguments(global_step, info)
        if self._open_step is not None:
            raise RuntimeError(
                f"cockpit.begin({global_step}): step {self._open_step.step} is still open. "
                "Steps cannot overlap: call cockpit.end() after that step's loss.backward() "
                "before beginning the next one."
            )
        tracked = _TrackedStep(self, global_step, exts, info or {}, debug)
        tracked.__enter__()  # raises before the step counts as open
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
        if error is None:
            tracked.__exit__(None, None, None)
        else:
            tracked.__exit__(type(error), error, error.__traceback__)

    @property
    def open_step(self) -> int | None:
        """The step opened by :meth:`begin` (or a ``with`` block) and not yet ended."""
        return None if self._open_step is None else self._open_step.step

    # ---- output ----------------------------------------------------------------
    def get_output(self) -> dict[int, dict[str, Any]]:
        """``{global_step: {name: value}}`` of everything tracked and logged."""
        merged: dict[int, dict[str, Any]] = {}
        for quantity in self.quantities:
            name = self.name_of(quantity)
            for step, value in quantity.get_output().items():
                merged.setdefault(step, {})[name] = value
        for step, values in self._epoch_logs.items():
            merged.setdefault(step, {}).update(values)
        return dict(sorted(merged.items()))

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
        """Store epoch-level figures under ``global_step`` (values as given)."""
        given = locals()
        values = {key: given[key] for key in EPOCH_KEYS}
        self._epoch_logs.setdefault(global_step, {}).update(values)
        if self._stream is not None:
            self._stream.write_step(global_step, values)
        self._notify(global_step, values)

    def write(self, logpath: str | os.PathLike) -> str:
        """Write everything to ``logpath + ".json"`` (folders are created); return the path."""
        path = write_log(logpath, self.get_output(), self.metadata())
        print(f"[cockpit_like] writing output to {path}")
        return str(path)

    @property
    def stream_path(self) -> str | None:
        """The streaming log's path, if streaming."""
        return None if self._stream is None else str(self._stream.path)

    def add_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        """Call ``listener(step, values)`` with what each tracked step (and each
        :meth:`log`) stores, as it is stored: the same pieces the streaming log
        gets (a two-step quantity's value for step ``k`` arrives one step later).
        Exporters (:mod:`cockpit_like.integrations.exporters`) attach this way."""
        if not callable(listener):
            raise ValueError(f"Cockpit.add_listener: {listener!r} is not callable")
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[int, dict[str, Any]], None]) -> None:
        """Stop calling ``listener`` (no error if it was not attached)."""
        self._listeners = [known for known in self._listeners if known is not listener]

    def _notify(self, step: int, values: dict[str, Any]) -> None:
        for listener in list(self._listeners):
            listener(step, values)

    # ---- resuming a run (docs/resume.md) -------------------------------------------
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
        from cockpit_like.resume import load_cockpit_state

        load_cockpit_state(self, state)

    def close(self) -> None:
        """Close the streaming log (nothing is lost if you never call this)."""
        if self._stream is not None:
            self._stream.close()


def _check_step_arguments(global_step: Any, info: Any) -> None:
    if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
        raise ValueError(f"cockpit(global_step): need a non-negative int, got {global_step!r}")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"cockpit(info=...) takes a dict, got {type(info).__name__}")


class _StepContext:
    """What ``cockpit(step, ...)`` returns: ``with`` calls ``begin`` and ``end``."""

    def __init__(self, cockpit: Cockpit, global_step: int, exts: tuple, info: dict, debug: bool):
        self.cockpit = cockpit
        self.step = global_step
        self.exts = exts
        self.info = info
        self.debug = debug

    def __enter__(self) -> _StepContext:
        self.cockpit.begin(self.step, *self.exts, info=self.info, debug=self.debug)
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self.cockpit.end(exc)
        return False


class _TrackedStep:
    """One tracked step, from :meth:`Cockpit.begin` to :meth:`Cockpit.end`."""

    def __init__(self, cockpit: Cockpit, global_step: int, exts: tuple, info: dict, debug: bool):
        self.cockpit = cockpit
        self.step = global_step
        self.user_exts = exts
        self.info = info
        self.debug = debug
        self.active: list[Quantity] = []
        self._execution: StepExecution | None = None
        self._loss_is_finite = True

    # ---- enter: collect the needs -----------------------------------------------
    def __enter__(self) -> _TrackedStep:
        cockpit, step = self.cockpit, self.step
        cockpit._next_step = step + 1
        self.active = [q for q in cockpit.quantities if q.is_active(step)]
        if not self.active and not self.user_exts:
            cockpit._tracer.drop_calls()  # nothing tracked: drop what the forward pass noted
            if self.debug:
                print(f"[cockpit_like|step {step}] nothing scheduled")
            return self

        for quantity in self.active:
            for key in sorted(quantity.required_info(step)):
                if key not in self.info:
                    raise context.MissingInfoError(key, cockpit.name_of(quantity), step)
        self._check_loss()

        requests = [("the user's *exts", ext) for ext in self.user_exts]
        stats, hooks, needs, owners, transform_hooks = [], [], [], [], []
        raw_batch_grad = any(isinstance(ext, BatchGrad) for ext in self.user_exts)
        for quantity in self.active:
            name = cockpit.name_of(quantity)
            for ext in quantity.extensions(step):
                requests.append((name, ext))
                raw_batch_grad |= isinstance(ext, BatchGrad)
            # BatchGradTransformsHooks become one per-sample statistic (utils_transforms)
            other_hooks, transforms = split_transform_hooks(quantity.extension_hooks(step))
            hooks.extend(other_hooks)
            transform_hooks.extend(transforms)
            asked = quantity.per_sample_stats(step)
            if asked or transforms:
                owners.append(name)
            stats.extend(s for s in asked if s not in stats)
            needs.extend(n for n in quantity.curvature_needs(step) if n not in needs)
        if transform_hooks:
            stats.append(merge_transform_hooks(transform_hooks))
        try:
            self._execution = StepExecution(
                step,
                cockpit.params,
                requests,
                stats,
                hooks,
                raw_batch_grad,
                cockpit.create_graph(step),
                cockpit._tracer,
                cockpit._module_collector,
                self.info.get("batch_size"),
                cockpit._names_of_params(),
                needs,
                owners,
                self.info,
            )
        except BaseException:
            cockpit._tracer.drop_calls()
            raise
        if self.debug:
            print(
                f"[cockpit_like|step {step}] quantities: "
                f"{[cockpit.name_of(q) for q in self.active]}; {self._execution.describe()}; "
                f"per-sample statistics: {stats}; create_graph: {cockpit.create_graph(step)}"
            )
        self._execution.enter()
        return self

    def _check_loss(self) -> None:
        loss = self.info.get("loss")
        if isinstance(loss, torch.Tensor):
            finite = bool(torch.isfinite(loss.detach()).all())
        elif isinstance(loss, (int, float)):
            finite = math.isfinite(loss)
        else:
            return
        if not finite:
            self._loss_is_finite = False
            warnings.warn(
                f"[cockpit_like] step {self.step}: the loss is {float(loss.detach() if isinstance(loss, torch.Tensor) else loss):g}; quantities "
                "that cannot be computed store NaN for this step",
                RuntimeWarning,
                stacklevel=3,
            )

    # ---- exit: compute, store, free ---------------------------------------------
    def __exit__(self, exc_type, exc, traceback) -> bool:
        execution = self._execution
        if execution is None:
            return False
        user_types = {type(ext) for ext in self.user_exts}
        try:
            execution.exit(exc_type, exc, traceback)
        except BaseException:
            execution.free(user_types)
            raise
        if exc_type is not None:
            execution.free(user_types)
            return False
        if not self.active:
            return False
        try:
            execution.check()
            record = context.StepRecord(
                global_step=self.step,
                info=self.info,
                params=self.cockpit.params,
                stats=execution.results(),
                loss_is_finite=self._loss_is_finite,
            )
            context._activate(record)
            new_values: dict[int, dict[str, Any]] = {}
            for quantity in self.active:
                self._track(quantity, new_values)
        finally:
            context._activate(None)
            execution.free(user_types)
        stream = self.cockpit._stream
        if stream is not None:
            for step, values in sorted(new_values.items()):
                stream.write_step(step, values)
        for step, values in sorted(new_values.items()):
            self.cockpit._notify(step, values)
        return False

    def _track(self, quantity: Quantity, new_values: dict[int, dict[str, Any]]) -> None:
        name = self.cockpit.name_of(quantity)
        before = dict(_last_items(quantity.output, 2))
        try:
            quantity.track(self.step, self.cockpit.params, self.info.get("loss"))
        except Exception as error:
            if self._loss_is_finite:
                raise
            warnings.warn(
                f"[cockpit_like] step {self.step}: {name} failed on the non-finite loss "
                f"({type(error).__name__}: {error}); storing NaN",
                RuntimeWarning,
                stacklevel=4,
            )
            quantity.output[self.step] = math.nan
        for step, value in _last_items(quantity.output, 2):
            if before.get(step, _MISSING) is not value:
                new_values.setdefault(step, {})[name] = value


_MISSING = object()


def _last_items(output: dict, count: int) -> list[tuple[int, Any]]:
    """The ``count`` most recently inserted items (O(count), not O(len(output)))."""
    items = []
    for item in reversed(output.items()):
        items.append(item)
        if len(items) == count:
            break
    return items
