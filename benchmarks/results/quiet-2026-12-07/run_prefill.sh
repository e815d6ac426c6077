#!/usr/bin/env bash
# Twenty-first session, Zen 5: Llama-style GQA prefill of 128 tokens from an empty cache, the artifact
# build (seq, past symbolic; and bounded ..1024) against the build bound at P = 0, seq 128 (static),
# both build orders (prefill_bounds.py of the twentieth session); bench --decode had read loop
# artifact / static 1.05x (rest.log). Nothing else running.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
for order in "bounded sym static" "static sym bounded"; do
  echo "== $order $(date -u) load: $(cat /proc/loadavg)"
  $NB BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src:tests:benchmarks timeout 900 .venv/bin/python \
    benchmarks/results/quiet-2026-12-06i/prefill_bounds.py /tmp/mv/models/llama_past_legacy_op17.onnx 128 30 1024 $order 2>&1 | grep -v -i warn | tail -3
done 2>&1 | tee $OUT/prefill_llama.log
