"""The CPU matmul's micro-tile prefetches the next weight panel (compile/passes/panel_prefetch.py,
BLOCKFORGE_PANEL_PREFETCH few-rows by default, ablation `panel-prefetch`): for tile (panel jo, row tile io < NR / 16), each k step prefetches
line io of row k of panel min(jo + 1, last); the later row tiles prefetch nothing. Fixed target (AVX-512, 2 cores) and
the kernel built from te, as tests/test_row_tiles.py does; the numbers against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from onnx import TensorProto  # noqa: E402
from onnx import helper as oh  # noqa: E402
from onnx import numpy_helper as nh  # noqa: E402
from tvm import relax, te, tirx  # noqa: E402

from blockforge.compile.passes.panel_prefetch import PREFETCH_LOOP, panel_prefetch  # noqa: E402
from blockforge.compile.passes.prepack import packed_matmul  # noqa: E402
from blockforge.compile.schedule.base import MR  # noqa: E402
from blockforge.compile.schedule.matmul import CPUMatmul  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})
K, PANELS = 64, 3


def _scheduled(m, prefetch=True):
    a = te.placeholder((1, m, K), "float32", name="a")
    wp = te.placeholder((PANELS, K, 64), "float32", name="wp")
    bias = te.placeholder((PANELS * 64,), "float32", name="b")
    y = packed_matmul(a, wp, None, MR)
    out = te.compute(y.shape, lambda b, i, j: y[b, i, j] + bias[j], name="T_add")
    func = te.create_prim_func([a, wp, bias, out]).with_attr("global_symbol", "main")
    with AVX512:
        sch = CPUMatmul(prefetch=prefetch).apply(func, AVX512, False)
    assert sch is not None
    mod = panel_prefetch(prefetch)(tvm.IRModule({"main": sch.mod["main"]}))
    return mod["main"]


def _all(root, kind):
    out = []
    tvm_ffi.structural_walk(root, [(kind, out.append)], order="pre")
    return out


def _prefetches(func):
    return [e for e in _all(func.body, tirx.Evaluate) if "llvm.prefetch" in str(e)]


def _annotated(func):
    return [lp for lp in _all(func.body, tirx.For) if PREFETCH_LOOP in lp.annotations]


def _eval(expr, values):
    """expr's value with each loop var (by name) set: an int."""
    def var(v):
        return tirx.IntImm("int64", values[v.name]) if v.name in values else v

    out = tvm.sym.Analyzer().simplify(tvm_ffi.structural_map(expr, (tirx.Var, var)))
    assert isinstance(out, tirx.IntImm), out
    return int(out.value)


def test_each_tile_prefetches_a_line_of_the_next_panel_in_its_k_loop():
    """50 rows (CLIP's tokens): 9 row tiles of 6 per panel, 3 panels; the prefetch sits in the
    k loop in front of the micro-tile's row loop, under `io < 4`, and reads wp[min(jo + 1, 2), k, io * 16]."""
    func = _scheduled(50)
    pfs = _prefetches(func)
    assert len(pfs) == 1, func
    assert not _annotated(func), "the mark is consumed"
    # where: a SeqStmt [prefetch, the unrolled MR-row loop] inside the k loop
    guards = [s for s in _all(func.body, tirx.IfThenElse) if s.then_case.same_as(pfs[0])]
    assert len(guards) == 1 and guards[0].else_case is None
    seqs = [s for s in _all(func.body, tirx.SeqStmt) if any(x.same_as(guards[0]) for x in s.seq)]
    assert len(seqs) == 1
    rows = seqs[0].seq[1]
    assert isinstance(rows, tirx.For) and rows.kind == tirx.ForKind.UNROLLED and int(rows.extent) == MR
    call = pfs[0].value
    # llvm.prefetch(address, rw 0 (read), locality 2 (L2), 1 (data))
    assert [int(a.value) for a in call.args[-3:]] == [0, 2, 1], call
    load = _all(call, tvm.ir.TensorLoad)[0]
    assert load.source.name == "wp"
    par = [lp for lp in _all(func.body, tirx.For) if lp.kind == tirx.ForKind.PARALLEL][0]
    tiles = -(-50 // MR)
    assert int(par.extent) == PANELS * tiles
    ks = [lp.loop_var.name for lp in _all(func.body, tirx.For) if lp.kind == tirx.ForKind.SERIAL
          and any(x.same_as(pfs[0]) for x in _all(lp.body, tirx.Evaluate))]
    for f in (0, 1, 5, tiles - 1, tiles, 2 * tiles + 3, PANELS * tiles - 1):
        jo, io = divmod(f, tiles)
        for k in (0, 7, K - 1):
            vals = {par.loop_var.name: f, **{name: 0 for name in ks}}
            vals[ks[-1]] = k  # the innermost serial loop holding it is k (K = 64: not split by K_BLOCK)
            assert _eval(guards[0].condition, vals) == (io < 4), (f, guards[0].condition)
            got = [_eval(i, vals) for i in load.indices]
            assert got == [min(jo + 1, PANELS - 1), k, io % 4 * 16], (f, k, got)


def test_ablation_leaves_no_prefetch_and_no_mark():
    func = _scheduled(50, prefetch=False)
    assert not _prefetches(func) and not _annotated(func)


def test_symbolic_rows_get_none():
    """A symbolic M (tiles partitioned, io outer) is not marked: the next panel is not the next tile's."""
    m = tirx.Var("m", "int64")
    a = te.placeholder((1, m, K), "float32", name="a")
    wp = te.placeholder((PANELS, K, 64), "float32", name="wp")
    y = packed_matmul(a, wp, None, MR)
    func = te.create_prim_func([a, wp, y]).with_attr("global_symbol", "main")
    with AVX512:
        sch = CPUMatmul().apply(func, AVX512, False)
    assert sch is not None and not _annotated(sch.mod["main"])


def _relax_gemm(m, k, n, w):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, m, k), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.matmul(x, relax.const(w))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("on, m, without, want", [
    ("1", 50, frozenset(), 1), ("1", 50, frozenset({"panel-prefetch"}), 0), ("0", 50, frozenset(), 0),
    (None, 50, frozenset(), 1), ("few-rows", 50, frozenset(), 1), (None, 50, frozenset({"panel-prefetch"}), 0),
    (None, 128, frozenset(), 0), ("all", 128, frozenset(), 1), (None, 12, frozenset(), 0), ("1", 12, frozenset(), 1)])
def test_modes_and_the_ablation_reach_the_pipeline(monkeypatch, on, m, without, want):
    """By default (few-rows) a GEMM of 19-64 static rows prefetches (CLIP's 50), one of 128 or 12
    does not; all (1) every one, off (0) none; the ablation takes it out whatever the setting."""
    from blockforge.compile.pipeline import run_phases
    from blockforge.targets import resolve

    if on is None:
        monkeypatch.delenv("BLOCKFORGE_PANEL_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("BLOCKFORGE_PANEL_PREFETCH", on)
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    mod, _ = run_phases(_relax_gemm(m, 64, 256, w), resolve("host"), without=without)
    funcs = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert sum(len(_prefetches(f)) for f in funcs) == want
    assert not any(_annotated(f) for f in funcs), "no mark reaches lowering"


@pytest.mark.parametrize("on", [None, "all"])
def test_a_column_crop_gets_none(monkeypatch, on):
    """N no panel width divides (a decoder's LM head: pad-panels' whole panels, then the crop in the
    tile): no prefetch in any mode, where the same GEMM with whole panels has one (a prefetch there
    made LLVM spill the accumulators every k step: 1.27x-1.77x the time at 37 rows)."""
    from blockforge.compile.pipeline import run_phases
    from blockforge.targets import resolve

    if on is None:
        monkeypatch.delenv("BLOCKFORGE_PANEL_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("BLOCKFORGE_PANEL_PREFETCH", on)
    counts = {}
    for n in (256, 256 + 17):
        w = np.random.default_rng(0).standard_normal((64, n)).astype(np.float32)
        mod, _ = run_phases(_relax_gemm(37, 64, n, w), resolve("host"))
        funcs = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
        assert any("crop" in str(f) for f in funcs) == (n % 64 != 0)
        counts[n] = sum(len(_prefetches(f)) for f in funcs)
    assert counts == {256: 1, 273: 0}


@pytest.mark.parametrize("m, k, n", [(50, 768, 256), (7, 96, 4 * 64 + 17)])
def test_numbers_against_onnxruntime(monkeypatch, m, k, n):
    """Prefetching changes no result: 50 x 768 x 256 (+ bias) and a padded N, against ORT."""
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setenv("BLOCKFORGE_PANEL_PREFETCH", "1")
    from blockforge.compile.onnx_backend import BlockforgeBackend

    rng = np.random.default_rng(m)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    g = oh.make_graph([oh.make_node("MatMul", ["x", "w"], ["mm"]), oh.make_node("Add", ["mm", "b"], ["y"])], "g",
                      [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, m, k])],
                      [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, n])],
                      [nh.from_array(w, "w"), nh.from_array(b, "b")])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    got = BlockforgeBackend.prepare(model).run({"x": x})[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_an_unknown_mode_is_one_user_error(monkeypatch):
    from blockforge.errors import BlockforgeError
    from blockforge.settings import panel_prefetch

    monkeypatch.setenv("BLOCKFORGE_PANEL_PREFETCH", "sometimes")
    with pytest.raises(BlockforgeError, match="BLOCKFORGE_PANEL_PREFETCH='sometimes'"):
        panel_prefetch()
