"""The schedule of the conv-gemm im2col (rewrite.py): the GEMM itself is CPUMatmul's.

TVM's default lowering runs the gather as one serial scalar loop nest. Here the panel rows
(batch x group x panel x k) are the parallel loop and each row of NR positions is vectorised
(lanes wide). It is a gather even for stride 1: the clamped, guarded index is no ramp to TVM.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.schedule.base import CPURule, vector_lanes
from blockforge.compile.conv.rewrite import IM2COL_BLOCK, PAD_BLOCK


class CPUIm2col(CPURule):
    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        try:
            blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        except Exception:
            return None
        if len(blocks) != 1 or sch.get(blocks[0]).name_hint not in (IM2COL_BLOCK, PAD_BLOCK):
            return None
        if sch.get(blocks[0]).name_hint == PAD_BLOCK:  # (n, c, phase, p): rows parallel, p whole vectors
            n, c, r, p = sch.get_loops(blocks[0])
            sch.parallel(sch.fuse(n, c, r))
            _, pi = sch.split(p, [None, vector_lanes(target)])
            sch.vectorize(pi)
            return sch
        n, g, jb, k, jr = sch.get_loops(blocks[0])
        lanes = vector_lanes(target)
        nr = int(sch.get(jr).extent)
        # k in the parallel loop too: the deep Wav2Vec2 layers have one panel (L=49), and TVM
        # splits a parallel loop into one contiguous range per thread (contiguous writes still).
        sch.parallel(sch.fuse(n, g, jb, k))
        if nr % lanes == 0:
            _, ji = sch.split(jr, [None, lanes])
            sch.vectorize(ji)
        return sch
