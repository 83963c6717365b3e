import json, glob, sys
keys = ["mx_err", "eig_err", "ht_z_pp", "ht_z_hu", "hte_z", "ticd_z", "tict_z", "tich_z"]
agg = {k: [] for k in keys}; nconv = 0; nstep = 0; bad = []
for f in sorted(glob.glob(sys.argv[1] if len(sys.argv) > 1 else "sweep_*.json")):
    D = json.load(open(f)); name = D["model"] + ("/" + D["dtype"] if D["dtype"] else "")
    for d in D["res"]:
        nstep += 1; nconv += bool(d.get("conv"))
        for k in keys:
            if k in d:
                agg[k].append((d[k], name, d["step"], d["seed"]))
        if d.get("mx_err", 0) > 1e-2: bad.append(("HessMaxEV", name, d["step"], d["seed"], d["mx_err"]))
        if d.get("eig_err", 0) > 1e-2: bad.append(("HessEig", name, d["step"], d["seed"], d["eig_err"]))
        for k in ["ht_z_pp", "ht_z_hu", "hte_z", "ticd_z", "tict_z", "tich_z"]:
            if d.get(k, 0) > 4: bad.append((k, name, d["step"], d["seed"], round(d[k], 2), d.get({"ht_z_pp":"ht_rel_pp","ht_z_hu":"ht_rel_hu","hte_z":"hte","ticd_z":"ticd","tict_z":"tict","tich_z":"tich"}[k])))
        if d.get("ticd_nooutputs") is not None: bad.append(("TICDiag stored without outputs", name, d["step"], d["ticd_nooutputs"]))
print("solves", nstep, "converged", nconv)
for k in keys:
    L = agg[k]
    if not L: continue
    if k in ("mx_err", "eig_err"):
        print(f"{k}: {sum(v<=1e-2 for v,*_ in L)}/{len(L)} within rtol; worst {max(L)}")
    else:
        print(f"{k}: n={len(L)} within2 {sum(v<=2 for v,*_ in L)/len(L):.3f} within3 {sum(v<=3 for v,*_ in L)/len(L):.3f} worst {max(L)}")
# per-model within-2 for TIC / HessTrace
import collections
for k in ["ht_z_pp", "ht_z_hu", "hte_z", "ticd_z", "tict_z", "tich_z"]:
    pm = collections.defaultdict(list)
    for v, n, *_ in agg[k]: pm[n].append(v)
    s = ", ".join(f"{n}:{sum(x<=2 for x in L)}/{len(L)}" for n, L in pm.items() if sum(x<=2 for x in L)/len(L) < 0.9)
    if s: print(" low-coverage", k, s)
print("--- bad"); [print(b) for b in bad[:40]]; print(len(bad), "bad")
