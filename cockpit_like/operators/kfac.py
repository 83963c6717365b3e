"""Model-level KFAC and EK-FAC operators: the one place for parameter order and weight/bias grouping.

A :class:`LayerCurvature` record holds one layer's Kronecker factors: the
input-side factor ``A [in, in]`` and the output-gradient factor
``G [out, out]`` of a weight ``W [out, *rest]`` with ``in = prod(rest)``
(``nn.Linear``: ``[out, in]``; ``nn.Conv2d``: ``[out, C_in, kh, kw]`` read as
``[out, C_in*kh*kw]``). Layout convention: ``W.flatten()`` is row-major
(``vec`` index ``o * in + i``), so the weight block is ``G ⊗ A``.

Bias, two groupings:

- separate (default, as curvlinops' ``separate_weight_and_bias=True``): the
  weight block ``G ⊗ A`` and a bias block ``G``;
- joined (``join_bias=True``): one block ``G ⊗ Ā`` over ``[W | b]``, with the
  augmented input factor ``Ā [in+1, in+1]`` (inputs with a constant 1
  appended, last row/column); in the parameter vector the block's entries are
  ``[vec W, b]`` (or ``[b, vec W]``, following ``params``), re-ordered by a
  :class:`~cockpit_like.operators.Permuted`. The weight and bias must then be
  adjacent in ``params``.

:func:`kfac_operator` / :func:`ekfac_operator` return a
:class:`~cockpit_like.operators.BlockDiagonal` whose blocks follow the
``params`` list (the cockpit's parameter order), named
``"<layer>.weight"`` / ``"<layer>.bias"`` (a joined block: ``"<layer>"``).
A parameter that no layer covers is an error unless ``missing="identity"``
(an ``I`` block) or ``missing="zero"`` (a ``0`` block; invert it with
damping) is asked for.

EK-FAC: the eigenbasis ``Q_G ⊗ Q_A`` of the factors
(:meth:`LayerCurvature.eigenbasis`) with the corrected eigenvalues
``eigenvalues [out, in]`` (:func:`cockpit_like.functional.ekfac.ekfac_eigenvalues`,
or :meth:`LayerCurvature.correct_eigenvalues`), a full vector, not a Kronecker
product; the bias block is ``Q_G diag(bias_eigenvalues) Q_Gᵀ``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cockpit_like.functional.ekfac import ekfac_eigenvalues, ekfac_eigenvalues_sequence
from cockpit_like.operators.base import LinearOperator
from cockpit_like.operators.block_diagonal import BlockDiagonal, Permuted, ScaledIdentity
from cockpit_like.operators.eigh import Eigh
from cockpit_like.operators.kronecker import KroneckerProduct

__all__ = ["LayerCurvature", "kfac_operator", "ekfac_operator", "MISSING"]

#: What :func:`kfac_operator` does with a parameter no layer covers.
MISSING = ("error", "identity", "zero")


@dataclass(eq=False, repr=False)
class LayerCurvature:
    """One layer's Kronecker factors (and, for EK-FAC, its corrected eigenvalues).

    Attributes:
        name: the layer's name (e.g. ``"fc1"``); blocks are named after it.
        weight: the weight parameter (matched by identity against ``params``),
            shape ``[out, *rest]``.
        A: input-side factor ``[in, in]`` (``[in+1, in+1]`` when ``join_bias``).
        G: output-gradient factor ``[out, out]``.
        bias: the bias parameter ``[out]`` or ``None``.
        join_bias: one block ``G ⊗ Ā`` for weight and bias (module docstring).
        eigenvalues: EK-FAC's corrected eigenvalues ``[out, in]`` (or flat
            ``[out * in]``; ``in + 1`` columns when joined), in the basis
            ``eigvecs_G ⊗ eigvecs_A``.
        bias_eigenvalues: EK-FAC's corrected eigenvalues of the separate bias
            block ``[out]``, in the basis ``eigvecs_G``.
        eigvecs_G, eigvecs_A: the eigenbasis (computed by :meth:`eigenbasis`
            from ``G`` and ``A`` when not given).
    """

    name: str
    weight: torch.Tensor
    A: torch.Tensor
    G: torch.Tensor
    bias: torch.Tensor | None = None
    join_bias: bool = False
    eigenvalues: torch.Tensor | None = None
    bias_eigenvalues: torch.Tensor | None = None
    eigvecs_G: torch.Tensor | None = None
    eigvecs_A: torch.Tensor | None = None

    def __post_init__(self):
        where = f"LayerCurvature {self.name!r}"
        if not isinstance(self.weight, torch.Tensor) or self.weight.dim() < 2:
            raise ValueError(f"{where}: weight must be a tensor [out, in] or [out, C, kh, kw]")
        out, inp = self.out_features, self.in_features
        if self.join_bias and self.bias is None:
            raise ValueError(f"{where}: join_bias=True needs a bias")
        if self.bias is not None and tuple(self.bias.shape) != (out,):
            raise ValueError(f"{where}: bias must have shape [{out}], got {list(self.bias.shape)}")
        size_a = inp + 1 if self.join_bias else inp
        augmented = " (the augmented factor: inputs with a 1 appended, as join_bias=True)" if self.join_bias else ""
        for label, factor, n in (("A", self.A, size_a), ("G", self.G, out)):
            if not isinstance(factor, torch.Tensor) or tuple(factor.shape) != (n, n):
                shape = list(factor.shape) if isinstance(factor, torch.Tensor) else type(factor).__name__
                raise ValueError(
                    f"{where}: factor {label} must be [{n}, {n}] for a weight of shape "
                    f"{list(self.weight.shape)}{augmented if label == 'A' else ''}, got {shape}"
                )
        if self.eigenvalues is not None and self.eigenvalues.numel() != out * size_a:
            raise ValueError(
                f"{where}: eigenvalues must have {out} x {size_a} = {out * size_a} entries, "
                f"got shape {list(self.eigenvalues.shape)}"
            )
        if self.bias_eigenvalues is not None and self.bias_eigenvalues.numel() != out:
            shape = list(self.bias_eigenvalues.shape)
            raise ValueError(f"{where}: bias_eigenvalues must have {out} entries, got shape {shape}")

    def __repr__(self) -> str:
        bias = None if self.bias is None else list(self.bias.shape)
        return (
            f"LayerCurvature(name={self.name!r}, weight={list(self.weight.shape)}, bias={bias}, "
            f"A={list(self.A.shape)}, G={list(self.G.shape)}, join_bias={self.join_bias}, "
            f"corrected_eigenvalues={self.eigenvalues is not None})"
        )

    # --------------------------------------------------------------- layout
    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        """``prod(weight.shape[1:])`` (``C_in * kh * kw`` for a convolution), without the bias column."""
        return math.prod(int(s) for s in self.weight.shape[1:])

    @property
    def weight_shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def bias_shape(self) -> tuple[int, ...] | None:
        return None if self.bias is None else tuple(self.bias.shape)

    def parameters(self) -> list[torch.Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    # ---------------------------------------------------------------- EK-FAC
    def eigenbasis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q_G, Q_A)``, from :func:`torch.linalg.eigh` of ``G`` and ``A`` unless given (then kept)."""
        if self.eigvecs_G is None:
            self.eigvecs_G = torch.linalg.eigh(self.G)[1]
        if self.eigvecs_A is None:
            self.eigvecs_A = torch.linalg.eigh(self.A)[1]
        return self.eigvecs_G, self.eigvecs_A

    def correct_eigenvalues(
        self,
        weight_grads: torch.Tensor | None = None,
        bias_grads: torch.Tensor | None = None,
        *,
        b: torch.Tensor | None = None,
        a: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> LayerCurvature:
        """Set :attr:`eigenvalues` (and :attr:`bias_eigenvalues`) from per-sample gradients; returns ``self``.

        Either ``weight_grads [N, *weight.shape]`` (and ``bias_grads [N, out]``
        when there is a bias) or the sequence form ``b [N, T, out]``,
        ``a [N, T, in]`` (the bias gradient is then ``sum_t b_nt``). ``scale``
        as in :func:`~cockpit_like.functional.ekfac.ekfac_eigenvalues`.
        """
        q_g, q_a = self.eigenbasis()
        if (weight_grads is None) == (b is None or a is None):
            raise ValueError(f"LayerCurvature {self.name!r}.correct_eigenvalues: give weight_grads, or b and a")
        if b is not None:
            if b.dim() == 2:
                b, a = b.unsqueeze(1), a.unsqueeze(1)
            if self.join_bias:
                a = torch.cat([a, torch.ones_like(a[..., :1])], dim=-1)
            self.eigenvalues = ekfac_eigenvalues_sequence(b, a, q_g, q_a, scale=scale)
            bias_grads = b.sum(1) if self.bias is not None else None
        else:
            grads = weight_grads.reshape(weight_grads.shape[0], self.out_features, -1)
            if self.join_bias:
                if bias_grads is None:
                    raise ValueError(f"LayerCurvature {self.name!r}: join_bias needs bias_grads")
                grads = torch.cat([grads, bias_grads.unsqueeze(-1)], dim=-1)
            self.eigenvalues = ekfac_eigenvalues(grads, q_g, q_a, scale=scale)
        if self.bias is not None and not self.join_bias:
            if bias_grads is None:
                raise ValueError(f"LayerCurvature {self.name!r} has a bias: pass bias_grads [N, {self.out_features}]")
            one = torch.ones(1, 1, dtype=q_g.dtype, device=q_g.device)
            self.bias_eigenvalues = ekfac_eigenvalues(bias_grads.unsqueeze(-1), q_g, one, scale=scale)[:, 0]
        return self

    # --------------------------------------------------------------- blocks
    def weight_block(self, kind: str) -> LinearOperator:
        """The (weight or joined) block ``G ⊗ A`` (``kind="kfac"``) or its EK-FAC form, in block layout."""
        if kind == "kfac":
            return KroneckerProduct([self.G, self.A])
        q_g, q_a = self._ekfac_basis()
        return Eigh(self.eigenvalues.reshape(-1).to(q_g.dtype), KroneckerProduct([q_g, q_a]))

    def bias_block(self, kind: str) -> LinearOperator:
        if kind == "kfac":
            return KroneckerProduct([self.G])
        q_g, _ = self._ekfac_basis()
        if self.bias_eigenvalues is None:
            raise ValueError(
                f"layer {self.name!r}: ekfac_operator needs bias_eigenvalues for its bias; set them with "
                "correct_eigenvalues(weight_grads, bias_grads) or join the bias (join_bias=True)"
            )
        return Eigh(self.bias_eigenvalues.reshape(-1).to(q_g.dtype), q_g)

    def _ekfac_basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.eigenvalues is None:
            raise ValueError(
                f"layer {self.name!r} has no corrected eigenvalues: compute them with "
                "LayerCurvature.correct_eigenvalues(...) or cockpit_like.functional.ekfac.ekfac_eigenvalues "
                "in the basis LayerCurvature.eigenbasis()"
            )
        if self.eigvecs_G is None or self.eigvecs_A is None:
            raise ValueError(
                f"layer {self.name!r} has corrected eigenvalues but no eigenbasis: set eigvecs_G and eigvecs_A "
                "to the basis they were computed in"
            )
        return self.eigvecs_G, self.eigvecs_A

    def joined_permutation(self, order: Sequence[str]) -> torch.Tensor:
        """Block index of each parameter-vector entry of the joined block; ``order`` of ``"weight"``/``"bias"``."""
        out, inp = self.out_features, self.in_features
        grid = torch.arange(out * (inp + 1), device=self.A.device).reshape(out, inp + 1)
        parts = {"weight": grid[:, :inp].reshape(-1), "bias": grid[:, inp]}
        return torch.cat([parts[role] for role in order])


def _resolve(layers: Sequence[LayerCurvature], params) -> list[tuple[object, LayerCurvature | None, str]]:
    """``[(param or name, layer, role)]`` in the order of ``params`` (``None``: every layer's, in layer order)."""
    if isinstance(layers, LayerCurvature):
        layers = [layers]
    layers = list(layers)
    for layer in layers:
        if not isinstance(layer, LayerCurvature):
            raise TypeError(f"expected LayerCurvature records, got {type(layer).__name__}")
    names = [layer.name for layer in layers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"layer names must be unique, repeated: {repeated}")
    by_id: dict[int, tuple[LayerCurvature, str]] = {}
    by_name: dict[str, tuple[LayerCurvature, str]] = {}
    for layer in layers:
        for role, tensor in (("weight", layer.weight), ("bias", layer.bias)):
            if tensor is None:
                continue
            if id(tensor) in by_id:
                other = by_id[id(tensor)][0].name
                raise ValueError(f"a parameter is covered by two layers, {other!r} and {layer.name!r}")
            by_id[id(tensor)] = (layer, role)
            by_name[f"{layer.name}.{role}"] = (layer, role)
    if params is None:
        roles = ("weight", "bias")
        return [(tensor, layer, role) for layer in layers for role, tensor in zip(roles, layer.parameters())]
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be a list of parameters (or of names like 'fc1.weight'), not one tensor")
    resolved = []
    for param in params:
        if isinstance(param, str):
            if param not in by_name:
                raise KeyError(f"no logged layer has the parameter {param!r}; known: {sorted(by_name)}")
            resolved.append((param, *by_name[param]))
        elif isinstance(param, torch.Tensor):
            resolved.append((param, *by_id.get(id(param), (None, ""))))
        else:
            raise TypeError(f"params entries must be tensors or names, got {type(param).__name__}")
    seen = [id(layer) * 2 + (role == "bias") for _, layer, role in resolved if layer is not None]
    if len(seen) != len(set(seen)):
        raise ValueError("params lists a parameter twice")
    return resolved


def _assemble(layers, params, kind: str, missing: str) -> BlockDiagonal:
    if missing not in MISSING:
        raise ValueError(f"missing={missing!r}: choose one of {list(MISSING)}")
    resolved = _resolve(layers, params)
    if not resolved:
        raise ValueError("no parameters to build an operator for (empty layers or params)")
    blocks, names = [], []
    position = 0
    while position < len(resolved):
        param, layer, role = resolved[position]
        if layer is None:
            if missing == "error":
                raise ValueError(
                    f"parameter #{position} (shape {list(param.shape)}) is not covered by any logged layer; "
                    "log its layer, leave it out of params, or pass missing='identity' (or 'zero')"
                )
            dtype = next(iter(layers)).G.dtype if not isinstance(layers, LayerCurvature) else layers.G.dtype
            blocks.append(ScaledIdentity(param.numel(), 1.0 if missing == "identity" else 0.0, dtype, param.device))
            names.append(f"<uncovered #{position}>")
            position += 1
            continue
        if layer.join_bias:
            partner = resolved[position + 1] if position + 1 < len(resolved) else (None, None, "")
            if partner[1] is not layer:
                raise ValueError(
                    f"layer {layer.name!r} joins weight and bias in one block (join_bias=True): both must be "
                    "in params, next to each other"
                )
            order = [role, partner[2]]
            blocks.append(Permuted(layer.weight_block(kind), layer.joined_permutation(order)))
            names.append(layer.name)
            position += 2
            continue
        blocks.append(layer.weight_block(kind) if role == "weight" else layer.bias_block(kind))
        names.append(f"{layer.name}.{role}")
        position += 1
    dtypes = {}
    for name, block in zip(names, blocks):
        dtypes.setdefault(block.dtype, name)
    if len(dtypes) > 1:  # (outside trial 13: a raw error from BlockDiagonal, an internal operator)
        shown = ", ".join(f"{dtype} ({name} ...)" for dtype, name in dtypes.items())
        raise ValueError(
            f"the KFAC operator's layers have several dtypes: {shown}. Its blocks are inverted and multiplied "
            "together, in one dtype: cast the model's layers to one dtype (a bfloat16 body with a float32 head: "
            "float32 throughout, or autocast), or leave the quantities that need the operator out "
            "(PreconditionedGradNorm)."
        )
    return BlockDiagonal(blocks, names)


def kfac_operator(layers: Sequence[LayerCurvature], params=None, missing: str = "error") -> BlockDiagonal:
    """KFAC of a model: ``diag(G_1 ⊗ A_1, G_1, G_2 ⊗ A_2, ...)`` in the order of ``params``.

    Args:
        layers: :class:`LayerCurvature` records.
        params: the parameters (tensors, matched by identity, or names
            ``"<layer>.weight"``/``"<layer>.bias"``) in the order of the flat
            parameter vector; ``None``: every layer's weight (and bias), in
            layer order. A subset is allowed.
        missing: ``"error"`` (default), ``"identity"`` or ``"zero"`` for a
            parameter no layer covers.

    Example:
        >>> W = torch.zeros(3, 2, dtype=torch.float64)
        >>> layer = LayerCurvature("fc", W, torch.eye(2, dtype=torch.float64), 2 * torch.eye(3, dtype=torch.float64))
        >>> op = kfac_operator([layer], [W])
        >>> op.names, float(op.trace())
        (['fc.weight'], 12.0)
    """
    return _assemble(layers, params, "kfac", missing)


def ekfac_operator(layers: Sequence[LayerCurvature], params=None, missing: str = "error") -> BlockDiagonal:
    """EK-FAC of a model: ``diag((Q_G ⊗ Q_A) diag(λ) (Q_G ⊗ Q_A)ᵀ, Q_G diag(λ_b) Q_Gᵀ, ...)``.

    Same arguments as :func:`kfac_operator`; every layer needs its corrected
    eigenvalues (:meth:`LayerCurvature.correct_eigenvalues`).
    """
    return _assemble(layers, params, "ekfac", missing)
