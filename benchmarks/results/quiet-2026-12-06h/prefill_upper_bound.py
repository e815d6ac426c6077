"""GPT-2 prefill with TVM's tir_var_upper_bound for seq and past (BF_UB, prefill_upper_bound.patch
applied) against the same build without it and the static build: prefill_upper_bound.py MODEL SEQ REPEAT ORDER..."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402

import blockforge  # noqa: E402
from blockforge.bench.contenders import TvmRunner  # noqa: E402
from blockforge.bench.harness import measure_interleaved, sgemm_ceiling  # noqa: E402
from prefill_window import _check, prepared  # noqa: E402

model = Path(sys.argv[1]); seq = int(sys.argv[2]); repeat = int(sys.argv[3]); plan = sys.argv[4:]
blockforge.configure(redirect_native_output=True)
sym, bound, feeds, want = prepared(model, seq)
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
