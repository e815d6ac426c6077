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
from blockforge.compile.records import default_db_dir
from blockforge.tune.database import DeviceDB
from blockforge.graph import FFNSpec, MHASpec, export
from blockforge.targets import resolve
from blockforge.targets.toolchain import cpu_id

PRESET = "x86-64-avx512"
DEST = Path("artifacts/shipped/tuning") / PRESET


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials-per-task", type=int, default=64)
    a = ap.parse_args()
    target = resolve(PRESET)
    models = Path("artifacts") / "demo"
    for name, spec in (("mha_bert", MHASpec(d_model=768, heads=12)),
                       ("ffn_bert", FFNSpec(d_model=768, d_ff=3072, activation="gelu"))):
        path = models / f"{name}.onnx"
        if not path.exists():
            export(spec, path)
        s = tune(TuneOptions(model=path, target=PRESET, trials_per_task=a.trials_per_task,
                             dims={"batch": 1, "seq": 128}, measure=True, progress=False))
        print(f"{name}: {s.trials_new} new trials, {s.trials_reused} reused")
    n = DeviceDB(default_db_dir(target), target).export_best(DEST)
    print(f"wrote {n} records to {DEST}, judged inside the models on {cpu_id()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
