"""What an optimizer is about to do: its next update, computed without taking it.

- :func:`lookahead_update`: the update ``optimizer.step()`` would make now, for
  any ``torch.optim.Optimizer``, run on shadow copies (Alpha predicts its
  direction with it).
- :class:`ComputeStep`: Cockpit's helper for quantities that need the update
  (``compute_update_step``) or are defined only for plain SGD
  (``is_sgd_default_kwargs``, used by CABS-style quantities). Its updates come
  from :func:`lookahead_update`.
- :class:`StepGuard`: what a look-ahead of an optimizer that keeps state elsewhere than in ``param_groups``
  and ``optimizer.state`` runs under, so that the run is left as it was (:func:`keeps_state_in_groups`).

May import torch and NumPy only.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import random
import types
import weakref
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "lookahead_update", "lookahead_parameters", "is_elementwise", "keeps_state_in_groups", "looking_ahead",
    "LookaheadNotValid", "StepGuard", "ComputeStep",
]

_IMMUTABLE = (bool, int, float, str, type(None), tuple)


def lookahead_update(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    gradients: Mapping[torch.Tensor, torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """The update ``optimizer.step()`` would make now, without making it.

    The step runs on *shadow* parameters: detached copies of every parameter
    of the optimizer with copies of their gradients and of their optimizer
    state, in new param groups with the same hyperparameters, swapped in for
    the duration of the call. The
    real parameters, gradients and state are never written (not even their
    autograd version counters change, so a graph kept for later
    Hessian-vector products stays valid). Afterwards the param groups (with
    their hyperparameters), the optimizer's plain attributes and torch's CPU
    RNG are restored.

    Exact for any optimizer whose ``step()`` reads the parameters from
    ``param_groups`` and their state from ``optimizer.state`` (all of
    ``torch.optim`` and the usual custom subclasses). An optimizer that
    :func:`keeps_state_in_groups` does not know steps under a :class:`StepGuard`:
    whatever else its step writes (buffers in a list, a tensor counter, a
    generator, an inner optimizer's parameters and state) is put back, and
    where it wrote the real parameters (a wrapper that steps an inner
    optimizer) :class:`LookaheadNotValid` is raised. For an element-wise
    optimizer (:func:`is_elementwise`) only ``params`` are stepped, in parts
    of at most :data:`LOOKAHEAD_PART_BYTES` of parameters each (one step per
    part), so the copies that exist at once stay bounded on a large model.

    Args:
        optimizer: the optimizer.
        params: the parameters whose update is returned.
        gradients: optional ``{param: gradient}`` used instead of ``param.grad``
            for the parameters it contains (e.g. ``grad_batch.sum(0)`` while
            ``param.grad`` is not written yet); a ``None`` gradient: the
            parameter has none, and the optimizer skips it (as torch's
            optimizers skip a ``p.grad`` that is None: no weight decay, no
            momentum), its update is zero.

    Returns:
        ``[theta_p(after) - theta_p(before) for p in params]`` (zeros for
        tensors the optimizer does not update).

    Example:
        >>> opt = torch.optim.SGD([w], lr=0.1)      # w.grad = g
        >>> lookahead_update(opt, [w])              # [-0.1 * g]
    """
    gradients = {} if gradients is None else gradients
    if is_elementwise(optimizer):
        updates = {}
        for part in _parts(optimizer, params):
            updates.update(_shadow_step(optimizer, gradients, only=part))
    else:
        updates = _shadow_step(optimizer, gradients)
    return [updates[id(p)] if id(p) in updates else torch.zeros_like(p) for p in params]


#: an element-wise optimizer's look-ahead steps the parameters in parts of at most this many bytes of
#: parameters (a larger parameter is a part of its own): its copies of a part's parameters, gradients
#: and state exist at once, not those of the whole model
LOOKAHEAD_PART_BYTES = 64 * 2**20


def _parts(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[set[int]]:
    """The ids of those ``params`` the optimizer holds, in parts of at most :data:`LOOKAHEAD_PART_BYTES`."""
    wanted = {id(p) for p in params}
    parts: list[set[int]] = [set()]
    size = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in wanted:
                continue
            nbytes = param.numel() * param.element_size()
            if parts[-1] and size + nbytes > LOOKAHEAD_PART_BYTES:
                parts.append(set())
                size = 0
            parts[-1].add(id(param))
            size += nbytes
    return [part for part in parts if part]


def _shadow_step(
    optimizer: torch.optim.Optimizer,
    gradients: Mapping[torch.Tensor, torch.Tensor | None],
    only: set[int] | None = None,
    lend: bool = False,
) -> dict[int, torch.Tensor]:
    """``{id(param): update}`` of one ``optimizer.step()`` on shadow copies (all parameters, or those in ``only``).

    Each shadow gets ``gradients[param]`` (else ``param.grad``; none where that is None) and a copy of the
    parameter's state; the step runs on new group dicts (same hyperparameters)
    holding the shadows. The real parameters, gradients, state and groups are
    never written; the optimizer's plain attributes and torch's CPU RNG are restored.
    ``lend``: the tensors in ``gradients`` are the caller's own and are given to
    the shadows as they are, not copied (the optimizer may write into them:
    torch's foreach SGD with Nesterov momentum does; their ``_version`` tells).

    An optimizer not known to keep all its state in ``param_groups`` and ``optimizer.state``
    (:func:`keeps_state_in_groups`: a wrapper, ZeRO, a hand-written ``step()``) steps under a
    :class:`StepGuard`, which puts back whatever else the step changed (tensors written in place, generators,
    Python containers and attributes reachable from the optimizer).

    Raises:
        LookaheadNotValid: the guarded step wrote (or rebound) the real parameters: it steps parameters other
            than those in its ``param_groups`` (a wrapper whose inner optimizer holds them), so the shadows'
            update is not the one the optimizer makes. Everything was put back first.
    """
    global _LOOKING_AHEAD
    saved_groups = optimizer.param_groups
    attributes = {k: v for k, v in vars(optimizer).items() if isinstance(v, _IMMUTABLE)}
    rng = torch.get_rng_state()
    guard = None if keeps_state_in_groups(optimizer) else StepGuard(optimizer)
    shadows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    updates: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        try:
            groups = []
            for group in saved_groups:
                shadowed = []
                for param in group["params"]:
                    if only is not None and id(param) not in only:
                        continue
                    shadow = param.detach().clone().requires_grad_(param.requires_grad)
                    grad = gradients[param] if param in gradients else param.grad
                    if grad is not None:
                        grad = grad.detach().to(param.dtype).reshape(param.shape)
                        shadow.grad = grad if lend and param in gradients else grad.clone()
                    if param in optimizer.state:
                        optimizer.state[shadow] = {
                            k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                            for k, v in optimizer.state[param].items()
                        }
                    shadows[id(param)] = (param, shadow)
                    shadowed.append(shadow)
                if shadowed:
                    groups.append(dict(group, params=shadowed))
            if groups:
                optimizer.param_groups = groups
                _LOOKING_AHEAD += 1  # the optimizer's step hooks see a look-ahead, not the training's step
                try:
                    with _step_hooks_held(optimizer):
                        if guard is None:
                            optimizer.step()
                        else:
                            own = [t for _, shadow in shadows.values() for t in (shadow, shadow.grad) if t is not None]
                            own += [v for _, shadow in shadows.values()
                                    for v in optimizer.state.get(shadow, {}).values() if isinstance(v, torch.Tensor)]
                            with guard.watching(own):
                                optimizer.step()
                finally:
                    _LOOKING_AHEAD -= 1
            # the shadows are ours: each becomes its update in place (no third copy of the parameters)
            updates = {key: shadow.detach().sub_(param.detach()) for key, (param, shadow) in shadows.items()}
        finally:  # the optimizer's own groups first: what an interrupt inside this block must leave right
            optimizer.param_groups = saved_groups
            for _, shadow in shadows.values():
                optimizer.state.pop(shadow, None)
            for key, value in attributes.items():
                setattr(optimizer, key, value)
            torch.set_rng_state(rng)
            if guard is not None:
                guard.restore()
    if guard is not None and guard.wrote_real:
        raise LookaheadNotValid(optimizer, guard.wrote_real)
    return updates


class LookaheadNotValid(RuntimeError):
    """A look-ahead's ``optimizer.step()`` wrote the real parameters (put back since): its update of the shadow
    copies is not the update the optimizer makes (a wrapper whose inner optimizer holds the parameters)."""

    def __init__(self, optimizer: torch.optim.Optimizer, written: list[int]):
        self.optimizer_name = type(optimizer).__name__
        self.written = list(written)
        inner = [f"{name}, its {type(value).__name__}" for name, value in vars(optimizer).items()
                 if isinstance(value, torch.optim.Optimizer) and value is not optimizer]
        declare = (f"declare the optimizer that holds the parameters instead, e.g. info['optimizer'] = "
                   f"<your {self.optimizer_name}>.{inner[0]}" if inner else
                   "declare the optimizer that holds the parameters in its param_groups and steps them there")
        super().__init__(
            f"the look-ahead of {self.optimizer_name}.step() on copies of the parameters wrote "
            f"{len(self.written)} of the real parameters (put back since): {self.optimizer_name} steps parameters "
            "held elsewhere than in its param_groups (it wraps or delegates to another optimizer, or keeps a list "
            f"of them of its own), so its update cannot be predicted on copies; {declare}"
        )


def keeps_state_in_groups(optimizer) -> bool:
    """Whether ``optimizer`` is known to read and write nothing but its ``param_groups`` and ``optimizer.state``
    in ``step()``: one of torch's own optimizers (``torch.optim``), or a subclass of one that adds no method of
    its own other than ``__init__`` (its ``step()`` is torch's). Other optimizers' look-aheads run under a
    :class:`StepGuard`."""
    if not isinstance(optimizer, torch.optim.Optimizer) or "step" in vars(optimizer):
        return False  # not an optimizer of torch's, or its step() replaced on the instance (a wrapper's patch)
    mro = type(optimizer).__mro__
    if not any(c.__module__.startswith("torch.optim.") and c is not torch.optim.Optimizer for c in mro):
        return False  # a hand-written step()
    for cls in mro:
        if cls is object or cls.__module__.startswith("torch.optim."):
            continue
        for name, value in vars(cls).items():
            # torch's Optimizer.__init__ wraps the class's step() for its hooks (``__wrapped__``: what it wraps)
            own = getattr(inspect.unwrap(value), "__module__", None) if callable(value) else cls.__module__
            if name != "__init__" and (callable(value) or isinstance(value, (staticmethod, classmethod, property))) \
                    and not (own or "").startswith("torch.optim."):
                return False
    return True


#: what :class:`StepGuard` does not look into: values that hold no state of the optimizer's it could put back
_LEAVES = (torch.Tensor, torch.nn.Module, torch.Generator, type, types.ModuleType, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, weakref.ref, str, bytes, int, float, complex, bool,
           type(None))


class StepGuard(TorchDispatchMode):
    """Leaves the run as it was around a look-ahead's ``optimizer.step()`` on shadow copies, whatever the step
    reaches, and says whether the step wrote the real parameters.

    - **Tensors written in place** (any ATen op whose schema marks an argument as written: ``add_``,
      ``out=``, ``_foreach_*_``), other than the shadows, their gradients and state (``own``) and tensors the
      step made itself: a copy of each is taken before its first write and copied back afterwards, with its
      autograd version counter (copy-on-write; the copies exist only during the step).
    - **Generators**: torch's default CPU (and CUDA) generators, every ``torch.Generator`` an op gets as
      ``generator=``, Python's ``random`` and NumPy's global state: as they were.
    - **Python containers and attributes** reachable from the optimizer (lists and dicts of buffers,
      counters, an inner optimizer's ``state`` and ``param_groups``): a shallow snapshot of each, taken at
      construction, put back where the step changed it.
    - **The real parameters** (those in ``param_groups`` at construction): a write into one, or a new
      ``.data`` or ``.grad``, is put back and listed in :attr:`wrote_real` (indices): the step stepped them.

    Costs only where it is used (optimizers that :func:`keeps_state_in_groups` does not know): one Python call
    per ATen op of the step, a copy of each foreign tensor it writes, a walk over the optimizer's containers.
    """

    #: containers and objects walked at most (a bound on the snapshot's cost)
    WALK_LIMIT = 1_000_000

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.wrote_real: list[int] = []
        self._real_params = [p for group in optimizer.param_groups for p in group["params"]]
        self._real: dict[int, int] = {}
        for index, param in enumerate(self._real_params):
            self._real.setdefault(_storage(param), index)
        self._bindings = [(p, p.detach(), p.grad) for p in self._real_params]
        self._containers = _walk(optimizer, self.WALK_LIMIT)
        self._generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._python_random = random.getstate()
        self._numpy_random = np.random.get_state()
        self._own: set[int] = set()
        self._written: list[tuple[torch.Tensor, torch.Tensor, int | None]] = []
        self._seen: set[tuple] = set()

    def watching(self, own: Iterable[torch.Tensor]) -> StepGuard:
        """The guard, to enter around the step; ``own``: the shadows, their gradients and state (not copied)."""
        self._own = {_storage(t) for t in own}
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        # an in-place op without annotations (torch.distributed's ``c10d::broadcast_``): each tensor it gets
        unannotated = schema.name.endswith("_") and not any(a.alias_info is not None for a in schema.arguments)
        for index, argument in enumerate(schema.arguments):
            value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            if isinstance(value, torch.Generator):
                if id(value) not in self._generators:
                    self._generators[id(value)] = (value, value.get_state())
            elif unannotated or (argument.alias_info is not None and argument.alias_info.is_write):
                for tensor in _tensors(value):
                    self._before_write(tensor)
        out = func(*args, **kwargs)
        if all(r.alias_info is None for r in schema.returns):  # new tensors: the step's own
            self._own.update(_storage(t) for t in _tensors(out))
        return out

    def _before_write(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:
            return
        storage = _storage(tensor)
        if storage in self._own:
            return
        if storage in self._real and self._real[storage] not in self.wrote_real:
            self.wrote_real.append(self._real[storage])
        try:
            key = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        except Exception:  # noqa: BLE001 - a sparse tensor has no strides: one copy per tensor object
            key = (storage, id(tensor))
        if key in self._seen:
            return
        self._seen.add(key)
        try:
            version = tensor._version
        except Exception:  # noqa: BLE001 - an inference tensor has none
            version = None
        self._written.append((tensor, tensor.clone(), version))

    def restore(self) -> None:
        """Put back everything the step changed (call once, after the step, also where it raised)."""
        with torch.no_grad():
            for tensor, copied, version in reversed(self._written):  # the first copy of a place is its original
                tensor.copy_(copied)
                if version is not None:
                    _set_version(tensor, version)
        self._written.clear()
        for generator, state in self._generators.values():
            generator.set_state(state)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        random.setstate(self._python_random)
        np.random.set_state(self._numpy_random)
        _put_back(self._containers)
        for index, (param, data, grad) in enumerate(self._bindings):
            if _storage(param) != _storage(data) or param.shape != data.shape:
                param.data = data
                if index not in self.wrote_real:
                    self.wrote_real.append(index)
            if param.grad is not grad:
                param.grad = grad


def _set_version(tensor: torch.Tensor, version: int) -> None:
    """Put ``tensor``'s autograd version counter back (a graph that saved it stays usable); where this torch has no
    way to, the counter stays advanced (the values are right; a graph saved before would refuse to backward)."""
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        return
    try:
        setter((tensor,), (version,))
    except TypeError:  # torch < 2.5: one tensor and one int
        setter(tensor, version)


def _storage(tensor: torch.Tensor) -> int:
    """Which memory ``tensor`` lives in (its views share it): the storage's address, else the tensor's id."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor subclass without storage
        return id(tensor)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _walk(root, limit: int) -> list[tuple[object, object]]:
    """``(container, shallow copy)`` for every list, dict, set and object ``__dict__`` reachable from ``root``."""
    saved: list[tuple[object, object]] = []
    seen: set[int] = set()
    stack = [root]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            saved.append((obj, dict(obj)))
            stack.extend(obj.values())
        elif isinstance(obj, list):
            saved.append((obj, list(obj)))
            stack.extend(obj)
        elif isinstance(obj, set):
            saved.append((obj, set(obj)))
        elif isinstance(obj, tuple):
            stack.extend(obj)
        elif isinstance(getattr(obj, "__dict__", None), dict):
            saved.append((obj, dict(vars(obj))))
            stack.extend(vars(obj).values())
    return saved


def _put_back(saved: list[tuple[object, object]]) -> None:
    for obj, copied in saved:
        if isinstance(obj, list):
            if len(obj) != len(copied) or any(a is not b for a, b in zip(obj, copied)):
                obj[:] = copied
            continue
        if isinstance(obj, set):
            if obj != copied:
                obj.clear()
                obj.update(copied)
            continue
        target = obj if isinstance(obj, dict) else vars(obj)
        if len(target) != len(copied) or any(k not in copied or copied[k] is not v for k, v in target.items()):
            target.clear()
            target.update(copied)


def has_step_hooks(optimizer) -> bool:
    """Whether step hooks can be registered on ``optimizer``: a ``torch.optim.Optimizer`` whose hook tables exist
    (``Optimizer.__init__`` makes them; a wrapper subclassing it without calling it, as timm's older Lookahead,
    has none, and ``register_step_pre_hook`` raised torch's AttributeError from inside the cockpit: outside trial
    36). Where there are none the wrapper's class step is not patched to call hooks either: the cockpit treats
    it as an optimizer whose step it cannot see."""
    import collections

    return isinstance(optimizer, torch.optim.Optimizer) and all(
        isinstance(getattr(optimizer, name, None), collections.OrderedDict)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    )


@contextlib.contextmanager
def _step_hooks_held(optimizer):
    """The step pre- and post-hooks of ``optimizer`` (``register_step_pre_hook`` / ``register_step_post_hook``) and the
    global ones (``register_optimizer_step_pre_hook``) do not run during a look-ahead's ``optimizer.step()``: they
    are the user's (an EMA of the weights, clipping, a counter) and act on the training's step, so a look-ahead ran
    each twice per tracked step and changed the run (seventh round of outside trials). The cockpit's own hooks
    skip look-aheads anyway (:func:`looking_ahead`)."""
    from torch.optim import optimizer as module

    with emptied(getattr(owner, name, None) for owner, name in (
        (optimizer, "_optimizer_step_pre_hooks"), (optimizer, "_optimizer_step_post_hooks"),
        (module, "_global_optimizer_pre_hooks"), (module, "_global_optimizer_post_hooks"),
    )):
        yield


@contextlib.contextmanager
def emptied(mappings: Iterable):
    """Each non-empty dict of ``mappings`` (hooks: ``OrderedDict``s torch reads at call time) empty inside, its
    entries put back in order afterwards, also when the body raises; other values are ignored."""
    held = []
    for hooks in mappings:
        if isinstance(hooks, dict) and hooks:
            held.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, kept in held:
            hooks.clear()
            hooks.update(kept)


#: look-aheads running now: an optimizer's step hooks called meanwhile are the look-ahead's (:func:`looking_ahead`)
_LOOKING_AHEAD = 0


def looking_ahead() -> bool:
    """Whether ``optimizer.step()`` is being called by a look-ahead on shadow copies (its step hooks then run too)."""
    return _LOOKING_AHEAD > 0


#: optimizers whose update of a parameter reads only that parameter, its gradient and its state
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop")
    if hasattr(torch.optim, name)
)


def is_elementwise(optimizer) -> bool:
    """Whether ``optimizer`` is one of :data:`ELEMENTWISE` (exact type: a subclass may couple parameters)."""
    return type(optimizer) in ELEMENTWISE


def lookahead_parameters(
    optimizer: torch.optim.Optimizer, gradients: Mapping[torch.Tensor, torch.Tensor], lend: bool = False
) -> dict[torch.Tensor, torch.Tensor]:
    """``{param: update}``: what ``optimizer.step()`` would do to each ``param`` if its gradient were ``gradients[param]``.

    Only these parameters are shadowed and stepped (their groups'
    hyperparameters, copies of their state), so this costs
    ``O(sum of their sizes)``: for an element-wise optimizer
    (:func:`is_elementwise`) it equals their part of :func:`lookahead_update`,
    and it can run during the backward pass, a few layers at a time. A
    parameter the optimizer does not hold gets a zero update. ``lend``: the
    gradient tensors are the caller's to lend, not copied (see
    :func:`_shadow_step`; a caller that reads them afterwards checks their
    ``_version``).
    """
    updates = _shadow_step(optimizer, gradients, only={id(p) for p in gradients}, lend=lend)
    return {p: updates[id(p)] if id(p) in updates else torch.zeros_like(p) for p in gradients}


class ComputeStep:
    """An optimizer's update step, for quantities that need it (Cockpit's ``cockpit.utils.optim.ComputeStep``).

    The update comes from :func:`lookahead_update`, so it is exact for every
    ``torch.optim`` optimizer (Cockpit computes it for plain SGD only and
    raises ``NotImplementedError`` otherwise). The gradient that the step
    reads is ``param.grad_batch.sum(0)`` where the parameter carries
    BackPACK's ``grad_batch`` (as in Cockpit: inside a backward hook
    ``param.grad`` is not written yet), else ``param.grad``. For a mean loss
    both are the mini-batch gradient.

    Example:
        >>> if not ComputeStep.is_sgd_default_kwargs(optimizer):
        ...     raise ValueError("only for plain SGD")
        >>> updates = ComputeStep.compute_update_step(optimizer, [id(p) for p in params])
        >>> updates[id(params[0])]                 # -lr * grad for plain SGD
    """

    @staticmethod
    def compute_update_step(
        optimizer: torch.optim.Optimizer, parameter_ids: Iterable[int]
    ) -> dict[int, torch.Tensor]:
        """``{id(p): update of p}`` for the optimizer's parameters whose ids are in ``parameter_ids``.

        Raises:
            ValueError: an id is not one of the optimizer's parameters.
        """
        wanted = set(parameter_ids)
        params = [p for group in optimizer.param_groups for p in group["params"] if id(p) in wanted]
        params = list({id(p): p for p in params}.values())
        if len(params) != len(wanted):
            found = {id(p) for p in params}
            raise ValueError(
                f"ComputeStep: {len(wanted - found)} of the requested parameter ids are not parameters of "
                f"this {type(optimizer).__name__}; pass ids of tensors in optimizer.param_groups"
            )
        gradients = {
            p: p.grad_batch.detach().sum(0) for group in optimizer.param_groups for p in group["params"]
            if isinstance(getattr(p, "grad_batch", None), torch.Tensor)
        }
        updates = lookahead_update(optimizer, params, gradients)
        return {id(p): update.detach() for p, update in zip(params, updates)}

    @staticmethod
    def is_sgd_default_kwargs(optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is ``torch.optim.SGD`` without momentum, dampening, weight decay or Nesterov.

        As in Cockpit: every param group has ``weight_decay``, ``momentum`` and
        ``dampening`` close to 0 (``numpy.isclose``) and ``nesterov`` False.
        """
        if not isinstance(optimizer, torch.optim.SGD):
            return False
        for group in optimizer.param_groups:
            for key in ("weight_decay", "momentum", "dampening"):
                if not np.isclose(group.get(key, 0.0), 0.0):
                    return False
            if group.get("nesterov", False) is not False:
                return False
        return True

    @staticmethod
    def update_sgd_default_kwargs(
        optimizer: torch.optim.Optimizer, parameter_ids: Iterable[int]
    ) -> dict[int, torch.Tensor]:
        """:meth:`compute_update_step` for plain SGD (``-lr * gradient``).

        Raises:
            ValueError: ``optimizer`` is not plain SGD (:meth:`is_sgd_default_kwargs`).
        """
        if not ComputeStep.is_sgd_default_kwargs(optimizer):
            raise ValueError(
                f"update_sgd_default_kwargs needs torch.optim.SGD without momentum, dampening, weight decay "
                f"or Nesterov, got {type(optimizer).__name__}; use compute_update_step for any optimizer"
            )
        return ComputeStep.compute_update_step(optimizer, parameter_ids)
