"""Three identical bf16 builds of the BERT-base FFN (seq 128), interleaved in one process: the
fifth pass read 2.465 and 1.660 ms for two builds of the same module (bf16_gemm.py's FFN row).
Equal medians here clear the harness; a spread says the first-built module is slower.
Argument: threads (1: process CPU time)."""
import os, sys, time, tempfile
os.environ.setdefault("BLOCKFORGE_ISOLATE", "0")
T = sys.argv[1] if len(sys.argv) > 1 else "2"
os.environ["TVM_NUM_THREADS"] = T
import numpy as np
from pathlib import Path
from blockforge.bench import measure_interleaved
from blockforge.compile.session import open_model
from blockforge.graph import FFNSpec, export
from blockforge.graph.model_io import random_inputs
import tvm
from tvm import relax
clock = time.process_time if T == "1" else time.perf_counter
tmp = Path(tempfile.mkdtemp())
model = export(FFNSpec(d_model=768, d_ff=3072, activation="gelu"), tmp / "ffn.onnx").model_path
dims = {"batch": 1, "seq": 128}
calls = {}
for i in range(3):
    s = open_model(model, "host", dims, precision="bf16")
    res = s.build()
    vm = relax.VirtualMachine(res.executable, tvm.cpu())
    inputs = random_inputs(s.inputs, dims, seed=0)
    args = [tvm.runtime.tensor(inputs[x.name]) for x in s.inputs]
    calls[f"build{i}"] = (lambda vm=vm, args=args: vm["main"](*args))
med = {k: float(np.median(v)) for k, v in measure_interleaved(calls, 30, warmup=2, clock=clock).items()}
print(T, "threads", open("/proc/loadavg").read().split()[:3], {k: round(v, 3) for k, v in med.items()})
