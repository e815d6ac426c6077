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
    [(at, shift)], extent = W.window(alloc, stmts)
    assert extent == 4 and at == 0
    assert tvm.sym.Analyzer().can_prove_equal(shift, io * _i(4))
    seq = W.compact_seq(tirx.SeqStmt([alloc] + stmts))
    new = seq.seq[0].buffer
    assert [int(e) for e in new.shape] == [4] and new.scope() == "local"
    idx = []
    import tvm_ffi
    tvm_ffi.structural_walk(seq, (tirx.BufferStore, lambda s: idx.append(s.indices[0]) if s.buffer.same_as(new) else None))
    assert sorted(int(i) for i in idx) == [0, 0, 1, 1, 2, 2, 3, 3]  # init and update of each row, rebased


def _partitioned(tail_guarded=True, tail_base=None):
    """LoopPartition's shape: acc (n,); a main loop over n // 4 row tiles of 4 unguarded rows
    and a tail loop over the last (n % 4 + 3) // 4 tiles whose rows are guarded `row < n`
    (tail_guarded) and which starts at row n // 4 * 4 (or tail_base(n)). Each stores then reads
    the rows it owns. Returns (alloc, stmts, acc, n)."""
    from tvm import tirx

    n = tirx.Var("n", "int64")
    acc = tirx.decl_buffer((n,), "float32", "acc")
    x = tirx.decl_buffer((n,), "float32", "x")
    out = tirx.decl_buffer((n,), "float32", "out")

    def tiles(var, extent, base, guard):
        body = []
        for r in range(4):
            row = base + var * _i(4) + _i(r)
            store = tirx.BufferStore(acc, tirx.BufferLoad(x, [row]) * tirx.FloatImm("float32", 2.0), [row])
            body.append(tirx.IfThenElse(row < n, store, None) if guard else store)
        for r in range(4):
            row = base + var * _i(4) + _i(r)
            copy = tirx.BufferStore(out, tirx.BufferLoad(acc, [row]), [row])
            body.append(tirx.IfThenElse(row < n, copy, None) if guard else copy)
        return tirx.For(var, _i(0), extent, tirx.ForKind.SERIAL, tirx.SeqStmt(body))

    four = _i(4)
    main = tiles(tirx.Var("io", "int64"), tirx.floordiv(n, four), _i(0), False)
    base = tail_base(n) if tail_base is not None else tirx.floordiv(n, four) * four
    tail = tiles(tirx.Var("it", "int64"), tirx.floordiv(tirx.floormod(n, four) + _i(3), four), base, tail_guarded)
    return tirx.AllocBuffer(acc), [main, tail], acc, n


def _allocs(seq):
    from tvm import tirx

    return [s.buffer for s in seq.seq if isinstance(s, tirx.AllocBuffer)]


def test_partitioned_row_tiles_the_main_loop_takes_the_window_the_guarded_tail_keeps_the_buffer():
    import tvm
    from tvm import tirx

    from blockforge.compile.passes.exprs import var_count

    alloc, stmts, acc, n = _partitioned()
    shifts, extent = W.window(alloc, stmts)
    assert extent == 4 and [i for i, _ in shifts] == [0]
    assert tvm.sym.Analyzer().can_prove_equal(shifts[0][1], stmts[0].loop_var * _i(4))
    seq = W.compact_seq(tirx.SeqStmt([alloc] + stmts))
    new, kept = _allocs(seq)
    assert [int(e) for e in new.shape] == [4] and kept.same_as(acc)
    main, tail = seq.seq[2:]
    assert var_count(main, new) and not var_count(main, acc)
    assert var_count(tail, acc) and not var_count(tail, new)


def test_partitioned_row_tiles_both_unguarded_share_the_window():
    from tvm import tirx

    alloc, stmts, acc, n = _partitioned(tail_guarded=False)
    shifts, extent = W.window(alloc, stmts)
    assert extent == 4 and [i for i, _ in shifts] == [0, 1]
    seq = W.compact_seq(tirx.SeqStmt([alloc] + stmts))
    assert [[int(e) for e in b.shape] for b in _allocs(seq)] == [[4]]  # the symbolic buffer is gone


def test_partitioned_loops_that_may_touch_the_same_rows_are_left_alone():
    """The tail starting two rows early overlaps the main loop's last tile: a value could flow."""
    from tvm import tirx

    alloc, stmts, *_ = _partitioned(tail_base=lambda n: tirx.floordiv(n, _i(4)) * _i(4) - _i(2))
    assert W.window(alloc, stmts) is None
    m = tirx.Var("m", "int64")
    alloc, stmts, *_ = _partitioned(tail_base=lambda n: tirx.floordiv(m, _i(4)) * _i(4))
    assert W.window(alloc, stmts) is None  # a base the analyzer cannot place against the main loop
    alloc, stmts, *_ = _partitioned(tail_base=lambda n: tirx.floordiv(n, _i(4)) * _i(4))
    assert W.window(alloc, stmts) is not None  # the same builder, apart: taken


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
    from blockforge.graph import build as graph_build, reference

    spec, path = ffn
    x = np.random.default_rng(seq).standard_normal((1, seq, 64)).astype(np.float32)
    got = _with_and_without(open_model(path, resolve("host"), {"batch": 1}), x)
    np.testing.assert_allclose(got, reference(spec, graph_build(spec)[1], {"x": x}), rtol=1e-4, atol=1e-4)


def _with_and_without(session, x):
    """The build's output on x, checked equal to the builds without the pass (or its partitioned case)."""
    import tvm
    from tvm import relax

    outs = []
    for without in (frozenset(), {"window-partitioned"}, {"window-allocs"}):
        vm = relax.VirtualMachine(build(session.relax(), session.target, without=without).executable, tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0], other)
    return outs[0]


@pytest.fixture(scope="module")
def cropped(tmp_path_factory):
    """x (1, seq, 64) @ w (64, 1000): 1000 columns are not a whole number of 64-wide weight
    panels, so each row tile writes its accumulators to an intermediate the crop reads (the
    shape of GPT-2's LM head, 50257 columns)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="lm_head")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", 1000])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path_factory.mktemp("crop") / "lm_head.onnx"
    onnx.save(m, str(path))
    return path, w


def _windowed_allocs(session, target, without=frozenset()):
    """The allocations of every kernel once BlockforgeWindowAllocs has run: [(name, shape)]."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    seen = []

    @tvm.instrument.pass_instrument
    class Grab:
        def run_after_pass(self, mod, info):
            if info.name == "BlockforgeWindowAllocs":
                seen.append(mod)

    with tvm.transform.PassContext(opt_level=3, instruments=[Grab()]):
        build(session.relax(), target, without=without)
    assert seen, "the window pass did not run"
    found = []
    for _, fn in seen[-1].functions_items():
        tvm_ffi.structural_walk(fn, (tirx.AllocBuffer, lambda a: found.append((a.buffer.name, list(a.buffer.shape)))))
    return found


def test_a_cropped_gemm_over_symbolic_rows_writes_back_through_a_constant_window(cropped):
    """The intermediate the crop reads was one (seq x 64) buffer shared by the main row tiles
    and their guarded tail (LoopPartition's copy), so it stayed a workspace: now the main
    loop's is a 6 x 64 window (on the stack, where LLVM stores the accumulators straight to
    the output) and only the tail keeps the symbolic buffer."""
    path, _ = cropped
    s = open_model(path, FIXED, {})
    allocs = [(n, shape) for n, shape in _windowed_allocs(s, FIXED) if n.startswith("packed_matmul") and "local" not in n]
    from tvm import tirx

    constant = [[int(e) for e in shape] for _, shape in allocs if all(isinstance(e, tirx.IntImm) for e in shape)]
    assert constant == [[6 * 64]], allocs
    assert len(allocs) == 2, allocs  # and the tail's, symbolic
    off = [a for a in _windowed_allocs(s, FIXED, {"window-partitioned"})
           if a[0].startswith("packed_matmul") and "local" not in a[0]]
    assert len(off) == 1 and not isinstance(off[0][1][0], tirx.IntImm), off  # the ablation: one (seq x 64) buffer


@pytest.mark.parametrize("seq", [1, 5, 6, 7, 37])
def test_a_cropped_gemm_over_symbolic_rows_matches_numpy_and_the_ablation(cropped, seq):
    path, w = cropped
    x = np.random.default_rng(seq).standard_normal((1, seq, 64)).astype(np.float32)
    np.testing.assert_allclose(_with_and_without(open_model(path, resolve("host"), {}), x), x @ w, rtol=1e-4, atol=1e-4)
