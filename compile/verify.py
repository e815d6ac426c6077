"""`verify`: ONNX Runtime vs the numpy oracle, and TVM vs both when a target is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from blockforge.graph.model_io import load_npz
from blockforge.graph.parity import ParityReport, check_parity, prepare_inputs
from blockforge.logs import native_output_to_log

from .isolate import load_untrusted


@dataclass
class VerifyOptions:
    model: Path
    inputs: Path | None = None
    dims: dict = field(default_factory=dict)  # model_io.parse_dims(): dim names and/or input shapes
    seed: int = 0
    target: str | dict | None = None  # None: ORT vs the oracle only
    tuning_db: Path | None = None  # None: the device's default database, if any
    use_tuning: bool = True


def verify(opts: VerifyOptions) -> ParityReport:
    """Dims come from --shape (dim names or whole input shapes) and, where it is silent,
    from the shapes of the --inputs arrays."""
    npz = load_npz(opts.inputs) if opts.inputs else None
    shapes = {k: v.shape for k, v in (npz or {}).items()}
    extra, notes = {}, []
    ort_device = "cpu"
    if opts.target:
        from .records import open_for_apply
        from .runtime import run_vm, tvm_device
        from .session import open_model

        session = open_model(opts.model, opts.target, opts.dims, input_shapes=shapes)
        model, target = session.model, session.target
        inputs = prepare_inputs(model, npz, session.dims, opts.seed)
        db, info = open_for_apply(target, opts.tuning_db) if opts.use_tuning else (None, None)
        res = session.build(database=db)
        ex = res.executable
        if info:
            notes.append(f"tuning records applied from {info['path']}")
            notes.extend(info["refused"])
            from .records import unvalidated_warning

            line = unvalidated_warning(info, [t for t in res.untuned_tasks if t in info["unvalidated"]], target.name)
            if line:
                notes.append(line)
        problem = target.run_problem()
        if problem:
            notes.append(f"TVM build for {target.name} succeeded; not run: {problem}")
        else:
            from tvm import relax

            from blockforge.graph.ort import cuda_available

            if target.device == "cuda" and cuda_available():
                ort_device = "cuda"  # compare GPU with GPU (TF32 off in graph/ort.py)
            dev = tvm_device(target.device)
            with native_output_to_log():
                extra["tvm"] = run_vm(relax.VirtualMachine(ex, dev), dev, session.inputs, session.outputs, inputs)
    else:
        from .session import bind_request

        model = load_untrusted(opts.model)
        inputs = prepare_inputs(model, npz, bind_request(model, opts.dims, shapes), opts.seed)
    report = check_parity(model, inputs, extra, ort_device=ort_device)
    report.notes[:0] = notes
    return report
