#!/usr/bin/env bash
# Twenty-eighth session, Intel Xeon (Ice Lake SP, family 6 model 106, 2 vCPUs, avx512_vnni, no
# AVX512_BF16; OpenVINO's own CPU family): issue #19's int8 rows at seq 128, BERT-base FFN, MHA and
# encoder block (export --quantize dynamic | static --per-channel) against ORT and OpenVINO on the
# same files, one process each, SGEMM ceiling before each.
cd /work/main
NB="env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE"
OUT=/work/main/benchmarks/results/icelake-2026-12-07; mkdir -p $OUT/int8 /tmp/i8
BF="$NB BLOCKFORGE_ISOLATE=0 PYTHONPATH=build/dev-src .venv/bin/python -m blockforge"
ceiling() { $NB PYTHONPATH=build/dev-src .venv/bin/python -c "import blockforge; blockforge.configure(); from blockforge.bench.harness import sgemm_ceiling; print(f'SGEMM ceiling {sgemm_ceiling():.0f} GFLOP/s')"; }
for b in ffn mha block; do for q in dynamic static; do
  [ -f /tmp/i8/${b}_${q}.onnx ] || { pc=""; [ $q = static ] && pc="--per-channel"
    $BF export $b --d-model 768 --heads 12 --d-ff 3072 --activation gelu --quantize $q $pc -o /tmp/i8/${b}_${q}.onnx >/dev/null; }
done; done
{
echo "== start $(date -u) load: $(cat /proc/loadavg)"; git log --oneline -1 | cut -c1-60
for s in ${SEQS:-128}; do for b in ffn mha block; do for q in dynamic static; do
  echo "== $b $q seq $s $(date -u) load: $(cat /proc/loadavg) $(ceiling)"
  $BF bench /tmp/i8/${b}_${q}.onnx --shape batch=1,seq=$s --against ort,openvino,untuned --repeat 20 \
     --json $OUT/int8/${b}_${q}_seq${s}.json --force 2>&1 | grep -v -i warn | head -12
done; done; done
echo "== end $(date -u) load: $(cat /proc/loadavg)"
} 2>&1 | tee -a $OUT/int8.log
