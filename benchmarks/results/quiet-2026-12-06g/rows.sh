#!/bin/sh
# Eighteenth session: the other int8 rows the FFN's gelu reaches (the dynamic FFN, both encoder
# blocks) at seq 128 and 512, one run each, same command as run.sh. Files: blockforge export
# ffn|block --d-model 768 --heads 12 --d-ff 3072 --activation gelu --quantize dynamic|static
# --per-channel -o /tmp/i8/{ffn,block}_{dynamic,static}.onnx
set -e
cd "$(dirname "$0")/../../.."
out=benchmarks/results/quiet-2026-12-06g
for m in ffn_dynamic block_static block_dynamic; do
  for seq in 128 512; do
    uptime
    BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \
      .venv/bin/python -m blockforge bench /tmp/i8/$m.onnx --shape batch=1,seq=$seq \
      --against ort,openvino,untuned --repeat 20 --json $out/${m}_seq${seq}.json
  done
done
