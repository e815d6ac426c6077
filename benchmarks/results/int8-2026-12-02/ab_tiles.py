"""The int8 GEMM's tiles A/B'd interleaved (ab_tiles.txt), one thread in CPU time (TVM_NUM_THREADS=1)
or wall clock: "old" kernels on the intrinsic before compile/quant/intrin.py's fix (A's broadcast
bound to a 1-element local buffer: a workspace alloc/free per row tile), "new" on the current one.

    TVM_NUM_THREADS=1 PYTHONPATH=build/dev-src .venv/bin/python benchmarks/results/int8-2026-12-02/ab_tiles.py \
        M K N {gelu|bias|bare} REPEAT new6x4,old6x4,new5x3,new4x3p,...   (p: the panels split)
"""
import sys, os, time, dataclasses, numpy as np, tvm
from blockforge.compile.quant import gemm, isa as isam, intrin
from blockforge.targets import resolve
from blockforge.bench import measure_interleaved
from tvm.script import tirx as T

def old_funcs(lanes=16, a_dtype="uint8", llvm_intrinsic="llvm.x86.avx512.vpdpbusd.512"):
    desc, _ = intrin.dot_funcs(lanes, a_dtype, llvm_intrinsic)
    v = f"int8x{lanes * 4}"; c = f"int32x{lanes}"
    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((4,), a_dtype, offset_factor=1), B: T.Buffer((lanes, 4), "int8", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            a4 = T.reinterpret(A.vload([0], f"{a_dtype}x4"), dtype="int32")
            C[T.ramp(T.int32(0), 1, lanes)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(llvm_intrinsic), C.vload([0], dtype=c),
                T.reinterpret(T.broadcast(a4, lanes), dtype=v), B.vload([0, 0], dtype=v), dtype=c)
    return desc, impl
old_name = lambda: intrin.register_once("old_vnni", old_funcs)
NEW = isam.ISAS["vnni"]; OLD = dataclasses.replace(NEW, intrin=old_name)

m, k, n = map(int, sys.argv[1:4]); act = sys.argv[4]; reps = int(sys.argv[5])
variants = sys.argv[6].split(",")  # e.g. old6x4,new6x4,new5x3
threads = int(os.environ.get("TVM_NUM_THREADS", "1"))
sp = gemm.Int8GemmSpec(k=k, n=n, m=m) if act == "bare" else gemm.Int8GemmSpec(k=k, n=n, m=m, scale="scalar", bias=True, activation=act if act != "bias" else "none")
tgt = resolve("host").tvm_target()
rng = np.random.default_rng(0)
a = rng.integers(0, 256, (m, k), dtype=np.uint8); w = rng.integers(-128, 128, (k, n), dtype=np.int8)
ins = [a, gemm.pack_weights(w), gemm.column_sums(w), np.array(3, np.int32)]
if act != "bare": ins += [np.array(2e-6, np.float32), rng.standard_normal(n).astype(np.float32)]
args = [tvm.runtime.tensor(x) for x in ins]
calls, outs = {}, {}
for vname in variants:
    which, t = vname[:3], vname[3:]
    split = "panels" if t.endswith("p") else "tiles"; mr, nv = map(int, t.rstrip("p").split("x"))
    isam.ISAS["vnni"] = OLD if which == "old" else NEW
    f = gemm.kernel(sp, gemm.Int8Tiles(mr, nv, split))
    isam.ISAS["vnni"] = NEW
    lib = tvm.compile(tvm.IRModule({"main": f}), target=tgt)
    out = tvm.runtime.tensor(np.zeros((m, n), sp.out_dtype)); lib["main"](*args, out); outs[vname] = out.numpy()
    calls[vname] = (lambda lib=lib, out=out: lib["main"](*args, out))
base = variants[0]
eq = {v: bool(np.array_equal(outs[base], outs[v])) for v in variants}
clock = time.thread_time if threads == 1 else time.perf_counter
l0 = os.getloadavg()
med = {k_: float(np.median(v)) for k_, v in measure_interleaved(calls, reps, warmup=2, clock=clock).items()}
ops = 2 * m * k * n
print(f"{sp.describe()} threads={threads} load {l0[0]:.1f}->{os.getloadavg()[0]:.1f} equal={eq}")
for v in variants:
    print(f"  {v}: {med[v]:.4f} ms {ops/med[v]/1e6:.0f} GOP/s  ratio vs {base} {med[v]/med[base]:.3f}")
