"""The fused attention kernel's query tile at a static Sq no tile divides (compile/attention/
flash.py query_tile): tiles balanced so the last is not mostly clamped rows (ViT's 197 tokens in
tiles of 64 computed 256 rows; in 4 of 50, 200), at the IR level on a fixed vector width."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
import tvm_ffi  # noqa: E402
from tvm import tirx  # noqa: E402

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.attention.flash import query_tile  # noqa: E402

AVX512 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2})


def _spec(sq: int, heads: int = 12) -> attention.AttentionSpec:
    return attention.AttentionSpec(dtype="float32", q="bhsd", k="bhds", v="bhsd", o="bhsd", heads=heads, d=64, dv=64,
                                   scale=0.125, batch=1, sq=sq, skv=sq)


@pytest.mark.parametrize("sq, want", [(197, 50), (128, 64), (1500, 60), (130, 44), (49, 50), (50, 50), (13, 15),
                                      (7, 8), (5, 5), (4, 4), (1, 1), (300, 60)])
def test_query_tile(sq, want):
    """197 -> 4 tiles of 50; Whisper's 1500 -> 25 tiles of 60 (24 of 64 compute 1536 rows, 24 of
    63 would run 3-row micro-kernels); 130 -> 3 of 44 (4 of 35 compute more rows); an Sq below
    one tile by the same rule: Wav2Vec2's 49 -> 50 (5-row micro-kernels, not 1-row ones),
    13 -> 15, 7 -> 8; an Sq with such a divisor (5, 4, a decode step's 1) stays as it is."""
    assert query_tile(64, sq, (64, 64), 16) == want
    assert str(attention.kernel(_spec(sq), lanes=16).attrs[attention.KERNEL_ATTR + ".tiles"]) == f"{want}x64"


@pytest.mark.parametrize("sq", [49, 13, 7, 5, 1])
def test_short_tile_ablation_keeps_sq_rows(sq):
    """attention-short-tile left out: an Sq below one tile is its own tile (the old rule)."""
    assert query_tile(64, sq, (64, 64), 16, short=False) == sq
    fn = attention.kernel(_spec(sq), lanes=16, short_tile=False)
    assert str(fn.attrs[attention.KERNEL_ATTR + ".tiles"]) == f"{sq}x64"


def _unrolled_extents(fn) -> set[int]:
    loops = []
    tvm_ffi.structural_walk(fn.body, [(tirx.For, loops.append)], order="pre")
    return {int(lp.extent) for lp in loops if lp.kind == tirx.ForKind.UNROLLED and isinstance(lp.extent, tirx.IntImm)}


def test_wav2vec2_rows_run_five_row_micro_kernels():
    """49 rows (Wav2Vec2-base's 1 s of audio): 5-row micro-kernels over a 50-row tile; with the
    ablation left out only 1-row ones (49 has no divisor from 2 to 6)."""
    assert 5 in _unrolled_extents(attention.kernel(_spec(49), lanes=16))
    old = _unrolled_extents(attention.kernel(_spec(49), lanes=16, short_tile=False))
    assert 1 in old and 5 not in old, old  # (4: a row's 4 vectors)


def test_vit_tokens_run_four_balanced_query_tiles():
    f = attention.kernel(_spec(197), lanes=16)
    loops = []
    tvm_ffi.structural_walk(f.body, [(tirx.For, loops.append)], order="pre")
    par = [lp for lp in loops if lp.kind == tirx.ForKind.PARALLEL]
    assert len(par) == 1 and int(par[0].extent) == 12 * 4, "(head, query tile): 48 tasks, 24 per core"
    unrolled = _unrolled_extents(f)
    assert 5 in unrolled, f"5-row micro-kernels (50 = 10 x 5): {unrolled}"
    # an explicit (tuned) tile is balanced as well
    assert str(attention.kernel(_spec(197), tiles=(64, 64), lanes=16).attrs[attention.KERNEL_ATTR + ".tiles"]) == "50x64"


@pytest.mark.parametrize("sq", [197, 49, 13])
def test_balanced_tile_numbers(sq):
    """Sq = 197 in tiles of 50, 49 in one of 50, 13 in one of 15: the clamped rows of the last
    tile are never stored (the output starts as NaN)."""
    spec = _spec(sq, heads=2)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, sq, 64)).astype("float32") for _ in range(3))
    s = q @ k.transpose(0, 1, 3, 2) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    from blockforge.compile.schedule.base import vector_lanes
    from blockforge.targets import resolve

    tgt = resolve("host").tvm_target()
    f = tvm.compile(tvm.IRModule({"main": attention.kernel(spec, lanes=vector_lanes(tgt))}), target=tgt)["main"]
    out = tvm.runtime.tensor(np.full_like(q, np.nan))
    f(*[tvm.runtime.tensor(x) for x in (q, k.transpose(0, 1, 3, 2).copy(), v)], out)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("without, want", [(frozenset(), "50x64"), (frozenset({"attention-qtile"}), "64x64")])
def test_pipeline_balances_unless_the_ablation(tmp_path, without, want):
    """The fuse-attention phase emits the balanced tile at seq 197; the ablation the default."""
    import onnx

    from blockforge.compile.pipeline import run_phases
    from blockforge.compile.session import open_model
    from blockforge.graph import MHASpec, export
    from blockforge.targets import resolve

    host = resolve("host")
    if host.tvm_target().kind.name != "llvm" or vector_lanes_of(host) != 16:
        pytest.skip("the expected tiles are AVX-512's")
    path = tmp_path / "m.onnx"
    export(MHASpec(d_model=64, heads=4), path)
    session = open_model(path, host, {"batch": 1, "seq": 197})
    mod, _ = run_phases(session.relax(), host, stop_after="fuse-attention", without=without)
    tiles = {str(f.attrs[attention.KERNEL_ATTR + ".tiles"]) for _, f in mod.functions_items()
             if isinstance(f, tirx.PrimFunc) and attention.is_kernel(f)}
    assert tiles == {want}


def vector_lanes_of(target) -> int:
    from blockforge.compile.schedule.base import vector_lanes

    return vector_lanes(target.tvm_target())
