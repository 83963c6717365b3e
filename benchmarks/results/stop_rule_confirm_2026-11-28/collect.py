"""Dense Hessians of trial 11's 8 nets (20 seeds x 3 steps, SGD lr 0.1) -> hess_nets.pt"""
import os, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nets, harness
out = []
for name, (cls, mk) in nets.NETS.items():
    for seed in range(20):
        torch.manual_seed(100)
        model = cls().double()
        g = torch.Generator().manual_seed(seed)
        data = [mk(g, 8).double() for _ in range(3)]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            H = torch.as_tensor(harness.exact_hessian(model, data[step]))
            out.append((f"{name}/{seed}/{step}", 0.5 * (H + H.T)))
            opt.zero_grad(); model(data[step]).mean().backward(); opt.step()
torch.save(out, "hess_nets.pt")
print(len(out), sorted(set(h.shape[0] for _, h in out)))
