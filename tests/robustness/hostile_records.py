"""Hostile tuning records: a real trace plus a payload, for the record-policy tests.

The payload is the one TVM honours: a loop annotated `pragma_import_llvm` with LLVM IR
(or the path of a .ll file) of module-level assembly whose constructor creates a marker
file. Linked into module.so, the constructor runs wherever the module is loaded
(`blockforge run`, the edge app). The tests assert the marker never appears.
"""

from __future__ import annotations

import json
from pathlib import Path

from blockforge.compile.records.reader import DEVICE, FORMAT, LEDGER, RECORDS


def constructor_ir(marker: Path) -> str:
    """LLVM IR that is only module-level assembly (which LLVM's linker always carries
    over): an x86-64 function that creat(2)s `marker`, registered in .init_array so the
    dynamic loader runs it when module.so is loaded."""
    def q(text: str) -> str:  # an LLVM string: quotes and backslashes as hex escapes
        return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else f"\\{ord(c):02X}" for c in text)

    # numeric labels: several hostile records in one module do not clash
    asm = [".text", "7:", "lea 8f(%rip), %rdi", "mov $420, %esi", "mov $85, %eax", "syscall", "ret",
           f'8: .asciz "{marker}"', '.section .init_array,"aw"', ".quad 7b", ".text"]
    return "".join(f'module asm "{q(line)}"\n' for line in asm)


def final_loop(insts: list) -> tuple[int, str]:
    """(position after, name) of a loop the trace leaves in place: the one it parallelizes
    last (what MetaSchedule's postprocessor also annotates with its unroll pragmas)."""
    for n in range(len(insts) - 1, -1, -1):
        if insts[n][0] == "Parallel":
            return n + 1, insts[n][1][0]
    for n, inst in enumerate(insts):  # no parallel loop: the first loop of the trace
        if inst[0] == "GetLoops" and inst[3]:
            return n + 1, inst[3][0]
    raise ValueError("trace has no loop")


def with_annotation(record: list, key: str, value) -> list:
    """A copy of a tuning record (the [trace, run_secs, target, args] part) whose trace
    annotates its final loop with key = value (value as it stands in trace JSON)."""
    rec = json.loads(json.dumps(record))
    insts = rec[0][0]
    at, loop = final_loop(insts)
    insts.insert(at, ["Annotate", [loop, value], [key], []])
    # decisions name instructions by position: those after the insertion move by one
    rec[0][1] = [[i + (i >= at), d] for i, d in rec[0][1]]
    return rec


def default_schedule_db(model: Path, d: Path, shape: dict, cpu: str, run_secs=(1e-5,)) -> list[tuple[str, str, list]]:
    """A real database of blockforge's default schedule for every task of `model`, marked as
    tuned on `cpu` (so a build there applies it): [(workload, task, record)]."""
    from tvm.s_tir import meta_schedule as ms

    from blockforge.compile.pipeline import extract_tasks, run_phases
    from blockforge.compile.session import open_model
    from blockforge.tune.jobs import default_schedule

    session = open_model(model, "host", shape)
    legal, _ = run_phases(session.relax(), session.target, stop_after="legalize")
    tgt = session.target.tvm_target()
    d.mkdir(parents=True)
    db = ms.database.JSONDatabase(work_dir=str(d))
    out = []
    for t in extract_tasks(legal, session.target):
        func = t.dispatched[0]
        wl = db.commit_workload(func)
        args = ms.arg_info.ArgInfo.from_prim_func(func["main"])
        db.commit_tuning_record(ms.database.TuningRecord(default_schedule(t, session.target).trace, wl,
                                                         list(run_secs), tgt, args))
        out.append((ms.database.Workload(func).as_json()[0], t.task_name))
    (d / DEVICE).write_text(json.dumps({"format": FORMAT, "key": session.target.key(),
                                        "target": session.target.target_json, "cpu_model": cpu}))
    (d / LEDGER).write_text(json.dumps({w: {"task": n, "trials": 1} for w, n in out}))
    records = [json.loads(line)[1] for line in (d / RECORDS).read_text().splitlines()]
    return [(w, n, r) for (w, n), r in zip(out, records)]


def write_records(d: Path, records: list[tuple[int, list]]) -> None:
    (d / RECORDS).write_text("".join(json.dumps([i, r]) + "\n" for i, r in records))
