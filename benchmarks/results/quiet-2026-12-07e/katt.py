import sys, numpy as np, blockforge
blockforge.configure(redirect_native_output=False)
import tvm
from blockforge.compile.attention.flash import AttentionSpec, kernel
from blockforge.targets import resolve
tgt = resolve("host").tvm_target()
def run(b, s, h, d, tiles=(64, 64)):
    spec = AttentionSpec(dtype="float32", q="bshd", k="bhds", v="bshd", o="bshd", heads=h, d=d, dv=d, scale=d ** -0.5, batch=b, sq=s, skv=s)
    lib = tvm.compile(tvm.IRModule({"main": kernel(spec, tiles, 16)}), target=tgt)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, s, h, d)).astype("float32"); kt = rng.standard_normal((b, h, d, s)).astype("float32")
    v = rng.standard_normal((b, s, h, d)).astype("float32")
    args = [tvm.runtime.tensor(x) for x in (q, kt, v, np.zeros((b, s, h, d), "float32"))]
    t = lib.jit().time_evaluator("main", tvm.cpu(), number=20, repeat=5)(*args)
    fl = 4 * b * h * s * s * d
    print(f"b={b} s={s} h={h} d={d} tiles={tiles}: {min(t.results)*1e3:.3f} ms, {fl/min(t.results)/1e9:.0f} GFLOP/s")
for d in map(int, sys.argv[1:] or [36, 48, 60, 64]):
    run(4, 256, 4, d)
