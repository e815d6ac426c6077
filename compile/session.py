"""The prelude every verb shares: one entry from a model path to a buildable model.

    in a child process: load, check, bind the shape, prepare (bind, fold shape arithmetic),
    import into TVM; meanwhile, here: resolve target -> can it build here? -> TVM's import
    -> the child's prepared model and binding read back -> import (once)

`open_model()` returns a `Session`; the child's work is not redone in the parent (it reads
the prepared model, its weights left in the child's folder until the importer reads them a
tensor at a time). `Session.relax()` imports the prepared model into Relax the first time
it is asked and reuses that module for every later build (compile, verify, bench's
untuned/tuned contenders, tune's A/B builds), instead of re-importing per build. Relax
passes are functional (they return new modules), so reuse is safe. The original model (what
ONNX Runtime runs) is loaded only when a verb asks for it (`Session.model`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import onnx

from blockforge.errors import BlockforgeError, printable, with_note
from blockforge.fsutil import atomic_write_bytes, atomic_write_json
from blockforge.graph.model_io import TensorSig, load_model
from blockforge.graph.shape import Binding, ShapeRequest
from blockforge.logs import native_output_to_log
from blockforge.targets import ResolvedTarget, resolve
from blockforge.targets.precision import PRECISIONS, Precision, resolve_precision

from blockforge.compile.frontend.importer import import_onnx
from blockforge.compile.isolate import prepare_untrusted
from blockforge.compile.pipeline import BuildResult, build, target_int8_isa
from blockforge.compile.frontend.prepare import PrepareReport

_log = logging.getLogger("blockforge.compile")


@dataclass
class Session:
    path: Path
    target: ResolvedTarget | None  # None: a verb that builds nothing (inspect, verify without a target)
    binding: Binding  # the shape resolved against the model: symbolic dim name -> value
    prepared: onnx.ModelProto | None = field(default=None, repr=False)  # what TVM imports
    prepare_report: PrepareReport | None = None
    weights_dir: Path | None = None  # where `prepared`'s external tensors are (None: in memory)
    _keep: object = field(default=None, repr=False)  # keeps weights_dir (isolate.Prepared)
    _relax: dict = field(default_factory=dict, repr=False)
    # what the import could not do as asked, for BuildResult.notes (int8 matmuls computed in
    # float32 on a CPU without an int8 instruction)
    import_notes: list = field(default_factory=list, repr=False)
    precision: Precision = PRECISIONS["fp32"]  # resolved against the target (targets.precision)

    @cached_property
    def model(self) -> onnx.ModelProto:
        """The model as written (dims not bound): what ONNX Runtime runs. Loaded and checked
        here on first use; compile never asks for it."""
        return load_model(self.path)

    @property
    def dims(self) -> dict[str, int]:
        """The binding's values (symbolic dim name -> value)."""
        return self.binding.as_dict()

    @cached_property
    def inputs(self) -> list[TensorSig]:  # the signature at the bound dims
        return self.binding.signature()[0]

    @cached_property
    def outputs(self) -> list[TensorSig]:
        return self.binding.signature()[1]

    def relax(self, int8: bool = True):
        """The imported Relax module (weights embedded), imported once. On a CPU target the
        quantized matmuls are imported for what its int8 instruction takes
        (_integer_rewrites); int8=False imports them as written (QDQ: dequantize + float GEMM;
        MatMulInteger: an int32 one: what a build without int8-gemm compiles)."""
        int8 = int8 and self.target.kind == "llvm"
        if int8 not in self._relax:
            model, rewritten = self._integer_rewrites() if int8 else (None, 0)
            if rewritten:
                try:
                    with native_output_to_log():
                        self._relax[int8] = import_prepared(model, self.binding, self.weights_dir)
                except BlockforgeError as e:
                    # The model as written imported in the isolated probe; the rewrite must
                    # not make a model uncompilable: fall back to it (dequantize + fp32 GEMM).
                    _log.warning("quantized matmuls kept as written (their rewritten form did not import: %s)", e)
                    rewritten = 0
                    self.import_notes = []
            if not rewritten:
                self._relax[int8] = self.relax(int8=False) if int8 else self._import_as_written()
        return self._relax[int8]

    def _integer_rewrites(self):
        """(the prepared model rewritten for the target's int8 instruction, how many rewrites;
        None, 0 when nothing applies). With an instruction (compile/quant/isa.py), the QDQ
        matmuls become MatMulInteger, for the int8-gemm phase (compile/quant/qdq.py); without
        one (SSE2-only x86, aarch64 without +dotprod), the MatMulIntegers become float32 GEMMs,
        which beat the int32 matmul TVM would import (compile/quant/as_float.py), and
        import_notes says so. The rewrites read the weights: loaded (a copy) only for a
        quantized model."""
        ops = {n.op_type for n in self.prepared.graph.node}
        if target_int8_isa(self.target) is not None:
            if "DequantizeLinear" not in ops:
                return None, 0
            from blockforge.compile.quant.qdq import qdq_matmuls_as_integer

            return qdq_matmuls_as_integer(self.prepared_with_weights())
        if "MatMulInteger" not in ops:
            return None, 0
        from blockforge.compile.quant.as_float import integer_matmuls_as_float

        done: list[str] = []
        model, count = integer_matmuls_as_float(self.prepared_with_weights(), done)
        if done:
            self.import_notes = [f"{len(done)} int8 matmul(s) ({', '.join(sorted(set(done)))}, K x N) run as "
                                 "float32 GEMMs: this target has no int8 dot-product instruction (VNNI, "
                                 "VPMADDUBSW/VPMADDWD: AVX2, SDOT: aarch64 +dotprod)"]
        return model, count

    def _import_as_written(self):
        with native_output_to_log():
            return import_prepared(self.prepared, self.binding, self.weights_dir)

    def prepared_with_weights(self) -> onnx.ModelProto | None:
        """`prepared` with its weights in memory (a copy, when they are on disk)."""
        if self.weights_dir is None or self.prepared is None:
            return self.prepared
        from onnx import external_data_helper

        m = onnx.ModelProto()
        m.CopyFrom(self.prepared)
        external_data_helper.load_external_data_for_model(m, str(self.weights_dir))
        return m

    def forget_imports(self) -> None:
        """Drop the imported Relax modules (their weights): a verb that builds once frees
        them before exporting (the build holds its own, prepacked, copy: the executable, or
        BuildResult.weights when they were lifted)."""
        self._relax.clear()

    def build(self, *, database=None, dump_ir: Path | None = None, default_schedules: bool = True,
              without=frozenset(), lift_weights: bool = False, transform=None) -> BuildResult:
        """transform: applied to the imported module before the build (a function of it: the
        import itself is kept for later builds), e.g. compile.decode.entries.add_step_entry."""
        if dump_ir:  # the ONNX-level phase: what TVM imported, and what prepare did
            atomic_write_bytes(dump_ir / "00-prepare.onnx", self.prepared_with_weights().SerializeToString())
            atomic_write_json(dump_ir / "00-prepare.json", self.prepare_report.to_dict())
        with native_output_to_log():
            mod = self.relax(int8="int8-gemm" not in without)
            res = build(mod if transform is None else transform(mod), self.target, database=database, dump_ir=dump_ir,
                        default_schedules=default_schedules, without=without, precision=self.precision.name,
                        lift_weights=lift_weights, dim_bounds=self.binding.bounds_dict())
        res.phases.insert(0, "prepare")
        res.notes[:0] = [n for n in self.import_notes if "int8-gemm" not in without]
        return res


def import_prepared(prepared: onnx.ModelProto, binding: Binding, weights_dir: Path | None = None):
    """import_onnx of a prepared model (prepare ran the checker on it); an import failure
    with dims left unbound says so."""
    try:
        return import_onnx(prepared, {}, check=False, weights_dir=weights_dir)
    except BlockforgeError as e:
        open_dims = binding.unbound()
        if not open_dims:
            raise
        example = ",".join(f"{printable(s.name)}={'x'.join(str(d) if isinstance(d, int) else 'N' for d in s.dims)}"
                           for s in binding.signature()[0])
        raise with_note(e, f" (dims {', '.join(open_dims)} are unbound: exports often import only with "
                           f"static shapes, e.g. {{shape}} {example})", "shape") from None


def open_model(model: str | Path, target: str | dict | ResolvedTarget | None = "host",
               shape: ShapeRequest | dict | str | None = None, *, input_shapes: dict | None = None,
               default_dims: dict[str, int] | None = None, static: bool = False,
               tvm_probe: bool = True, prepare: bool = True, precision: str | None = None) -> Session:
    """Load, check, bind and prepare the model once, in a child process
    (isolate.prepare_untrusted; `tvm_probe`: it also imports the prepared model into TVM
    there), resolving the target and checking it can be built here meanwhile (a refusal of
    the target comes first), and read back what the child made.

    shape: the ShapeRequest (dim names and/or whole input shapes; a parse_dims mapping or
    text is taken too); input_shapes: shapes of user-supplied arrays, binding what the shape
    leaves open; default_dims: bound only where the model has such a dim and nothing else
    bound it; static: every dim must end up bound. target None: nothing is built (inspect,
    verify without a target); prepare=False: the model is only bound and its folded sizes
    checked (Session.prepared is None). precision: a name from targets.precision (None:
    fp32), refused here when the target cannot compute in it, before any verdict on the model
    (the child may have started reading it)."""
    request = dict(shape=ShapeRequest.of(shape).to_dict(), input_shapes={k: list(v) for k, v in (input_shapes or {}).items()},
                   defaults=dict(default_dims or {}), static=static)
    mode = ("tvm" if tvm_probe else "prepare") if prepare else "sizes"
    resolved = {}

    def check_target():
        """While the child reads the model: the target (resolving it imports TVM, 3-4 s) and,
        for a build, the importer's modules, so a toy compile's wall time is not the sum of
        both processes' TVM imports. Its refusals still come before anything about the model."""
        t = None
        if target is not None:
            t = target if isinstance(target, ResolvedTarget) else resolve(target)
        # The precision first: a target that cannot compute in it is refused whatever is installed
        # (installing the cross compiler would not help).
        prec = resolve_precision(precision, t) if t is not None else PRECISIONS["fp32"]
        if t is not None:
            problem = t.build_problem()
            if problem:
                raise BlockforgeError(f"cannot build for {t.name}: {problem}")
            if prepare:
                import blockforge.compile.frontend.converters  # noqa: F401  (TVM's ONNX frontend)
        resolved.update(target=t, precision=prec)

    with native_output_to_log():
        got = prepare_untrusted(model, request, mode=mode, meanwhile=check_target)
    return Session(Path(model), resolved["target"], got.binding, got.model, got.report, got.weights_dir, got,
                   precision=resolved["precision"])
