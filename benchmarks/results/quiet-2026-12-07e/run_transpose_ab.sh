#!/usr/bin/env bash
# Twenty-fifth session, Zen 5: transposing elementwise kernels tiled (ablation transpose-tiles) on the
# new families where reshape/transpose kernels showed in the profile (new_families.log), whole model,
# interleaved with ORT and OpenVINO f32, both build orders; SGEMM ceiling before and after.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07e
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
ceil() { $NB .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print('SGEMM ceiling %.0f GFLOP/s' % sgemm_ceiling())"; }
for m in ${MODELS:-mobilevit_small segformer_b0 convnext_tiny}; do
  for order in "" "--without-first"; do
    echo "== $m $order $(date -u) load: $(cat /proc/loadavg) $(ceil)"
    $NB timeout 1200 .venv/bin/python benchmarks/whole_ab.py /tmp/s25/full/$m.onnx --dims batch=1 \
      --ab ${AB:-transpose-tiles} --repeat 10 $order 2>&1 | grep -v -i warn | tail -3
  done
done 2>&1 | tee $OUT/transpose_ab${TAG:+_$TAG}.log
