"""bf16 on the VDPBF16PS kernel (compile/bf16, `--precision bf16`) against float32 and
OpenVINO's bf16, interleaved in one process:

1. the bf16 GEMM kernel alone vs numpy's SGEMM and blockforge's fp32 GEMM at the same shape
   (GFLOP/s; x the SGEMM ceiling, the faster of the two: VDPBF16PS's hardware target is ~2x);
2. the BERT-base FFN (d_model 768, d_ff 3072, gelu, seq 128; `--blocks ffn,mha,block` adds the
   MHA (12 heads) and the post-LN encoder block, `--seq` another length): blockforge
   --precision bf16, blockforge fp32, OpenVINO with the bf16 precision hint, OpenVINO f32 and
   ONNX Runtime (fp32), with each output's relative L2 error against ORT's float32.

Every line carries the load average: on a shared machine the absolute numbers are not
quotable, the ratios within one run are.

`--ab NAME[,NAME]` adds the bf16 build without each ablation NAME (compile/pipeline.py ABLATIONS,
e.g. bf16-attention, bf16-row-fit) as one more contender of the same run.

    flock /tmp/blockforge-bench.lock .venv/bin/python benchmarks/bf16_gemm.py [--repeat 20] [--blocks ffn,mha,block] [--seq N] [--threads 1] [--ab NAME] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import sys

os.environ.setdefault("BLOCKFORGE_ISOLATE", "0")  # our own models; no child-process check
# --threads 1: TVM's pool and OpenBLAS read their thread counts when they start (before numpy's import)
if "--threads" in sys.argv[:-1] and sys.argv[sys.argv.index("--threads") + 1] == "1":
    os.environ["TVM_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"
THREADS = 1 if os.environ.get("TVM_NUM_THREADS") == "1" else 2
# One thread each: the process's CPU time, which a shared machine's descheduling does not add to
# and which counts an engine's work on a worker thread of its own too (OpenVINO's streams).
CLOCK = time.process_time if THREADS == 1 else time.perf_counter

import numpy as np  # noqa: E402

from blockforge import configure  # noqa: E402
from blockforge.bench import REGISTRY, measure_interleaved  # noqa: E402
from blockforge.bench.harness import sgemm_ceiling  # noqa: E402
from blockforge.bench.contenders import BenchModel  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import BlockSpec, FFNSpec, MHASpec, export  # noqa: E402
from blockforge.graph import ort as ort_runner  # noqa: E402
from blockforge.graph.model_io import random_inputs  # noqa: E402

FULL = dict(gemm=(128, 768, 3072), ffn=FFNSpec(d_model=768, d_ff=3072, activation="gelu"), seq=128)
SMOKE = dict(gemm=(16, 64, 128), ffn=FFNSpec(d_model=64, d_ff=128, activation="gelu"), seq=8)
# --blocks: the BERT-base blocks issue #19's bf16 target names (<= 0.9x OpenVINO bf16), at toy sizes for --smoke
BLOCKS = {"mha": (MHASpec(d_model=768, heads=12), MHASpec(d_model=64, heads=2)),
          "block": (BlockSpec(d_model=768, heads=12, d_ff=3072, activation="gelu", norm="post", eps=1e-12),
                    BlockSpec(d_model=64, heads=2, d_ff=128, activation="gelu", norm="post", eps=1e-12))}


def _load() -> str:
    return "load %.1f/%.1f/%.1f" % os.getloadavg()


def _medians(calls: dict, repeat: int) -> dict[str, float]:
    return {k: float(np.median(v)) for k, v in measure_interleaved(calls, repeat, warmup=2, clock=CLOCK).items()}


def _rel_l2(got, ref) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))


def _probe(threads: int, iters: int = 100000, chains: int = 24, smoke: bool = False):
    """(call, FLOPs a call): `chains` independent VDPBF16PS zmm accumulators per thread, in
    registers, on `threads` threads (bench.harness.chain_probe): the instruction's rate the
    cores give now, timed with the contenders, so each one's GFLOP/s reads as a fraction of it.
    (The C loop quoted before this probe existed read 953 GFLOP/s on two Zen 5 threads, while
    the FFN at seq 128 alone ran 1.23 ms = 980 GFLOP/s: a rate from another minute.)"""
    from blockforge.bench.harness import chain_probe
    from blockforge.compile.bf16.intrin import IMPORT_PRAGMA, LLVM_IR, dpbf16

    iters = 100 if smoke else iters
    one_pair = np.full(16, 0x3F803F80, np.uint32).view(np.int32)  # bf16 (1.0, 1.0) in each lane
    call, sums = chain_probe(dpbf16, one_pair, one_pair, ("float32", 16), threads, iters, chains,
                             annotations={IMPORT_PRAGMA: LLVM_IR})
    assert (sums.numpy() == 2 * iters).all(), "the probe's chains did not run"
    return call, threads * iters * chains * 16 * 2 * 2


def _gemm(shape, repeat: int, probe) -> None:
    import tvm
    from tvm import relax

    from blockforge.compile.bf16 import gemm
    from blockforge.compile.pipeline import build
    from blockforge.targets import resolve

    m, k, n = shape
    host = resolve("host")
    spec = gemm.Bf16GemmSpec(k=k, n=n, m=m)
    lib = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=host.tvm_target())
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    args = [tvm.runtime.tensor(a), tvm.runtime.tensor(gemm.pack_weights(w))]
    out = tvm.runtime.tensor(np.zeros((m, n), np.float32))
    lib["main"](*args, out)
    exact = float(np.abs(out.numpy() - gemm.reference(a, w)).max())
    # blockforge's float32 GEMM (prepacked weights, CPUMatmul) on the same shape
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([m, k], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.const(w)))
        bb.emit_func_output(y)
    vm = relax.VirtualMachine(build(bb.get(), host).executable, tvm.cpu())
    xt = tvm.runtime.tensor(a)
    # numpy's SGEMM is never interleaved with TVM's kernels: OpenBLAS's workers spin for tens of
    # ms after each call and take both cores from TVM's pool (int8_gemm.py measured 1.89 ms alone
    # vs 4.91 ms right after one SGEMM). The ceiling is taken before and after instead.
    ceil_before = sgemm_ceiling(clock=CLOCK)
    time.sleep(0.5)
    med = _medians({"bf16": lambda: lib["main"](*args, out), "fp32": lambda: vm["main"](xt), "probe": probe[0]}, repeat)
    time.sleep(0.2)
    ceil_after = sgemm_ceiling(clock=CLOCK)
    peak = probe[1] / (med.pop("probe") * 1e-3) / 1e9
    rate = {key: 2 * m * n * k / (ms * 1e-3) / 1e9 for key, ms in med.items()}
    ceiling = max(ceil_before, ceil_after, rate["fp32"])  # the rate float32 reaches here
    print(f"GEMM {m}x{k}x{n} (max |kernel - bf16 emulation| {exact:.1e}; rel L2 vs fp32 "
          f"{_rel_l2(out.numpy(), a.astype(np.float64) @ w):.1e}; {_load()}): bf16 kernel {med['bf16']:.3f} ms "
          f"= {rate['bf16']:.0f} GFLOP/s = {rate['bf16'] / peak:.0%} of the VDPBF16PS probe ({peak:.0f}); SGEMM ceiling {ceil_before:.0f} before / {ceil_after:.0f} after GFLOP/s; "
          f"blockforge fp32 GEMM {med['fp32']:.3f} ms = {rate['fp32']:.0f} GFLOP/s; "
          f"bf16 = {rate['bf16'] / ceiling:.2f}x the SGEMM ceiling in this run (hardware target ~2x)")


def _ffn(spec, seq: int, repeat: int, tmp: Path, probe, ab: tuple[str, ...] = ()) -> None:
    """One block (an FFN, MHA or encoder block spec) at bf16 and fp32 against the peers."""
    import tvm
    from tvm import relax

    model = export(spec, tmp / f"{spec.kind}.onnx").model_path
    dims = {"batch": 1, "seq": seq}
    s16, s32 = open_model(model, "host", dims, precision="bf16"), open_model(model, "host", dims)
    inputs = random_inputs(s32.inputs, dims, seed=0)

    def tvm_call(session, without=frozenset()):
        res = session.build(without=without)
        vm = relax.VirtualMachine(res.executable, tvm.cpu())
        args = [tvm.runtime.tensor(inputs[s.name]) for s in session.inputs]
        return (lambda: vm["main"](*args)), res

    bf16, res = tvm_call(s16)
    fp32, _ = tvm_call(s32)
    ort = ort_runner.session(s32.model, threads=THREADS)
    ref = np.asarray(next(iter(ort_runner.run(ort, inputs).values())), np.float64)
    calls = {"blockforge bf16": bf16, "blockforge fp32": fp32, "ORT fp32": lambda: ort.run(None, inputs)}
    for name in ab:
        calls[f"blockforge bf16 ({name} off)"], _ = tvm_call(s16, frozenset({name}))
    errors = {k: _rel_l2(f().numpy(), ref) for k, f in calls.items() if k.startswith("blockforge")}
    ov = REGISTRY["openvino"]
    if ov.available():
        bm = BenchModel(session=s32, onnx=s32.model, spec=None, dims=dims)
        for name, precision in (("OpenVINO bf16", "bf16"), ("OpenVINO f32", "f32")):
            calls[name] = ov.make_runner(bm, inputs, THREADS, precision=precision)
            errors[name] = _rel_l2(calls[name].outputs()[0], ref)
    load = _load()
    calls["VDPBF16PS probe"] = probe[0]
    med = _medians(calls, repeat)
    peak = probe[1] / (med.pop("VDPBF16PS probe") * 1e-3) / 1e9
    flops = 4 * seq * spec.d_model * spec.d_ff if spec.kind == "ffn" else None  # its two GEMMs
    what = f"d_ff {spec.d_ff} {spec.activation}" if spec.kind == "ffn" else f"heads {spec.heads}" + \
        (f" d_ff {spec.d_ff} {spec.activation} {spec.norm}-LN" if spec.kind == "block" else "")
    print(f"{spec.kind.upper()} d_model {spec.d_model} {what} seq {seq} ({THREADS} thread(s), "
          f"{'process CPU time' if THREADS == 1 else 'wall'}; {load} -> {_load()}; "
          f"phases {' > '.join(res.phases)}; the VDPBF16PS probe {peak:.0f} GFLOP/s):")
    peer = med.get("OpenVINO bf16")
    for k, ms in med.items():
        vs = f", {ms / peer:.2f}x OpenVINO bf16" if peer else ""
        err = f"; rel L2 vs ORT fp32 {errors[k]:.1e}" if k in errors else ""
        rate = f" = {flops / (ms * 1e-3) / 1e9:.0f} GFLOP/s, {flops / (ms * 1e-3) / 1e9 / peak:.0%} of the probe" \
            if flops else ""
        print(f"  {k}: {ms:.3f} ms{rate} ({ms / med['blockforge fp32']:.2f}x blockforge fp32{vs}{err})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="toy sizes: proves the script runs (tests/test_benchmarks.py), measures nothing")
    ap.add_argument("--threads", type=int, choices=(1, 2), default=2, help="1: every engine on one thread, "
                    "timed in the process's CPU time (ratios that hold on a shared machine)")
    ap.add_argument("--blocks", default="ffn", help="comma list of ffn, mha, block (default ffn)")
    ap.add_argument("--seq", type=int, default=None, help="the blocks' rows (default 128; smoke 8)")
    ap.add_argument("--ab", default="", help="comma list: one more contender each, the bf16 build without that ablation")
    a = ap.parse_args()
    blocks = a.blocks.split(",")
    from blockforge.compile.pipeline import ABLATIONS

    ab = tuple(x for x in a.ab.split(",") if x)
    if set(ab) - set(ABLATIONS):
        ap.error(f"--ab: choose from {', '.join(sorted(ABLATIONS))}")
    if set(blocks) - {"ffn", *BLOCKS}:
        ap.error(f"--blocks: choose from ffn, {', '.join(BLOCKS)}")
    configure(redirect_native_output=False)
    from blockforge.targets import resolve
    from blockforge.targets.precision import target_has
    from blockforge.targets.toolchain import cpu_model

    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical cores; shared machine: read ratios, not digits")
    if not target_has(resolve("host"), "avx512bf16"):
        print("this CPU has no AVX512_BF16: the bf16 kernel cannot run here; nothing to measure")
        return 0
    cfg = SMOKE if a.smoke else FULL
    probe = _probe(THREADS, smoke=a.smoke)
    _gemm(cfg["gemm"], a.repeat, probe)
    with tempfile.TemporaryDirectory(prefix="bf16-gemm-") as tmp:  # the exported blocks, removed at the end
        for b in blocks:
            spec = cfg["ffn"] if b == "ffn" else BLOCKS[b][1 if a.smoke else 0]
            _ffn(spec, a.seq or cfg["seq"], a.repeat, Path(tmp), probe, ab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
