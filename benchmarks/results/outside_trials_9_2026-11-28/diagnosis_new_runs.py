import torch, torch.nn as nn, torch.nn.functional as F, warnings, numpy as np, sys
from sklearn.datasets import load_wine, load_breast_cancer
from cockpit_like import Cockpit
from cockpit_like.utils.configuration import configuration
from cockpit_like.diagnosis import group_findings
warnings.simplefilter("ignore")
def data(name):
    d = load_wine() if name == "wine" else load_breast_cancer()
    X = torch.tensor(d.data, dtype=torch.float32); X = (X - X.mean(0)) / X.std(0); y = torch.tensor(d.target)
    return X, y
def run(tag, name, hidden, opt_fn, sched_fn, steps, lr_scale=1.0, shuffle=False, seed=0):
    torch.manual_seed(seed); X, y = data(name); C = int(y.max()) + 1
    if shuffle: y = y[torch.randperm(len(y))]
    m = nn.Sequential(nn.Linear(X.shape[1], hidden), nn.Tanh(), nn.Linear(hidden, C)) if hidden else nn.Linear(X.shape[1], C)
    opt = opt_fn(m.parameters()); sched = sched_fn(opt) if sched_fn else None
    ck = Cockpit(m.parameters(), quantities=configuration("economy"), model=m, diagnose=True)
    g = torch.Generator().manual_seed(seed); losses_seen = []
    for s in range(steps):
        idx = torch.randint(0, len(y), (16,), generator=g); x, t = X[idx], y[idx]
        opt.zero_grad(); ls = F.cross_entropy(m(x), t, reduction="none"); loss = ls.mean()
        with ck(s, info={"batch_size": 16, "individual_losses": ls, "loss": loss, "optimizer": opt}):
            loss.backward()
        opt.step(); sched and sched.step(); losses_seen.append(float(loss))
    inc = [(i.cause, i.severity, i.step, i.found_at) for i in group_findings(ck.findings) if i.severity != "info"]
    print(f"{tag:38s} loss {np.median(losses_seen[:5]):.3f} -> {np.median(losses_seen[-10:]):.3f} | {inc}")
SEED = int(sys.argv[1]) if len(sys.argv) > 1 else 0
run1 = lambda *a, **k: run(*a, seed=SEED, **k)
warm = lambda w: (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / w)))
run1("healthy wine MLP Adam warm-up 50", "wine", 16, lambda p: torch.optim.Adam(p, 3e-3), warm(50), 150)
run1("healthy cancer logreg SGD 1.0", "cancer", 0, lambda p: torch.optim.SGD(p, 1.0), None, 120)
run1("healthy wine MLP SGD one-cycle", "wine", 16, lambda p: torch.optim.SGD(p, 0.3, momentum=0.9), lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.3, total_steps=150), 150)
run1("BROKEN shuffled wine Adam warm-up 30", "wine", 32, lambda p: torch.optim.Adam(p, 3e-3), warm(30), 200, shuffle=True)
run1("BROKEN lr tiny wine Adam warm-up", "wine", 16, lambda p: torch.optim.Adam(p, 3e-7), warm(20), 150)
run1("BROKEN lr huge cancer MLP SGD", "cancer", 16, lambda p: torch.optim.SGD(p, 50.0), None, 100)
