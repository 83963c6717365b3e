"""How often Cockpit's power iteration stops far from the eigenvalue it targets (``HessMaxEV(accelerate=False)``).

Dense float64 Hessians of six small models (cross-entropy and MSE; tanh, ReLU, softplus, GELU with LayerNorm,
sigmoid, a GroupNorm CNN) at their initialisation, 12 seeds each, 5 ``U[0, 1)`` starts per Hessian: the stops of
Cockpit's rule (two consecutive Rayleigh quotients within ``1e-3`` relative), their error against the
eigenvalue of largest magnitude, and whether the last iterate's residual ``||H u - lambda u||`` would have told
the bad stops apart (it does not: the reason ``converged`` is False for every step of the plain power iteration).

    OMP_NUM_THREADS=1 python -m benchmarks.power_iteration_claims
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from cockpit_like.functional.eigen import power_iteration


class GroupNormCNN(nn.Module):
    """A small CNN whose Hessian's two ends nearly tie in magnitude (Cockpit's rule stops far off there)."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


def _models():
    """(name, model, input shape, loss) — float64 (the default dtype is set by the caller)."""
    yield "mlp_tanh", nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), (8, 6), "ce"
    yield "mlp_relu", nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3)), (8, 6), "ce"
    yield "groupnorm_cnn", GroupNormCNN(), (4, 1, 5, 5), "ce"
    yield "mse_softplus", nn.Sequential(nn.Linear(5, 7), nn.Softplus(), nn.Linear(7, 2)), (10, 5), "mse"
    yield "layernorm_gelu", nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4)), (6, 5), "ce"
    yield "deep_sigmoid", nn.Sequential(nn.Linear(4, 6), nn.Sigmoid(), nn.Linear(6, 6), nn.Sigmoid(),
                                        nn.Linear(6, 3)), (8, 4), "ce"  # fmt: skip


def _dense_hessian(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]

    def loss(flat):
        params = {n: v.view(s) for n, v, s in zip(names, torch.split(flat, sizes), shapes)}
        out = functional_call(model, params, (inputs,))
        return F.cross_entropy(out, targets) if kind == "ce" else F.mse_loss(out, targets)

    return torch.autograd.functional.hessian(loss, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def measure(seeds: int = 12, starts: int = 5) -> list[tuple[str, float, float, bool]]:
    """Per stop of Cockpit's rule: (model, error relative to |lambda|, residual relative to |value|, stopped)."""
    rows = []
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for seed in range(seeds):
            for name, model, shape, kind in _models():
                torch.manual_seed(seed)
                for module in model.modules():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
                inputs = torch.randn(*shape)
                targets = torch.randint(0, 3, (shape[0],)) if kind == "ce" else torch.randn(shape[0], 2)
                hessian = _dense_hessian(model, inputs, targets, kind)
                eigenvalues = torch.linalg.eigvalsh(hessian)
                target = float(eigenvalues[eigenvalues.abs().argmax()])
                draws = torch.Generator().manual_seed(1000 + seed)
                for _ in range(starts):
                    result = power_iteration(lambda v: hessian @ v, torch.rand(hessian.shape[0], generator=draws),
                                             max_iter=100, warn=False)  # fmt: skip
                    rows.append((name, abs(result.value - target) / abs(target),
                                 result.residual / abs(result.value), result.converged))  # fmt: skip
    finally:
        torch.set_default_dtype(default)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args(argv)
    rows = [row for row in measure(args.seeds, args.starts) if row[3]]
    print(f"stops of Cockpit's rule: {len(rows)}; more than 1% off: {sum(r[1] > 0.01 for r in rows)}; "
          f"more than 10% off: {sum(r[1] > 0.1 for r in rows)}; largest error {max(r[1] for r in rows):.1%}")
    print("| residual / |value| at most | stops kept | of them > 1% off | stops set apart | of them > 1% off |")
    print("|---|---|---|---|---|")
    for limit in (0.01, 0.03, 0.1, 0.2):
        kept = [r for r in rows if r[2] <= limit]
        apart = [r for r in rows if r[2] > limit]
        print(f"| {limit:g} | {len(kept)} | {sum(r[1] > 0.01 for r in kept)} | {len(apart)} | "
              f"{sum(r[1] > 0.01 for r in apart)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
