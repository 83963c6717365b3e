"""Medium models vs scipy eigsh on exact HVPs. usage: python medium.py mlp|cnn nseeds steps dtype"""
import sys, copy, json
import numpy as np
import torch
import scipy.sparse.linalg as sla
from harness import run, check, flat_loss_fn
from small import summarize


class Net(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        if kind == "mlp":
            self.f = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.Tanh(), torch.nn.Linear(40, 30),
                                         torch.nn.Sigmoid(), torch.nn.Linear(30, 5))
        else:
            self.f = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 3), torch.nn.Tanh(), torch.nn.Conv2d(6, 8, 3),
                                         torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))
        self.kind = kind

    def forward(self, xy):
        x, y = xy
        return torch.nn.functional.cross_entropy(self.f(x), y, reduction="none")


def make_ref(cache):
    def ref(model, xy):
        key = len(cache)
        f, flat0 = flat_loss_fn(model, xy if False else None) if False else (None, None)
        m64 = copy.deepcopy(model).double()
        x, y = xy
        x64 = x.double()
        params = [p for p in m64.parameters()]
        loss = m64((x64, y)).mean()
        g = torch.autograd.grad(loss, params, create_graph=True)
        gf = torch.cat([t.reshape(-1) for t in g])
        D = gf.numel()
        def hvp(v):
            v = torch.as_tensor(np.asarray(v).reshape(-1), dtype=torch.float64)
            hv = torch.autograd.grad(gf, params, v, retain_graph=True)
            return torch.cat([t.reshape(-1) for t in hv]).numpy()
        op = sla.LinearOperator((D, D), matvec=hvp, dtype=np.float64)
        la = sla.eigsh(op, k=1, which="LA", tol=1e-10)[0][0]
        sa = sla.eigsh(op, k=1, which="SA", tol=1e-10)[0][0]
        # exact trace from D products (unit vectors), cheap enough at D ~ 1-3e3
        tr = 0.0
        I = np.eye(D)
        for j in range(D):
            tr += hvp(I[j])[j]
        return dict(lmax=la, lmin=sa, trace=tr, D=D)
    return ref


def main():
    kind = sys.argv[1]; nseeds = int(sys.argv[2]); steps = int(sys.argv[3])
    dtype = torch.float64 if sys.argv[4] == "64" else torch.float32
    g = torch.Generator().manual_seed(123)
    if kind == "mlp":
        data = [(torch.randn(32, 20, generator=g).to(dtype), torch.randint(0, 5, (32,), generator=g)) for _ in range(steps)]
    else:
        data = [(torch.randn(16, 1, 8, 8, generator=g).to(dtype), torch.randint(0, 5, (16,), generator=g)) for _ in range(steps)]
    refs_cache = {}
    base = Net(kind).to(dtype)
    print("D", sum(p.numel() for p in base.parameters()), flush=True)
    recs = []
    for seed in range(nseeds):
        model = copy.deepcopy(base)
        step_counter = {"i": 0}
        reff = make_ref({})
        def hess_fn(m, xy):
            i = step_counter["i"]; step_counter["i"] += 1
            if i not in refs_cache:
                refs_cache[i] = reff(m, xy)
                print("ref step", i, refs_cache[i], flush=True)
            return refs_cache[i]
        cp, qs, refs = run(model, data, steps, seed, lr=0.5, hess_fn=hess_fn)
        recs += check(cp, qs, refs, dtype, f"{kind}/{sys.argv[4]}/seed{seed}")
    json.dump(recs, open(f"recs_{kind}_{sys.argv[4]}.json", "w"), default=float)
    summarize(recs)


if __name__ == "__main__":
    main()
