#!/usr/bin/env bash
# Twenty-sixth session, Zen 5: depthwise, pointwise and channels-last convs (compile/conv). Nothing
# else running. The depthwise cases alone (conv.py --ab), then the three CNN-heavy families at full
# size (export_new_full.py -> /tmp/s25/full/) against ORT and OpenVINO f32, then each rewrite A/B'd
# inside them (whole_ab.py --abba). SGEMM ceiling before each step.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07f
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
ceil() { $NB .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print('SGEMM ceiling %.0f GFLOP/s' % sgemm_ceiling())"; }
{
echo "== depthwise cases $(date -u) load: $(cat /proc/loadavg) $(ceil)"
$NB timeout 900 .venv/bin/python benchmarks/conv.py --ab conv-depthwise --case mobilevit_dw --case segformer_dw \
   --case convnext_dw56 --case convnext_dw14 --repeat 20 2>&1 | grep -v -i warn
for m in mobilevit_small segformer_b0 convnext_tiny; do
  echo "== $m $(date -u) load: $(cat /proc/loadavg) $(ceil)"
  $NB timeout 1500 .venv/bin/python -m blockforge bench /tmp/s25/full/$m.onnx --shape batch=1 --against ort,openvino,untuned \
     --repeat 10 --profile 2>&1 | grep -v -i "warn" | head -24
done
for ab in "mobilevit_small conv-depthwise" "mobilevit_small conv-pointwise" "segformer_b0 conv-channels-last" \
          "segformer_b0 conv-depthwise" "convnext_tiny conv-depthwise"; do
  set -- $ab
  echo "== A/B $1 without $2 $(date -u) load: $(cat /proc/loadavg) $(ceil)"
  $NB timeout 1500 .venv/bin/python benchmarks/whole_ab.py /tmp/s25/full/$1.onnx --dims batch=1 --ab $2 --abba --repeat 10 2>&1 \
     | grep -v -i warn | tail -3
done
} 2>&1 | tee $OUT/run.log
