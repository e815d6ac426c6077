#!/usr/bin/env bash
# The sixth pass's second part, after the first clean-clone CI (nothing else running): the whole-model
# table again (does the first part's parity with OpenVINO reproduce?), the peer-in-process effect,
# and the edge app's in-place loop against its copying loop (full GPT-2, capacity 1024, prompt 128).
cd /work/main
OUT=benchmarks/results/quiet-2026-12-02c
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
PY=.venv/bin/python
ceiling() { $NB $PY -c "from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; ceiling; ceiling; ceiling
echo "== edge app, GPT-2 small, in-place vs copying loop, 3 runs each alternating, 64 tokens after a 128-token prompt"
for r in 1 2 3; do for f in "" "--copy-cache"; do
  echo "-- run $r ${f:-in-place}"; timeout 300 $NB /tmp/lead/gpt2_pkg/run.sh $(cat /tmp/lead/gpt2_args.txt) --decode 65 $f | grep -E "steps after|calls:"
done; done
echo "== peer in process, Llama decode entry P=128 $(date -u) load: $(cat /proc/loadavg)"
timeout 400 $NB $PY $OUT/peer_effect.py /tmp/lead/llama_inplace.host /tmp/mv/models/llama_past_legacy_op17.onnx 2>&1 | grep -v Warning
echo "== whole models again $(date -u) load: $(cat /proc/loadavg)"
mkdir -p /tmp/lead/whole2
timeout 1500 $NB $PY benchmarks/whole_models.py --cache-dir /tmp/peertable/cache --repeat 10 --quiet-ceiling 409 --out /tmp/lead/whole2 2>&1 | grep -v Warning
echo "== end $(date -u) load: $(cat /proc/loadavg)"; ceiling
} 2>&1 | tee $OUT/second.log
cp /tmp/lead/whole2/whole-models-*.md $OUT/second-whole-models.md 2>/dev/null
