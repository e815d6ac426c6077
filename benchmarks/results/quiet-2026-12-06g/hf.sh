#!/bin/sh
# Eighteenth session: Hugging Face BERT-base QDQ (dynamo SDPA export, quantized by `blockforge
# quantize --mode static --per-channel`: /tmp/p2/bert_qdq.onnx, dims s33=1, s50=SEQ, s6=1) and
# blockforge's own QDQ encoder block, after int8-gelu-segments, int8-addend, int8-gelu-ops and
# output-views; bench against ORT and OpenVINO on the same file. RUN=N names the JSONs.
set -e
cd "$(dirname "$0")/../../.."
out=benchmarks/results/quiet-2026-12-06g
for seq in 512 128; do
  uptime
  BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
    .venv/bin/python -m blockforge bench /tmp/p2/bert_qdq.onnx --shape s33=1,s50=$seq,s6=1 \
    --against ort,openvino,untuned --repeat 10 --json $out/hf_bert_qdq_seq${seq}_run${RUN:-1}.json
  uptime
  BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
    .venv/bin/python -m blockforge bench /tmp/i8/block_static.onnx --shape batch=1,seq=$seq \
    --against ort,openvino,untuned --repeat 20 --json $out/block_static_seq${seq}_run${RUN:-1}.json
done
