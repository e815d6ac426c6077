"""The schedule of the conv-gemm im2col (rewrite.py): the GEMM itself is CPUMatmul's.

TVM's default lowering runs the gather as one serial scalar loop nest. Here the column
panels (batch x group x panel) are the parallel loop and each panel row of NR positions is
vectorised (lanes wide): for stride 1 its taps are consecutive inputs.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from ..cpu_schedule import CPURule, vector_lanes
from .rewrite import IM2COL_BLOCK


class CPUIm2col(CPURule):
    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        try:
            blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        except Exception:
            return None
        if len(blocks) != 1 or sch.get(blocks[0]).name_hint != IM2COL_BLOCK:
            return None
        n, g, jb, k, jr = sch.get_loops(blocks[0])
        lanes = vector_lanes(target)
        nr = int(sch.get(jr).extent)
        sch.parallel(sch.fuse(n, g, jb))
        if nr % lanes == 0:
            _, ji = sch.split(jr, [None, lanes])
            sch.vectorize(ji)
        return sch
