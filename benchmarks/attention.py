#!/usr/bin/env python3
"""Fused CPU attention A/B: ORT vs blockforge untuned with the fused kernel vs without it,
interleaved in one process (blockforge.bench.harness.measure_interleaved).

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/attention.py MODEL.onnx --seq 128 512

Prints a markdown table per sequence length (median ms, p90, ratio to ORT) and, with
--profile, the per-kernel split of both builds. --tiles times the kernel alone at every
tile candidate (what `tune` does per kernel), interleaved.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    ap.add_argument("--tiles", action="store_true", help="time the kernel alone at each tile candidate")
    args = ap.parse_args(argv)
    if args.tiles:
        return tiles(args)

    import blockforge
    from blockforge.bench.contenders import TvmRunner
    from blockforge.bench.harness import measure_interleaved, profile_vm
    from blockforge.compile.pipeline import build
    from blockforge.compile.session import open_model
    from blockforge.graph import ort as ort_runner
    from blockforge.graph.model_io import random_inputs
    from blockforge.targets.toolchain import cpu_model

    blockforge.configure()
    rows = []
    for seq in args.seq:
        dims = {"batch": args.batch, "seq": seq}
        s = open_model(args.model, "host", dims)
        inputs = random_inputs(s.inputs, {}, seed=0)
        threads = int(s.target.target_json.get("num-cores", 1))
        sess = ort_runner.session(s.model, threads=threads)
        runners = {"ort": lambda sess=sess: sess.run(None, inputs)}
        for name, fuse in (("unfused", False), ("fused", True)):
            ex = build(s.relax(), s.target, fuse_attention=fuse).executable
            runners[name] = TvmRunner(ex, s.target.device, s.inputs, s.outputs, inputs)
        outs = {k: (r.outputs()[0] if k != "ort" else sess.run(None, inputs)[0])
                for k, r in runners.items()}
        samples = measure_interleaved(runners, args.repeat, warmup=2)
        ort_ms = float(np.median(samples["ort"]))
        for k, v in samples.items():
            rows.append({"seq": seq, "contender": k, "median_ms": round(float(np.median(v)), 3),
                         "p90_ms": round(float(np.percentile(v, 90)), 3), "vs_ort": round(float(np.median(v)) / ort_ms, 2),
                         "max_abs_vs_ort": float(np.abs(outs[k].astype(np.float64) - outs["ort"]).max())})
        if args.profile:
            for k in ("unfused", "fused"):
                print(f"\nseq {seq} {k}: top kernels")
                for p in profile_vm(runners[k])[:8]:
                    print(f"  {p.name:60s} {p.total_ms:8.3f} ms {p.pct:5.1f}%")
    print(f"\n{args.model.name}, batch {args.batch}, {cpu_model()}, shared machine: read ranks, not digits\n")
    print("| seq | contender | median ms | p90 ms | / ORT | max abs vs ORT |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['contender']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['vs_ort']:.2f} | "
              f"{r['max_abs_vs_ort']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "cpu": cpu_model(), "rows": rows}, indent=1))
    return 0


def tiles(args) -> int:
    """The fused kernel alone, at each tile candidate, interleaved (random inputs)."""
    import tvm

    import blockforge
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile import attention
    from blockforge.compile.schedule.base import vector_lanes
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.targets.toolchain import cpu_model

    blockforge.configure()
    print(f"{args.model.name}, batch {args.batch}, {cpu_model()}; kernel alone, ms (median of {args.repeat})")
    for seq in args.seq:
        s = open_model(args.model, "host", {"batch": args.batch, "seq": seq})
        mod, _ = run_phases(s.relax(), s.target, stop_after="fuse-attention")
        tgt = s.target.tvm_target()
        lanes = vector_lanes(tgt)
        for spec in attention.kernel_specs(mod):
            runners = {}
            for t in attention.tile_candidates(lanes):
                f = attention.kernel(spec, t, lanes)
                lib = tvm.compile(tvm.IRModule({"main": f}), target=tgt)
                rng = np.random.default_rng(0)
                dims = {"batch": args.batch, "seq": seq, "kv_seq": seq}
                args_ = [tvm.runtime.tensor(
                    (rng.random([int(d) if isinstance(d, tvm.tirx.IntImm) else dims[d.name] for d in p.shape]) < 0.8)
                    if str(p.dtype) == "bool" else
                    rng.standard_normal([int(d) if isinstance(d, tvm.tirx.IntImm) else dims[d.name] for d in p.shape])
                    .astype(str(p.dtype))) for p in f.params]
                fn = lib["main"]
                runners[f"{t[0]}x{t[1]}"] = (lambda fn=fn, a=args_: fn(*a))
            samples = measure_interleaved(runners, args.repeat, warmup=2)
            med = {k: float(np.median(v)) for k, v in samples.items()}
            best = min(med, key=med.get)
            print(f"seq {seq} {spec.describe()}: " + ", ".join(
                f"{k} {v:.3f}{' *' if k == best else ''}" for k, v in med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
