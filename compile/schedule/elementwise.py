"""CPUElementwise: kernels of elementwise steps only, inlined into one pass, vectorised."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.schedule.base import CPURule, has_root, log_skip, schedule_elementwise, vector_lanes
from blockforge.compile.schedule.reduction import is_reduction


# Below this many elements a kernel runs on one core: a parallel launch cost ~7 us on the 2-core
# Zen 4 VM, more than a vectorised add of 12288 floats (1.6 us); at 98304 floats (GPT-2's
# residual at seq 128) the launch pays in the model, not in a hot loop (see the class doc).
MIN_PARALLEL = 16384


class CPUElementwise(CPURule):
    """A function of elementwise steps only (no reduction): inlined into its last block,
    rows parallel, the innermost axis vectorised. The last rule tried: every other rule's
    kernels (GEMM epilogues, row reductions, im2col) keep theirs.

    int8 modules' quantize / dequantize / activation chains ran as serial loops through one
    full buffer per step (the QDQ BERT-base FFN's gelu chain 0.52 ms). Float modules had their
    lone elementwise kernels left to TVM's serial scalar loop too: a residual add whose rows are
    symbolic (a decoder's one-build prompt; a reshape beside it made CPURowReduction take the
    static build's), 1.23 ms of GPT-2's prompt at seq 128; with it the prompt ran 0.979-0.992x
    (40 interleaved rounds in each of three build orders on Zen 4, `elementwise` ablation:
    benchmarks/results/quiet-2026-12-06b/prefill_orders.log), of which vectorising alone gave
    nothing (two exploration A/Bs): the parallel rows did."""

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
        try:
            for b in sch.get_child_blocks(sch.get_sblock("root", "main")):
                if len(sch.get_loops(b)) >= 1:
                    schedule_elementwise(sch, b, vector_lanes(target), MIN_PARALLEL)
        except Exception as e:  # a kernel this rule cannot shape keeps TVM's loops, never fails the build
            log_skip("CPUElementwise", func, "not scheduled", e)
            return None
        return sch
