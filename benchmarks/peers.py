"""The peer table in one command: blockforge against ONNX Runtime, ORT's fused transformer
kernels and OpenVINO, on the BERT-base blocks.

    make bench-peers                         # = benchmarks/peers.py (installs the [peers] extra)
    .venv/bin/python benchmarks/peers.py --repeat 20 [--only mha] [--tuning-db DIR]

Cases: BERT-base (d_model 768, 12 heads, d_ff 3072, exact gelu) MHA at seq 128 and 512, FFN
at seq 128 and 512, and the encoder block (post-LN, as BERT) at seq 128; fp32, batch 1,
threads = physical cores (the host preset's num-cores, for every engine). Contenders: ort,
ort-fused, openvino (when installed), blockforge untuned, and tuned (when the host's tuning
database, or --tuning-db, exists; otherwise skipped with a note). Every case is one
`blockforge bench` run: interleaved samples, outputs checked against the oracle before
timing, ratios to the best peer from the same samples.

Writes benchmarks/results/peers-<host>.{json,md,png} with the CPU model (/proc/cpuinfo),
the core count and the version of every engine.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import blockforge
from blockforge.bench import BenchOptions, bench, plot
from blockforge.bench.contenders import CONTENDERS
from blockforge.bench.harness import host_facts
from blockforge.fsutil import atomic_write_json, atomic_write_text
from blockforge.graph import BlockSpec, FFNSpec, MHASpec, export

BERT = dict(d_model=768)
CASES = [
    ("bert_mha", MHASpec(**BERT, heads=12), 128),
    ("bert_mha", MHASpec(**BERT, heads=12), 512),
    ("bert_ffn", FFNSpec(**BERT, d_ff=3072, activation="gelu"), 128),
    ("bert_ffn", FFNSpec(**BERT, d_ff=3072, activation="gelu"), 512),
    ("bert_block", BlockSpec(**BERT, heads=12, d_ff=3072, activation="gelu", norm="post", eps=1e-12), 128),
]
# --smoke: the same kinds of case at toy sizes (the smoke test in make test runs them).
SMOKE_CASES = [
    ("tiny_mha", MHASpec(d_model=32, heads=2), 8),
    ("tiny_ffn", FFNSpec(d_model=32, d_ff=64, activation="gelu"), 8),
    ("tiny_block", BlockSpec(d_model=32, heads=2, d_ff=64, activation="gelu", norm="post", eps=1e-12), 8),
]
SCHEMA = "blockforge.peers/1"


def summary_table(reports: list[tuple[str, object]]) -> str:
    """One row per case: each contender's median ms and ratio to the best peer."""
    names = [c for c in CONTENDERS if any(x.name == c for _, r in reports for x in r.results)]
    lines = ["| case | " + " | ".join(names) + " | best peer | headline |",
             "|---|" + "---|" * (len(names) + 2)]
    for case, r in reports:
        cells = []
        for n in names:
            x = next((x for x in r.results if x.name == n), None)
            cells.append(f"{x.median_ms:.2f} ms ({x.ratio_to_best_peer:.2f}x)" if x and x.ratio_to_best_peer
                         else (f"{x.median_ms:.2f} ms" if x else "skipped"))
        h = r.headline
        head = f"**{h['ratio_to_best_peer']:.2f}x** ({h['contender']})" if h else "-"
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {r.best_peer or '-'} | {head} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=30, help="timed samples per contender per case")
    ap.add_argument("--only", default=None, help="substring filter on case names (e.g. mha, s512)")
    ap.add_argument("--against", default=",".join(CONTENDERS))
    ap.add_argument("--tuning-db", default=None, help="tuning database (default: the host's, if any)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few samples: proves the script runs (tests/test_benchmarks.py), measures nothing")
    a = ap.parse_args()
    blockforge.configure()  # TVM's pool = physical cores, as the CLI sets it
    out, models = Path(a.out), Path("artifacts") / "bench"
    host = host_facts()
    node = platform.node() or "host"
    reports = []
    t0 = time.time()
    for name, spec, seq in (SMOKE_CASES if a.smoke else CASES):
        case = f"{name}_s{seq}"
        if a.only and a.only not in case:
            continue
        path = models / f"{name}.onnx"
        if not path.exists():
            export(spec, path)
        rep = bench(BenchOptions(model=path, target="host", shape={"batch": 1, "seq": seq}, repeat=a.repeat,
                                 against=tuple(x for x in a.against.split(",") if x),
                                 tuning_db=Path(a.tuning_db) if a.tuning_db else None))
        print(f"### {case}\n\n{rep.markdown()}\n" + "".join(f"\nnote: {n}" for n in rep.notes) + "\n", flush=True)
        reports.append((case, rep))
    if not reports:
        print("no case matches --only", file=sys.stderr)
        return 2
    table = summary_table(reports)
    command = "benchmarks/peers.py " + " ".join(sys.argv[1:])
    load = [host["load_avg_1m"], host_facts()["load_avg_1m"]]
    head = (f"Peer benchmark on {host['cpu_model']} ({host['physical_cores']} physical cores, {host['machine']}; "
            f"load average {' -> '.join(f'{x:.1f}' for x in load if x is not None)} over the run), "
            f"threads {reports[0][1].threads} for every engine, fp32, batch 1, {a.repeat} interleaved samples "
            f"per contender; engines: {', '.join(f'{k} {v}' for k, v in host['versions'].items())}. "
            f"Ratios are medians over the best peer's (lower is faster). Command: `{command}`.")
    atomic_write_json(out / f"peers-{node}.json", {
        "schema": SCHEMA, "command": command, "host": host, "load_avg_1m_end": load[1],
        "wall_s": round(time.time() - t0, 1),
        "summary": [{"case": c, "best_peer": r.best_peer, "headline": r.headline,
                     "median_ms": {x.name: x.median_ms for x in r.results},
                     "ratio_to_best_peer": {x.name: x.ratio_to_best_peer for x in r.results}} for c, r in reports],
        "cases": {c: r.to_dict() for c, r in reports}})
    details = "\n\n".join(f"### {c}\n\n{r.markdown()}" + "".join(f"\n\nnote: {n}" for n in r.notes)
                          for c, r in reports)
    atomic_write_text(out / f"peers-{node}.md", f"{head}\n\n{table}\n\n{details}\n")
    plot([r for _, r in reports], out / f"peers-{node}.png", labels=[c for c, _ in reports])
    print(f"{head}\n\n{table}\n\nwrote {out}/peers-{node}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
