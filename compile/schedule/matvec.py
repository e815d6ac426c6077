"""CPUMatvec: the prepacked matmul at decode shapes (M <= MATVEC_ROWS rows in all).

A decode step's matmuls are matrix-vector products: every weight byte is read once and used
M times, so the kernel is bound by the read bandwidth, not by FMAs. CPUMatmul's 6-row
micro-tile is guarded down to M rows, and its row-tile loop sits outside the panels; here the
M rows are the innermost unrolled loop of one panel's K stream: each (K, 64) panel is read
once, contiguously, into M rows of NR_VECS vector accumulators (independent FMA chains; a
narrower target takes the panel in column strips of NR_VECS vectors), the bias/activation
epilogue folded into the write-back.

Threads: the panels are split over the cores, as CPUMatmul does. Measured (benchmarks/matvec.py,
weights rotated past the L3 so that they come from DRAM, as in a decode step): one thread reads
about as fast as two on this 2-vCPU VM, but a one-thread build of the whole GPT-2 decode step was
1.35x slower than the two-thread one at load 13.6: on a shared machine each runnable thread gets
its own share of the cores, so the second thread wins CPU time even where DRAM is not the limit.
`parallel=False` (one thread) stays for that A/B.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.schedule.base import CPURule, NR_VECS, block_alive, panel_group, const_int, log_skip, schedule_elementwise, single_reduction, target_cores, vector_lanes, vectorize_inner
from blockforge.compile.schedule.matmul import collapse_epilogue, fold_into_writeback, inline_producers, is_crop, packed_panel_width

MATVEC_ROWS = 4  # rows (batch x M) up to which a packed matmul is a matvec


def matvec_rows(sch, mm) -> int | None:
    """Static rows (the product of the batch and M extents) of a packed matmul block."""
    ivs = sch.get(mm).iter_vars
    exts = [const_int(iv.dom.extent) for iv in ivs[:-2]]
    return None if any(e is None for e in exts) else math.prod(exts)


class CPUMatvec(CPURule):
    """A packed matmul with at most MATVEC_ROWS static rows: panels outside, one panel's K
    stream inside it, the rows unrolled innermost but for the panel's vectorised 64 columns.
    parallel=False: one thread (the A/B in benchmarks/matvec.py)."""

    def __init__(self, parallel: bool = True):
        super().__init__()
        self.parallel = parallel

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        mm, blocks = single_reduction(sch)
        if mm is None:
            return None
        nr = packed_panel_width(sch.get(mm))
        # prepack's weights (N/NR, K, NR) only: conv-gemm's packed im2col operand carries batch
        # and group axes, whose extents are not rows
        if nr and len(sch.get(mm).reads[1].source.shape) != 3:
            return None
        rows = matvec_rows(sch, mm) if nr else None
        if rows is None or rows > MATVEC_ROWS:
            return None  # CPUMatmul's case
        lanes = vector_lanes(target)
        if nr % lanes:
            log_skip("CPUMatvec", func, f"panel width {nr} is not whole vectors of {lanes}")
            return None
        idx = inline_producers(sch, blocks, mm, "CPUMatvec", func)
        if idx is None:
            return None
        *rowloops, j, k = sch.get_loops(mm)
        # NR_VECS vector chains per row: a 64-wide panel is 4 zmm, but 8 ymm (AVX2) or 16 q (NEON)
        # registers per row, so narrower targets take the panel in column strips (rows x
        # NR_VECS registers each), every strip of it still read once. A panel narrower than
        # that (AVX2's 2 ymm: schedule.base.nr_vecs) is read beside the next ones, so each row
        # keeps NR_VECS chains: one 2-vector panel at a time ran 1 x 768 x 3072 in 0.157 ms
        # against 0.111 with the 4-vector panels before (x86-64-avx2 build, Zen 5).
        wide = NR_VECS * lanes
        group = panel_group(nr, const_int(sch.get(j).extent), lanes)
        cols = wide if nr % wide == 0 else nr  # strips tile the panel exactly
        if group > 1:
            jo, js, ji = sch.split(j, [None, group, nr])  # js: the panels read together
            sch.reorder(jo, k, js, *rowloops, ji)
            sch.unroll(js)
        else:
            jo, js, ji = sch.split(j, [None, nr // cols, cols])
            sch.reorder(jo, js, k, *rowloops, ji)
        epilogue = list(blocks[idx + 1:])
        collapse_epilogue(sch, epilogue, "CPUMatvec", func)
        acc = sch.cache_write(mm, 0, "local")  # rows x cols (x the panels read together): registers
        fold_into_writeback(sch, epilogue, "CPUMatvec", func, mm)
        sch.reverse_compute_at(acc, jo if group > 1 else js, preserve_unit_loops=True)
        for b in epilogue:
            if block_alive(sch, b) and is_crop(sch, b, mm):
                sch.reverse_compute_at(b, jo, preserve_unit_loops=True)
        for b in epilogue:
            if block_alive(sch, b) and not is_crop(sch, b, mm):
                schedule_elementwise(sch, b, lanes)
        sch.vectorize(ji)
        for r in rowloops:
            sch.unroll(r)
        vectorize_inner(sch, acc, cols)
        if self.parallel and target_cores(target) > 1:
            sch.parallel(jo)
        init = sch.decompose_reduction(mm, k)
        sch.vectorize(sch.get_loops(init)[-1])
        return sch
