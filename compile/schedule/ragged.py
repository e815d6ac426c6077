"""CPUMatmulRaggedN: matmuls whose N no panel width divides (ViT's 197 tokens)."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.schedule.base import CPURule, MR, block_alive, const_int, schedule_elementwise, single_reduction, vector_lanes
from blockforge.compile.schedule.matmul import collapse_epilogue, fold_into_writeback, inline_producers, is_nn_matmul, packed_panel_width


class CPUMatmulRaggedN(CPURule):
    """Matmuls CPUMatmul leaves alone because N is no multiple of the vector width: ViT's
    197 tokens make the attention scores (B, h, 197, 64) x (B, h, 64, 197), which TVM's
    default lowering runs as scalar dot products reading B with a stride of N. Measured
    (1, 12, 197, 64) x (1, 12, 64, 197) * 0.125, 2 threads, shared machine, interleaved:
    56.7 ms default lowering, 4.0 ms with this rule (benchmarks/ragged_matmul.py).

    Rows are tiled by MR and parallel; for each k the MR rows of the accumulator (MR x N,
    in L1) are updated along j, contiguous in B and C: an innermost unit-stride loop that
    LLVM's loop vectorizer turns into vectors plus a scalar tail (TVM's own vectorize needs
    a lanes-divisible extent).
    """

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        mm, blocks = single_reduction(sch)
        if mm is None:
            return None
        ok, n = is_nn_matmul(sch.get(mm))
        lanes = vector_lanes(target)
        if not ok or n is None or n % lanes == 0 or n < lanes or packed_panel_width(sch.get(mm)):
            return None  # CPUMatmul's (or nobody's) case
        idx = inline_producers(sch, blocks, mm, "CPUMatmulRaggedN", func)
        if idx is None:
            return None
        epilogue = list(blocks[idx + 1:])
        collapse_epilogue(sch, epilogue, "CPUMatmulRaggedN", func)
        *batch, i, j, k = sch.get_loops(mm)
        iext = const_int(sch.get(i).extent)
        mr = next((m for m in (MR, 4, 2) if iext is not None and iext % m == 0), 1)
        io, ii = sch.split(i, [None, mr])
        acc = sch.cache_write(mm, 0, "local")  # (MR, N) rows: ~5 KiB at N=197, in L1
        fold_into_writeback(sch, epilogue, "CPUMatmulRaggedN", func)
        sch.reorder(*batch, io, k, ii, j)
        sch.reverse_compute_at(acc, io, preserve_unit_loops=True)
        for b in blocks[idx + 1:]:
            if block_alive(sch, b):
                schedule_elementwise(sch, b, lanes)
        outer = sch.fuse(*batch, io) if batch else io
        sch.parallel(outer)
        sch.unroll(ii)
        sch.decompose_reduction(mm, k)
        return sch
