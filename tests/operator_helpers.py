"""Small float64 inputs shared by the operator, KFAC/EK-FAC and ihvp tests (seeded, no global RNG)."""

from __future__ import annotations

import torch

DT = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def spd(n: int, seed: int) -> torch.Tensor:
    """A random symmetric positive definite ``[n, n]`` matrix (a curvature factor)."""
    m = torch.randn(n, n + 1, dtype=DT, generator=gen(seed))
    return m @ m.T / (n + 1) + 0.05 * torch.eye(n, dtype=DT)


def orthogonal(n: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, dtype=DT, generator=gen(seed)))[0]


def param(*shape: int, seed: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, dtype=DT, generator=gen(seed)))
