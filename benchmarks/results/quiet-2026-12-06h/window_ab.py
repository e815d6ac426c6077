"""A GEMM over symbolic rows with a crop (N not a whole number of 64-wide weight panels, as GPT-2's
LM head): the build with `window-partitioned`, the same without it, and the build bound to the
row count, interleaved in one process (medians), in the order given.

    window_ab.py K N M REPEAT ORDER...   (ORDER: new, old (without window-partitioned), static)
"""
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import blockforge
from blockforge.bench.contenders import TvmRunner
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling
from blockforge.compile.session import open_model



def model(K: int, N: int) -> Path:
    """x (1, seq, K) @ w (K, N), random weights, written once."""
    path = Path(f"/tmp/window_ab_{K}_{N}.onnx")
    if not path.exists():
        w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((K, N), dtype=np.float32) * 0.02, "w")
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="lm_head")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", N])], [w])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.save(m, str(path))
    return path


def main():
    K, N, M, repeat = (int(a) for a in sys.argv[1:5])
    order = sys.argv[5:]
    path = model(K, N)
    blockforge.configure(redirect_native_output=True)
    sym, bound = open_model(path, "host", {}), open_model(path, "host", {"seq": M})
    feeds = {"x": np.random.default_rng(1).standard_normal((1, M, K), dtype=np.float32)}
    plan = {"new": (sym, frozenset()), "old": (sym, frozenset({"window-partitioned"})), "static": (bound, frozenset())}
    runners = {k: TvmRunner(plan[k][0].build(without=plan[k][1]).executable, "cpu", bound.inputs, bound.outputs, feeds)
               for k in order}
    outs = {k: r.outputs()[0] for k, r in runners.items()}
    assert all(np.array_equal(o, outs[order[0]]) for o in outs.values())
    before = sgemm_ceiling()
    med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=2).items()}
    print(f"{M}x{K}x{N} order {order} SGEMM {before:.0f} / {sgemm_ceiling():.0f} GFLOP/s: "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in med.items())
          + (f" | new/old {med['new'] / med['old']:.3f}" if "new" in med and "old" in med else "")
          + (f", new/static {med['new'] / med['static']:.3f}" if "new" in med and "static" in med else ""), flush=True)


if __name__ == "__main__":
    main()
