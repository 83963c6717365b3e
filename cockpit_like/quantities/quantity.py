"""Base classes of every quantity (the plugin contract of ``API.md``).

A quantity declares, per step, what it needs (BackPACK extensions, hooks,
per-sample statistics, ``info`` keys, the graph) and computes its value from
what the cockpit hands it. The cockpit never special-cases a quantity: it
builds each step from these answers.

Writing a new quantity means subclassing one of

- :class:`SingleStepQuantity`: a value at each scheduled step,
- :class:`ByproductQuantity`: the same, but needing nothing from BackPACK,
- :class:`TwoStepQuantity`: information cached at a start step and finished at
  an end step (e.g. the update ``theta_{t+1} - theta_t``),

and overriding ``_compute`` (or ``_compute_start``/``_compute_end``). See
``docs/custom_quantities.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cockpit_like.resume import is_plain
from cockpit_like.utils.schedules import check_schedule

__all__ = [
    "Quantity",
    "SingleStepQuantity",
    "ByproductQuantity",
    "TwoStepQuantity",
    "KeepUntil",
    "last_blocked_step",
    "to_output",
    "parameter_snapshot",
]


def to_output(value: Any) -> Any:
    """Convert a computed value into what is stored (no tensors).

    Zero-dimensional tensors become Python ``float`` (or ``int`` / ``bool``),
    other tensors numpy arrays of the same dtype; lists and dicts are converted
    recursively, tuples stay tuples, Python and numpy scalars and arrays are
    kept as they are.

    Example:
        >>> to_output([torch.tensor(2.0), torch.ones(2)])
        [2.0, array([1., 1.], dtype=float32)]
    """
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dim() == 0:
            return value.item()
        if value.dtype == torch.bfloat16:  # numpy has no bfloat16: float32 holds each of its values exactly
            value = value.float()  # (outside trial 17: GradHist1d of a bfloat16 convolution stopped training)
        return value.cpu().numpy()
    if isinstance(value, dict):
        return {key: to_output(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_output(item) for item in value]
    if isinstance(value, tuple):
        return tuple(to_output(item) for item in value)
    return value


class Quantity:
    """Base class of all quantities.

    Args:
        track_schedule: ``int -> bool``; whether to compute at a global step
            (see :mod:`cockpit_like.utils.schedules`).
        verbose: print a line whenever a value is computed.

    Attributes:
        output: ``{global_step: value}`` of what was computed so far.
    """

    def __init__(self, track_schedule: Callable[[int], bool], verbose: bool = False):
        check_schedule(track_schedule, type(self).__name__)
        self._track_schedule = track_schedule
        self._verbose = verbose
        self.output: dict[int, Any] = {}

    # ---- what the quantity needs at a step --------------------------------
    def should_compute(self, global_step: int) -> bool:
        """Whether the schedule asks for a value at ``global_step``."""
        return bool(self._track_schedule(global_step))

    def is_active(self, global_step: int) -> bool:
        """Whether the quantity does any work at ``global_step``.

        The cockpit asks for needs and calls :meth:`track` only on active
        quantities. Two-step quantities are also active at their end steps.
        """
        return self.should_compute(global_step)

    def extensions(self, global_step: int) -> list:
        """BackPACK extensions needed at ``global_step`` (results stay on params)."""
        return []

    def extension_hooks(self, global_step: int) -> list[Callable]:
        """Hooks ``hook(module)`` run by BackPACK on each module during backward."""
        return []

    def per_sample_stats(self, global_step: int) -> list:
        """Per-sample-gradient statistics (``backends.per_sample``) needed at a step.

        They are reduced layer by layer during the backward pass, shared
        between quantities that ask for equal statistics, and read back with
        :meth:`cockpit_like.context.StepRecord.stat`.

        Where a step cannot have them (a BatchNorm in training mode couples the
        rows: a row's gradient is undefined), a quantity that asks for them is
        left out of the step, unless :attr:`works_without_per_sample_stats`.
        """
        return []

    #: True for a quantity that still computes what it can where its per-sample statistics were left out of a
    #: step (``record.stat(spec, None)`` is None there; it says what it lacks with ``record.note``)
    works_without_per_sample_stats: bool = False

    def curvature_needs(self, global_step: int) -> list:
        """Step needs computed once after the backward pass (e.g. :class:`~cockpit_like.backends.hvp.HutchinsonDiagonal`).

        Merged by value between quantities and read back with
        :meth:`cockpit_like.context.StepRecord.stat`, like per-sample statistics.
        """
        return []

    def adapt_to_models(self, models: list) -> None:
        """Called when the cockpit learns the models that own its parameters (choose how to compute)."""

    def prepare_forward(self, global_step: int) -> None:
        """Called at the start of each forward pass of a model the cockpit knows, when the
        quantity is active at the coming step ``global_step`` (e.g. to install forward hooks
        for that step only; :class:`~cockpit_like.quantities.activations.ActivationStats`)."""

    def observe_info(self, global_step: int, info: dict[str, Any]) -> None:
        """Called when a step at which the quantity is active begins (each backward pass's block), with the
        step's ``info``, before the quantity is asked what it needs (e.g. to choose how to compute from the
        keys given: TIC's GGN diagonal where ``info["outputs"]`` is)."""

    def required_info(self, global_step: int) -> set[str]:
        """Keys of the cockpit's ``info`` dict needed at ``global_step``.

        The cockpit checks them when the step begins, before the backward pass.
        """
        return set()

    def create_graph(self, global_step: int) -> bool:
        """Whether the backward pass must keep the graph (``create_graph=True``)."""
        return False

    def hessian_products(self, global_step: int) -> bool:
        """Whether it needs Hessian-vector products at ``global_step`` (second derivatives of every
        operation of the forward pass; named in the error of a step whose model has an operation without)."""
        return False

    def settings(self) -> dict[str, Any]:
        """JSON-safe description of the quantity's arguments (written to logs)."""
        return {}

    # ---- resuming a run (docs/resume.md) --------------------------------------
    #: attributes :meth:`state_dict` leaves out (the cockpit saves ``output`` itself;
    #: ``verbose`` is the resumed run's choice)
    _STATE_SKIP: tuple[str, ...] = ("output", "_track_schedule", "_verbose")

    def state_dict(self) -> dict[str, Any]:
        """What the quantity carries from one step to the next, to resume a run.

        The default saves every attribute that holds plain data (tensors,
        numpy arrays, Python numbers, strings, ``None`` and lists, tuples, sets
        and dicts of them: a reference, a warm start, an adapted range, running
        statistics) and, for an attribute with ``state_dict`` /
        ``load_state_dict`` methods (not a module or an optimizer: the user
        saves those), what its ``state_dict()`` returns. Callables (the
        schedule), other objects and the attributes in ``_STATE_SKIP`` are left
        out, and so is ``output``: the cockpit saves it, or points to its
        stream. Override this and :meth:`load_state_dict` for state kept in
        anything else.
        """
        attributes, objects = {}, {}
        for name, value in vars(self).items():
            if name in self._STATE_SKIP or callable(value):
                continue
            if is_plain(value):
                attributes[name] = value
            elif _has_state(value):
                objects[name] = value.state_dict()
        return {"attributes": attributes, "objects": objects}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (of a quantity built with the same arguments)."""
        for name, value in state.get("attributes", {}).items():
            setattr(self, name, value)
        for name, value in state.get("objects", {}).items():
            getattr(self, name).load_state_dict(value)

    def from_log(self, value: Any, params: list) -> Any:
        """A value of this quantity read back from its log or stream (arrays come back as lists) in the form it had
        in memory (``get_output()`` of a resumed run is the uninterrupted run's). ``params``: the cockpit's.
        Default: as read."""
        return value

    # ---- computing ---------------------------------------------------------
    #: the value measures the parameters the step saw (Distance, UpdateSize, Alpha): withdrawn where the optimizer
    #: stepped from other parameters than the tracked backward pass's (``Cockpit._check_optimizer_step``)
    reads_parameters: bool = False
    #: the value predicts the optimizer's update from the step's gradient (Alpha): withdrawn where the gradients
    #: changed before the optimizer's step other than by one factor
    predicts_update: bool = False
    #: the value estimates a variance over the step's samples (divisor ``B - 1``: the gradient tests, GSNR, CABS,
    #: EarlyStopping, Alpha's fit): a step with one sample stores no value, with a note (Cockpit stores inf or NaN)
    needs_two_samples: bool = False

    def waits_for_optimizer(self, global_step: int) -> bool:
        """Whether ``global_step`` must end when ``info["optimizer"]`` steps, not at the end of the cockpit's
        block: what the quantity computes then reads the gradients the optimizer gets (after clipping or
        unscaling), its per-sample rows kept until then. Default: no."""
        return False

    def lost_ends(self, global_step: int) -> list[tuple[int, int]]:
        """``(start, end)`` of the values started before whose end step the cockpit was not entered (its step
        numbers skip it; ``global_step`` is entered now): they will never be computed, and what their start
        kept is dropped. Default: none."""
        return []

    def drop_start(self, start: int, end: int) -> bool:
        """The value that starts at ``start`` and ends at ``end`` cannot be computed (the optimizer stepped several
        times in between): drop what ``start`` kept for it; whether there was such a value. Default: no."""
        return False

    def learn_to_wait(self, global_step: int) -> bool:
        """``info["optimizer"]`` stepped with other gradients than the backward pass of ``global_step`` left, and not
        by one factor (clipping by value, gradient noise): the values of a :attr:`predicts_update` quantity there
        are withdrawn. Whether the quantity now learned to predict from the gradients the optimizer gets, from its
        next start step on (:meth:`waits_for_optimizer`). Default: no."""
        return False

    def skip_optimizer_step(self, global_step: int, params: list[torch.Tensor]) -> list[int]:
        """A GradScaler skipped ``global_step`` (its gradients are not finite): the step stores nothing, and the
        parameters are those the update of the step before left. The steps whose values are lost with it (a
        note at each says why). Default: :meth:`skip`, none lost."""
        self.skip(global_step)
        return []

    def skip(self, global_step: int) -> None:
        """``global_step`` was scheduled but stores nothing (it failed a self-check, or what it needs was left
        out): release what :meth:`prepare_forward` set up for it. The default does nothing."""

    def skip_at(self, global_step: int, params: list[torch.Tensor]) -> None:
        """As :meth:`skip`, where ``params`` are the step's parameters (the step failed a self-check, or what the
        quantity needs was left out; its parameters are right). Default: :meth:`skip`."""
        self.skip(global_step)

    def forget(self, global_step: int) -> None:
        """``global_step`` failed before it was stored (an exception or an interrupt in the cockpit's work, after
        this quantity was tracked there, docs/notebooks.md): drop what tracking it started, as if it had never
        been tracked, so that it can be tracked again. The values it stored are taken back by the cockpit. The
        default has nothing to drop."""

    def withdraw(self, global_step: int, ends: bool = True) -> list[int]:
        """The values computed at ``global_step`` no longer hold: remove them; the steps they were stored under.
        (``ends``: also the values whose end was ``global_step``, for quantities of two steps.)"""
        if global_step in self.output:
            del self.output[global_step]
            return [global_step]
        return []

    def track(self, global_step: int, params: list[torch.Tensor], batch_loss: Any) -> None:
        """Compute and store the value if the schedule asks for it."""
        if self.should_compute(global_step):
            value = self._compute(global_step, params, batch_loss)
            self._store(global_step, value)

    def _compute(self, global_step: int, params: list[torch.Tensor], batch_loss: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} must implement _compute(global_step, params, batch_loss)"
        )

    def _store(self, global_step: int, value: Any) -> None:
        if value is None:
            return
        self.output[global_step] = to_output(value)
        if self._verbose:
            print(f"[Step {global_step}] {type(self).__name__}: {self.output[global_step]}")

    def get_output(self) -> dict[int, Any]:
        """All stored values, ``{global_step: value}``."""
        return self.output

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({args})"


def _has_state(value: Any) -> bool:
    return (
        callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
        and not isinstance(value, (torch.nn.Module, torch.optim.Optimizer))
    )


class SingleStepQuantity(Quantity):
    """A quantity computed from the information of one step."""


class ByproductQuantity(SingleStepQuantity):
    """A single-step quantity that needs nothing from BackPACK."""


class TwoStepQuantity(Quantity):
    """A quantity that starts at one step and ends at a later one.

    At a start step, :meth:`_compute_start` saves what it needs with
    :meth:`save_to_cache`; at an end step, :meth:`_compute_end` loads it back
    with :meth:`load_from_cache` and returns the value, which is stored
    ``SAVE_SHIFT`` steps before the end step. After every tracked step, cache
    entries whose ``block_fn(step)`` is false are freed.

    By default a step is a start when the schedule holds, and an end when the
    schedule held ``SAVE_SHIFT`` steps before.
    """

    SAVE_SHIFT: int = 1

    def __init__(self, track_schedule: Callable[[int], bool], verbose: bool = False):
        super().__init__(track_schedule, verbose=verbose)
        self._cache: dict[int, dict[str, tuple[Any, Callable[[int], bool]]]] = {}
        #: start steps that stored nothing (:meth:`skip`): their end computes nothing
        self._skipped_starts: set[int] = set()
        #: start steps whose value waits for its end step (``SAVE_SHIFT > 0``; :meth:`lost_ends`)
        self._awaiting: set[int] = set()

    def is_start(self, global_step: int) -> bool:
        return self.should_compute(global_step)

    def is_end(self, global_step: int) -> bool:
        start = global_step - self.SAVE_SHIFT
        return start >= 0 and self.should_compute(start)

    def is_active(self, global_step: int) -> bool:
        return self.is_start(global_step) or self.is_end(global_step)

    def track(self, global_step: int, params: list[torch.Tensor], batch_loss: Any) -> None:
        if self.is_start(global_step):
            self._compute_start(global_step, params, batch_loss)
            if self.SAVE_SHIFT > 0 and global_step in self._cache:
                self._awaiting.add(global_step)
        start = global_step - self.SAVE_SHIFT
        if self.is_end(global_step) and start not in self._skipped_starts:
            value = self._compute_end(global_step, params, batch_loss)
            self._store(start, value)
        self._skipped_starts.discard(start)
        self._awaiting.discard(start)
        self.clean_cache(global_step)

    def lost_ends(self, global_step: int) -> list[tuple[int, int]]:
        lost = sorted(start for start in self._awaiting if start + self.SAVE_SHIFT < global_step)
        for start in lost:
            self._awaiting.discard(start)
            self._cache.pop(start, None)
        return [(start, start + self.SAVE_SHIFT) for start in lost]

    #: the end step reads only the parameters (UpdateSize): a step a GradScaler skipped still ends the value
    ends_on_parameters: bool = False

    #: the start reads only the parameters and stores nothing under the start step (Distance's ``theta_0``): a
    #: step that stores nothing because it failed a self-check still starts (a step a GradScaler skipped need
    #: not: the optimizer did not step, so the next step's parameters are the same)
    starts_on_parameters: bool = False

    def skip_at(self, global_step: int, params: list[torch.Tensor]) -> None:
        """As :meth:`skip`; where the start reads only the parameters (:attr:`starts_on_parameters`), the step
        still starts."""
        if self.starts_on_parameters and self.is_start(global_step):
            self._compute_start(global_step, params, None)
        self.skip(global_step)

    def skip_optimizer_step(self, global_step: int, params: list[torch.Tensor]) -> list[int]:
        """As :meth:`skip`, but the value that ends here is still computed where it reads only the parameters
        (:attr:`ends_on_parameters`); otherwise its start step is returned (lost)."""
        start, lost = global_step - self.SAVE_SHIFT, []
        if self.SAVE_SHIFT > 0 and self.is_end(global_step) and start in self._cache and start not in self._skipped_starts:
            if self.ends_on_parameters:
                self._store(start, self._compute_end(global_step, params, None))
            else:
                lost.append(start)
        self.skip(global_step)
        return lost

    def drop_start(self, start: int, end: int) -> bool:
        if self.SAVE_SHIFT == 0 or end - self.SAVE_SHIFT != start or start not in self._cache:
            return False
        del self._cache[start]
        self._awaiting.discard(start)
        return True

    def skip(self, global_step: int) -> None:
        """The step stores nothing: no start information is kept (its end stores nothing either), and the
        value whose end this step was is not computed."""
        super().skip(global_step)
        if self.is_start(global_step):
            self._skipped_starts.add(global_step)
        self._skipped_starts.discard(global_step - self.SAVE_SHIFT)
        self._awaiting.discard(global_step - self.SAVE_SHIFT)
        self.clean_cache(global_step)

    def forget(self, global_step: int) -> None:
        """What ``global_step`` started (its cache entries) is dropped and the step is not marked as skipped: tracked
        again, it starts afresh; not tracked again, its value of two steps is not computed (nothing cached)."""
        self._cache.pop(global_step, None)
        self._awaiting.discard(global_step)
        self._skipped_starts.discard(global_step)

    def withdraw(self, global_step: int, ends: bool = True) -> list[int]:
        """Drop what ``global_step`` started (its value will not be computed) and remove the values computed
        there: the one stored under it (``SAVE_SHIFT = 0``) and, with ``ends``, the one whose end it was."""
        removed = []
        if self.SAVE_SHIFT == 0 and global_step in self.output:
            del self.output[global_step]
            removed.append(global_step)
        start = global_step - self.SAVE_SHIFT
        if ends and self.SAVE_SHIFT > 0 and start in self.output:
            del self.output[start]
            removed.append(start)
        if self._cache.pop(global_step, None) is not None or self.is_start(global_step):
            self._skipped_starts.add(global_step)
        self._awaiting.discard(global_step)
        return removed

    def _compute_start(self, global_step: int, params: list[torch.Tensor], batch_loss: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _compute_start")

    def _compute_end(self, global_step: int, params: list[torch.Tensor], batch_loss: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement _compute_end")

    # ---- cache ---------------------------------------------------------------
    def save_to_cache(
        self, global_step: int, key: str, value: Any, block_fn: Callable[[int], bool]
    ) -> None:
        """Keep ``value`` under ``(global_step, key)`` while ``block_fn(step)`` holds."""
        if not callable(block_fn):
            raise TypeError(f"block_fn must be callable int -> bool, got {block_fn!r}")
        self._cache.setdefault(global_step, {})[key] = (value, block_fn)

    def load_from_cache(self, global_step: int, key: str) -> Any:
        """The value saved under ``(global_step, key)``.

        Raises:
            KeyError: nothing is cached there (e.g. the cockpit was not entered
                at the start step, or the entry was already freed).
        """
        try:
            return self._cache[global_step][key][0]
        except KeyError:
            raise KeyError(
                f"{type(self).__name__}: no cached {key!r} from step {global_step}. "
                f"Cached: {self.cached_keys()}. Enter the cockpit context at every "
                "step between the start and the end step."
            ) from None

    def is_cached(self, global_step: int, key: str) -> bool:
        return key in self._cache.get(global_step, {})

    def cached_keys(self) -> list[tuple[int, str]]:
        """``(step, key)`` of all live cache entries."""
        return [(step, key) for step, entries in self._cache.items() for key in entries]

    def clean_cache(self, global_step: int) -> None:
        """Free every entry whose block function does not hold at ``global_step``."""
        for step in list(self._cache):
            entries = self._cache[step]
            for key in [k for k, (_, block) in entries.items() if not block(global_step)]:
                del entries[key]
            if not entries:
                del self._cache[step]

    # ---- resuming a run ------------------------------------------------------
    _STATE_SKIP = Quantity._STATE_SKIP + ("_cache", "_skipped_starts")

    def state_dict(self) -> dict[str, Any]:
        """:meth:`Quantity.state_dict` plus the live cache entries.

        Each entry is saved with the last step its block function holds
        (:func:`last_blocked_step`; ``None``: all steps) and comes back with a
        :class:`KeepUntil` of that step.
        """
        state = super().state_dict()
        state["cache"] = {
            step: {key: (value, last_blocked_step(block, step)) for key, (value, block) in entries.items()}
            for step, entries in self._cache.items()
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._cache = {
            step: {key: (value, KeepUntil(last)) for key, (value, last) in entries.items()}
            for step, entries in state.get("cache", {}).items()
        }


class KeepUntil:
    """A block function that can be saved: holds for ``step <= last`` (every step if ``last`` is None).

    Example:
        >>> self.save_to_cache(t, "params", snapshot, block_fn=KeepUntil(t))  # kept until the next step
    """

    def __init__(self, last: int | None):
        self.last = last

    def __call__(self, global_step: int) -> bool:
        return self.last is None or global_step <= self.last

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepUntil) and other.last == self.last

    def __repr__(self) -> str:
        return f"KeepUntil({self.last})"


def last_blocked_step(block_fn: Callable[[int], bool], start: int, horizon: int = 2**62) -> int | None:
    """The last step ``>= start`` at which ``block_fn`` holds (``start - 1`` if none, ``None`` if all).

    Assumes the form of every block function in Cockpit and here: true up to
    some step, false after it (``lambda step: step <= t``, ``lambda _: True``);
    found by doubling then bisection, a few dozen calls. Steps beyond
    ``start + horizon`` count as all.
    """
    if isinstance(block_fn, KeepUntil):
        return block_fn.last
    if not block_fn(start):
        return start - 1
    good, width = start, 1
    while block_fn(start + width):
        good = start + width
        if width >= horizon:
            return None
        width *= 2
    bad = start + width
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if block_fn(middle) else (good, middle)
    return good


def parameter_snapshot(params) -> list[torch.Tensor]:
    """Detached copies of ``params``, made once per step and shared by every quantity that keeps them (Alpha,
    UpdateSize and Distance starting at the same step hold one copy of the parameters, not one each).
    Nothing may write into them."""
    from cockpit_like.backends.partitions import step_memo

    params = list(params)
    key = ("parameter snapshot", tuple(id(p) for p in params))
    return step_memo(key, lambda: [p.detach().clone() for p in params])
