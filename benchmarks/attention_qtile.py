"""The fused attention kernel at ViT's 197 tokens (12 heads, d 64, no mask; --sq/--heads/--layout for others) with different query
tiles, built from its spec, checked against numpy, timed interleaved; each tile as given
(balance=False) and "balanced" (what a build runs: flash.query_tile).

    TVM_NUM_THREADS=1 nice .venv/bin/python benchmarks/attention_qtile.py --sq 197 --tiles 64x64,50x64 --cpu-time
    TVM_NUM_THREADS=1 nice .venv/bin/python benchmarks/attention_qtile.py --sq 197 --tiles 64x64 --ab-key-tail --cpu-time
    # Whisper-base's encoder attention as its model runs it (8 heads, q/v/out (b, s, h, d), scale 1)
    TVM_NUM_THREADS=1 nice .venv/bin/python benchmarks/attention_qtile.py --sq 1500 --heads 8 --layout bshd \
        --scale 1 --tiles 64x64 --ab-exp2 --cpu-time
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
    ap.add_argument("--ab-exp2", action="store_true", help="also the balanced tile with fast_exp, not fast_exp2 "
                    "(ablation attention-exp2)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd", help="q, v and out (K is K^T, bhds)")
    ap.add_argument("--scale", type=float, default=0.125)
    a = ap.parse_args(argv)
    tgt = resolve("host").tvm_target()
    lanes = vector_lanes(tgt)
    h, d, s, lay = a.heads, 64, a.sq, a.layout
    spec = AttentionSpec(dtype="float32", q=lay, k="bhds", v=lay, o=lay, heads=h, d=d, dv=d,
                         scale=a.scale, batch=1, sq=s, skv=s)
    tr = (lambda x: x) if lay == "bhsd" else (lambda x: x.transpose(0, 2, 1, 3).copy())  # (b, h, s, d) -> layout
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, s, d)).astype("float32") for _ in range(3))
    sc = q @ k.transpose(0, 1, 3, 2) * a.scale
    p = np.exp(sc - sc.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    want = tr(p @ v)
    dev = tvm.cpu(0)
    args = [tvm.runtime.tensor(x, dev) for x in (tr(q), k.transpose(0, 1, 3, 2).copy(), tr(v), tr(np.zeros_like(q)))]
    runners = {}
    variants = [(t, True, True) for t in a.tiles.split(",") + ["balanced"]]
    if a.ab_key_tail:  # the balanced tile with a whole last key tile (ablation attention-key-tail)
        variants.append(("balanced", False, True))
    if a.ab_exp2:  # the balanced tile with fast_exp (ablation attention-exp2)
        variants.append(("balanced", True, False))
    for t, key_tail, exp2 in variants:
        qt, kt = map(int, (a.tiles.split(",")[0] if t == "balanced" else t).split("x"))
        fn = kernel(spec, (qt, kt), lanes, balance=t == "balanced", key_tail=key_tail, exp2=exp2)
        f = tvm.compile(tvm.IRModule({"main": fn}), target=tgt)["main"]
        args[3].copyfrom(np.full(want.shape, np.nan, np.float32))
        f(*args)
        np.testing.assert_allclose(args[3].numpy(), want, rtol=1e-4, atol=1e-4)
        label = t if t != "balanced" else f"balanced {fn.attrs['blockforge.attention.tiles']}"
        runners[label + ("" if key_tail else " whole key tail") + ("" if exp2 else " fast_exp")] = (lambda f=f: f(*args))
    s_ = measure_interleaved(runners, a.repeat, 2, clock=time.thread_time if a.cpu_time else time.perf_counter)
    print({k: round(float(np.median(v)), 3) for k, v in s_.items()}, "ms; load", os.getloadavg())


if __name__ == "__main__":
    main()
