"""Peak memory of one `blockforge compile`: the RSS of the CLI process plus its isolation
children, summed, polled every 20 ms, against the model's weight bytes (issue #18: a BERT-base
export, 436 MB of weights, peaked at 5.1 GB, 12x; the bar is below 3x).

    .venv/bin/python benchmarks/compile_memory.py artifacts/models/bert_legacy_op17.onnx --shape batch=1,seq=128
    .venv/bin/python benchmarks/compile_memory.py --smoke     # a tiny fixture model: proves the script runs

Wall time is printed beside the load average: it moves with the machine's load, the peak does not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMOKE_MODEL = REPO / "tests" / "fixtures" / "models" / "bert_legacy_op17.onnx"


def weight_bytes(path: Path) -> int:
    """Bytes of the model's initializers (raw data as stored)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in m.graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def tree_rss(proc) -> int:
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child that just ended
            pass
    return total


def measure(model: Path, shape: str | None, target: str, out: Path, poll_s: float = 0.02) -> dict:
    """Run `blockforge compile` once; peak summed RSS (bytes) and wall seconds."""
    import psutil

    cmd = [sys.executable, "-m", "blockforge", "compile", str(model), "--target", target, "-o", str(out),
           "--no-tuning", "--force"] + (["--shape", shape] if shape else [])
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = psutil.Process(p.pid)
    peak = 0
    while p.poll() is None:
        try:
            peak = max(peak, tree_rss(proc))
        except psutil.Error:
            pass
        time.sleep(poll_s)
    wall = time.perf_counter() - t0
    stdout, stderr = p.communicate()
    if p.returncode:
        raise SystemExit(f"compile failed (rc {p.returncode}):\n{stdout}\n{stderr}")
    return {"peak_rss": peak, "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--shape", default="batch=1,seq=128")
    ap.add_argument("--target", default="host")
    ap.add_argument("--smoke", action="store_true", help="a tiny fixture model (proves the script runs)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.model = SMOKE_MODEL
    if a.model is None:
        ap.error("give a model or --smoke")
    weights = weight_bytes(a.model)
    with tempfile.TemporaryDirectory(prefix="compile-memory-") as d:
        r = measure(a.model, a.shape, a.target, Path(d) / "out")
    load = os.getloadavg()
    print(f"model {a.model.name}: weights {weights / 2**20:.1f} MiB; compile peak RSS (parent + children) "
          f"{r['peak_rss'] / 2**20:.0f} MiB = {r['peak_rss'] / max(weights, 1):.2f}x the weights; "
          f"wall {r['wall_s']:.1f} s (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
