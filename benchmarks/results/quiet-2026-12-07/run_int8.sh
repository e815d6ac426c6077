#!/usr/bin/env bash
# Twenty-first session, Zen 5 (AMD EPYC family 26 model 2), nothing else running: issue #19's
# rows on this CPU (full-width VPDPBUSD and VDPBF16PS; the int8 and bf16 kernels were chosen on
# Zen 4): int8 BERT-base FFN, MHA and encoder block (export --quantize dynamic | static
# --per-channel) against ORT and OpenVINO on the same files, seq 128 and 512, one run; then bf16
# blocks against OpenVINO's bf16 hint at seq 128 and 512.
cd /work/main
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
OUT=/work/main/benchmarks/results/quiet-2026-12-07; mkdir -p $OUT/int8 /tmp/i8
BF="$NB BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src .venv/bin/python -m blockforge"
ceiling() { $NB PYTHONPATH=build/dev-src .venv/bin/python -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
for b in ffn mha block; do for q in dynamic static; do
  [ -f /tmp/i8/${b}_${q}.onnx ] || { pc=""; [ $q = static ] && pc="--per-channel"
    $BF export $b --d-model 768 --heads 12 --d-ff 3072 --activation gelu --quantize $q $pc -o /tmp/i8/${b}_${q}.onnx >/dev/null; }
done; done
echo "== start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60; ceiling; ceiling; ceiling
for s in 128 512; do for b in ffn mha block; do for q in dynamic static; do
  echo "== $b $q seq $s $(date -u) load: $(cat /proc/loadavg)"
  $BF bench /tmp/i8/${b}_${q}.onnx --shape batch=1,seq=$s --against ort,openvino,untuned --repeat 20 \
     --json $OUT/int8/${b}_${q}_seq${s}.json --force 2>&1 | grep -v -i warn | head -12
done; done; ceiling; done
for s in 128 512; do
  echo "== bf16 blocks seq $s $(date -u) load: $(cat /proc/loadavg)"
  timeout 900 $NB PYTHONPATH=build/dev-src .venv/bin/python benchmarks/bf16_gemm.py --blocks ffn,mha,block --seq $s --repeat 20 2>&1 | grep -v -i warn
  ceiling
done
echo "== end $(date -u) load: $(cat /proc/loadavg)"
