#!/usr/bin/env bash
# Eleventh quiet pass (issue #21): bench --decode with each point's roofline timed in its own rounds
# (triad and read beside the contenders), GPT-2 small and the Llama-style GQA decoder, full size,
# random weights (benchmarks/export_models.py full --models gpt2_past,llama_past --exporters legacy
# --opsets 17 --out /tmp/mv/models); then the prefill A/B of the one build's main with and without
# qkv_heads against the build bound at seq 128 (prefill_ab.py, beside this script). Nothing else running.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-06; mkdir -p $OUT
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
BF=.venv/bin/blockforge
M=/tmp/mv/models
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
grep -o -w -E 'avx512f|avx512_vnni|avx512_bf16|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
$PY -c "import tvm, onnxruntime, openvino, onnx, numpy; print('tvm', tvm.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__)"
git log --oneline -1 | cut -c1-80
for i in 1 2 3 4 5; do ceiling; done | tee /tmp/ceilings.txt
echo "quiet value (median of 5): $(awk '{print $3}' /tmp/ceilings.txt | sort -n | sed -n 3p) GFLOP/s"
for m in gpt2 llama; do
  echo "== bench --decode ${m} $(date -u) load: $(cat /proc/loadavg)"; ceiling
  timeout 1200 $NB $BF bench $M/${m}_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --repeat 20 --json $OUT/decode_${m}.json --force
done
for m in gpt2 llama; do
  echo "== prefill A/B ${m} $(date -u) load: $(cat /proc/loadavg)"
  timeout 900 $NB $PY $OUT/prefill_ab.py $M/${m}_past_legacy_op17.onnx 128 30 2>&1 | grep -v -i warn
done
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/decode.log
