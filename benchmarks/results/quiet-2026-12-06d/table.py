"""The fourteenth pass's int8 table: blockforge / the best int8 peer per run, and the median,
from the bench JSONs of `int8/run.sh` (before concat-stack) or `int8_after/run.sh` (after).
A run whose SGEMM ceiling is outside 183-223 GFLOP/s (10% of the quiet ~203) is marked."""
import json
import statistics
import sys
from pathlib import Path

here = Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "int8_after")
for b in ("ffn", "mha", "block"):
    for q in ("dynamic", "static"):
        row = []
        for s in (128, 512):
            ratios = []
            for r in (1, 2, 3):
                f = here / f"{b}_{q}_seq{s}_run{r}.json"
                if not f.exists():
                    continue
                d = json.loads(f.read_text())
                res = d["results"]
                res = {x["name"]: x for x in res} if isinstance(res, list) else res
                med = {k: v["median_ms"] for k, v in res.items()}
                peers = {k: v for k, v in med.items() if k in ("ort", "openvino")}
                if "untuned" not in med or not peers:
                    ratios.append(("not timed", None))
                    continue
                ceil = d.get("sgemm_gflops", d.get("ceiling"))
                ok = ceil is not None and 183 <= ceil <= 223
                ratios.append((f"{med['untuned'] / min(peers.values()):.2f}" + ("" if ok else f" (SGEMM {ceil:.0f})"),
                               med["untuned"] / min(peers.values()) if ok else None))
            good = [x for _, x in ratios if x is not None]
            row.append(", ".join(t for t, _ in ratios) + (f" | **{statistics.median(good):.2f}x**" if good else " |"))
        print(f"| {b.upper() if b != 'block' else 'block'} {q} | " + " | ".join(row) + " |")
