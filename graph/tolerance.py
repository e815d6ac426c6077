"""The one tolerance table, by dtype and scope; tests and `verify` both read it.

A value passes when |actual - expected| <= atol + rtol * |expected| (numpy.isclose).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


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
}


def tolerance_for(dtype: str, kind: str) -> Tolerance:
    """kind is the spec kind ("mha", "ffn", "block") or a scope ("op", "block")."""
    scope = "block" if kind == "block" else "op"
    return TOLERANCES[(str(np.dtype(dtype)), scope)]


@dataclass(frozen=True)
class Comparison:
    pair: str
    output: str
    max_abs: float
    max_rel: float
    tol: Tolerance
    passed: bool
    note: str = ""


def compare(pair: str, output: str, actual: np.ndarray, expected: np.ndarray, tol: Tolerance) -> Comparison:
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return Comparison(pair, output, float("inf"), float("inf"), tol, False,
                          f"shape {a.shape} != {e.shape}")
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
    max_rel = float((err / np.maximum(np.abs(e), np.finfo(np.float32).tiny)).max()) if err.size else 0.0
    passed = bool(np.all(err <= tol.atol + tol.rtol * np.abs(e)))
    return Comparison(pair, output, max_abs, max_rel, tol, passed, note)
