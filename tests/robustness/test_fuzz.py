"""Mutation fuzz of `inspect`/`verify`: >= 1000 mutated models, no crash, no traceback.

BLOCKFORGE_FUZZ_N raises the count for a longer local run, e.g.
    BLOCKFORGE_FUZZ_N=20000 .venv/bin/pytest tests/robustness/test_fuzz.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

N = int(os.environ.get("BLOCKFORGE_FUZZ_N", "1000"))
SEED = int(os.environ.get("BLOCKFORGE_FUZZ_SEED", "20261129"))


def test_mutated_models_never_crash(tmp_path):
    out = tmp_path / "fuzz.json"
    worker = Path(__file__).with_name("fuzz_worker.py")
    p = subprocess.run([sys.executable, str(worker), str(N), str(SEED), str(out)], capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, f"fuzz worker died (rc {p.returncode}): {p.stderr[-2000:]}"
    res = json.loads(out.read_text())
    assert res["inputs"] == N >= 1000
    assert res["bad"] == [], json.dumps(res["bad"][:5], indent=1)
    # The mutants must reach past the parser: some are accepted, some fail parity or checks.
    assert res["codes"].get("inspect:0", 0) > 0 and res["codes"].get("inspect:2", 0) > 0, res["codes"]
    print(json.dumps({k: v for k, v in res.items() if k != "bad"}))
