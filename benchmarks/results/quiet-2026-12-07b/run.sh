#!/usr/bin/env bash
# Twenty-second session, Zen 5 (AMD EPYC family 26 model 2), nothing else running: #19's bf16 FFN
# (BERT-base, d_ff 3072, gelu) against OpenVINO's bf16 hint, seq 128 and 512.
#  bf16_probe.log: benchmarks/bf16_gemm.py with its VDPBF16PS probe timed in the same rounds
#                  (each contender's GFLOP/s as a fraction of it), three processes per length;
#  bf16_bench.log: blockforge bench --precision bf16 --against openvino,untuned, three per length.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07b
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src"
PY=.venv/bin/python
mkdir -p /tmp/bf16ffn
[ -f /tmp/bf16ffn/ffn.onnx ] || $NB $PY -m blockforge export ffn --d-model 768 --d-ff 3072 --activation gelu -o /tmp/bf16ffn/ffn.onnx > /dev/null
for s in 128 512 128 512 128 512; do
  $NB $PY benchmarks/bf16_gemm.py --seq $s --repeat 20 2>&1 | grep -E "GEMM|probe [0-9]|blockforge bf16:|OpenVINO bf16:" \
    | sed 's/(max.*load/(load/; s/ phases.*finalize;//; s/; SGEMM.*//'
done | tee $OUT/bf16_probe.log
for s in 128 512 128 512 128 512; do
  $NB $PY -m blockforge bench /tmp/bf16ffn/ffn.onnx --precision bf16 --against openvino,untuned --shape batch=1,seq=$s \
    --repeat 20 2>&1 | grep -E "SGEMM ceiling|^\| (openvino|untuned)" | sed 's/.*dims/dims/'
done | tee $OUT/bf16_bench.log
