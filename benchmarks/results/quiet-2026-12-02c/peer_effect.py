"""Does a peer engine in the same process slow blockforge's module? One decode step entry
(`decode`, Llama-style GQA loop artifact at P = 128, no peers until phase B) timed alone, then
interleaved with ONNX Runtime, then with OpenVINO, then with both, then alone again (the bench
harness's measure_interleaved each time, 2 threads). Quiet machine only.

    .venv/bin/python benchmarks/results/quiet-2026-12-02c/peer_effect.py ARTIFACT MODEL.onnx
"""
import os
import sys
import time
from pathlib import Path

import numpy as np

import blockforge

blockforge.configure(redirect_native_output=False)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from decode_inplace import _start  # noqa: E402

from blockforge.bench import REGISTRY, measure_interleaved  # noqa: E402
from blockforge.bench.contenders import BenchModel  # noqa: E402
from blockforge.bench.decode import EntryRunner  # noqa: E402
from blockforge.compile.artifact.runtime import load_artifact  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402

art, model = Path(sys.argv[1]), Path(sys.argv[2])
mod = load_artifact(art)
feeds = _start(model, 128, seed=1)
tvm_step = EntryRunner(mod, feeds, "decode")
threads = 2


def med(calls, n=40):
    return {k: round(float(np.median(v)), 3) for k, v in measure_interleaved(calls, n, warmup=2).items()}


print("load", os.getloadavg())
print("A alone", med({"blockforge": tvm_step}))
shapes = {k: np.shape(v) for k, v in feeds.items()}
s = open_model(model, "host", input_shapes=shapes, prepare=False)
bm = BenchModel(session=s, onnx=s.model, spec=None, dims={})
ort = REGISTRY["ort"].make_runner(bm, feeds, threads)
print("B with ORT", med({"blockforge": tvm_step, "ort": ort}))
ov = REGISTRY["openvino"].make_runner(bm, feeds, threads, precision="f32")
print("C with OpenVINO", med({"blockforge": tvm_step, "openvino": ov}))
print("D with both", med({"blockforge": tvm_step, "ort": ort, "openvino": ov}))
print("E alone again (peers loaded, idle)", med({"blockforge": tvm_step}))
time.sleep(2)
print("F alone after 2 s", med({"blockforge": tvm_step}))
print("load", os.getloadavg())
