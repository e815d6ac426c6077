"""RMSNorm spelled out by exporters, as one relax.nn.rms_norm op.

Llama/Mistral/Qwen2 (and T5's LayerNorm) export RMSNorm as

    y = x * (1 / sqrt(mean(x ** 2, axis=-1, keepdims=True) + eps))   [* weight]
        (or rsqrt(...); x * x for x ** 2)

TVM's FuseOps keeps `x ** 2` out of the reduction's kernel (fast_math makes it a call_tir
`square`), and the remaining kernel's keepdims mean has a unit axis after the rows, which
CPURowReduction's row test refuses: two serial whole-tensor passes per norm (Llama-style GQA:
25 norms, 11.4 ms of 146 ms kernel time, issue #20). As one rms_norm op it legalizes to a
single row kernel (sum of squares, then scale) that CPURowReduction schedules: rows parallel,
both row passes vectorised.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.exprs import bound_value, const_scalar as _scalar, op_name as _op


def _ndim(e) -> int | None:
    nd = getattr(e.ty, "ndim", -1)
    return None if nd is None or nd < 0 else int(nd)


@mutator
class _RMSNorm(PyExprMutator):
    def _bound(self, e):
        """The call a dataflow var is bound to (post-order: already rewritten), else e."""
        v = bound_value(self, e)
        return v if v is not None else e

    def _inverse_rms(self, e):
        """(x, eps) where e = 1/sqrt(mean(x*x, last axis, keepdims) + eps) (or rsqrt), else None."""
        e = self._bound(e)
        if _op(e) == "relax.divide" and _scalar(e.args[0]) == 1.0:
            s = self._bound(e.args[1])
            if _op(s) != "relax.sqrt":
                return None
            a = self._bound(s.args[0])
        elif _op(e) == "relax.rsqrt":
            a = self._bound(e.args[0])
        else:
            return None
        if _op(a) != "relax.add":
            return None
        m, eps = (a.args[0], _scalar(a.args[1]))
        if eps is None:
            m, eps = a.args[1], _scalar(a.args[0])
        m = self._bound(m)
        if eps is None or _op(m) != "relax.mean" or not bool(m.attrs.keepdims):
            return None
        nd = _ndim(m.args[0])
        axes = [int(v) for v in (m.attrs.axis or [])]
        if nd is None or len(axes) != 1 or axes[0] not in (-1, nd - 1):
            return None
        sq = self._bound(m.args[0])
        if _op(sq) == "relax.power" and _scalar(sq.args[1]) == 2.0:
            return sq.args[0], eps
        if _op(sq) == "relax.multiply" and sq.args[0].same_as(sq.args[1]):
            return sq.args[0], eps
        if _op(sq) == "relax.call_tir" and sq.args[0].name_hint == "square" and len(sq.args[1].fields) == 1:
            return sq.args[1].fields[0], eps  # fast_math already ran (fp32-compute's float16 models)
        return None

    def _norm(self, x, inv):
        found = self._inverse_rms(inv)
        if found is None or not found[0].same_as(x):
            return None
        dtype = getattr(x.ty, "dtype", None)
        shape = getattr(x.ty, "shape", None)
        if dtype != "float32" or shape is None or not isinstance(shape[-1], tvm.tirx.IntImm):
            return None
        return found[1], int(shape[-1])

    def _weighted(self, y, w):
        """rms_norm(x, ones) * w, w a constant row vector: rms_norm(x, w)."""
        call = self._bound(y)
        if _op(call) != "relax.nn.rms_norm" or not isinstance(w, tvm.ir.expr.GenericConst):
            return None
        ones = call.args[1]
        if not isinstance(ones, tvm.ir.expr.GenericConst) or not np.all(ones.value.numpy() == 1.0):
            return None
        wt = w.value.numpy()
        n = ones.value.numpy().shape[0]
        if wt.dtype != np.float32 or wt.size != n or wt.shape[-1] != n:
            return None
        return relax.op.nn.rms_norm(call.args[0], relax.const(wt.reshape(n)), axes=[-1],
                                    epsilon=float(call.attrs.epsilon))

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if _op(call) != "relax.multiply":
            return call
        a, b = call.args
        for x, other in ((a, b), (b, a)):
            norm = self._norm(x, other)
            if norm is not None:
                eps, n = norm
                return relax.op.nn.rms_norm(x, relax.const(np.ones(n, "float32")), axes=[-1], epsilon=eps)
            weighted = self._weighted(x, other)
            if weighted is not None:
                return weighted
        return call


def rms_norm_pass() -> tvm.transform.Pass:
    """The rewrite above over every Relax function, then the dead steps it left removed."""

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeRMSNorm")
    def rms_norm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        m = _RMSNorm(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(func))
        return relax.transform.DeadCodeElimination()(m.builder_.get())

    return rms_norm
