"""A hand-written kernel's tuned choice (its tiles) as a MetaSchedule record.

The fused attention, the int8 GEMM and the bf16 GEMM are written by hand, so MetaSchedule's
search spaces do not apply; what `tune` times is a small set of candidates per kernel. Each is
stored the way MetaSchedule stores anything: a record of the kernel's workload (the kernel at
its default choice) whose trace holds one decision, a SampleCategorical over the candidates
encoded as integers. compile looks the workload up and takes the best record's decision;
MetaSchedule's own tools read the records. A database is untrusted input: the caller keeps a
decoded choice only if it is one of the candidates tune times for that kernel.
"""

from __future__ import annotations


def choice_trace(workload, codes: list[int], code: int):
    """A trace over `workload` (an IRModule) whose one decision picks `code` among `codes`."""
    from tvm import s_tir

    sch = s_tir.Schedule(workload)
    sch.sample_categorical(candidates=codes, probs=[1.0 / len(codes)] * len(codes), decision=codes.index(code))
    return sch.trace


def choice_from_trace(trace) -> int | None:
    """The code a trace's first SampleCategorical decided, or None."""
    for inst in trace.insts:
        if inst.kind.name == "SampleCategorical":
            d = trace.decisions.get(inst)
            codes = list(inst.attrs[0])
            if d is not None and 0 <= int(d) < len(codes):
                return int(codes[int(d)])
            return None
    return None


def recorded_choice(database, workload, target, decode, candidates):
    """The best record of `workload` on `target` in a MetaSchedule database, its code decoded,
    if that is one of `candidates` (a database is untrusted input: it picks among what tune
    times, nothing else); else None."""
    if not database.has_workload(workload):
        return None
    rec = database.query_tuning_record(workload, target, "main")
    code = choice_from_trace(rec.trace) if rec is not None else None
    choice = None if code is None else decode(code)
    return choice if choice in candidates else None
