"""`blockforge inspect`: op histogram, inputs/outputs, params, FLOPs."""

from __future__ import annotations

import json

from .common import add_shape, dims


def add(sub) -> None:
    p = sub.add_parser("inspect", help="op histogram, inputs/outputs, params, FLOPs")
    p.add_argument("model")
    add_shape(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(a) -> int:
    from blockforge.compile.isolate import load_untrusted
    from blockforge.graph.analysis import analyze
    from blockforge.graph.model_io import model_spec

    model = load_untrusted(a.model)
    facts = analyze(model, dims(a))
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
