"""Block-diagonal operators (one block per parameter or layer), index permutations and ``c I``.

- :class:`BlockDiagonal` ``diag(B_1, ..., B_m)``: a vector is cut into
  consecutive slices of the blocks' sizes; ``tr = sum tr B_j``,
  ``det = prod det B_j``, ``||·||_F² = sum ||B_j||_F²``, eigenvalues are the
  union of the blocks', and the inverse (damped or not) is block-wise. Blocks
  may carry names (``block(name)``).
- :class:`Permuted` ``P A Pᵀ``, i.e. ``(P A Pᵀ)[i, j] = A[p_i, p_j]``: the
  same operator on re-ordered coordinates; every scalar, the eigenvalues and
  the damped inverse (``P (A + δ I)^{-1} Pᵀ``) carry over. Used for a weight
  and its bias joined in one Kronecker block (``[W | b]`` row-major inside
  the block, ``[vec W, b]`` in the parameter vector).
- :class:`ScaledIdentity` ``c I_n`` (a stand-in block for a parameter without
  curvature, if asked for).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cockpit_like.operators.base import LinearOperator, check_damping

__all__ = ["BlockDiagonal", "Permuted", "ScaledIdentity"]


class BlockDiagonal(LinearOperator):
    """``diag(B_1, ..., B_m)`` of square operators, optionally named.

    Args:
        blocks: the operators, in the order of the vector's slices.
        names: one unique string per block (e.g. ``"fc1.weight"``), or ``None``.

    Example:
        >>> D = BlockDiagonal([KroneckerProduct([torch.eye(2)]), KroneckerProduct([3 * torch.eye(1)])], ["a", "b"])
        >>> (D @ torch.ones(3)).tolist(), float(D.block("b").trace())
        ([1.0, 1.0, 3.0], 3.0)
    """

    def __init__(self, blocks: Sequence[LinearOperator], names: Sequence[str] | None = None):
        blocks = list(blocks)
        if not blocks:
            raise ValueError("BlockDiagonal(blocks) needs at least one block")
        for index, block in enumerate(blocks):
            if not isinstance(block, LinearOperator):
                raise TypeError(
                    f"BlockDiagonal block {index} is a {type(block).__name__}, not a LinearOperator; wrap a "
                    "matrix as KroneckerProduct([matrix])"
                )
            if block.dtype != blocks[0].dtype or block.device != blocks[0].device:
                raise ValueError(
                    f"BlockDiagonal block {index} is {block.dtype} on {block.device}, block 0 "
                    f"{blocks[0].dtype} on {blocks[0].device}; all blocks must share dtype and device"
                )
        if names is not None:
            names = [str(name) for name in names]
            if len(names) != len(blocks):
                raise ValueError(f"BlockDiagonal: {len(names)} names for {len(blocks)} blocks; give one per block")
            duplicates = sorted({name for name in names if names.count(name) > 1})
            if duplicates:
                raise ValueError(f"BlockDiagonal: block names must be unique, repeated: {duplicates}")
        self.blocks = blocks
        self.names = names
        self.sizes = [block.shape[0] for block in blocks]
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self._size = self.offsets[-1]
        self._dtype, self._device = blocks[0].dtype, blocks[0].device

    def block(self, name: str | int) -> LinearOperator:
        """The block called ``name`` (or at position ``name`` if an int)."""
        if isinstance(name, int):
            return self.blocks[name]
        if self.names is None:
            raise KeyError(f"this BlockDiagonal has no block names; index its {len(self.blocks)} blocks by position")
        if name not in self.names:
            parts = [block for block in self.names if block.startswith(f"{name}.")]
            if parts:
                raise KeyError(f"operator has blocks {self.names}; layer {name!r} has the blocks {parts}: ask for one")
            raise KeyError(f"operator has blocks {self.names}; layer {name!r} was not logged")
        return self.blocks[self.names.index(name)]

    def slice(self, name: str | int) -> slice:
        """Where the block ``name`` sits in a vector."""
        if isinstance(name, int):
            index = name
        else:
            self.block(name)  # the error for an unknown name
            index = self.names.index(name)
        return slice(self.offsets[index], self.offsets[index + 1])

    def _matmat(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([block @ x[start:stop] for block, start, stop in self._spans()], dim=0)

    def _spans(self):
        return zip(self.blocks, self.offsets[:-1], self.offsets[1:])

    def transpose(self) -> BlockDiagonal:
        return BlockDiagonal([block.T for block in self.blocks], self.names)

    def trace(self) -> torch.Tensor:
        return torch.stack([block.trace() for block in self.blocks]).sum()

    def frobenius_norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.stack([block.frobenius_norm() for block in self.blocks]))

    def slogdet(self) -> tuple[torch.Tensor, torch.Tensor]:
        signs, logs = zip(*(block.slogdet() for block in self.blocks))
        return torch.stack(signs).prod(), torch.stack(logs).sum()

    def eigenvalues(self) -> torch.Tensor:
        return torch.cat([block.eigenvalues() for block in self.blocks]).sort().values

    def to_dense(self) -> torch.Tensor:
        return torch.block_diag(*(block.to_dense() for block in self.blocks))

    def inverse(self, damping: float = 0.0, strategy: str = "exact") -> BlockDiagonal:
        """Block-wise ``(B_j + damping I)^{-1}`` with each block's ``strategy``; errors name the block."""
        damping = check_damping(damping, strategy, "BlockDiagonal")
        inverses = []
        for index, block in enumerate(self.blocks):
            try:
                inverses.append(block.inverse(damping=damping, strategy=strategy))
            except ValueError as error:
                label = repr(self.names[index]) if self.names else str(index)
                raise ValueError(f"block {label}: {error}") from error
        return BlockDiagonal(inverses, self.names)

    def _state(self) -> dict:
        return {"blocks": [block.state_dict() for block in self.blocks], "names": self.names}

    @classmethod
    def _from_state(cls, state: dict) -> BlockDiagonal:
        return cls([LinearOperator.from_state_dict(block) for block in state["blocks"]], state["names"])


class Permuted(LinearOperator):
    """``P A Pᵀ``: ``A`` on coordinates re-ordered by ``permutation`` (``out[i] = A[p_i, p_j]``).

    Args:
        operator: ``A``.
        permutation: a 1-D integer tensor, a permutation of ``range(n)``;
            ``(P A Pᵀ) x = (A x[q])[p]`` with ``q`` the inverse permutation.
    """

    def __init__(self, operator: LinearOperator, permutation: torch.Tensor):
        if not isinstance(operator, LinearOperator):
            raise TypeError(f"Permuted(operator, ...) needs a LinearOperator, got {type(operator).__name__}")
        permutation = torch.as_tensor(permutation, dtype=torch.long, device=operator.device)
        n = operator.shape[0]
        if permutation.dim() != 1 or permutation.numel() != n or not bool(
            (permutation.sort().values == torch.arange(n, device=operator.device)).all()
        ):
            raise ValueError(f"Permuted: permutation must be a permutation of range({n})")
        self.operator = operator
        self.permutation = permutation
        self.inverse_permutation = torch.argsort(permutation)
        self._size, self._dtype, self._device = n, operator.dtype, operator.device

    def _matmat(self, x: torch.Tensor) -> torch.Tensor:
        return (self.operator @ x[self.inverse_permutation])[self.permutation]

    def transpose(self) -> Permuted:
        return Permuted(self.operator.T, self.permutation)

    def trace(self) -> torch.Tensor:
        return self.operator.trace()

    def frobenius_norm(self) -> torch.Tensor:
        return self.operator.frobenius_norm()

    def slogdet(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.operator.slogdet()

    def eigenvalues(self) -> torch.Tensor:
        return self.operator.eigenvalues()

    def to_dense(self) -> torch.Tensor:
        p = self.permutation
        return self.operator.to_dense()[p][:, p]

    def inverse(self, damping: float = 0.0, strategy: str = "exact") -> Permuted:
        return Permuted(self.operator.inverse(damping=damping, strategy=strategy), self.permutation)

    def _state(self) -> dict:
        return {"operator": self.operator.state_dict(), "permutation": self.permutation}

    @classmethod
    def _from_state(cls, state: dict) -> Permuted:
        return cls(LinearOperator.from_state_dict(state["operator"]), state["permutation"])


class ScaledIdentity(LinearOperator):
    """``scale * I_n``.

    Args:
        size: ``n``.
        scale: the diagonal value (a float).
        dtype, device: of the vectors it multiplies.
    """

    def __init__(self, size: int, scale: float = 1.0, dtype: torch.dtype = torch.float32, device=None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"ScaledIdentity(size={size!r}) needs a positive int")
        self.scale = float(scale)
        self._size, self._dtype = size, dtype
        self._device = torch.device(device) if device is not None else torch.device("cpu")

    def _matmat(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x

    def transpose(self) -> ScaledIdentity:
        return self

    def _scalar(self, value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=self._dtype, device=self._device)

    def trace(self) -> torch.Tensor:
        return self._scalar(self._size * self.scale)

    def frobenius_norm(self) -> torch.Tensor:
        return self._scalar(math.sqrt(self._size) * abs(self.scale))

    def slogdet(self) -> tuple[torch.Tensor, torch.Tensor]:
        sign = 0.0 if self.scale == 0 else math.copysign(1.0, self.scale) ** self._size
        logabs = -math.inf if self.scale == 0 else self._size * math.log(abs(self.scale))
        return self._scalar(sign), self._scalar(logabs)

    def eigenvalues(self) -> torch.Tensor:
        return torch.full((self._size,), self.scale, dtype=self._dtype, device=self._device)

    def to_dense(self) -> torch.Tensor:
        return self.scale * torch.eye(self._size, dtype=self._dtype, device=self._device)

    def inverse(self, damping: float = 0.0, strategy: str = "exact") -> ScaledIdentity:
        damping = check_damping(damping, strategy, "ScaledIdentity")
        if self.scale + damping == 0:
            raise ValueError(
                f"ScaledIdentity.inverse(damping={damping}): {self.scale} * I + damping I is singular; pass damping > 0"
            )
        return ScaledIdentity(self._size, 1.0 / (self.scale + damping), self._dtype, self._device)

    def _state(self) -> dict:
        # the scale as a 0-dim tensor carries the dtype and device (and follows op.to(...))
        return {"size": self._size, "scale": self._scalar(self.scale)}

    @classmethod
    def _from_state(cls, state: dict) -> ScaledIdentity:
        scale = state["scale"]
        return cls(state["size"], float(scale), scale.dtype, scale.device)
