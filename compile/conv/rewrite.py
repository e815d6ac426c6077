"""Convolutions as im2col + a prepacked GEMM (the pipeline's conv-gemm phase).

A 1-D or 2-D convolution (any kernel, stride, padding, dilation, groups) with a constant
weight is, per batch item and group g,

    y[g*Og + o, j] = sum_k  W[g, o, k] * cols[g, k, j]          j: the output positions (OH*OW)
    cols[g, (c, kh, kw), (oh, ow)] = x_padded[g*Cg + c, oh*sh + kh*dh, ow*sw + kw*dw]

The weight is the GEMM's left operand (rows = output channels), so the product comes out in
the NC(H)W layout the graph wants: no transpose before the next op, and the bias (per row)
and activation are elementwise consumers FuseOps fuses into the GEMM, which CPUMatmul folds
into its accumulator write-back. The im2col writes `cols` straight in the panel layout the
matmul kernel streams (prepack.py's weights: (L/NR, K, NR), here per batch item and group),
so the gather is the only copy: one write of K*L floats against 2*Og*K*L flops of GEMM.

Padded / out-of-range taps read zero through a select in the gather (no padded copy of x);
positions past L (the last panel's tail) are zero columns, whose products the GEMM's output
never keeps: its j extent is L itself.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.prepack import PACKED_BLOCK

IM2COL_BLOCK = "conv_im2col"
CROP_BLOCK = "conv_crop"
# Measured per shape class (conv1d 512 ch x 1500, k=5; 2 threads, shared machine, load ~18,
# ms, interleaved with ORT): TVM's own direct conv vs this rewrite, by output rows per group Og:
#   groups=1 (Og 512)  1826 vs 36    groups=16 (Og 32)  361 vs 35    groups=128 (Og 4)  17.8 vs 13.3
#   depthwise (Og 1)   1.03 vs 48  (a GEMM of one row per group: 1/6 of each 6-row tile is work)
# Whisper's k=3 convs (stride 1 / 2, 80->512 / 512->512, 3000 frames): 1282 vs 49, 4320 vs 112.
# So depthwise-like convs (Og < 4) keep TVM's direct schedule; the rest become GEMMs.
MIN_GROUP_ROWS = 4
# The columns are a workspace of K*L floats per batch item and group (Whisper's conv2: 9 MiB,
# Wav2Vec2's positional conv: 25 MiB); a big image conv would need many GiB (1x64x2048x2048, k7:
# 48 GiB) where TVM's direct conv needs none: beyond this, the conv stays direct.
MAX_COLS_BYTES = 256 << 20
OUT_EWISE_FUSABLE = 4  # relax's OpPatternKind kOutEWiseFusable (a matmul's)
_LAYOUTS = {"relax.nn.conv1d": ("NCW", "OIW"), "relax.nn.conv2d": ("NCHW", "OIHW")}


def _static(shape) -> list[int] | None:
    try:
        return [int(d) for d in shape]
    except (TypeError, ValueError):
        return None


class ConvShape:
    """The geometry of one convolution: d spatial dims, pads as (begin..., end...)."""

    def __init__(self, xs, ws, strides, padding, dilation, groups):
        self.n, self.c, *self.size = xs
        self.o, self.cg, *self.kernel = ws
        d = len(self.size)
        self.strides, self.dilation, self.groups = list(strides), list(dilation), groups
        pads = list(padding)
        if len(pads) == d:
            pads = pads * 2
        self.pad_begin, self.pad_end = pads[:d], pads[d:]
        self.out = [(s + pb + pe - dl * (k - 1) - 1) // st + 1 for s, pb, pe, dl, k, st in
                    zip(self.size, self.pad_begin, self.pad_end, self.dilation, self.kernel, self.strides)]
        self.og = self.o // groups
        self.kg = self.cg * int(np.prod(self.kernel))
        self.length = int(np.prod(self.out))

    def valid(self) -> bool:
        return self.groups >= 1 and self.c == self.cg * self.groups and self.o % self.groups == 0 \
            and all(v >= 1 for v in self.out) and all(p >= 0 for p in self.pad_begin + self.pad_end)

    def cols_bytes(self, nr: int) -> int:
        return 4 * self.n * self.groups * self.kg * -(-self.length // nr) * nr

    def flops(self) -> int:
        return 2 * self.n * self.o * self.kg * self.length


def im2col(x: te.Tensor, cs: ConvShape, nr: int) -> te.Tensor:
    """cols[n, g, jb, k, jr] (the GEMM's right operand, NR-wide panels); zero outside x."""
    nb = -(-cs.length // nr)
    d = len(cs.size)

    def f(n, g, jb, k, jr):
        j = jb * nr + jr
        pos, rest = [], j
        for i in reversed(range(d)):  # output coordinates, last dim fastest
            # (the first one needs no modulo: j < L is guarded below; 1-D then indexes by j itself)
            pos.insert(0, rest % cs.out[i] if i else rest)
            rest = rest // cs.out[i]
        taps, rest = [], k
        for i in reversed(range(d)):  # k = (c, kh, kw), kw fastest: the weight's OIHW order
            taps.insert(0, rest % cs.kernel[i])
            rest = rest // cs.kernel[i]
        c = g * cs.cg + rest
        at = [p * cs.strides[i] + t * cs.dilation[i] - cs.pad_begin[i] for i, (p, t) in enumerate(zip(pos, taps))]
        inside = j < cs.length
        for i, a in enumerate(at):
            inside = tirx.all(inside, a >= 0, a < cs.size[i])
        safe = [tirx.max(tirx.min(a, cs.size[i] - 1), 0) for i, a in enumerate(at)]
        return tirx.if_then_else(inside, x[(n, c, *safe)], tirx.const(0, x.dtype))

    return te.compute((cs.n, cs.groups, nb, cs.kg, nr), f, name=IM2COL_BLOCK)


def conv_gemm(w: te.Tensor, cols: te.Tensor, cs: ConvShape) -> te.Tensor:
    """y[n, g*Og + o, j] = sum_k w[g, o, k] * cols[n, g, j // NR, k, j % NR] (a packed_matmul
    block CPUMatmul schedules; the group is an outer index of the row), over whole panels
    (L rounded up to NR), then the L real positions. A GEMM whose own j extent is ragged gets a
    tail guard inside its vector loop (TVM's LoopPartition does not split it off): measured
    (64 x 66 x 192, L=200, 1 thread) 7.5 ms against 0.12 ms at L=256."""
    nb, nr = int(cols.shape[2]), int(cols.shape[-1])
    k = te.reduce_axis((0, cs.kg), name="k")

    def f(n, o, j):
        if cs.groups == 1:
            return te.sum(w[0, o, k] * cols[n, 0, j // nr, k, j % nr], axis=k)
        g = o // cs.og
        return te.sum(w[g, o % cs.og, k] * cols[n, g, j // nr, k, j % nr], axis=k)

    y = te.compute((cs.n, cs.o, nb * nr), f, name=PACKED_BLOCK)
    if nb * nr == cs.length:
        return y
    return te.compute((cs.n, cs.o, cs.length), lambda n, o, j: y[n, o, j], name=CROP_BLOCK)


def _geometry(call, nr: int) -> ConvShape | None:
    """The convolution's shape when this rewrite applies: float32, constant weight, static
    shapes, canonical layouts."""
    x, w = call.args
    a = call.attrs
    if not isinstance(w, tvm.ir.expr.GenericConst) or getattr(x.ty, "dtype", None) != "float32":
        return None
    layout = _LAYOUTS[call.op.name]
    out_layout = str(a.out_layout) if a.out_layout else layout[0]
    if (str(a.data_layout), str(a.kernel_layout), out_layout) != (*layout, layout[0]) \
            or str(a.out_dtype) not in ("None", "", "void", "float32"):
        return None
    xs = _static(getattr(x.ty, "shape", None) or [])
    wt = w.value.numpy()
    if xs is None or len(xs) != len(layout[0]) or wt.ndim != len(xs) or wt.dtype != np.float32:
        return None
    cs = ConvShape(xs, wt.shape, [int(v) for v in a.strides], [int(v) for v in a.padding],
                   [int(v) for v in a.dilation], int(a.groups))
    if not cs.valid() or cs.og < MIN_GROUP_ROWS or cs.cols_bytes(nr) > MAX_COLS_BYTES:
        return None
    return cs


@mutator
class _ConvGemm(PyExprMutator):
    def __init__(self, mod, nr: int):
        super().__init__(mod)
        self.nr = nr

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", None) not in _LAYOUTS:
            return call
        cs = _geometry(call, self.nr)
        if cs is None:
            return call
        x, w = call.args
        wmat = relax.const(np.ascontiguousarray(w.value.numpy().reshape(cs.groups, cs.og, cs.kg)))
        b = self.builder_
        cols = b.emit(b.call_te(lambda t: im2col(t, cs, self.nr), x, primfunc_name_hint="conv_im2col"))
        gemm = b.call_te(lambda a, c: conv_gemm(a, c, cs), wmat, cols, primfunc_name_hint="conv_gemm")
        # A GEMM to FuseOps, so the bias and activation after it fuse into its epilogue (the
        # group index o // Og hides that from AnnotateTIROpPattern: it said reduction, 3).
        gv = gemm.args[0]
        b.update_func(gv, b.get()[gv].with_attr("op_pattern", OUT_EWISE_FUSABLE))
        if len(cs.out) == 1:
            return gemm  # not emitted: the caller binds it (an alias binding would stop FuseOps)
        return relax.op.reshape(b.emit(gemm), (cs.n, cs.o, *cs.out))


def conv_gemm_pass(nr: int) -> tvm.transform.Pass:
    """Every conv1d/conv2d the rewrite covers, as im2col + packed GEMM with panels of nr."""

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeConvGemm")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        m = _ConvGemm(mod, nr)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(func))
        return m.builder_.get()

    return _pass
