"""Default CPU schedules, so an untuned build is not punished with TVM's naive loops.

TVM's default llvm pipeline leaves matmuls as scalar triple loops (~100x slower than
ONNX Runtime on an MHA block). These dlight-style rules give every matmul-like and
row-reduction kernel a reasonable schedule; MetaSchedule records, where present, are
applied first and win (ApplyDefaultSchedule skips already-scheduled functions).

Matmul micro-kernel (C[..., i, j] += A[..., i, k] * B[..., k, j], j contiguous in B and C):
    for (batch, j_outer, i_outer) in parallel:        # B panel K x NR stays in L2 across i
        acc[MR][NR] = 0                                # MR*NR/lanes vector registers
        for k: acc[ii][jj] += A[i, k] * B[k, jj]       # broadcast A, FMA NR-wide rows of B
        C[i, j] = epilogue(acc)                        # bias/activation/scale fused in-tile
"""

from blockforge.compile.schedule.base import MR, NR_VECS, K_BLOCK, PARTITION_HINT, vector_lanes, CPURule
from blockforge.compile.schedule.elementwise import CPUElementwise
from blockforge.compile.schedule.matmul import CPUMatmul, panel_width
from blockforge.compile.schedule.matvec import CPUMatvec
from blockforge.compile.schedule.ragged import CPUMatmulRaggedN
from blockforge.compile.schedule.reduction import CPURowReduction
from blockforge.compile.schedule.rules import default_cpu_rules

__all__ = ['CPUElementwise', 'CPUMatmul', 'CPUMatmulRaggedN', 'CPUMatvec', 'CPURowReduction', 'CPURule', 'K_BLOCK', 'MR', 'NR_VECS', 'PARTITION_HINT', 'default_cpu_rules', 'panel_width', 'vector_lanes']
