#!/usr/bin/env bash
# Twenty-eighth session, Intel Xeon (Ice Lake SP, family 6 model 106, 2 vCPUs, avx512_vnni, no
# AVX512_BF16): conv-rows (the transposed conv GEMM for ResNet's 7 x 7 and 14 x 14 stages) A/B on the
# bottleneck cases of benchmarks/conv.py, then ResNet-50 whole (export_full.py, legacy exporter)
# with and without it, both build orders (--abba), and bench --profile against ORT and OpenVINO f32.
cd /work/main
OUT=benchmarks/results/icelake-2026-12-07
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
ceil() { $NB .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print('SGEMM ceiling %.0f GFLOP/s' % sgemm_ceiling())"; }
{
echo "== start (conv-rows: 1x1 only) $(date -u) load: $(cat /proc/loadavg) $(ceil) $(ceil)"; git log --oneline -1 | cut -c1-60
$NB .venv/bin/python benchmarks/conv.py --ab conv-rows --case resnet_s3 --case resnet_s4 --repeat 20 2>&1 | grep -v -i warn
echo "== resnet50 A/B $(date -u) load: $(cat /proc/loadavg) $(ceil)"
$NB timeout 1500 .venv/bin/python benchmarks/whole_ab.py /tmp/s28/full/resnet50.onnx --dims batch=1 --ab conv-rows --abba --repeat 10 2>&1 | grep -v -i warn
} 2>&1 | tee -a $OUT/conv.log
