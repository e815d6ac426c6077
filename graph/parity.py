"""Parity: run the model in ONNX Runtime and the oracle (and any other contender) and compare."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import onnx

from . import ort as ort_runner
from .model_io import check_inputs, model_spec, random_inputs, signature
from .oracle import reference_outputs
from .tolerance import Comparison, OrtSpread, compare, compare_accuracy, output_tolerance
from .weights import make_weights

# (actual, expected): the expected side is the more trusted one.
PAIRS = [("tvm", "ort"), ("tvm", "oracle"), ("ort", "oracle"), ("tvm", "reference"), ("ort", "reference")]
# Runs of the float model a quantized one came from: the oracle (a blockforge export's spec)
# and ORT on verify --reference FP32.onnx.
FLOAT_ORIGINALS = ("oracle", "reference")


@dataclass
class ParityReport:
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    input_issues: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "notes": self.notes,
            "input_issues": self.input_issues,
            "comparisons": [
                {"pair": c.pair, "output": c.output, "max_abs": c.max_abs, "max_rel": c.max_rel,
                 "rel_count": c.rel_count, "count": c.count,  # max_rel: over |expected| > atol
                 "rtol": c.tol.rtol, "atol": c.tol.atol, "step": c.tol.step, "passed": c.passed, "note": c.note,
                 "precision": c.precision or "float", "rel_l2": c.rel_l2, "accuracy_gate": c.gate,
                 "rel_l2_limit": c.tol.rel_l2}  # set: the row judges the whole output (bf16, deep int8)
                for c in self.comparisons
            ],
        }


def prepare_inputs(model: onnx.ModelProto, npz: dict | None, dims: dict[str, int] | None, seed: int):
    ins, _ = signature(model)
    if npz is None:
        inputs = random_inputs(ins, dims, seed)
    else:
        inputs = npz
    check_inputs(ins, inputs)
    return inputs


def oracle_outputs(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The oracle's outputs for blockforge-built models (spec in metadata), else None."""
    spec = model_spec(model)
    if spec is None:
        return None
    weights = make_weights(spec)
    # A row the mask blocks entirely (-inf everywhere) is NaN by the formula (-inf - -inf),
    # in ORT as here; inputs near the dtype's limit overflow. Intended: no RuntimeWarning.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        refs = reference_outputs(spec, weights, inputs)
    names = [o.name for o in model.graph.output]
    out = {names[0]: refs.pop("output")}
    return {**out, **{n: a for n, a in refs.items() if n in names}}  # present_key/present_value


def non_finite_inputs(inputs: dict[str, np.ndarray]) -> list[str]:
    issues = []
    for k, v in inputs.items():
        if v.dtype.kind == "f":
            n_nan, n_inf = int(np.isnan(v).sum()), int(np.isinf(v).sum())
            if n_nan or n_inf:
                issues.append(f"input {k!r} holds {n_nan} NaN and {n_inf} Inf values")
    return issues


def compare_runs(model: onnx.ModelProto, runs: dict[str, dict[str, np.ndarray]],
                 precision: str = "fp32") -> list[Comparison]:
    """precision: the TVM build's (targets.precision); its outputs are held to that precision's
    row (bf16). A quantized model (int8) is compared with ONNX Runtime on the same file at the
    int8 parity row; against a float original (the oracle, --reference) by the accuracy gate:
    the quantization's error is the model's, not ours."""
    kind = tolerance_kind(model)
    quant = model_precision(model)
    out_names = [o.name for o in model.graph.output]
    cmp = []
    for a, b in PAIRS:
        if a not in runs or b not in runs:
            continue
        for name in out_names:
            if name not in runs[a] or name not in runs[b]:
                continue
            actual = runs[a][name]
            if quant != "float" and b in FLOAT_ORIGINALS:
                cmp.append(compare_accuracy(f"{a} vs {b}", name, actual, runs[b][name], quant, kind))
                continue
            row = quant if quant != "float" else (precision if a == "tvm" else "fp32")
            tol = output_tolerance(actual.dtype, kind, row)
            cmp.append(replace(compare(f"{a} vs {b}", name, actual, runs[b][name], tol),
                               precision=quant if quant != "float" else (row if row != "fp32" else "")))
    return cmp


def tolerance_kind(model: onnx.ModelProto) -> str | None:
    """Which rows of graph/tolerance.py hold the model's outputs: a blockforge model's spec kind;
    a quantized one deeper than an encoder block, "deep"; else None (foreign: the block rows)."""
    from .quantize import is_quantized, quantized_depth
    from .tolerance import INT8_BLOCK_DEPTH

    spec = model_spec(model)
    if spec is not None:
        return spec.kind
    return "deep" if is_quantized(model) and quantized_depth(model) > INT8_BLOCK_DEPTH else None


def model_precision(model: onnx.ModelProto) -> str:
    """"int8" for a quantized model (graph/quantize.QUANTIZED_OPS), else "float"."""
    from .quantize import is_quantized

    return "int8" if is_quantized(model) else "float"


def check_parity(model: onnx.ModelProto, inputs: dict[str, np.ndarray],
                 extra_runs: dict[str, dict[str, np.ndarray]] | None = None,
                 ort_device: str = "cpu", ort_outputs: dict[str, np.ndarray] | None = None,
                 precision: str = "fp32", ort_as_written=None) -> ParityReport:
    """ort_outputs: ONNX Runtime's run, when the caller made it (in a bounded child process:
    compile/isolate.run_ort); else it runs here. ort_as_written: () -> ORT's outputs with its
    graph optimizations off, called only when a quantized model's TVM row fails (its spread,
    tolerance.within_spread); None: run here when ORT's run was made here, else no spread."""
    report = ParityReport(input_issues=non_finite_inputs(inputs))
    runs = {"ort": ort_outputs if ort_outputs is not None else ort_runner.run(model, inputs, device=ort_device)}
    oracle = oracle_outputs(model, inputs)
    if oracle is not None:
        runs["oracle"] = oracle
    else:
        report.notes.append("not a blockforge model (no spec in metadata): oracle skipped")
    runs.update(extra_runs or {})
    report.comparisons = compare_runs(model, runs, precision)
    if ort_as_written is None and ort_outputs is None:
        def ort_as_written():
            return ort_runner.run(model, inputs, device=ort_device, optimize=False)
    if ort_as_written is not None:
        _judge_by_spread(runs, report, OrtSpread(ort_as_written))
    _note_known_deviations(model, inputs, runs, report)
    return report


def _judge_by_spread(runs: dict, report: ParityReport, spread: OrtSpread) -> None:
    """A quantized model's failed elementwise TVM-vs-ORT rows, judged again against ORT's own
    spread on the file (tolerance.within_spread): ORT as written runs once, only for them."""
    failed = [c for c in report.comparisons if c.pair == "tvm vs ort" and c.precision == "int8" and not c.passed
              and c.tol.rel_l2 is None]
    if not failed:
        return
    again = {id(c): spread.judge(c, runs["tvm"][c.output], runs["ort"][c.output]) for c in failed}
    report.comparisons = [again.get(id(c), c) for c in report.comparisons]
    if any(again[k].passed for k in again):
        report.notes.append("int8: an output beyond the int8 parity row passes where it is no farther from ONNX "
                            "Runtime than ONNX Runtime's own run of the file as written (optimizations off) is "
                            "(graph/tolerance.py within_spread)")


def _note_known_deviations(model: onnx.ModelProto, inputs: dict[str, np.ndarray], runs: dict, report) -> None:
    """A TVM-vs-ORT failure on a model where ORT is known to depart from the ONNX reference
    (ort_deviations.KNOWN): when TVM matches the reference, the row says so. It stays a FAIL
    (it does differ from ORT); the note tells the user which side follows the specification."""
    from .ort_deviations import deviations_in, reference_outputs

    failed = [c for c in report.comparisons if c.pair == "tvm vs ort" and not c.passed]
    known = deviations_in(model) if failed else []
    if not known:
        return
    ref = reference_outputs(model, inputs)
    matches = {id(c) for c in failed if c.output in ref and
               compare("tvm vs reference", c.output, runs["tvm"][c.output], ref[c.output], c.tol).passed}
    if not matches:
        return
    row = "TVM matches the ONNX reference; ORT is known to depart here, see note"
    report.comparisons = [replace(c, note="; ".join(filter(None, [c.note, row]))) if id(c) in matches else c
                          for c in report.comparisons]
    report.notes.append("FAIL vs ORT where ORT is known to depart from the ONNX reference (onnx.reference), "
                        "which TVM matches: " + "; ".join(d.what for d in known))
