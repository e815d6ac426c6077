"""CPUElementwise: elementwise chains (int8 modules' epilogues), vectorised."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.schedule.base import CPURule, has_root, log_skip, schedule_elementwise, vector_lanes
from blockforge.compile.schedule.reduction import is_reduction


class CPUElementwise(CPURule):
    """A function of elementwise steps only (no reduction): inlined into its last block,
    rows parallel, the innermost axis vectorised. Used in int8 modules only (pipeline:
    their quantize / dequantize / activation chains, which TVM's default lowering ran as
    serial loops through one full buffer per step: the QDQ BERT-base FFN's gelu chain
    0.52 ms). Float modules keep their schedules as they were."""

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        if not has_root(sch):
            return None
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        if not blocks or any(is_reduction(sch.get(b)) for b in blocks):
            return None
        for b in blocks[:-1]:
            try:
                sch.compute_inline(b)
            except Exception as e:
                log_skip("CPUElementwise", func, f"step {sch.get(b).name_hint} not inlined", e)
        for b in sch.get_child_blocks(sch.get_sblock("root", "main")):
            if len(sch.get_loops(b)) >= 1:
                schedule_elementwise(sch, b, vector_lanes(target))
        return sch
