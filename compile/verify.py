"""`verify`: ONNX Runtime vs the numpy oracle, and TVM vs both when a target is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from blockforge.errors import ArgumentError, BlockforgeError, Phrase
from blockforge.graph.model_io import DEFAULT_DIMS, load_npz, model_spec
from blockforge.graph.shape import ShapeRequest
from blockforge.graph.parity import ParityReport, check_parity, prepare_inputs
from blockforge.logs import native_output_to_log

from blockforge.compile.isolate import run_ort
from blockforge.compile.session import Session, open_model


@dataclass
class VerifyOptions:
    model: Path
    inputs: Path | None = None
    shape: ShapeRequest | dict | None = None  # dim names and/or whole input shapes (graph/shape.py)
    seed: int = 0
    target: str | dict | None = None  # None: ORT vs the oracle only
    tuning_db: Path | None = None  # None: the device's default database, if any
    use_tuning: bool = True
    precision: str = "fp32"  # the TVM build's (targets.precision); its row of the tolerance table
    reference: Path | None = None  # the float model a quantized one came from (ORT runs it)


def verify(opts: VerifyOptions, session: Session | None = None) -> ParityReport:
    """Dims come from --shape (dim names or whole input shapes) and, where it is silent,
    from the shapes of the --inputs arrays.

    session: opts.model already opened for opts.target (open_model with opts' shape and
    precision), for a caller that looked at the prepared model first: its load, checks,
    binding and prepare are used, not redone (a real export: ~1-2 s of onnxslim alone)."""
    if session is not None and (not opts.target or session.target is None or session.prepared is None
                                or session.precision.name != opts.precision
                                or Path(session.path).resolve() != Path(opts.model).resolve()):
        raise ArgumentError(f"the {{session}} given to verify is not {opts.model} opened for a build at "
                            f"precision {opts.precision}", "session")
    npz = load_npz(opts.inputs) if opts.inputs else None
    shapes = {k: v.shape for k, v in (npz or {}).items()}
    extra, notes = {}, []
    ort_device = "cpu"
    if opts.target:
        from blockforge.compile.records.reader import open_for_apply
        from blockforge.compile.artifact.runtime import run_vm, tvm_device

        if session is None:
            session = open_model(opts.model, opts.target, opts.shape, input_shapes=shapes, precision=opts.precision)
        model, target = session.model, session.target
        # random inputs at the usual sizes, but never past a dim's upper bound (--shape seq=..16),
        # which the module refuses
        sample = {k: min(b, DEFAULT_DIMS[k]) for k, b in session.binding.bounds if k in DEFAULT_DIMS}
        inputs = prepare_inputs(model, npz, {**sample, **session.dims}, opts.seed)
        problem = target.run_problem()
        if not problem and target.device == "cuda":
            from blockforge.graph.ort import cuda_available

            ort_device = "cuda" if cuda_available() else "cpu"  # compare GPU with GPU (TF32 off in graph/ort.py)
        # ORT first, in the bounded child: a model too big to run stops there, before TVM
        # runs the same graph in this process.
        ort = run_ort(opts.model, model, inputs, ort_device)
        db, info = open_for_apply(target, opts.tuning_db) if opts.use_tuning else (None, None)
        res = session.build(database=db)
        ex = res.executable
        if info:
            notes.append(f"tuning records applied from {info['path']}")
            notes.extend(info["refused"])
            from blockforge.compile.records.reader import unvalidated_warning

            line = unvalidated_warning(info, [t for t in res.untuned_tasks if t in info["unvalidated"]], target.name)
            if line:
                notes.append(line)
        if problem:
            notes.append(f"TVM build for {target.name} succeeded; not run: {problem}")
        else:
            from tvm import relax

            dev = tvm_device(target.device)
            with native_output_to_log():
                extra["tvm"] = run_vm(relax.VirtualMachine(ex, dev), dev, session.inputs, session.outputs, inputs)
    else:
        # the prelude without a target: the child binds and refuses what ORT's session setup
        # would fold above the size cap
        session = open_model(opts.model, None, opts.shape, input_shapes=shapes, prepare=False)
        model = session.model
        inputs = prepare_inputs(model, npz, session.dims, opts.seed)
        ort = run_ort(opts.model, model, inputs, ort_device)  # the untrusted model runs in the bounded child
        if model_spec(model) is None and opts.reference is None:  # no oracle, no float original
            raise BlockforgeError(f"{opts.model}: ONNX Runtime runs it, but it is not a blockforge model (no spec in "
                                  "its metadata), so there is no oracle to check ONNX Runtime against; give a "
                                  "target to compare TVM with ONNX Runtime")
    from blockforge.graph.parity import model_precision

    quant = model_precision(model)
    if opts.reference is not None:
        # the one prelude, as for the model itself: bound, its folded sizes checked, in the child
        ref_model = open_model(opts.reference, None, opts.shape, input_shapes=shapes, prepare=False).model
        from blockforge.graph.model_io import check_inputs, signature

        check_inputs(signature(ref_model)[0], inputs,
                     f"{{reference}} {opts.reference} (it must take the quantized model's inputs)", argument="reference")
        extra["reference"] = run_ort(opts.reference, ref_model, inputs, ort_device)
        if quant == "float":
            notes.append(Phrase(f"{{reference}} {opts.reference}: the model is not quantized; compared at its float row",
                                "reference"))
    if quant != "float":
        notes.append(Phrase(f"precision {quant}: TVM is checked against ONNX Runtime on the same quantized file "
                            "(parity: a few 8-bit rounding steps of the output's range, graph/tolerance.py); against "
                            "the float model (oracle or {reference}) the quantization's own error is gated by "
                            "relative L2", "reference"))
    def ort_as_written():  # only for a failed int8 row (parity._judge_by_spread); bounded like the first run
        return run_ort(opts.model, model, inputs, ort_device, optimize=False)

    report = check_parity(model, inputs, extra, ort_device=ort_device, ort_outputs=ort, precision=opts.precision,
                          ort_as_written=ort_as_written)
    report.notes[:0] = notes
    return report
