"""The AVX512_BF16 dot-product tensor intrinsic (VDPBF16PS), which TVM does not ship.

Semantics: C[i] += A[0] B[i, 0] + A[1] B[i, 1], i < 16: 16 float32 lanes, each += a pair of
bf16 products (exact in float32) -- 32 multiply-adds per instruction, twice VFMADD's 16.

TVM cannot express the call directly: llvm.x86.avx512bf16.dpbf16ps.512 takes <32 x bfloat>
(LLVM 22), and any bfloat16 value in TIR is rewritten to float32 by BF16ComputeLegalize
(the call then fails LLVM's verifier), while a bfloat16x32 that skips the legalizer crashes
TVM's LLVM codegen. So bf16 values travel through TIR as their bits (uint16 storage, int32
lanes holding bf16 pairs) and the call goes to a 3-line LLVM IR function that bitcasts them,
linked into the module by the `pragma_import_llvm` attribute (TVM's codegen links it, LLVM
inlines it: the kernel's loop holds the bare instruction; tests/test_bf16_gemm.py checks the
assembly). The same IR holds the bf16 pair pack (VCVTNEPS2BF16 on two float32x16) and the
helpers the fused attention kernel calls them through (pack_pairs16, dpbf16: `--precision
bf16`'s Q K^T and P V, compile/attention/flash.py).
"""

from __future__ import annotations

DPBF16_16X2 = "blockforge_dpbf16ps_16x2"
LLVM_FUNC = "blockforge_dpbf16ps"
PACK_FUNC = "blockforge_pack_bf16"  # two float32x16 -> 16 bf16 pairs (VCVTNEPS2BF16 twice)
# Linked once per kernel (linkonce_odr: the copies of several kernels merge).
LLVM_IR = f"""
define linkonce_odr <16 x float> @{LLVM_FUNC}(<16 x float> %c, <16 x i32> %a, <16 x i32> %b) #0 {{
  %av = bitcast <16 x i32> %a to <32 x bfloat>
  %bv = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %c, <32 x bfloat> %av, <32 x bfloat> %bv)
  ret <16 x float> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define linkonce_odr <16 x i32> @{PACK_FUNC}(<16 x float> %lo, <16 x float> %hi) #0 {{
  %l = fptrunc <16 x float> %lo to <16 x bfloat>
  %h = fptrunc <16 x float> %hi to <16 x bfloat>
  %li = bitcast <16 x bfloat> %l to <16 x i16>
  %hi16 = bitcast <16 x bfloat> %h to <16 x i16>
  %lw = zext <16 x i16> %li to <16 x i32>
  %hw = zext <16 x i16> %hi16 to <16 x i32>
  %hs = shl <16 x i32> %hw, splat (i32 16)
  %r = or <16 x i32> %lw, %hs
  ret <16 x i32> %r
}}
attributes #0 = {{ alwaysinline nounwind readnone }}
"""
IMPORT_PRAGMA = "pragma_import_llvm"


def widen(x):
    """bf16 bits (uint16) -> the float32 they stand for: the same expression in the kernel's
    compute and the intrinsic's description, so tensorize matches them."""
    from tvm import tirx

    return tirx.reinterpret("float32", tirx.shift_left(x.astype("uint32"), tirx.const(16, "uint32")))


def round_bits(x):
    """float32 -> its bf16 bits in the low half of a uint32, round to nearest even (as
    gemm.to_bf16_bits: NaN stays a quiet NaN); integer ops only, so it vectorizes."""
    from tvm import tirx

    u32 = lambda v: tirx.const(v, "uint32")  # noqa: E731
    b = tirx.reinterpret("uint32", x)
    r = tirx.shift_right(b + u32(0x7FFF) + tirx.bitwise_and(tirx.shift_right(b, u32(16)), u32(1)), u32(16))
    nan = tirx.bitwise_and(b, u32(0x7FFFFFFF)) > u32(0x7F800000)
    return tirx.Select(nan, tirx.bitwise_or(tirx.shift_right(b, u32(16)), u32(0x40)), r)


def pack_pairs16(lo, hi):
    """Two float32x16 vectors as 16 int32 lanes each holding a bf16 pair (lo's in the low
    half): the element pairs VDPBF16PS multiplies, from vertical lanes of two vectors (no
    shuffle), so the pairs' partners are whatever two rows or vectors the caller picks. On
    VCVTNEPS2BF16 (LLVM_IR's PACK_FUNC: fptrunc to bfloat): round to nearest even as
    round_bits, a NaN stays a NaN (its payload may differ), denormals may be flushed, which
    VDPBF16PS reads as 0 all the same. The kernel must import LLVM_IR (IMPORT_PRAGMA)."""
    from tvm import tirx

    return tirx.call_pure_extern("int32x16", PACK_FUNC, lo, hi)


def dpbf16(c, a, b):
    """c (float32x16) + the pair products of a and b (int32x16 each, bf16 pairs): the call
    LLVM_IR's function makes VDPBF16PS; the kernel must import LLVM_IR (IMPORT_PRAGMA)."""
    from tvm import tirx

    return tirx.call_pure_extern("float32x16", LLVM_FUNC, c, a, b)


def _funcs():
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((2,), "uint16", offset_factor=1), B: T.Buffer((16, 2), "uint16", offset_factor=1),
             C: T.Buffer((16,), "float32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            for i in T.serial(0, 16):
                for k in T.serial(0, 2):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + widen(A[vk]) * widen(B[vi, vk])

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((2,), "uint16", offset_factor=1), B: T.Buffer((16, 2), "uint16", offset_factor=1),
             C: T.Buffer((16,), "float32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:16], A[0:2], B[0:16, 0:2])
            T.writes(C[0:16])
            a2 = T.reinterpret(A.vload([0], "uint16x2"), dtype="int32")  # the pair, broadcast
            b32 = T.reinterpret(B.vload([0, 0], dtype="uint16x32"), dtype="int32x16")
            C[T.ramp(T.int32(0), 1, 16)] = T.call_pure_extern(
                "float32x16", LLVM_FUNC, C.vload([0], dtype="float32x16"), T.broadcast(a2, 16), b32)

    return desc, impl


def dpbf16_16x2() -> str:
    """Registers the intrinsic on first call (TVM's registry is process-global); its name."""
    from tvm.s_tir import TensorIntrin

    if TensorIntrin.get(DPBF16_16X2, allow_missing=True) is None:
        TensorIntrin.register(DPBF16_16X2, *_funcs())
    return DPBF16_16X2

