"""The attention-op layout (one ONNX Attention node, imported as the plain Relax decomposition)
against the packed layout (the same math as ONNX MatMul/Softmax nodes): same weights, same
inputs, blockforge's untuned host build and ONNX Runtime, timed interleaved in one process.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/attention_layouts.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import blockforge
from blockforge.compile.onnx_backend import BlockforgeBackend
from blockforge.graph import MHASpec, build
from blockforge.graph import ort as ort_runner
from blockforge.graph.model_io import random_inputs, signature
from blockforge.targets.toolchain import cpu_model, physical_cores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    a = ap.parse_args()
    blockforge.configure()
    for variant in (dict(), dict(causal=True, mask="bool")):
        runs, outs = {}, {}
        for layout in ("packed", "attention-op"):
            spec = MHASpec(d_model=a.d_model, heads=a.heads, layout=layout, batch=1, seq=a.seq, **variant)
            model, _ = build(spec)
            ins, _ = signature(model)
            x = random_inputs(ins, {}, seed=0)
            rep = BlockforgeBackend.prepare(model)
            args = [x[s.name] for s in ins]
            session = ort_runner.session(model, threads=physical_cores())  # TVM's pool size too
            runs[f"tvm {layout}"] = lambda rep=rep, args=args: rep.run(args)
            runs[f"ort {layout}"] = lambda s=session, x=x: s.run(None, x)
            outs[layout] = rep.run(args)[0]
        times = {k: [] for k in runs}
        for _ in range(2):
            for f in runs.values():
                f()
        for _ in range(a.repeat):  # interleaved: every contender once per round
            for k, f in runs.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        diff = float(np.abs(outs["packed"] - outs["attention-op"]).max())
        print(f"MHA d{a.d_model} h{a.heads} batch 1 seq {a.seq} {variant or 'no mask'} on {cpu_model()}: median ms "
              + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in times.items())
              + f"; max |packed - attention-op| {diff:.1e}")


if __name__ == "__main__":
    main()
