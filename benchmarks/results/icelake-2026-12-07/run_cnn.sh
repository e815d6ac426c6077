#!/usr/bin/env bash
# Twenty-eighth session, Ice Lake SP: ResNet-50 and MobileNetV2 at full size (results/quiet-2026-12-07g/export_full.py,
# legacy exporter, opset 17, into /tmp/s28/full/) against ORT and OpenVINO f32, bench --profile, one process each.
cd /work/main
OUT=benchmarks/results/icelake-2026-12-07
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
for m in ${MODELS:-resnet50 mobilenet_v2}; do
  echo "== $m $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60
  $NB timeout 1500 .venv/bin/python -m blockforge bench /tmp/s28/full/$m.onnx --shape batch=1 --against ort,openvino,untuned \
     --repeat 20 --profile 2>&1 | grep -v -i "warn" | head -${ROWS:-30}
done 2>&1 | tee -a $OUT/cnn.log
