"""The fused attention kernel's last key tile at a static key length no key tile divides:
only the remainder's whole vectors wide (ViT's 197 = 3 x 64 + 5: a 16-key tile), where it was
a whole 64-key tile ending at Skv with 59 of its keys dropped (their scores and exps computed
all the same). Measured, 12 heads, d 64, one thread CPU time: 2.06 -> 1.85 ms
(benchmarks/attention_qtile.py --ab-key-tail)."""

from __future__ import annotations

import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from blockforge.compile import attention  # noqa: E402
from blockforge.compile.attention.flash import tail_width  # noqa: E402
from test_attention_fusion import LANES, _padding, _run_kernel, _spec, pipeline_kernel_script  # noqa: E402


@pytest.mark.parametrize("skv, kt, want", [(197, 64, 16), (150, 64, 32), (129, 64, 16), (191, 64, 64),
                                           (1500, 64, 32), (70, 32, 16), (200, 128, 80)])
def test_tail_width(skv, kt, want):
    assert tail_width(skv, kt, 16) == want


def _register_tiles(text: str) -> set[tuple[int, int]]:
    """The micro-kernels' register tiles (rows x width: Q K^T's keys, P V's d) in a kernel's
    script, told from the query-tile buffers by their rows (at most acc_regs)."""
    tiles = {(int(a), int(b)) for a, b in re.findall(r"T\.alloc_local\(\((\d+), (\d+)\)\)", text)}
    return {t for t in tiles if t[0] <= attention.acc_regs(LANES)}


def test_vit_tail_tile_is_one_vector_wide():
    """197 keys: 3 tiles of 64 and one of 16 (5-row micro-kernels of the balanced 50-row
    query tile); key_tail=False: the whole 64-key tail, as before."""
    spec = _spec(sq=197, skv=197, heads=12, d=64, dv=64, q="bhsd", v="bhsd", o="bhsd", k="bhds")
    assert _register_tiles(attention.kernel(spec, (64, 4 * LANES), LANES).script()) == {(5, 4 * LANES), (5, LANES)}
    assert _register_tiles(attention.kernel(spec, (64, 4 * LANES), LANES, key_tail=False).script()) == {(5, 4 * LANES)}


@pytest.mark.parametrize("sq, skv, kw", [
    (197, 197, {}),
    (150, 150, dict(causal=True, fill=0.0)),
    (130, 129, dict(add=("b", "1", "1", "k"))),
    (40, 150, dict(keep=("b", "1", "1", "k"), fill=-1e4)),
    (150, 150, dict(causal=True, keep=("b", "1", "1", "k"), fill=float(np.finfo(np.float32).min), same_len=True)),
    (33, 129, dict(inf_rows_zero=True, add=("b", "1", "1", "k"))),
])
def test_static_ragged_keys_match_numpy(sq, skv, kw):
    """Static Sq/Skv, each mask form, the narrow tail after full tiles; batch 1 of the padding
    mask drops every key (the causal + padding row then spreads over all keys)."""
    rng = lambda r, shape: r.standard_normal(shape)  # noqa: E731
    got, want = _run_kernel(_spec(sq=sq, skv=skv, batch=2, **kw), (64, 4 * LANES), 2, sq, skv,
                            add_fn=rng, keep_fn=_padding)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_inf_rows_zero_kernel_zeroes_only_all_minus_inf_rows():
    """-inf on every key of batch 1: 0 there (torch's _safe_softmax); finite elsewhere."""
    def add(r, shape):
        a = r.standard_normal(shape)
        a[1] = -np.inf
        return a
    got, want = _run_kernel(_spec(sq=70, skv=197, batch=2, add=("b", "1", "1", "k"), inf_rows_zero=True),
                            (64, 4 * LANES), 2, 70, 197, add_fn=add)
    assert (got[1] == 0).all() and np.isnan(want[1]).all()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-5)


def test_pipeline_ablation_reaches_the_kernel():
    """`--without attention-key-tail` (benchmarks/whole_ab.py --ab) builds the whole-tail kernel
    (d 32, so P V's register tiles are not one vector wide too)."""
    widths = {}
    for without in (set(), {"attention-key-tail"}):
        widths[bool(without)] = {w for _, w in _register_tiles(pipeline_kernel_script(197, 32, without))}
    assert LANES in widths[False] and LANES not in widths[True], widths
