"""The benchmark suite (not part of `make test`): BERT-base MHA and FFN at seq 128 and 512,
and the d_model 512 / 8-head MHA, batch 1, fp32, on the host CPU.

    benchmarks/run.sh [--trials-per-task N] [--repeat 30]

Exports the blocks, optionally tunes them into the host's tuning database, then runs
`blockforge bench` (ORT vs untuned vs tuned, interleaved, same threads) with a per-kernel
profile, and writes benchmarks/results/<host>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from blockforge.bench import BenchOptions, bench, plot
from blockforge.fsutil import atomic_write_json, atomic_write_text
from blockforge.graph import FFNSpec, MHASpec, export
from blockforge.targets import resolve

CASES = [
    ("bert_mha", MHASpec(d_model=768, heads=12), 128),
    ("bert_mha", MHASpec(d_model=768, heads=12), 512),
    ("bert_ffn", FFNSpec(d_model=768, d_ff=3072, activation="gelu"), 128),
    ("bert_ffn", FFNSpec(d_model=768, d_ff=3072, activation="gelu"), 512),
    ("mha_d512_h8", MHASpec(d_model=512, heads=8), 128),
]

# --smoke: toy sizes for the smoke test in make test.
SMOKE_CASES = [("tiny_mha", MHASpec(d_model=32, heads=2), 8), ("tiny_ffn", FFNSpec(d_model=32, d_ff=64), 8)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials-per-task", type=int, default=0, help="tune first (0: use the database as is)")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--only", default=None, help="substring filter on case names")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few samples: proves the script runs (tests/test_benchmarks.py), measures nothing")
    a = ap.parse_args()
    out = Path(a.out)
    models = Path("artifacts") / "bench"
    host = platform.node() or "host"
    target = resolve("host")
    reports, tune_log = [], []
    for name, spec, seq in (SMOKE_CASES if a.smoke else CASES):
        case = f"{name}_s{seq}"
        if a.only and a.only not in case:
            continue
        path = models / f"{name}.onnx"
        if not path.exists():
            export(spec, path)
        dims = {"batch": 1, "seq": seq}
        if a.trials_per_task:
            from blockforge.tune.jobs import TuneOptions, tune

            t0 = time.time()
            # measure=True also A/B-tests every tuned record inside the whole model.
            s = tune(TuneOptions(model=path, target="host", trials_per_task=a.trials_per_task, shape=dims,
                                 measure=True, progress=False))
            tune_log.append({"case": case, "new_trials": s.trials_new, "reused": s.trials_reused,
                             "tasks": len(s.tasks), "wall_s": round(time.time() - t0, 1),
                             "kept_default": s.kept_default, "naive_ms": s.naive_ms,
                             "untuned_ms": s.untuned_ms, "tuned_ms": s.tuned_ms})
            print(f"tuned {case}: {s.trials_new} new trials over {len(s.tasks)} tasks", flush=True)
        rep = bench(BenchOptions(model=path, target="host", shape=dims, repeat=a.repeat, profile=True))
        print(rep.markdown(), flush=True)
        reports.append((case, rep))
    data = {"host": host, "target": target.target_json, "python": sys.version.split()[0],
            "cases": {c: r.to_dict() for c, r in reports}, "tuning": tune_log,
            "command": "benchmarks/run.sh " + " ".join(sys.argv[1:])}
    atomic_write_json(out / f"{host}.json", data)
    atomic_write_text(out / f"{host}.md", "\n\n".join(f"### {c}\n\n{r.markdown()}" for c, r in reports) + "\n")
    if reports:
        plot([r for _, r in reports], out / f"{host}.png")
    print(f"wrote {out / host}.json/.md/.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
