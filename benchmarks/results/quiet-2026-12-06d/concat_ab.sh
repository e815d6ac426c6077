#!/usr/bin/env bash
# concat-stack A/B inside the QDQ MHA and block (blockforge export ... --quantize static
# --per-channel, BERT-base sizes), --abba, 2 threads, with the int8 peers on the same file.
cd /work/main
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE BLOCKFORGE_ISOLATE=0"
echo "== start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60
for s in 128 512; do for b in mha block; do
  echo "== $b static seq $s $(date -u) load: $(cat /proc/loadavg)"
  $NB .venv/bin/python benchmarks/whole_ab.py /tmp/i8/${b}_static.onnx --dims batch=1,seq=$s --ab concat-stack --abba --repeat 30 2>&1 | grep -v -i warn | tail -4
done; done
echo "== end $(date -u) load: $(cat /proc/loadavg)"
