#!/usr/bin/env bash
# Twenty-fifth session, Zen 5: full-size random-weight new families (export_new_full.py -> /tmp/s25/full/: transformers'
# default configs, legacy exporter, opset 17) against ORT and OpenVINO f32, bench --profile, one
# process each; SGEMM ceiling before each. Nothing else running.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07e
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
ceil() { $NB .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print('SGEMM ceiling %.0f GFLOP/s' % sgemm_ceiling())"; }
for m in ${MODELS:-convnext_tiny dinov2_base segformer_b0 mobilevit_small modernbert_base}; do
  shape=""; [ $m = modernbert_base ] && shape="--shape input_ids=1x${SEQ:-512},attention_mask=1x${SEQ:-512}"
  [ $m != modernbert_base ] && shape="--shape batch=1"
  echo "== $m $(date -u) load: $(cat /proc/loadavg) $(ceil)"
  $NB timeout 1500 .venv/bin/python -m blockforge bench /tmp/s25/full/$m.onnx $shape --against ort,openvino,untuned \
     --repeat 10 --profile 2>&1 | grep -v -i "warn" | head -40
done 2>&1 | tee $OUT/new_families.log
