#!/usr/bin/env bash
# The eighth quiet pass: a Zen 4 machine again (AMD EPYC family 25 model 17, the issues' reference
# CPU), nothing else running. The gate's quiet value is the median of five SGEMM readings taken
# first; whole models, int8, bf16 and decode at this commit. Results beside this script.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-02e; mkdir -p $OUT
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
BF=.venv/bin/blockforge
C=/tmp/peertable/cache
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
grep -o -w -E 'avx512f|avx512_vnni|avx512_bf16|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
$PY -c "import tvm, onnxruntime, openvino, onnx, numpy; print('tvm', tvm.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__)"
git log --oneline -1; $PY -c "from blockforge.compile.pipeline import ABLATIONS; assert 'conv-strided-loads' in ABLATIONS, 'the installed package is not this commit: make install'"
for i in 1 2 3 4 5; do ceiling; done | tee /tmp/pass/ceilings.txt
} 2>&1 | tee $OUT/all.log
QUIET=$(awk '{print $3}' /tmp/pass/ceilings.txt | sort -n | sed -n 3p)
echo "quiet value (median of 5): $QUIET GFLOP/s" | tee -a $OUT/all.log
{
echo "== whole models $(date -u) load: $(cat /proc/loadavg)"
timeout 1800 $NB $PY benchmarks/whole_models.py --cache-dir $C --repeat 10 --quiet-ceiling $QUIET --out $OUT
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/whole.log
{
echo "== int8 FFN seq 128 $(date -u) load: $(cat /proc/loadavg)"
timeout 600 $NB $PY benchmarks/int8_gemm.py --repeat 20
echo "== int8 FFN seq 512 $(date -u) load: $(cat /proc/loadavg)"
timeout 700 $NB $PY benchmarks/int8_gemm.py --repeat 10 --seq 512
echo "== int8 BERT-base 12 layers, seq 128 $(date -u) load: $(cat /proc/loadavg)"
for f in /tmp/pass/bert_dyn.onnx /tmp/pass/bert_qdq.onnx; do timeout 600 $NB $PY benchmarks/int8_whole.py $f --seq 128 --repeat 6; done
echo "== bf16 blocks $(date -u) load: $(cat /proc/loadavg)"
timeout 700 $NB $PY benchmarks/bf16_gemm.py --blocks ffn,mha,block --repeat 20
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/int8_bf16.log
{
echo "== decode fp32 GPT-2 small $(date -u) load: $(cat /proc/loadavg)"; ceiling
timeout 900 $NB $BF bench /tmp/mv/models/gpt2_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --json $OUT/decode_gpt2.json
echo "== decode fp32 Llama GQA $(date -u) load: $(cat /proc/loadavg)"
timeout 900 $NB $BF bench /tmp/mv/models/llama_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --json $OUT/decode_llama.json
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/decode.log
