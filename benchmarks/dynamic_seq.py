#!/usr/bin/env python3
"""One build for every sequence length vs a build per length (issue #13, item 3).

The model is compiled once with `seq` symbolic (batch bound) and once per length with
`seq` bound; both run the same inputs, interleaved in one process. The symbolic build is
what a single artifact ships (no artifact-format change: the VM binds seq from the input
shapes). The goal: within 1.25x of the per-length build at each length.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/dynamic_seq.py MODEL.onnx \\
        --seq 64 128 256 384 [--unfused] [--json OUT.json]

--unfused adds the symbolic build without the fused attention kernel (the previous
state: CPU rules only), for the before/after.
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
    ap.add_argument("--seq", type=int, nargs="+", default=[64, 128, 256, 384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--unfused", action="store_true", help="also time the symbolic build without the fused kernel")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import blockforge
    from blockforge.bench.contenders import TvmRunner
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.pipeline import build
    from blockforge.compile.session import open_model
    from blockforge.graph.model_io import random_inputs
    from blockforge.targets.toolchain import cpu_model

    blockforge.configure()
    sym = open_model(args.model, "host", {"batch": args.batch})
    if not any(not isinstance(d, int) for s in sym.inputs for d in s.dims):
        raise SystemExit(f"{args.model}: no symbolic dim left once batch is bound (export without --seq)")
    dynamic = build(sym.relax(), sym.target).executable
    unfused = build(sym.relax(), sym.target, fuse_attention=False).executable if args.unfused else None
    rows = []
    for seq in args.seq:
        static = open_model(args.model, "host", {"batch": args.batch, "seq": seq})
        inputs = random_inputs(static.inputs, {}, seed=0)
        runners = {"static": TvmRunner(build(static.relax(), static.target).executable, "cpu", static.inputs, static.outputs, inputs),
                   "dynamic": TvmRunner(dynamic, "cpu", static.inputs, static.outputs, inputs)}
        if unfused is not None:
            runners["dynamic-unfused"] = TvmRunner(unfused, "cpu", static.inputs, static.outputs, inputs)
        ref = runners["static"].outputs()[0]
        samples = measure_interleaved(runners, args.repeat, warmup=2)
        base = float(np.median(samples["static"]))
        for k, v in samples.items():
            out = runners[k].outputs()[0]
            rows.append({"seq": seq, "build": k, "median_ms": round(float(np.median(v)), 3),
                         "p90_ms": round(float(np.percentile(v, 90)), 3),
                         "vs_static": round(float(np.median(v)) / base, 2),
                         "max_abs_vs_static": float(np.abs(out.astype(np.float64) - ref).max())})
    print(f"\n{args.model.name}, batch {args.batch}, {cpu_model()}; shared machine: read ranks, not digits\n")
    print("| seq | build | median ms | p90 ms | / static | max abs vs static |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['build']} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {r['vs_static']:.2f} | "
              f"{r['max_abs_vs_static']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "cpu": cpu_model(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
