#!/usr/bin/env bash
# THP for TVM's buffers: GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (malloc madvises its mmap'd chunks) vs default,
# alternating processes; blockforge untuned and OpenVINO in each.
cd /work/main  # -> thp.log
W=$(ls /tmp/peertable/cache/wav2vec2_base-*/wav2vec2_base.onnx)
B=$(ls /tmp/peertable/cache/bert_base-*/bert_base.onnx)
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src"
for i in 1 2 3 4; do
  for t in "" glibc.malloc.hugetlb=1; do
    for m in W B; do
      if [ $m = W ]; then f=$W; s="input_values=1x16000"; else f=$B; s="input_ids=1x128,attention_mask=1x128"; fi
      echo "== $m tunable=[$t] $(cat /proc/loadavg | cut -d' ' -f1)"
      GLIBC_TUNABLES=$t $NB .venv/bin/python -m blockforge bench $f --against openvino,untuned --shape $s --repeat 10 2>&1 \
        | grep -E "SGEMM ceiling|^\| (openvino|untuned)" | sed 's/.*dims.*SGEMM/SGEMM/'
    done
  done
done
