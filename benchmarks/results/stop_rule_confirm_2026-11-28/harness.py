"""Black-box harness: Lanczos quantities of cockpit_like vs exact Hessians."""
import copy, json, math, sys
import numpy as np
import torch
from cockpit_like import Cockpit
from cockpit_like.quantities import HessEigenvalues, HessMaxEV, HessTraceEstimate
from cockpit_like.backends import randomness

EVERY = lambda s: True


class QuadModel(torch.nn.Module):
    """l_i = 0.5 th^T A th + b_i^T th (+ optional quartic) ; params split in blocks."""

    def __init__(self, A, dtype, split=None, quartic=0.0, bilinear=None, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(1000 + seed)
        D = A.shape[0]
        self.D = D
        split = split or [D]
        th = torch.randn(D, generator=g, dtype=torch.float64) * 0.5
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(t.clone().to(dtype)) for t in th.split(split)])
        self.register_buffer("A", torch.as_tensor(A, dtype=dtype))
        self.quartic = quartic
        self.bilinear = bilinear  # list of (i,j,coef): adds coef*th_i*th_j*x (x data)

    def theta(self):
        return torch.cat([p.reshape(-1) for p in self.ps])

    def forward(self, x):  # x: [B, D]
        th = self.theta()
        base = 0.5 * th @ self.A @ th
        lin = x @ th
        out = base + lin
        if self.quartic:
            out = out + self.quartic * (th ** 4).sum() * (1 + 0 * x[:, 0])
        if self.bilinear:
            for i, j, c in self.bilinear:
                out = out + c * th[i] * th[j] * x[:, 0]
        return out  # per-sample losses


def flat_loss_fn(model, x):
    m64 = copy.deepcopy(model).double()
    names = [n for n, p in m64.named_parameters()]
    shapes = [p.shape for p in m64.parameters()]
    sizes = [p.numel() for p in m64.parameters()]
    x64 = x.double()

    def f(flat):
        parts = flat.split(sizes)
        params = {n: t.reshape(s) for n, t, s in zip(names, parts, shapes)}
        out = torch.func.functional_call(m64, params, (x64,))
        return out.mean()
    flat0 = torch.cat([p.detach().reshape(-1) for p in m64.parameters()])
    return f, flat0


def exact_hessian(model, x):
    f, flat0 = flat_loss_fn(model, x)
    H = torch.autograd.functional.hessian(f, flat0)
    return H.numpy()


def make_quantities(trace=True):
    qs = {
        "EV_1e-2": HessEigenvalues(EVERY, rtol=1e-2),
        "EV_1e-3": HessEigenvalues(EVERY, rtol=1e-3),
        "MaxEV_pow_1e-2": HessMaxEV(EVERY),
        "MaxEV_la_1e-2": HessMaxEV(EVERY, use_power=False),
        "MaxEV_pow_1e-3": HessMaxEV(EVERY, rtol=1e-3),
        "MaxEV_la_1e-3": HessMaxEV(EVERY, use_power=False, rtol=1e-3),
    }
    if trace:
        qs["TrE_hpp"] = HessTraceEstimate(EVERY)
        qs["TrE_hut"] = HessTraceEstimate(EVERY, method="hutchinson")
    return qs


def run(model, data, steps, seed, lr=0.05, hess_fn=exact_hessian, use_cockpit=True,
        trace=True, dropout_probe=False):
    randomness.set_seed(seed)
    qs = make_quantities(trace) if use_cockpit else {}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cp = Cockpit(list(model.parameters()), quantities=list(qs.values()), model=model) if use_cockpit else None
    refs = []
    for step in range(steps):
        x = data[step]
        if use_cockpit:
            refs.append(hess_fn(model, x))
        opt.zero_grad()
        li = model(x)
        loss = li.mean()
        info = {"batch_size": li.shape[0], "individual_losses": li, "loss": loss, "optimizer": opt}
        if use_cockpit:
            with cp(step, info=info):
                loss.backward(create_graph=cp.create_graph(step))
        else:
            loss.backward()
        opt.step()
    return cp, qs, refs


def check(cp, qs, refs, dtype, tag):
    """returns list of records."""
    out = cp.get_output()
    recs = []
    slack = 2e-5 if dtype == torch.float32 else 1e-10
    for step, ref in enumerate(refs):
        if isinstance(ref, dict):
            lmax, lmin, tr = ref["lmax"], ref["lmin"], ref["trace"]
        else:
            ev = np.linalg.eigvalsh(0.5 * (ref + ref.T))
            lmax, lmin, tr = ev[-1], ev[0], np.trace(ref)
        M = max(abs(lmax), abs(lmin))
        for key, q in qs.items():
            name = cp.name_of(q)
            val = out.get(step, {}).get(name, None)
            conv = q.converged.get(step, None) if hasattr(q, "converged") else None
            rec = dict(tag=tag, step=step, q=key, lmax=lmax, lmin=lmin, val=val, conv=conv,
                       products=q.hvp_counts.get(step) if hasattr(q, "hvp_counts") else None)
            if key.startswith("TrE"):
                if val is None:
                    rec["status"] = "missing"
                else:
                    se = val["standard_error"]
                    z = abs(val["trace"] - tr) / se if se > 0 else (0.0 if abs(val["trace"] - tr) <= 1e-12 * (1 + abs(tr)) else math.inf)
                    rec.update(trace=tr, est=val["trace"], se=se, z=z, status="trace")
                recs.append(rec)
                continue
            rtol = 1e-3 if "1e-3" in key else 1e-2
            tol = rtol * M + slack * max(M, 1e-30) + (1e-12 if M == 0 else 0)
            if val is None:
                rec["status"] = "missing"
                recs.append(rec)
                continue
            if key.startswith("EV"):
                conv = val["converged"]
                errs = [abs(val["largest"] - lmax), abs(val["smallest"] - lmin)]
                err = max(errs)
                rec["products"] = val["products"]
            elif "_pow_" in key:
                cands = [lmax if abs(lmax) >= abs(lmin) else lmin]
                if abs(abs(lmax) - abs(lmin)) <= tol:
                    cands = [lmax, lmin]
                err = min(abs(val - c) for c in cands)
            else:
                err = abs(val - lmax)
            rec["conv"] = conv
            rec["err_rel"] = err / M if M > 0 else err
            within = err <= tol
            rec["status"] = ("conv_in" if within else "conv_OUT") if conv else "notconv"
            recs.append(rec)
    return recs
