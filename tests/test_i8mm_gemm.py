"""The int8 GEMM on aarch64 SMMLA (+i8mm): the target's features pick it (before SDOT), the
weights' (N/16, K/8, 16, 8) layout, the kernel's IR and assembly on a fixed aarch64 target
(16 SMMLAs a k-step, no accumulator spills, rows in pairs), SDOT for a K that is not whole
8-byte groups and under the int8-i8mm ablation, and end to end in the edge app under
qemu-aarch64 (its `max` CPU has i8mm): exact int32 from a MatMulInteger model, quantized
blocks (dynamic, static QDQ with the attention products) against ONNX Runtime on the same
file, and an illegal instruction on a Cortex-A76 (dotprod, no i8mm): SMMLA is what runs."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from test_sdot_gemm import (_inner_loop, _isa, _qemu_marks, dies_without_the_instruction,  # noqa: E402
                            exact_int32_under_qemu, int8_gemm_module, quantized_block_matches_ort)

from blockforge.compile.quant import gemm  # noqa: E402
from blockforge.compile.quant.isa import ISAS  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

I8MM_TARGET = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                 "mattr": ["+neon", "+dotprod", "+i8mm"], "num-cores": 2})
I8MM = ISAS["i8mm"]


def test_i8mm_is_read_from_the_target():
    assert _isa("aarch64-linux-i8mm") == "i8mm"
    arm = {"kind": "llvm", "mtriple": "aarch64-linux-gnu"}
    assert _isa({**arm, "mcpu": "neoverse-v1"}) == "i8mm"  # Graviton 3
    assert _isa({**arm, "mcpu": "neoverse-n2"}) == "i8mm"
    assert _isa({**arm, "mcpu": "neoverse-n1"}) == "sdot"  # Graviton 2: dotprod only
    assert _isa({**arm, "mcpu": "cortex-a76"}) == "sdot"  # Raspberry Pi 5
    assert _isa("aarch64-linux-dotprod") == "sdot"
    assert _isa("aarch64-linux") is None


def test_weights_pack_in_eight_byte_groups():
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 128, (24, 32), dtype=np.int8)
    p = gemm.pack_weights(w, I8MM.kgroup)
    assert p.shape == (2, 3, 16, 8)
    for jo, kp, c, t in [(0, 0, 0, 0), (1, 2, 15, 7), (0, 1, 3, 5), (1, 0, 8, 2)]:
        assert p[jo, kp, c, t] == w[8 * kp + t, 16 * jo + c]
    # a column pair's 8 k-bytes each: the 16 contiguous bytes one SMMLA reads as its B
    assert list(p[1, 2, 4:6].reshape(-1)) == [*w[16:24, 20], *w[16:24, 21]]
    with pytest.raises(ValueError, match="K % 8"):
        gemm.Int8GemmSpec(k=36, n=32, isa="i8mm")
    assert gemm.supported(36, 32, "sdot") and not gemm.supported(36, 32, "i8mm")
    with pytest.raises(ValueError, match="rows in pairs"):
        gemm.kernel(gemm.Int8GemmSpec(k=64, n=32, m=8, isa="i8mm"), gemm.GemmTiles(3, 1, "tiles"))


@pytest.mark.parametrize("m", [202, None, 1])  # a ragged last tile (one row pair), symbolic rows, a decode row
def test_smmla_kernel_ir_and_assembly(m):
    spec = gemm.Int8GemmSpec(k=256, n=128, m=m, scale="column", bias=True, isa="i8mm")
    tiles = gemm.default_tiles(spec)
    assert tiles.mr == (2 if m == 1 else I8MM.mr) and tiles.mr % 2 == 0
    text = gemm.kernel(spec).script()
    assert text.count('"llvm.aarch64.neon.smmla"') == 1, "the update is not on the SMMLA intrinsic"
    assert "sdot" not in text
    assert text.split("def main(A:")[1].split("Wp:")[0].endswith('"int8"), '), "activations are s8 on SMMLA"
    assert "Wp: T.Buffer((T.int64(8), T.int64(32), T.int64(16), T.int64(8))" in text  # (N/16, K/8, 16, 8)
    asm = tvm.compile(tvm.IRModule({"main": gemm.kernel(spec)}), target=I8MM_TARGET).mod.inspect_source("asm")
    loop = _inner_loop(asm, "smmla")
    smmlas = sum(i.startswith("smmla") for i in loop)
    # one k-step (8 bytes): MR/2 row pairs x 8 column pairs, the 2 x 2 tiles in registers
    assert smmlas == tiles.mr // 2 * 8, loop
    assert not [i for i in loop if "[sp" in i], f"accumulators spilled: {loop}"
    # 32 multiply-adds per SMMLA: 4 x 16 tiles measured 512 in 26 instructions (SDOT's 5 x 1: 320 in 39)
    assert 32 * smmlas / len(loop) >= (16 if m != 1 else 12), f"{32 * smmlas / len(loop):.1f} multiply-adds per instruction"


def test_sdot_takes_what_smmla_cannot_and_the_ablation():
    from blockforge.compile.pipeline import phases

    def isas(k, without=frozenset()):
        (phase,) = [p for p in phases(resolve("aarch64-linux-i8mm"), int8=True, without=without) if p.name == "int8-gemm"]
        mod = int8_gemm_module(k, 32)
        with I8MM_TARGET:
            for p in phase.passes():
                mod = p(mod)
        return [s.isa for s in gemm.kernel_specs(mod)]

    assert isas(40) == ["i8mm"]
    assert isas(36) == ["sdot"]  # K % 8 != 0: SDOT's 4-byte groups
    assert isas(40, frozenset({"int8-i8mm"})) == ["sdot"]


# --------------------------------------------------------------------------- under qemu

@_qemu_marks
@pytest.mark.parametrize("act, zp_a, zp_w, k, instruction", [("uint8", 131, 3, 72, "smmla"), ("int8", -7, 0, 72, "smmla"),
                                                             ("int8", 5, 0, 36, "sdot")])
def test_exact_int32_in_the_edge_app_under_qemu(tmp_path, act, zp_a, zp_w, k, instruction):
    # 13 rows: three whole 4-row tiles and a ragged one (a row pair, one row clamped); K = 36 on SDOT
    exact_int32_under_qemu(tmp_path, act, zp_a, zp_w, k, "aarch64-linux-i8mm", instruction)


@_qemu_marks
@pytest.mark.parametrize("kind, mode, seq", [("ffn", "dynamic", 16), ("ffn", "static", 16), ("mha", "static", 256)])
def test_quantized_blocks_match_ort_under_qemu(tmp_path, kind, mode, seq):
    """The MHA at seq 256 with one 64-wide head: its QDQ attention products (256 x 64 x 256) reach
    gemm.PARALLEL_MACS, so int8-attention packs K^T and V in the graph, in SMMLA's 8-byte groups."""
    gemms, pkg, inputs = quantized_block_matches_ort(tmp_path, kind, mode, seq, heads=1, target="aarch64-linux-i8mm",
                                                     instruction="smmla")
    # fc1, fc2; the MHA's q, k, v and out projections and its two attention products
    assert gemms == (2 if kind == "ffn" else 6), gemms
    if (kind, mode) == ("ffn", "dynamic"):
        dies_without_the_instruction(tmp_path, pkg, inputs, "cortex-a76")  # dotprod, no i8mm
