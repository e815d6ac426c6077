"""The fused attention kernel at ViT's 197 tokens (12 heads, d 64, no mask) with different query
tiles, built from its spec, checked against numpy, timed interleaved; each tile as given
(balance=False) and "balanced" (what a build runs: flash.query_tile).

    TVM_NUM_THREADS=1 nice .venv/bin/python benchmarks/attention_qtile.py --sq 197 --tiles 64x64,50x64 --cpu-time
    TVM_NUM_THREADS=1 nice .venv/bin/python benchmarks/attention_qtile.py --sq 197 --tiles 64x64 --ab-key-tail --cpu-time
"""
import argparse, os, time
import numpy as np

import blockforge
blockforge.configure(redirect_native_output=False)
import tvm
from blockforge.compile.attention.flash import AttentionSpec, kernel
from blockforge.bench.harness import measure_interleaved
from blockforge.targets import resolve
from blockforge.compile.schedule.base import vector_lanes


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sq", type=int, default=197)
    ap.add_argument("--tiles", default="64x64,50x64")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--ab-key-tail", action="store_true", help="also the balanced tile with a whole last key tile")
    a = ap.parse_args(argv)
    tgt = resolve("host").tvm_target()
    lanes = vector_lanes(tgt)
    h, d, s = 12, 64, a.sq
    spec = AttentionSpec(dtype="float32", q="bhsd", k="bhds", v="bhsd", o="bhsd", heads=h, d=d, dv=d,
                         scale=0.125, batch=1, sq=s, skv=s)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, s, d)).astype("float32") for _ in range(3))
    sc = q @ k.transpose(0, 1, 3, 2) * 0.125
    p = np.exp(sc - sc.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    want = p @ v
    dev = tvm.cpu(0)
    args = [tvm.runtime.tensor(x, dev) for x in (q, k.transpose(0, 1, 3, 2).copy(), v, np.zeros_like(q))]
    runners = {}
    variants = [(t, True) for t in a.tiles.split(",") + ["balanced"]]
    if a.ab_key_tail:  # the balanced tile with a whole last key tile (ablation attention-key-tail)
        variants.append(("balanced", False))
    for t, key_tail in variants:
        qt, kt = map(int, (a.tiles.split(",")[0] if t == "balanced" else t).split("x"))
        fn = kernel(spec, (qt, kt), lanes, balance=t == "balanced", key_tail=key_tail)
        f = tvm.compile(tvm.IRModule({"main": fn}), target=tgt)["main"]
        args[3].copyfrom(np.full(q.shape, np.nan, np.float32))
        f(*args)
        np.testing.assert_allclose(args[3].numpy(), want, rtol=1e-4, atol=1e-4)
        label = t if t != "balanced" else f"balanced {fn.attrs['blockforge.attention.tiles']}"
        runners[label + ("" if key_tail else " whole key tail")] = (lambda f=f: f(*args))
    s_ = measure_interleaved(runners, a.repeat, 2, clock=time.thread_time if a.cpu_time else time.perf_counter)
    print({k: round(float(np.median(v)), 3) for k, v in s_.items()}, "ms; load", os.getloadavg())


if __name__ == "__main__":
    main()
