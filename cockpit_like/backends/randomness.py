"""The cockpit's own random numbers: every draw from a generator seeded per step, the user's streams untouched.

A training run with dropout, random augmentation or shuffling must be the
same with and without the cockpit. So nothing in the cockpit draws from
torch's global generators (CPU or CUDA). Each random draw comes from

    generator(step, purpose, device) = torch.Generator(device).manual_seed(h(seed, step, purpose))

with ``h`` the first 63 bits of SHA-256 of ``"{seed}|{step}|{purpose}"``:

- the same numbers whatever else the cockpit tracks at the step (a quantity
  gives the same value alone and with others), and on every rank under DDP;
- different numbers at different steps and for different purposes
  (``"lanczos probes"``, ``"hutchinson diagonal"``, ...);
- reproducible: the same seed gives the same draws; :func:`set_seed` changes
  it (default :data:`DEFAULT_SEED`).

Where a library draws from the global generator itself (BackPACK's
Monte-Carlo extensions ``DiagGGNMC`` and ``KFAC`` sample labels with
``torch.multinomial`` in the loss module's backward hook),
:func:`seeded_global_rng` saves the global states, seeds them from
:func:`derive_seed` for the draw, and restores them afterwards;
:func:`seeded_sampling` gives such an extension a twin whose hook runs so.

Example:
    >>> a = torch.randn(3, generator=generator(5, "lanczos probes"))
    >>> bool(torch.equal(a, torch.randn(3, generator=generator(5, "lanczos probes"))))
    True

May import torch only.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

__all__ = [
    "DEFAULT_SEED",
    "set_seed",
    "get_seed",
    "derive_seed",
    "generator",
    "seeded_global_rng",
    "seeded_sampling",
    "SAMPLING_EXTENSIONS",
    "input_fingerprint",
]

#: the cockpit's seed unless :func:`set_seed` changes it
DEFAULT_SEED = 0

_seed = DEFAULT_SEED


def set_seed(seed: int) -> None:
    """Seed every later draw of the cockpit (process-wide; never touches torch's own generators)."""
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"set_seed takes an int, got {seed!r}")
    _seed = seed


def get_seed() -> int:
    """The cockpit's current seed."""
    return _seed


def derive_seed(step: int, purpose: str, *extra) -> int:
    """A 63-bit seed from the cockpit's seed, the step, ``purpose`` and ``extra`` (stable across runs and ranks)."""
    text = "|".join(str(part) for part in (_seed, step, purpose, *extra))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def generator(step: int, purpose: str, device="cpu", *extra) -> torch.Generator:
    """A fresh generator on ``device`` seeded by :func:`derive_seed` (``step``, ``purpose``, ``extra``)."""
    return torch.Generator(device=device).manual_seed(derive_seed(step, purpose, *extra))


def _cuda_index(device) -> int | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device() if device.index is None else device.index


@contextlib.contextmanager
def seeded_global_rng(seed: int, device="cpu") -> Iterator[None]:
    """Run a block whose code draws from torch's global generators with them seeded by ``seed``; restore after.

    The CPU generator and, for a CUDA ``device``, that device's generator are
    saved, seeded, and put back as they were (also on an error), so the
    caller's streams continue as if the block had never run. Other CUDA devices
    are not touched (code inside must draw on ``device`` only).
    """
    cpu = torch.default_generator
    cpu_state = cpu.get_state()
    index = _cuda_index(device)
    cuda = torch.cuda.default_generators[index] if index is not None else None
    cuda_state = cuda.get_state() if cuda is not None else None
    try:
        cpu.manual_seed(seed)
        if cuda is not None:
            cuda.manual_seed(seed)
        yield
    finally:
        cpu.set_state(cpu_state)
        if cuda is not None:
            cuda.set_state(cuda_state)


def _extension_types() -> tuple[type, ...]:
    try:
        from backpack.extensions import KFAC, DiagGGNMC
    except ImportError:  # pragma: no cover - BackPACK is a requirement
        return ()
    return (DiagGGNMC, KFAC)


#: BackPACK extensions that draw from the global generator in their hooks
SAMPLING_EXTENSIONS = _extension_types()


def _seeded_call(call):
    def __call__(self, module, g_inp, g_out):
        step = getattr(self, "_cockpit_step", None)
        if step is None:  # not a cockpit twin of this step: as BackPACK would
            return call(self, module, g_inp, g_out)
        self._cockpit_calls += 1
        device = g_out[0].device if g_out and isinstance(g_out[0], torch.Tensor) else "cpu"
        seed = derive_seed(step, type(self).__name__, self._cockpit_calls, input_fingerprint(module))
        with seeded_global_rng(seed, device):
            return call(self, module, g_inp, g_out)

    return __call__


def input_fingerprint(module) -> float:
    """``sum(module.input0)`` (BackPACK keeps the module's input there; 0.0 if absent), a float.

    Part of the seed of a sampling hook call, so that the backward passes of
    one optimizer step (micro-batches of gradient accumulation, whose inputs
    differ) draw independent numbers, while the same pass on the same data
    draws the same (reproducible, alone or with other quantities).
    """
    tensor = getattr(module, "input0", None)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return 0.0
    return float(tensor.detach().sum())


def seeded_sampling(extension, step: int):
    """A twin of a sampling BackPACK extension whose hook draws from a generator seeded per step; others as given.

    The twin shares the original's ``__dict__`` (savefield, hyperparameters,
    results; see :func:`cockpit_like.backends.no_grad.twin_class`) and keeps
    the step and a count of its hook calls in slots of its own, so the ``k``-th
    hook call of a backward pass at step ``s`` draws from the seed
    ``derive_seed(s, name, k, input_fingerprint(module))``.
    """
    if not SAMPLING_EXTENSIONS or not isinstance(extension, SAMPLING_EXTENSIONS):
        return extension
    from cockpit_like.backends.no_grad import twin_class

    cls = _seeded_class(twin_class(type(extension), "seeded", _seeded_call))
    twin = object.__new__(cls)
    twin.__dict__ = extension.__dict__
    twin._cockpit_step = step
    twin._cockpit_calls = 0
    return twin


_SLOTTED: dict[type, type] = {}


def _seeded_class(cls: type) -> type:
    """``cls`` with slots for the step and the call count (kept out of the shared ``__dict__``)."""
    if cls not in _SLOTTED:
        _SLOTTED[cls] = type(
            cls.__name__,
            (cls,),
            {"__slots__": ("_cockpit_step", "_cockpit_calls"), "__module__": cls.__module__,
             "__qualname__": cls.__qualname__},
        )
    return _SLOTTED[cls]
