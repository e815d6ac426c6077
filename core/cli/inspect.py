"""`blockforge inspect`: op histogram, inputs/outputs, params, FLOPs."""

from __future__ import annotations

import json

from .common import add_shape, shape


def add(sub) -> None:
    p = sub.add_parser("inspect", help="op histogram, inputs/outputs, params, FLOPs")
    p.add_argument("model")
    add_shape(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(a) -> int:
    from blockforge.compile.session import open_model
    from blockforge.errors import printable
    from blockforge.graph.analysis import analyze
    from blockforge.graph.model_io import DEFAULT_DIMS, model_spec

    # FLOPs on the prepared model: exports compute their shapes at run time (Shape ->
    # Concat -> Reshape), which shape inference alone cannot see through. The prelude
    # (without a target) prepares in a child process: its folding evaluates subgraphs
    # natively, and it refuses a model whose folding would materialise a tensor above the cap.
    session = open_model(a.model, None, shape(a), default_dims=DEFAULT_DIMS, tvm_probe=False)
    model, report = session.model, session.prepare_report
    facts = analyze(model, session.dims, session.prepared)
    spec = model_spec(model)
    open_dims = session.binding.unbound()
    if a.json:
        print(json.dumps({**facts.to_dict(), "spec": spec.to_dict() if spec else None,
                          "unbound_dims": open_dims, "prepare": report.to_dict() if report else None}, indent=2))
        return 0
    # Names, dims and op types are the model's text: escaped, so none can forge a line or reach
    # the terminal as an escape sequence (--json escapes them as JSON does).
    print(f"model: {a.model}  (opset {facts.opset}, {'blockforge ' + spec.kind if spec else 'foreign model'})")
    for label, sigs in (("input", facts.inputs), ("output", facts.outputs)):
        for s in sigs:
            axes = "[" + ", ".join(str(d) if isinstance(d, int) else printable(repr(d)) for d in s.dims) + "]"
            print(f"  {label:6} {printable(s.name):18} {s.dtype:8} {axes}")
    print(f"  params {facts.params:,} ({facts.param_bytes / 2**20:.2f} MiB)")
    print(f"  MatMul/Gemm/Conv/attention FLOPs {facts.flops:,} at {facts.dims}")
    if open_dims:
        print(f"  note: dims {', '.join(map(printable, open_dims))} are unbound: FLOPs count only the static part "
              "(give --shape, e.g. input_ids=1x128)")
    print("  ops: " + ", ".join(f"{printable(k)} x{v}" for k, v in facts.ops.items()))
    return 0
