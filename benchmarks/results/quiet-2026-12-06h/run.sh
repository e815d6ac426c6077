#!/bin/bash
# Nineteenth session, quiet machine (nothing else running): window-partitioned A/Bs.
cd "$(dirname "$0")/../../.."
export BLOCKFORGE_ISOLATE=0 PYTHONPATH="$PWD/build/dev-src:$PWD/tests:$PWD/benchmarks"
py() { env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python "$@"; }
R=benchmarks/results/quiet-2026-12-06h
lscpu | grep -E "Model name|CPU family|Model:" ; uptime
for m in 128 131 37; do
  for o in "new old static" "old static new" "static new old"; do
    py $R/window_ab.py 768 3121 $m 300 $o
  done
done 2>&1 | grep -v Warning | tee $R/kernel.log
uptime
for o in "new old" "old new"; do py $R/window_ab.py 768 50257 128 20 $o; done 2>&1 | tee -a $R/kernel.log
uptime
for o in "main old static" "old static main" "static main old"; do
  uptime; py $R/prefill_window.py /tmp/mv/models/gpt2_past_legacy_op17.onnx 128 30 $o
done 2>&1 | tee $R/prefill.log
