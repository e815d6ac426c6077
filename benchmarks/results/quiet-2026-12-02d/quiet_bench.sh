#!/usr/bin/env bash
# The seventh quiet pass (AMD EPYC family 26 = Zen 5, the sixth pass's CPU), nothing else running:
# the whole-model table after this session's three changes (attention-short-tile, split-affine,
# panel-prefetch for 19-64 rows), then each change's A/B in both build orders. Results beside this script.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-02d; mkdir -p $OUT
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
C=/tmp/peertable/cache
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
$PY -c "import tvm, onnxruntime, openvino, onnx, numpy; print('tvm', tvm.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__)"
git log --oneline -1; $PY -c "import blockforge, os; print('blockforge under test:', os.path.dirname(blockforge.__file__))"; $PY -c "from blockforge.compile.pipeline import ABLATIONS; assert 'split-affine' in ABLATIONS, 'the installed package is not this commit: make install'"
for i in 1 2 3 4 5; do ceiling; done | tee /tmp/ceilings.txt
} 2>&1 | tee $OUT/all.log
QUIET=$(awk '{print $3}' /tmp/ceilings.txt | sort -n | sed -n 3p)
echo "quiet value (median of 5): $QUIET GFLOP/s" | tee -a $OUT/all.log
{
echo "== whole models $(date -u) load: $(cat /proc/loadavg)"
timeout 1500 $NB $PY benchmarks/whole_models.py --cache-dir $C --repeat 10 --quiet-ceiling $QUIET --out $OUT
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/whole.log
{
ab() { m=$1; dims=$2; abl=$3; r=$4
  for order in "" "--without-first"; do
    echo "== $m --ab $abl $order $(date -u) load: $(cat /proc/loadavg)"
    timeout 600 $NB $PY benchmarks/whole_ab.py $C/$m-*/$m.onnx --dims $dims --ab $abl --repeat $r --no-peers $order 2>&1 | tail -2
  done; }
ab wav2vec2_base s33=1,s50=16000 attention-short-tile 20
ab whisper_base_encoder s33=1 split-affine 10
ab clip_vision s33=1 panel-prefetch 30
ab wav2vec2_base s33=1,s50=16000 panel-prefetch 20
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/ab.log
