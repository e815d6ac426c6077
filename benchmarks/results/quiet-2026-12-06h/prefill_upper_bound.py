import sys, os
sys.path.insert(0, "/work/main/benchmarks")
from pathlib import Path
import numpy as np, onnx
import blockforge
from decode_entries import _feeds, _check, _ort
from blockforge.bench.contenders import TvmRunner
from blockforge.bench.decode import cache_layout, shapes
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling
from blockforge.compile.session import open_model
model = Path(sys.argv[1]); seq = int(sys.argv[2]); repeat = int(sys.argv[3]); plan = sys.argv[4:]
blockforge.configure(redirect_native_output=True)
m = onnx.load(str(model), load_external_data=False)
batch = {i.type.tensor_type.shape.dim[0].dim_param: 1 for i in m.graph.input if i.name in ("input_ids", "attention_mask")}
sym = open_model(model, "host", batch)
bound = open_model(model, "host", shapes(cache_layout(m), 0, seq))
feeds = _feeds(bound, seed=seq)
want = _ort(model, bound, feeds, blockforge.settings.physical_cores()).outputs()
runners = {}
for k in plan:
    os.environ["BF_UB"] = "seq=1024,past=1024" if k == "ub" else ""
    s = bound if k == "static" else sym
    runners[k] = TvmRunner(s.build().executable, s.target.device, bound.inputs, bound.outputs, feeds)
_check(runners, want)
before = sgemm_ceiling()
med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=1).items()}
print(f"seq {seq} SGEMM {before:.0f} / {sgemm_ceiling():.0f}: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items())
      + " | " + ", ".join(f"{k}/static {v / med['static']:.3f}" for k, v in med.items() if k != "static"), flush=True)
