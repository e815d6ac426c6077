"""Micro-benchmark behind fast_math's patch-conv rewrite: ViT-B/16's patch embedding.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/patch_conv.py

conv2d (1, 3, 224, 224) x (768, 3, 16, 16), stride 16, built with and without the rewrite
to im2col + (prepacked) matmul, both checked against a numpy reference, timed interleaved
(median of 5 rounds of 5 calls).
"""

import time

import numpy as np

import blockforge

blockforge.configure(redirect_native_output=False)
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from blockforge.compile.pipeline import build  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

rng = np.random.default_rng(0)
x = rng.standard_normal((1, 3, 224, 224)).astype("float32")
w = (rng.standard_normal((768, 3, 16, 16)) * 0.05).astype("float32")
cols = x.reshape(1, 3, 14, 16, 14, 16).transpose(0, 2, 4, 1, 3, 5).reshape(196, 768)
want = (cols @ w.reshape(768, 768).T).reshape(1, 14, 14, 768).transpose(0, 3, 1, 2)

from tvm.script import relax as R  # noqa: E402


@tvm.script.ir_module
class Patch:
    @R.function
    def main(x: R.Tensor((1, 3, 224, 224), "float32"), w: R.Tensor((768, 3, 16, 16), "float32")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=16)
            R.output(y)
        return y


mod = relax.transform.BindParams("main", {"w": tvm.runtime.tensor(w)})(Patch)

t = resolve("host")
runs = {}
for label, without in (("conv2d", {"patch-conv"}), ("im2col-gemm", set())):
    ex = build(mod, t, without=without).executable
    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(ex, dev)
    a = tvm.runtime.tensor(x, dev)
    np.testing.assert_allclose(vm["main"](a).numpy(), want, rtol=1e-3, atol=1e-3)
    runs[label] = (vm["main"], a)
ts = {k: [] for k in runs}
for _ in range(5):
    for label, (f, a) in runs.items():
        f(a)
        t0 = time.perf_counter()
        for _ in range(5):
            f(a)
        ts[label].append((time.perf_counter() - t0) / 5 * 1e3)
print({k: round(float(np.median(v)), 3) for k, v in ts.items()}, "ms per call")
