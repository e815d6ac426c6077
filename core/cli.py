"""The `blockforge` command: parses arguments and calls the typed Python API, nothing more.

Exit codes: 0 success, 1 parity failure (verify), 2 user error (bad input), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from blockforge.errors import BlockforgeError


def _print_table(headers: list[str], rows: list[list], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    print(line(headers), file=out)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=out)
    for r in cells:
        print(line(r), file=out)


# ---------------------------------------------------------------- export / inspect / verify

def _spec_from_args(a):
    from blockforge.graph.spec import BlockSpec, FFNSpec, MHASpec

    common = dict(d_model=a.d_model, dtype=a.dtype, opset=a.opset, seed=a.seed, batch=a.batch, seq=a.seq)
    if a.kind == "mha":
        return MHASpec(**common, heads=a.heads, cross=a.cross, kv_seq=a.kv_seq, causal=a.causal,
                       mask=a.mask, bias=not a.no_bias, layout=a.layout)
    if a.kind == "ffn":
        return FFNSpec(**common, d_ff=a.d_ff, activation=a.activation or "relu")
    return BlockSpec(**common, heads=a.heads, d_ff=a.d_ff, activation=a.activation or "gelu",
                     norm=a.norm, causal=a.causal, layout=a.layout)


def cmd_export(a) -> int:
    from blockforge.graph.export import export

    res = export(_spec_from_args(a), a.output)
    m = res.manifest
    print(f"wrote {res.model_path} ({m['bytes'] / 2**20:.1f} MiB, {m['params']:,} params, "
          f"{m['matmul_flops'] / 1e9:.3f} GFLOP at {m['flops_at']}) and {res.manifest_path}")
    return 0


def cmd_inspect(a) -> int:
    from blockforge.compile.isolate import load_untrusted
    from blockforge.graph.analysis import analyze
    from blockforge.graph.model_io import model_spec, parse_dims

    model = load_untrusted(a.model)
    facts = analyze(model, parse_dims(a.shape))
    spec = model_spec(model)
    if a.json:
        print(json.dumps({**facts.to_dict(), "spec": spec.to_dict() if spec else None}, indent=2))
        return 0
    print(f"model: {a.model}  (opset {facts.opset}, {'blockforge ' + spec.kind if spec else 'foreign model'})")
    for label, sigs in (("input", facts.inputs), ("output", facts.outputs)):
        for s in sigs:
            print(f"  {label:6} {s.name:18} {s.dtype:8} {list(s.dims)}")
    print(f"  params {facts.params:,} ({facts.param_bytes / 2**20:.2f} MiB)")
    print(f"  MatMul FLOPs {facts.flops:,} at {facts.dims}")
    print("  ops: " + ", ".join(f"{k} x{v}" for k, v in facts.ops.items()))
    return 0


def cmd_verify(a) -> int:
    from blockforge.compile.verify import VerifyOptions, verify

    report = verify(VerifyOptions(model=Path(a.model), inputs=Path(a.inputs) if a.inputs else None,
                                  shape=a.shape, seed=a.seed, target=a.target, tuning_db=a.tuning_db,
                                  no_tuning=a.no_tuning))
    for note in report.notes:
        print(f"note: {note}")
    for issue in report.input_issues:
        print(f"warning: {issue}")
    rows = [[c.pair, c.output, f"{c.max_abs:.3e}", f"{c.max_rel:.3e}", f"rtol={c.tol.rtol:g} atol={c.tol.atol:g}",
             ("PASS" if c.passed else "FAIL") + (f" ({c.note})" if c.note else "")] for c in report.comparisons]
    _print_table(["pair", "output", "max abs err", "max rel err", "tolerance", "result"], rows)
    if a.json:
        from blockforge.fsutil import atomic_write_json

        atomic_write_json(a.json, report.to_dict())
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


# ---------------------------------------------------------------- targets / compile / run

def cmd_targets(a) -> int:
    from blockforge.targets import list_targets

    rows = list_targets()
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    _print_table(["preset", "build here", "run here", "target", "why not"],
                 [[r["name"], "yes" if r["can_build"] else "no", "yes" if r["can_run"] else "no",
                   json.dumps(r["target"]), r["build_problem"] or r["run_problem"] or ""] for r in rows])
    return 0


def cmd_compile(a) -> int:
    from blockforge.compile import CompileOptions, compile_model
    from blockforge.graph.model_io import parse_dims

    res = compile_model(CompileOptions(
        model=Path(a.model), target=a.target, dims=parse_dims(a.shape),
        output=Path(a.output) if a.output else None, dump_ir=Path(a.dump_ir) if a.dump_ir else None,
        tuning_db=Path(a.tuning_db) if a.tuning_db else None, use_tuning=not a.no_tuning))
    m = res.manifest
    size = (res.artifact / "module.so").stat().st_size
    print(f"compiled {a.model} for {res.target.name} -> {res.artifact}/ (module.so {size / 2**20:.1f} MiB, "
          f"phases: {' > '.join(m['phases'])})")
    if m.get("tuning"):
        t = m["tuning"]
        kept = [k for k in t["kept_default"] if k not in t["missing"]]
        print(f"tuning records: {t['applied']} of {t['tasks']} tasks from {t['path']}"
              + (f"; default schedule kept (faster in the model) for {len(kept)}" if kept else ""))
        for name in t.get("missing", []):
            print(f"warning: no tuning record for task {name}", file=sys.stderr)
    problem = res.target.run_problem()
    if problem:
        print(f"note: cannot run here: {problem}")
    return 0


def cmd_run(a) -> int:
    import time

    import numpy as np

    from blockforge.compile import load_artifact
    from blockforge.fsutil import atomic_write_bytes
    from blockforge.graph.model_io import load_npz
    from blockforge.logs import native_output_to_log

    inputs = load_npz(a.inputs)
    mod = load_artifact(a.artifact)
    with native_output_to_log():
        t0 = time.perf_counter()
        outs = mod.run(inputs)
        dt = time.perf_counter() - t0
    import io

    buf = io.BytesIO()
    np.savez(buf, **outs)
    atomic_write_bytes(a.output, buf.getvalue())
    print(f"ran {a.artifact} in {dt * 1e3:.2f} ms -> {a.output} ({', '.join(f'{k} {v.shape}' for k, v in outs.items())})")
    return 0


def cmd_tune(a) -> int:
    from blockforge.compile.tune import TuneOptions, tune
    from blockforge.graph.model_io import parse_dims

    s = tune(TuneOptions(model=Path(a.model), target=a.target, trials=a.trials, trials_per_task=a.trials_per_task,
                         db=Path(a.db) if a.db else None, rpc_tracker=a.rpc_tracker, rpc_key=a.rpc_key,
                         dims=parse_dims(a.shape), round_trials=a.round_trials, measure=not a.no_measure,
                         progress=not a.no_progress, rpc_wait_s=a.rpc_wait))
    rows = [[t.name, f"{t.flops / 1e6:.2f}", f"{t.best_us:.1f}" if t.best_us else "-",
             f"{t.gflops:.1f}" if t.gflops else "-", f"{min(t.trials_before, t.budget) + t.trials_new}/{t.budget}",
             t.trials_new, t.status] for t in s.tasks]
    _print_table(["task", "MFLOP", "best us", "GFLOP/s", "trials", "new", "status"], rows)
    print(f"spent {s.trials_new} new trials, reused {s.trials_reused}"
          + (f", salvaged {s.salvaged} records of an interrupted job" if s.salvaged else "")
          + f"; database {s.db}")
    if s.kept_default:
        print(f"kept blockforge's default schedule (faster inside the model) for: {', '.join(s.kept_default)}")
    if s.untuned_ms is not None:
        print(f"whole model on this device: TVM naive {s.naive_ms:.3f} ms, blockforge untuned {s.untuned_ms:.3f} ms, "
              f"tuned {s.tuned_ms:.3f} ms")
    if a.json:
        from blockforge.fsutil import atomic_write_json

        atomic_write_json(a.json, s.to_dict())
    return 0


def cmd_rpc(a) -> int:
    from blockforge.compile.rpc import serve

    return serve(a.role, host=a.host, port=a.port, tracker=a.tracker, key=a.key)


def cmd_bench(a) -> int:
    from blockforge.compile.bench import BenchOptions, bench, plot
    from blockforge.fsutil import atomic_write_json
    from blockforge.graph.model_io import parse_dims

    rep = bench(BenchOptions(model=Path(a.model), target=a.target,
                             against=tuple(x.strip() for x in a.against.split(",") if x.strip()),
                             repeat=a.repeat, dims=parse_dims(a.shape),
                             tuning_db=Path(a.tuning_db) if a.tuning_db else None, profile=a.profile))
    print(rep.markdown())
    for n in rep.notes:
        print(f"note: {n}")
    if a.json:
        atomic_write_json(a.json, rep.to_dict())
    if a.plot:
        plot([rep], Path(a.plot))
    return 0


def cmd_package(a) -> int:
    from blockforge.compile.package import PackageOptions, package_artifact

    res = package_artifact(PackageOptions(artifact=Path(a.artifact), output=Path(a.output) if a.output else None,
                                          app=a.app))
    total = sum(res.files.values())
    print(f"packaged {a.artifact} for {res.arch} -> {res.path}/ ({total / 2**20:.1f} MiB)")
    for name, size in sorted(res.files.items()):
        print(f"  {name:28} {size / 2**10:10.1f} KiB")
    return 0


# ---------------------------------------------------------------- parser

def _add_export(sub) -> None:
    p = sub.add_parser("export", help="build an MHA / FFN / encoder block as ONNX")
    p.add_argument("kind", choices=["mha", "ffn", "block"])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=None, help="default 4*d_model")
    p.add_argument("--activation", choices=["relu", "gelu", "gelu_tanh"], default=None,
                   help="FFN activation (ffn default relu, block default gelu)")
    p.add_argument("--cross", action="store_true", help="cross-attention: key/value get their own length")
    p.add_argument("--kv-seq", type=int, default=None, help="static key/value length (implies --cross)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mask", choices=["additive", "bool"], default=None, help="add a key_padding_mask input")
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--layout", choices=["per-head", "packed"], default="per-head")
    p.add_argument("--norm", choices=["pre", "post"], default="pre", help="block: pre-LN or post-LN")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    p.add_argument("--opset", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None, help="static batch (default symbolic)")
    p.add_argument("--seq", type=int, default=None, help="static sequence length (default symbolic)")
    p.add_argument("-o", "--output", default=None, help="MODEL.onnx (default artifacts/<name>.onnx)")
    p.set_defaults(func=cmd_export)


def build_parser() -> argparse.ArgumentParser:
    import blockforge

    parser = argparse.ArgumentParser(prog="blockforge", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"blockforge {blockforge.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_export(sub)

    p = sub.add_parser("inspect", help="op histogram, inputs/outputs, params, FLOPs")
    p.add_argument("model")
    p.add_argument("--shape", default=None, help="bind symbolic dims for FLOPs, e.g. batch=1,seq=128")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="ONNX Runtime vs numpy oracle (and TVM with --target)")
    p.add_argument("model")
    p.add_argument("--inputs", default=None, help=".npz of named inputs (default: random from --seed)")
    p.add_argument("--shape", default=None, help="bind symbolic dims, e.g. batch=1,seq=128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=None, help="also compile with TVM for this preset or target JSON")
    p.add_argument("--tuning-db", default=None, help="apply this tuning database (default: the device's)")
    p.add_argument("--no-tuning", action="store_true", help="ignore tuning records")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("targets", help="list target presets and whether they build / run here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_targets)

    p = sub.add_parser("compile", help="compile an ONNX model with TVM into an artifact directory")
    p.add_argument("model")
    p.add_argument("--target", required=True, help="preset name (see `blockforge targets`) or TVM target JSON")
    p.add_argument("--shape", default=None, help="bind symbolic dims, e.g. batch=1,seq=128")
    p.add_argument("-o", "--output", default=None, help="artifact directory (default artifacts/<model>.<target>)")
    p.add_argument("--dump-ir", default=None, help="write the IR after each pipeline phase here")
    p.add_argument("--tuning-db", default=None, help="tuning database dir (default: the device's)")
    p.add_argument("--no-tuning", action="store_true", help="ignore tuning records")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("run", help="run a compiled artifact on inputs from an .npz")
    p.add_argument("artifact")
    p.add_argument("--inputs", required=True)
    p.add_argument("--output", required=True)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("tune", help="MetaSchedule autotuning into the device's database (resumable)",
                       description="Every task gets --trials-per-task trials (default 64); --trials caps the "
                                   "job at min(per-task, trials // tasks) each. Trials already in the database "
                                   "count: a rerun spends 0, a raised budget only the difference.")
    p.add_argument("model")
    p.add_argument("--target", required=True)
    p.add_argument("--trials", type=int, default=None, help="total budget for this job")
    p.add_argument("--trials-per-task", type=int, default=None, help="budget per task (default 64)")
    p.add_argument("--round-trials", type=int, default=32, help="trials per task between database merges")
    p.add_argument("--db", default=None, help="tuning database dir (default artifacts/tuning/<device-key>)")
    p.add_argument("--rpc-tracker", default=None, help="HOST:PORT of a TVM RPC tracker")
    p.add_argument("--rpc-key", default=None, help="device key registered at the tracker")
    p.add_argument("--rpc-wait", type=float, default=10.0, help="seconds to wait for a device")
    p.add_argument("--shape", default=None, help="bind symbolic dims, e.g. batch=1,seq=128")
    p.add_argument("--no-measure", action="store_true", help="skip the untuned-vs-tuned whole-model timing")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="write the summary as JSON here")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("rpc", help="start a TVM RPC tracker or server (binds 127.0.0.1 by default)")
    p.add_argument("role", choices=["tracker", "server"])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback: the server runs "
                                                       "arbitrary code for anyone who reaches it)")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--tracker", default=None, help="server: HOST:PORT of the tracker")
    p.add_argument("--key", default=None, help="server: device key")
    p.set_defaults(func=cmd_rpc)

    p = sub.add_parser("bench", help="ONNX Runtime vs untuned vs tuned TVM, interleaved in one process")
    p.add_argument("model")
    p.add_argument("--target", default="host")
    p.add_argument("--against", default="ort,untuned,tuned", help="comma list of ort,untuned,tuned")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--shape", default="batch=1,seq=128", help="static dims (default batch=1,seq=128)")
    p.add_argument("--tuning-db", default=None)
    p.add_argument("--profile", action="store_true", help="per-kernel times of the TVM contenders")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("package", help="gather what an edge device needs: module, manifest, runtime, app")
    p.add_argument("artifact")
    p.add_argument("-o", "--output", default=None, help="package dir (default <artifact>.pkg)")
    p.add_argument("--app", action="store_true", help="also build and include the C++ example app")
    p.set_defaults(func=cmd_package)

    return parser


def main(argv: list[str] | None = None) -> int:
    from blockforge.logs import log_path, setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    log = setup_logging()
    try:
        return int(args.func(args) or 0)
    except BlockforgeError as e:
        print(f"blockforge: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("blockforge: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: one line on the terminal, the traceback in the log
        log.error("internal error\n%s", traceback.format_exc())
        print(f"blockforge: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
              f"(traceback in {log_path()})", file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main())
