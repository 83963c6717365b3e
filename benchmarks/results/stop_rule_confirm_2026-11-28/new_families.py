import torch, torch.nn as nn, torch.nn.functional as F
from cockpit_like.functional.krylov import lanczos_decomposition
from cockpit_like.backends.curvature_engine import start_vectors
torch.set_default_dtype(torch.float64)
class Attn(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Linear(3, 8); s.att = nn.MultiheadAttention(8, 2, batch_first=True); s.out = nn.Linear(8, 4)
    def forward(s, x):
        h = s.emb(x); a, _ = s.att(h, h, h); return s.out((h + a).mean(1))
FAM = {
 "gelu_ln_mlp": (lambda: nn.Sequential(nn.Linear(10, 24), nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 16), nn.GELU(), nn.Linear(16, 5)), lambda g: torch.randn(24, 10, generator=g)),
 "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 6, 5), nn.ELU(), nn.Conv1d(6, 6, 3), nn.Softplus(), nn.Flatten(), nn.Linear(6 * 10, 5)), lambda g: torch.randn(24, 2, 16, generator=g)),
 "attention": (Attn, lambda g: torch.randn(24, 5, 3, generator=g)),
}
res = {}
for name, (make, data) in FAM.items():
    torch.manual_seed(7); net = make(); g = torch.Generator().manual_seed(11)
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    names, shapes = [n for n, _ in net.named_parameters()], [p.shape for p in net.parameters()]
    for step in range(3):
        x = data(g); y = torch.randint(0, 5, (24,), generator=g) if name != "attention" else torch.randint(0, 4, (24,), generator=g)
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        def loss(v):
            vals = {n: t.reshape(s) for n, t, s in zip(names, v.split([s.numel() for s in shapes]), shapes)}
            return F.cross_entropy(torch.func.functional_call(net, vals, (x,)), y)
        H = torch.func.hessian(loss)(flat); H = 0.5 * (H + H.T); ev = torch.linalg.eigvalsh(H); M = float(ev.abs().max())
        for confirm in (0, None):
            miss = prods = 0
            for d in range(40):
                K = lanczos_decomposition(lambda v: H @ v, start_vectors(2, H.shape[0], torch.float64, "cpu", torch.Generator().manual_seed(d)), max_products=100, rtol=1e-2, confirm=confirm)
                w = K.ritz_values(); prods += K.num_products
                e = max(abs(float(w[0]) - float(ev[0])), abs(float(w[-1]) - float(ev[-1]))) / M; miss += K.converged and e > 1e-2
                if K.converged and e > 1e-2 and confirm is None: print("   miss", name, step, round(100 * e, 2), "%", K.num_products, "bottom" if abs(float(w[0]) - float(ev[0])) > abs(float(w[-1]) - float(ev[-1])) else "top")
            r = res.setdefault((name, confirm), [0, 0, 0]); r[0] += miss; r[1] += 40; r[2] += prods
        opt.zero_grad(); loss_v = F.cross_entropy(net(x), y); loss_v.backward(); opt.step()
    print(name, "D", H.shape[0], {str(c): res[(name, c)] for c in (0, None)}, flush=True)
