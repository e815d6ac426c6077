"""float16 models on CPU: the fp32-compute phase (what ONNX Runtime's CPU provider does:
float32 inside, float16 at the edges) against the previous float16-storage scheme
(ToMixedPrecision: float32 accumulation, float16 between ops). Latency interleaved in one
process, and the overflow cases that motivated the change.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/fp16_cpu.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("BLOCKFORGE_ISOLATE", "0")  # our own models; no child-process check

from blockforge import configure  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import FFNSpec, MHASpec, export  # noqa: E402
from blockforge.graph import ort as ort_runner  # noqa: E402
from blockforge.graph.model_io import random_inputs  # noqa: E402

CASES = [("bert_mha_fp16", MHASpec(d_model=768, heads=12, dtype="float16"), 128),
         ("bert_ffn_fp16", FFNSpec(d_model=768, d_ff=3072, activation="gelu", dtype="float16"), 128)]

SMOKE_CASES = [("tiny_mha_fp16", MHASpec(d_model=32, heads=2, dtype="float16"), 8),
               ("tiny_ffn_fp16", FFNSpec(d_model=32, d_ff=64, activation="gelu", dtype="float16"), 8)]


def _build(session, scheme: str):
    """The executable with the CPU float16 phase as `scheme` ('fp32-compute' or 'fp16-storage')."""
    return session.build(without={"fp32-compute"} if scheme == "fp16-storage" else set()).executable


def _runner(ex, session, inputs):
    import tvm
    from tvm import relax

    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(inputs[s.name], dev) for s in session.inputs]
    fn = vm["main"]
    return lambda: fn(*args), lambda: {o.name: v.numpy() for o, v in zip(session.outputs, [fn(*args)])}


def _overflow(session, scheme, model, inputs):
    run = _runner(_build(session, scheme), session, inputs)[1]
    ours = next(iter(run().values())).astype(np.float32)
    ref = next(iter(ort_runner.run(model, inputs).values())).astype(np.float32)
    same = np.array_equal(~np.isfinite(ours), ~np.isfinite(ref))
    return int((~np.isfinite(ours)).sum()), int((~np.isfinite(ref)).sum()), same, ours.size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few samples: proves the script runs (tests/test_benchmarks.py), measures nothing")
    a = ap.parse_args()
    configure(redirect_native_output=False)
    from blockforge.targets.toolchain import cpu_model

    cpu = cpu_model()
    print(f"CPU: {cpu}, {os.cpu_count()} logical cores; shared machine: read ranks, not digits")
    with tempfile.TemporaryDirectory(prefix="fp16-cpu-") as tmp:  # the exported blocks, removed at the end
        return _measure(a, Path(tmp))


def _measure(a, tmp: Path) -> int:
    for name, spec, seq in (SMOKE_CASES if a.smoke else CASES):
        path = export(spec, tmp / f"{name}.onnx").model_path
        dims = {"batch": 1, "seq": seq}
        session = open_model(path, "host", dims)
        inputs = random_inputs(session.inputs, dims, seed=0)
        calls = {s: _runner(_build(session, s), session, inputs)[0] for s in ("fp16-storage", "fp32-compute")}
        samples = {s: [] for s in calls}
        for _ in range(a.repeat):  # interleaved: drift hits both alike
            for s, call in calls.items():
                call()
                t0 = time.perf_counter()
                call()
                samples[s].append((time.perf_counter() - t0) * 1e3)
        med = {s: float(np.median(v)) for s, v in samples.items()}
        print(f"{name} seq {seq}: " + ", ".join(f"{s} {m:.3f} ms" for s, m in med.items())
              + f" (fp32-compute / fp16-storage = {med['fp32-compute'] / med['fp16-storage']:.2f})")
    # the overflow cases (d_model 64, seq 16)
    for name, spec, scale in (("mha x300", MHASpec(d_model=64, heads=4, dtype="float16"), 300.0),
                              ("ffn 60000", FFNSpec(d_model=64, dtype="float16"), None)):
        path = export(spec, tmp / "small.onnx").model_path
        dims = {"batch": 1, "seq": 16}
        session = open_model(path, "host", dims)
        base = random_inputs(session.inputs, dims, seed=0)
        inputs = {k: (np.full_like(v, 60000) if scale is None else (v.astype(np.float32) * scale).astype(v.dtype))
                  for k, v in base.items()}
        for s in ("fp16-storage", "fp32-compute"):
            n_ours, n_ort, same, size = _overflow(session, s, session.model, inputs)
            print(f"{name}: {s}: {n_ours} non-finite of {size} outputs, ORT {n_ort}; same positions: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
