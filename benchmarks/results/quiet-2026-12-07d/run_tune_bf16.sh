#!/usr/bin/env bash
# Twenty-fourth session (Zen 5, nothing else running): `tune --precision bf16` on the BERT-base
# blocks at seq 128 and 512 (the bf16 GEMM and bf16 attention tile searches), then
# `bench --precision bf16` untuned vs tuned vs OpenVINO bf16 on each database. Logs beside this.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07d; M=/tmp/s24/m; DB=/tmp/s24/tdb
export PYTHONPATH=/work/main/build/dev-src BLOCKFORGE_ISOLATE=0
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
BF=".venv/bin/python -m blockforge"
mkdir -p $M $DB
$BF export ffn --d-model 768 --d-ff 3072 --activation gelu -o $M/ffn.onnx --force
$BF export mha --d-model 768 --heads 12 -o $M/mha.onnx --force
$BF export block --d-model 768 --heads 12 --d-ff 3072 --norm post -o $M/block.onnx --force
{
for seq in 128 512; do for b in ffn mha block; do
  rm -rf $DB/$b-$seq
  echo "== tune $b seq $seq $(date -u +%T) load: $(cat /proc/loadavg)"
  $NB timeout 1500 $BF tune $M/$b.onnx --target host --precision bf16 --shape batch=1,seq=$seq \
    --trials-per-task 1 --tuning-db $DB/$b-$seq --json $DB/$b-$seq.json 2>&1 | grep -v "^\s*$" \
    | grep -E "blockforge tune: (bf16|fused)|whole model|kept|error"
done; done
} 2>&1 | tee $OUT/tune_bf16.log
{
for seq in 512 128; do for b in mha block ffn; do
  echo "== bench $b seq $seq $(date -u +%T) load: $(cat /proc/loadavg)"
  $NB timeout 900 $BF bench $M/$b.onnx --precision bf16 --shape batch=1,seq=$seq --against openvino,untuned,tuned \
    --tuning-db $DB/$b-$seq --repeat 20 2>&1 | grep -E "^\||SGEMM|at [0-9.]+x|warning" | head -12
done; done
echo "== end $(date -u +%T) load: $(cat /proc/loadavg)"
} 2>&1 | tee $OUT/bench_tuned.log
# int8 tiles on AVX-512 without VNNI (the x86-64-avx512 preset): BERT-base FFN, dynamic, 7-bit weights
$BF quantize $M/ffn.onnx --mode dynamic --reduce-range -o $M/ffn_int8_7.onnx --force
rm -rf $DB/int8bw
$NB timeout 900 $BF tune $M/ffn_int8_7.onnx --target x86-64-avx512 --shape batch=1,seq=128 --trials-per-task 1 \
  --tuning-db $DB/int8bw 2>&1 | grep -E "blockforge tune: int8|whole model|kept" | tee $OUT/int8bw_tune.log
