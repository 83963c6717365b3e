"""HessMaxEV(rtol=0.1): values stored with converged=True that are further than rtol*max|lambda| from the
eigenvalue of largest magnitude (exact: dense float64 Hessian). Self-contained; prints MISMATCH."""
import os
os.environ["OMP_NUM_THREADS"] = "1"
import warnings; warnings.filterwarnings("ignore")
import torch, torch.nn as nn
from torch.func import functional_call
from cockpit_like import Cockpit
from cockpit_like.quantities import HessMaxEV
from cockpit_like.backends import randomness
torch.set_default_dtype(torch.float64)

class SinReg(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(3, 6); self.l2 = nn.Linear(6, 1)
        with torch.no_grad(): self.l1.weight.mul_(4.0)
    def forward(self, x): return self.l2(torch.sin(self.l1(x)))

def batch(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)

def exact_eigs(model, x, y):
    names = [n for n, _ in model.named_parameters()]; shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    def f(t):
        ps = {n: v.view(s) for n, v, s in zip(names, torch.split(t, sizes), shapes)}
        return ((functional_call(model, ps, (x,)) - y) ** 2).mean()
    th = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return torch.linalg.eigvalsh(torch.autograd.functional.hessian(f, th))

bad = 0; n = 0
for seed in range(15):
    torch.manual_seed(0); model = SinReg(); opt = torch.optim.SGD(model.parameters(), lr=0.05)
    randomness.set_seed(seed)
    q = HessMaxEV(lambda s: True, rtol=0.1)
    ck = Cockpit(model.parameters(), quantities=[q], model=model)
    for step in range(3):
        x, y = batch(step); ev = exact_eigs(model, x, y)
        opt.zero_grad(); out = model(x); losses = ((out - y) ** 2).mean(1); loss = losses.mean()
        with ck(step, info={"batch_size": 5, "individual_losses": losses, "loss": loss, "optimizer": opt}):
            loss.backward(create_graph=ck.create_graph(step))
        opt.step()
        v = ck.get_output()[step]["HessMaxEV"]; scale = ev.abs().max().item()
        target = ev[ev.abs().argmax()].item(); n += 1
        if q.converged[step] and abs(v - target) > 0.1 * scale:
            bad += 1
            near = ev[(ev - v).abs().argmin()].item()
            print(f"MISMATCH seed {seed} step {step}: stored {v:.6g} converged=True after {q.hvp_counts[step]} products; "
                  f"exact eigenvalue of largest magnitude {target:.6g}, error {abs(v-target)/scale:.1%} of max|lambda| > rtol 10%; "
                  f"nearest eigenvalue {near:.6g}; top 3 {ev[-3:].tolist()}")
print(f"{bad} of {n} converged solves outside rtol*max|lambda|" if bad else f"OK 0 of {n}")
