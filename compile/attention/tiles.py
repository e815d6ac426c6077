"""The tile choice as MetaSchedule sees it (compile/records/choice.py): workloads, trace
encoding (qt * 10000 + kt), records. The float32 kernel and the bf16 one (`--precision bf16`:
Q K^T and P V on VDPBF16PS) are different workloads with their own candidates and defaults."""

from __future__ import annotations

from blockforge.compile.attention.flash import (AttentionSpec, bf16_tile_candidates, bf16_tiles, default_tiles, kernel,
                                                tile_candidates)
from blockforge.compile.records.choice import choice_from_trace, choice_trace, recorded_choice


def defaults(spec: AttentionSpec, lanes: int, bf16: bool = False) -> tuple[int, int] | None:
    """The untuned tiles of the float32 kernel, or of the bf16 one (None: it has none, and the
    phase builds the float32 kernel)."""
    return bf16_tiles(lanes, spec.skv) if bf16 else default_tiles(lanes)


def candidates(spec: AttentionSpec, lanes: int, bf16: bool = False) -> tuple[tuple[int, int], ...]:
    """What tune times for a spec (the default first)."""
    return bf16_tile_candidates(lanes, spec.skv) if bf16 else tile_candidates(lanes)


def workload(spec: AttentionSpec, lanes: int, bf16: bool = False):
    """The tuning workload of a spec: its kernel at the default tiles, as MetaSchedule keys it."""
    import tvm

    return tvm.IRModule({"main": kernel(spec, defaults(spec, lanes, bf16), lanes, bf16=bf16)})


def encode_tiles(tiles: tuple[int, int]) -> int:
    return tiles[0] * 10000 + tiles[1]


def decode_tiles(code: int) -> tuple[int, int]:
    return int(code) // 10000, int(code) % 10000


def tile_trace(spec: AttentionSpec, lanes: int, tiles: tuple[int, int], among=None, bf16: bool = False):
    """A MetaSchedule trace whose one decision is the tile choice among `among` (None: the
    spec's candidates): how a tile choice is stored as a tuning record."""
    codes = [encode_tiles(t) for t in (among or candidates(spec, lanes, bf16))]
    return choice_trace(workload(spec, lanes, bf16), codes, encode_tiles(tiles))


def tiles_from_trace(trace) -> tuple[int, int] | None:
    code = choice_from_trace(trace)
    return None if code is None else decode_tiles(code)


def tile_record(database, spec: AttentionSpec, target, bf16: bool = False) -> tuple[int, int] | None:
    """The tuned tiles for `spec` on `target` from a MetaSchedule database, or None."""
    from blockforge.compile.schedule.base import vector_lanes

    if database is None:
        return None
    lanes = vector_lanes(target)
    return recorded_choice(database, workload(spec, lanes, bf16), target, decode_tiles, candidates(spec, lanes, bf16))
