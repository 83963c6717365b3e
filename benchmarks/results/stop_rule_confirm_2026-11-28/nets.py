"""Six+ small real networks (float64), dense reference Hessian of the mean loss. usage: python nets.py [name|all] nseeds steps"""
import sys, json, collections
import torch, numpy as np
import torch.nn as nn, torch.nn.functional as F
import harness
from harness import run, check, make_quantities, EVERY
from small import summarize
from cockpit_like.quantities import HessEigenvalues
def mq(trace=True):
    qs = make_quantities(trace)
    qs["EV_p1_1e-2"] = HessEigenvalues(EVERY, probes=1)
    qs["EV_warm_1e-2"] = HessEigenvalues(EVERY, warm_start=True)
    return qs
harness.make_quantities = mq

class TiedCNN(nn.Module):  # same 3x3 conv applied twice (weight tying), 1 channel
    def __init__(s):
        super().__init__(); s.c = nn.Conv2d(2, 2, 3, padding=1); s.l = nn.Linear(2 * 6 * 6, 3)
    def forward(s, x):
        y = x[:, -1].long(); z = x[:, :72].reshape(-1, 2, 6, 6)
        z = torch.tanh(s.c(torch.tanh(s.c(z))))
        return F.cross_entropy(s.l(z.flatten(1)), y, reduction="none")
class Siamese(nn.Module):
    def __init__(s):
        super().__init__(); s.f = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    def forward(s, x):
        a, b, t = x[:, :5], x[:, 5:10], x[:, 10]
        d = ((s.f(a) - s.f(b)) ** 2).sum(1)
        return (d - t) ** 2
class DupUnits(nn.Module):  # hidden units 0 and 1 identical (in and out weights): symmetric case
    def __init__(s):
        super().__init__(); s.l1 = nn.Linear(4, 5); s.l2 = nn.Linear(5, 3)
        with torch.no_grad():
            s.l1.weight[1] = s.l1.weight[0]; s.l1.bias[1] = s.l1.bias[0]; s.l2.weight[:, 1] = s.l2.weight[:, 0]
    def forward(s, x):
        y = x[:, -1].long()
        return F.cross_entropy(s.l2(torch.tanh(s.l1(x[:, :4]))), y, reduction="none")
class DupUnitsMSE(nn.Module):  # 3 identical hidden units, sigmoid, MSE
    def __init__(s):
        super().__init__(); s.l1 = nn.Linear(3, 4); s.l2 = nn.Linear(4, 1)
        with torch.no_grad():
            for k in (1, 2):
                s.l1.weight[k] = s.l1.weight[0]; s.l1.bias[k] = s.l1.bias[0]; s.l2.weight[:, k] = s.l2.weight[:, 0]
    def forward(s, x):
        return (s.l2(torch.sigmoid(s.l1(x[:, :3])))[:, 0] - x[:, 3]) ** 2
class EmbedPool(nn.Module):
    def __init__(s):
        super().__init__(); s.e = nn.Embedding(7, 4); s.l = nn.Linear(4, 3)
    def forward(s, x):
        tok = (x[:, :5].abs() * 3).long().clamp(max=6); y = x[:, -1].long()
        return F.cross_entropy(s.l(s.e(tok).mean(1)), y, reduction="none")
class TinyGRU(nn.Module):
    def __init__(s):
        super().__init__(); s.g = nn.GRU(2, 3, batch_first=True); s.l = nn.Linear(3, 2)
    def forward(s, x):
        y = x[:, -1].long(); z = x[:, :8].reshape(-1, 4, 2)
        o, h = s.g(z)
        return F.cross_entropy(s.l(h[0]), y, reduction="none")
class PolyReg(nn.Module):
    def __init__(s):
        super().__init__(); s.w = nn.Parameter(torch.zeros(5)); s.b = nn.Parameter(torch.zeros(1))
    def forward(s, x):
        t = x[:, 0]; feats = torch.stack([t ** k for k in range(1, 6)], 1)
        return (feats @ s.w + s.b - x[:, 1]) ** 2
class DeepLinearScalar(nn.Module):  # w3*w2*w1*x: saddle at 0-like structure, permutation symmetry
    def __init__(s):
        super().__init__(); s.a = nn.Linear(3, 2, bias=False); s.b = nn.Linear(2, 2, bias=False); s.c = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            s.a.weight.mul_(0.1); s.b.weight.mul_(0.1); s.c.weight.mul_(0.1)
    def forward(s, x):
        return (s.c(s.b(s.a(x[:, :3])))[:, 0] - x[:, 3]) ** 2

NETS = {
    "tied_cnn": (TiedCNN, lambda g, B: torch.cat([torch.randn(B, 72, generator=g), torch.randint(0, 3, (B, 1), generator=g).double()], 1)),
    "siamese": (Siamese, lambda g, B: torch.cat([torch.randn(B, 10, generator=g), torch.rand(B, 1, generator=g) * 3], 1)),
    "dup_units": (DupUnits, lambda g, B: torch.cat([torch.randn(B, 4, generator=g), torch.randint(0, 3, (B, 1), generator=g).double()], 1)),
    "dup_units3_mse": (DupUnitsMSE, lambda g, B: torch.randn(B, 4, generator=g)),
    "embed_pool": (EmbedPool, lambda g, B: torch.cat([torch.randn(B, 5, generator=g), torch.randint(0, 3, (B, 1), generator=g).double()], 1)),
    "tiny_gru": (TinyGRU, lambda g, B: torch.cat([torch.randn(B, 8, generator=g), torch.randint(0, 2, (B, 1), generator=g).double()], 1)),
    "poly_reg": (PolyReg, lambda g, B: (lambda t: torch.stack([t, torch.sin(3 * t)], 1))(torch.rand(B, generator=g) * 2 - 1)),
    "deep_linear": (DeepLinearScalar, lambda g, B: torch.randn(B, 4, generator=g)),
}

def main():
    which = sys.argv[1]; nseeds = int(sys.argv[2]); steps = int(sys.argv[3])
    recs = []
    for name, (cls, mk) in NETS.items():
        if which != "all" and which != name: continue
        for seed in range(nseeds):
            torch.manual_seed(100)
            model = cls().double()
            g = torch.Generator().manual_seed(seed)
            data = [mk(g, 8).double() for _ in range(steps)]
            cp, qs, refs = run(model, data, steps, seed, lr=0.1)
            recs += check(cp, qs, refs, torch.float64, f"{name}/64/seed{seed}")
    json.dump(recs, open(f"recs_nets_{which}.json", "w"), default=float)
    summarize(recs)
    c = collections.defaultdict(collections.Counter)
    for r in recs:
        if r["status"] != "trace": c[r["tag"].split("/")[0]][(r["q"], r["status"])] += 1
    for k in c: print("SETUP", k, {a: b for a, b in c[k].items() if a[1] != "conv_in"}, "conv_in", sum(b for a, b in c[k].items() if a[1] == "conv_in"))
if __name__ == "__main__":
    main()
