"""Packed matmuls whose static M no row tile divides (ViT's 197 tokens) are computed
over whole MR-row tiles, the rows past M re-reading row M - 1, and cropped in the tile's
write-back (compile/passes/prepack.py): the k loop of every tile is then guard-free. Guarded,
the split's row predicate sat in each tile's k loop (a compare and branch per k and accumulators
spilled around it): 1.24x slower single-core on ViT's 197 x 3072 x 768 GEMM (benchmarks/vit_gemm.py).
Only where the recomputed rows are a small share of the work (prepack.WHOLE_TILES_WASTE)."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from onnx import TensorProto  # noqa: E402
from onnx import helper as oh  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from tvm import te, tirx  # noqa: E402

from blockforge.compile.onnx_backend import BlockforgeBackend  # noqa: E402
from blockforge.compile.passes.prepack import CROP_BLOCK, PACKED_BLOCK, packed_matmul, whole_tile_rows  # noqa: E402
from blockforge.compile.schedule.base import MR  # noqa: E402
from blockforge.compile.schedule.matmul import CPUMatmul  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})
K = 64


def _scheduled(m, n_panels=2, n=None):
    a = te.placeholder((1, m, K), "float32", name="a")
    wp = te.placeholder((n_panels, K, 64), "float32", name="wp")
    bias = te.placeholder((n or n_panels * 64,), "float32", name="b")
    y = packed_matmul(a, wp, n, MR)
    out = te.compute(y.shape, lambda b, i, j: y[b, i, j] + bias[j], name="T_add")
    func = te.create_prim_func([a, wp, bias, out]).with_attr("global_symbol", "main")
    with AVX512:
        sch = CPUMatmul().apply(func, AVX512, False)
    assert sch is not None
    return sch.mod["main"]


def _blocks(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tvm.s_tir.stmt.SBlockRealize, out.append)], order="pre")
    return {r.block.name_hint: r for r in out}


def _loops(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, out.append)], order="pre")
    return out


@pytest.mark.parametrize("m, rows", [(197, 198), (299, 300), (50, None), (128, None), (192, None), (13, None), (1, None)])
def test_whole_tile_rows(m, rows):
    """Ragged static M whose recomputed rows are <= 2% of the work (197 -> 198); CLIP's 50 -> 54 (8%),
    BERT's 128 -> 132 (3%), a few rows (decode's M = 1: 6x the work) or a whole M stay guarded."""
    assert whole_tile_rows(m, MR) == rows
    assert whole_tile_rows(tvm.tirx.IntImm("int64", m), MR) == rows
    assert whole_tile_rows(tvm.tirx.Var("m", "int64"), MR) is None, "a symbolic M keeps LoopPartition's split"


def test_ragged_rows_run_whole_tiles_without_a_guard_in_the_k_loop():
    func = _scheduled(197)
    blocks = _blocks(func)
    update = blocks[PACKED_BLOCK + "_update"]
    assert isinstance(update.predicate, tirx.IntImm) and int(update.predicate) == 1, update.predicate
    assert int(update.block.iter_vars[1].dom.extent) == 198, "the accumulator covers 33 whole row tiles"
    # the write-out of the 197 real rows is the guarded one, its 64 columns still vectors
    add = blocks["T_add"]
    assert "197" in str(add.predicate), add.predicate
    kinds = [(lp.kind, int(lp.extent)) for lp in _loops(func)]
    assert kinds.count((tirx.ForKind.VECTORIZED, 64)) >= 3, kinds  # init, update, write-out
    assert (tirx.ForKind.PARALLEL, 2 * 33) in kinds, kinds


def test_ragged_columns_and_rows_keep_the_column_crop():
    """N padded to panels and M to tiles: one crop of both."""
    func = _scheduled(197, n_panels=2, n=100)
    assert int(_blocks(func)[PACKED_BLOCK + "_update"].block.iter_vars[1].dom.extent) == 198


def _model(m, n, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((K, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    g = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["mm"]), oh.make_node("Add", ["mm", "b"], ["y"])], "g",
                      [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, m, K])],
                      [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, n])],
                      [nh.from_array(w, "w"), nh.from_array(b, "b")])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10), w, b


@pytest.mark.parametrize("m, n", [(197, 128), (299, 4 * 64 + 17)])
def test_ragged_rows_numbers(m, n):
    """The recomputed rows past M never reach the output; the real ones match numpy."""
    model, w, b = _model(m, n, m)
    x = np.random.default_rng(m + 1).standard_normal((1, m, K)).astype(np.float32)
    got = BlockforgeBackend.prepare(model).run({"x": x})[0]
    assert got.shape == (1, m, n)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)
