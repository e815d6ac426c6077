#!/bin/bash
# Wav2Vec2-base (convolutions on conv-gemm's panels) and Whisper-base's encoder built for x86-64-avx2
# on this Zen 5: the commit before the AVX2 tile ($1, a dev tree of 5e7ad70) against this one.
set -e
D=benchmarks/results/quiet-2026-12-07c
OLD=$1; NEW=$PWD/build/dev-src
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export BLOCKFORGE_ISOLATE=0
W2V=/tmp/peertable/cache/wav2vec2_base-33c783a771f44eda/wav2vec2_base.onnx
out=$D/avx2_conv.log; uptime > $out
for which in old new new old; do
  [ $which = old ] && P=$OLD || P=$NEW
  echo "== $which: Wav2Vec2-base" >> $out
  PYTHONPATH=$P .venv/bin/python -m blockforge bench $W2V --target x86-64-avx2 --shape input_values=1x16000 --against untuned --repeat 10 --quiet-ceiling 416 2>&1 | grep -E "on x86|quotable|^\| untuned" >> $out
done
uptime >> $out
