"""SDPA's NaN guard on a softmax as an ordered comparison: where(isnan(p), c, p) with p =
softmax(x) becomes where(p >= 0, p, c).

PyTorch's scaled_dot_product_attention exports `where(isnan(softmax), 0, softmax)` so a fully
masked row (all -inf: softmax gives NaN) reads 0. The fused attention kernel takes it in float
models; where it is not fused (a QDQ model's attention, the softmax then quantized) TVM lowers the
select on T.isnan badly: with the 8-bit quantize after it (P for the int8 P V product) the
softmax kernel's parallel body held 256 vpextrb, 48 gathers and a scalar path per lane, 3.8-4.0 ms
for a 12 x 512 x 512 P where the same without the guard ran 0.87 ms. A softmax is in [0, 1] or
NaN, and `p >= 0` is false exactly for NaN: the same values, c included, for any c, -0.0 too.
(`p != p` is no substitute: TVM's simplifier folds it to false, and the masked row then reads 255.)
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.exprs import bound_value, op_name, rewrite_functions


@mutator
class _NanGuards(PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != "relax.where" or len(call.args) != 3:
            return call
        cond, fill, p = call.args
        guard = bound_value(self, cond)
        if op_name(guard) != "relax.isnan" or not guard.args[0].same_as(p) \
                or op_name(bound_value(self, p)) != "relax.nn.softmax":
            return call
        if getattr(p.ty, "dtype", None) not in ("float32", "float16"):
            return call
        zero = relax.const(0.0, p.ty.dtype)
        return relax.op.where(relax.op.greater_equal(p, zero), p, fill)


def nan_guard_pass() -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="BlockforgeNanGuard")
    def nan_guard(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _NanGuards(mod), unused=True)

    return nan_guard
