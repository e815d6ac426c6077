"""float16 models computed in float32 on CPU, as ONNX Runtime's CPU provider computes them.

ORT's CPU provider has no float16 MatMul/Softmax/Gelu kernels: its graph optimizer casts the
float16 inputs and weights to float32 once, runs the whole graph in float32 and casts the
outputs back (seen in its optimized graph: Cast nodes at the inputs and the output only).
Keeping float16 storage between ops (ToMixedPrecision's scheme) rounds every intermediate
to float16 instead, and an intermediate beyond 65504 becomes inf where ORT's stays finite:
measured on an MHA (d_model 64, 4 heads, seq 16) with inputs x300, the QK^T scores reach
1.4e6 (3.6e5 after the 1/sqrt(d_k) scale) and TVM gave 1024 NaN of 1024 outputs against
ORT's 0; an FFN with inputs 60000 gave 1024 Inf against ORT's 96 (only where the output
itself overflows float16).

So the function keeps its float16 signature and computes in float32 inside: parameters
are cast on entry, float16 constants (the weights) become float32 constants, matmuls
produce float32, and the results are cast back to float16 at the return. An op that names
float16 itself (an explicit Cast to float16, a call into a float16 PrimFunc) keeps it, with
casts around it, as ORT keeps the model's own Cast nodes.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

from blockforge.errors import raise_if_stopped

from blockforge.compile.passes.kernels import replace_functions

F16, F32 = "float16", "float32"
_DTYPE_ATTRS = ("dtype", "out_dtype")


class _Unsupported(Exception):
    """A function shape this pass does not rewrite (it then keeps the previous scheme)."""


def _is_f16(ty) -> bool:
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == F16


def _mentions_f16(ty) -> bool:
    if _is_f16(ty):
        return True
    return isinstance(ty, tvm.ir.TupleType) and any(_mentions_f16(t) for t in ty.fields)


def _names_f16(call: relax.Call) -> bool:
    """The op itself asks for float16 (an attribute), or calls typed float16 code."""
    attrs = call.attrs
    if attrs is not None:
        for name in _DTYPE_ATTRS:
            v = getattr(attrs, name, None)
            if v is not None and str(v) == F16:
                return True
    return bool(call.ty_args) and any(_is_f16(t) for t in call.ty_args)


class _Rewriter:
    def __init__(self, bb: relax.BlockBuilder):
        self.bb = bb
        self.env: dict = {}  # old Var -> new expression (float32 where the old one was float16)

    def expr(self, e):
        if isinstance(e, relax.Var):
            if e not in self.env:
                raise _Unsupported(f"free variable {e.name}")
            return self.env[e]
        if isinstance(e, tvm.ir.Constant):
            if _is_f16(e.ty):
                return relax.const(e.value.numpy().astype(F32), F32)
            return e
        if isinstance(e, relax.Tuple):
            return relax.Tuple([self.expr(f) for f in e.fields])
        if isinstance(e, relax.TupleGetItem):
            return relax.TupleGetItem(self.expr(e.tuple_value), e.index)
        if isinstance(e, relax.Call):
            return self.call(e)
        if not _mentions_f16(getattr(e, "ty", None)):
            return e  # shapes, prim values, strings, functions
        raise _Unsupported(type(e).__name__)

    def call(self, c: relax.Call):
        if isinstance(c.op, tvm.ir.Op) and c.op.name == "relax.matmul":
            a, b = self.expr(c.args[0]), self.expr(c.args[1])
            out = c.attrs.out_dtype
            return relax.op.matmul(a, b, out_dtype=F32 if out is None or str(out) in (F16, "void", "") else out)
        if not _names_f16(c):
            return relax.Call(c.op, [self.expr(a) for a in c.args], c.attrs, c.ty_args)
        # The op stays float16: its float16 arguments go back to float16, its result up to float32.
        args = [self._to_f16_like(self.expr(a), a.ty) for a in c.args]
        inner = self.bb.emit(relax.Call(c.op, args, c.attrs, c.ty_args))
        return self._to_f32(inner)

    def _to_f16_like(self, new, old_ty):
        if _is_f16(old_ty):
            return relax.op.astype(new, F16)
        if isinstance(old_ty, tvm.ir.TupleType):
            fields = [self._to_f16_like(self.bb.emit(relax.TupleGetItem(new, i)), t)
                      for i, t in enumerate(old_ty.fields)]
            return relax.Tuple(fields)
        return new

    def _to_f32(self, new):
        ty = new.ty
        if _is_f16(ty):
            return relax.op.astype(new, F32)
        if isinstance(ty, tvm.ir.TupleType):
            return relax.Tuple([self._to_f32(self.bb.emit(relax.TupleGetItem(new, i)))
                                for i in range(len(ty.fields))])
        return new

    def back(self, new, old_ty):
        """The function's result in its declared (float16) types."""
        if _is_f16(old_ty):
            return relax.op.astype(new, F16)
        if isinstance(old_ty, tvm.ir.TupleType):
            return relax.Tuple([self.back(self.bb.emit(relax.TupleGetItem(new, i)), t)
                                for i, t in enumerate(old_ty.fields)])
        return new


def _convert(name: str, func: relax.Function) -> relax.Function:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise _Unsupported("body is not a sequence of bindings")
    bb = relax.BlockBuilder()
    params = [relax.Var(p.name, p.ty) for p in func.params]
    rw = _Rewriter(bb)
    with bb.function(name, params):
        with bb.dataflow():
            for old, new in zip(func.params, params):
                rw.env[old] = bb.emit(relax.op.astype(new, F32)) if _is_f16(old.ty) else new
            for block in body.blocks:
                for binding in block.bindings:
                    if not isinstance(binding, relax.VarBinding):
                        raise _Unsupported(type(binding).__name__)
                    rw.env[binding.var] = bb.emit(rw.expr(binding.value))
            out = bb.emit_output(rw.back(rw.expr(body.body), body.body.ty))
        bb.emit_func_output(out)
    new = bb.get()[name]
    return new.with_attrs(dict(func.attrs)) if func.attrs else new


def _has_f16(func: relax.Function) -> bool:
    return any(_is_f16(p.ty) for p in func.params)


@tvm.transform.module_pass(opt_level=0, name="BlockforgeFloat16AsFloat32")
def float16_as_float32(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    converted = {}
    for gv, func in mod.functions_items():
        if not (isinstance(func, relax.Function) and _has_f16(func)):
            continue
        try:
            converted[gv] = _convert(gv.name_hint, func)
        except Exception as e:  # _Unsupported, or TVM refusing an op's new types
            raise_if_stopped()
            # Not a shape we rewrite: float16 storage with float32 accumulation, as before.
            logging.getLogger("blockforge").warning("float16 function %s kept in float16 (%s)", gv.name_hint, e)
            return relax.transform.ToMixedPrecision(out_dtype=F32)(mod)
    return replace_functions(mod, converted)
