"""GPT-2 prefill (empty cache) from the artifact build with seq and past symbolic: bounded
(`--shape batch=1,seq=..B,past=..B`, compile/passes/dim_bounds.py) against unbounded, and the
build bound at P = 0 and seq (static), built in the order given, timed interleaved (medians).

    prefill_bounds.py MODEL.onnx SEQ REPEAT BOUND ORDER...   (ORDER: bounded, sym, static)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quiet-2026-12-06h"))
import numpy as np  # noqa: E402
import onnx  # noqa: E402

import blockforge  # noqa: E402
from blockforge.bench.contenders import TvmRunner  # noqa: E402
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from prefill_window import _check, prepared  # noqa: E402


def bounded_session(model: Path, ub: int):
    """The model opened with batch 1 and seq, past bounded by `ub` (past_seq: 2 ub, derived)."""
    m = onnx.load(str(model), load_external_data=False)
    dims = {i.type.tensor_type.shape.dim[0].dim_param: 1 for i in m.graph.input if i.name in ("input_ids", "attention_mask")}
    s = open_model(model, "host", {**dims, "seq": {"max": ub}, "past": {"max": ub}})
    assert s.binding.bounds_dict() == {"seq": ub, "past": ub, "past_seq": 2 * ub}, s.binding.bounds
    return s


def main():
    model, seq, repeat, ub, order = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
    blockforge.configure(redirect_native_output=True)
    sym, bound, feeds, want = prepared(model, seq)
    plan = {"bounded": bounded_session(model, ub), "sym": sym, "static": bound}
    runners = {k: TvmRunner(plan[k].build().executable, "cpu", bound.inputs, bound.outputs, feeds) for k in order}
    _check(runners, want)
    before = sgemm_ceiling()
    med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=1).items()}
    print(f"seq {seq} bound {ub} order {order} SGEMM {before:.0f} / {sgemm_ceiling():.0f} GFLOP/s: "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
          + f" | bounded/sym {med['bounded'] / med['sym']:.3f}, bounded/static {med['bounded'] / med['static']:.3f}, "
            f"sym/static {med['sym'] / med['static']:.3f}", flush=True)


if __name__ == "__main__":
    main()
