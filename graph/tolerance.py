"""The one tolerance table, by dtype and scope; tests and `verify` both read it.

A value passes when |actual - expected| <= atol + rtol * |expected| (numpy.isclose); a row
with rel_l2 judges the whole output instead: ||actual - expected||_2 / ||expected||_2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    rel_l2: float | None = None  # set: the output passes on its relative L2 error (rtol/atol unused)


TOLERANCES: dict[tuple[str, str], Tolerance] = {
    # A single MHA/FFN: float32 GEMMs over d_model/d_ff terms differ from the float64
    # oracle by summation order only.
    ("float32", "op"): Tolerance(rtol=1e-4, atol=1e-5),
    # Whole blocks: LayerNormalization divides by a per-row std, amplifying absolute
    # error of the residual stream, and errors of two sublayers add up.
    ("float32", "block"): Tolerance(rtol=1e-4, atol=1e-4),
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
}
PRECISION_DTYPE = {"bf16": "bfloat16"}  # a build's precision -> the row its outputs are held to


def tolerance_for(dtype: str, kind: str) -> Tolerance:
    """kind is the spec kind ("mha", "ffn", "block") or a scope ("op", "block")."""
    scope = "block" if kind == "block" else "op"
    return TOLERANCES[(str(np.dtype(dtype)), scope)]


def output_tolerance(dtype, spec_kind: str | None, precision: str = "fp32") -> Tolerance:
    """The row one model output is compared with (verify and bench alike): foreign graphs
    (no spec) get the looser whole-block row; dtypes without a row of their own (integers,
    bool, float64) float32's. precision: the build's (targets.precision); bf16 has its row."""
    kind = spec_kind or "block"
    if precision in PRECISION_DTYPE and str(dtype) == "float32":
        return TOLERANCES[(PRECISION_DTYPE[precision], "block" if kind == "block" else "op")]
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

    @property
    def rel_floor(self) -> float:
        """|expected| from which the relative error counts: atol / rtol."""
        return self.tol.atol / self.tol.rtol if self.tol.rtol > 0 else float("inf")


def compare(pair: str, output: str, actual: np.ndarray, expected: np.ndarray, tol: Tolerance) -> Comparison:
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
                          rel / tol.rel_l2)
    allowed = tol.atol + tol.rtol * np.abs(e)
    big = (tol.rtol * np.abs(e) >= tol.atol) & (e != 0)  # where rtol, not atol, sets the allowance
    rel_count = int(big.sum())
    max_rel = float((err[big] / np.abs(e[big])).max()) if rel_count else None
    passed = bool(np.all(err <= allowed))
    with np.errstate(divide="ignore", invalid="ignore"):  # atol = 0 and expected = 0: inf unless exact
        used = np.where(err == 0, 0.0, err / allowed)
    tol_used = float(used.max()) if err.size else 0.0
    return Comparison(pair, output, max_abs, max_rel, tol, passed, note, rel_count, int(err.size), tol_used)
