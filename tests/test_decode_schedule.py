"""Schedules at the decode shape (one query row after P cached keys), at the IR level on a
fixed vector width, as tests/test_schedule_ir.py does."""

from __future__ import annotations

from blockforge.compile import attention


def _spec(sq: int, skv: int = 129) -> attention.AttentionSpec:
    return attention.AttentionSpec(dtype="float32", q="bhsd", k="bhds", v="bhsd", o="bshd", heads=12, d=64, dv=64,
                                   scale=0.125, batch=1, sq=sq, skv=skv, add=("b", "1", "q", "k"))


def test_decode_step_attention_tile_is_the_query_rows():
    """At Sq = 1 the kernel's query tile is one row, not the default 64 (which computed 64
    rows, clamped, for the one stored: 64x the Q K^T and P V work per head); a chunk of 5
    gets 5; a prompt longer than a tile keeps the default."""
    for sq, want in ((1, 1), (5, 5), (128, 64)):
        func = attention.kernel(_spec(sq), lanes=16)
        assert str(func.attrs[attention.KERNEL_ATTR + ".tiles"]) == f"{want}x64", sq
    # an explicit (tuned) tile is clamped too
    assert str(attention.kernel(_spec(1), tiles=(32, 128), lanes=16).attrs[attention.KERNEL_ATTR + ".tiles"]) == "1x128"
