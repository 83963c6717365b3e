"""The cockpit: schedule -> needs -> backward -> quantities -> store.

Usage::

    cockpit = Cockpit(model.parameters(), quantities=configuration("economy"))
    for step, (x, y) in enumerate(loader):
        loss = lossfunc(model(x), y)
        with cockpit(step, info={"batch_size": len(x), "loss": loss, ...}):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from backpack import backpack
from backpack.extensions import BatchGrad

from cockpit_like import context
from cockpit_like.backends.extensions import describe, merge_extensions
from cockpit_like.backends.lean_hooks import ModuleCollector
from cockpit_like.backends.per_sample import PerSampleReducer
from cockpit_like.logs import EPOCH_KEYS, StreamWriter, run_metadata, write_log
from cockpit_like.quantities.quantity import Quantity

__all__ = ["Cockpit", "NotExtendedError", "UnsupportedLayerError"]


class NotExtendedError(RuntimeError):
    """BackPACK computed nothing: the model or loss was not ``extend``-ed."""


class UnsupportedLayerError(NotImplementedError):
    """BackPACK has no extension for a layer of the model."""


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
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        quantities: list[Quantity] | None = None,
        stream_to: str | os.PathLike | None = None,
        *,
        lean_hooks: bool = True,
    ):
        self.params = _check_params(params)
        self._module_collector = ModuleCollector() if lean_hooks else None
        if quantities is not None and not isinstance(quantities, (list, tuple)):
            raise ValueError(
                f"Cockpit(quantities=...) takes a list of Quantity instances, got "
                f"{type(quantities).__name__}"
            )
        self.quantities: list[Quantity] = []
        self._names: dict[int, str] = {}
        self._epoch_logs: dict[int, dict[str, Any]] = {}
        self._stream: StreamWriter | None = None
        for quantity in quantities or []:
            self.add(quantity)
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

    # ---- per step ------------------------------------------------------------
    def create_graph(self, global_step: int) -> bool:
        """Whether ``loss.backward`` must be called with ``create_graph=True`` at this step."""
        return any(
            q.create_graph(global_step) for q in self.quantities if q.is_active(global_step)
        )

    def __call__(self, global_step: int, *exts: Any, info: dict | None = None, debug: bool = False):
        """The context manager around ``loss.backward()`` for ``global_step``."""
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise ValueError(f"cockpit(global_step): need a non-negative int, got {global_step!r}")
        if info is not None and not isinstance(info, dict):
            raise ValueError(f"cockpit(info=...) takes a dict, got {type(info).__name__}")
        return _TrackedStep(self, global_step, exts, info or {}, debug)

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

    def write(self, logpath: str | os.PathLike) -> str:
        """Write everything to ``logpath + ".json"`` (folders are created); return the path."""
        path = write_log(logpath, self.get_output(), self.metadata())
        print(f"[cockpit_like] writing output to {path}")
        return str(path)

    @property
    def stream_path(self) -> str | None:
        """The streaming log's path, if streaming."""
        return None if self._stream is None else str(self._stream.path)

    def close(self) -> None:
        """Close the streaming log (nothing is lost if you never call this)."""
        if self._stream is not None:
            self._stream.close()


class _TrackedStep:
    """One use of ``with cockpit(step, ...)``."""

    def __init__(self, cockpit: Cockpit, global_step: int, exts: tuple, info: dict, debug: bool):
        self.cockpit = cockpit
        self.step = global_step
        self.user_exts = exts
        self.info = info
        self.debug = debug
        self.active: list[Quantity] = []
        self._backpack: backpack | None = None
        self._extensions: list[Any] = []
        self._reducer: PerSampleReducer | None = None
        self._loss_is_finite = True

    # ---- enter: collect the needs -----------------------------------------------
    def __enter__(self) -> _TrackedStep:
        cockpit, step = self.cockpit, self.step
        self.active = [q for q in cockpit.quantities if q.is_active(step)]
        if not self.active and not self.user_exts:
            if self.debug:
                print(f"[cockpit_like|step {step}] nothing scheduled")
            return self

        for quantity in self.active:
            for key in sorted(quantity.required_info(step)):
                if key not in self.info:
                    raise context.MissingInfoError(key, cockpit.name_of(quantity), step)
        self._check_loss()

        requests = [("the user's *exts", ext) for ext in self.user_exts]
        stats, hooks = [], []
        raw_batch_grad = any(isinstance(ext, BatchGrad) for ext in self.user_exts)
        for quantity in self.active:
            name = cockpit.name_of(quantity)
            for ext in quantity.extensions(step):
                requests.append((name, ext))
                raw_batch_grad |= isinstance(ext, BatchGrad)
            hooks.extend(quantity.extension_hooks(step))
            stats.extend(s for s in quantity.per_sample_stats(step) if s not in stats)
        if stats:
            # the statistics backend picks BatchGrad (raw grad_batch wanted) or the linear fast path
            from cockpit_like.backends.per_sample_extension import statistics_backend

            extension, self._reducer = statistics_backend(stats, cockpit.params, raw_batch_grad)
            requests.append(("per-sample statistics", extension))
            hooks.insert(0, self._reducer)
        self._extensions = merge_extensions(requests)

        if self.debug:
            print(
                f"[cockpit_like|step {step}] quantities: "
                f"{[cockpit.name_of(q) for q in self.active]}; extensions: "
                f"{[describe(e) for e in self._extensions]}; per-sample statistics: {stats}; "
                f"create_graph: {cockpit.create_graph(step)}"
            )
        if self._extensions or hooks:
            if cockpit._module_collector is not None:
                hooks.append(cockpit._module_collector)
            exts, hook = self._extensions, _chain(hooks)
            if cockpit.create_graph(step):
                # backward(create_graph=True) would record everything the hooks compute (Finding 9)
                from cockpit_like.backends.no_grad import hook_without_autograd, without_autograd

                exts, hook = [without_autograd(ext) for ext in exts], hook_without_autograd(hook)
            self._backpack = backpack(*exts, extension_hook=hook)
            self._backpack.__enter__()
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
        if self._backpack is not None:
            self._backpack.__exit__(exc_type, exc, traceback)
            collector = self.cockpit._module_collector
            if collector is not None:
                if exc_type is None:
                    collector.make_lean()
                else:
                    collector.forget()
        if exc_type is not None:
            self._free_buffers()
            if isinstance(exc, NotImplementedError) and not isinstance(exc, UnsupportedLayerError):
                raise UnsupportedLayerError(
                    f"BackPACK cannot run the extensions needed at step {self.step} "
                    f"({[describe(e) for e in self._extensions]}) on this model: {exc}. "
                    "Replace the layer with a supported one, or track the quantities that need "
                    "these extensions less often / leave them out."
                ) from exc
            return False
        if not self.active:
            return False
        try:
            self._check_buffers()
            record = context.StepRecord(
                global_step=self.step,
                info=self.info,
                params=self.cockpit.params,
                stats=self._reducer.results() if self._reducer is not None else {},
                loss_is_finite=self._loss_is_finite,
            )
            context._activate(record)
            new_values: dict[int, dict[str, Any]] = {}
            for quantity in self.active:
                self._track(quantity, new_values)
        finally:
            context._activate(None)
            self._free_buffers()
        stream = self.cockpit._stream
        if stream is not None:
            for step, values in sorted(new_values.items()):
                stream.write_step(step, values)
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

    def _check_buffers(self) -> None:
        params = self.cockpit.params
        for ext in self._extensions:
            field = getattr(ext, "savefield", None)
            if field is None:
                continue
            missing = [i for i, p in enumerate(params) if not hasattr(p, field)]
            if field == "grad_batch" and self._reducer is not None and not self._reducer.keep_grad_batch:
                missing = [i for i in range(len(params)) if i not in self._reducer.seen]
            if len(missing) == len(params):
                raise NotExtendedError(
                    f"step {self.step}: BackPACK computed no {describe(ext)} ('{field}') for any "
                    "parameter. The model (and, for curvature, the loss function) must be "
                    "extended: `model = backpack.extend(model)`, `lossfunc = "
                    "backpack.extend(lossfunc)`, and the forward pass must run after that."
                )
            if missing:
                shown = ", ".join(f"#{i} {list(params[i].shape)}" for i in missing[:5])
                raise NotExtendedError(
                    f"step {self.step}: BackPACK computed no {describe(ext)} for parameters "
                    f"{shown}{' ...' if len(missing) > 5 else ''}. Their module is not extended "
                    "with backpack.extend, or they are not used in the loss; extend every module "
                    "that holds tracked parameters, or pass only those to Cockpit(params)."
                )

    def _free_buffers(self) -> None:
        keep = {type(ext) for ext in self.user_exts}
        fields = {ext.savefield for ext in self._extensions if type(ext) not in keep and hasattr(ext, "savefield")}
        for param in self.cockpit.params:
            for field in fields:
                if hasattr(param, field):
                    delattr(param, field)


_MISSING = object()


def _last_items(output: dict, count: int) -> list[tuple[int, Any]]:
    """The ``count`` most recently inserted items (O(count), not O(len(output)))."""
    items = []
    for item in reversed(output.items()):
        items.append(item)
        if len(items) == count:
            break
    return items


def _chain(hooks: list):
    if len(hooks) == 1:
        return hooks[0]

    def run_all(module: torch.nn.Module) -> None:
        for hook in hooks:
            hook(module)

    return run_all
