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

from blockforge.compile.conv.rewrite import CROP_BLOCK
from blockforge.compile.passes.exprs import bound_value, const_scalar as _scalar, op_name as _op, rewrite_functions, static_shape


def _ndim(e) -> int | None:
    nd = getattr(e.ty, "ndim", -1)
    return None if nd is None or nd < 0 else int(nd)


def _bound_or_self(mutator, e):
    """The call a dataflow var is bound to (post-order: already rewritten), else e."""
    v = bound_value(mutator, e)
    return v if v is not None else e


@mutator
class _RMSNorm(PyExprMutator):
    def _bound(self, e):
        return _bound_or_self(self, e)

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


def _rewrite_pass(mutator_cls, name: str) -> tvm.transform.Pass:
    """mutator_cls's rewrite over every Relax function, then the dead steps it left removed."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def rewrite(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, mutator_cls(mod), dce=True)

    return rewrite


def rms_norm_pass() -> tvm.transform.Pass:
    """The RMSNorm rewrite above."""
    return _rewrite_pass(_RMSNorm, "BlockforgeRMSNorm")


# InstanceNormalization (Wav2Vec2's GroupNorm of 512 groups over 512 channels) comes out of
# TVM's importer as  (x - mean(c)) / sqrt(variance(c) + eps),  mean and variance keepdims over
# the last axis, where c is x or (after the conv-gemm phase) the first L positions of a conv's
# whole GEMM panels x. FuseOps makes that three kernels: the crop (a copy: c has two readers),
# the variance (mean, then squared deviations) and the normalize (mean again, then the
# output): the crop read from memory once and each of the others once. As one row kernel
# (sum, squared deviations, normalize: both reductions read the row from L1 after the first)
# that reads the panels itself, the crop is gone and the row leaves memory once.
IN_PATTERN = 4  # kOutEWiseFusable: the affine and GELU after it fuse into its row loop
IN_SUM, IN_SQUARES = "instance_norm_sum", "instance_norm_squares"


def instance_norm_te(x, length: int, eps: float):
    """y = (x - mean) / sqrt(var + eps) over the first `length` positions of x's last axis
    (the rest of each row is normalized with the same statistics: a conv's tail panel)."""
    from tvm import te, tirx

    *rows, _ = (int(d) for d in x.shape)
    inv = tirx.const(1.0 / length, x.dtype)
    k = te.reduce_axis((0, length), name="k")
    s = te.compute(rows, lambda *r: te.sum(x[(*r, k)], axis=k), name=IN_SUM)
    k2 = te.reduce_axis((0, length), name="k2")
    q = te.compute(rows, lambda *r: te.sum((x[(*r, k2)] - s[r] * inv) * (x[(*r, k2)] - s[r] * inv), axis=k2),
                   name=IN_SQUARES)
    return te.compute(tuple(int(d) for d in x.shape),
                      lambda *i: (x[i] - s[i[:-1]] * inv) / tirx.sqrt(q[i[:-1]] * inv + tirx.const(eps, x.dtype)),
                      name="instance_norm")


def _last_axis_keepdims(call, op: str):
    """call's input when call is `op(x, axis=[last], keepdims=True)`, else None."""
    if _op(call) != op or not bool(call.attrs.keepdims):
        return None
    nd = _ndim(call.args[0])
    axes = [int(v) for v in (call.attrs.axis or [])]
    return call.args[0] if nd is not None and len(axes) == 1 and axes[0] in (-1, nd - 1) else None


def _prefix_of(c, x) -> bool:
    """c's static shape is x's but for a last axis no longer (with a slice from 0 by 1, or
    conv-gemm's crop, c is then x's first positions)."""
    cs, xs = (static_shape(getattr(e.ty, "shape", None)) for e in (c, x))
    if cs is None or xs is None or len(cs) != len(xs) or cs[:-1] != xs[:-1] or cs[-1] > xs[-1]:
        return False
    return True


@mutator
class _InstanceNorm(PyExprMutator):
    def _bound(self, e):
        return _bound_or_self(self, e)

    def _slice_source(self, c):
        """x when c is bound to strided_slice(x, last axis, 0 .. L, stride 1) or to conv-gemm's
        crop kernel of x (after an epilogue chain), else None."""
        s = self._bound(c)
        if _op(s) == "relax.call_tir" and s.args[0].name_hint.startswith(CROP_BLOCK) and len(s.args[1].fields) == 1:
            x = s.args[1].fields[0]
            return x if _prefix_of(c, x) else None
        if _op(s) != "relax.strided_slice" or len(s.args) < 4:
            return None
        x = s.args[0]
        nd = _ndim(x)
        try:  # (symbolic bounds: not this crop)
            axes, begin = ([int(getattr(v, "value", v)) for v in a] for a in s.args[1:3])
            strides = [int(getattr(v, "value", v)) for v in s.args[4]] if len(s.args) > 4 else [1]
        except (TypeError, ValueError, AttributeError):
            return None
        if nd is None or axes not in ([nd - 1], [-1]) or begin != [0] or strides != [1]:
            return None
        return x if _prefix_of(c, x) else None

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if _op(call) != "relax.divide":
            return call
        d, s = (self._bound(a) for a in call.args)
        if _op(d) != "relax.subtract" or _op(s) != "relax.sqrt":
            return call
        x, m = d.args
        a = self._bound(s.args[0])
        if _op(a) != "relax.add":
            return call
        v, eps = a.args[0], _scalar(a.args[1])
        if eps is None:
            v, eps = a.args[1], _scalar(a.args[0])
        c = _last_axis_keepdims(self._bound(m), "relax.mean")
        if eps is None or c is None or not c.same_as(_last_axis_keepdims(self._bound(v), "relax.variance")):
            return call
        if not c.same_as(x) and not x.same_as(self._slice_source(c)):
            return call
        shape = static_shape(getattr(x.ty, "shape", None))
        length = static_shape(c.ty.shape)
        if getattr(x.ty, "dtype", None) != "float32" or shape is None or length is None or len(shape) < 2:
            return call
        b = self.builder_
        new = b.call_te(lambda t: instance_norm_te(t, length[-1], eps), x, primfunc_name_hint="instance_norm")
        gv = new.args[0]
        b.update_func(gv, b.get()[gv].with_attr("op_pattern", IN_PATTERN))
        return new


def instance_norm_pass() -> tvm.transform.Pass:
    """The InstanceNormalization rewrite above (the crop, mean and variance it leaves unused
    are removed)."""
    return _rewrite_pass(_InstanceNorm, "BlockforgeInstanceNorm")
