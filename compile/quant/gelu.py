"""gelu in 32 cubic segments, read with VPERMI2PS: the int8 epilogue's gelu on AVX-512.

gelu(x) = relu(x) - h(|x|), with h(t) = t * Phi(-t) (even in x, 0 at 0, 0.17 at its peak, 2.6e-7
at t = 16/3). h on [0, 16/3) in 32 segments of 1/6, a cubic in t each (least squares on
Chebyshev nodes; coefficients rounded to float32); t clamped just below 16/3, where h is below
float32's resolution of the result. Each of the four coefficients is one 32-entry table, two zmm
registers: VPERMI2PS picks 16 lanes' coefficients by their segment in one instruction.

Per 16 outputs: and, min, mul, cvt, 4 VPERMI2PS, 3 FMA, max, sub (13 instructions, 4 on the
multiply pipes) where topi.fast_erf's rational gelu (fast_math.gelu) takes 18 with a VDIVPS,
Zen 4's slowest vector op (16 on the multiply pipes). Max abs error against the exact gelu,
float32 as the kernel computes it: 4.8e-7 (fast_erf's: 3e-7; 16 segments of 1/3 with VPERMPS:
6e-6, at 0). Where the int8 output differs from fast_erf's (a value within that of a rounding
boundary) it is by one level, as the reciprocal quantize's. Measured: Epilogue.gelu_segments.

The tables enter the TE expression as a select on the lane (the output column mod 16); in a
loop vectorized by 16 whose first column is a multiple of 16 (the int8 epilogue's) the lane is
the constant ramp 0..15 and LLVM folds each select into a constant vector: a VPERMI2PS operand.
Only valid there: a scalar evaluation would permute a scalar."""

from __future__ import annotations

import functools

import numpy as np

SEGMENTS = 32
WIDTH = 1.0 / 6.0  # of a segment: the index is t * 6
DEGREE = 3
T_MAX = np.float32(SEGMENTS * WIDTH) * np.float32(1 - 2.0 ** -20)  # below 16/3: the last index 15


def _h(t):
    from scipy.special import erfc

    return t * 0.5 * erfc(t / np.sqrt(2.0))


@functools.lru_cache(maxsize=1)
def coefficients() -> np.ndarray:
    """(SEGMENTS, DEGREE + 1) float32, highest power first, in the global t (no per-segment
    offset: an FMA chain straight from t)."""
    out = []
    nodes = np.cos(np.pi * (np.arange(64) + 0.5) / 64)
    for s in range(SEGMENTS):
        lo, hi = s * WIDTH, (s + 1) * WIDTH
        t = (lo + hi) / 2 + (hi - lo) / 2 * nodes
        v = np.vander(t, DEGREE + 1)
        if s == 0:  # through h(0) = 0: gelu(0) is 0 exactly, a zero activation its zero point
            c = np.append(np.linalg.lstsq(v[:, :-1], _h(t), rcond=None)[0], 0.0)
        else:
            c, *_ = np.linalg.lstsq(v, _h(t), rcond=None)
        out.append(c)
    return np.asarray(out, np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    """What the kernel computes, in numpy float32 (the kernel's FMAs round once where this
    rounds twice: within an ulp or two)."""
    x = np.asarray(x, np.float32)
    c = coefficients()
    t = np.minimum(np.abs(x), T_MAX)
    idx = (t * np.float32(1 / WIDTH)).astype(np.int32)
    h = c[idx, 0]
    for d in range(1, DEGREE + 1):
        h = (h * t + c[idx, d]).astype(np.float32)
    return (np.maximum(x, np.float32(0)) - h).astype(np.float32)


def gelu_segments(x):
    """The TE compute of gelu on `x` (its last axis the vectorized columns, see the module's
    note)."""
    from tvm import te, tirx

    c = coefficients()
    f32 = lambda v: tirx.const(float(v), "float32")  # noqa: E731

    def table(lane, d, half):  # segments 16 * half.. of column d: a constant vector once `lane` is the ramp
        e = f32(c[16 * half + 15, d])
        for s in range(14, -1, -1):
            e = tirx.Select(lane == s, f32(c[16 * half + s, d]), e)
        return e

    def body(*i):
        v = x[i]
        lane = i[-1] % 16
        t = te.min(te.abs(v), f32(T_MAX))
        idx = (t * f32(1 / WIDTH)).astype("int32")  # bit 4: the second table
        coef = [tirx.call_llvm_pure_intrin("float32", "llvm.x86.avx512.vpermi2var.ps.512", table(lane, d, 0), idx,
                                           table(lane, d, 1)) for d in range(DEGREE + 1)]
        h = coef[0]
        for d in range(1, DEGREE + 1):
            h = h * t + coef[d]
        return te.max(v, f32(0)) - h

    return te.compute(x.shape, body, name="gelu_segments")
