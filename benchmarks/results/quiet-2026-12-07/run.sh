#!/usr/bin/env bash
# Twenty-first session (AMD EPYC family 26 model 2 = Zen 5), nothing else running: the
# whole-model table (#20) on this CPU at the current commit (the last Zen 5 table was the seventh
# pass's, before the eighth-twentieth sessions' work). Results beside this script.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07; mkdir -p $OUT
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
C=/tmp/peertable/cache
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; grep -m1 "model name" /proc/cpuinfo; grep -m1 "cpu family" /proc/cpuinfo; grep -m1 "^model\s" /proc/cpuinfo
$PY -c "import tvm, onnxruntime, openvino, onnx, numpy, torch, transformers; print('tvm', tvm.__version__, 'onnxruntime', onnxruntime.__version__, 'openvino', openvino.__version__, 'onnx', onnx.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
git log --oneline -1; $PY -c "import blockforge, os; print('blockforge under test:', os.path.dirname(blockforge.__file__))"
for i in 1 2 3 4 5; do ceiling; done | tee /tmp/ceilings.txt
} 2>&1 | tee $OUT/all.log
QUIET=$(awk '{print $3}' /tmp/ceilings.txt | sort -n | sed -n 3p)
echo "quiet value (median of 5): $QUIET GFLOP/s" | tee -a $OUT/all.log
{
echo "== whole models $(date -u) load: $(cat /proc/loadavg)"
timeout 2400 $NB $PY benchmarks/whole_models.py --cache-dir $C --repeat 10 --quiet-ceiling $QUIET --out $OUT --export-python $PY
echo "== load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/whole.log
