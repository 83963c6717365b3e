"""EK-FAC's corrected eigenvalues: per-sample gradients rotated into a Kronecker eigenbasis.

For a layer with weight ``W [out, in]`` and per-sample gradients ``g_n [out, in]``
(``n = 1..N``), KFAC's factors ``G ≈ Q_G Λ_G Q_Gᵀ`` and ``A ≈ Q_A Λ_A Q_Aᵀ``
give the eigenbasis ``Q = Q_G ⊗ Q_A`` of ``G ⊗ A``. EK-FAC (George et al.,
2018) keeps that basis and replaces the Kronecker eigenvalues by the
diagonal of the (empirical) Fisher in it:

    λ[o, i] = scale * sum_n (Q_Gᵀ g_n Q_A)[o, i]²,

i.e. ``λ = diag(Qᵀ F Q)`` for ``F = scale * sum_n vec(g_n) vec(g_n)ᵀ``, in the
row-major layout of ``W.flatten()`` (``vec`` index ``o * in + i``).

Normalisation: ``scale=None`` means ``1/N``, the mean over the samples.
With BackPACK-style per-sample gradients of a **mean** loss
(``grad_batch[n] = ∇ℓ_n / B``), the empirical Fisher of the mean loss is
``F = (1/B) sum_n ∇ℓ_n ∇ℓ_nᵀ = B sum_n grad_batch[n] grad_batch[n]ᵀ``: pass
``scale=B``, the normalisation of the curvature statistics' Kronecker
factors (:mod:`cockpit_like.statistics.logs`: ``G = B sum δ δᵀ``,
``A = (1/M) sum x xᵀ``).

Sequence form: when the per-sample gradient is a sum over ``T`` positions,
``g_n = sum_t b_nt a_ntᵀ`` (output gradients ``b [N, T, out]``, inputs
``a [N, T, in]``; a convolution's unfolded patches are its positions), the
rotation is ``Q_Gᵀ g_n Q_A = (b_n Q_G)ᵀ (a_n Q_A)``. For ``T = 1`` the sum of
squares is one product ``((b Q_G)²)ᵀ (a Q_A)²`` and no ``[N, out, in]`` tensor
is formed; for ``T > 1`` the rotated per-sample matrices are formed a chunk
of samples at a time (``chunk_bytes``), never all at once.

A bias (per-sample gradients ``[N, out]``, block ``G``) is the case ``in = 1``:
``ekfac_eigenvalues(grad[:, :, None], Q_G, ones(1, 1))[:, 0]``.

Example:
    >>> g = torch.randn(5, 3, 2, dtype=torch.float64)
    >>> lam = ekfac_eigenvalues(g, torch.eye(3, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    >>> torch.allclose(lam, (g**2).mean(0))
    True
"""

from __future__ import annotations

import torch

__all__ = ["ekfac_eigenvalues", "ekfac_eigenvalues_sequence"]

_CHUNK_BYTES = 16 << 20


def _check_basis(eigvecs_G: torch.Tensor, eigvecs_A: torch.Tensor, out: int, inp: int, what: str) -> None:
    for name, q, n in (("eigvecs_G", eigvecs_G, out), ("eigvecs_A", eigvecs_A, inp)):
        if not isinstance(q, torch.Tensor) or q.dim() != 2 or tuple(q.shape) != (n, n):
            shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"{what}: {name} must be [{n}, {n}] to match the gradients, got {shape}")


def _chunk(per_sample_numel: int, itemsize: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, per_sample_numel * itemsize))


def ekfac_eigenvalues(
    grad_batch: torch.Tensor,
    eigvecs_G: torch.Tensor,
    eigvecs_A: torch.Tensor,
    scale: float | None = None,
    chunk_bytes: int = _CHUNK_BYTES,
) -> torch.Tensor:
    """``scale * sum_n (Q_Gᵀ g_n Q_A)²`` (element-wise square), shape ``[out, in]``.

    Args:
        grad_batch: per-sample gradients ``[N, out, in]`` or ``[N, out, *rest]``
            (a convolution weight ``[N, out, C, kh, kw]`` is read as
            ``[N, out, C*kh*kw]``, as ``weight.flatten()`` orders it).
        eigvecs_G: ``Q_G [out, out]`` (columns: eigenvectors of ``G``).
        eigvecs_A: ``Q_A [in, in]``.
        scale: normalisation (``None``: ``1/N``; see the module docstring).
        chunk_bytes: memory bound of the rotated chunk.
    """
    if not isinstance(grad_batch, torch.Tensor) or grad_batch.dim() < 3:
        shape = list(grad_batch.shape) if isinstance(grad_batch, torch.Tensor) else type(grad_batch).__name__
        raise ValueError(f"ekfac_eigenvalues: grad_batch must be [N, out, in] (per-sample gradients), got {shape}")
    grads = grad_batch.detach().reshape(grad_batch.shape[0], grad_batch.shape[1], -1)
    n, out, inp = grads.shape
    _check_basis(eigvecs_G, eigvecs_A, out, inp, "ekfac_eigenvalues")
    scale = 1.0 / n if scale is None else float(scale)
    total = torch.zeros(out, inp, dtype=grads.dtype, device=grads.device)
    step = _chunk(out * inp, grads.element_size(), chunk_bytes)
    for start in range(0, n, step):
        rotated = eigvecs_G.T @ grads[start : start + step] @ eigvecs_A
        total += (rotated**2).sum(0)
    return scale * total


def ekfac_eigenvalues_sequence(
    b: torch.Tensor,
    a: torch.Tensor,
    eigvecs_G: torch.Tensor,
    eigvecs_A: torch.Tensor,
    scale: float | None = None,
    chunk_bytes: int = _CHUNK_BYTES,
) -> torch.Tensor:
    """The same for ``g_n = sum_t b_nt a_ntᵀ`` from ``b [N, T, out]`` and ``a [N, T, in]``; ``[out, in]``.

    ``b`` and ``a`` may also be ``[N, out]`` / ``[N, in]`` (``T = 1``).
    """
    if b.dim() == 2 and a.dim() == 2:
        b, a = b.unsqueeze(1), a.unsqueeze(1)
    if b.dim() != 3 or a.dim() != 3 or b.shape[:2] != a.shape[:2]:
        raise ValueError(
            "ekfac_eigenvalues_sequence: b must be [N, T, out] and a [N, T, in] with the same N and T, got "
            f"{list(b.shape)} and {list(a.shape)}"
        )
    n, positions, out = b.shape
    inp = a.shape[2]
    _check_basis(eigvecs_G, eigvecs_A, out, inp, "ekfac_eigenvalues_sequence")
    scale = 1.0 / n if scale is None else float(scale)
    u = b.detach() @ eigvecs_G  # rows u_nt = Q_Gᵀ b_nt
    v = a.detach() @ eigvecs_A  # rows v_nt = Q_Aᵀ a_nt
    if positions == 1:
        return scale * ((u[:, 0] ** 2).T @ (v[:, 0] ** 2))
    total = torch.zeros(out, inp, dtype=u.dtype, device=u.device)
    step = _chunk(out * inp, u.element_size(), chunk_bytes)
    for start in range(0, n, step):
        rotated = u[start : start + step].transpose(1, 2) @ v[start : start + step]
        total += (rotated**2).sum(0)
    return scale * total
