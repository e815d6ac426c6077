"""CPUMatvec (compile/schedule/matvec.py): packed matmuls of <= 4 rows, as a decode step has
them. The schedule's IR is pinned in tests/test_schedule_ir.py; here: which matmuls it takes,
its threads, and its numbers against numpy for M = 1..4, ragged N, odd K, fused epilogues."""

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
from blockforge.compile.passes.prepack import PACKED_BLOCK, packed_matmul  # noqa: E402
from blockforge.compile.pipeline import default_rules, run_phases  # noqa: E402
from blockforge.compile.schedule.matvec import CPUMatvec  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})
HOST = resolve("host")


def _packed(rows: tuple, k: int, nb: int, n: int | None = None):
    a = te.placeholder((*rows, k), "float32", name="a")
    wp = te.placeholder((nb, k, 64), "float32", name="wp")
    return te.create_prim_func([a, wp, packed_matmul(a, wp, n)]).with_attr("global_symbol", "main")


def _loops(func):
    out = []
    tvm_ffi.structural_walk(func.body, [(tirx.For, out.append)], order="pre")
    return [(lp.kind, int(lp.extent)) for lp in out if isinstance(lp.extent, tirx.IntImm)]


def _apply(rule, func):
    with AVX512:
        sch = rule.apply(func, AVX512, False)
    return None if sch is None else sch.mod["main"]


@pytest.mark.parametrize("rows, applies", [((1,), True), ((4,), True), ((5,), False), ((2, 2), True),
                                           ((2, 3), False), ((6,), False)])
def test_matvec_takes_at_most_four_rows(rows, applies):
    """Rows are batch x M: (2, 2) is 4 rows, (2, 3) is 6: CPUMatmul's 6-row tile then."""
    assert (_apply(CPUMatvec(), _packed(rows, 32, 2)) is not None) == applies


def test_conv_gemm_packed_operand_is_not_a_matvec():
    """conv-gemm's packed block (compile/conv/rewrite.py) reads im2col columns (batch, group,
    L/NR, K, NR): its 2 output channels are no matvec rows; CPUMatmul keeps it."""
    k = 32
    w = te.placeholder((1, 2, k), "float32", name="w")
    cols = te.placeholder((1, 1, 2, k, 64), "float32", name="cols")
    r = te.reduce_axis((0, k), name="k")
    y = te.compute((1, 2, 128), lambda n, o, j: te.sum(w[0, o, r] * cols[n, 0, j // 64, r, j % 64], axis=r),
                   name=PACKED_BLOCK)
    assert _apply(CPUMatvec(), te.create_prim_func([w, cols, y]).with_attr("global_symbol", "main")) is None


def test_panels_are_split_over_the_cores():
    """Both cores stream (parallel over the panels, 64 columns vectorised); parallel=False
    (the one-thread A/B of benchmarks/matvec.py) has no parallel loop."""
    f = _apply(CPUMatvec(), _packed((1,), 96, 5, 4 * 64 + 17))
    assert (tirx.ForKind.PARALLEL, 5) in _loops(f) and (tirx.ForKind.VECTORIZED, 64) in _loops(f)
    assert not any(kind == tirx.ForKind.PARALLEL for kind, _ in _loops(_apply(CPUMatvec(parallel=False),
                                                                              _packed((1,), 96, 5))))


def test_matvec_rule_is_opt_in(monkeypatch):
    """Off by default (quiet, a GPT-2 decode step was 4-6% slower with it: core/settings.py);
    BLOCKFORGE_MATVEC=1 turns it on, the ablation still takes it out."""
    has = lambda *a: any(isinstance(r, CPUMatvec) for r in default_rules(HOST, *a))  # noqa: E731
    monkeypatch.delenv("BLOCKFORGE_MATVEC", raising=False)
    assert not has()
    monkeypatch.setenv("BLOCKFORGE_MATVEC", "1")
    assert has() and not has(frozenset({"matvec"}))


K_ODD = 97


def _model(rows: tuple, k: int, n: int, epilogue: str, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["mm"]), oh.make_node("Add", ["mm", "b"], ["z"])]
    if epilogue == "relu":
        nodes.append(oh.make_node("Relu", ["z"], ["y"]))
    elif epilogue == "gelu":
        nodes.append(oh.make_node("Gelu", ["z"], ["y"], approximate="tanh"))
    else:
        nodes[-1] = oh.make_node("Add", ["mm", "b"], ["y"])
    g = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [*rows, k])],
                      [oh.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, n])],
                      [nh.from_array(w, "w"), nh.from_array(b, "b")])
    return oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10), w, b


def _want(x, w, b, epilogue):
    z = x.astype(np.float64) @ w + b
    if epilogue == "relu":
        return np.maximum(z, 0)
    if epilogue == "gelu":
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    return z


@pytest.mark.parametrize("rows, k, n, epilogue", [
    ((1,), K_ODD, 4 * 64 + 17, "gelu"),   # ragged N (padded panels, cropped), odd K, GPT-2's MLP epilogue
    ((2,), 96, 3 * 64, "bias"),
    ((3,), K_ODD, 5 * 64 + 1, "relu"),
    ((4,), 33, 4 * 64, "bias"),
    ((2, 1), 64, 4 * 64 + 5, "bias"),     # rows from a batch dim
])
def test_matvec_numbers(rows, k, n, epilogue, monkeypatch):
    monkeypatch.setenv("BLOCKFORGE_MATVEC", "1")
    model, w, b = _model(rows, k, n, epilogue, seed=sum(rows) + k)
    # the build really takes CPUMatvec: no 6-row micro-tile in the scheduled matmul
    mod, _ = run_phases(import_onnx(model), HOST, stop_after="schedule")
    mm = [f for gv, f in mod.functions_items() if "matmul" in gv.name_hint and isinstance(f, tirx.PrimFunc)]
    assert mm and all((tirx.ForKind.UNROLLED, 6) not in _loops(f) for f in mm), [f.script() for f in mm]
    x = np.random.default_rng(k).standard_normal((*rows, k)).astype(np.float32)
    got = BlockforgeBackend.prepare(model).run({"x": x})[0]
    assert got.shape == (*rows, n)
    np.testing.assert_allclose(got, _want(x, w, b, epilogue), rtol=1e-4, atol=1e-4)
