"""GPT-2 prefill (seq 128, empty cache): the one build's main, the same without
`window-partitioned`, and the build bound at P = 0, seq = 128, built in the order given, timed
interleaved (medians). As benchmarks/results/quiet-2026-12-06b/prefill_orders.py.

    prefill_window.py MODEL.onnx SEQ REPEAT ORDER...   (ORDER: main, old, static)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: decode_entries
import numpy as np
import onnx

import blockforge
from decode_entries import _check, _feeds, _ort
from blockforge.bench.contenders import TvmRunner
from blockforge.bench.decode import cache_layout, shapes
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling
from blockforge.compile.session import open_model


def prepared(model: Path, seq: int):
    """(the one build's session: batch bound, the session bound at P = 0 and seq, feeds, ORT's outputs)."""
    m = onnx.load(str(model), load_external_data=False)
    batch = {i.type.tensor_type.shape.dim[0].dim_param: 1 for i in m.graph.input if i.name in ("input_ids", "attention_mask")}
    sym = open_model(model, "host", batch)
    bound = open_model(model, "host", shapes(cache_layout(m), 0, seq))
    feeds = _feeds(bound, seed=seq)
    return sym, bound, feeds, _ort(model, bound, feeds, blockforge.settings.physical_cores()).outputs()


if __name__ == "__main__":
    model, seq, repeat, order = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    blockforge.configure(redirect_native_output=True)
    sym, bound, feeds, want = prepared(model, seq)
    plan = {"main": (sym, frozenset()), "old": (sym, frozenset({"window-partitioned"})), "static": (bound, frozenset())}
    runners = {k: TvmRunner(plan[k][0].build(without=plan[k][1]).executable, "cpu", bound.inputs, bound.outputs, feeds)
               for k in order}
    _check(runners, want)
    before = sgemm_ceiling()
    med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=1).items()}
    print(f"{model.name} seq {seq} order {order} SGEMM {before:.0f} / {sgemm_ceiling():.0f} GFLOP/s: "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
          + f" | main/static {med['main'] / med['static']:.3f}, old/static {med['old'] / med['static']:.3f}, "
            f"main/old {med['main'] / med['old']:.3f}", flush=True)
