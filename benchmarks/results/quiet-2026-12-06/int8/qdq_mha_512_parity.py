"""Why verify fails the int8 QDQ MHA at seq 512 (blockforge export mha --d-model 768 --heads 12
--quantize static --per-channel): blockforge against ONNX Runtime (default optimizations: its
fused int8 kernels) and against ORT running the QDQ graph as written (ORT_DISABLE_ALL), and ORT's
two runs against each other, in quantization steps of 0.0157 * max|ORT| (the int8 parity row),
with blockforge's int8 rewrites and the attention's exp2 left out one at a time.

    .venv/bin/python qdq_mha_512_parity.py mha_static.onnx 512
"""
import os
import sys

os.environ["BLOCKFORGE_ISOLATE"] = "0"
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

import blockforge  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import ort as ort_runner  # noqa: E402
from blockforge.graph.model_io import random_inputs  # noqa: E402

blockforge.configure(redirect_native_output=True)
path, seq = sys.argv[1], int(sys.argv[2])
s = open_model(path, "host", {"batch": 1, "seq": seq})
inputs = random_inputs(s.inputs, {}, seed=0)
ref = ort_runner.run(onnx.load(path), inputs)["output"]
so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
raw = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, inputs)[0]
step = 0.0157 * np.abs(ref).max()


def show(name, a, b):
    d = np.abs(a - b)
    print(f"{name}: max {d.max():.3e} = {d.max() / step:.2f} steps; elements > 1 step {(d > step).sum()}")


for w in (frozenset(), frozenset({"attention-exp2"}), frozenset({"int8-gemm"}), frozenset({"int8-qdq-epilogue"})):
    vm = relax.VirtualMachine(s.build(without=w).executable, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(inputs[i.name]) for i in s.inputs]).numpy()
    show(f"blockforge {'without ' + ','.join(sorted(w)) if w else '(default)'} vs ORT", got, ref)
    if not w:
        show("blockforge vs ORT as written (ORT_DISABLE_ALL)", got, raw)
show("ORT vs ORT as written", ref, raw)
