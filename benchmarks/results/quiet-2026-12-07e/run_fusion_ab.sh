#!/usr/bin/env bash
# Twenty-fifth session, Zen 5: the attention forms fuse-attention newly takes (MPNet's bias + mask,
# Gemma 2's soft-capping), whole model, fused vs the phase off (--ab fuse-attention), interleaved with
# ORT and OpenVINO f32, both build orders (SEQS="128" -> fusion_ab.log, SEQS=512 -> fusion_ab_512.log;
# after the shared sum of bias + mask: MODELS=mpnet_base SEQS=512 TAG=shared_sum); SGEMM ceiling before and after each. Nothing else running.
# Models: /tmp/s25/export_full.py (random weights; MPNet-base = all-mpnet-base-v2's config; a
# Gemma-2-style decoder of llama_gqa's size with attn softcap 50), legacy exporter, opset 17.
cd /work/main
OUT=benchmarks/results/quiet-2026-12-07e
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0 PYTHONPATH=/work/main/build/dev-src"
ceil() { $NB .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print('SGEMM ceiling %.0f GFLOP/s' % sgemm_ceiling())"; }
for SEQ in ${SEQS:-128}; do for m in ${MODELS:-mpnet_base gemma2_small}; do
  for order in "" "--without-first"; do
    echo "== $m seq $SEQ $order $(date -u) load: $(cat /proc/loadavg) $(ceil)"
    $NB timeout 1200 .venv/bin/python benchmarks/whole_ab.py /tmp/s25/full/$m.onnx --dims batch=1,seq=$SEQ \
      --ab fuse-attention --repeat 10 $order 2>&1 | grep -v -i warn | tail -6
    echo "-- after: load $(cat /proc/loadavg) $(ceil)"
  done
done; done 2>&1 | tee $OUT/fusion_ab${SEQS:+_$SEQS}${TAG:+_$TAG}.log
