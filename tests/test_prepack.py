"""Prepacked weights whose N no panel width divides (vocabularies: GPT-2's 50257): padded to
whole panels, the product cropped back (compile/passes/prepack.py), so the matmul keeps the
packed kernel's parallel-over-panels schedule at one row (a decode step) instead of falling to
a rows-only schedule on one core."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from onnx import TensorProto  # noqa: E402
from onnx import helper as oh  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from tvm import te, tirx  # noqa: E402

from blockforge.compile.frontend.importer import import_onnx  # noqa: E402
from blockforge.compile.onnx_backend import BlockforgeBackend  # noqa: E402
from blockforge.compile.passes.prepack import CROP_BLOCK, PACKED_BLOCK, pack_weights, packed_matmul  # noqa: E402
from blockforge.compile.pipeline import run_phases  # noqa: E402
from blockforge.compile.schedule.matmul import CPUMatmul  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})
K, N = 96, 4 * 64 + 17  # 5 panels of 64, the last with 17 real columns


def _model(m, n=N, bias=False, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((K, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["y" if not bias else "mm"], name="lm_head")]
    inits = [nh.from_array(w, "w")]
    if bias:
        nodes.append(oh.make_node("Add", ["mm", "b"], ["y"], name="bias"))
        inits.append(nh.from_array(b, "b"))
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [m, K])],
                      [oh.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], inits)
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    return model, w, (b if bias else np.zeros(n, np.float32))


def test_pack_weights_pads_the_last_panel_with_zeros():
    w = np.arange(3 * 70, dtype=np.float32).reshape(3, 70)
    wp = pack_weights(w, 16)
    assert wp.shape == (5, 3, 16)
    assert np.array_equal(wp.transpose(1, 0, 2).reshape(3, 80)[:, :70], w)
    assert not wp[4, :, 6:].any(), "the padded columns are zero"


def test_ragged_weights_are_packed_and_cropped():
    mod, _ = run_phases(import_onnx(_model(1)[0]), resolve("host"), stop_after="prepack")
    text = mod.script(show_meta=False)
    assert PACKED_BLOCK in text and CROP_BLOCK in text
    mod, _ = run_phases(import_onnx(_model(1)[0]), resolve("host"), stop_after="prepack", without={"pad-panels"})
    assert PACKED_BLOCK not in mod.script(show_meta=False), "the ablation leaves the matmul unpacked"


def test_narrow_ragged_weights_are_not_padded():
    """Below 4 panels the padding would waste more than a quarter of the columns: unpacked."""
    mod, _ = run_phases(import_onnx(_model(1, n=2 * 64 + 5)[0]), resolve("host"), stop_after="prepack")
    assert PACKED_BLOCK not in mod.script(show_meta=False)


def _loops(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, out.append)], order="pre")
    return out


def test_one_row_is_parallel_over_the_panels():
    """M = 1: the parallel loop runs over the 5 column panels (both cores busy), the panels'
    64 columns vectorised; only the crop is guarded."""
    a = te.placeholder((1, K), "float32", name="a")
    wp = te.placeholder((5, K, 64), "float32", name="wp")
    func = te.create_prim_func([a, wp, packed_matmul(a, wp, N)]).with_attr("global_symbol", "main")
    with AVX512:
        sch = CPUMatmul().apply(func, AVX512, False)
    assert sch is not None
    kinds = [(lp.kind, int(lp.extent)) for lp in _loops(sch.mod["main"])]
    assert (tirx.ForKind.PARALLEL, 5) in kinds, kinds
    assert (tirx.ForKind.VECTORIZED, 64) in kinds, kinds


@pytest.mark.parametrize("m, bias", [(1, False), (7, True), (13, False)])
def test_padded_matmul_numbers(m, bias):
    model, w, b = _model(m, bias=bias, seed=m)
    x = np.random.default_rng(m + 100).standard_normal((m, K)).astype(np.float32)
    got = BlockforgeBackend.prepare(model).run({"x": x})[0]
    assert got.shape == (m, N)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)
