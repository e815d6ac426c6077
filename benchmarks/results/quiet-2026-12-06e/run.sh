#!/usr/bin/env bash
# Sixteenth quiet pass: int8 BERT-base FFN, MHA and encoder block (export --quantize dynamic | static
# --per-channel) against ORT and OpenVINO on the same files, seq 128 and 512, 2 threads, three runs
# (after int8-recip-quantize); then the whole-model table (issue #20) once.
# The models: blockforge export ffn|mha|block --d-model 768 --heads 12 --d-ff 3072 --activation gelu
#             --quantize dynamic | static --per-channel -o /tmp/i8/{kind}_{mode}.onnx
cd /work/main
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
OUT=/work/main/benchmarks/results/quiet-2026-12-06e
for RUN in 1 2 3; do
echo "== run $RUN start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60
for s in 128 512; do for b in ffn mha block; do for q in dynamic static; do
  echo "== $b $q seq $s $(date -u) load: $(cat /proc/loadavg)"
  $NB .venv/bin/blockforge bench /tmp/i8/${b}_${q}.onnx --shape batch=1,seq=$s --against ort,openvino,untuned --repeat 20 \
     --json $OUT/int8/${b}_${q}_seq${s}_run$RUN.json --force 2>&1 | grep -v -i warn | head -12
done; done; done
done
echo "== whole models $(date -u) load: $(cat /proc/loadavg)"
$NB .venv/bin/python benchmarks/whole_models.py --cache-dir /tmp/wm_cache --repeat 10 --quiet-ceiling 203 --out $OUT 2>&1 | grep -v -i warn | tail -30
echo "== end $(date -u) load: $(cat /proc/loadavg)"
