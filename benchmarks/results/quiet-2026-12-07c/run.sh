#!/bin/bash
# Twenty-third session (Zen 5): int8 on x86 without VNNI (VPMADDUBSW) and QDQ Gemm nodes.
# Run from the repository root on a quiet machine: bash benchmarks/results/quiet-2026-12-07c/run.sh
set -e
D=benchmarks/results/quiet-2026-12-07c
export PYTHONPATH=$PWD/build/dev-src:$PWD/benchmarks BLOCKFORGE_ISOLATE=0
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
.venv/bin/python tests/devtree.py build/dev-src >/dev/null
uptime > $D/novnni.log
.venv/bin/python benchmarks/int8_gemm.py --repeat 20 --no-vnni >> $D/novnni.log 2>&1
# OpenVINO capped at AVX2 (the peer of a CPU without VNNI); ORT's MLAS has no such cap
uptime > $D/novnni_ov_avx2.log
ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/int8_gemm.py --repeat 20 --no-vnni >> $D/novnni_ov_avx2.log 2>&1
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
B=".venv/bin/python -m blockforge"
$B export ffn --d-model 768 --batch 1 --seq 128 -o $T/ffn.onnx >/dev/null
$B quantize $T/ffn.onnx --mode static --per-channel -o $T/ffn_qdq.onnx >/dev/null 2>&1
$B quantize $T/ffn.onnx --mode dynamic -o $T/ffn_dyn.onnx >/dev/null 2>&1
uptime > $D/qdq_gemm.log
for m in ffn_qdq ffn_dyn; do
  $B bench $T/$m.onnx --against ort,openvino,untuned --repeat 20 --quiet-ceiling 416 --profile >> $D/qdq_gemm.log 2>&1
done
