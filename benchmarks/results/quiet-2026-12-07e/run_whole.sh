#!/usr/bin/env bash
# Twenty-fifth session, Zen 5: the whole-model table after this session's changes (transpose tiles,
# CPURowReduction declining reduction-free kernels, the attention forms), against its last quotable
# run (quiet-2026-12-07/, same VM); the quiet ceiling as there (416).
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07e
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
echo "== start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1
timeout 2400 $NB .venv/bin/python benchmarks/whole_models.py --cache-dir /tmp/peertable/cache --repeat 10 \
  --quiet-ceiling 416 --out $OUT --export-python .venv/bin/python 2>&1 | grep -v -i warn | tail -5
