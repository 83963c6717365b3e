"""Small structured models. usage: python small.py [setup_name|all] [nseeds] [steps]"""
import sys, json, collections
import numpy as np
import torch
from harness import QuadModel, run, check, exact_hessian

def had(n):
    H = np.array([[1.0]])
    while H.shape[0] < n:
        H = np.block([[H, H], [H, -H]])
    return H / np.sqrt(n)

def complete(V, D, rng):
    """orthonormal basis whose first columns span V (orthonormal)."""
    R = rng.standard_normal((D, D))
    R[:, :V.shape[1]] = V
    Q, _ = np.linalg.qr(R)
    Q[:, :V.shape[1]] = V  # keep exact structured vectors
    # re-orthogonalise the rest
    rest = Q[:, V.shape[1]:] - V @ (V.T @ Q[:, V.shape[1]:])
    rest, _ = np.linalg.qr(rest)
    return np.hstack([V, rest])

def spd(Q, lam):
    return (Q * np.asarray(lam)) @ Q.T

rng = np.random.default_rng(7)
S = {}
# equal-size entries (Hadamard eigenvectors)
S["had8_tie"] = spd(had(8), [3.004, -3.002, 1e-3, 2e-3, -1e-3, 5e-4, 0, 3e-3])
S["had4_tie"] = spd(had(4), [3.004, -3.002, 1e-3, -1e-3])
S["had8_mixed"] = spd(had(8), [5, -4.99, 1, 0.5, 0.2, -0.3, 0.1, 0.05])
S["had8_repeated"] = spd(had(8), [2, 2, 2, -1, -1, 0.5, 0.5, 0.5])
S["had8_rep_tie"] = spd(had(8), [2, 2, -2, -2, 0.1, 0.1, 0.1, 0.1])
# 6-param: eigenvectors (1..1)/sqrt6 and (1,1,1,-1,-1,-1)/sqrt6, rest small
V6 = np.array([[1] * 6, [1, 1, 1, -1, -1, -1]], float).T / np.sqrt(6)
Q6 = complete(V6, 6, rng)
S["six_tie"] = spd(Q6, [3.004, -3.002, 1e-3, 2e-3, -1e-3, 1.5e-3])
S["six_tie_rev"] = spd(Q6, [-3.004, 3.002, 1e-3, 2e-3, -1e-3, 1.5e-3])
# sparse eigenvectors orthogonal to half of the +-1 vectors: pairs (e_2k +- e_2k+1)/sqrt2
P = np.zeros((12, 12))
for k in range(6):
    P[2 * k, 2 * k] = P[2 * k + 1, 2 * k] = 1 / np.sqrt(2)
    P[2 * k, 2 * k + 1] = 1 / np.sqrt(2); P[2 * k + 1, 2 * k + 1] = -1 / np.sqrt(2)
lam12 = np.linspace(0.1, 1.0, 12); lam12[1] = 10.0; lam12[3] = -9.99
S["pairs12_outlier"] = spd(P, lam12)
# (1,1,-1,-1,0..)/2 and (1,-1,-1,1,0...)/2 eigvecs (orthogonal to many +-1 vectors)
V = np.zeros((10, 2)); V[:4, 0] = [1, 1, -1, -1]; V[:4, 1] = [1, -1, -1, 1]; V /= 2
Q10 = complete(V, 10, rng)
S["quad10_tie"] = spd(Q10, [4.0, -4.0 + 1e-3] + list(np.linspace(-0.5, 0.5, 8)))
# single large outlier with tiny start component: v = (1,-1,1e-3,0..)
v = np.zeros(8); v[:3] = [1, -1, 1e-3]; v /= np.linalg.norm(v)
Qo = complete(v[:, None], 8, rng)
S["outlier_tiny"] = spd(Qo, [100] + list(np.linspace(0.5, 1.5, 7)))
S["outlier_tiny_neg"] = spd(Qo, [-100] + list(np.linspace(0.5, 1.5, 7)))
# rank 1
h = had(8)[:, 3]
S["rank1_had"] = 7.0 * np.outer(h, h)
w = np.zeros(5); w[:2] = [1, -1]; w /= np.sqrt(2)
S["rank1_pair_neg"] = -3.0 * np.outer(w, w)
S["rank1_ones"] = 2.0 * np.outer(np.ones(4), np.ones(4)) / 4
# zero
S["zero5"] = np.zeros((5, 5))
S["zero2"] = np.zeros((2, 2))
# saddles
S["saddle2"] = np.array([[0.0, 1.0], [1.0, 0.0]])
S["saddle3"] = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0, 0, 0.0]])
S["diag_pm"] = np.diag([1.0, -1.0, 1.0, -1.0])
S["scaled_identity"] = 2.5 * np.eye(6)
S["tiny_scale"] = 1e-6 * spd(had(4), [1.0, -0.999, 0.3, 0.1])

NONLIN = {  # (A, quartic, bilinear)
    "saddle2_quartic": (np.array([[0.0, 1.0], [1.0, 0.0]]), 0.3, None),
    "bilinear6": (np.zeros((6, 6)), 0.0, [(0, 3, 1.0), (1, 4, 1.0), (2, 5, 1.0), (0, 1, 0.5)]),
    "had8_tie_quartic": (S["had8_tie"], 0.01, None),
}

def setups():
    out = []
    for name, A in S.items():
        out.append((name, A, 0.0, None))
    for name, (A, qu, bl) in NONLIN.items():
        out.append((name, A, qu, bl))
    return out

def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    nseeds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    dtypes = [torch.float64, torch.float32]
    allrecs = []
    for name, A, qu, bl in setups():
        if which != "all" and name != which:
            continue
        D = A.shape[0]
        for dtype in dtypes:
            for seed in range(nseeds):
                g = torch.Generator().manual_seed(seed)
                data = [torch.randn(4, D, generator=g).to(dtype) for _ in range(steps)]
                split = [D // 2, D - D // 2] if D >= 4 else None
                model = QuadModel(A, dtype, split=split, quartic=qu, bilinear=bl, seed=seed)
                cp, qs, refs = run(model, data, steps, seed)
                tag = f"{name}/{str(dtype)[6:]}/seed{seed}"
                allrecs += check(cp, qs, refs, dtype, tag)
    json.dump(allrecs, open(f"recs_small_{which}.json", "w"), default=float)
    summarize(allrecs)

def summarize(recs):
    c = collections.Counter(); bad = []
    zs = []
    for r in recs:
        if r["status"] == "trace":
            zs.append((r["q"], r["z"], r)); continue
        c[(r["q"], r["status"])] += 1
        if r["status"] in ("conv_OUT", "missing"):
            bad.append(r)
    for k in sorted(c): print(k, c[k])
    for meth in ("TrE_hpp", "TrE_hut"):
        z = np.array([x[1] for x in zs if x[0] == meth])
        if len(z): print(meth, "n", len(z), "within2", np.mean(z <= 2), "within3", np.mean(z <= 3), "max z", z.max())
    worst = sorted([x for x in zs], key=lambda x: -x[1])[:5]
    for q, z, r in worst: print("worst z", q, r["tag"], r["step"], "trace", r["trace"], "est", r["est"], "se", r["se"], "z", z)
    for r in bad[:30]:
        print("BAD", r["tag"], r["step"], r["q"], "lmax", r["lmax"], "lmin", r["lmin"], "val", r["val"], "prod", r["products"], "err_rel", r.get("err_rel"))
    print("n bad", len(bad))

if __name__ == "__main__":
    main()
