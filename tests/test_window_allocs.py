"""compile/passes/window_allocs.py: a kernel-local buffer of symbolic size (a GEMM's accumulator
over seq rows) shrunk to the constant window one row tile uses (ablation `window-allocs`), on
hand-made flattened TIR and in whole builds."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")

from blockforge.compile.passes import window_allocs as W  # noqa: E402
from blockforge.compile.pipeline import build  # noqa: E402
from blockforge.compile.session import open_model  # noqa: E402
from blockforge.graph import FFNSpec, export  # noqa: E402
from blockforge.targets import resolve  # noqa: E402
from llvm_ir import llvm_source, workspace_allocs  # noqa: E402

FIXED = resolve({"kind": "llvm", "mcpu": "znver4", "mtriple": "x86_64-linux-gnu", "num-cores": 2})


def _i(v):
    from tvm import tirx

    return tirx.IntImm("int64", v)


def _tiles(rows=4, stride=4, kind=None, extra=None):
    """acc (n,) local; for io in range(n // 4): acc[io*stride + r] = 0, += x, out[...] = acc[...]
    for r < rows, unrolled as TVM leaves a row tile. Returns (alloc, stmts, acc, out, io)."""
    from tvm import tirx

    n = tirx.Var("n", "int64")
    acc = tirx.decl_buffer((n,), "float32", "acc", scope="local")
    x = tirx.decl_buffer((n,), "float32", "x")
    out = tirx.decl_buffer((n,), "float32", "out")
    io = tirx.Var("io", "int64")
    k = tirx.Var("k", "int64")
    body = []
    row = lambda r: io * _i(stride) + _i(r)  # noqa: E731
    for r in range(rows):
        body.append(tirx.BufferStore(acc, tirx.FloatImm("float32", 0.0), [row(r)]))
    upd = [tirx.BufferStore(acc, tirx.BufferLoad(acc, [row(r)]) + tirx.BufferLoad(x, [row(r)]), [row(r)])
           for r in range(rows)]
    body.append(tirx.For(k, _i(0), _i(8), tirx.ForKind.SERIAL, tirx.SeqStmt(upd)))
    for r in range(rows):
        body.append(tirx.BufferStore(out, tirx.BufferLoad(acc, [row(r)]), [row(r)]))
    loop = tirx.For(io, _i(0), tirx.floordiv(n, _i(4)), kind or tirx.ForKind.SERIAL, tirx.SeqStmt(body))
    return tirx.AllocBuffer(acc), [loop] + (extra(acc, n) if extra else []), acc, out, io


def test_a_row_tile_buffer_becomes_its_window():
    from tvm import tirx
    import tvm

    alloc, stmts, acc, out, io = _tiles()
    shift, extent = W.window(alloc, stmts)
    assert extent == 4
    assert tvm.sym.Analyzer().can_prove_equal(shift, io * _i(4))
    seq = W.compact_seq(tirx.SeqStmt([alloc] + stmts))
    new = seq.seq[0].buffer
    assert [int(e) for e in new.shape] == [4] and new.scope() == "local"
    idx = []
    import tvm_ffi
    tvm_ffi.structural_walk(seq, (tirx.BufferStore, lambda s: idx.append(s.indices[0]) if s.buffer.same_as(new) else None))
    assert sorted(int(i) for i in idx) == [0, 0, 1, 1, 2, 2, 3, 3]  # init and update of each row, rebased


def test_a_buffer_read_by_a_second_loop_is_left_alone():
    """A producer loop and a consumer loop: sharing one window would lose the rows in between."""
    from tvm import tirx

    def consumer(acc, n):
        j = tirx.Var("j", "int64")
        y = tirx.decl_buffer((n,), "float32", "y")
        return [tirx.For(j, _i(0), n, tirx.ForKind.SERIAL, tirx.BufferStore(y, tirx.BufferLoad(acc, [j]), [j]))]

    alloc, stmts, *_ = _tiles(extra=consumer)
    assert W.window(alloc, stmts) is None


def test_overlapping_windows_are_left_alone():
    alloc, stmts, *_ = _tiles(rows=4, stride=2)  # iteration io touches [2 io, 2 io + 4): overlaps io + 1
    assert W.window(alloc, stmts) is None


def test_a_parallel_row_loop_is_left_alone():
    from tvm import tirx

    alloc, stmts, *_ = _tiles(kind=tirx.ForKind.PARALLEL)
    assert W.window(alloc, stmts) is None


def test_an_address_taken_is_left_alone():
    from tvm import tirx

    def take(acc, n):
        return [tirx.Evaluate(tirx.address_of(tirx.BufferLoad(acc, [_i(0)])))]

    alloc, stmts, *_ = _tiles(extra=take)
    assert W.window(alloc, stmts) is None
    seq = tirx.SeqStmt([alloc] + stmts)
    assert W.compact_seq(seq).same_as(seq)


def test_a_constant_buffer_is_not_touched():
    from tvm import tirx

    buf = tirx.decl_buffer((_i(16),), "float32", "c", scope="local")
    i = tirx.Var("i", "int64")
    loop = tirx.For(i, _i(0), _i(16), tirx.ForKind.SERIAL, tirx.BufferStore(buf, tirx.FloatImm("float32", 1.0), [i]))
    assert W.window(tirx.AllocBuffer(buf), [loop]) is None


@pytest.fixture(scope="module")
def ffn(tmp_path_factory):
    spec = FFNSpec(d_model=64, d_ff=256, activation="gelu")
    return spec, export(spec, tmp_path_factory.mktemp("wa") / "f.onnx").model_path


def test_symbolic_rows_gemm_tiles_call_no_workspace_allocator(ffn):
    """seq symbolic: without the pass each GEMM's accumulator is a (seq, 64) workspace buffer
    (AllocWorkspace in the parallel body); with it the tile is constant and on the stack."""
    _, path = ffn
    s = open_model(path, FIXED, {"batch": 1})
    with_pass = workspace_allocs(llvm_source(build(s.relax(), FIXED).executable))
    without = workspace_allocs(llvm_source(build(s.relax(), FIXED, without={"window-allocs"}).executable))
    lambdas = lambda d: sum(v for k, v in d.items() if "parallel_lambda" in k)  # noqa: E731
    assert lambdas(without) >= 2, without
    assert lambdas(with_pass) == 0, with_pass


@pytest.mark.parametrize("seq", [1, 5, 6, 7, 37])
def test_symbolic_rows_outputs_match_the_oracle_and_the_ablation(ffn, seq):
    """Every tail length of the 6-row tile (1, 5: only a tail; 6: none; 7, 37: both)."""
    import tvm
    from tvm import relax

    from blockforge.graph import build as graph_build, reference

    spec, path = ffn
    host = resolve("host")
    s = open_model(path, host, {"batch": 1})
    x = np.random.default_rng(seq).standard_normal((1, seq, 64)).astype(np.float32)
    outs = []
    for without in (frozenset(), {"window-allocs"}):
        vm = relax.VirtualMachine(build(s.relax(), host, without=without).executable, tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], reference(spec, graph_build(spec)[1], {"x": x}), rtol=1e-4, atol=1e-4)
