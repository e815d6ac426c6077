"""ViT's GEMMs at 197 rows vs the same GEMMs at 192 / 208 rows (whole row tiles): what the
row tail costs. Each case is x (1, M, K) @ W (K, N) + b as a compiled Relax function
(prepacked constant W, bias in the epilogue), checked against numpy, timed interleaved.

    nice .venv/bin/python benchmarks/vit_gemm.py [--ms 192,197,208] [--shapes 768x768,768x3072,3072x768]
        [--ab row-tiles] [--cpu-time]   (--cpu-time with TVM_NUM_THREADS=1)
"""
import argparse, os, sys, time
import numpy as np

import blockforge
blockforge.configure(redirect_native_output=False)
import tvm
from tvm import relax
from blockforge.targets import resolve
from blockforge.compile.pipeline import build
from blockforge.bench.harness import measure_interleaved


def gemm_module(m: int, k: int, n: int, w: np.ndarray, bias: np.ndarray):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, m, k), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(w)))
            y = bb.emit(relax.op.add(y, relax.const(bias)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="192,197,208")
    ap.add_argument("--shapes", default="768x768,768x3072,3072x768")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--without", default="")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time CPU time of the calling thread (run with TVM_NUM_THREADS=1): the kernel's code, "
                         "not a loaded machine's descheduling")
    ap.add_argument("--ab", default="", help="an ablation each M is also built without (e.g. row-tail)")
    a = ap.parse_args(argv)
    t = resolve("host")
    rng = np.random.default_rng(0)
    without = frozenset(x for x in a.without.split(",") if x)
    for shape in a.shapes.split(","):
        k, n = map(int, shape.split("x"))
        w = rng.standard_normal((k, n)).astype("float32") / np.sqrt(k)
        bias = rng.standard_normal(n).astype("float32")
        runners, flops = {}, {}
        for m in map(int, a.ms.split(",")):
            xs = rng.standard_normal((1, m, k)).astype("float32")
            xt = tvm.runtime.tensor(xs, tvm.cpu(0))
            for label, wo in ((f"M={m}", without), (f"M={m}-{a.ab}", without | {a.ab}))[: 2 if a.ab else 1]:
                f = relax.VirtualMachine(build(gemm_module(m, k, n, w, bias), t, without=wo).executable, tvm.cpu(0))["main"]
                np.testing.assert_allclose(f(xt).numpy(), xs @ w + bias, rtol=1e-3, atol=1e-3)
                runners[label] = (lambda f=f, xt=xt: f(xt))
                flops[label] = 2.0 * m * k * n
        s = measure_interleaved(runners, a.repeat, 2, clock=time.thread_time if a.cpu_time else time.perf_counter)
        row = "  ".join(f"{name}: {float(np.median(v)):.3f} ms {flops[name] / np.median(v) / 1e6:.0f} GFLOP/s"
                        for name, v in s.items())
        print(f"K={k} N={n}  {row}", flush=True)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
