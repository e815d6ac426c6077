"""Prefill A/B: the one build's main (seq, past symbolic) with qkv_heads and without it (what
main ran before 93b36ed), and the build bound at P = 0, seq = S; interleaved, medians."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: decode_entries
import numpy as np, onnx
import blockforge
from decode_entries import _feeds, _check, _ort
from blockforge.bench.contenders import TvmRunner
from blockforge.bench.decode import cache_layout, shapes
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling
from blockforge.compile.session import open_model

model = Path(sys.argv[1]); seq = int(sys.argv[2]); repeat = int(sys.argv[3])
blockforge.configure(redirect_native_output=True)
m = onnx.load(str(model), load_external_data=False)
batch = {i.type.tensor_type.shape.dim[0].dim_param: 1 for i in m.graph.input if i.name in ("input_ids", "attention_mask")}
sym = open_model(model, "host", batch)
shape = shapes(cache_layout(m), 0, seq)
bound = open_model(model, "host", shape)
feeds = _feeds(bound, seed=seq)
mk = lambda s, ex: TvmRunner(ex, s.target.device, bound.inputs, bound.outputs, feeds)
runners = {"ort": _ort(model, bound, feeds, blockforge.settings.physical_cores())}
want = runners["ort"].outputs()
runners["main, qkv_heads"] = mk(sym, sym.build().executable)
runners["main, without"] = mk(sym, sym.build(without=frozenset({"qkv-heads"})).executable)
runners["static"] = mk(bound, bound.build().executable)
_check(runners, want)
print(f"SGEMM {sgemm_ceiling():.0f} GFLOP/s", flush=True)
med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=1).items()}
print(f"SGEMM {sgemm_ceiling():.0f} GFLOP/s")
print(model.name, "seq", seq, ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
for k in ("main, qkv_heads", "main, without"):
    print(f"  {k} / static {med[k] / med['static']:.3f}x")
