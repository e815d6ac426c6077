"""The static build with and without its panel prefetch, and the symbolic build: static_rows.py K N M REPEAT ORDER..."""
import sys
from pathlib import Path
import numpy as np
import blockforge
from blockforge.bench.contenders import TvmRunner
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling
from blockforge.compile.session import open_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from window_ab import model  # noqa: E402
K, N, M, repeat = (int(a) for a in sys.argv[1:5]); order = sys.argv[5:]
path = model(K, N)
blockforge.configure(redirect_native_output=True)
sym, bound = open_model(path, "host", {}), open_model(path, "host", {"seq": M})
feeds = {"x": np.random.default_rng(1).standard_normal((1, M, K), dtype=np.float32)}
plan = {"sym": (sym, frozenset()), "static": (bound, frozenset()), "nopf": (bound, frozenset({"panel-prefetch"})),
        "norow": (bound, frozenset({"row-tiles"}))}
runners = {k: TvmRunner(plan[k][0].build(without=plan[k][1]).executable, "cpu", bound.inputs, bound.outputs, feeds) for k in order}
before = sgemm_ceiling()
med = {k: float(np.median(v)) for k, v in measure_interleaved(runners, repeat, warmup=2).items()}
print(f"{M}x{K}x{N} SGEMM {before:.0f}: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
