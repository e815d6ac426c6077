"""QDQ FFN: int8-qdq-epilogue on vs off (ablation), same process, interleaved; + ORT, OpenVINO."""
import sys, os, time
if "--threads1" in sys.argv:
    sys.argv.remove("--threads1"); os.environ["TVM_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.setdefault("BLOCKFORGE_ISOLATE", "0")
from pathlib import Path
import numpy as np
from blockforge import configure
configure(redirect_native_output=False)
import tvm
from tvm import relax
from blockforge.bench import REGISTRY, measure_interleaved
from blockforge.bench.contenders import BenchModel
from blockforge.compile.session import open_model
from blockforge.graph import ort as ort_runner
from blockforge.graph.model_io import random_inputs
p, seq, rep = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dims = {"batch": 1, "seq": seq}
s = open_model(p, "host", dims)
inputs = random_inputs(s.inputs, dims, seed=0)
def call(without):
    vm = relax.VirtualMachine(s.build(without=without).executable, tvm.cpu())
    args = [tvm.runtime.tensor(inputs[i.name]) for i in s.inputs]
    return lambda: vm["main"](*args)
after, before = call(frozenset()), call(frozenset({"int8-qdq-epilogue"}))
threads = int(os.environ["TVM_NUM_THREADS"])
ort = ort_runner.session(s.model, threads=threads)
ref = next(iter(ort_runner.run(ort, inputs).values()))
ea, eb = (float(np.abs(f().numpy() - ref).max()) for f in (after, before))
print(f"max |after - ORT| {ea:.3e}, |before - ORT| {eb:.3e}, |after - before| {float(np.abs(after().numpy() - before().numpy()).max()):.3e}, range {float(np.abs(ref).max()):.2f}")
calls = {"after": after, "before (int8-qdq-epilogue off)": before, "ORT": lambda: ort.run(None, inputs)}
ov = REGISTRY["openvino"]
if ov.available():
    calls["OpenVINO"] = ov.make_runner(BenchModel(session=s, onnx=s.model, spec=None, dims=dims), inputs, threads)
l0 = os.getloadavg()
med = {k: float(np.median(v)) for k, v in measure_interleaved(calls, rep, warmup=2, clock=time.process_time if threads == 1 else time.perf_counter).items()}
print(f"{p.name} seq {seq}, {threads} threads ({'process CPU time' if threads == 1 else 'wall'}), load {l0[0]:.1f} -> {os.getloadavg()[0]:.1f}, {rep} interleaved samples")
for k, v in med.items():
    print(f"  {k}: {v / med['after']:.3f}x after ({v:.3f} ms, unquotable)")
