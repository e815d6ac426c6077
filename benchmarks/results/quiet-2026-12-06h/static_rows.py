import sys
from pathlib import Path
import numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
import blockforge
from blockforge.bench.contenders import TvmRunner
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling
from blockforge.compile.session import open_model
K, N, M, repeat = (int(a) for a in sys.argv[1:5]); order = sys.argv[5:]
path = Path(f"/tmp/window_ab_{K}_{N}.onnx")
if not path.exists():
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((K, N), dtype=np.float32) * 0.02, "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="lm_head")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", N])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 8
    onnx.save(m, str(path))
blockforge.configure(redirect_native_output=True)
sym, bound = open_model(path, "host", {}), open_model(path, "host", {"seq": M})
feeds = {"x": np.random.default_rng(1).standard_normal((1, M, K), dtype=np.float32)}
plan = {"sym": (sym, frozenset()), "static": (bound, frozenset()), "nopf": (bound, frozenset({"panel-prefetch"})),
        "norow": (bound, frozenset({"row-tiles"}))}
runners = {k: TvmRunner(plan[k][0].build(without=plan[k][1]).executable, "cpu", bound.inputs, bound.outputs, feeds) for k in order}
before = sgemm_ceiling()
med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=2).items()}
print(f"{M}x{K}x{N} SGEMM {before:.0f}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
