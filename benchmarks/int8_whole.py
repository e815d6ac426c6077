"""A quantized whole model (issue #19: BERT-base 12 layers in int8, seq 128 and 512): blockforge
against ONNX Runtime and OpenVINO on the same quantized file, timed interleaved.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/int8_whole.py bert_dyn.onnx --seq 512 [--repeat 6] [--threads 1]

(`blockforge quantize bert.onnx --mode dynamic|static -o ...` makes the file.) Over 12 layers the
engines' rounding flips exceed the int8 parity row of one block; such a model is judged as a whole
(graph/tolerance.py's "deep" rows, rel L2) by `bench` and `verify`. Here every contender's
elementwise distance to ORT is printed too (with the output's range), and the times are ratios to
blockforge. `--threads 1`: one thread each, in CPU time (TVM's pool and ORT run on the calling
thread; ratios that hold on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--threads" in sys.argv[:-1]:  # TVM's pool reads its size when it starts
    os.environ["TVM_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import numpy as np  # noqa: E402

import blockforge  # noqa: E402

blockforge.configure(redirect_native_output=False)


def _has_dims(model, want) -> bool:
    from blockforge.graph.model_io import load_model

    found = {d.dim_param for i in load_model(model).graph.input for d in i.type.tensor_type.shape.dim}
    return set(want) <= found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a quantized encoder with input_ids / attention_mask (batch, seq)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None, help="1: CPU time of one thread (default: the cores, wall)")
    a = ap.parse_args(argv)
    from blockforge.bench.contenders import REGISTRY, BenchModel, TvmRunner
    from blockforge.bench.harness import measure_interleaved
    from blockforge.compile.session import open_model
    from blockforge.graph.model_io import load_model, random_inputs

    # (batch, seq) by those names (the legacy exporter's), else every input as 1 x seq (dynamo's s33, s50)
    names = [i.name for i in load_model(a.model).graph.input]
    shape = {"batch": 1, "seq": a.seq} if _has_dims(a.model, ("batch", "seq")) else ",".join(f"{n}=1x{a.seq}" for n in names)
    s = open_model(a.model, "host", shape)
    threads = a.threads or int(s.target.target_json.get("num-cores", 1))
    dims = s.dims
    inputs = random_inputs(s.inputs, dims, seed=0)
    if "attention_mask" in inputs:
        inputs["attention_mask"] = np.ones_like(inputs["attention_mask"])  # no padding
    bm = BenchModel(s, load_model(a.model), None, {})
    runners = {"blockforge": TvmRunner(s.build().executable, s.target.device, s.inputs, s.outputs, inputs)}
    for peer in ("ort", "openvino"):
        if REGISTRY[peer].available():
            runners[peer] = REGISTRY[peer].make_runner(bm, inputs, threads)
    from blockforge.graph.tolerance import rel_l2

    ref = runners["ort"].outputs()[0].astype(np.float64)
    step = float(np.abs(ref).max()) / 255  # one 8-bit step of the output, as graph/tolerance.py counts it
    for name, r in runners.items():
        d = np.abs(r.outputs()[0] - ref)
        print(f"{name}: max |out - ORT| {float(d.max()):.3e} = {float(d.max()) / step:.1f} steps of max|ORT|/255 "
              f"({float(np.mean(d > 4 * step)):.1%} beyond 4), rel L2 {rel_l2(r.outputs()[0], ref):.2e} "
              f"(output range {float(np.ptp(ref)):.2f})")
    clock = time.thread_time if threads == 1 else time.perf_counter
    load0 = os.getloadavg()[0]
    med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, a.repeat, 1, clock=clock).items()}
    print(f"\n{Path(a.model).name} seq {a.seq}, {threads} thread(s), {'CPU' if threads == 1 else 'wall'} time, "
          f"load {load0:.1f} -> {os.getloadavg()[0]:.1f}, {a.repeat} interleaved samples")
    best = min(v for k, v in med.items() if k != "blockforge")
    print("\n| contender | time / blockforge |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v / med['blockforge']:.2f}x |")
    print(f"\nblockforge / best peer: {med['blockforge'] / best:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
