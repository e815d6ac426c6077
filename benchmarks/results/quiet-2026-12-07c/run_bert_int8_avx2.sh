#!/bin/bash
# HF BERT-base (12 layers, seq 128) int8 built for x86-64-avx2 on this Zen 5: blockforge quantize
# dynamic with full-range and 7-bit weights, against the fp32 export, each its own process.
set -e
D=benchmarks/results/quiet-2026-12-07c
export PYTHONPATH=$PWD/build/dev-src BLOCKFORGE_ISOLATE=0
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
B=".venv/bin/python -m blockforge"
BERT=/tmp/peertable/cache/bert_base-351f66b0bca647e4/bert_base.onnx
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
S="input_ids=1x128,attention_mask=1x128"
$B quantize $BERT --mode dynamic --shape $S -o $T/bert_dyn.onnx >/dev/null 2>&1
$B quantize $BERT --mode dynamic --reduce-range --shape $S -o $T/bert_dyn7.onnx >/dev/null 2>&1
out=$D/bert_int8_avx2.log; uptime > $out
for m in $BERT $T/bert_dyn7.onnx $T/bert_dyn.onnx; do
  echo "== $(basename $m)" >> $out
  $B bench $m --target x86-64-avx2 --shape $S --against untuned --repeat 10 --quiet-ceiling 416 2>&1 | grep -E "on x86|quotable|^\| untuned|rel L2|note: precision" >> $out
done
uptime >> $out
