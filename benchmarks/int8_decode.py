"""int8 decode: per-token latency of a dynamic-quantized decoder against its fp32 original.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/int8_decode.py \
        --fp32 gpt2_past_legacy_op17.onnx --int8 gpt2_past_dyn.onnx [--past 128,512] [--repeat 20] [--threads 1]

(`blockforge quantize FP32 --mode dynamic -o INT8` makes the int8 file.) Each model is built
once, for the host, with the past length symbolic and one new token (batch 1, seq 1): the
artifact a decode loop runs. At each --past the four contenders run the same step, timed
interleaved (bench/harness.py): blockforge int8, blockforge fp32, ORT on the int8 file, ORT on
the fp32 file. blockforge int8 is checked against ORT running the same quantized file (the
logits within a few of its rounding steps: blockforge and ORT round the activations' dynamic
scale the same way, but their float sums differ in order), fp32 against ORT fp32. Prints the
int8 / fp32 ratio the issue's target is about (<= 0.35x).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# --threads 1: TVM's pool reads its size when it starts; one thread is then timed in CPU
# time (time.thread_time), which a loaded machine's descheduling does not inflate.
if "--threads" in sys.argv[:-1]:
    os.environ["TVM_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import numpy as np  # noqa: E402

import blockforge

blockforge.configure(redirect_native_output=False)  # noqa: E402


def step_inputs(sigs, past: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One decode step's inputs: random token, random cache, a mask of ones over past + 1."""
    from blockforge.graph.model_io import random_inputs

    out = random_inputs(sigs, {"batch": 1, "seq": 1, "past": past, "past_seq": past + 1}, seed=seed)
    rng = np.random.default_rng(seed)
    for s in sigs:
        if s.name == "input_ids":
            out[s.name] = rng.integers(0, vocab, out[s.name].shape).astype(s.dtype)
        elif s.name == "attention_mask":
            out[s.name] = np.ones_like(out[s.name])
    return out


def build(model: str):
    from blockforge.compile.session import open_model

    s = open_model(model, "host", {"batch": 1, "seq": 1})
    return s, s.build()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32", required=True, help="the decoder with past_key_values inputs")
    ap.add_argument("--int8", required=True, help="its `blockforge quantize --mode dynamic` output")
    ap.add_argument("--past", default="128,512")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--threads", type=int, default=None, help="1: one thread each, timed in CPU time "
                    "(default: the target's cores, wall time)")
    a = ap.parse_args(argv)
    from blockforge.bench.contenders import REGISTRY, BenchModel, TvmRunner
    from blockforge.bench.harness import measure_interleaved
    from blockforge.graph.model_io import load_model

    built = {name: build(path) for name, path in (("int8", a.int8), ("fp32", a.fp32))}
    threads = a.threads or int(built["int8"][0].target.target_json.get("num-cores", 1))
    clock = time.thread_time if threads == 1 else time.perf_counter
    bench_models = {name: BenchModel(built[name][0], load_model(path), None, {})
                    for name, path in (("int8", a.int8), ("fp32", a.fp32))}
    rows = []
    for past in (int(p) for p in a.past.split(",")):
        runners = {}
        for name, (s, art) in built.items():
            inputs = step_inputs(s.inputs, past, a.vocab)
            runners[f"blockforge {name}"] = TvmRunner(art.executable, s.target.device, s.inputs, s.outputs, inputs)
            runners[f"ort {name}"] = REGISTRY["ort"].make_runner(bench_models[name], inputs, threads)
        errs = {}
        for name in built:
            got, want = runners[f"blockforge {name}"].outputs()[0], runners[f"ort {name}"].outputs()[0]
            errs[name] = float(np.max(np.abs(got - want)))
            # int8: one rounding step of the logits' range (tests/test_int8_decode.py); fp32: float error
            bound = float(np.ptp(want)) / 255 if name == "int8" else 1e-3
            assert errs[name] <= bound, (name, past, errs[name], bound)
        print(f"P = {past}: logits max |blockforge - ORT| on the same file: int8 {errs['int8']:.2e}, "
              f"fp32 {errs['fp32']:.2e} (logit range {float(np.ptp(want)):.1f})")
        load0 = os.getloadavg()[0]
        samples = measure_interleaved(runners, a.repeat, 2, clock=clock)
        med = {k: float(np.median(v)) for k, v in samples.items()}
        rows.append((past, load0, os.getloadavg()[0], med))
    print(f"\n{Path(a.int8).name} vs {Path(a.fp32).name}, {threads} thread(s), "
          f"{'CPU' if threads == 1 else 'wall'} time, {a.repeat} interleaved samples")
    print("\n| P | load | blockforge int8 / fp32 | ort int8 / blockforge int8 | ort fp32 / blockforge fp32 |\n|---|---|---|---|---|")
    for past, l0, l1, med in rows:
        print(f"| {past} | {l0:.1f} -> {l1:.1f} | {med['blockforge int8'] / med['blockforge fp32']:.3f}x | "
              f"{med['ort int8'] / med['blockforge int8']:.2f}x | {med['ort fp32'] / med['blockforge fp32']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
