"""Micro-benchmark behind cpu_schedule.CPUMatmulRaggedN: ViT attention scores, N = 197 tokens.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/ragged_matmul.py

Builds (1, 12, 197, 64) x (1, 12, 64, 197) * 0.125 with and without the rule, checks both
against numpy, and times them interleaved (median of 5 rounds of 5 calls).
"""
import time, numpy as np
import blockforge
blockforge.configure(redirect_native_output=False)
import tvm
from tvm import relax
from tvm.script import relax as R
from blockforge.targets import resolve
from blockforge.compile.pipeline import build

@tvm.script.ir_module
class M:
    @R.function
    def main(q: R.Tensor((1, 12, 197, 64), "float32"), k: R.Tensor((1, 12, 64, 197), "float32")):
        with R.dataflow():
            s = R.matmul(q, k)
            o = R.multiply(s, R.const(0.125, "float32"))
            R.output(o)
        return o

t = resolve("host")
rng = np.random.default_rng(0)
q = rng.standard_normal((1,12,197,64)).astype("float32"); k = rng.standard_normal((1,12,64,197)).astype("float32")
want = (q @ k) * 0.125
res = {}
for label, without in (("without", {"ragged-n"}), ("with", set())):
    ex = build(M, t, without=without).executable
    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(ex, dev)
    a, b = tvm.runtime.tensor(q, dev), tvm.runtime.tensor(k, dev)
    out = vm["main"](a, b).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    res[label] = (vm, a, b)
# interleaved timing
ts = {k: [] for k in res}
for r in range(5):
    for label, (vm, a, b) in res.items():
        f = vm["main"]; f(a, b)
        t0 = time.perf_counter()
        for _ in range(5): f(a, b)
        ts[label].append((time.perf_counter() - t0) / 5 * 1e3)
print({k: round(float(np.median(v)), 3) for k, v in ts.items()}, "ms per call")
