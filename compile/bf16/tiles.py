"""The bf16 GEMM's tile choice as MetaSchedule records it (compile/records/choice.py), as the
int8 GEMM's (compile/quant/tiles.py): the workload is the kernel at its default tiles (with the
write-back the bf16-gemm phase builds), a record's decision one of the tile candidates
(GemmTiles.code). tune times them (tune/gemm_tiles.py); the bf16-gemm phase takes the best
record's tiles, only if they are one of the candidates tune would time for that spec."""

from __future__ import annotations

from blockforge.compile.bf16.gemm import Bf16GemmSpec, GemmTiles, kernel, tile_candidates
from blockforge.compile.quant.tiles import tiles_from_trace  # noqa: F401  (the same codes: GemmTiles)
from blockforge.compile.records.choice import choice_trace, recorded_choice


def workload(spec: Bf16GemmSpec, gelu_segments: bool = True):
    """The tuning workload of a spec: its kernel at the default tiles, as MetaSchedule keys it."""
    import tvm

    return tvm.IRModule({"main": kernel(spec, gelu_segments)})


def tile_trace(spec: Bf16GemmSpec, tiles: GemmTiles, candidates=None, gelu_segments: bool = True):
    """A MetaSchedule trace whose one decision is `tiles` among the candidates."""
    codes = [t.code() for t in (candidates or tile_candidates(spec))]
    return choice_trace(workload(spec, gelu_segments), codes, tiles.code())


def tile_record(database, spec: Bf16GemmSpec, target, gelu_segments: bool = True) -> GemmTiles | None:
    """The tuned tiles for `spec` on `target` from a MetaSchedule database, or None."""
    if database is None:
        return None
    return recorded_choice(database, workload(spec, gelu_segments), target, GemmTiles.from_code,
                           tile_candidates(spec))
