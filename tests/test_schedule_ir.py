"""Schedules as TVM's dlight tests check them: a PrimFunc before, the expected TIR after,
`assert_structural_equal`, under fixed targets (the x86-64-avx512 and x86-64-avx2 presets'
mcpus), so the expected IR is the same on every build machine. tests/test_schedules.py
checks the properties (parallel loop, widths, guards) and the numbers over more shapes.

To regenerate an expected function after a deliberate schedule change, print
`_schedule(rule, before, target).script()` and substitute the width parameters back in.
"""

from __future__ import annotations

import re

import pytest

tvm = pytest.importorskip("tvm")
from tvm.script import tirx as T  # noqa: E402

from blockforge.compile.schedule.elementwise import CPUElementwise
from blockforge.compile.schedule.matmul import CPUMatmul
from blockforge.compile.schedule.matvec import CPUMatvec
from blockforge.compile.schedule.reduction import CPURowReduction
from blockforge.compile.schedule.base import vector_lanes  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})
AVX2 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2})
NEON = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"], "num-cores": 4})


def _schedule(rule, func, target):
    func = func.with_attr("global_symbol", "main")  # as the expected functions are named
    with target:
        sch = rule.apply(func, target, False)
    assert sch is not None, f"{type(rule).__name__} did not apply"
    return sch.mod["main"]


@pytest.mark.parametrize("target, lanes", [(AVX512, 16), (AVX2, 8), (NEON, 4),
                                            (tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu"}), 4)])
def test_vector_lanes_follow_the_target_not_the_build_machine(target, lanes):
    """TVM's llvm_get_vector_width says 512 bits for `-mcpu=haswell` on an AVX-512 machine:
    the lanes come from the target's own features."""
    assert vector_lanes(target) == lanes


# fmt: off
@T.prim_func(s_tir=True)
def matmul_before(a: T.Buffer((T.int64(8), T.int64(16)), "float32"), b: T.Buffer((T.int64(16), T.int64(128)), "float32"), matmul: T.Buffer((T.int64(8), T.int64(128)), "float32")):
    T.func_attr({"tirx.noalias": True})
    for i, j, k in T.grid(T.int64(8), T.int64(128), T.int64(16)):
        with T.sblock("matmul"):
            v_i = T.axis.spatial(T.int64(8), i)
            v_j = T.axis.spatial(T.int64(128), j)
            v_k = T.axis.reduce(T.int64(16), k)
            T.reads(a[v_i, v_k], b[v_k, v_j])
            T.writes(matmul[v_i, v_j])
            with T.init():
                matmul[v_i, v_j] = T.float32(0.0)
            matmul[v_i, v_j] = matmul[v_i, v_j] + a[v_i, v_k] * b[v_k, v_j]
# fmt: on


def _matmul_expected(nr: int):
    """MR = 6 rows unrolled x NR columns vectorised in registers; (column panels x row tiles)
    fused into the one parallel loop; the partial last row tile guarded."""

    @T.prim_func(s_tir=True)
    def main(a: T.Buffer((T.int64(8), T.int64(16)), "float32"), b: T.Buffer((T.int64(16), T.int64(128)), "float32"), matmul: T.Buffer((T.int64(8), T.int64(128)), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        matmul_local = T.sblock_alloc_buffer((T.int64(8), T.int64(128)), scope="local")
        for j_0_i_0_fused in T.parallel(T.int64(2 * (128 // nr))):
            for i_1_init in T.unroll(T.int64(6)):
                for j_1_init in T.vectorized(T.int64(nr)):
                    with T.sblock("matmul_init"):
                        v_i = T.axis.spatial(T.int64(8), j_0_i_0_fused % T.int64(2) * T.int64(6) + i_1_init)
                        v_j = T.axis.spatial(T.int64(128), j_0_i_0_fused // T.int64(2) * T.int64(nr) + j_1_init)
                        T.where(j_0_i_0_fused % T.int64(2) * T.int64(6) + i_1_init < T.int64(8))
                        T.reads()
                        T.writes(matmul_local[v_i, v_j])
                        matmul_local[v_i, v_j] = T.float32(0.0)
            for k in range(T.int64(16)):
                for i_1 in T.unroll(T.int64(6)):
                    for j_1 in T.vectorized(T.int64(nr)):
                        with T.sblock("matmul_update"):
                            v_i = T.axis.spatial(T.int64(8), j_0_i_0_fused % T.int64(2) * T.int64(6) + i_1)
                            v_j = T.axis.spatial(T.int64(128), j_0_i_0_fused // T.int64(2) * T.int64(nr) + j_1)
                            v_k = T.axis.reduce(T.int64(16), k)
                            T.where(j_0_i_0_fused % T.int64(2) * T.int64(6) + i_1 < T.int64(8))
                            T.reads(matmul_local[v_i, v_j], a[v_i, v_k], b[v_k, v_j])
                            T.writes(matmul_local[v_i, v_j])
                            matmul_local[v_i, v_j] = matmul_local[v_i, v_j] + a[v_i, v_k] * b[v_k, v_j]
            for ax0 in T.unroll(T.int64(6)):
                for ax1 in T.vectorized(T.int64(nr)):
                    with T.sblock("matmul_local"):
                        v0 = T.axis.spatial(T.int64(8), j_0_i_0_fused % T.int64(2) * T.int64(6) + ax0)
                        v1 = T.axis.spatial(T.int64(128), j_0_i_0_fused // T.int64(2) * T.int64(nr) + ax1)
                        T.where(j_0_i_0_fused % T.int64(2) * T.int64(6) + ax0 < T.int64(8))
                        T.reads(matmul_local[v0, v1])
                        T.writes(matmul[v0, v1])
                        matmul[v0, v1] = matmul_local[v0, v1]

    return main


@pytest.mark.parametrize("target, nr", [(AVX512, 64), (AVX2, 16)])
def test_matmul_static(target, nr):
    """AVX-512: 6 x 4 zmm accumulators; AVX2: 6 x 2 ymm (its 16 registers: schedule.base.nr_vecs)."""
    tvm.ir.assert_structural_equal(_schedule(CPUMatmul(), matmul_before, target), _matmul_expected(nr))


@pytest.mark.parametrize("target, vecs", [(AVX512, 4), (AVX2, 2), (NEON, 4),
                                          (tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu"}), 2)])
def test_micro_tile_fits_the_register_file(target, vecs):
    """6 rows x vecs accumulators: 24 of AVX-512's and NEON's 32 registers, 12 of x86's 16 below
    AVX-512 (24 spilled there); the prepacked panels are that wide."""
    from blockforge.compile.schedule.base import nr_vecs
    from blockforge.compile.schedule.matmul import panel_width

    assert nr_vecs(target) == vecs and panel_width(target) == vecs * vector_lanes(target)


# fmt: off
@T.prim_func(s_tir=True)
def one_row_packed(a: T.Buffer((T.int64(1), T.int64(32)), "float32"), wp: T.Buffer((T.int64(8), T.int64(32), T.int64(16)), "float32"), out: T.Buffer((T.int64(1), T.int64(128)), "float32")):
    T.func_attr({"tirx.noalias": True})
    for i, j, k in T.grid(T.int64(1), T.int64(128), T.int64(32)):
        with T.sblock("packed_matmul"):
            v_i, v_j, v_k = T.axis.remap("SSR", [i, j, k])
            T.reads(a[v_i, v_k], wp[v_j // T.int64(16), v_k, v_j % T.int64(16)])
            T.writes(out[v_i, v_j])
            with T.init():
                out[v_i, v_j] = T.float32(0.0)
            out[v_i, v_j] = out[v_i, v_j] + a[v_i, v_k] * wp[v_j // T.int64(16), v_k, v_j % T.int64(16)]
# fmt: on


def test_few_rows_read_narrow_panels_side_by_side():
    """A decode step's one row on AVX2's 2-ymm panels: two panels per k step (4 FMA chains, as
    one 4-vector panel gave), an unrolled loop of 2 around the vectorised 16 columns, the
    write-back vectorised over both."""
    text = _schedule(CPUMatmul(), one_row_packed, AVX2).script()
    assert re.search(r"for k in range\(T.int64\(32\)\):\n\s+for i_1 in T.unroll\(T.int64\(6\)\):\n\s+"
                     r"for j_1 in T.unroll\(T.int64\(2\)\):\n\s+for j_2 in T.vectorized\(T.int64\(16\)\)", text), text
    assert re.search(r"T.vectorized\(T.int64\(32\)\)", text), text  # the write-back


# fmt: off
@T.prim_func(s_tir=True)
def matvec_before(a: T.Buffer((2, 96), "float32"), wp: T.Buffer((3, 96, 64), "float32"), b: T.Buffer((192,), "float32"), bias: T.Buffer((2, 192), "float32")):
    T.func_attr({"tirx.noalias": True})
    packed_matmul = T.sblock_alloc_buffer((2, 192))
    for i0, i1, k in T.grid(2, 192, 96):
        with T.sblock("packed_matmul"):
            v_i0, v_i1, v_k = T.axis.remap("SSR", [i0, i1, k])
            T.reads(a[v_i0, v_k], wp[v_i1 // 64, v_k, v_i1 % 64])
            T.writes(packed_matmul[v_i0, v_i1])
            with T.init():
                packed_matmul[v_i0, v_i1] = T.float32(0.0)
            packed_matmul[v_i0, v_i1] = packed_matmul[v_i0, v_i1] + a[v_i0, v_k] * wp[v_i1 // 64, v_k, v_i1 % 64]
    for i, j in T.grid(2, 192):
        with T.sblock("bias"):
            v_i, v_j = T.axis.remap("SS", [i, j])
            T.reads(packed_matmul[v_i, v_j], b[v_j])
            T.writes(bias[v_i, v_j])
            bias[v_i, v_j] = packed_matmul[v_i, v_j] + b[v_j]
# fmt: on


def _matvec_expected(cols: int):
    """Two rows on packed (3, 96, 64) panels: each panel's K stream read once (in 64 / cols
    column strips of 4 vectors), both rows unrolled inside it, no row guard, the bias in the
    write-back; the panels parallel."""

    @T.prim_func(s_tir=True)
    def main(a: T.Buffer((2, 96), "float32"), wp: T.Buffer((3, 96, 64), "float32"), b: T.Buffer((192,), "float32"), bias: T.Buffer((2, 192), "float32")):
        T.func_attr({"tirx.noalias": True})
        packed_matmul_local = T.sblock_alloc_buffer((2, 192), scope="local")
        for i1_0 in T.parallel(3):
            for i1_1 in range(64 // cols):
                for i0_init in T.unroll(2):
                    for i1_2_init in T.vectorized(cols):
                        with T.sblock("packed_matmul_init"):
                            v_i0 = T.axis.spatial(2, i0_init)
                            v_i1 = T.axis.spatial(192, i1_0 * 64 + i1_1 * cols + i1_2_init)
                            T.reads()
                            T.writes(packed_matmul_local[v_i0, v_i1])
                            packed_matmul_local[v_i0, v_i1] = T.float32(0.0)
                for k in range(96):
                    for i0 in T.unroll(2):
                        for i1_2 in T.vectorized(cols):
                            with T.sblock("packed_matmul_update"):
                                v_i0 = T.axis.spatial(2, i0)
                                v_i1 = T.axis.spatial(192, i1_0 * 64 + i1_1 * cols + i1_2)
                                v_k = T.axis.reduce(96, k)
                                T.reads(packed_matmul_local[v_i0, v_i1], a[v_i0, v_k], wp[v_i1 // 64, v_k, v_i1 % 64])
                                T.writes(packed_matmul_local[v_i0, v_i1])
                                packed_matmul_local[v_i0, v_i1] = packed_matmul_local[v_i0, v_i1] + a[v_i0, v_k] * wp[v_i1 // 64, v_k, v_i1 % 64]
                for ax0 in T.unroll(2):
                    for ax1 in T.vectorized(cols):
                        with T.sblock("packed_matmul_local"):
                            v0 = T.axis.spatial(2, ax0)
                            if cols == 64:  # one strip: its unit loop simplified out of the write-back
                                v1 = T.axis.spatial(192, i1_0 * 64 + ax1)
                            else:
                                v1 = T.axis.spatial(192, i1_0 * 64 + i1_1 * cols + ax1)
                            T.reads(packed_matmul_local[v0, v1], b[v1])
                            T.writes(bias[v0, v1])
                            bias[v0, v1] = packed_matmul_local[v0, v1] + b[v1]

    return main


@pytest.mark.parametrize("target, cols", [(AVX512, 64), (AVX2, 32)])
def test_matvec_two_rows(target, cols):
    matvec_before_named = matvec_before.with_attr("global_symbol", "main")
    tvm.ir.assert_structural_equal(_schedule(CPUMatvec(), matvec_before_named, target), _matvec_expected(cols))


# fmt: off
@T.prim_func(s_tir=True)
def softmax_before(x: T.Buffer((T.int64(4), T.int64(32)), "float32"), T_softmax_norm: T.Buffer((T.int64(4), T.int64(32)), "float32")):
    T.func_attr({"tirx.noalias": True})
    T_softmax_maxelem = T.sblock_alloc_buffer((T.int64(4),))
    T_softmax_exp = T.sblock_alloc_buffer((T.int64(4), T.int64(32)))
    T_softmax_expsum = T.sblock_alloc_buffer((T.int64(4),))
    for i0, k in T.grid(T.int64(4), T.int64(32)):
        with T.sblock("T_softmax_maxelem"):
            v_i0 = T.axis.spatial(T.int64(4), i0)
            v_k = T.axis.reduce(T.int64(32), k)
            T.reads(x[v_i0, v_k])
            T.writes(T_softmax_maxelem[v_i0])
            with T.init():
                T_softmax_maxelem[v_i0] = T.float32(-340282346638528859811704183484516925440.0)
            T_softmax_maxelem[v_i0] = T.max(T_softmax_maxelem[v_i0], x[v_i0, v_k])
    for i0, i1 in T.grid(T.int64(4), T.int64(32)):
        with T.sblock("T_softmax_exp"):
            v_i0 = T.axis.spatial(T.int64(4), i0)
            v_i1 = T.axis.spatial(T.int64(32), i1)
            T.reads(x[v_i0, v_i1], T_softmax_maxelem[v_i0])
            T.writes(T_softmax_exp[v_i0, v_i1])
            T_softmax_exp[v_i0, v_i1] = T.exp(x[v_i0, v_i1] - T_softmax_maxelem[v_i0])
    for i0, k in T.grid(T.int64(4), T.int64(32)):
        with T.sblock("T_softmax_expsum"):
            v_i0 = T.axis.spatial(T.int64(4), i0)
            v_k = T.axis.reduce(T.int64(32), k)
            T.reads(T_softmax_exp[v_i0, v_k])
            T.writes(T_softmax_expsum[v_i0])
            with T.init():
                T_softmax_expsum[v_i0] = T.float32(0.0)
            T_softmax_expsum[v_i0] = T_softmax_expsum[v_i0] + T_softmax_exp[v_i0, v_k]
    for i0, i1 in T.grid(T.int64(4), T.int64(32)):
        with T.sblock("T_softmax_norm"):
            v_i0 = T.axis.spatial(T.int64(4), i0)
            v_i1 = T.axis.spatial(T.int64(32), i1)
            T.reads(T_softmax_exp[v_i0, v_i1], T_softmax_expsum[v_i0])
            T.writes(T_softmax_norm[v_i0, v_i1])
            T.sblock_attr({"axis": 1})
            T_softmax_norm[v_i0, v_i1] = T_softmax_exp[v_i0, v_i1] / T_softmax_expsum[v_i0]
# fmt: on


def _softmax_expected(lanes: int):
    """One parallel loop over rows; max and sum as lane-wide rfactor partials, then a
    horizontal reduction; exp and the normalisation vectorised."""

    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((T.int64(4), T.int64(32)), "float32"), T_softmax_norm: T.Buffer((T.int64(4), T.int64(32)), "float32")):
        T.func_attr({"tirx.noalias": True})
        # with T.sblock("root"):
        T_softmax_maxelem = T.sblock_alloc_buffer((T.int64(4),))
        T_softmax_exp = T.sblock_alloc_buffer((T.int64(4), T.int64(32)))
        T_softmax_expsum = T.sblock_alloc_buffer((T.int64(4),))
        T_softmax_maxelem_rf = T.sblock_alloc_buffer((T.int64(lanes), T.int64(4)))
        T_softmax_expsum_rf = T.sblock_alloc_buffer((T.int64(lanes), T.int64(4)))
        for i0_m in T.parallel(T.int64(4)):
            for k_1_init in T.vectorized(T.int64(lanes)):
                with T.sblock("T_softmax_maxelem_rf_init"):
                    vk_1 = T.axis.spatial(T.int64(lanes), k_1_init)
                    v_i0 = T.axis.spatial(T.int64(4), i0_m)
                    T.reads()
                    T.writes(T_softmax_maxelem_rf[vk_1, v_i0])
                    T_softmax_maxelem_rf[vk_1, v_i0] = T.float32(-340282346638528859811704183484516925440.0)
            for k_0 in range(T.int64(32 // lanes)):
                for k_1 in T.vectorized(T.int64(lanes)):
                    with T.sblock("T_softmax_maxelem_rf_update"):
                        vk_1 = T.axis.spatial(T.int64(lanes), k_1)
                        v_i0 = T.axis.spatial(T.int64(4), i0_m)
                        vk_0 = T.axis.reduce(T.int64(32 // lanes), k_0)
                        T.reads(T_softmax_maxelem_rf[vk_1, v_i0], x[v_i0, vk_0 * T.int64(lanes) + vk_1])
                        T.writes(T_softmax_maxelem_rf[vk_1, v_i0])
                        T_softmax_maxelem_rf[vk_1, v_i0] = T.max(T_softmax_maxelem_rf[vk_1, v_i0], x[v_i0, vk_0 * T.int64(lanes) + vk_1])
            for k_1 in range(T.int64(lanes)):
                with T.sblock("T_softmax_maxelem"):
                    vk_1 = T.axis.reduce(T.int64(lanes), k_1)
                    v_i0 = T.axis.spatial(T.int64(4), i0_m)
                    T.reads(T_softmax_maxelem_rf[vk_1, v_i0])
                    T.writes(T_softmax_maxelem[v_i0])
                    with T.init():
                        T_softmax_maxelem[v_i0] = T.float32(-340282346638528859811704183484516925440.0)
                    T_softmax_maxelem[v_i0] = T.max(T_softmax_maxelem[v_i0], T_softmax_maxelem_rf[vk_1, v_i0])
            for i1_0 in range(T.int64(32 // lanes)):
                for i1_1 in T.vectorized(T.int64(lanes)):
                    with T.sblock("T_softmax_exp"):
                        v_i0 = T.axis.spatial(T.int64(4), i0_m)
                        v_i1 = T.axis.spatial(T.int64(32), i1_0 * T.int64(lanes) + i1_1)
                        T.reads(x[v_i0, v_i1], T_softmax_maxelem[v_i0])
                        T.writes(T_softmax_exp[v_i0, v_i1])
                        T_softmax_exp[v_i0, v_i1] = T.exp(x[v_i0, v_i1] - T_softmax_maxelem[v_i0])
            for k_1_init in T.vectorized(T.int64(lanes)):
                with T.sblock("T_softmax_expsum_rf_init"):
                    vk_1 = T.axis.spatial(T.int64(lanes), k_1_init)
                    v_i0 = T.axis.spatial(T.int64(4), i0_m)
                    T.reads()
                    T.writes(T_softmax_expsum_rf[vk_1, v_i0])
                    T_softmax_expsum_rf[vk_1, v_i0] = T.float32(0.0)
            for k_0 in range(T.int64(32 // lanes)):
                for k_1 in T.vectorized(T.int64(lanes)):
                    with T.sblock("T_softmax_expsum_rf_update"):
                        vk_1 = T.axis.spatial(T.int64(lanes), k_1)
                        v_i0 = T.axis.spatial(T.int64(4), i0_m)
                        vk_0 = T.axis.reduce(T.int64(32 // lanes), k_0)
                        T.reads(T_softmax_expsum_rf[vk_1, v_i0], T_softmax_exp[v_i0, vk_0 * T.int64(lanes) + vk_1])
                        T.writes(T_softmax_expsum_rf[vk_1, v_i0])
                        T_softmax_expsum_rf[vk_1, v_i0] = T_softmax_expsum_rf[vk_1, v_i0] + T_softmax_exp[v_i0, vk_0 * T.int64(lanes) + vk_1]
            for k_1 in range(T.int64(lanes)):
                with T.sblock("T_softmax_expsum"):
                    vk_1 = T.axis.reduce(T.int64(lanes), k_1)
                    v_i0 = T.axis.spatial(T.int64(4), i0_m)
                    T.reads(T_softmax_expsum_rf[vk_1, v_i0])
                    T.writes(T_softmax_expsum[v_i0])
                    with T.init():
                        T_softmax_expsum[v_i0] = T.float32(0.0)
                    T_softmax_expsum[v_i0] = T_softmax_expsum[v_i0] + T_softmax_expsum_rf[vk_1, v_i0]
            for i1_0 in range(T.int64(32 // lanes)):
                for i1_1 in T.vectorized(T.int64(lanes)):
                    with T.sblock("T_softmax_norm"):
                        v_i0 = T.axis.spatial(T.int64(4), i0_m)
                        v_i1 = T.axis.spatial(T.int64(32), i1_0 * T.int64(lanes) + i1_1)
                        T.reads(T_softmax_exp[v_i0, v_i1], T_softmax_expsum[v_i0])
                        T.writes(T_softmax_norm[v_i0, v_i1])
                        T.sblock_attr({"axis": 1})
                        T_softmax_norm[v_i0, v_i1] = T_softmax_exp[v_i0, v_i1] / T_softmax_expsum[v_i0]

    return main


@pytest.mark.parametrize("target, lanes", [(AVX512, 16), (AVX2, 8)])
def test_softmax_row_reduction_static(target, lanes):
    tvm.ir.assert_structural_equal(_schedule(CPURowReduction(), softmax_before, target), _softmax_expected(lanes))


@pytest.mark.parametrize("rule", [CPUMatmul(), CPUMatvec(), CPURowReduction()], ids=lambda r: type(r).__name__)
def test_cpu_rules_leave_other_targets_alone(rule):
    """One guard for every CPU rule (cpu_schedule.CPURule): a GPU target gets no schedule."""
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    before = {CPUMatmul: matmul_before, CPUMatvec: matvec_before}.get(type(rule), softmax_before)
    assert rule.apply(before, cuda, False) is None
    assert rule.apply(before, AVX512, False) is not None


@T.prim_func(s_tir=True)
def residual_add_before(var_x: T.handle, var_r: T.handle, var_y: T.handle):
    """A decoder's residual add as TVM legalizes it: one serial block over (1, seq, 768)."""
    T.func_attr({"op_pattern": 0, "tirx.noalias": True})
    seq = T.int64()
    x = T.match_buffer(var_x, (T.int64(1), seq, T.int64(768)))
    r = T.match_buffer(var_r, (T.int64(1), seq, T.int64(768)))
    y = T.match_buffer(var_y, (T.int64(1), seq, T.int64(768)))
    for ax0, ax1, ax2 in T.grid(T.int64(1), seq, T.int64(768)):
        with T.sblock("T_add"):
            v0, v1, v2 = T.axis.remap("SSS", [ax0, ax1, ax2])
            y[v0, v1, v2] = x[v0, v1, v2] + r[v0, v1, v2]


def _residual_add_expected(lanes):
    @T.prim_func(s_tir=True)
    def main(var_x: T.handle, var_r: T.handle, var_y: T.handle):
        T.func_attr({"op_pattern": 0, "tirx.noalias": True})
        seq = T.int64()
        x = T.match_buffer(var_x, (T.int64(1), seq, T.int64(768)))
        r = T.match_buffer(var_r, (T.int64(1), seq, T.int64(768)))
        y = T.match_buffer(var_y, (T.int64(1), seq, T.int64(768)))
        for ax0_ax1_fused in T.parallel(seq):
            for ax2_0 in range(T.int64(768 // lanes)):
                for ax2_1 in T.vectorized(T.int64(lanes)):
                    with T.sblock("T_add"):
                        v0 = T.axis.spatial(T.int64(1), T.int64(0))
                        v1 = T.axis.spatial(seq, ax0_ax1_fused)
                        v2 = T.axis.spatial(T.int64(768), ax2_0 * T.int64(lanes) + ax2_1)
                        T.reads(x[v0, v1, v2], r[v0, v1, v2])
                        T.writes(y[v0, v1, v2])
                        y[v0, v1, v2] = x[v0, v1, v2] + r[v0, v1, v2]

    return main


@pytest.mark.parametrize("target, lanes", [(AVX512, 16), (AVX2, 8)])
def test_elementwise_symbolic_rows_parallel_and_vectorised(target, lanes):
    """A float residual add over symbolic rows (a decoder's one-build prompt): TVM left it a
    serial scalar loop; CPUElementwise runs the rows on every core, each row in vectors."""
    tvm.ir.assert_structural_equal(_schedule(CPUElementwise(), residual_add_before, target),
                                   _residual_add_expected(lanes))


@pytest.mark.parametrize("rows, parallel", [(1, False), (16, False), (21, False), (22, True), (128, True)])
def test_elementwise_parallel_only_above_min_parallel(rows, parallel):
    """Under MIN_PARALLEL elements (16384: 21 rows of 768 are 16128) one core runs the kernel:
    a parallel launch costs more than the add. Vectorised either way."""
    from tvm import te

    from blockforge.compile.schedule.elementwise import MIN_PARALLEL

    assert (rows * 768 >= MIN_PARALLEL) == parallel
    x, r = (te.placeholder((1, rows, 768), "float32", name=n) for n in "xr")
    y = te.compute(x.shape, lambda a, b, c: x[a, b, c] + r[a, b, c], name="T_add")
    text = _schedule(CPUElementwise(), te.create_prim_func([x, r, y]), AVX512).script()
    assert ("T.parallel" in text) == parallel, text
    assert "T.vectorized(16)" in text.replace("T.int64(16)", "16"), text


def test_elementwise_rule_refuses_reductions():
    """A kernel with a reduction is a row reduction's or a GEMM's, never CPUElementwise's."""
    assert CPUElementwise().apply(softmax_before.with_attr("global_symbol", "main"), AVX512, False) is None


@T.prim_func(s_tir=True)
def unfold_before(x: T.Buffer((T.int64(1), T.int64(64), T.int64(32), T.int64(32)), "float32"),
                  y: T.Buffer((T.int64(1024), T.int64(64)), "float32")):
    """(1, C, H, W) -> (H*W, C) through a reshape: MobileViT's unfold and SegFormer's flatten as
    TVM legalizes them, the channel innermost in the output and the outermost in the input."""
    T.func_attr({"op_pattern": 2, "tirx.noalias": True})
    for i, c in T.grid(T.int64(1024), T.int64(64)):
        with T.sblock("T_transpose"):
            vi, vc = T.axis.remap("SS", [i, c])
            y[vi, vc] = x[T.int64(0), vc, vi // T.int64(32), vi % T.int64(32)]


def _unfold_expected(lanes):
    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((T.int64(1), T.int64(64), T.int64(32), T.int64(32)), "float32"),
             y: T.Buffer((T.int64(1024), T.int64(64)), "float32")):
        T.func_attr({"op_pattern": 2, "tirx.noalias": True})
        for i_0_c_0_fused in T.parallel(T.int64(64 * 64 // lanes)):
            for i_1 in range(T.int64(16)):
                for c_1 in T.vectorized(T.int64(lanes)):
                    with T.sblock("T_transpose"):
                        vi = T.axis.spatial(T.int64(1024), i_0_c_0_fused // T.int64(64 // lanes) * T.int64(16) + i_1)
                        vc = T.axis.spatial(T.int64(64), i_0_c_0_fused % T.int64(64 // lanes) * T.int64(lanes) + c_1)
                        T.reads(x[T.int64(0), vc, vi // T.int64(32), vi % T.int64(32)])
                        T.writes(y[vi, vc])
                        y[vi, vc] = x[T.int64(0), vc, vi // T.int64(32), vi % T.int64(32)]

    return main


@pytest.mark.parametrize("target, lanes", [(AVX512, 16), (AVX2, 8)])
def test_elementwise_transpose_in_tiles(target, lanes):
    """A kernel that reads its input across lines (the output's innermost axis steps the input by
    1024 elements, the next axis out by 1) runs in tiles of 16 rows x a vector, so each of the 16
    input lines a tile gathers from is fetched once for the 16 rows (MobileViT-small whole,
    `transpose-tiles`: 0.92-0.96x). transpose-tiles off: rows parallel, the row vectorised."""
    tvm.ir.assert_structural_equal(_schedule(CPUElementwise(), unfold_before, target), _unfold_expected(lanes))
    text = _schedule(CPUElementwise(tile_transposes=False), unfold_before, target).script()
    assert "T.parallel(T.int64(1024))" in text, text


def test_elementwise_rows_read_in_order_are_not_tiled():
    """The residual add reads every input along its own rows: no tiles."""
    from tvm import te

    x, r = (te.placeholder((1, 64, 768), "float32", name=n) for n in "xr")
    y = te.compute(x.shape, lambda a, b, c: x[a, b, c] + r[a, b, c], name="T_add")
    text = _schedule(CPUElementwise(), te.create_prim_func([x, r, y]), AVX512).script()
    assert "a_b_fused in T.parallel(64)" in text and "b_1" not in text, text


@pytest.mark.parametrize("w, vec, tiled", [(56, 8, True), (7, None, False)])
def test_elementwise_transpose_half_vectors(w, vec, tiled):
    """ConvNeXt's (H*W, C) -> (1, C, H, W) with rows of 56 (vectors of 8) or 7 (no vector: the
    rows rule's loop)."""
    from tvm import te

    from blockforge.compile.schedule.elementwise import transposes

    x = te.placeholder((w * w, 96), "float32", name="x")
    y = te.compute((1, 96, w, w), lambda a, c, h, v: x[h * w + v, c], name="T_transpose")
    func = te.create_prim_func([x, y]).with_attr("global_symbol", "main")
    sch = tvm.s_tir.Schedule(func)
    (block,) = sch.get_child_blocks(sch.get_sblock("root", "main"))
    assert transposes(sch, block) == 1, "the channel axis: the input's unit stride"
    text = _schedule(CPUElementwise(), func, AVX512).script()
    assert (f"T.vectorized({vec})" in text) == tiled and ("range(16)" in text) == tiled, text


def test_elementwise_gather_is_not_a_transpose():
    """An index read from data (a gather, embedding lookups): no offset steps to sample; the
    rows rule's loop, not a failure that leaves the kernel unscheduled."""
    from tvm import te

    from blockforge.compile.schedule.elementwise import transposes

    x = te.placeholder((64, 32), "float32", name="x")
    idx = te.placeholder((128,), "int64", name="idx")
    y = te.compute((128, 32), lambda i, j: x[idx[i], j], name="T_take")
    func = te.create_prim_func([x, idx, y]).with_attr("global_symbol", "main")
    sch = tvm.s_tir.Schedule(func)
    (block,) = sch.get_child_blocks(sch.get_sblock("root", "main"))
    assert transposes(sch, block) is None
    text = _schedule(CPUElementwise(), func, AVX512).script()
    assert "T.vectorized(16)" in text, text
