"""Both passes' int8 runs together (fourteenth: quiet-2026-12-06d/int8_after, sixteenth: quiet-2026-12-06e/int8):
blockforge / the best int8 peer, median over the runs whose SGEMM ceiling is 183-223 GFLOP/s. Run from the repository root."""
import json, statistics
from pathlib import Path
dirs = [Path("benchmarks/results/quiet-2026-12-06d/int8_after"), Path("benchmarks/results/quiet-2026-12-06e/int8")]
for b in ("ffn", "mha", "block"):
    for q in ("dynamic", "static"):
        row = []
        for s in (128, 512):
            rs = []
            for d in dirs:
                for r in (1, 2, 3):
                    f = d / f"{b}_{q}_seq{s}_run{r}.json"
                    if not f.exists(): continue
                    j = json.loads(f.read_text()); res = j["results"]
                    res = {x["name"]: x for x in res} if isinstance(res, list) else res
                    med = {k: v["median_ms"] for k, v in res.items() if v.get("median_ms")}
                    peers = [v for k, v in med.items() if k in ("ort", "openvino")]
                    ceil = j.get("sgemm_gflops", j.get("ceiling"))
                    if "untuned" in med and peers and ceil and 183 <= ceil <= 223:
                        rs.append(med["untuned"] / min(peers))
            row.append(f"{statistics.median(rs):.2f}x (n={len(rs)}, {min(rs):.2f}-{max(rs):.2f})")
        print(b, q, " | ".join(row))
