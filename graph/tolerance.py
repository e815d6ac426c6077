"""The one tolerance table, by dtype (precision) and scope; tests and `verify` both read it.

A value passes when |actual - expected| <= atol + step * max|expected| + rtol * |expected|
(numpy.isclose, plus `step`: a share of the output's range, for quantized models); a row
with rel_l2 judges the whole output instead: ||actual - expected||_2 / ||expected||_2 (bf16).

Quantized models get two rows of their own, for two different questions:
- parity (TOLERANCES["int8", ...]): blockforge on a quantized file against ONNX Runtime on
  the SAME file. int32 accumulation is exact, so the two differ only where a requantize
  rounds a value on the other side of a half step, spread by the GEMM after it: a few
  8-bit steps of the output's range (INT8_STEPS).
- accuracy (ACCURACY): the quantized model against its float original, as a relative L2
  error, ||q - f|| / ||f||: what quantization costs, not whether we computed it right.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    rel_l2: float | None = None  # set: the output passes on its relative L2 error (rtol/atol unused)
    step: float = 0.0  # allowance as a share of max|expected| (int8: one step of 255)


INT8_STEPS = 4  # int8 parity: 8-bit steps of the output's range (measured up to 2.5, below)
# Deeper than one encoder block (graph/quantize.quantized_depth: BERT-base layer 4 dynamic, 6
# QDQ) a quantized model is judged as a whole ("deep" rows): over 12 layers each flip is
# requantized and spread again, and two correct int8 engines part by far more than the steps.
INT8_BLOCK_DEPTH = 6

TOLERANCES: dict[tuple[str, str], Tolerance] = {
    # A single MHA/FFN: float32 GEMMs over d_model/d_ff terms differ from the float64
    # oracle by summation order only.
    ("float32", "op"): Tolerance(rtol=1e-4, atol=1e-5),
    # Whole blocks: LayerNormalization divides by a per-row std, amplifying absolute
    # error of the residual stream, and errors of two sublayers add up. Foreign models of any
    # depth get this row, and a deep one's summation-order error scales with its activations'
    # range, not with each element: ResNet-50 (random weights, output max 285, rms 50) against
    # ORT without graph optimizations, max |error| 2.6e-4 for ORT's optimized graph, 5.3e-4
    # OpenVINO f32, 6.1e-4 blockforge (rel L2 0.8e-6 / 1.6e-6 / 1.7e-6): two correct engines
    # failed rtol + atol (max rel 3.2e-4 on elements near 1). `step` adds 1e-5 of max|expected|
    # (2.9e-3 there, ~4.5x blockforge's error; a wrong computation is off by O(1)).
    ("float32", "block"): Tolerance(rtol=1e-4, atol=1e-4, step=1e-5),
    # float16 keeps 11 significant bits (eps ~ 9.8e-4); every intermediate (scores,
    # softmax, hidden activations of width d_ff) is rounded to it once or more.
    ("float16", "op"): Tolerance(rtol=1e-3, atol=2.5e-3),
    ("float16", "block"): Tolerance(rtol=1e-2, atol=1e-2),
    # --precision bf16 (float32 in and out, GEMMs on bf16 operands): 8 significant bits, so
    # single elements near a cancellation are off by any ratio; the output as a whole is
    # judged. OpenVINO's bf16 on BERT-base blocks at seq 128 (issue #19, vs fp32): FFN
    # 3.4e-3, MHA 5.5e-3, block 2.6e-3; the limit is ~2x the worst of those.
    ("bfloat16", "op"): Tolerance(rtol=0.0, atol=0.0, rel_l2=1e-2),
    ("bfloat16", "block"): Tolerance(rtol=0.0, atol=0.0, rel_l2=1e-2),
    # int8 (QDQ static, dynamic, QLinearMatMul/QGemm/MatMulIntegerToFloat) against ORT on
    # the same quantized file: the float32 row for the float parts, plus INT8_STEPS 8-bit
    # steps of the output's range. int32 accumulation is exact; what differs is a requantize
    # after a float op (softmax before PV, a bias add) rounding the other way, which the next
    # GEMM spreads over a row. Measured: d_model 64 FFN/MHA/block (dynamic, QDQ S8S8
    # per-channel, U8S8; 2 seeds) max |tvm - ort| / max|ort| <= 2.0e-7 (no flip); BERT-base
    # QDQ MHA 2.0 steps and block 2.5 steps, in one row of 128 -- there ORT is the one that
    # departs from onnx.reference (0.2% of elements, row 111, with ORT's optimizations off
    # too), which blockforge matches (0.001% of elements above 1e-5).
    ("int8", "op"): Tolerance(rtol=1e-4, atol=1e-5, step=INT8_STEPS / 255),
    ("int8", "block"): Tolerance(rtol=1e-4, atol=1e-4, step=INT8_STEPS / 255),
    # Deep int8 (BERT-base 12 layers, seq 128, seeds 0/1, against ORT on the same file):
    # dynamic: blockforge max 4.5-5.1 steps of max|ORT|/255, rel L2 1.6e-2; OpenVINO 3.9-4.3,
    # 1.6e-2. Static QDQ: blockforge max 11.9-12.1 steps, 13-15% of elements beyond 4 steps, rel L2
    # 4.6-4.9e-2; OpenVINO 13.0-13.3 steps, rel L2 4.8-4.9e-2 -- as far as ORT's own int8 is from
    # the float model (5.3e-2). So the whole output is judged, 2x the worst measured; a wrong
    # scale, zero point or layout is off by O(1).
    ("int8", "deep"): Tolerance(rtol=0.0, atol=0.0, rel_l2=1e-1),
}

# Relative L2 error a quantized model may show against its float original (ORT or
# blockforge alike: they compute the same quantized sum). Bounds ~2x the largest measured:
# BERT-base (issue #19): FFN 2.4e-2, MHA 1.1e-1 (QDQ static quantizes QK^T and PV too),
# block 2.7e-2; d_model 64 (random calibration): FFN 1.6-2.4e-2, MHA 1.9e-2 dynamic and
# 4.5-8.1e-2 static, block 1.2e-2 dynamic and 1.8-3.4e-2 static.
ACCURACY: dict[tuple[str, str], float] = {
    ("int8", "ffn"): 5e-2,
    ("int8", "mha"): 2.5e-1,
    ("int8", "block"): 7e-2,
    # BERT-base 12 layers (ORT int8 vs ORT float, seq 128): dynamic 2.8e-2, static QDQ 5.3e-2
    ("int8", "deep"): 1e-1,
}
PRECISION_DTYPE = {"bf16": "bfloat16"}  # a build's precision -> the row its outputs are held to


def _scope(kind: str | None) -> str:
    return kind if kind in ("block", "deep") else "op"


def tolerance_for(dtype: str, kind: str) -> Tolerance:
    """kind is the spec kind ("mha", "ffn", "block") or a scope ("op", "block"; "deep" is
    int8's alone: a float model of any depth is held to its block row)."""
    scope = "block" if kind == "deep" else _scope(kind)
    return TOLERANCES[(str(np.dtype(dtype)), scope)]


def tolerance_for_precision(precision: str, kind: str) -> Tolerance:
    return TOLERANCES[(precision, "block" if kind == "deep" and precision != "int8" else _scope(kind))]


def accuracy_gate(precision: str, spec_kind: str | None) -> float:
    """The largest relative L2 error a `precision` model may show against its float original;
    foreign graphs (no spec) get the whole-block bound."""
    return ACCURACY[(precision, spec_kind or "block")]


def output_tolerance(dtype, spec_kind: str | None, precision: str | None = None) -> Tolerance:
    """The row one model output is compared with (verify and bench alike): foreign graphs
    (no spec) get the looser whole-block row; dtypes without a row of their own (integers,
    bool, float64) float32's. precision: "int8" (a quantized model): its parity row, whatever
    dtype its float output has; "bf16" (the build's, targets.precision): the bf16 row for
    float32 outputs; None/"fp32"/"float": the dtype's row."""
    kind = spec_kind or "block"
    if precision == "int8":
        return tolerance_for_precision("int8", kind)
    if precision in PRECISION_DTYPE and str(dtype) == "float32":
        return tolerance_for_precision(PRECISION_DTYPE[precision], kind)
    try:
        return tolerance_for(dtype, kind)
    except (KeyError, TypeError):
        return tolerance_for("float32", kind)


@dataclass(frozen=True)
class Comparison:
    """max_rel is taken only over elements where the relative term governs the tolerance,
    rtol * |expected| >= atol (rel_count of them; None when there are none). Below that, atol
    decides, and |err| / |expected| says nothing: an FFN at d_model 64 showed max rel 1.3e-4
    (> rtol 1e-4) from |expected| = 1.1e-3, |err| = 1.4e-7, 70x under atol; over |expected| >
    atol alone it still did, over rtol * |expected| >= atol it is 2.8e-6.
    tol_used is max |err| / (atol + rtol * |expected|): the share of the allowance the worst
    element uses; the comparison passes when it is <= 1."""

    pair: str
    output: str
    max_abs: float
    max_rel: float | None
    tol: Tolerance
    passed: bool
    note: str = ""
    rel_count: int = 0  # elements the relative error is taken over (rtol * |expected| >= atol)
    count: int = 0  # elements compared
    tol_used: float = float("nan")  # max |err| / (atol + rtol * |expected|)
    precision: str = ""  # "int8": a quantized model ("" float)
    rel_l2: float | None = None  # ||actual - expected|| / ||expected||
    gate: float | None = None  # set: an accuracy comparison, passed when rel_l2 <= gate

    @property
    def rel_floor(self) -> float:
        """|expected| from which the relative error counts: atol / rtol."""
        return self.tol.atol / self.tol.rtol if self.tol.rtol > 0 else float("inf")


def compare(pair: str, output: str, actual: np.ndarray, expected: np.ndarray, tol: Tolerance,
            floor: float = 0.0) -> Comparison:
    """floor: an allowance no element's is below (within_spread's); 0: the row's alone."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return Comparison(pair, output, float("inf"), float("inf"), tol, False,
                          f"shape {a.shape} != {e.shape}", tol_used=float("inf"))
    bad_a, bad_e = ~np.isfinite(a), ~np.isfinite(e)
    if bad_a.any() or bad_e.any():
        # Non-finite values only agree when both sides have the same ones.
        same = np.array_equal(bad_a, bad_e) and np.array_equal(a[bad_a], e[bad_e], equal_nan=True)
        note = f"non-finite values: {int(bad_a.sum())} vs {int(bad_e.sum())}"
        if not same:
            return Comparison(pair, output, float("nan"), float("nan"), tol, False, note)
        a, e = a[~bad_a], e[~bad_e]
    else:
        note = ""
    err = np.abs(a - e)
    max_abs = float(err.max()) if err.size else 0.0
    if tol.rel_l2 is not None:
        norm = float(np.linalg.norm(e))
        rel = float(np.linalg.norm(a - e)) / norm if norm > 0 else (0.0 if max_abs == 0 else float("inf"))
        note = "; ".join(filter(None, [note, f"rel L2 {rel:.2e}"]))
        nz = e != 0
        max_rel = float((err[nz] / np.abs(e[nz])).max()) if nz.any() else None
        return Comparison(pair, output, max_abs, max_rel, tol, rel <= tol.rel_l2, note, int(nz.sum()), int(err.size),
                          rel / tol.rel_l2, rel_l2=rel)
    allowed = np.maximum(tol.atol + tol.step * (float(np.abs(e).max()) if e.size else 0.0) + tol.rtol * np.abs(e),
                         floor)
    big = (tol.rtol * np.abs(e) >= tol.atol) & (e != 0)  # where rtol, not atol, sets the allowance
    rel_count = int(big.sum())
    max_rel = float((err[big] / np.abs(e[big])).max()) if rel_count else None
    passed = bool(np.all(err <= allowed))
    with np.errstate(divide="ignore", invalid="ignore"):  # atol = 0 and expected = 0: inf unless exact
        used = np.where(err == 0, 0.0, err / allowed)
    tol_used = float(used.max()) if err.size else 0.0
    return Comparison(pair, output, max_abs, max_rel, tol, passed, note, rel_count, int(err.size), tol_used,
                      rel_l2=rel_l2(a, e))


def rel_l2(actual: np.ndarray, expected: np.ndarray) -> float:
    a, e = np.asarray(actual, dtype=np.float64).ravel(), np.asarray(expected, dtype=np.float64).ravel()
    ok = np.isfinite(a) & np.isfinite(e)
    den = float(np.linalg.norm(e[ok]))
    num = float(np.linalg.norm(a[ok] - e[ok]))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def compare_accuracy(pair: str, output: str, actual: np.ndarray, expected: np.ndarray, precision: str,
                     spec_kind: str | None) -> Comparison:
    """A quantized output against its float original: passes when the relative L2 error is
    within the precision's gate (elementwise figures are reported, not judged)."""
    gate = accuracy_gate(precision, spec_kind)
    c = compare(pair, output, actual, expected, Tolerance(rtol=0.0, atol=0.0))
    if c.note.startswith("shape") or c.max_abs != c.max_abs:  # a shape or non-finite mismatch stays a failure
        return replace(c, precision=precision, gate=gate)
    ok = c.rel_l2 is not None and c.rel_l2 <= gate
    note = f"{precision} vs float: rel L2 err {c.rel_l2:.2e} {'<=' if ok else '>'} gate {gate:g}"
    return replace(c, passed=ok, note="; ".join(filter(None, [c.note, note])), precision=precision, gate=gate,
                   tol_used=c.rel_l2 / gate)


# int8 parity against ORT's own spread. ORT runs a quantized file two ways that are both the
# file's computation: with its graph optimizations (fused int8 kernels: what bench and verify
# run) and as written (ORT_DISABLE_ALL). Where a value lies on a rounding tie they part by whole
# requantize steps, and so may blockforge. An output beyond the int8 row but no farther from
# ORT than ORT's two runs are from each other is as close as the reference is to itself: it
# passes, and says so. Measured: BERT-base QDQ MHA at seq 512 (its softmax output quantized at
# a scale calibrated on 32-token batches): ORT optimized vs as written 1.91x the row (184 of
# 393,216 elements beyond it), blockforge vs ORT 1.91x (685). At most SPREAD_CAP x the row's
# step allowance: farther apart, one of ORT's runs is broken, not rounded.
SPREAD_CAP = 4.0


def within_spread(c: Comparison, actual: np.ndarray, expected: np.ndarray, written: np.ndarray) -> Comparison:
    """A failed elementwise int8 row `c` (actual against ORT's optimized run `expected`)
    judged again with ORT's spread, max |expected - written| (`written`: ORT's run as written),
    as the least allowance of every element (capped at SPREAD_CAP times the row's steps)."""
    e, w = np.asarray(expected, np.float64), np.asarray(written, np.float64)
    if c.passed or c.tol.step <= 0 or c.tol.rel_l2 is not None or e.shape != w.shape or not e.size \
            or not (np.isfinite(e).all() and np.isfinite(w).all()):
        return c
    spread = float(np.abs(e - w).max())
    cap = SPREAD_CAP * c.tol.step * float(np.abs(e).max())
    again = compare(c.pair, c.output, actual, expected, c.tol, floor=min(spread, cap))
    spread_note = (f"ONNX Runtime's own spread on this file (optimized vs as written): max {spread:.2e}"
                   + (f", capped at {SPREAD_CAP:g}x the row's steps" if spread > cap else ""))
    if again.passed:
        note = f"beyond the int8 row ({c.tol_used:.3g}x) but within {spread_note}"
    else:
        note = f"beyond the int8 row ({c.tol_used:.3g}x) and beyond {spread_note}"
    # tol_used stays the row's: the figure the user compares with the row
    return replace(c, passed=again.passed, note="; ".join(filter(None, [c.note, note])))


class OrtSpread:
    """ORT's outputs on a quantized file as written (graph optimizations off), made at most once
    and only when a row needs them: the spread within_spread allows a failed int8 row. One
    holder for parity (verify), bench's check and whole_ab. `run`: () -> {output name: array}."""

    def __init__(self, run):
        self._run = run
        self._outputs: dict | None = None

    def outputs(self) -> dict:
        if self._outputs is None:
            self._outputs = self._run()
        return self._outputs

    def judge(self, c: Comparison, actual: np.ndarray, expected: np.ndarray, output: str | None = None) -> Comparison:
        """`c` again within the spread where it failed and the as-written run has the output
        (`output`: its name there, default c.output); a passed row never pays for the run."""
        if c.passed:
            return c
        written = self.outputs().get(c.output if output is None else output)
        return c if written is None else within_spread(c, actual, expected, written)
