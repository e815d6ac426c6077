"""The int8 GEMM's tile choice as MetaSchedule records it (compile/records/choice.py): the
workload is the kernel at its default tiles, a record's decision one of the tile candidates
encoded as an integer (GemmTiles.code).

tune times the candidates (tune/gemm_tiles.py); the int8-gemm phase takes the best record's
tiles (tile_record), only if they are one of the candidates tune would time for that spec.
"""

from __future__ import annotations

from blockforge.compile.quant.gemm import GemmTiles, Int8GemmSpec, kernel, tile_candidates
from blockforge.compile.records.choice import choice_from_trace, choice_trace, recorded_choice


def workload(spec: Int8GemmSpec):
    """The tuning workload of a spec: its kernel at the default tiles, as MetaSchedule keys it."""
    import tvm

    return tvm.IRModule({"main": kernel(spec)})


def tile_trace(spec: Int8GemmSpec, tiles: GemmTiles, candidates=None):
    """A MetaSchedule trace whose one decision is `tiles` among the candidates."""
    codes = [t.code() for t in (candidates or tile_candidates(spec))]
    return choice_trace(workload(spec), codes, tiles.code())


def tiles_from_trace(trace) -> GemmTiles | None:
    code = choice_from_trace(trace)
    return None if code is None else GemmTiles.from_code(code)


def tile_record(database, spec: Int8GemmSpec, target) -> GemmTiles | None:
    """The tuned tiles for `spec` on `target` from a MetaSchedule database, or None."""
    if database is None:
        return None
    return recorded_choice(database, workload(spec), target, GemmTiles.from_code, tile_candidates(spec))
