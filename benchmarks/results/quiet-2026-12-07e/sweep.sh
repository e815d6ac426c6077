#!/usr/bin/env bash
# families sweep: export (legacy op17, dynamo op18) then blockforge verify on the host
cd "$(dirname "$0")"
PY=/work/main/.venv/bin/python
OUT=${OUT:-/tmp/s25/sweep}; mkdir -p $OUT
fams=${FAMS:-$($PY sweep_export.py --list)}
for f in $fams; do
  for e in ${EXPS:-dynamo legacy}; do
    t0=$(date +%s)
    if timeout 600 $PY sweep_export.py $f $e $OUT > $OUT/${f}_${e}.export.log 2>&1; then
      BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src timeout 900 $PY -m blockforge verify $OUT/${f}_${e}.onnx \
        --target host --inputs $OUT/${f}_${e}.npz > $OUT/${f}_${e}.verify.log 2>&1
      rc=$?
      echo "$f $e verify rc=$rc $(( $(date +%s) - t0 ))s :: $(tail -1 $OUT/${f}_${e}.verify.log | cut -c1-300)"
    else
      echo "$f $e EXPORT-FAIL $(( $(date +%s) - t0 ))s :: $(grep -v '^\s' $OUT/${f}_${e}.export.log | grep -i error | tail -1 | cut -c1-300)"
    fi
  done
done
