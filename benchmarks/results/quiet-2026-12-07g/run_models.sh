#!/usr/bin/env bash
# The three CNN-heavy families on a quieter host (twenty-seventh session), four processes each:
# bench --against ort,openvino,untuned, SGEMM ceiling before each.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07g
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
ceil() { $NB .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print('SGEMM ceiling %.0f GFLOP/s' % sgemm_ceiling())"; }
for i in 1 2 3 4; do for m in mobilevit_small segformer_b0 convnext_tiny; do
  echo "== $m #$i $(date -u) load: $(cat /proc/loadavg) $(ceil)"
  $NB timeout 1500 .venv/bin/python -m blockforge bench /tmp/s25/full/$m.onnx --shape batch=1 --against ort,openvino,untuned \
     --repeat 10 2>&1 | grep -v -i "warn" | grep "SGEMM\|^| \(ort\|openvino\|untuned\)"
done; done 2>&1 | tee $OUT/models.log
