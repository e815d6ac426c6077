"""`verify`: ONNX Runtime vs the numpy oracle, and TVM vs both when a target is given."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blockforge.graph.model_io import load_npz, parse_dims, signature
from blockforge.graph.parity import ParityReport, check_parity, prepare_inputs
from blockforge.logs import native_output_to_log

from .isolate import load_untrusted


@dataclass
class VerifyOptions:
    model: Path
    inputs: Path | None = None
    shape: str | None = None
    seed: int = 0
    target: str | None = None
    tuning_db: Path | None = None
    no_tuning: bool = False


def verify(opts: VerifyOptions) -> ParityReport:
    dims = parse_dims(opts.shape)
    model = load_untrusted(opts.model, tvm=bool(opts.target), dims=dims)
    inputs = prepare_inputs(model, load_npz(opts.inputs) if opts.inputs else None, dims, opts.seed)
    extra, notes = {}, []
    ort_device = "cpu"
    if opts.target:
        from blockforge.targets import resolve

        from .frontend import import_onnx
        from .pipeline import build
        from .runtime import run_vm, tvm_device
        from .tuning_db import open_for_apply

        target = resolve(opts.target)
        db, info = (None, None) if opts.no_tuning else open_for_apply(target, opts.tuning_db)
        with native_output_to_log():
            ex = build(import_onnx(model, dims), target, database=db).executable
        if info:
            notes.append(f"tuning records applied from {info['path']}")
        problem = target.run_problem()
        if problem:
            notes.append(f"TVM build for {target.name} succeeded; not run: {problem}")
        else:
            from tvm import relax

            from blockforge.graph.ort import cuda_available

            if target.device == "cuda" and cuda_available():
                ort_device = "cuda"  # compare GPU with GPU (TF32 off in graph/ort.py)
            dev = tvm_device(target.device)
            ins, outs = signature(model)
            with native_output_to_log():
                extra["tvm"] = run_vm(relax.VirtualMachine(ex, dev), dev, ins, outs, inputs)
    report = check_parity(model, inputs, extra, ort_device=ort_device)
    report.notes[:0] = notes
    return report
