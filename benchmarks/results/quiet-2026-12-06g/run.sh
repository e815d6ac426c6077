#!/bin/sh
# Eighteenth session: blockforge's own-export BERT-base FFN QDQ at seq 128 and 512 after
# int8-gelu-segments and output-views, bench against ORT and OpenVINO on the same file (20
# repeats), nothing else running. File: blockforge export ffn --d-model 768 --heads 12 --d-ff 3072
# --activation gelu --quantize static --per-channel -o /tmp/i8/ffn_static.onnx
# RUN=N names the JSONs (runs 1-3 -> runN.log)
set -e
cd "$(dirname "$0")/../../.."
out=benchmarks/results/quiet-2026-12-06g
for seq in 128 512; do
  uptime
  BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
    .venv/bin/python -m blockforge bench /tmp/i8/ffn_static.onnx --shape batch=1,seq=$seq \
    --against ort,openvino,untuned --repeat 20 --json $out/ffn_static_seq${seq}_run${RUN:-1}.json
done
