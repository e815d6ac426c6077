"""Interleaved A/B of pipeline ablations on a block model (batch=1, seq=S, d_model 768 inputs): each
build twice (new, the ablations, the ablations again in reverse order, new), one call each per round,
ROUNDS rounds (default 30), medians; the ratio of each pair and their geometric mean. No parity
gate: whole_ab.py's refuses the QDQ MHA at seq 512, where every build (int8-attention off, and the
commit before the seventeenth session's too) is 0.0106 from ORT, 1.78x the int8 row.

    BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src python ab_products.py MODEL SEQ ABL1,ABL2 [ROUNDS]
"""
import sys, time, numpy as np, tvm
from tvm import relax
import blockforge; blockforge.configure()
from blockforge.compile.session import open_model
model, seq = sys.argv[1], int(sys.argv[2])
variants = [("new", frozenset())] + [(f"-{a}", frozenset({a})) for a in sys.argv[3].split(",")]
s = open_model(model, "host", {"batch": 1, "seq": seq})
rng = np.random.default_rng(0)
x = {i.name: rng.standard_normal([int(d) for d in [1, seq, 768]]).astype(np.float32) for i in s.inputs}
fns = {}
for name, w in variants + [(n + " (2)", w) for n, w in variants[::-1]]:
    vm = relax.VirtualMachine(s.build(without=w).executable, tvm.cpu())
    args = [tvm.runtime.tensor(x[i.name]) for i in s.inputs]
    f = vm["main"]
    f(*args)
    fns[name] = (f, args)
times = {k: [] for k in fns}
for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 30):
    for k, (f, args) in fns.items():
        t = time.perf_counter(); f(*args); times[k].append(time.perf_counter() - t)
med = {k: np.median(v) * 1e3 for k, v in times.items()}
print({k: round(v, 3) for k, v in med.items()})
import os; print("load", os.getloadavg())
for n, _ in variants[1:]:
    a = (med["new"] / med[n] * med["new (2)"] / med[n + " (2)"]) ** 0.5
    print(f"new / {n}: {med['new']/med[n]:.3f}, {med['new (2)']/med[n + ' (2)']:.3f}, geo {a:.3f}")
