#!/usr/bin/env bash
# After int8-attention (13fd009): the QDQ MHA and block (blockforge export mha|block --d-model 768 --heads 12
# --d-ff 3072 --activation gelu --quantize static --per-channel), three runs, as run.sh.
cd /work/main
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
OUT=/work/main/benchmarks/results/quiet-2026-12-06e/int8_attention
mkdir -p $OUT
for RUN in 1 2 3; do
echo "== run $RUN start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60
for s in 128 512; do for b in mha block; do q=static
  echo "== $b $q seq $s $(date -u) load: $(cat /proc/loadavg)"
  $NB .venv/bin/blockforge bench /tmp/i8/${b}_${q}.onnx --shape batch=1,seq=$s --against ort,openvino,untuned --repeat 20 \
     --json $OUT/${b}_${q}_seq${s}_run$RUN.json --force 2>&1 | grep -v -i warn | head -12
done; done
done
echo "== end $(date -u) load: $(cat /proc/loadavg)"
