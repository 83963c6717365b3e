"""The :class:`LinearOperator` interface, its checks and (de)serialisation.

An operator is a square ``n x n`` matrix known through its structure. It
multiplies a vector ``x`` of shape ``[n]`` or a batch of ``k`` vectors given
as the columns of ``X`` of shape ``[n, k]``, and returns the same shape.
Scalars (``trace``, ``det``, ``logdet``, ``frobenius_norm``) are 0-dim
tensors in the operator's dtype and device.

Determinants of possibly indefinite matrices go through :meth:`slogdet`
(sign and ``log |det|``): ``logdet()`` is ``log det`` where ``det > 0``,
``-inf`` where ``det == 0`` and ``nan`` where ``det < 0`` (as
:func:`torch.logdet`).

Serialisation: :meth:`LinearOperator.state_dict` is a nested plain dict
(``{"type": class name, "version": 1, ...tensors, lists, nested dicts}``);
:meth:`LinearOperator.from_state_dict` rebuilds any registered operator from
it; :meth:`LinearOperator.save` / :func:`load` write and read that dict with
``torch.save`` / ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["LinearOperator", "load", "check_damping", "STRATEGIES"]

#: Damping strategies of :meth:`LinearOperator.inverse`.
STRATEGIES = ("exact", "heuristic")

_REGISTRY: dict[str, type] = {}
_VERSION = 1


def check_damping(damping: float, strategy: str, owner: str) -> float:
    """Validate ``damping >= 0`` and a known ``strategy``; returns ``float(damping)``."""
    if isinstance(damping, torch.Tensor):
        damping = float(damping)
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not damping >= 0:
        raise ValueError(
            f"{owner}.inverse(damping={damping!r}): damping must be a float >= 0 "
            "(the inverse is of A + damping * I)"
        )
    if strategy not in STRATEGIES:
        raise ValueError(f"{owner}.inverse(strategy={strategy!r}): unknown strategy; choose one of {list(STRATEGIES)}")
    return float(damping)


class LinearOperator:
    """Base class of the square operators (see the module docstring).

    Subclasses set ``_size`` (``n``), ``_dtype``, ``_device`` and implement
    :meth:`_matmat` (``[n, k] -> [n, k]``), :meth:`transpose`,
    :meth:`trace`, :meth:`slogdet`, :meth:`frobenius_norm`,
    :meth:`eigenvalues`, :meth:`inverse`, :meth:`to_dense`,
    :meth:`_state` and :meth:`_from_state`.

    Example:
        >>> A = KroneckerProduct([torch.eye(2), 2 * torch.eye(3)])
        >>> (A @ torch.ones(6)).tolist(), float(A.trace())
        ([2.0, 2.0, 2.0, 2.0, 2.0, 2.0], 12.0)
    """

    _size: int
    _dtype: torch.dtype
    _device: torch.device

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

    # ------------------------------------------------------------------ shape
    @property
    def shape(self) -> tuple[int, int]:
        return (self._size, self._size)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"

    # --------------------------------------------------------------- products
    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, LinearOperator):
            raise TypeError(
                f"{type(self).__name__} @ {type(x).__name__}: products of operators are not supported; "
                "multiply with a tensor [n] or [n, k] (or call .to_dense())"
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__} @ x needs a torch.Tensor, got {type(x).__name__}")
        n = self._size
        if x.dim() not in (1, 2) or x.shape[0] != n:
            raise ValueError(
                f"{type(self).__name__} of shape ({n}, {n}) cannot multiply a tensor of shape "
                f"{list(x.shape)}: expected a vector of size {n} or a matrix [{n}, k] holding k vectors as columns"
            )
        if x.dtype != self._dtype:
            raise ValueError(
                f"{type(self).__name__} has dtype {self._dtype} but the vector has dtype {x.dtype}; "
                f"convert one of them (x.to({self._dtype}) or op.to({x.dtype}))"
            )
        if x.device != self._device:
            raise ValueError(
                f"{type(self).__name__} is on {self._device} but the vector is on {x.device}; move one of them "
                f"(x.to({str(self._device)!r}) or op.to({str(x.device)!r}))"
            )
        if x.dim() == 1:
            return self._matmat(x.unsqueeze(1)).squeeze(1)
        return self._matmat(x)

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ op`` for rows: ``x [n]`` or ``[k, n]`` (``k`` vectors as rows), i.e. ``(op.T @ x.T).T``."""
        if not isinstance(x, torch.Tensor):
            return NotImplemented
        if x.dim() == 2:
            return (self.T @ x.T).T
        return self.T @ x

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``self @ x`` (a vector ``[n]`` or columns ``[n, k]``)."""
        return self @ x

    def _matmat(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def T(self) -> LinearOperator:
        """The transposed operator (``self`` for symmetric operators)."""
        return self.transpose()

    def transpose(self) -> LinearOperator:
        raise NotImplementedError

    # --------------------------------------------------------------- scalars
    def trace(self) -> torch.Tensor:
        raise NotImplementedError

    def slogdet(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sign, log |det|)`` as 0-dim tensors (sign 0 and ``-inf`` for a singular operator)."""
        raise NotImplementedError

    def det(self) -> torch.Tensor:
        sign, logabs = self.slogdet()
        return sign * torch.exp(logabs)

    def logdet(self) -> torch.Tensor:
        """``log det``: ``-inf`` for a singular and ``nan`` for a negative determinant (as :func:`torch.logdet`)."""
        sign, logabs = self.slogdet()
        nan = torch.full_like(logabs, float("nan"))
        return torch.where(sign > 0, logabs, torch.where(sign < 0, nan, torch.full_like(logabs, -float("inf"))))

    def frobenius_norm(self) -> torch.Tensor:
        raise NotImplementedError

    def eigenvalues(self) -> torch.Tensor:
        """All eigenvalues, ascending (symmetric operators)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- others
    def inverse(self, damping: float = 0.0, strategy: str = "exact") -> LinearOperator:
        """An operator for ``(self + damping I)^{-1}`` (see each class for the strategies)."""
        raise NotImplementedError

    def to_dense(self) -> torch.Tensor:
        raise NotImplementedError

    def to(self, *args, **kwargs) -> LinearOperator:
        """A copy with every tensor moved/converted by ``tensor.to(*args, **kwargs)``."""
        probe = torch.empty(0, dtype=self._dtype, device=self._device).to(*args, **kwargs)

        def convert(tensor: torch.Tensor) -> torch.Tensor:  # index tensors keep their integer dtype
            if tensor.is_floating_point():
                return tensor.to(device=probe.device, dtype=probe.dtype)
            return tensor.to(device=probe.device)

        return LinearOperator.from_state_dict(_map_tensors(self.state_dict(), convert))

    # ---------------------------------------------------------- serialisation
    def state_dict(self) -> dict:
        """A nested plain dict of tensors, lists and strings (``weights_only`` safe)."""
        state = self._state()
        state["type"] = type(self).__name__
        state["version"] = _VERSION
        return state

    def _state(self) -> dict:
        raise NotImplementedError

    @classmethod
    def _from_state(cls, state: dict) -> LinearOperator:
        raise NotImplementedError

    @staticmethod
    def from_state_dict(state: dict) -> LinearOperator:
        """Rebuild an operator from :meth:`state_dict` (any registered type)."""
        if not isinstance(state, dict) or "type" not in state:
            raise ValueError(
                "LinearOperator.from_state_dict needs the dict written by op.state_dict() "
                f"(with a 'type' entry), got {type(state).__name__}"
            )
        if state.get("version") != _VERSION:
            raise ValueError(f"operator state of version {state.get('version')!r}; this version reads {_VERSION}")
        kind = state["type"]
        if kind not in _REGISTRY:
            raise ValueError(f"unknown operator type {kind!r} in the state dict; known: {sorted(_REGISTRY)}")
        return _REGISTRY[kind]._from_state(state)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` with ``torch.save``; read it back with :func:`load`."""
        torch.save(self.state_dict(), path)

    @staticmethod
    def load(path: str | os.PathLike, map_location: Any = None) -> LinearOperator:
        """Read an operator written by :meth:`save` (``torch.load(weights_only=True)``)."""
        return load(path, map_location=map_location)


def load(path: str | os.PathLike, map_location: Any = None) -> LinearOperator:
    """Read an operator written by :meth:`LinearOperator.save` (``torch.load(weights_only=True)``)."""
    return LinearOperator.from_state_dict(torch.load(path, map_location=map_location, weights_only=True))


def _map_tensors(state: Any, function) -> Any:
    if isinstance(state, torch.Tensor):
        return function(state)
    if isinstance(state, dict):
        return {key: _map_tensors(value, function) for key, value in state.items()}
    if isinstance(state, list):
        return [_map_tensors(value, function) for value in state]
    return state


def check_square(matrix: torch.Tensor, what: str) -> None:
    if not isinstance(matrix, torch.Tensor) or matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        shape = list(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix).__name__
        raise ValueError(f"{what} must be a square matrix (2-D tensor [n, n]), got {shape}")


def is_symmetric(matrix: torch.Tensor) -> bool:
    """Whether ``matrix`` equals its transpose up to ``1000 eps`` of its largest entry (summation-order noise)."""
    scale = matrix.abs().max() if matrix.numel() else torch.zeros((), dtype=matrix.dtype)
    tol = 1000 * torch.finfo(matrix.dtype).eps * max(float(scale), 1e-300) if matrix.is_floating_point() else 0
    return bool((matrix - matrix.T).abs().max() <= tol) if matrix.numel() else True


def scalar(value: float, like: LinearOperator) -> torch.Tensor:
    return torch.tensor(value, dtype=like.dtype, device=like.device)
