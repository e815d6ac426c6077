#!/usr/bin/env bash
# attention-heads A/B on the seeds' fp32 encoder block (blockforge export block --d-model 768 --heads 12
# --d-ff 3072 --activation gelu -o /tmp/s1/block.onnx): whole_ab.py --abba, 2 threads wall-clock and one
# thread in CPU time (TVM_NUM_THREADS=1 --cpu-time: a noisy machine's descheduling does not count).
cd /work/main
PY="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 .venv/bin/python"
echo "== start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60
$PY -c "from blockforge.bench.harness import sgemm_ceiling; print('SGEMM', round(sgemm_ceiling()), 'GFLOP/s')"
for s in 128 512; do
  echo "== seq $s, 2 threads $(date -u) load: $(cat /proc/loadavg)"
  $PY benchmarks/whole_ab.py /tmp/s1/block.onnx --dims batch=1,seq=$s --ab attention-heads --repeat 30 --abba --no-peers 2>&1 | tail -3 | head -2
  echo "== seq $s, 1 thread CPU time $(date -u) load: $(cat /proc/loadavg)"
  TVM_NUM_THREADS=1 $PY benchmarks/whole_ab.py /tmp/s1/block.onnx --dims batch=1,seq=$s --ab attention-heads --repeat 30 --abba --cpu-time 2>&1 | tail -3 | head -2
done
$PY -c "from blockforge.bench.harness import sgemm_ceiling; print('SGEMM', round(sgemm_ceiling()), 'GFLOP/s')"
echo "== end $(date -u) load: $(cat /proc/loadavg)"
