"""Prefill A/B with the build order rotated: one process per order, each building the one build's
main (seq, past symbolic), main without the `elementwise` rule, and the build bound at P = 0,
seq = S, then timing them interleaved (medians). Two identical builds measured up to 1.067x
apart by build order (whole_ab.py), so each ratio is read across every order.

    prefill_orders.py MODEL.onnx SEQ REPEAT ORDER [pair]   (ORDER: which runner is built first;
                                                             pair: main and static only)
"""
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

model = Path(sys.argv[1]); seq = int(sys.argv[2]); repeat = int(sys.argv[3]); order = int(sys.argv[4])
blockforge.configure(redirect_native_output=True)
m = onnx.load(str(model), load_external_data=False)
batch = {i.type.tensor_type.shape.dim[0].dim_param: 1 for i in m.graph.input if i.name in ("input_ids", "attention_mask")}
sym = open_model(model, "host", batch)
bound = open_model(model, "host", shapes(cache_layout(m), 0, seq))
feeds = _feeds(bound, seed=seq)
want = _ort(model, bound, feeds, blockforge.settings.physical_cores()).outputs()
plan = [("main", sym, frozenset()), ("main, no elementwise", sym, frozenset({"elementwise"})), ("static", bound, frozenset())]
pair = sys.argv[5:] == ["pair"]
if pair:
    del plan[1]
plan = plan[order:] + plan[:order]
runners = {k: TvmRunner(s.build(without=w).executable, s.target.device, bound.inputs, bound.outputs, feeds)
           for k, s, w in plan}
_check(runners, want)
before = sgemm_ceiling()
med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=1).items()}
print(f"{model.name} seq {seq} order {[k for k, _, _ in plan]} SGEMM {before:.0f} / {sgemm_ceiling():.0f} GFLOP/s: "
      + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
print(f"  main / static {med['main'] / med['static']:.3f}x" + ("" if pair else
      f", no elementwise / static {med['main, no elementwise'] / med['static']:.3f}x, main / no elementwise "
      f"{med['main'] / med['main, no elementwise']:.3f}x"), flush=True)
