#!/usr/bin/env bash
# The sixth quiet pass (this session's machine: AMD EPYC family 26 = Zen 5), nothing else running.
# The gate's quiet value is the median of five SGEMM readings taken first (the last pass's two
# readings were too few: the ceiling spreads 357-421 at load ~1 on this VM). Results beside this script.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-02c; mkdir -p $OUT
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
BF=.venv/bin/blockforge
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
$PY -c "import tvm, onnxruntime, openvino, onnx, numpy; print('tvm', tvm.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__)"
for i in 1 2 3 4 5; do ceiling; done | tee /tmp/lead/ceilings.txt
} 2>&1 | tee $OUT/all.log
QUIET=$(awk '{print $3}' /tmp/lead/ceilings.txt | sort -n | sed -n 3p)
echo "quiet value (median of 5): $QUIET GFLOP/s" | tee -a $OUT/all.log
{
echo "== whole models $(date -u) load: $(cat /proc/loadavg)"
timeout 1500 $NB $PY benchmarks/whole_models.py --cache-dir /tmp/peertable/cache --repeat 10 --quiet-ceiling $QUIET --out $OUT ${WHOLE_ONLY:+--only $WHOLE_ONLY}
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/whole.log
{
C=/tmp/peertable/cache
echo "== panel-prefetch A/B (opt-in: BLOCKFORGE_PANEL_PREFETCH=1), both build orders on CLIP $(date -u) load: $(cat /proc/loadavg)"
BLOCKFORGE_PANEL_PREFETCH=1 timeout 400 $NB $PY benchmarks/whole_ab.py $C/clip_vision-*/clip_vision.onnx --dims s33=1 --ab panel-prefetch --repeat 20 --no-peers
BLOCKFORGE_PANEL_PREFETCH=1 timeout 400 $NB $PY benchmarks/whole_ab.py $C/clip_vision-*/clip_vision.onnx --dims s33=1 --ab panel-prefetch --repeat 20 --no-peers --without-first
BLOCKFORGE_PANEL_PREFETCH=1 timeout 400 $NB $PY benchmarks/whole_ab.py $C/vit_b16-*/vit_b16.onnx --dims s33=1 --ab panel-prefetch --repeat 10 --no-peers
BLOCKFORGE_PANEL_PREFETCH=1 timeout 400 $NB $PY benchmarks/whole_ab.py $C/bert_base-*/bert_base.onnx --dims s33=1,s50=128,s6=1 --ab panel-prefetch --repeat 10 --no-peers
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/prefetch.log
{
echo "== decode fp32 GPT-2 small $(date -u) load: $(cat /proc/loadavg)"; ceiling
timeout 900 $NB $BF bench /tmp/mv/models/gpt2_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --json $OUT/decode_gpt2.json
echo "== decode fp32 Llama GQA $(date -u) load: $(cat /proc/loadavg)"
timeout 900 $NB $BF bench /tmp/mv/models/llama_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --json $OUT/decode_llama.json
for m in gpt2 llama; do
echo "== decode, in-place cache (capacity 1024) vs the copying loop vs the bare step, $m $(date -u) load: $(cat /proc/loadavg)"
TVM_NUM_THREADS=2 timeout 900 $NB $PY benchmarks/decode_inplace.py --artifact /tmp/lead/${m}_inplace.host --model /tmp/mv/models/${m}_past_legacy_op17.onnx --past 128,512
done
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/decode.log
{
echo "== int8 FFN seq 128, with the AVX2-class presets $(date -u) load: $(cat /proc/loadavg)"
timeout 600 $NB $PY benchmarks/int8_gemm.py --repeat 20 --no-avx512
echo "== int8 BERT-base 12 layers, seq 128 $(date -u) load: $(cat /proc/loadavg)"
for f in /tmp/lead/bert_dyn.onnx /tmp/lead/bert_qdq.onnx; do timeout 600 $NB $PY benchmarks/int8_whole.py $f --seq 128 --repeat 6; done
echo "== bf16: identical FFN builds, 2 threads $(date -u) load: $(cat /proc/loadavg)"
timeout 300 $NB $PY /work/main/benchmarks/results/quiet-2026-12-02c/bf16_twice.py 2
echo "== bf16 blocks $(date -u) load: $(cat /proc/loadavg)"
timeout 700 $NB $PY benchmarks/bf16_gemm.py --blocks ffn,mha,block --repeat 20 --ab bf16-attention
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/int8_bf16.log
