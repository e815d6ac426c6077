"""The tile choice as MetaSchedule sees it: workloads, trace encoding, records."""

from __future__ import annotations

from blockforge.compile.attention.flash import AttentionSpec, default_tiles, kernel, tile_candidates


def workload(spec: AttentionSpec, lanes: int):
    """The tuning workload of a spec: its kernel at the default tiles, as MetaSchedule keys it."""
    import tvm

    return tvm.IRModule({"main": kernel(spec, default_tiles(lanes), lanes)})


def encode_tiles(tiles: tuple[int, int]) -> int:
    return tiles[0] * 10000 + tiles[1]


def decode_tiles(code: int) -> tuple[int, int]:
    return int(code) // 10000, int(code) % 10000


def tile_trace(spec: AttentionSpec, lanes: int, tiles: tuple[int, int], candidates=None):
    """A MetaSchedule trace whose one decision is the tile choice (a categorical over the
    candidates, encoded qt*10000+kt): how a tile choice is stored as a tuning record."""
    from tvm import s_tir

    codes = [encode_tiles(t) for t in (candidates or tile_candidates(lanes))]
    sch = s_tir.Schedule(workload(spec, lanes))
    sch.sample_categorical(candidates=codes, probs=[1.0 / len(codes)] * len(codes),
                           decision=codes.index(encode_tiles(tiles)))
    return sch.trace


def tiles_from_trace(trace) -> tuple[int, int] | None:
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            d = trace.decisions.get(inst)
            if d is not None:
                return decode_tiles(int(inst.attrs[0][int(d)]))
    return None


def tile_record(database, spec: AttentionSpec, target) -> tuple[int, int] | None:
    """The tuned tiles for `spec` on `target` from a MetaSchedule database, or None."""
    from blockforge.compile.schedule.base import vector_lanes

    if database is None:
        return None
    mod = workload(spec, vector_lanes(target))
    if not database.has_workload(mod):
        return None
    rec = database.query_tuning_record(mod, target, "main")
    tiles = tiles_from_trace(rec.trace) if rec is not None else None
    # a database (untrusted input) picks among the tiles tune times, nothing else
    return tiles if tiles in tile_candidates(vector_lanes(target)) else None
