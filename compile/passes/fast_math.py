"""Relax rewrites for speed: vectorisable activations, pow as multiplies, patch convs as GEMMs.

Activations: gelu/erf/tanh/sigmoid through TVM's polynomial fast_erf/fast_tanh/fast_exp.

LLVM lowers TIR's erf to a scalar libm call per element, which breaks vectorisation
of the fused matmul epilogue: on the BERT-base FFN the exact gelu epilogue alone cost
~2 ms, more than ONNX Runtime's whole FFN. topi.fast_erf is a rational approximation
(max abs error ~1e-7 in float32), well inside the float32 tolerance of the parity table.

Exporters spell GELU themselves: erf form x * 0.5 * (1 + erf(x / sqrt2)) (BERT, ViT; the
erf is caught above) and the tanh form with Pow(x, 3) (GPT-2's gelu_new). TIR's pow is a
scalar libm powf call per element, so power(x, 2|3) becomes x*x(*x) (`_power`).

Patch embedding (ViT): a Conv whose stride equals its kernel and has no padding reads every
input pixel once: it is a GEMM of the image cut into patches (N*P, C*kh*kw) with the weights
(C*kh*kw, O). `_patch_conv` rewrites it to reshape/permute + matmul, so the weight is
prepacked and the product runs in the CPU matmul kernel (cpu_schedule.CPUMatmul) instead of
TVM's untuned direct conv2d loops.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.exprs import const_scalar as _const_scalar, rewrite_functions, static_shape as _static


def gelu(x):
    """gelu through topi.fast_erf (the float build's, and the int8 epilogue's)."""
    half = tvm.tirx.const(0.5, x.dtype)
    return topi.multiply(topi.multiply(x, half),
                         topi.add(topi.fast_erf(topi.multiply(x, tvm.tirx.const(1 / math.sqrt(2), x.dtype))),
                                  tvm.tirx.const(1.0, x.dtype)))


def _softmax(x, axis: int):
    """topi.nn.fast_softmax's steps (the row max, fast_exp of x - max, the row sum) with the
    normalisation as exp * (1 / sum): one division per row, which LLVM hoists out of the row's
    vector loop, not one per element (VDIVPS, Zen 4's slowest vector op: a 12 x 512 x 512 softmax
    writing 8-bit P, Hugging Face BERT QDQ at seq 512, see fast_math's `reciprocal`). Within an
    ulp of the quotient."""
    from tvm import te

    shape = x.shape
    axis = axis % len(shape)
    rows = lambda idx: tuple(v for i, v in enumerate(idx) if i != axis)  # noqa: E731
    at = lambda idx, k: (*idx[:axis], k, *idx[axis:])  # noqa: E731
    reduced = tuple(d for i, d in enumerate(shape) if i != axis)
    k1, k2 = te.reduce_axis((0, shape[axis]), name="k"), te.reduce_axis((0, shape[axis]), name="k")
    top = te.compute(reduced, lambda *i: te.max(x[at(i, k1)], axis=k1), name="T_softmax_maxelem")
    e = topi.fast_exp(te.compute(shape, lambda *i: x[i] - top[rows(i)], name="T_softmax_delta"))
    total = te.compute(reduced, lambda *i: te.sum(e[at(i, k2)], axis=k2), name="T_softmax_expsum")
    one = tvm.tirx.const(1.0, x.dtype)
    return te.compute(shape, lambda *i: e[i] * (one / total[rows(i)]), name="T_softmax_norm", attrs={"axis": axis})


def _sigmoid(x):
    """1 / (1 + exp(-x)) through topi.fast_exp (a vectorisable polynomial; TIR's sigmoid lowers
    to libm expf per element: Llama's SwiGLU gate, CLIP's quick-gelu)."""
    one = tvm.tirx.const(1.0, x.dtype)
    return topi.divide(one, topi.add(one, topi.fast_exp(topi.negative(x))))


def _gelu_tanh(x):
    c = tvm.tirx.const(math.sqrt(2 / math.pi), x.dtype)
    inner = topi.multiply(c, topi.add(x, topi.multiply(tvm.tirx.const(0.044715, x.dtype),
                                                       topi.multiply(x, topi.multiply(x, x)))))
    return topi.multiply(topi.multiply(x, tvm.tirx.const(0.5, x.dtype)),
                         topi.add(topi.fast_tanh(inner), tvm.tirx.const(1.0, x.dtype)))


def is_patch_conv(call) -> bool:
    """A conv2d the patch-conv rewrite takes: constant float32 weight, static NCHW input,
    stride == kernel, no padding, dilation 1, one group, the image a whole number of patches."""
    x, w = call.args
    a = call.attrs
    if not isinstance(w, tvm.ir.expr.GenericConst) or getattr(x.ty, "dtype", None) != "float32":
        return False
    xs = _static(getattr(x.ty, "shape", None) or [])
    wt = w.value.numpy()
    if xs is None or len(xs) != 4 or wt.ndim != 4 or wt.dtype != np.float32:
        return False
    _, c, h, wd = xs
    _, ci, kh, kw = wt.shape
    return (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) == ("NCHW", "OIHW", "NCHW") \
        and int(a.groups) == 1 and ci == c and [int(v) for v in a.strides] == [kh, kw] \
        and not any(int(v) for v in a.padding) and all(int(v) == 1 for v in a.dilation) \
        and not h % kh and not wd % kw and str(a.out_dtype) in ("None", "", "void", "float32")


@mutator
class _FastActivations(PyExprMutator):
    def __init__(self, mod, patch_conv: bool = True, sigmoid: bool = True, reciprocal: bool = True):
        super().__init__(mod)
        self.patch_conv = patch_conv
        self.sigmoid = sigmoid
        self.reciprocal = reciprocal

    def _reciprocal_quantize(self, call):
        """quantize(x, s, zp) with a constant per-tensor scale as quantize(x * (1 / s), 1, zp):
        TVM's legalization divides each element by s (VDIVPS); the int8 epilogue's steps
        multiply already (gemm.Epilogue.reciprocal: one level apart where x / s lies within an
        ulp or two of a half-integer; ORT's fused QDQ kernels and OpenVINO multiply too). A scale
        whose reciprocal is not a normal float32 (a hostile file's) keeps the division."""
        from blockforge.compile.quant.gemm import reciprocal_scale

        x, scale, zp = call.args
        s = _const_scalar(scale)
        if s is None or getattr(x.ty, "dtype", None) != "float32" or getattr(scale.ty, "dtype", None) != "float32":
            return call
        r = reciprocal_scale(s)
        if r is None or float(r) == 1.0:
            return call
        scaled = self.builder_.emit(relax.op.multiply(x, relax.const(r, "float32")))
        return relax.op.quantize(scaled, relax.const(1.0, "float32"), zp, axis=int(call.attrs.axis),
                                 out_dtype=str(call.attrs.out_dtype))

    def _power(self, call):
        x, e = call.args
        p = _const_scalar(e)
        if p not in (2.0, 3.0) or getattr(x.ty, "dtype", None) not in ("float32", "float16"):
            return call
        fn = (lambda t: topi.multiply(t, t)) if p == 2.0 else (lambda t: topi.multiply(t, topi.multiply(t, t)))
        return self.builder_.call_te(fn, x, primfunc_name_hint="square" if p == 2.0 else "cube")

    def _patch_conv(self, call):
        if not is_patch_conv(call):
            return call
        x, w = call.args
        wt = w.value.numpy()
        n, c, h, wd = _static(x.ty.shape)
        o, _, kh, kw = wt.shape
        hp, wp = h // kh, wd // kw
        b = self.builder_
        cols = b.emit(relax.op.reshape(x, (n, c, hp, kh, wp, kw)))
        cols = b.emit(relax.op.permute_dims(cols, [0, 2, 4, 1, 3, 5]))  # (N, Hp, Wp, C, kh, kw)
        cols = b.emit(relax.op.reshape(cols, (n * hp * wp, c * kh * kw)))  # (N*P, C*kh*kw)
        wmat = relax.const(np.ascontiguousarray(wt.reshape(o, c * kh * kw).T))  # (C*kh*kw, O)
        y = b.emit(relax.op.matmul(cols, wmat))  # (N*P, O)
        y = b.emit(relax.op.reshape(y, (n, hp, wp, o)))
        return relax.op.permute_dims(y, [0, 3, 1, 2])  # (N, O, Hp, Wp)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        op = getattr(call.op, "name", None)
        if op == "relax.power":
            return self._power(call)
        if op == "relax.quantize" and self.reciprocal:
            return self._reciprocal_quantize(call)
        if op == "relax.nn.conv2d":
            return self._patch_conv(call) if self.patch_conv else call
        if op not in ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.erf", "relax.tanh", "relax.nn.softmax") \
                and not (op == "relax.sigmoid" and self.sigmoid):
            return call
        dtype = getattr(call.args[0].ty, "dtype", None)
        if dtype != "float32":  # the fast kernels are float32 polynomials
            return call
        if op == "relax.nn.softmax":
            # exp through a vectorisable polynomial (topi.fast_exp) instead of libm's expf.
            return self.builder_.call_te(_softmax if self.reciprocal else topi.nn.fast_softmax, call.args[0],
                                         int(call.attrs.axis), primfunc_name_hint="softmax")
        fn = {"relax.nn.gelu": gelu, "relax.nn.gelu_tanh": _gelu_tanh,
              "relax.erf": topi.fast_erf, "relax.tanh": topi.fast_tanh, "relax.sigmoid": _sigmoid}[op]
        return self.builder_.call_te(fn, call.args[0], primfunc_name_hint=op.split(".")[-1])


def fast_math(patch_conv: bool = True, sigmoid: bool = True, reciprocal: bool = True) -> tvm.transform.Pass:
    """The rewrites above as one module pass; patch_conv=False keeps convolutions as they are
    (the pipeline's "patch-conv" ablation), sigmoid=False TIR's sigmoid ("fast-sigmoid"),
    reciprocal=False the softmax's and the quantizes' divisions per element ("reciprocal")."""

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeFastMath")
    def fast_math_pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _FastActivations(mod, patch_conv, sigmoid, reciprocal))

    return fast_math_pass
