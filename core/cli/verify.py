"""`blockforge verify`: ONNX Runtime vs the numpy oracle, and TVM vs both with --target."""

from __future__ import annotations

from .common import add_force, add_precision, add_shape, add_tuning, check_outputs, note_text, shape, path_or_none, print_table, write_json


def add(sub) -> None:
    p = sub.add_parser("verify", help="ONNX Runtime vs numpy oracle (and TVM with --target)")
    p.add_argument("model")
    p.add_argument("--inputs", default=None, help=".npz of named inputs (default: random from --seed)")
    add_shape(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=None, help="also compile with TVM for this preset or target JSON")
    add_tuning(p)
    add_precision(p)
    p.add_argument("--reference", default=None,
                   help="quantized MODEL: its float original (FP32.onnx), run by ONNX Runtime; the quantization's "
                        "error is gated against it (relative L2)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    add_force(p)
    p.set_defaults(func=run)


def run(a) -> int:
    check_outputs(a, [a.model, a.inputs, a.tuning_db, a.reference], json=a.json)
    from blockforge.compile.verify import VerifyOptions, verify
    from blockforge.errors import printable

    report = verify(VerifyOptions(model=a.model, inputs=path_or_none(a.inputs, "--inputs"), shape=shape(a), seed=a.seed,
                                  target=a.target, tuning_db=path_or_none(a.tuning_db, "--tuning-db"), use_tuning=not a.no_tuning,
                                  precision=a.precision, reference=path_or_none(a.reference, "--reference")))
    for note in report.notes:
        print(f"note: {note_text(note)}")
    for issue in report.input_issues:
        print(f"warning: {printable(issue, limit=None)}")
    rows = [[c.pair, printable(c.output), f"{c.max_abs:.3e}", _rel(c), f"{c.tol_used:.3g}", _tol(c),
             ("PASS" if c.passed else "FAIL") + (f" ({c.note})" if c.note else "")] for c in report.comparisons]
    print_table(["pair", "output", "max abs err", "max rel err (|expected| >= atol/rtol)", "err/allowed",
                 "tolerance", "result"], rows)
    if report.comparisons:
        print("An element passes when |actual - expected| <= atol + rtol * |expected| (err/allowed <= 1). "
              "Below |expected| = atol/rtol the allowance is mostly atol, so relative error is left out "
              "there (n = elements it covers).")
    write_json(a.json, report.to_dict())
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


def _tol(c) -> str:
    if c.gate is not None:
        return f"{c.precision} accuracy: rel L2 <= {c.gate:g}"
    if c.tol.rel_l2 is not None:
        return f"rel L2 <= {c.tol.rel_l2:g}"
    step = f" + {c.tol.step:.3g}*max|expected|{f' ({c.precision})' if c.precision else ''}" if c.tol.step else ""
    return f"rtol={c.tol.rtol:g} atol={c.tol.atol:g}{step}"


def _rel(c) -> str:
    """The relative-error cell: only over elements where rtol, not atol, sets the allowance."""
    if c.max_rel is None:
        return f"n/a (no |expected| >= {c.rel_floor:g})"
    if c.count and c.rel_count < c.count:
        return f"{c.max_rel:.3e} (n={c.rel_count}/{c.count})"
    return f"{c.max_rel:.3e}"
