#!/bin/bash
# fp32 on x86-64-avx2 (run on this Zen 5): the 6 x 2 micro-tile against the 6 x 4 one before it
# (commit 5e7ad70, its dev tree built into $OLD). Separate processes, alternating order.
# bash benchmarks/results/quiet-2026-12-07c/run_avx2.sh OLD_DEV_TREE
set -e
D=benchmarks/results/quiet-2026-12-07c
OLD=$1; NEW=$PWD/build/dev-src
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export BLOCKFORGE_ISOLATE=0
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
PYTHONPATH=$NEW .venv/bin/python -m blockforge export ffn --d-model 768 --batch 1 --seq 128 -o $T/ffn.onnx >/dev/null
BERT=/tmp/peertable/cache/bert_base-351f66b0bca647e4/bert_base.onnx
GPT2=/tmp/mv/models/gpt2_past_legacy_op17.onnx
out=$D/avx2_fp32.log; uptime > $out
for order in "old new" "new old" "old new"; do
  for which in $order; do
    [ $which = old ] && P=$OLD || P=$NEW
    echo "== $which: FFN" >> $out
    PYTHONPATH=$P .venv/bin/python -m blockforge bench $T/ffn.onnx --target x86-64-avx2 --against untuned --repeat 20 --quiet-ceiling 416 2>&1 | grep -E "on x86|quotable|^\| untuned" >> $out
    echo "== $which: BERT-base whole" >> $out
    PYTHONPATH=$P .venv/bin/python -m blockforge bench $BERT --target x86-64-avx2 --shape input_ids=1x128,attention_mask=1x128 --against untuned --repeat 10 --quiet-ceiling 416 2>&1 | grep -E "on x86|quotable|^\| untuned" >> $out
  done
done
for which in old new; do
  [ $which = old ] && P=$OLD || P=$NEW
  echo "== $which: GPT-2 decode" >> $out
  PYTHONPATH=$P .venv/bin/python -m blockforge bench $GPT2 --decode --target x86-64-avx2 --past 128,512 --prompt 0 --against untuned --repeat 10 2>&1 | grep -E "^\| decode|triad" >> $out
done
uptime >> $out
