"""aarch64 int8: the SDOT tensor intrinsic and the target check (`+dotprod`, Armv8.2+:
Cortex-A55/A76/A78, Neoverse N1, Apple M1, ...).

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
"""

from __future__ import annotations


SDOT_4X4 = "blockforge_sdot_4x4_s8s8s32"


def sdot_4x4() -> str:
    """Our SDOT intrinsic (TVM's description and body; compile/quant/intrin.dot_funcs), registered
    on first use; its name."""
    from blockforge.compile.quant.intrin import dot_funcs, register_once

    return register_once(SDOT_4X4, lambda: dot_funcs(4, "int8", "llvm.aarch64.neon.sdot.v4i32.v16i8"))


def has_dotprod(target) -> bool:
    """The target (its mcpu/mattr, not the build machine) has the dot-product extension; an
    x86 target answers False."""
    from tvm.target.codegen import target_has_features

    try:
        return bool(target_has_features("dotprod", target))
    except Exception:  # not an LLVM CPU target
        return False
