#!/bin/sh
# Seventeenth session: the BERT-base QDQ MHA and block at seq 512 after int8-sums and
# int8-shift-quantize, bench against ORT and OpenVINO on the same file (one run each, 20 repeats),
# nothing else running. Files: blockforge export mha|block --d-model 768 --heads 12 --d-ff 3072
# --activation gelu --quantize static --per-channel -o /tmp/i8/{mha,block}_static.onnx
# RUN=N names the JSONs (runs 1-3 -> runN.log)
set -e
cd "$(dirname "$0")/../../.."
out=benchmarks/results/quiet-2026-12-06f
for m in mha block; do
  uptime
  BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
    .venv/bin/python -m blockforge bench /tmp/i8/${m}_static.onnx --shape batch=1,seq=512 \
    --against ort,openvino,untuned --repeat 20 --json $out/${m}_static_seq512_run${RUN:-1}.json
done
