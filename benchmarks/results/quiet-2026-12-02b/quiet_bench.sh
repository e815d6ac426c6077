#!/usr/bin/env bash
# One quiet benchmark pass on this session's machine (AMD EPYC family 26 = Zen 5; the earlier
# passes ran on family 25 = Zen 4): nothing else running. Results beside this script.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-02b; mkdir -p $OUT
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
BF=.venv/bin/blockforge
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
ceiling; ceiling
$PY -c "import tvm, onnxruntime, openvino, onnx, numpy; print('tvm', tvm.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__)"
echo "== stack-allocs A/B, BERT-base post-LN block seq 128, both build orders $(date -u)"
$BF export block --d-model 768 --heads 12 --d-ff 3072 --activation gelu --norm post -o /tmp/bert_block.onnx --force >/dev/null
timeout 300 $NB $PY benchmarks/whole_ab.py /tmp/bert_block.onnx --dims batch=1,seq=128 --ab stack-allocs --repeat 30
timeout 300 $NB $PY benchmarks/whole_ab.py /tmp/bert_block.onnx --dims batch=1,seq=128 --ab stack-allocs --repeat 30 --without-first
echo "== whole models $(date -u) load: $(cat /proc/loadavg)"
timeout 1500 $NB $PY benchmarks/whole_models.py --cache-dir /tmp/peertable/cache --repeat 10 --quiet-ceiling ${QUIET_CEILING:?} --out $OUT
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/whole.log
{
echo "== decode fp32 GPT-2 small $(date -u) load: $(cat /proc/loadavg)"; ceiling
timeout 900 $NB $BF bench /tmp/mv/models/gpt2_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --json $OUT/decode_gpt2.json
echo "== decode fp32 Llama GQA $(date -u) load: $(cat /proc/loadavg)"
timeout 900 $NB $BF bench /tmp/mv/models/llama_past_legacy_op17.onnx --decode --past 128,512 --prompt 128 --json $OUT/decode_llama.json
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/decode.log
{
echo "== int8 blocks seq 128 $(date -u) load: $(cat /proc/loadavg)"
timeout 600 $NB $PY benchmarks/int8_gemm.py --repeat 20
echo "== int8 blocks seq 512 $(date -u) load: $(cat /proc/loadavg)"
timeout 700 $NB $PY benchmarks/int8_gemm.py --repeat 10 --seq 512
echo "== bf16 blocks $(date -u) load: $(cat /proc/loadavg)"
timeout 700 $NB $PY benchmarks/bf16_gemm.py --blocks ffn,mha,block --repeat 20 --ab bf16-attention
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/int8.log
