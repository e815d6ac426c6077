"""Divisions TVM's simplifier would fold into a compile-time "Divide by zero" error.

TIR's arithmetic simplifier rewrites `x - x` to 0 and then refuses to fold `0.0 / 0.0`
(ICHECK "Divide by zero"): a valid float model computing `(x-x)/(x-x)` failed to build,
where ONNX Runtime returns NaN. Floating-point division by zero is defined (IEEE 754: NaN
or +-inf), so such a division is kept for run time, its operands hidden from the simplifier
behind a bit-preserving reinterpret (a no-op in the generated code).

Integer division by zero is undefined in ONNX (ONNX Runtime refuses it when the model
runs; on x86 the instruction traps): a model that always does it is refused at compile
time with one line that says so, not TVM's check failure.
"""

from __future__ import annotations

import tvm

from blockforge.errors import BlockforgeError

from blockforge.compile.passes.kernels import map_prim_funcs

_SAME_WIDTH_INT = {"float16": "int16", "bfloat16": "int16", "float32": "int32", "float64": "int64"}


def _opaque(e):
    """`e` with the same bits, in a form the simplifier does not look through."""
    from tvm import tirx

    dtype = str(e.ty)
    return tirx.reinterpret(dtype, tirx.reinterpret(_SAME_WIDTH_INT[dtype], e))


def _rewrite(func, analyzer, integer_divisions: list):
    import tvm_ffi
    from tvm import tirx

    def division(d):
        den = analyzer.simplify(d.b)
        if isinstance(den, tirx.FloatImm) and den.value == 0 and str(d.ty) in _SAME_WIDTH_INT:
            return type(d)(_opaque(d.a), _opaque(d.b))
        if isinstance(den, tirx.IntImm) and den.value == 0:
            integer_divisions.append(d)  # reported after the walk: an exception here would lose its text
        return d

    def store(s):  # values only: index arithmetic never divides by a model's data
        return tvm_ffi.structural_map(s, ((tirx.Div, tirx.FloorDiv, tirx.Mod, tirx.FloorMod), division))

    return tvm_ffi.structural_map(func, (tirx.BufferStore, store))


INTEGER_DIVISION_BY_ZERO = "blockforge.integer_division_by_zero"  # module attr: the PrimFunc's name


@tvm.transform.module_pass(opt_level=0, name="BlockforgeIEEEDivision")
def ieee_division(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Float divisions by a zero the simplifier can prove: kept for run time. An integer one
    is marked on the module (an exception raised in a pass reaches the caller as TVM's
    RuntimeError): check_integer_division() after the phase raises it."""
    import tvm.sym

    analyzer = tvm.sym.Analyzer()
    integer: list[str] = []

    def rewrite(gv, func):
        found: list = []
        new = _rewrite(func, analyzer, found)
        if found:
            integer.append(gv.name_hint)
        return new

    mod = map_prim_funcs(mod, rewrite)
    return mod.with_attr(INTEGER_DIVISION_BY_ZERO, integer[0]) if integer else mod


def check_integer_division(mod) -> None:
    where = (mod.attrs or {}).get(INTEGER_DIVISION_BY_ZERO) if mod.attrs is not None else None
    if where:
        raise BlockforgeError(f"the model divides integers by zero (in {where}): integer division by zero is "
                              "undefined in ONNX, and ONNX Runtime refuses it when the model runs")
