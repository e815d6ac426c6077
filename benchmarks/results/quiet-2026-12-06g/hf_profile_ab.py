# HF BERT-base QDQ: the build with and without an ablation (argv[2]), each profiled (softmax kernels and all
# kernels, profile_vm, 5 runs) then timed interleaved (15 rounds). PYTHONPATH=build/dev-src python hf_profile_ab.py 512 reciprocal
import sys, numpy as np, tvm
import blockforge; blockforge.configure(redirect_native_output=True)
from blockforge.bench.contenders import TvmRunner
from blockforge.bench.harness import profile_vm, measure_interleaved
from blockforge.compile.session import open_model
from blockforge.graph.model_io import random_inputs
dims = {"s33": 1, "s50": int(sys.argv[1]), "s6": 1}
ab = sys.argv[2]
s = open_model("/tmp/p2/bert_qdq.onnx", "host", dims)
feeds = random_inputs(s.inputs, dims, seed=0)
runners = {k: TvmRunner(s.build(without=w).executable, s.target.device, s.inputs, s.outputs, feeds)
           for k, w in (("new", frozenset()), ("without", frozenset({ab})))}
for k, r in runners.items():
    prof = profile_vm(r, runs=5)
    sm = [p for p in prof if "softmax" in p.name]
    print(k, "softmax kernels:", len(sm), "sum %.2f ms" % sum(p.total_ms for p in sm), "all kernels %.1f ms" % sum(p.total_ms for p in prof))
med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, 15, warmup=1).items()}
print(med, "new/without %.3f" % (med["new"] / med["without"]))
