"""The int8 GEMM's tile choice as MetaSchedule records it (as compile/attention/tiles.py does
for the fused attention): the workload is the kernel at its default tiles, a record's trace
holds one decision, a SampleCategorical over the tile candidates encoded as integers.

tune times the candidates (tune/int8_tiles.py); the int8-gemm phase takes the best record's
tiles (tile_record). A database is untrusted input: a decoded choice is used only if it is
one of the candidates tune would time for that spec.
"""

from __future__ import annotations

from blockforge.compile.quant.gemm import SPLITS, Int8GemmSpec, Int8Tiles, kernel, tile_candidates


def workload(spec: Int8GemmSpec):
    """The tuning workload of a spec: its kernel at the default tiles, as MetaSchedule keys it."""
    import tvm

    return tvm.IRModule({"main": kernel(spec)})


def encode(tiles: Int8Tiles) -> int:
    return tiles.mr * 100 + tiles.nv * 10 + SPLITS.index(tiles.split)


def decode(code: int) -> Int8Tiles | None:
    code = int(code)
    mr, nv, split = code // 100, code // 10 % 10, code % 10
    try:
        return Int8Tiles(mr, nv, SPLITS[split]) if 0 <= code and split < len(SPLITS) else None
    except ValueError:  # out of the registers, or nonsense: not a choice anyone recorded
        return None


def tile_trace(spec: Int8GemmSpec, tiles: Int8Tiles, candidates=None):
    """A MetaSchedule trace whose one decision is `tiles` among the candidates."""
    from tvm import s_tir

    codes = [encode(t) for t in (candidates or tile_candidates(spec))]
    sch = s_tir.Schedule(workload(spec))
    sch.sample_categorical(candidates=codes, probs=[1.0 / len(codes)] * len(codes), decision=codes.index(encode(tiles)))
    return sch.trace


def tiles_from_trace(trace) -> Int8Tiles | None:
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            d = trace.decisions.get(inst)
            codes = list(inst.attrs[0])
            if d is not None and 0 <= int(d) < len(codes):
                return decode(int(codes[int(d)]))
    return None


def tile_record(database, spec: Int8GemmSpec, target) -> Int8Tiles | None:
    """The tuned tiles for `spec` on `target` from a MetaSchedule database, or None."""
    if database is None:
        return None
    mod = workload(spec)
    if not database.has_workload(mod):
        return None
    rec = database.query_tuning_record(mod, target, "main")
    tiles = tiles_from_trace(rec.trace) if rec is not None else None
    # a database (untrusted input) picks among the tiles tune times for this spec, nothing else
    return tiles if tiles in tile_candidates(spec) else None
