"""int8 on the VNNI kernel (compile/quant) against float32, interleaved in one process:

1. the int8 GEMM kernels the quantized FFN runs (their specs taken from its int8-gemm phase:
   scale, bias and gelu in the epilogue) and the bare int32 kernel at the same shape, vs
   blockforge's fp32 GEMM and a VNNI probe (independent VPDPBUSD zmm chains: the instruction
   rate this machine gives now), with numpy's SGEMM ceiling (a 2048 square, as `bench`
   measures it) before and after: GOP/s, the multiple of the SGEMM ceiling, % of the VNNI
   peak (cores x 128 ops/cycle x the clock) and of the probe;
2. the BERT-base FFN (d_model 768, d_ff 3072, gelu, seq 128) quantized with ORT's
   quantize_dynamic (QInt8 weights) and quantize_static (QDQ S8S8 per-channel): blockforge
   before (the int8-gemm phase left out: TVM's int32 GEMM loops, or dequantize + float32
   GEMM for QDQ) / after / ONNX Runtime on the same quantized file / blockforge on the
   float32 model.

numpy's SGEMM is never interleaved with TVM's kernels: OpenBLAS's workers spin for longer
than measure_interleaved's pause after each call and took the two cores from TVM's pool
(this script once timed the FFN's 128x768x3072 GEMM at 3.9 ms beside them, 1.9 ms alone,
and the whole FFN, two such GEMMs, at 1.86 ms).

`--threads 1` times one thread in CPU time (time.thread_time): on a shared machine a
descheduled thread's wait then does not count, so these ratios hold under load; `--tiles`
also times every tile candidate of the FFN's kernels (gemm.tile_candidates: what `tune`
searches) against the default tiles.

Every line carries the load average: on a shared machine the absolute numbers are not
quotable, the ratios within one run are.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/int8_gemm.py [--repeat 20] [--threads 1] [--tiles] [--seq 512] [--no-avx512] [--no-vnni] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("BLOCKFORGE_ISOLATE", "0")  # our own models; no child-process check
# --threads N: TVM's pool and OpenBLAS read their thread counts when they start (before numpy's import)
_T = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 1] for i, a in enumerate(sys.argv)
           if a.split("=", 1)[0] == "--threads" and ("=" in a or i + 1 < len(sys.argv))), None)
if _T:
    os.environ["TVM_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = _T

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from blockforge import configure  # noqa: E402
from blockforge.bench import REGISTRY, measure_interleaved  # noqa: E402
from blockforge.bench.contenders import BenchModel  # noqa: E402
from blockforge.bench.harness import sgemm_ceiling  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import FFNSpec, export  # noqa: E402
from blockforge.graph import ort as ort_runner  # noqa: E402
from blockforge.graph.model_io import random_inputs  # noqa: E402

FULL = dict(gemm=(128, 768, 3072), ffn=FFNSpec(d_model=768, d_ff=3072, activation="gelu"), seq=128)
SMOKE = dict(gemm=(16, 64, 128), ffn=FFNSpec(d_model=64, d_ff=128, activation="gelu"), seq=8)


def _load() -> str:
    return "load %.1f/%.1f/%.1f" % os.getloadavg()


# Per core and cycle: one 512-bit VPDPBUSD = 64 u8 x s8 products = 128 ops. Zen 4 runs it
# double-pumped on two 256-bit units (measured here: 2 ymm or 1 zmm per cycle); Ice Lake and
# Sapphire Rapids issue one zmm per cycle too.
VNNI_OPS_PER_CYCLE = 128


def _cpu_mhz() -> float | None:
    """/proc/cpuinfo's clock (a VM reports the nominal one; boost can be higher)."""
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
    except (OSError, ValueError, IndexError):
        return None
    return max(mhz) if mhz else None


def _vnni_probe(threads: int, iters: int = 200000, chains: int = 24):
    """(call, ops): `chains` independent VPDPBUSD zmm accumulators per thread, in registers,
    on `threads` threads (bench.harness.chain_probe): the instruction rate the cores give now.
    ~1.3 ms a call at 3.7 GHz: at 0.13 ms the call's own overhead read ~5% low."""
    from tvm import tirx

    from blockforge.bench.harness import chain_probe

    def vpdpbusd(acc, a, b):
        return tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc,
                                          tirx.reinterpret("int8x64", a), b)

    call, sums = chain_probe(vpdpbusd, np.ones(64, np.uint8), np.ones(64, np.int8), ("int32", 16), threads, iters,
                             chains)
    assert (sums.numpy() == 4 * iters).all(), "the probe's chains did not run"
    return call, threads * iters * chains * VNNI_OPS_PER_CYCLE


def _kernel_call(spec, tiles=None):
    """(call, max |kernel - numpy|) of one int8 GEMM kernel on random operands (int32 out: exact)."""
    import tvm

    from blockforge.compile.quant import gemm
    from blockforge.targets import resolve

    m, k, n = spec.m, spec.k, spec.n
    target = resolve("host").tvm_target()
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec, tiles, gemm.epilogue_for(target))}), target=target)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    w = rng.integers(-128, 128, (k, n), dtype=np.int8)
    scale = {"none": None, "scalar": np.array(2e-6, np.float32), "column": np.full(n, 2e-6, np.float32)}[spec.scale]
    bias = rng.standard_normal(n).astype(np.float32) if spec.bias else None
    rowcorr = np.zeros(m, np.int32) if spec.rowcorr else None
    ins = [a, gemm.pack_weights(w), gemm.column_sums(w), np.array(3, np.int32)]
    ins += [x for x in (rowcorr, scale, bias) if x is not None]
    args = [tvm.runtime.tensor(np.asarray(x)) for x in ins]
    out = tvm.runtime.tensor(np.zeros((m, n), spec.out_dtype))
    lib["main"](*args, out)
    err = 0.0
    if spec.activation == "none" and ("gelu",) not in spec.post:  # (gelu's polynomial: tests/test_int8_gemm.py)
        err = float(np.abs(out.numpy().astype(np.float64) - gemm.reference(spec, a, w, 3, 0, scale, bias)).max())
    return (lambda: lib["main"](*args, out)), err


def _gemm(shape, repeat: int, ffn_specs: list, threads: int, tiles: bool, qdq_specs: list = ()) -> float:
    """The int8 kernels (the dynamic FFN's, `ffn_specs`, and the QDQ FFN's) against the SGEMM
    ceiling and the VNNI rate; returns the ceiling."""
    from blockforge.compile.quant import gemm

    m, k, n = shape
    clock = time.thread_time if threads == 1 else time.perf_counter  # one thread: its CPU time
    ceil_before = sgemm_ceiling(clock=clock)
    time.sleep(0.5)  # OpenBLAS's workers stop spinning before TVM's pool is timed
    bare = gemm.Int8GemmSpec(k=k, n=n, m=m)
    specs = {f"bare {bare.describe()}": bare, **{f"FFN {sp.describe()}": sp for sp in ffn_specs},
             **{f"QDQ FFN {sp.describe()}": sp for sp in qdq_specs}}
    calls, errs, ops = {}, {}, {}
    for name, sp in specs.items():
        calls[name], errs[name] = _kernel_call(sp)
        ops[name] = 2 * sp.m * sp.k * sp.n
    # the FFN's kernels on the 6 x 4 tile before the stack-sized default (the int8-stack-tiles ablation)
    legacy = {}
    for sp in ffn_specs:
        t = gemm.default_tiles(sp, stack=False)
        if t != gemm.default_tiles(sp):
            key = f"FFN {sp.describe()} at {t.describe()} (int8-stack-tiles off)"
            legacy[key] = sp
            calls[key], errs[key] = _kernel_call(sp, t)
            ops[key] = 2 * sp.m * sp.k * sp.n
    af = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
    calls["blockforge fp32 GEMM"], ops["blockforge fp32 GEMM"] = _fp32_gemm(af, np.ones((k, n), np.float32)), 2 * m * k * n
    calls["VNNI probe"], ops["VNNI probe"] = _vnni_probe(threads)
    load = _load()
    med = {key: float(np.median(v)) for key, v in measure_interleaved(calls, repeat, warmup=2, clock=clock).items()}
    time.sleep(0.2)
    ceil_after = sgemm_ceiling(clock=clock)
    rate = {key: ops[key] / (ms * 1e-3) / 1e9 for key, ms in med.items()}
    # The ceiling: numpy's SGEMM (before and after) or blockforge's own fp32 GEMM, the fastest
    ceiling = max(ceil_before, ceil_after, rate["blockforge fp32 GEMM"])
    mhz = _cpu_mhz()
    peak = threads * VNNI_OPS_PER_CYCLE * mhz / 1e3 if mhz else None
    probe = rate["VNNI probe"]
    print(f"{threads} thread(s), {'CPU time' if threads == 1 else 'wall time'} ({load} -> {_load()}): "
          f"SGEMM ceiling {ceil_before:.0f} before / {ceil_after:.0f} after GFLOP/s (numpy 2048^2), "
          f"blockforge fp32 GEMM {m}x{k}x{n} {med['blockforge fp32 GEMM']:.3f} ms = {rate['blockforge fp32 GEMM']:.0f} "
          f"GFLOP/s; ceiling used {ceiling:.0f}. VNNI probe {probe:.0f} GOP/s"
          + (f"; VNNI peak {threads} x {VNNI_OPS_PER_CYCLE} ops/cycle x {mhz / 1e3:.2f} GHz (/proc/cpuinfo) = "
             f"{peak:.0f} GOP/s (probe / peak {probe / peak:.2f}: above 1 the cores boost past that clock, below "
             f"they are shared)" if peak else ""))
    for name in [*specs, *legacy]:
        print(f"  int8 {name} (max err vs numpy {errs[name]:.1e}): {med[name]:.3f} ms = {rate[name]:.0f} GOP/s = "
              f"{rate[name] / ceiling:.2f}x the SGEMM ceiling, {100 * rate[name] / probe:.0f}% of the VNNI probe"
              + (f", {100 * rate[name] / peak:.0f}% of the nominal-clock VNNI peak" if peak else ""))
    for what, group in (("FFN", ffn_specs), ("QDQ FFN", qdq_specs)):
        if not group:
            continue
        t = sum(med[f"{what} {sp.describe()}"] for sp in group)
        r = sum(2 * sp.m * sp.k * sp.n for sp in group) / (t * 1e-3) / 1e9
        print(f"  the {what}'s {len(group)} GEMMs together: {t:.3f} ms = {r:.0f} GOP/s = {r / ceiling:.2f}x the SGEMM "
              f"ceiling ({100 * r / (4 * ceiling):.0f}% of the VNNI rate, 4x the ceiling), {100 * r / probe:.0f}% of the VNNI probe")
    if tiles:
        _tiles([*ffn_specs, *qdq_specs], repeat, clock)
    return ceiling


def _tiles(specs: list, repeat: int, clock) -> None:
    """Every tile candidate of each kernel (what `tune` searches) against the default tiles."""
    from blockforge.compile.quant import gemm

    for sp in specs:
        calls = {t.describe(): _kernel_call(sp, t)[0] for t in gemm.tile_candidates(sp)}
        default = gemm.default_tiles(sp).describe()
        load = _load()
        med = {key: float(np.median(v)) for key, v in measure_interleaved(calls, repeat, warmup=2, clock=clock).items()}
        ranked = sorted(med, key=med.get)
        print(f"  tiles of {sp.describe()} ({load} -> {_load()}), time / default {default}: "
              + ", ".join(f"{key} {med[key] / med[default]:.3f}" for key in ranked))


def _fp32_gemm(af: np.ndarray, wf: np.ndarray):
    """blockforge's float32 GEMM (prepacked weights, CPUMatmul) on the same shape, as a call."""
    import tvm
    from tvm import relax

    from blockforge.compile.pipeline import build
    from blockforge.targets import resolve

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(list(af.shape), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(wf)))
        bb.emit_func_output(y)
    vm = relax.VirtualMachine(build(bb.get(), resolve("host")).executable, tvm.cpu())
    xt = tvm.runtime.tensor(af)
    return lambda: vm["main"](xt)


def _quantize(fp32: Path, mode: str, seq: int, d_model: int, tmp: Path, reduce_range: bool = False) -> Path:
    """ORT's quantizers as issue #19 ran them: dynamic QInt8 weights; static QDQ S8S8
    per-channel, calibrated on 8 random batches after quant_pre_process; reduce_range: 7-bit
    weights (what x86 without VNNI runs on VPMADDUBSW: compile/quant/isa.py)."""
    from onnxruntime import quantization as q

    out = tmp / f"ffn_{mode}{'_7bit' if reduce_range else ''}.onnx"
    if mode == "dynamic":
        q.quantize_dynamic(str(fp32), str(out), weight_type=q.QuantType.QInt8, reduce_range=reduce_range)
        return out

    class Batches(q.CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"x": np.random.default_rng(i).standard_normal((1, seq, d_model)).astype(np.float32)}
                            for i in range(8)])

        def get_next(self):
            return next(self.it, None)

    from onnxruntime.quantization.shape_inference import quant_pre_process

    quant_pre_process(str(fp32), str(tmp / "pre.onnx"))
    q.quantize_static(str(tmp / "pre.onnx"), str(out), Batches(), quant_format=q.QuantFormat.QDQ,
                      activation_type=q.QuantType.QInt8, weight_type=q.QuantType.QInt8, per_channel=True,
                      reduce_range=reduce_range)
    return out


# --no-avx512: what a CPU without AVX-512 gets (Alder Lake and newer clients): the int8 build
# for x86-64-avxvnni (256-bit VEX VPDPBUSD) against the fp32 build for x86-64-avx2, both run on
# this CPU (Zen 5 has AVX-VNNI too), so the ratio is the ISA's, not an Alder Lake's clock.
NO_AVX512 = (("blockforge int8, x86-64-avxvnni", "x86-64-avxvnni", "quant"),
             ("blockforge fp32, x86-64-avx2", "x86-64-avx2", "fp32"))
# --no-vnni: what a CPU without VNNI gets (Haswell to Ice Lake clients, Skylake-SP, Zen 1-3):
# int8 on VPMADDUBSW (compile/quant/isa.py "avx2", "avx512bw") for 7-bit weights, the same
# model's full-range quantization (on the exact VPMADDWD fallback there) and fp32, for
# x86-64-avx2 and x86-64-avx512, all run on this CPU: the ratios are the ISA's.
NO_VNNI = tuple((f"blockforge {what}, {preset}", preset, which) for preset in ("x86-64-avx2", "x86-64-avx512")
                for what, which in (("int8 7-bit", "quant7"), ("int8 full-range", "quant"), ("fp32", "fp32")))


def _ffn(spec: FFNSpec, seq: int, repeat: int, sgemm: float, tmp: Path, mode: str, threads: int,
         no_avx512: bool = False, no_vnni: bool = False) -> None:
    import tvm
    from tvm import relax

    fp32 = export(spec, tmp / "ffn.onnx").model_path
    quant = _quantize(fp32, mode, seq, spec.d_model, tmp)
    dims = {"batch": 1, "seq": seq}
    sq, sf = open_model(quant, "host", dims), open_model(fp32, "host", dims)
    inputs = random_inputs(sq.inputs, dims, seed=0)

    def tvm_call(session, without=frozenset()):
        res = session.build(without=without)
        vm = relax.VirtualMachine(res.executable, tvm.cpu())
        args = [tvm.runtime.tensor(inputs[s.name]) for s in session.inputs]
        return (lambda: vm["main"](*args)), res

    before, _ = tvm_call(sq, {"int8-gemm"})
    after, res = tvm_call(sq)
    ours_fp32, _ = tvm_call(sf)
    # ORT as `bench` runs it (spinning workers on: its default and its speed); the harness's
    # interleaving pauses between contenders so those workers stop before the next one runs
    # (ORT with spinning off measured 3.4 ms here against 2.0 ms with it on).
    ort = ort_runner.session(sq.model, threads=threads)
    ref = next(iter(ort_runner.run(ort, inputs).values()))
    err = float(np.abs(after().numpy() - ref).max())
    peer = f"ORT int8 {mode} (same file)"
    calls = {"blockforge int8 (before: int8-gemm off)": before, "blockforge int8 (after)": after,
             peer: lambda: ort.run(None, inputs), "blockforge fp32": ours_fp32}
    if mode == "static":  # the requantize/gelu chain between the GEMMs as a second kernel (A/B)
        calls["blockforge int8 (int8-qdq-epilogue off)"], _ = tvm_call(sq, {"int8-qdq-epilogue"})
        # gelu and the quantize per element instead of from the byte table (gemm.lut_tail)
        calls["blockforge int8 (int8-lut-tail off)"], _ = tvm_call(sq, {"int8-lut-tail"})
        # the quantize's division per element instead of the multiply by 1 / scale (gemm.Epilogue)
        calls["blockforge int8 (reciprocal off)"], _ = tvm_call(sq, {"reciprocal"})
    # the untuned kernels on the 6 x 4 tile (1536 B of accumulators: a workspace per row tile)
    calls["blockforge int8 (int8-stack-tiles off)"], _ = tvm_call(sq, {"int8-stack-tiles"})
    files = {"quant": quant, "fp32": fp32}
    if no_vnni:
        files["quant7"] = _quantize(fp32, mode, seq, spec.d_model, tmp, reduce_range=True)
        ref7 = next(iter(ort_runner.run(onnx.load(str(files["quant7"])), inputs).values()))
        exact = next(iter(ort_runner.run(onnx.load(str(fp32)), inputs).values()))
        rel = lambda y: float(np.linalg.norm(y - exact) / np.linalg.norm(exact))  # noqa: E731
        print(f"  rel L2 against the fp32 FFN (ORT on each file): full-range weights {rel(ref):.2e}, "
              f"7-bit {rel(ref7):.2e}")
    from blockforge.targets import resolve

    for name, preset, which in (NO_AVX512 if no_avx512 else ()) + (NO_VNNI if no_vnni else ()):
        if resolve(preset).run_problem() is None:
            s = open_model(files[which], preset, dims)
            calls[name], _ = tvm_call(s)
            if which == "quant7":
                got = calls[name]().numpy()
                print(f"  {name}: max |blockforge - ORT on the 7-bit file| {float(np.abs(got - ref7).max()):.2e}")
    peers = [peer]
    ov = REGISTRY["openvino"]
    if ov.available():  # bench's OpenVINO contender: f32 hint (QDQ still runs in int8), latency hint
        bm = BenchModel(session=sq, onnx=sq.model, spec=None, dims=dims)
        # ONEDNN_MAX_CPU_ISA=AVX2 in the environment caps OpenVINO's oneDNN at AVX2 (no VNNI):
        # the peer a CPU without VNNI has (its fp32 FFN 3.9 ms there against 2.8, Zen 5). ORT's
        # MLAS has no such cap. (AVX512_CORE did not keep its int8 off VNNI: 951 GOP/s, above
        # VPMADDUBSW zmm's 531.)
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
        name = f"OpenVINO (same file{', ONEDNN_MAX_CPU_ISA=' + cap if cap else ''})"
        calls[name] = ov.make_runner(bm, inputs, threads)
        peers.append(name)
    # one thread: the process's CPU time (as the kernels' thread time above; the process's, so
    # that OpenVINO's work on a stream thread of its own is counted too)
    samples = measure_interleaved(calls, repeat, warmup=2, clock=time.process_time if threads == 1 else time.perf_counter)
    med = {k: float(np.median(v)) for k, v in samples.items()}
    what = "quantize_dynamic QInt8" if mode == "dynamic" else "quantize_static QDQ S8S8 per-channel"
    print(f"FFN d_model {spec.d_model} d_ff {spec.d_ff} {spec.activation} seq {seq}, {what} "
          f"({threads} thread(s), {'process CPU time' if threads == 1 else 'wall'}; {_load()}; SGEMM ceiling {sgemm:.0f} GFLOP/s; phases {' > '.join(res.phases)}; "
          f"max |after - ORT| {err:.2e}):")
    base, best = med["blockforge fp32"], min(med[p] for p in peers)
    for k, ms in med.items():
        print(f"  {k}: {ms:.3f} ms ({ms / base:.2f}x blockforge fp32, {ms / best:.2f}x the best peer)")


def _ffn_kernel_specs(spec: FFNSpec, seq: int, tmp: Path, mode: str = "dynamic") -> list:
    """The int8 GEMM specs the quantized FFN's int8-gemm phase emits (QDQ: with the
    requantize/bias/gelu chain in their epilogues, gemm.POST_STEPS)."""
    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.quant import gemm

    quant = _quantize(export(spec, tmp / "ffn.onnx").model_path, mode, seq, spec.d_model, tmp)
    s = open_model(quant, "host", {"batch": 1, "seq": seq})
    mod, _ = run_phases(s.relax(), s.target, stop_after="int8-gemm")
    return list(dict.fromkeys(gemm.kernel_specs(mod)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="TVM's and OpenBLAS's threads (default: the "
                    "physical cores); 1: timed in CPU time")
    ap.add_argument("--tiles", action="store_true", help="also time every tile candidate of the FFN's kernels")
    ap.add_argument("--gemm-only", action="store_true", help="the kernels only, not the FFN contenders")
    ap.add_argument("--smoke", action="store_true", help="toy sizes: proves the script runs (tests/test_benchmarks.py), measures nothing")
    ap.add_argument("--seq", type=int, default=None, help="the FFN's rows and the bare GEMM's M (default 128; smoke 8)")
    ap.add_argument("--no-vnni", action="store_true", help="also int8 (7-bit weights), full-range int8 and fp32 "
                    "builds for x86-64-avx2 and x86-64-avx512 (CPUs without VNNI: VPMADDUBSW), where this CPU runs them")
    ap.add_argument("--no-avx512", action="store_true", help="also the int8 build for x86-64-avxvnni and the fp32 "
                    "build for x86-64-avx2 (a CPU without AVX-512), where this CPU runs them")
    a = ap.parse_args()
    configure(redirect_native_output=False)
    from blockforge.compile.quant.intrin import has_vnni
    from blockforge.targets import resolve

    from blockforge.targets.toolchain import cpu_model

    cpu = cpu_model()
    print(f"CPU: {cpu}, {os.cpu_count()} logical cores; shared machine: read ratios, not digits")
    if not has_vnni(resolve("host").tvm_target()):
        print("this CPU has no AVX-512 VNNI: the int8 kernel cannot run here; nothing to measure")
        return 0
    cfg = SMOKE if a.smoke else FULL
    if a.seq:  # (issue #19's second shape: seq 512)
        cfg = dict(cfg, seq=a.seq, gemm=(a.seq, *cfg["gemm"][1:]))
    threads = int(os.environ["TVM_NUM_THREADS"])  # configure() set it (or --threads did)
    with tempfile.TemporaryDirectory(prefix="int8-gemm-") as tmp:  # the exported FFNs, removed at the end
        dirs = [Path(tmp) / d for d in ("dynamic-specs", "static-specs", "dynamic", "static")]
        for d in dirs:
            d.mkdir()
        specs = _ffn_kernel_specs(cfg["ffn"], cfg["seq"], dirs[0])
        qdq = _ffn_kernel_specs(cfg["ffn"], cfg["seq"], dirs[1], "static")
        sgemm = _gemm(cfg["gemm"], a.repeat, specs, threads, a.tiles, qdq)
        if a.gemm_only:
            return 0
        for mode, d in zip(("dynamic", "static"), dirs[2:]):
            _ffn(cfg["ffn"], cfg["seq"], a.repeat, sgemm, d, mode, threads, a.no_avx512, a.no_vnni)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
