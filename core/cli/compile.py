"""`blockforge compile`: an ONNX model into an artifact directory for a target."""

from __future__ import annotations

import sys

from .common import add_force, add_precision, add_shape, add_tuning, shape, path_or_none


def add(sub) -> None:
    p = sub.add_parser("compile", help="compile an ONNX model with TVM into an artifact directory")
    p.add_argument("model")
    p.add_argument("--target", required=True, help="preset name (see `blockforge targets`) or TVM target JSON")
    add_shape(p)
    p.add_argument("-o", "--output", default=None, help="artifact directory (default <model>.<target> beside the model)")
    add_force(p, "an existing output that is not a blockforge artifact, or ")
    p.add_argument("--dump-ir", default=None, help="write the IR after each pipeline phase here")
    add_tuning(p)
    add_precision(p)
    p.add_argument("--no-step-entry", action="store_true",
                   help="a decoder compiled with seq symbolic: no `decode` entry for the seq-1 steps (a shorter "
                        "build; every call runs main)")
    p.add_argument("--kv-capacity", type=int, default=None, metavar="ROWS",
                   help="a decoder compiled with seq symbolic: also `decode_inplace`, the step on a preallocated "
                        "cache of ROWS positions written in place (no copy of the cache per step); `run --decode` "
                        "uses it")
    p.set_defaults(func=run)


def run(a) -> int:
    from blockforge.compile import CompileOptions, compile_model

    res = compile_model(CompileOptions(
        model=a.model, target=a.target, shape=shape(a), output=a.output,
        dump_ir=a.dump_ir, tuning_db=path_or_none(a.tuning_db, "--tuning-db"), use_tuning=not a.no_tuning,
        precision=a.precision, force=a.force, step_entry=not a.no_step_entry,
        kv_capacity=a.kv_capacity))
    m = res.manifest
    size = (res.artifact / m["module"]).stat().st_size
    print(f"compiled {a.model} for {res.target.name} -> {res.artifact}/ (module.so {size / 2**20:.1f} MiB, "
          f"phases: {' > '.join(m['phases'])}{', precision ' + m['precision'] if m['precision'] != 'fp32' else ''})")
    for line in m.get("notes", []):
        print(f"warning: {line}", file=sys.stderr)
    if m.get("step"):
        print(f"decode steps ({m['step']['dim']} = 1) run the entry {m['step']['function']}; the prompt runs main")
    if m.get("inplace"):
        print(f"in-place cache: {m['inplace']['capacity']} positions, steps of `run --decode` run "
              f"{m['inplace']['function']}")
    if m.get("tuning"):
        t = m["tuning"]
        kept = [k for k in t["kept_default"] if k not in t["missing"]]
        print(f"tuning records: {t['applied']} of {t['tasks']} tasks from {t['path']}"
              + (f"; default schedule kept (faster in the model) for {len(kept)}" if kept else ""))
        for line in t.get("refused", []):
            print(f"warning: {line}", file=sys.stderr)
        for name in t.get("missing", []):
            print(f"warning: no tuning record for task {name}", file=sys.stderr)
        from blockforge.compile.records.reader import unvalidated_warning

        line = unvalidated_warning(t, t.get("unvalidated", []), res.target.name)
        if line:
            print(f"warning: {line}", file=sys.stderr)
    problem = res.target.run_problem()
    if problem:
        print(f"note: cannot run here: {problem}")
    return 0
