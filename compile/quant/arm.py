"""aarch64 int8: the SDOT and SMMLA tensor intrinsics and their target checks (`+dotprod`,
Armv8.2+: Cortex-A55/A76/A78, Neoverse N1, Apple M1, ...; `+i8mm`, Armv8.6: Cortex-A510/A710,
Neoverse N2/V1, Graviton 3, Apple M2, ...).

SDOT (`llvm.aarch64.neon.sdot.v4i32.v16i8`): C[i] += sum_k s8(A[k]) * s8(B[i, k]), i < 4,
k < 4; 16 multiply-adds per instruction. TVM 0.27 ships it as `dot_4x4_i8i8s32_sdot`
(tvm.s_tir.tensor_intrin.arm_cpu), and unlike its x86 `dot_16x4_vnni` it compiles with the
bundled LLVM 22 (the intrinsic's signature, <4 x i32> (<4 x i32>, <16 x i8>, <16 x i8>), did
not change). But importing that module builds all of its SME intrinsics: 110 s of CPU on
this (loaded) machine, per process. So the kernel registers this 4x4 intrinsic of its own,
the same description and body. Its B is 4 columns x 4 bytes = 16 contiguous bytes, a quarter
of one (16, 4) group of the weight layout the VNNI kernel packs: the same prepacked weights
serve both, four SDOTs per 16-column panel.

Activations are signed on SDOT: quantize_dynamic's u8 activations are shifted by -128
(a - zp = (a - 128) - (zp - 128)), so the existing column-sum term zp_a colsum(W) absorbs the
shift and nothing else changes. UDOT is u8 x u8 and does not fit s8 weights; USDOT (u8 x s8,
`+i8mm`, Armv8.6: Cortex-A710/X2, Neoverse V1/N2) would take them unshifted but
most dotprod boards (A55, A76: Raspberry Pi 5, RK3588) lack it, and the shift is one pass over
M x K bytes beside an M x K x N GEMM.

SMMLA (`llvm.aarch64.neon.smmla.v4i32.v16i8`, `+i8mm`): C[i, j] += sum_k s8(A[i, k]) s8(B[j, k]),
i, j < 2, k < 8: a 2 x 2 int32 tile in one register (row-major: c00 c01 c10 c11) from two
16-byte operands, each two rows of 8 bytes. 32 multiply-adds per instruction. TVM has no
such intrinsic. Its B is two columns' 8 bytes: the weights pack (N/16, K/8, 16, 8) for it
(gemm.pack_weights, kgroup 8); A two rows' 8 bytes, which the kernel packs per call. The
activations are s8 as for SDOT (the same shift).
"""

from __future__ import annotations


SDOT_4X4 = "blockforge_sdot_4x4_s8s8s32"
SMMLA_2X2X8 = "blockforge_smmla_2x2x8_s8s8s32"


def sdot_4x4() -> str:
    """Our SDOT intrinsic (TVM's description and body; compile/quant/intrin.dot_funcs), registered
    on first use; its name."""
    from blockforge.compile.quant.intrin import dot_funcs, register_once

    return register_once(SDOT_4X4, lambda: dot_funcs(4, "int8", "llvm.aarch64.neon.sdot.v4i32.v16i8"))


def has_dotprod(target) -> bool:
    """The target (its mcpu/mattr, not the build machine) has the dot-product extension; an
    x86 target answers False."""
    from blockforge.targets.precision import tvm_target_has

    return tvm_target_has(target, "dotprod")


def smmla_2x2x8() -> str:
    """Our SMMLA intrinsic, registered on first use; its name."""
    from blockforge.compile.quant.intrin import register_once

    return register_once(SMMLA_2X2X8, _smmla_funcs)


def _smmla_funcs():
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((2, 8), "int8", offset_factor=1), B: T.Buffer((2, 8), "int8", offset_factor=1),
             C: T.Buffer((2, 2), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:2, 0:2], A[0:2, 0:8], B[0:2, 0:8])
            T.writes(C[0:2, 0:2])
            for i, j, k in T.grid(2, 2, 8):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    C[vi, vj] = C[vi, vj] + T.cast(A[vi, vk], "int32") * T.cast(B[vj, vk], "int32")

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((2, 8), "int8", offset_factor=1), B: T.Buffer((2, 8), "int8", offset_factor=1),
             C: T.Buffer((2, 2), "int32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[0:2, 0:2], A[0:2, 0:8], B[0:2, 0:8])
            T.writes(C[0:2, 0:2])
            # the 2 x 2 tile, A's and B's 2 x 8 bytes, each as the one register it is
            C[0, T.ramp(T.int32(0), 1, 4)] = T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.aarch64.neon.smmla.v4i32.v16i8"), C.vload([0, 0], dtype="int32x4"),
                A.vload([0, 0], dtype="int8x16"), B.vload([0, 0], dtype="int8x16"), dtype="int32x4")

    return desc, impl


def has_i8mm(target) -> bool:
    """The target has the int8 matrix multiply extension (SMMLA); an x86 target answers False."""
    from blockforge.targets.precision import tvm_target_has

    return tvm_target_has(target, "i8mm", "dotprod")
