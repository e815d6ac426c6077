#!/usr/bin/env bash
# int8-combine A/B: each model built with and without the phase, four builds in one process
# (new, without, without, new: whole_ab.py --abba), 30 interleaved rounds, no peers; SGEMM before/after.
# Models: /tmp/i8/{mha,block}_{dynamic,static}.onnx (run.sh's exports), BERT-base whole from
# benchmarks/export_models.py quantized by `blockforge quantize --mode dynamic` (/tmp/s1/bert_dyn.onnx).
cd /work/main
PY="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 .venv/bin/python"
sg() { $PY -c "from blockforge.bench.harness import sgemm_ceiling; print('SGEMM', round(sgemm_ceiling()), 'GFLOP/s')"; }
echo "== start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60; sg
for m in "mha_dynamic 512" "block_dynamic 512" "mha_dynamic 128" "block_dynamic 128" "mha_static 128" "block_static 128" "block_static 512"; do
  set -- $m
  echo "== $1 seq $2 $(date -u) load: $(cat /proc/loadavg)"
  $PY benchmarks/whole_ab.py /tmp/i8/$1.onnx --dims batch=1,seq=$2 --ab int8-combine --repeat 30 --abba --no-peers 2>&1 | tail -3 | head -2
done
echo "== bert_base dynamic seq 128 $(date -u) load: $(cat /proc/loadavg)"
$PY benchmarks/whole_ab.py /tmp/s1/bert_dyn.onnx --dims s33=1,s50=128,s6=1 --ab int8-combine --repeat 20 --abba --no-peers 2>&1 | tail -3 | head -2
sg; echo "== end $(date -u) load: $(cat /proc/loadavg)"
