"""The prelude every verb shares: one entry from a model path to a buildable model.

    resolve target -> can it build here? -> isolated load + check (+ prepare + import in a
    child) -> resolve dims -> prepare (bind, fold shape arithmetic) -> import (once)

`open_model()` returns a `Session`; `Session.relax()` imports the prepared model into Relax
the first time it is asked and reuses that module for every later build (compile, verify,
bench's untuned/tuned contenders, tune's A/B builds), instead of re-importing per build.
Relax passes are functional (they return new modules), so reuse is safe.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from blockforge.errors import BlockforgeError, printable
from blockforge.fsutil import atomic_write_bytes, atomic_write_json
from blockforge.graph.model_io import TensorSig, resolve_dims, signature, unbound_dims
from blockforge.logs import native_output_to_log
from blockforge.targets import ResolvedTarget, resolve
from blockforge.targets.precision import PRECISIONS, Precision, resolve_precision

from .frontend import bound_signature, import_onnx
from .isolate import load_untrusted
from .pipeline import BuildResult, build, target_has_vnni
from .prepare import PrepareReport, prepare

_log = logging.getLogger("blockforge.compile")


@dataclass
class Session:
    path: Path
    model: onnx.ModelProto  # as loaded and checked (dims not bound): what ONNX Runtime runs
    dims: dict[str, int]  # resolved: symbolic dim name -> value
    target: ResolvedTarget
    inputs: list[TensorSig]  # the signature at the bound dims
    outputs: list[TensorSig]
    prepared: onnx.ModelProto | None = field(default=None, repr=False)  # what TVM imports
    prepare_report: PrepareReport | None = None
    _relax: dict = field(default_factory=dict, repr=False)
    precision: Precision = PRECISIONS["fp32"]  # resolved against the target (targets.precision)

    def relax(self, int8: bool = True):
        """The imported Relax module (weights embedded), imported once. On a target with
        AVX-512 VNNI the QDQ matmuls are imported as MatMulInteger (compile/quant/qdq.py),
        for the int8-gemm phase; int8=False imports them as written (dequantize + float
        GEMM: what a build without int8-gemm compiles)."""
        int8 = int8 and self.target.kind == "llvm" and target_has_vnni(self.target)
        if int8 not in self._relax:
            rewritten = 0
            if int8:
                from .quant.qdq import qdq_matmuls_as_integer

                model, rewritten = qdq_matmuls_as_integer(self.prepared)
            if rewritten:
                try:
                    with native_output_to_log():
                        self._relax[int8] = import_prepared(model, self.inputs)
                except BlockforgeError as e:
                    # The model as written imported in the isolated probe; the rewrite must
                    # not make a model uncompilable: fall back to it (dequantize + fp32 GEMM).
                    _log.warning("QDQ matmuls kept as written (their MatMulInteger form did not import: %s)", e)
                    rewritten = 0
            if not rewritten:
                self._relax[int8] = self.relax(int8=False) if int8 else self._import_as_written()
        return self._relax[int8]

    def _import_as_written(self):
        with native_output_to_log():
            return import_prepared(self.prepared, self.inputs)

    def build(self, *, database=None, dump_ir: Path | None = None, default_schedules: bool = True,
              without=frozenset()) -> BuildResult:
        if dump_ir:  # the ONNX-level phase: what TVM imported, and what prepare did
            atomic_write_bytes(dump_ir / "00-prepare.onnx", self.prepared.SerializeToString())
            atomic_write_json(dump_ir / "00-prepare.json", self.prepare_report.to_dict())
        with native_output_to_log():
            res = build(self.relax(int8="int8-gemm" not in without), self.target, database=database, dump_ir=dump_ir,
                        default_schedules=default_schedules, without=without, precision=self.precision.name)
        res.phases.insert(0, "prepare")
        return res


def bind_request(model: onnx.ModelProto, dims: dict | None = None, input_shapes: dict | None = None,
                 default_dims: dict | None = None, static: bool = False) -> dict[str, int]:
    """The model's symbolic dims bound from what the user gave (see model_io.resolve_dims);
    static: every dim must be bound (bench), else one clear error naming the inputs."""
    ins = signature(model)[0]
    bound = resolve_dims(ins, dims, input_shapes=input_shapes, defaults=default_dims)
    if static:
        for s in ins:
            s.bind(bound)  # raises, naming the input, the dim and both ways to give it
    return bound


def import_prepared(prepared: onnx.ModelProto, inputs: list[TensorSig]):
    """import_onnx of a prepared model; an import failure with dims left unbound says so."""
    try:
        return import_onnx(prepared, {})
    except BlockforgeError as e:
        open_dims = unbound_dims(inputs, {})
        if not open_dims:
            raise
        example = ",".join(f"{printable(s.name)}={'x'.join(str(d) if isinstance(d, int) else 'N' for d in s.dims)}"
                           for s in inputs)
        raise BlockforgeError(f"{e} (dims {', '.join(open_dims)} are unbound: exports often import only with "
                              f"static shapes, e.g. --shape {example})") from None


def open_model(model: str | Path, target: str | dict | ResolvedTarget = "host",
               dims: dict | None = None, *, input_shapes: dict | None = None,
               default_dims: dict[str, int] | None = None, static: bool = False,
               tvm_probe: bool = True, precision: str | None = None) -> Session:
    """Resolve the target, check it can be built here, load the model (checked in a child
    process first: `tvm_probe` also prepares and imports it there), bind its dims and
    prepare it. precision: a name from targets.precision (None: fp32), refused here, before
    the model is read, when the target cannot compute in it.

    dims: --shape as parsed (dim names and/or whole input shapes); input_shapes: shapes of
    user-supplied arrays, binding what dims leaves open; default_dims: bound only where the
    model has such a dim and nothing else bound it; static: every dim must end up bound."""
    t = target if isinstance(target, ResolvedTarget) else resolve(target)
    problem = t.build_problem()
    if problem:
        raise BlockforgeError(f"cannot build for {t.name}: {problem}")
    prec = resolve_precision(precision, t)
    request = dict(dims=dict(dims or {}), input_shapes=dict(input_shapes or {}),
                   default_dims=dict(default_dims or {}), static=static)
    proto = load_untrusted(model, tvm=tvm_probe, request=request)
    bound = bind_request(proto, **request)
    ins, outs = bound_signature(proto, bound)
    with native_output_to_log():
        prepared, report = prepare(proto, bound, str(model))
    return Session(Path(model), proto, bound, t, ins, outs, prepared, report, precision=prec)
