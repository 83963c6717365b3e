"""The user's process-wide state that the cockpit's own work leaves as it found it, also when that work fails.

The cockpit's work in :meth:`~cockpit_like.Cockpit.begin` and
:meth:`~cockpit_like.Cockpit.end` turns gradients off (``torch.no_grad()``),
seeds torch's global generators for a block and puts them back (BackPACK's
Monte-Carlo extensions, the optimizer's look-ahead), and marks its own
computations (:func:`~cockpit_like.backends.internal.cockpit_work`), each in
a ``with`` statement that restores what it changed. An exception that lands
inside such a statement's own entry or exit skips the restore: Jupyter's
"Interrupt kernel" raises ``KeyboardInterrupt`` wherever the kernel is (an
interrupt inside ``torch.no_grad().__enter__``, after it turned gradients
off, leaves them off for the rest of the session). :func:`user_state_kept`
captures this state before the work and puts it back when the work raises,
whatever raised and wherever; the global random number generators (torch's,
NumPy's, Python's) it puts back in any case (the user's code that the cockpit's own passes run, a hook that
draws gradient noise, must not move the user's streams).

The user's hooks sit out the cockpit's own backward passes and re-runs: module
hooks (:func:`guard_module_hooks`), hooks on the tracked parameters
(:func:`held_tensor_hooks`) and hooks on any other tensor
(:func:`guard_tensor_hooks`: an activation's gradient kept or noised, Grad-CAM).

May import torch and :mod:`cockpit_like.backends.internal` (and, at call time,
:func:`cockpit_like.utils.optim.emptied`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator

import torch

from cockpit_like.backends import internal

__all__ = ["UserState", "gradient_changes", "guard_module_hooks", "guard_tensor_hooks", "held_tensor_hooks", "in_rerun",
           "generator_namespaces", "held_modules", "kept_generators", "kept_module_attributes", "own_backward", "rerunning", "user_state_kept"]  # fmt: skip


class UserState:
    """Grad mode, torch's CPU generator (and those of the CUDA devices once CUDA is initialised), Python's and
    NumPy's global generators, the depth of
    the cockpit's own work and of the optimizer look-aheads, as they were at :meth:`capture`."""

    __slots__ = ("grad_enabled", "cpu_rng", "cuda_rng", "other_rng", "work_depth", "looking_ahead")

    @classmethod
    def capture(cls) -> UserState:
        from cockpit_like.utils import optim

        state = cls()
        state.grad_enabled = torch.is_grad_enabled()
        state.cpu_rng = torch.default_generator.get_state()
        state.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        state.other_rng = _global_streams()
        state.work_depth = getattr(internal._STATE, "depth", 0)
        state.looking_ahead = optim._LOOKING_AHEAD
        return state

    def restore(self) -> None:
        from cockpit_like.utils import optim

        torch._C._set_grad_enabled(self.grad_enabled)
        self.restore_rng()
        internal._STATE.depth = self.work_depth
        optim._LOOKING_AHEAD = self.looking_ahead

    def restore_rng(self) -> None:
        torch.default_generator.set_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        _set_global_streams(self.other_rng)


def _global_streams() -> tuple:
    """The states of Python's ``random`` and (where imported) NumPy's global generator: a forward pass the
    cockpit re-runs, or a hook in its own passes, may draw from them (outside trial 31: a LayerDrop on
    ``random.random()``, a SpecAugment mask from ``np.random``, 0.03-0.05 apart in the parameters)."""
    import random
    import sys

    numpy = sys.modules.get("numpy")
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def _set_global_streams(states: tuple) -> None:
    import random
    import sys

    python, numpy_state = states
    random.setstate(python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and numpy_state is not None:
        numpy.random.set_state(numpy_state)


def _stream_of(value):
    """``(restore, state)`` of a random number generator (``torch.Generator``, ``numpy.random.Generator`` /
    ``RandomState``, ``random.Random``), else ``None``."""
    import random
    import sys

    if isinstance(value, torch.Generator):
        return value.set_state, value.get_state()
    if isinstance(value, random.Random):
        return value.setstate, value.getstate()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.random.RandomState):
            return value.set_state, value.get_state()
        if isinstance(value, numpy.random.Generator):
            return (lambda state, bits=value.bit_generator: setattr(bits, "state", state)), value.bit_generator.state
    return None


def _generator_types() -> tuple:
    """The classes of random number generators: torch's, Python's and (where imported) NumPy's."""
    import random
    import sys

    numpy = sys.modules.get("numpy")
    extra = (numpy.random.RandomState, numpy.random.Generator) if numpy is not None else ()
    return (torch.Generator, random.Random, *extra)


def _generators(values, inner: bool = True) -> list:
    """The generators among ``values``, and (``inner``) inside those that are dicts, lists, tuples or plain objects,
    two levels down (a ``{"gen": g}`` configuration, a helper holding ``self.g``, a list of lists: outside trials 32
    and 33); each once."""
    import itertools
    import types

    kinds = _generator_types()
    found, seen = [], set()
    opaque = (torch.Tensor, torch.nn.Module, str, bytes, int, float, type, types.ModuleType)

    def add(value) -> bool:
        if not isinstance(value, kinds):
            return False
        if id(value) not in seen:
            seen.add(id(value))
            found.append(value)
        return True

    def contents(value):
        if value is None or isinstance(value, opaque):
            return ()
        if isinstance(value, dict):
            return itertools.islice(value.values(), _INNER_LIMIT)
        if isinstance(value, (list, tuple)):
            return itertools.islice(value, _INNER_LIMIT)
        attributes = getattr(value, "__dict__", None)
        return itertools.islice(attributes.values(), _INNER_LIMIT) if isinstance(attributes, dict) and not callable(value) else ()

    for value in values:
        if add(value) or not inner:
            continue
        for item in contents(value):
            if not add(item):
                for deeper in contents(item):
                    add(deeper)
    return found


#: the most entries of a container or object looked into for generators (:func:`_generators`)
_INNER_LIMIT = 256

#: the packages whose modules' globals hold no generator of the user's (:func:`generator_namespaces`)
_LIBRARIES = frozenset(("torch", "transformers", "cockpit_like", "backpack", "timm", "torchvision", "diffusers",
                        "peft", "accelerate", "lightning", "pytorch_lightning"))  # fmt: skip


#: per model, the namespaces :func:`generator_namespaces` found (a model's classes do not change)
_NAMESPACES = weakref.WeakKeyDictionary()


def generator_namespaces(models) -> list[dict]:
    """The global namespaces of the Python modules that define the classes of the modules of ``models`` (the
    user's own, not a library's): a generator made at the top of the user's script or module
    (``GEN = torch.Generator()``) and drawn from in a ``forward`` or in a custom ``autograd.Function``'s
    ``backward`` lives there (outside trial 32: the cockpit's re-runs and own backward passes drew from such
    generators, and the parameters ended 0.005-0.009 apart)."""
    import sys

    spaces, seen = [], set()
    for model in models:
        names = _NAMESPACES.get(model)
        if names is None:
            names = sorted({type(module).__module__ for module in model.modules()} - {None})
            names = [name for name in names if name.split(".")[0] not in _LIBRARIES]
            _NAMESPACES[model] = names
        for name in names:
            found = sys.modules.get(name)
            if found is not None and name not in seen:
                seen.add(name)
                spaces.append(vars(found))
    return spaces


def _namespace_values(spaces: list[dict]) -> list:
    """The values of the namespaces ``spaces``, the class attributes of the classes defined there (a custom
    ``autograd.Function`` holding its generator as ``gen``: outside trial 32) or in another file of the user's
    project (such a ``Function`` imported from there: trial 33's last gap), and the values at the top of the
    user's own modules they import (``import noise`` and ``noise.G`` in the forward pass: outside trial 33), with
    their classes' attributes."""
    import sys
    import types

    def users_class(value, here) -> bool:  # defined here, or in another file of the user's project (trial 33)
        if not isinstance(value, type):
            return False
        where = getattr(value, "__module__", None)
        return where == here or (where is not None and _users_module(sys.modules.get(where)))

    values, seen = [], {id(space) for space in spaces}
    for space in spaces:
        here = space.get("__name__")
        for value in list(space.values()):
            values.append(value)
            if users_class(value, here):
                values.extend(vars(value).values())
            elif isinstance(value, types.ModuleType) and id(vars(value)) not in seen and _users_module(value):
                seen.add(id(vars(value)))
                for inner in list(vars(value).values()):
                    values.append(inner)
                    if users_class(inner, value.__name__):
                        values.extend(vars(inner).values())
    return values


def _users_module(module) -> bool:
    """Whether ``module`` is a Python module of the user's project: a file outside the standard library and the
    installed packages, and not a library the cockpit knows."""
    path = getattr(module, "__file__", None)
    if not path or getattr(module, "__name__", "").split(".")[0] in _LIBRARIES:
        return False
    return not any(path.startswith(prefix) for prefix in _installed_paths() if prefix)


@functools.cache
def _installed_paths() -> tuple:
    """Where the standard library and the installed packages live."""
    import sysconfig

    return tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def held_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module``'s modules and those its modules hold without registering them (in a plain list, tuple or dict
    attribute, or set past ``Module.__setattr__``: a mean teacher kept out of ``state_dict``, outside trial 33),
    each once."""
    found, seen = [], set()

    def take(root):
        for owner in root.modules():
            if id(owner) not in seen:
                seen.add(id(owner))
                found.append(owner)

    take(module)
    for owner in list(found):
        for name, value in owner.__dict__.items():
            if name in _MODULE_INTERNALS:
                continue
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, torch.nn.Module) and id(item) not in seen:
                    take(item)
    return found


def _module_values(module: torch.nn.Module) -> list:
    """The attribute values of ``module``'s modules (and of those it holds unregistered), and the class attributes
    of their classes that are not the library's (``GEN = torch.Generator()`` in a class body)."""
    values, classes = [], set()
    for owner in held_modules(module):
        values.extend(value for name, value in owner.__dict__.items() if name not in _MODULE_INTERNALS)
        cls = type(owner)
        if cls not in classes and (cls.__module__ or "").split(".")[0] not in _LIBRARIES:
            classes.add(cls)
            values.extend(vars(cls).values())
    return values


#: per model, ``(signature, generators)``: what :func:`_held_generators` found, and the modules' attribute counts then
_MODEL_GENERATORS = weakref.WeakKeyDictionary()


def _held_generators(models) -> list:
    """The generators the cockpit's work puts back for ``models`` (:func:`user_state_kept`, and for a re-run
    module :func:`kept_generators`): those the models' modules hold (:func:`_module_values`; inside dicts, lists
    and helper objects two levels down) and those at the top of the user's modules that define their classes
    (:func:`generator_namespaces`: looked at each time). The models' are looked for again only where a module's
    attributes changed in number (a scan at every step cost 1.5-4 ms on the benchmark's models): a generator bound
    later to an attribute that existed before (``self.gen = None`` first) is found at the next such change."""
    found: list = []
    for model in models:
        signature = tuple(len(owner.__dict__) for owner in model.modules())
        cached = _MODEL_GENERATORS.get(model)
        if cached is None or cached[0] != signature:
            cached = (signature, _generators(_module_values(model)))
            _MODEL_GENERATORS[model] = cached
        found += cached[1]
    found += _generators(_namespace_values(generator_namespaces(models)), inner=False)  # (direct values: cheap)
    return list({id(generator): generator for generator in found}.values())


@contextlib.contextmanager
def kept_generators(module: torch.nn.Module, arguments=()) -> Iterator[None]:
    """Put back, afterwards, the generators a re-run of ``module``'s forward pass may draw from: those
    :func:`_held_generators` finds for it and those among ``arguments`` (``model(x, generator=g)``). (torch's,
    NumPy's and Python's global ones: :func:`user_state_kept` around all of the cockpit's work.)"""
    found = {id(g): g for g in _held_generators([module]) + _generators(arguments)}
    held = [_stream_of(generator) for generator in found.values()]
    try:
        yield
    finally:
        for restore, state in held:
            restore(state)


@contextlib.contextmanager
def user_state_kept(models=()) -> Iterator[UserState]:
    """Run the cockpit's work; if it raises (anything, ``KeyboardInterrupt`` included), put the
    :class:`UserState` captured before it back, then let the exception go on; if it does not, put the global
    generators back, torch's, NumPy's and Python's (the cockpit draws from its own; the user's code its passes and
    re-runs run may draw from them: outside trial 29, a hook adding gradient noise moved the parameters by
    0.04-0.08 in 4 steps; trial 31, a LayerDrop on ``random.random()`` 0.048), and the generators at the top of
    the user's modules that define the classes of ``models`` (:func:`generator_namespaces`: trial 32, a custom
    ``autograd.Function``'s ``backward`` adding noise from one, run again by the curvature's products)."""
    state = UserState.capture()
    held = [_stream_of(generator) for generator in _held_generators(models)]
    try:
        yield state
    except BaseException:
        state.restore()
        raise
    finally:
        for restore, stream in held:
            restore(stream)
    state.restore_rng()


@contextlib.contextmanager
def held_tensor_hooks(tensors) -> Iterator[None]:
    """The user's gradient hooks on ``tensors`` (``p.register_hook``: gradient noise, clipping, a counter) do not run
    inside: the cockpit's own backward passes (Hessian-vector products, per-row re-runs) compute gradients of the
    parameters too, and a hook ran there dozens of times per tracked step, drawing from the user's random numbers
    (seventh round of outside trials). They are put back as they were, also when the work raises."""
    from cockpit_like.utils.optim import emptied  # (at call time: cockpit_like.utils imports the quantities)

    global _OWN_PASSES
    _OWN_PASSES += 1
    try:
        with emptied(getattr(tensor, "_backward_hooks", None) for tensor in tensors):
            yield
    finally:
        _OWN_PASSES -= 1


#: the cockpit's own backward passes running now (:func:`held_tensor_hooks`; process-wide: on a GPU the autograd
#: engine runs hooks on its device threads, and the user's backward pass never overlaps the cockpit's own)
_OWN_PASSES = 0


def own_backward() -> contextlib.AbstractContextManager:
    """A backward pass of the cockpit's own runs inside (a check's ``torch.autograd.grad``): the user's guarded
    hooks sit it out (:func:`held_tensor_hooks` of no tensors)."""
    return held_tensor_hooks(())


#: torch's ``Tensor.register_hook``, where :func:`guard_tensor_hooks` replaced it (None: not replaced)
_REGISTER_HOOK = None


def guard_tensor_hooks() -> None:
    """From now on, in this process, a hook the user registers on a tensor (``t.register_hook(fn)``: an
    activation's gradient kept for Grad-CAM, noised, clipped, logged) does nothing in the cockpit's own backward
    passes and runs as given everywhere else. Those passes (Hessian-vector products, per-row passes, checks) run
    through the forward graph again: such a hook ran 20-141 times instead of 4 in 4 steps, and one drawing
    gradient noise from torch's generator changed the run (outside trial 29). Parameters' own hook tables are
    emptied for those passes anyway (:func:`held_tensor_hooks`); a hook on another tensor can only be reached
    where it is registered, so ``torch.Tensor.register_hook`` is wrapped once: the hook given is stored as a
    twin that calls it, or returns ``None`` while the cockpit's own pass runs (:func:`_guarded`); the function of a
    ``torch.autograd.graph.register_multi_grad_hook`` too (called through that module: a name imported from it
    before the first cockpit is torch's own). Hooks of torch, BackPACK and the cockpit are stored as given."""
    global _REGISTER_HOOK
    if _REGISTER_HOOK is not None:
        return
    original = torch.Tensor.register_hook

    @functools.wraps(original)
    def register_hook(self, hook):
        if callable(hook) and not getattr(hook, "_cockpit_guarded", False) and _users_hook(hook):
            hook = _guarded(hook, "backward")
        return original(self, hook)

    _REGISTER_HOOK = original
    torch.Tensor.register_hook = register_hook

    # ``register_multi_grad_hook(tensors, fn)``: torch's own per-tensor hooks gather the gradients and call ``fn``;
    # ``fn`` is the user's (outside trial 32: 5 calls became 25-163 in 5 steps)
    import torch.autograd.graph as graph

    multi = graph.register_multi_grad_hook

    @functools.wraps(multi)
    def register_multi_grad_hook(tensors, fn, *args, **kwargs):
        if callable(fn) and not getattr(fn, "_cockpit_guarded", False) and _users_hook(fn):
            fn = _guarded(fn, "backward")
        return multi(tensors, fn, *args, **kwargs)

    graph.register_multi_grad_hook = register_multi_grad_hook


def guard_module_hooks(models) -> None:
    """Make the user's module hooks on the modules of ``models`` (and the global ones) leave the cockpit's own
    work alone: backward hooks and backward pre-hooks do nothing in the cockpit's own backward passes
    (:func:`held_tensor_hooks`), forward hooks and forward pre-hooks nothing in its re-runs
    (:func:`rerunning`) unless they were seen changing what they hook.

    torch hands a module's backward hooks to the graph when the module runs forward, so holding them at the
    cockpit's passes is too late; the Hessian-vector products of a curvature step run through the forward graph
    again, and a gradient logger hooked on a Linear layer saw 117 calls instead of 4 over 4 steps of the full
    preset (outside trial 8). Each such hook is replaced in its table by a twin that calls it, or does nothing
    while the cockpit's own work runs: called before the next forward pass (when the cockpit learns the models,
    after each tracked step, and as a tracked step's forward pass begins: the root module's own hooks are read
    by torch just before that), so a hook registered between a tracked step's forward and backward passes is
    guarded from the step after. Hooks of torch,
    BackPACK and the cockpit are left as they are.
    """
    from torch.nn.modules import module as torch_module

    owners = [owner for model in models for owner in model.modules()] + [_GlobalTables(torch_module)]
    for owner in owners:  # (at every tracked step: most tables are empty, and an empty one costs one lookup)
        for name, kind in _GUARDED_TABLES:
            hooks = owner.__dict__.get(name)
            if hooks:
                for key, hook in list(hooks.items()):
                    if not getattr(hook, "_cockpit_guarded", False) and _users_hook(hook):
                        hooks[key] = _guarded(hook, kind)


class _GlobalTables:
    """torch's global module hook tables (``_global_forward_hooks``, ...) under the modules' own table names."""

    def __init__(self, torch_module):
        self.__dict__.update({name: getattr(torch_module, f"_global{name}", None) for name, _ in _GUARDED_TABLES})


#: ``(table, kind)``: the module's hook tables (``_global`` + the name: torch's global ones) and when their hooks
#: sit out: "backward" in the cockpit's own backward passes, "forward" in its re-runs unless seen changing the
#: output, "forward_pre" in its re-runs always (the arguments they replay are those the pre-hooks made)
_GUARDED_TABLES = (("_backward_hooks", "backward"), ("_backward_pre_hooks", "backward"),
                   ("_forward_hooks", "forward"), ("_forward_pre_hooks", "forward_pre"))  # fmt: skip


#: ``[count, name]``: the user's guarded backward hooks (module backward hooks, tensor hooks) that returned a new
#: gradient in the user's own backward passes, and the last one's name (:func:`gradient_changes`)
_CHANGES: list = [0, None]


def gradient_changes() -> tuple[int, str | None]:
    """``(count, name)`` of the user's hooks that returned a new gradient in a backward pass of the user's so far:
    a step compares the count with its value when the step began (the quantities then read the changed
    gradients, the curvature's products included: hooks that halve every parameter's gradient halve HessMaxEV)."""
    return _CHANGES[0], _CHANGES[1]


def _handed_back(result, args) -> bool:
    """Whether a backward hook's ``result`` is only the gradients it was given (``return grad``, ``return
    grad_input``): not a change."""
    given = {id(t) for a in args for t in (a if isinstance(a, (tuple, list)) else (a,)) if isinstance(t, torch.Tensor)}
    returned = result if isinstance(result, (tuple, list)) else (result,)
    return all(t is None or id(t) in given for t in returned)


def _guarded(hook, kind: str):
    if kind == "backward":

        @functools.wraps(hook)
        def guarded(*args, **kwargs):
            if _OWN_PASSES:
                return None
            result = hook(*args, **kwargs)
            if result is not None and not _handed_back(result, args):
                target = getattr(hook, "func", hook)
                _CHANGES[0] += 1
                _CHANGES[1] = getattr(target, "__qualname__", None) or type(target).__name__
            return result

    elif kind == "forward_pre":

        @functools.wraps(hook)
        def guarded(*args, **kwargs):
            if _RERUNS:  # the re-runs replay the call's arguments as its forward received them: after these hooks
                return None
            return hook(*args, **kwargs)

    else:

        @functools.wraps(hook)
        def guarded(*args, **kwargs):
            if _RERUNS and not guarded._cockpit_changes:
                return None
            result = hook(*args, **kwargs)
            if result is not None:  # it changes what it hooks: the re-runs need it to reproduce the call
                guarded._cockpit_changes = True
            return result

        guarded._cockpit_changes = False
    guarded._cockpit_guarded = True
    return guarded


#: where a hook of torch's own, BackPACK's or the cockpit's comes from (kept in the cockpit's re-runs: weight norm's and
#: pruning's pre-hooks compute the weight, the cockpit's record the calls)
_OWN_PACKAGES = frozenset({"torch", "backpack", "cockpit_like"})


def _users_hook(hook) -> bool:
    target = getattr(hook, "func", hook)  # functools.partial
    origin = getattr(target, "__module__", None) or type(target).__module__ or ""
    return origin.split(".")[0] not in _OWN_PACKAGES


@contextlib.contextmanager
def rerunning() -> Iterator[None]:
    """The cockpit's per-row re-runs of a module run inside: the user's forward pre-hooks, forward hooks and backward
    hooks (guarded by :func:`guard_module_hooks`) do nothing there, except forward hooks seen returning a new output
    (the re-run needs them to reproduce the call; the arguments it replays already went through the pre-hooks). An
    activation logger or a call counter in a hook saw 8-36 calls per tracked step instead of one (outside trial 8)."""
    global _RERUNS
    _RERUNS += 1
    try:
        yield
    finally:
        _RERUNS -= 1


def in_rerun() -> bool:
    """Whether a per-row re-run of the cockpit runs now (:func:`rerunning`): the cockpit's own forward hooks that
    count the training's calls (ActivationStats, DataStats) skip it."""
    return _RERUNS > 0


#: the cockpit's per-row re-runs running now (:func:`rerunning`)
_RERUNS = 0


_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


@contextlib.contextmanager
def kept_module_attributes(module: torch.nn.Module) -> Iterator[None]:
    """The plain Python attributes of ``module`` and its submodules as they were, afterwards: a forward pass that
    counts its calls (``self.calls += 1``, a warm-up switched by it) or appends to a list kept on the module ran
    again in the cockpit's re-runs, and the run with the cockpit then differed from the one without (outside trial
    8: parameters 0.051 apart). Numbers, strings and other values are bound again; lists, dicts and sets get
    their entries back in place; attributes the re-runs added are removed. Tensors and modules are left to the
    callers (buffers and tensor attributes: :func:`cockpit_like.backends.rerun._model_kept`)."""
    kept = []
    for owner in module.modules():
        names = set(owner.__dict__)
        values = []
        for name, value in owner.__dict__.items():
            if name in _MODULE_INTERNALS or isinstance(value, (torch.Tensor, torch.nn.Module)):
                continue
            copy = list(value) if type(value) is list else dict(value) if type(value) is dict else (
                set(value) if type(value) is set else None)  # fmt: skip
            values.append((name, value, copy))
        kept.append((owner, names, values))
    try:
        yield
    finally:
        for owner, names, values in kept:
            for name in [name for name in owner.__dict__ if name not in names and name not in _MODULE_INTERNALS]:
                if not isinstance(owner.__dict__[name], (torch.Tensor, torch.nn.Module)):
                    del owner.__dict__[name]
            for name, value, copy in values:
                owner.__dict__[name] = value
                if isinstance(copy, list):
                    value[:] = copy
                elif copy is not None:
                    value.clear()
                    value.update(copy)
