"""`blockforge bench`: contenders side by side, interleaved in one process; the headline is
each one's ratio to the best peer (the fastest non-blockforge contender)."""

from __future__ import annotations

from pathlib import Path

from .common import (DEFAULT_SHAPE, add_force, add_precision, add_shape, check_outputs, default_dims, note_text, shape,
                     path_or_none, write_json)


def add(sub) -> None:
    from blockforge.bench.contenders import CONTENDERS, PEERS

    p = sub.add_parser("bench", help="blockforge (untuned, tuned) vs ONNX Runtime, ORT fused and OpenVINO, "
                                     "interleaved in one process; ratio to the best peer")
    p.add_argument("model")
    p.add_argument("--target", default="host")
    p.add_argument("--against", default=",".join(CONTENDERS),
                   help=f"comma list of {','.join(CONTENDERS)} (default: all; peers {', '.join(PEERS)} that are "
                        "not installed or cannot take the model are skipped with a note)")
    p.add_argument("--repeat", type=int, default=30)
    add_shape(p, default_note=f"{DEFAULT_SHAPE} for the dims the model has")
    p.add_argument("--tuning-db", default=None, help="tuning database dir (default: the device's)")
    p.add_argument("--profile", action="store_true", help="per-kernel times of the TVM contenders")
    add_precision(p)
    p.add_argument("--quiet-ceiling", type=float, default=None, metavar="GFLOPS",
                   help="this machine's SGEMM GFLOP/s when quiet (the report's ceiling on an idle machine): the "
                        "report says whether the run is quotable (every ceiling it measured, before and after "
                        "the timing, >= 90%% of it)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG bar chart (ratio to the best peer) here")
    p.add_argument("--decode", action="store_true",
                   help="a decoder with past_key_values inputs: per-token latency at each --past, prefill of "
                        "--prompt tokens, bytes read per token against a memory bandwidth measured in the run")
    p.add_argument("--past", default="16,128,512,1024", help="--decode: cached lengths (comma list)")
    p.add_argument("--prompt", type=int, default=128, help="--decode: prefill length (0: none)")
    p.add_argument("--copy-cache", action="store_true",
                   help="--decode: no in-place row (the loop artifact built without --kv-capacity)")
    add_force(p)
    p.set_defaults(func=run)


def run(a) -> int:
    check_outputs(a, [a.model, a.tuning_db], json=a.json, plot=a.plot)  # before the import, too
    if a.decode:
        return run_decode(a)
    if a.copy_cache:
        from blockforge.errors import BlockforgeError

        raise BlockforgeError("--copy-cache is a --decode option (the loop artifact's cache)")
    from blockforge.bench import BenchOptions, bench, plot
    from blockforge.fsutil import write_error

    rep = bench(BenchOptions(model=a.model, target=a.target,
                             against=tuple(x.strip() for x in a.against.split(",") if x.strip()),
                             repeat=a.repeat, shape=shape(a), default_dims=default_dims(a),
                             tuning_db=path_or_none(a.tuning_db, "--tuning-db"), profile=a.profile,
                             precision=a.precision, quiet_ceiling=a.quiet_ceiling))
    print(rep.markdown())
    for n in rep.notes:
        print(f"note: {note_text(n)}")
    write_json(a.json, rep.to_dict())
    if a.plot is not None:
        try:
            plot([rep], Path(a.plot))
        except OSError as e:
            raise write_error(a.plot, e) from None
    return 0


def run_decode(a) -> int:
    from blockforge.bench.decode import DecodeOptions, bench_decode
    from blockforge.errors import BlockforgeError

    for flag, given in (("--shape", a.shape is not None), ("--plot", a.plot is not None), ("--profile", a.profile)):
        if given:
            raise BlockforgeError(f"--decode binds its own shapes and reports a table: drop {flag}")
    if a.quiet_ceiling is not None:
        raise BlockforgeError("--decode relates each point to a memory bandwidth measured beside it, not to the "
                              "SGEMM ceiling: drop --quiet-ceiling")
    try:
        pasts = tuple(int(x) for x in a.past.split(",") if x.strip())
    except ValueError:
        raise BlockforgeError(f"--past {a.past!r}: expected a comma list of lengths, e.g. 16,128,512") from None
    rep = bench_decode(DecodeOptions(model=a.model, target=a.target,
                                     against=tuple(x.strip() for x in a.against.split(",") if x.strip()),
                                     repeat=a.repeat, pasts=pasts, prompt=a.prompt, inplace=not a.copy_cache,
                                     tuning_db=path_or_none(a.tuning_db, "--tuning-db")))
    print(rep.markdown())
    for n in rep.notes:
        print(f"note: {note_text(n)}")
    write_json(a.json, rep.to_dict())
    return 0
