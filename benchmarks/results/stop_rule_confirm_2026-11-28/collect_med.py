import os, sys, copy, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import medium
out = []
for kind, lr in (("mlp", 0.5), ("cnn", 0.5)):
    g = torch.Generator().manual_seed(123)
    if kind == "mlp":
        data = [(torch.randn(32, 20, generator=g).double(), torch.randint(0, 5, (32,), generator=g)) for _ in range(4)]
    else:
        data = [(torch.randn(16, 1, 8, 8, generator=g).double(), torch.randint(0, 5, (16,), generator=g)) for _ in range(4)]
    model = medium.Net(kind).double()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    params = list(model.parameters())
    for step in range(4):
        loss = model(data[step]).mean()
        gr = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params, create_graph=True)])
        D = gr.numel()
        H = torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(gr, params, e, retain_graph=True)]) for e in torch.eye(D, dtype=torch.float64)])
        out.append((f"{kind}/{step}", 0.5 * (H + H.T)))
        opt.zero_grad(); loss.backward(); opt.step()
torch.save(out, "hess_med.pt"); print([(t, h.shape[0]) for t, h in out])
