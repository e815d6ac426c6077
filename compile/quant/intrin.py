"""The x86 int8 dot-product tensor intrinsics: AVX-512 VNNI in the form LLVM 22 accepts, and
VPMADDUBSW where the target has no VNNI.

TVM 0.27 ships `dot_16x4_vnni` (tvm.s_tir.tensor_intrin.x86), but with its bundled LLVM 22
it does not compile: "Call parameter type does not match function signature" —
llvm.x86.avx512.vpdpbusd.512 now takes <64 x i8> operands where TVM passes <16 x i32>.
Here the broadcast 4 bytes of A and the 16x4 bytes of B are reinterpreted as int8x64.

Semantics (VPDPBUSD): C[i] += sum_k u8(A[k]) * s8(B[i, k]), i < 16, k < 4.
"""

from __future__ import annotations

VNNI_16X4 = "blockforge_vnni_16x4_u8s8s32"
# The 256-bit form: 8 int32 lanes, B (8, 4). LLVM selects its encoding from the target: VEX
# ({vex} vpdpbusd) with AVX-VNNI (Alder Lake+, Zen 5 client) and no AVX-512, EVEX with
# AVX512_VNNI + AVX512VL.
VNNI_8X4 = "blockforge_vnni_8x4_u8s8s32"
# Without VNNI (compile/quant/isa.py "avx512bw", "avx2"): VPMADDUBSW + VPMADDWD + VPADDD.
MADDUBS_16X4 = "blockforge_maddubs_16x4_u8s8s32"
MADDUBS_8X4 = "blockforge_maddubs_8x4_u8s8s32"
# ... and exact for any weights, both operands widened to int16 (isa.py "avx2-wd", "avx512bw-wd")
MADDWD_16X2 = "blockforge_maddwd_16x2_s16s16s32"
MADDWD_8X2 = "blockforge_maddwd_8x2_s16s16s32"
_LLVM = {16: "llvm.x86.avx512.vpdpbusd.512", 8: "llvm.x86.avx512.vpdpbusd.256"}


def dot_desc(lanes: int, g: int, a_dtype: str, b_dtype: str):
    """What every int8 dot-product intrinsic computes: C[i] += sum_k A[k] B[i, k] in int32
    (i < lanes, k < g): its description for tensorize."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((g,), a_dtype, offset_factor=1), B: T.Buffer((lanes, g), b_dtype, offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:g], B[0:lanes, 0:g])
            T.writes(C[0:lanes])
            for i in T.serial(0, lanes):
                for k in T.serial(0, g):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")

    return desc


def dot_funcs(lanes: int, a_dtype: str, llvm_intrinsic: str):
    """desc and impl of a `lanes` x 4 int8 dot-product intrinsic: C[i] += sum_k A[k] B[i, k]
    (i < lanes, k < 4), A's 4 bytes broadcast to every lane, B's lanes x 4 bytes as they lie.
    VPDPBUSD (16 lanes, u8 A) here, SDOT (4 lanes, s8 A) in compile/quant/arm.py."""
    from tvm.script import tirx as T

    v = f"int8x{lanes * 4}"  # what both instructions take: the bytes, reinterpreted
    c = f"int32x{lanes}"
    desc = dot_desc(lanes, 4, a_dtype, "int8")

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((4,), a_dtype, offset_factor=1), B: T.Buffer((lanes, 4), "int8", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            # A's 4 bytes as one int32, broadcast, in one expression: bound to a name first
            # (a4 = ...), TVMScript makes it a 1-element "local" buffer, which LowerTVMBuiltin
            # serves with a TVMBackendAllocWorkspace/FreeWorkspace pair per parallel iteration
            # (each row tile of the GEMM: two calls beside ~4600 cycles of VPDPBUSDs).
            C[T.ramp(T.int32(0), 1, lanes)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(llvm_intrinsic), C.vload([0], dtype=c),
                T.reinterpret(T.broadcast(T.reinterpret(A.vload([0], f"{a_dtype}x4"), dtype="int32"), lanes), dtype=v),
                B.vload([0, 0], dtype=v), dtype=c)

    return desc, impl


def maddubs_funcs(lanes: int):
    """desc and impl of the `lanes` x 4 u8 x s8 dot product on x86 without VNNI (AVX2: 8 lanes,
    AVX512BW: 16): VPMADDUBSW multiplies the byte pairs and adds each pair into int16, with
    saturation; VPMADDWD by ones adds the two int16 of each int32 lane; VPADDD accumulates.
    Three instructions where VPDPBUSD is one, 2x the multiply-adds of an fp32 FMA of the same
    width. The desc is the exact sum: it holds where no pair saturates, |a0 w0 + a1 w1| <=
    255 (|w0| + |w1|) <= 32767, which the int8-gemm phase checks on the constant weights
    before it picks this instruction (isa.Int8Isa.pair_bound)."""
    from tvm.script import tirx as T

    desc = dot_desc(lanes, 4, "uint8", "int8")
    bits = lanes * 32
    pairs = "llvm.x86.avx2.pmadd.ub.sw" if lanes == 8 else "llvm.x86.avx512.pmaddubs.w.512"
    quads = "llvm.x86.avx2.pmadd.wd" if lanes == 8 else "llvm.x86.avx512.pmaddw.d.512"
    v, h, c = f"int8x{bits // 8}", f"int16x{bits // 16}", f"int32x{lanes}"

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((4,), "uint8", offset_factor=1), B: T.Buffer((lanes, 4), "int8", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            # one expression, as dot_funcs' (a named temporary becomes a workspace buffer)
            C[T.ramp(T.int32(0), 1, lanes)] = C.vload([0], dtype=c) + T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(quads),
                T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id(pairs),
                    T.reinterpret(T.broadcast(T.reinterpret(A.vload([0], "uint8x4"), dtype="int32"), lanes), dtype=v),
                    B.vload([0, 0], dtype=v), dtype=h),
                T.broadcast(T.int16(1), bits // 16), dtype=c)

    return desc, impl


def maddwd_funcs(lanes: int):
    """desc and impl of the exact `lanes` x 2 int16 dot product (VPMADDWD, then VPADDD): A's two
    int16 (8-bit activations widened) broadcast as one int32, B (lanes, 2) int16 (8-bit weights
    widened at packing). Each lane's two products are summed straight into int32 (at most
    2 x 255 x 128 in magnitude): no saturation, for any weights. Where VPMADDUBSW + VPMADDWD
    make 32 multiply-adds of two multiplying instructions, this makes 16 of one, so the two rate
    alike where those instructions share their ports (Zen 5: isa.py)."""
    from tvm.script import tirx as T

    bits = lanes * 32
    quads = "llvm.x86.avx2.pmadd.wd" if lanes == 8 else "llvm.x86.avx512.pmaddw.d.512"
    h, c = f"int16x{bits // 16}", f"int32x{lanes}"
    desc = dot_desc(lanes, 2, "int16", "int16")

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((2,), "int16", offset_factor=1), B: T.Buffer((lanes, 2), "int16", offset_factor=1),
             C: T.Buffer((lanes,), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:2], B[0:lanes, 0:2])
            T.writes(C[0:lanes])
            C[T.ramp(T.int32(0), 1, lanes)] = C.vload([0], dtype=c) + T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id(quads),
                T.reinterpret(T.broadcast(T.reinterpret(A.vload([0], "int16x2"), dtype="int32"), lanes), dtype=h),
                B.vload([0, 0], dtype=h), dtype=c)

    return desc, impl


def register_once(name: str, funcs) -> str:
    """Registers the intrinsic on first call (TVM's registry is process-global); its name."""
    from tvm.s_tir import TensorIntrin

    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *funcs())
    return name


def vnni_16x4() -> str:
    return register_once(VNNI_16X4, lambda: dot_funcs(16, "uint8", _LLVM[16]))


def vnni_8x4() -> str:
    """The 256-bit intrinsic (AVX-VNNI, or AVX512_VNNI + AVX512VL), registered on first call."""
    return register_once(VNNI_8X4, lambda: dot_funcs(8, "uint8", _LLVM[8]))


def maddubs_8x4() -> str:
    """The AVX2 form (ymm, no VNNI: Haswell to Ice Lake clients, Zen 1-3), registered on first call."""
    return register_once(MADDUBS_8X4, lambda: maddubs_funcs(8))


def maddubs_16x4() -> str:
    """The AVX512BW form (zmm, no VNNI: Skylake-SP/X), registered on first call."""
    return register_once(MADDUBS_16X4, lambda: maddubs_funcs(16))


def maddwd_8x2() -> str:
    """The exact AVX2 form (full-range weights), registered on first call."""
    return register_once(MADDWD_8X2, lambda: maddwd_funcs(8))


def maddwd_16x2() -> str:
    """The exact AVX512BW form (full-range weights), registered on first call."""
    return register_once(MADDWD_16X2, lambda: maddwd_funcs(16))


def has_avx512bw(target) -> bool:
    from blockforge.targets.precision import tvm_target_has

    return tvm_target_has(target, "avx512bw")


def has_avx2(target) -> bool:
    from blockforge.targets.precision import tvm_target_has

    return tvm_target_has(target, "avx2")


def has_vnni(target) -> bool:
    """The target (its mcpu/mattr, not the build machine) has AVX-512 VNNI."""
    from blockforge.targets.precision import tvm_target_has

    return tvm_target_has(target, "avx512vnni", "avx512bw")


def has_avxvnni_only(target) -> bool:
    """AVX-VNNI without AVX-512 VNNI: where the 256-bit kernel is the int8 GEMM's instruction
    (a target with both takes the 512-bit one: twice the multiply-adds per instruction)."""
    return has_avxvnni(target) and not has_vnni(target)


def has_avxvnni(target) -> bool:
    """The target has AVX-VNNI (256-bit VPDPBUSD, VEX-encoded): vnni_8x4's instruction there."""
    from blockforge.targets.precision import tvm_target_has

    return tvm_target_has(target, "avxvnni")
