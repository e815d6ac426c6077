"""HF BERT-base QDQ whole: batched int8 attention products against dequantize + float32 ones
(rewrite.int8_gemm batched_products, patched per build; the int8-batched-products ablation), each
build twice, interleaved, 10 rounds.

    BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src python hf_batched_ab.py SEQ
"""
import numpy as np, tvm, time, sys
from tvm import relax
import blockforge; blockforge.configure()
from blockforge.compile.session import open_model
import blockforge.compile.quant.rewrite as rw
seq = int(sys.argv[1])
s = open_model("/tmp/p2/bert_qdq.onnx", "host", {"s33": 1, "s50": seq, "s6": 1})
rng = np.random.default_rng(0)
inputs = {"input_ids": rng.integers(0, 30000, (1, seq)).astype(np.int64), "attention_mask": np.ones((1, seq), np.int64)}
orig = rw.int8_gemm
fns, outs = {}, {}
for name, batched in (("batched", True), ("per-default", False), ("per-default (2)", False), ("batched (2)", True)):
    def patched(*a, **k):
        k["batched_products"] = batched
        return orig(*a, **k)
    rw.int8_gemm = patched
    vm = relax.VirtualMachine(s.build().executable, tvm.cpu())
    rw.int8_gemm = orig
    args = [tvm.runtime.tensor(inputs[i.name]) for i in s.inputs]
    fns[name] = (vm["main"], args)
    o = vm["main"](*args)
    outs[name] = (o[0] if not hasattr(o, "numpy") else o).numpy()
print("max |batched - float products|", float(np.abs(outs["batched"] - outs["per-default"]).max()))
t = {k: [] for k in fns}
for _ in range(10):
    for k, (f, a) in fns.items():
        t0 = time.perf_counter(); f(*a); t[k].append(time.perf_counter() - t0)
m = {k: round(np.median(v) * 1e3, 2) for k, v in t.items()}
print(m, "batched/default", m["batched"] / m["per-default"], m["batched (2)"] / m["per-default (2)"])
import os; print(os.getloadavg())
