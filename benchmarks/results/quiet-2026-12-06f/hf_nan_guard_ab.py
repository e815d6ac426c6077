"""HF BERT-base QDQ (dynamo export, blockforge quantize --mode static --per-channel: /tmp/p2/bert_qdq.onnx)
whole, the nan-guard ablation against the default build, interleaved, 10 rounds; outputs against ORT.

    BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src python hf_nan_guard_ab.py SEQ
"""
import numpy as np, tvm, time, sys
from tvm import relax
import blockforge; blockforge.configure()
from blockforge.compile.session import open_model
from blockforge.graph import ort as ort_runner
seq = int(sys.argv[1])
s = open_model("/tmp/p2/bert_qdq.onnx", "host", {"s33": 1, "s50": seq, "s6": 1})
rng = np.random.default_rng(0)
mask = np.ones((1, seq), np.int64); mask[0, seq - 7:] = 0
inputs = {"input_ids": rng.integers(0, 30000, (1, seq)).astype(np.int64), "attention_mask": mask}
ref = ort_runner.run(s.model, inputs)
fns = {}
for name, w in (("new", frozenset()), ("-nan-guard", frozenset({"nan-guard"}))):
    vm = relax.VirtualMachine(s.build(without=w).executable, tvm.cpu())
    args = [tvm.runtime.tensor(inputs[i.name]) for i in s.inputs]
    out = vm["main"](*args)
    o = out[0].numpy() if hasattr(out, "__len__") and not hasattr(out, "numpy") else out.numpy()
    r0 = next(iter(ref.values()))
    print(name, "max |tvm - ort|", float(np.abs(o - r0).max()), "ref max", float(np.abs(r0).max()))
    fns[name] = (vm["main"], args)
t = {k: [] for k in fns}
for _ in range(10):
    for k, (f, a) in fns.items():
        t0 = time.perf_counter(); f(*a); t[k].append(time.perf_counter() - t0)
m = {k: np.median(v) * 1e3 for k, v in t.items()}
print(m, "new/without", m["new"] / m["-nan-guard"])
