#!/bin/bash
# Twentieth session, quiet: the static build's panel prefetch with a cropped N (static_rows.py of the
# nineteenth session: static = with it, nopf = without), both orders.
cd "$(dirname "$0")/../../.."
export BLOCKFORGE_ISOLATE=0 PYTHONPATH="$PWD/build/dev-src:$PWD/tests:$PWD/benchmarks"
py() { env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python "$@"; }
S=benchmarks/results/quiet-2026-12-06h/static_rows.py
uptime
for shape in "768 3121 37" "768 3121 20" "768 3121 50" "768 3072 37" "768 50257 37"; do
  for o in "static nopf" "nopf static"; do py $S $shape 200 $o; done
done 2>&1 | grep --line-buffered -v Warning
uptime
