"""Regenerate the tuned records shipped for the demo blocks (x86-64-avx512 preset):

    .venv/bin/python benchmarks/ship_records.py --trials-per-task 64

Tunes the BERT-base MHA and FFN (batch 1, seq 128) into the preset's device database,
then keeps the best record per workload in artifacts/shipped/tuning/x86-64-avx512/
(small enough to commit). `make demo` benchmarks with them where the CPU has AVX-512;
compile/verify apply a record only where its workload matches the model's task.

The records carry the CPU they were tuned and judged on (device.json `cpu_model`, the
ledger's in-model verdicts by CPU): on this CPU they apply where they won inside the model;
on any other, builds skip them with a warning until `blockforge tune MODEL --target
x86-64-avx512 --tuning-db DIR --check-only` re-runs the A/B there (`make demo` does, on a
copy of this directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blockforge.tune.jobs import TuneOptions, tune
from blockforge.compile.records.reader import default_db_dir
from blockforge.tune.database import DeviceDB
from blockforge.graph import FFNSpec, MHASpec, export
from blockforge.targets import resolve
from blockforge.targets.toolchain import cpu_id

PRESET = "x86-64-avx512"
DEST = Path("artifacts/shipped/tuning") / PRESET
BLOCKS = [("mha_bert", MHASpec(d_model=768, heads=12)),
          ("ffn_bert", FFNSpec(d_model=768, d_ff=3072, activation="gelu"))]
SMOKE_BLOCKS = [("ffn_tiny", FFNSpec(d_model=32, d_ff=64))]  # one block: a tune is ~1 min even so
# The smoke test proves the script runs and writes records, not the search: a small population.
SMOKE_POPULATION = 32


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials-per-task", type=int, default=64)
    ap.add_argument("--dest", type=Path, default=DEST, help=f"where the best records go (default {DEST})")
    ap.add_argument("--smoke", action="store_true",
                    help="toy blocks, for the smoke test in make test (needs --dest: never the shipped records)")
    a = ap.parse_args()
    if a.smoke and a.dest == DEST:
        ap.error("--smoke writes toy records: give --dest")
    target = resolve(PRESET)
    models = Path("artifacts") / ("bench-smoke" if a.smoke else "demo")
    blocks = SMOKE_BLOCKS if a.smoke else BLOCKS
    for name, spec in blocks:
        path = models / f"{name}.onnx"
        if not path.exists():
            export(spec, path)
        s = tune(TuneOptions(model=path, target=PRESET, trials_per_task=a.trials_per_task,
                             shape={"batch": 1, "seq": 8 if a.smoke else 128}, measure=True, progress=False,
                             **({"population": SMOKE_POPULATION} if a.smoke else {})))
        print(f"{name}: {s.trials_new} new trials, {s.trials_reused} reused")
    n = DeviceDB(default_db_dir(target), target).export_best(a.dest)
    print(f"wrote {n} records to {a.dest}, judged inside the models on {cpu_id()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
