#!/usr/bin/env bash
# Tenth quiet pass (issue #21): window_allocs and the weight arena, decode per token and prefill as `bench --decode`
# (the loop artifact's decode_inplace at each P), and the loops' overhead against the bare
# step (benchmarks/decode_inplace.py), GPT-2 small and the Llama-style GQA decoder, full size,
# random weights (benchmarks/export_models.py full --models gpt2_past,llama_past --exporters
# legacy --opsets 17 --out /tmp/mv/models). Nothing else running. Results beside this script.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-04b; mkdir -p $OUT /tmp/pass
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
BF=.venv/bin/blockforge
M=/tmp/mv/models
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
grep -o -w -E 'avx512f|avx512_vnni|avx512_bf16|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
$PY -c "import tvm, onnxruntime, openvino, onnx, numpy; print('tvm', tvm.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__)"
git log --oneline -1
for i in 1 2 3 4 5; do ceiling; done | tee /tmp/pass/ceilings.txt
echo "quiet value (median of 5): $(awk '{print $3}' /tmp/pass/ceilings.txt | sort -n | sed -n 3p) GFLOP/s"
} 2>&1 | tee $OUT/all.log
{
for m in gpt2 llama; do
  echo "== compile ${m} --kv-capacity 1024 $(date -u) load: $(cat /proc/loadavg)"
  [ -d /tmp/pass/${m}_cap ] || $BF compile $M/${m}_past_legacy_op17.onnx --target host --shape batch=1 --kv-capacity 1024 -o /tmp/pass/${m}_cap
done
for m in gpt2 llama; do
  echo "== bench --decode ${m} $(date -u) load: $(cat /proc/loadavg)"; ceiling
  timeout 1200 $NB $BF bench $M/${m}_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --repeat 20 --json $OUT/decode_${m}.json
done
for m in gpt2 llama; do
  echo "== loops vs bare step ${m} $(date -u) load: $(cat /proc/loadavg)"
  timeout 900 $NB TVM_NUM_THREADS=2 $PY benchmarks/decode_inplace.py --artifact /tmp/pass/${m}_cap --model $M/${m}_past_legacy_op17.onnx --past 128,512
done
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/decode.log
