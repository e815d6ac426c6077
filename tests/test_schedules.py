"""IR-level tests of the CPU schedules, as TVM's dlight tests do: a small PrimFunc before,
the structural properties that matter after (parallel loop, vector widths, tile sizes,
guards), and the numbers against numpy. Static and symbolic extents."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
tvm_ffi = pytest.importorskip("tvm_ffi")
from tvm import te, tirx, topi  # noqa: E402

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.attention.flash import micro_rows  # noqa: E402
from blockforge.compile.schedule.base import MR, NR_VECS, PARTITION_HINT, vector_lanes
from blockforge.compile.schedule.matmul import CPUMatmul
from blockforge.compile.schedule.reduction import CPURowReduction  # noqa: E402
from blockforge.targets import resolve  # noqa: E402

# Scheduled for a fixed target (the x86-64-avx512 preset's mcpu), so the expected structure
# is the same on every build machine; run on the host (LLVM splits the 16-lane vectors
# where the host has only AVX2).
TARGET = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})
RUN_TARGET = resolve("host").tvm_target()
LANES = vector_lanes(TARGET)
i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
SEQ = tirx.Var("seq", "int64")


def loops(func) -> list[dict]:
    """Every loop of a PrimFunc, outermost first: kind, static extent (None: symbolic),
    annotations, and the names of the blocks under it."""
    out = []

    def visit(f):
        names = []
        tvm_ffi.structural_walk(f.body, [(tvm.s_tir.stmt.SBlock, lambda b: names.append(b.name_hint))])
        out.append({"kind": int(f.kind), "extent": int(f.extent.value) if isinstance(f.extent, tirx.IntImm) else None,
                    "annotations": dict(f.annotations), "blocks": names})

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit)], order="pre")
    return out


PARALLEL, VECTORIZED, UNROLLED = int(tirx.ForKind.PARALLEL), int(tirx.ForKind.VECTORIZED), int(tirx.ForKind.UNROLLED)


def _schedule(rule, func):
    with TARGET:
        sch = rule.apply(func, TARGET, False)
    assert sch is not None, f"{type(rule).__name__} did not apply"
    return sch.mod["main"]


def _run(func, arrays, out_shape, dtype="float32"):
    lib = tvm.compile(tvm.IRModule({"main": func}), target=RUN_TARGET)
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype))
    lib["main"](*[tvm.runtime.tensor(a) for a in arrays], out)
    return out.numpy()


def _matmul(m, k, n, batch=2):
    a = te.placeholder((i64(batch), m, k), "float32", name="a")
    b = te.placeholder((i64(batch), k, n), "float32", name="b")
    r = te.reduce_axis((i64(0), k), name="k")
    c = te.compute((i64(batch), m, n), lambda bb, i, j: te.sum(a[bb, i, r] * b[bb, r, j], axis=r), name="matmul")
    return te.create_prim_func([a, b, c])


def _bind(shape, n):
    return tuple(n if not isinstance(d, tirx.IntImm) else int(d.value) for d in shape)


# ---------------------------------------------------------------- CPUMatmul

def test_matmul_static_register_tile_and_parallel():
    f = _schedule(CPUMatmul(), _matmul(i64(48), i64(64), i64(128)))
    ls = loops(f)
    par = [x for x in ls if x["kind"] == PARALLEL]
    assert len(par) == 1 and ls[0] is par[0], "one parallel loop, outermost"
    assert par[0]["extent"] == 2 * (128 // (NR_VECS * LANES)) * (48 // MR)  # batch x column panels x row tiles
    vec = [x for x in ls if x["kind"] == VECTORIZED and "matmul_update" in x["blocks"]]
    assert [x["extent"] for x in vec] == [NR_VECS * LANES], "NR-wide vector along N"
    unr = [x for x in ls if x["kind"] == UNROLLED and "matmul_update" in x["blocks"]]
    assert [x["extent"] for x in unr] == [MR], "MR rows unrolled into registers"
    assert not any(PARTITION_HINT in x["annotations"] for x in ls)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 48, 64), dtype=np.float32), rng.standard_normal((2, 64, 128), dtype=np.float32)
    np.testing.assert_allclose(_run(f, [a, b], (2, 48, 128)), a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n", [5, 64, 77])
def test_matmul_symbolic_n_full_panels_vectorised_tail_guarded(n):
    """Attention scores over a symbolic seq: (seq, d) x (d, seq). Panels of NR columns are
    vectorised; the panel loop carries the LoopPartition hint that splits off the guarded tail."""
    f = _schedule(CPUMatmul(), _matmul(SEQ, i64(16), SEQ))
    ls = loops(f)
    assert ls[0]["kind"] == PARALLEL and ls[0]["extent"] is None, "parallel over batch x row tiles"
    hinted = [x for x in ls if PARTITION_HINT in x["annotations"]]
    assert len(hinted) == 1 and hinted[0]["extent"] is None and "matmul_update" in hinted[0]["blocks"]
    vec = [x for x in ls if x["kind"] == VECTORIZED and "matmul_update" in x["blocks"]]
    assert [x["extent"] for x in vec] == [NR_VECS * LANES]
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, n, 16), dtype=np.float32), rng.standard_normal((2, 16, n), dtype=np.float32)
    np.testing.assert_allclose(_run(f, [a, b], (2, n, n)), a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [5, 37])
def test_matmul_symbolic_m_row_tiles_partitioned(m):
    """Projections (seq, d_model) x (d_model, N) and P V over a symbolic seq: the column
    panels are the parallel loop; the row tiles run inside with the LoopPartition hint, so
    only the last, partial tile carries the row guard."""
    for k, n in ((i64(64), i64(128)), (SEQ, i64(16))):
        f = _schedule(CPUMatmul(), _matmul(SEQ, k, n))
        ls = loops(f)
        assert ls[0]["kind"] == PARALLEL
        hinted = [x for x in ls if PARTITION_HINT in x["annotations"]]
        assert len(hinted) == 1 and "matmul_update" in hinted[0]["blocks"] and hinted[0]["extent"] is None
        unr = [x["extent"] for x in ls if x["kind"] == UNROLLED and "matmul_update" in x["blocks"]]
        assert unr == [MR]
        kk = m if k is SEQ else 64
        rng = np.random.default_rng(2)
        a = rng.standard_normal((2, m, kk), dtype=np.float32)
        b = rng.standard_normal((2, kk, int(n.value)), dtype=np.float32)
        np.testing.assert_allclose(_run(f, [a, b], (2, m, int(n.value))), a @ b, rtol=1e-5, atol=1e-4)


def test_matmul_refuses_transposed_b():
    """B read as (j, k) is not the NN pattern the micro-kernel streams: no schedule."""
    a = te.placeholder((i64(32), i64(64)), "float32", name="a")
    b = te.placeholder((i64(128), i64(64)), "float32", name="b")
    r = te.reduce_axis((i64(0), i64(64)), name="k")
    c = te.compute((i64(32), i64(128)), lambda i, j: te.sum(a[i, r] * b[j, r], axis=r), name="matmul")
    with TARGET:
        assert CPUMatmul().apply(te.create_prim_func([a, b, c]), TARGET, False) is None


# ---------------------------------------------------------------- CPURowReduction

def _softmax(s):
    x = te.placeholder((i64(2), i64(3), s, s), "float32", name="x")
    return te.create_prim_func([x, topi.nn.fast_softmax(x, -1)])


def _np_softmax(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_softmax_static_reductions_vectorised_in_one_parallel_row_loop():
    f = _schedule(CPURowReduction(), _softmax(i64(128)))
    ls = loops(f)
    par = [x for x in ls if x["kind"] == PARALLEL]
    assert len(par) == 1 and par[0]["extent"] == 2 * 3 * 128, "one parallel loop over all rows"
    row_blocks = set(par[0]["blocks"])
    assert {"T_softmax_maxelem_rf_update", "T_softmax_expsum_rf_update", "T_fast_exp", "T_softmax_norm"} <= row_blocks
    assert "T_softmax_delta" not in row_blocks, "x - max is inlined into exp (read once)"
    for name in ("T_softmax_maxelem_rf_update", "T_softmax_expsum_rf_update", "T_fast_exp", "T_softmax_norm"):
        vec = [x["extent"] for x in ls if x["kind"] == VECTORIZED and name in x["blocks"]]
        assert vec == [LANES], f"{name}: one {LANES}-lane vector loop, got {vec}"
    # the partials' init leaves the ko loop, as a vector store of identities
    assert any(x["kind"] == VECTORIZED and x["blocks"] == ["T_softmax_maxelem_rf_init"] for x in ls)
    assert not any(PARTITION_HINT in x["annotations"] for x in ls), "no tail at 128"
    a = np.random.default_rng(3).standard_normal((2, 3, 128, 128), dtype=np.float32)
    np.testing.assert_allclose(_run(f, [a], a.shape), _np_softmax(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [5, 16, 37])
def test_softmax_symbolic_length(n):
    """A row length below, at and above one vector: full chunks vectorised, the tail
    guarded and partitioned off; a row shorter than a vector still initialises every lane."""
    f = _schedule(CPURowReduction(), _softmax(SEQ))
    ls = loops(f)
    assert [x["kind"] for x in ls].count(PARALLEL) == 1
    hinted = [x for x in ls if PARTITION_HINT in x["annotations"]]
    assert {b for x in hinted for b in x["blocks"]} >= {"T_softmax_maxelem_rf_update", "T_fast_exp",
                                                        "T_softmax_expsum_rf_update", "T_softmax_norm"}
    assert any(x["kind"] == VECTORIZED and x["blocks"] == ["T_softmax_expsum_rf_init"] for x in ls)
    a = np.random.default_rng(4).standard_normal((2, 3, n, n), dtype=np.float32)
    np.testing.assert_allclose(_run(f, [a], a.shape), _np_softmax(a), rtol=1e-5, atol=1e-6)


def test_softmax_static_ragged_row():
    f = _schedule(CPURowReduction(), _softmax(i64(37)))
    a = np.random.default_rng(5).standard_normal((2, 3, 37, 37), dtype=np.float32)
    np.testing.assert_allclose(_run(f, [a], a.shape), _np_softmax(a), rtol=1e-5, atol=1e-6)


def test_layer_norm_symbolic_rows():
    x = te.placeholder((i64(2), SEQ, i64(64)), "float32", name="x")
    g = te.placeholder((i64(64),), "float32", name="g")
    b = te.placeholder((i64(64),), "float32", name="b")
    f = _schedule(CPURowReduction(), te.create_prim_func([x, g, b, topi.nn.layer_norm(x, g, b, axis=[-1], epsilon=1e-5)]))
    ls = loops(f)
    assert [x["kind"] for x in ls].count(PARALLEL) == 1
    assert any(x["kind"] == VECTORIZED and "T_layer_norm" in x["blocks"] for x in ls)
    rng = np.random.default_rng(6)
    a, gg, bb = (rng.standard_normal(s, dtype=np.float32) for s in ((2, 11, 64), (64,), (64,)))
    want = (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5) * gg + bb
    np.testing.assert_allclose(_run(f, [a, gg, bb], a.shape), want, rtol=1e-4, atol=1e-5)


def test_instance_norm_keepdims_reductions_in_one_vectorised_row_loop():
    """TVM's InstanceNormalization import (Wav2Vec2's GroupNorm of 512 groups): mean and
    variance reduce to (N, C, 1), a unit axis between the rows and the reduced one. Refused
    before, it fell to the default schedule: scalar reductions."""
    n, c, t = i64(1), i64(8), i64(101)
    x = te.placeholder((n, c, t), "float32", name="x")
    g = te.placeholder((c, i64(1)), "float32", name="g")
    mean = topi.divide(topi.sum(x, axis=[2], keepdims=True), 101.0)
    d = topi.subtract(x, mean)
    var = topi.divide(topi.sum(topi.multiply(d, d), axis=[2], keepdims=True), 101.0)
    y = topi.multiply(topi.divide(topi.subtract(x, mean), topi.sqrt(topi.add(var, 1e-5))), g)
    f = _schedule(CPURowReduction(), te.create_prim_func([x, g, y]))
    ls = loops(f)
    par = [x for x in ls if x["kind"] == PARALLEL]
    assert len(par) == 1 and par[0]["extent"] == 8, "one parallel loop over the channels"
    reds = [b for b in par[0]["blocks"] if b.endswith("_rf") or b.endswith("_rf_update")]
    assert len(reds) == 2, par[0]["blocks"]
    for name in reds:
        assert [x["extent"] for x in ls if x["kind"] == VECTORIZED and name in x["blocks"]] == [LANES], name
    rng = np.random.default_rng(7)
    a, gg = rng.standard_normal((1, 8, 101), dtype=np.float32) + 3, rng.standard_normal((8, 1), dtype=np.float32)
    want = (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5) * gg
    np.testing.assert_allclose(_run(f, [a, gg], a.shape), want, rtol=1e-4, atol=1e-5)


def test_rms_norm_keepdims_mean_is_a_row_kernel():
    """RMSNorm as torch exports it (ReduceMean keepdims over the last axis: Llama, T5):
    the same unit axis, the same row kernel."""
    x = te.placeholder((i64(1), i64(12), i64(40)), "float32", name="x")
    ms = topi.divide(topi.sum(topi.multiply(x, x), axis=[2], keepdims=True), 40.0)
    y = topi.divide(x, topi.sqrt(topi.add(ms, 1e-6)))
    f = _schedule(CPURowReduction(), te.create_prim_func([x, y]))
    par = [x for x in loops(f) if x["kind"] == PARALLEL]
    assert len(par) == 1 and par[0]["extent"] == 12
    a = np.random.default_rng(8).standard_normal((1, 12, 40), dtype=np.float32)
    np.testing.assert_allclose(_run(f, [a], a.shape), a / np.sqrt((a * a).mean(-1, keepdims=True) + 1e-6),
                               rtol=1e-5, atol=1e-6)


def test_row_reduction_refuses_a_block_reading_another_row():
    """Blocks fused into one row loop must only read their own row of each other's output."""
    x = te.placeholder((i64(8), i64(32)), "float32", name="x")
    r = te.reduce_axis((i64(0), i64(32)), name="k")
    s = te.compute((i64(8),), lambda i: te.sum(x[i, r], axis=r), name="s")
    y = te.compute((i64(8), i64(32)), lambda i, j: x[i, j] - s[(i + 1) % 8], name="y")
    with TARGET:
        assert CPURowReduction().apply(te.create_prim_func([x, y]), TARGET, False) is None


# ---------------------------------------------------------------- the fused attention kernel

def _spec(**kw):
    base = dict(dtype="float32", q="bshd", k="bhds", v="bshd", o="bshd", heads=2, d=64, dv=64, scale=0.125)
    return attention.AttentionSpec(**{**base, **kw})


@pytest.mark.parametrize("tiles", [(64, 4), (48, 8)])
def test_attention_kernel_structure(tiles):
    qt, kt = tiles[0], tiles[1] * LANES
    tiles = (qt, kt)
    f = attention.kernel(_spec(), tiles, LANES)
    ls = loops(f)
    assert ls[0]["kind"] == PARALLEL and ls[0]["extent"] is None, "(batch, head, query tile) in parallel"
    assert [x["kind"] for x in ls].count(PARALLEL) == 1
    vec = sorted({x["extent"] for x in ls if x["kind"] == VECTORIZED})
    # the key tile's scores in whole vectors: kt // LANES unrolled vector pieces, never one
    # kt-wide vector (LLVM rebuilt such a vector lane by lane for 16-lane reads: whisper, 0.89x)
    assert vec == sorted({64, LANES}), f"vectors along d_v and lanes only: {vec}"
    mr_s, mr_o = micro_rows(qt, kt // LANES, LANES), micro_rows(qt, 64 // LANES, LANES)
    unrolled = {x["extent"] for x in ls if x["kind"] == UNROLLED}
    assert {mr_s, mr_o, kt // LANES} <= unrolled, f"micro-kernel rows and key-tile vectors unrolled: {unrolled}"
    regs = attention.acc_regs(LANES)
    assert mr_s * (kt // LANES) <= regs and mr_o * (64 // LANES) <= regs
    assert qt % mr_s == 0 and qt % mr_o == 0
    assert f.attrs[attention.KERNEL_ATTR + ".tiles"] == f"{qt}x{kt}"
    assert attention.AttentionSpec.from_json(str(f.attrs[attention.KERNEL_ATTR])) == _spec()


def test_attention_kernel_static_exact_tiles_have_no_tail():
    """Static lengths that the tiles divide: no guard, no tail tile, no row clamp."""
    f = attention.kernel(_spec(batch=1, sq=128, skv=128), (64, 4 * LANES), LANES)
    text = f.script()
    assert "if " not in text and "T.int64(127)" not in text  # 127: the clamped last row/key index
    # The control: a query tile the length does not divide (balance=False keeps 64 at 100
    # rows; balanced, 100 runs as 2 x 50) clamps its last rows and runs a tail tile.
    g = attention.kernel(_spec(batch=1, sq=100, skv=100), (64, 4 * LANES), LANES, balance=False).script()
    assert "T.int64(99)" in g and "if " in g, "ragged static lengths: clamped rows, a tail tile"


def test_fast_exp_matches_numpy():
    x = te.placeholder((i64(1024),), "float32", name="x")
    y = te.compute(x.shape, lambda i: attention.fast_exp(x[i]), name="y")
    f = te.create_prim_func([x, y])
    a = np.concatenate([np.linspace(-100, 80, 1020, dtype=np.float32),
                        np.array([-np.inf, -88.5, 0.0, 1e-3], np.float32)])
    got = _run(f, [a], a.shape)
    want = np.exp(a.astype(np.float64))
    assert got[1020] == 0.0, "exp(-inf) is exactly 0 (a masked score adds nothing)"
    np.testing.assert_allclose(got, want, rtol=2e-7 * 8, atol=1e-37)


@pytest.mark.parametrize("nonpositive", [False, True])
def test_fast_exp_keeps_nan(nonpositive):
    """NaN in, NaN out: the clamps put x second in max/min (TVM's max(a, b) is
    select(a > b, a, b), b on NaN), so a NaN score (or inf - inf, a row with an Inf score
    minus its max) is not turned into exp(-88.38) ~ 0 as it was."""
    x = te.placeholder((i64(16),), "float32", name="x")
    y = te.compute(x.shape, lambda i: attention.fast_exp(x[i], nonpositive=nonpositive), name="y")
    a = np.full(16, np.nan, np.float32)
    a[::2] = -1.0
    got = _run(te.create_prim_func([x, y]), [a], a.shape)
    assert np.isnan(got[1::2]).all() and np.allclose(got[::2], np.exp(-1.0)), got
