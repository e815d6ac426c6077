#!/usr/bin/env bash
# per export: softmax count in the import vs fused_attention calls after fuse-attention
OUT=${OUT:-/tmp/s25/sweep}; cd "$(dirname "$OUT")"
for f in ${FILES:-$OUT/*.onnx}; do
  b=$(basename $f .onnx); d=dumps/$b; rm -rf $d; mkdir -p dumps
  PYTHONPATH=/work/main/build/dev-src timeout 600 /work/main/.venv/bin/python -m blockforge compile $f --target host \
     --shape $(/work/main/.venv/bin/python -c "import numpy as np,sys; d=np.load(sys.argv[1]); print(\",\".join(k+\"=\"+\"x\".join(map(str,v.shape)) for k,v in d.items()))" $OUT/$b.npz) --dump-ir $d -o dumps/$b.art > dumps/$b.log 2>&1 || { echo "$b compile-fail $(tail -1 dumps/$b.log | cut -c1-200)"; continue; }
  sm=$(grep -c "R.nn.softmax" $d/00-import.py)
  fa=$(grep -c "fused_attention" $d/01-fuse-attention.py | head -1)
  calls=$(grep -E "= R.call_tir\(cls.fused_attention|call_tir\(cls\.fused_attention" $d/01-fuse-attention.py | wc -l)
  left=$(grep -c "R.nn.softmax" $d/01-fuse-attention.py)
  echo "$b softmax_in_import=$sm attention_calls=$calls softmax_left=$left"
  rm -rf dumps/$b.art
done
