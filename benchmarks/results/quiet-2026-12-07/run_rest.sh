#!/usr/bin/env bash
# Twenty-first session, Zen 5, nothing else running: the rest of the issues' rows on this CPU.
# #19: HF BERT-base 12 layers whole in int8 (blockforge quantize --mode dynamic | static
# --per-channel of whole_models.py's bert_base export) against ORT and OpenVINO, seq 128 and 512;
# #21: bench --decode GPT-2 small and the Llama-style GQA decoder (export_models.py full --models
# gpt2_past,llama_past --exporters legacy --opsets 17), P = 128 and 512, prefill 128.
# The QDQ rows ran after the rest (the first static quantize named dims the export lacks):
# QS=qdq DECODE= LOG=rest_qdq bash run_rest.sh
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07; mkdir -p $OUT /tmp/i8w
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
BF="$NB BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src $PY -m blockforge"
M=/tmp/mv/models
ceiling() { $NB PYTHONPATH=build/dev-src $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
# inputs first (not timed)
[ -f $M/llama_past_legacy_op17.onnx ] || PYTHONPATH=build/dev-src:benchmarks $PY benchmarks/export_models.py full --models llama_past --exporters legacy --opsets 17 --out $M > /dev/null 2>&1
B=$(ls /tmp/peertable/cache/bert_base-*/bert_base.onnx)
[ -f /tmp/i8w/bert_dyn.onnx ] || $BF quantize $B --mode dynamic -o /tmp/i8w/bert_dyn.onnx > /dev/null
[ -f /tmp/i8w/bert_qdq.onnx ] || $BF quantize $B --mode static --per-channel --shape s33=1,s50=128,s6=1 -o /tmp/i8w/bert_qdq.onnx > /dev/null
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-80
for i in 1 2 3; do ceiling; done
for q in ${QS:-dyn qdq}; do for s in 128 512; do
  echo "== int8 whole BERT-base $q seq $s $(date -u) load: $(cat /proc/loadavg)"; ceiling
  timeout 900 $NB PYTHONPATH=build/dev-src $PY benchmarks/int8_whole.py /tmp/i8w/bert_$q.onnx --seq $s --repeat 10 2>&1 | grep -v -i warn
done; done
for m in ${DECODE-gpt2 llama}; do
  echo "== bench --decode ${m} $(date -u) load: $(cat /proc/loadavg)"; ceiling
  timeout 1200 $BF bench $M/${m}_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --repeat 20 --json $OUT/decode_${m}.json --force 2>&1 | grep -v -i warn
done
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/${LOG:-rest}.log
