"""Dynamo exports' 2-D GEMMs between reshapes, as one batched matmul: its epilogue fuses again.

torch's dynamo exporter writes each Linear / Conv1D of GPT-2 and T5 as

    a = reshape(x, [M, K]);  y = matmul(a, W);  z = reshape(y, [*L, N])   (M = prod(L))
    z + bias, gelu(z), relu(z), z + residual ...

FuseOps stops at the reshape after the matmul, so the bias add, activation and residual add ran
as separate whole-tensor passes (GPT-2 small: 12% of kernel time elementwise, T5-base 8%; issue
#20). matmul(reshape(x, [*L, K]), W) computes z directly (a leading-batch matmul against a 2-D
weight is the same GEMM of M rows; the reshape is a view); the elementwise ops then follow the
matmul and fuse into its epilogue.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.exprs import bound_value, op_name as _op, rewrite_functions, static_shape as _static


def _use_counts(func) -> dict:
    counts: dict = {}

    def visit(e):
        if isinstance(e, relax.Var):
            counts[e] = counts.get(e, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return counts


@mutator
class _MatmulThroughReshape(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.uses: dict = {}  # the function's original vars -> number of uses (per function)

    def plan(self, func) -> bool:
        self.uses = _use_counts(func)
        return True

    def _bound(self, e):
        return bound_value(self, e)

    def visit_call_(self, call):
        new = super().visit_call_(call)
        if _op(new) != "relax.reshape":
            return new
        mm_var = call.args[0]  # the original var: its use count
        mm = self._bound(new.args[0])
        if _op(mm) != "relax.matmul" or self.uses.get(mm_var, 0) != 1:
            return new
        a, w = mm.args
        as_ = _static(getattr(a.ty, "shape", None) or [])
        ws = _static(getattr(w.ty, "shape", None) or [])
        out = _static(getattr(new.ty, "shape", None) or [])
        if None in (as_, ws, out) or len(as_) != 2 or len(ws) != 2 or len(out) < 2 or out[-1] != ws[1]:
            return new
        m = 1
        for d in out[:-1]:
            m *= d
        if m != as_[0]:
            return new
        # a's rows as z's leading dims (a view); a reshape producing a: one reshape of its input
        inner = self._bound(a)
        base = inner.args[0] if _op(inner) == "relax.reshape" else a
        x = self.builder_.emit(relax.op.reshape(base, [*out[:-1], as_[1]]))
        return relax.op.matmul(x, w, out_dtype=mm.attrs.out_dtype)


def matmul_reshape_pass() -> tvm.transform.Pass:
    """The rewrite above over every Relax function, then the dead reshapes/matmuls removed."""

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeMatmulThroughReshape")
    def matmul_reshape(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _MatmulThroughReshape(mod), lambda m, func: m.plan(func), dce=True)

    return matmul_reshape
