"""The dot-product instructions the int8 GEMM (compile/quant/gemm) is tensorized with, as data.

One kernel generator, one weight layout (N/16, K/g, 16, g) for every instruction, g the bytes
of k one instruction reads per column (4 for the dot products, 8 for SMMLA): what differs is the
activations' signedness, how many int32 lanes one instruction accumulates, the register tile
and the tensor intrinsic. The int8-gemm phase picks the row from the target's features (its
mcpu/mattr, never the build machine).

| isa  | instruction            | A x W        | lanes | tile (rows x 16-col panels) | accumulators     |
|------|------------------------|--------------|-------|-----------------------------|------------------|
| vnni | VPDPBUSD zmm (x86)     | u8 x s8      | 16    | 5 x 3 (under 1 KiB: stack)  | 15 of 32 zmm     |
| avxvnni | {vex} VPDPBUSD ymm (x86, no AVX-512) | u8 x s8 | 8 | MR x 1 (2 per panel)   | 2 MR of 16 ymm   |
| avx512bw | VPMADDUBSW + VPMADDWD zmm (x86, no VNNI) | u8 x s8 | 16 | 5 x 3 | 15 of 32 zmm |
| avx2 | VPMADDUBSW + VPMADDWD ymm (x86, no VNNI) | u8 x s8 | 8 | 4 x 1 (2 per panel) | 8 of 16 ymm |
| avx512bw-wd, avx2-wd | VPMADDWD zmm / ymm (their exact fallbacks) | s16 x s16 | 16 / 8 | 5 x 3 / 4 x 1 | as above |
| sdot | SDOT v.4s (aarch64)    | s8 x s8      | 4     | 5 x 1 (4 SDOTs per panel)   | 20 of 32 q regs  |
| i8mm | SMMLA v.4s (aarch64)   | s8 x s8      | 2 x 2 | 4 x 1 (16 SMMLAs per k-step)| 16 of 32 q regs  |

VPMADDUBSW (the "avx512bw" and "avx2" rows: x86 without VNNI, i.e. Haswell to Ice Lake clients,
Skylake-SP, AMD Zen 1-3) adds each pair of u8 x s8 products into int16 with saturation, so the
rows are exact only for weights whose pairs along K have |w0| + |w1| <= 128 (`pair_bound`):
255 x 128 = 32640 fits, 255 x 129 does not. ONNX Runtime's `reduce_range` (7-bit weights,
[-64, 63]) always does; full-range weights usually do not (ORT's own AVX2 kernel then
saturates; its documentation recommends reduce_range on such CPUs). The int8-gemm phase checks
each constant weight matrix; one that could saturate, and a product whose B is known only at
run time, take the row's exact fallback: both operands widened to int16, VPMADDWD straight
into int32. On Zen 5 (BERT-base FFN's 128x768x3072, 2 threads) VPMADDUBSW ran 272 / 532 GOP/s
(ymm / zmm, at its register-only probe's rate), VPMADDWD 234 / 462.

SMMLA (`+i8mm`, Armv8.6: Cortex-A510/A710/X2 and later, Neoverse N2/V1/V2, Graviton 3/4) is a
matrix instruction: a 2 x 8 block of A times an 8 x 2 block of W into a 2 x 2 int32 tile, 32
multiply-adds against SDOT's 16 (not timed on a board here: no Arm hardware). Rows go in pairs:
its kernel packs A's rows in pairs first (compile/quant/gemm.py, `_mmla_acc`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from blockforge.compile.quant import arm, intrin


@dataclass(frozen=True)
class Int8Isa:
    name: str
    act_dtype: str  # what the instruction takes as activations: "uint8" or "int8"
    lanes: int  # int32 accumulators one instruction updates (16 columns = 16 // lanes instructions)
    mr: int  # rows per micro-tile
    nv: int  # 16-column panels per micro-tile row, at most
    intrin: Callable[[], str]  # registers the tensor intrinsic (lanes x 4); its name
    has: Callable[[object], bool]  # the TVM target has the instruction
    kgroup: int = 4  # bytes of k per column one instruction reads: the packed weights' last dim
    mmla: bool = False  # a 2 x kgroup by kgroup x 2 matrix instruction (rows in pairs), not a dot
    # the ISA a GEMM takes when K is not whole k-groups of this one, or (pair_bound) when its
    # weights could saturate this one or are known only at run time
    fallback: str | None = None
    # the instruction adds each pair of products (k = 2i, 2i+1) into int16 with saturation:
    # exact only for weights with |w0| + |w1| <= pair_bound in every pair (None: never saturates)
    pair_bound: int | None = None
    w_dtype: str = "int8"  # the packed weights' (int16 on VPMADDWD: the 8-bit values widened)

    def exact_for(self, w) -> bool:
        """The instruction computes A x w exactly for every u8 A: (K, N) int8 weights as the
        kernel packs them (gemm.int8_weights); K even."""
        if self.pair_bound is None:
            return True
        import numpy as np

        a = np.abs(np.asarray(w, dtype=np.int16))
        return bool(((a[0::2] + a[1::2]) <= self.pair_bound).all())

    def shift(self, dtype: str) -> int:
        """What to add to activations of `dtype` (and their zero point) to make them the
        instruction's: +128 for s8 on VPDPBUSD, -128 for u8 on SDOT, 0 when they already are."""
        if dtype == self.act_dtype or self.act_dtype == "int16":
            return 0
        return 128 if self.act_dtype == "uint8" else -128


ISAS: dict[str, Int8Isa] = {
    # 5 rows x 3 panels: the largest tile whose accumulators (15 x 64 B) stay under TVM's 1 KiB
    # stack limit (compile/quant/gemm.py STACK_BYTES); the 6 x 4 before it (24 zmm, 1536 B) got a
    # workspace alloc/free per row tile: 0.85x its time at 512x768x3072 +gelu and 512x3072x768,
    # one thread (benchmarks/int8_gemm.py --tiles; gemm.py's MICRO_TILES comment).
    "vnni": Int8Isa("vnni", "uint8", 16, 5, 3, intrin.vnni_16x4, intrin.has_vnni),
    # 5 rows x 16 columns = 20 accumulators + 4 weight registers + the row broadcasts. LLVM 22's
    # inner loop for K=256, N=128 (tests/test_sdot_gemm.py counts it): 6 x 1 spilled 3-4
    # accumulators to the stack per k-step, 5 x 1 none (39 instructions, 20 SDOTs), 3 x 2 and
    # 4 x 2 spilled 8-25.
    "avxvnni": Int8Isa("avxvnni", "uint8", 8, 6, 1, intrin.vnni_8x4, intrin.has_avxvnni_only),
    # 4 rows (2 pairs) x 16 columns (8 pairs) = 16 accumulators, 2 A + 8 W registers. LLVM 22's
    # inner loop for K=256, N=128: 26 instructions, 16 SMMLAs (512 multiply-adds; SDOT's 5 x 1:
    # 320 in 39); 6 x 1 took 47 with 4 stack accesses, 8 x 1 103 with 17 (tests/test_i8mm_gemm.py).
    "i8mm": Int8Isa("i8mm", "int8", 4, 4, 1, arm.smmla_2x2x8, arm.has_i8mm, kgroup=8, mmla=True,
                    fallback="sdot"),
    "sdot": Int8Isa("sdot", "int8", 4, 5, 1, arm.sdot_4x4, arm.has_dotprod),
    # x86 without VNNI; after the VNNI rows, so a target with either takes that instead.
    # 5 x 3 as VNNI's: 15 accumulators + 3 weight vectors, the broadcast, the ones and the two
    # int16/int32 temporaries fit 32 zmm.
    "avx512bw": Int8Isa("avx512bw", "uint8", 16, 5, 3, intrin.maddubs_16x4, intrin.has_avx512bw,
                        pair_bound=128, fallback="avx512bw-wd"),
    # 16 ymm: 4 rows x 2 = 8 accumulators + 2 weight vectors + broadcast, ones, 2 temporaries
    "avx2": Int8Isa("avx2", "uint8", 8, 4, 1, intrin.maddubs_8x4, intrin.has_avx2, pair_bound=128,
                    fallback="avx2-wd"),
    # The exact fallbacks of the two above, for weights whose pairs could saturate VPMADDUBSW (and
    # K not whole 4-byte groups): activations and weights widened to int16, VPMADDWD into int32.
    # Never a target's first choice (has: never), only a GEMM's.
    "avx512bw-wd": Int8Isa("avx512bw-wd", "int16", 16, 5, 3, intrin.maddwd_16x2, lambda t: False, kgroup=2,
                           w_dtype="int16"),
    "avx2-wd": Int8Isa("avx2-wd", "int16", 8, 4, 1, intrin.maddwd_8x2, lambda t: False, kgroup=2,
                       w_dtype="int16"),
}


def for_target(target) -> Int8Isa | None:
    """The int8 dot-product instruction of a TVM target, or None (the phase stays off); the
    first row the target has (an +i8mm target has +dotprod too: SMMLA first)."""
    return next((i for i in ISAS.values() if i.has(target)), None)
