import sys, torch, collections
from cockpit_like.functional.krylov import lanczos_decomposition
from cockpit_like.backends.curvature_engine import start_vectors
torch.set_default_dtype(torch.float64)
data = torch.load(sys.argv[1]); draws = int(sys.argv[2]); rtol = float(sys.argv[3])
LEAST = 8
def ends(C, m):
    T = C[:m, :m]; T = 0.5 * (T + T.T)
    w, V = torch.linalg.eigh(T)
    r = (C[m:, :m] @ V).norm(dim=0)
    return w, r
stats = collections.defaultdict(lambda: [0, 0, 0, 0])  # rule -> [conv, miss_top, miss_any, products]
for tag, H in data:
    D = H.shape[0]
    ev = torch.linalg.eigvalsh(H); lmax, lmin = float(ev[-1]), float(ev[0]); M = max(abs(lmax), abs(lmin))
    for d in range(draws):
        g = torch.Generator().manual_seed(1000 * d + 7)
        starts = start_vectors(2, D, torch.float64, "cpu", g)
        K = lanczos_decomposition(lambda v: H @ v, starts, max_products=min(100, D), rtol=0.0,
                                  restart=lambda m: start_vectors(1, D, torch.float64, "cpu", g)[0])
        C = K.coefficients; mm = K.num_products; size = C.shape[0]
        hist = {}
        for m in range(2, mm + 1):
            w, r = ends(C, m)
            hist[m] = (float(w[-1]), float(w[0]), float(r[-1]), float(r[0]), float(w.abs().max()), float(w[-1]-w[-2]) if len(w)>1 else 0.0, float(w[1]-w[0]) if len(w)>1 else 0.0)
        def base(m):
            t, b, rt, rb, s = hist[m][:5]
            return rt <= rtol * s and rb <= rtol * s
        rules = {
            "base": lambda m: m >= LEAST and base(m),
            "look2": lambda m: m >= LEAST and base(m) and base(m - 2) and abs(hist[m][0] - hist[m-2][0]) <= rtol * hist[m][4] and abs(hist[m][1] - hist[m-2][1]) <= rtol * hist[m][4],
            "look4": lambda m: m >= LEAST + 2 and base(m) and base(m - 4) and abs(hist[m][0] - hist[m-4][0]) <= rtol * hist[m][4] and abs(hist[m][1] - hist[m-4][1]) <= rtol * hist[m][4],
            "look1": lambda m: m >= LEAST and base(m) and base(m - 1) and abs(hist[m][0] - hist[m-1][0]) <= rtol * hist[m][4] and abs(hist[m][1] - hist[m-1][1]) <= rtol * hist[m][4],
            "look2h": lambda m: m >= LEAST and base(m) and abs(hist[m][0] - hist[m-2][0]) <= rtol * hist[m][4] / 2 and abs(hist[m][1] - hist[m-2][1]) <= rtol * hist[m][4] / 2,
            "look2n": lambda m: m >= LEAST and base(m) and abs(hist[m][0] - hist[m-2][0]) <= rtol * hist[m][4] and abs(hist[m][1] - hist[m-2][1]) <= rtol * hist[m][4],
            "look3": lambda m: m >= LEAST + 1 and base(m) and base(m - 3) and abs(hist[m][0] - hist[m-3][0]) <= rtol * hist[m][4] and abs(hist[m][1] - hist[m-3][1]) <= rtol * hist[m][4],
            "cond3": lambda m: m >= LEAST and base(m) and (min(hist[m][5], hist[m][6]) > 3 * rtol * hist[m][4] or rules["look2"](m)),
            "cond10": lambda m: m >= LEAST and base(m) and (min(hist[m][5], hist[m][6]) > 10 * rtol * hist[m][4] or rules["look2"](m)),
            "cond30": lambda m: m >= LEAST and base(m) and (min(hist[m][5], hist[m][6]) > 30 * rtol * hist[m][4] or rules["look2"](m)),
            "tight4": lambda m: m >= LEAST and all(x <= rtol * hist[m][4] / 4 for x in hist[m][2:4]),
        }
        for name, rule in rules.items():
            stop = next((m for m in range(2, mm + 1) if (m >= LEAST or m == mm) and (rule(m) or m == mm and mm >= size)), None)
            st = stats[name]
            if stop is None:
                st[3] += mm; continue
            t, b = hist[stop][0], hist[stop][1]
            tol = rtol * M + 1e-10 * M
            st[0] += 1; st[3] += stop
            st[1] += abs(t - lmax) > tol
            st[2] += abs(t - lmax) > tol or abs(b - lmin) > tol
for name, (c, mt, ma, p) in stats.items():
    print(f"{name:8s} converged {c} miss_top {mt} miss_any {ma} products {p}")
