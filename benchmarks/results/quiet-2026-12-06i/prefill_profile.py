"""Per-kernel profile of GPT-2's prefill (seq 128, empty cache): the bounded symbolic build's main
against the static build (P = 0, seq 128), kernels grouped by name with the digits dropped
(fused_matmul3_add7 -> fused_matmul_add), medians of 10 instrumented runs each.

    prefill_profile.py MODEL.onnx SEQ BOUND
"""
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quiet-2026-12-06h"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import blockforge  # noqa: E402
from blockforge.bench.contenders import TvmRunner  # noqa: E402
from blockforge.bench.harness import profile_vm  # noqa: E402
from prefill_bounds import bounded_session  # noqa: E402
from prefill_window import prepared  # noqa: E402

model, seq, ub = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
blockforge.configure(redirect_native_output=True)
sym, bound, feeds, want = prepared(model, seq)
bounded = bounded_session(model, ub)
groups = {}
for k, s in (("bounded", bounded), ("static", bound)):
    r = TvmRunner(s.build().executable, "cpu", bound.inputs, bound.outputs, feeds)
    g = defaultdict(lambda: [0, 0.0])
    for p in profile_vm(r, runs=10):
        key = re.sub(r"\d+", "", p.name)
        g[key][0] += p.calls
        g[key][1] += p.total_ms
    groups[k] = g
keys = sorted(set(groups["bounded"]) | set(groups["static"]), key=lambda k: -max(groups[x][k][1] for x in groups))
print(f"{'kernel group':60s} {'bounded ms':>10s} {'calls':>5s} {'static ms':>10s} {'calls':>5s}")
for k in keys:
    b, s = groups["bounded"].get(k, [0, 0.0]), groups["static"].get(k, [0, 0.0])
    print(f"{k[:60]:60s} {b[1]:10.3f} {b[0]:5d} {s[1]:10.3f} {s[0]:5d}")
print(f"{'sum':60s} {sum(v[1] for v in groups['bounded'].values()):10.3f}       "
      f"{sum(v[1] for v in groups['static'].values()):10.3f}")
