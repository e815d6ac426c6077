#!/bin/bash
# Twentieth session, quiet machine (nothing else running): the dim-bounds A/B on GPT-2 prefill.
cd "$(dirname "$0")/../../.."
export BLOCKFORGE_ISOLATE=0 PYTHONPATH="$PWD/build/dev-src:$PWD/tests:$PWD/benchmarks"
py() { env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python "$@"; }
R=benchmarks/results/quiet-2026-12-06i
M=${M:-/tmp/mv/models/gpt2_past_legacy_op17.onnx}
lscpu | grep -E "Model name|CPU family|Model:"
for o in "bounded sym static" "sym static bounded" "static bounded sym" "bounded sym static" "sym static bounded" "static bounded sym"; do
  uptime; py $R/prefill_bounds.py $M 128 30 1024 $o
done 2>&1 | grep -v Warning | tee $R/prefill.log
