#!/usr/bin/env bash
# Twenty-seventh session, Zen 5: full-size random-weight new families (export_full.py -> /tmp/s27/full/, legacy
# exporter, opset 17) against ORT and OpenVINO f32, bench --profile, one process each; SGEMM ceiling before each.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07g
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
ceil() { $NB .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print('SGEMM ceiling %.0f GFLOP/s' % sgemm_ceiling())"; }
for m in ${MODELS:-resnet50 mobilenet_v2 efficientnet_b0 cvt_13}; do
  echo "== $m $(date -u) load: $(cat /proc/loadavg) $(ceil)"
  $NB timeout 1500 .venv/bin/python -m blockforge bench /tmp/s27/full/$m.onnx --shape batch=1 --against ort,openvino,untuned \
     --repeat 10 --profile 2>&1 | grep -v -i "warn" | head -${ROWS:-40}
done 2>&1 | tee -a $OUT/new_full.log
