"""The im2col of a strided 1-D convolution as contiguous loads and a lane shuffle.

rewrite.im2col's gather reads x at a stride-s, clamped, guarded index, which TVM's LLVM
codegen scalarises (one load and one insert per lane). Here a vector of `lanes` columns of
one (channel, tap) row is one contiguous load of lanes * s floats and a shuffle keeping every
s-th (vpermt2ps for s = 2); only the vectors that touch the padding or run past the input take
the guarded scalar loop. Measured alone on Zen 5 (2 threads, hot cache, ms, gather -> this):
Wav2Vec2-base's layers 1-5 (512 ch, k=3/3/3/3/2, s=2) 0.86 -> 0.17, 0.34 -> 0.087, 0.20 -> 0.061,
0.12 -> 0.057, 0.037 -> 0.033; Whisper-base's conv2 (3000 frames, k=3, s=2, pads 1) 0.82 -> 0.18.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockforge.compile.conv.rewrite import ConvShape

MAX_STRIDE = 4  # a load of lanes * s floats per vector of lanes: beyond 4, mostly unused bytes


def applies(cs: ConvShape, lanes: int, nr: int) -> bool:
    """Strides 2-4 of a 1-D conv with more than one panel of outputs (at one panel, Wav2Vec2's
    layer 6 (L = 49), the kernel took 14 us against the gather's 9)."""
    return len(cs.size) == 1 and 2 <= cs.strides[0] <= MAX_STRIDE and nr % lanes == 0 and cs.length > nr


def _i64(v):
    from tvm import tirx

    return tirx.const(v, "int64")


@contextlib.contextmanager
def _im2col_func(x_shape: list[int], cs: ConvShape, nr: int):
    """An im2col PrimFunc being built: yields (the builder, X, Y: x and cols); the function is
    the builder's get() after the block."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("conv_im2col")
            X = T.arg("x", T.buffer([_i64(v) for v in x_shape], "float32"))
            Y = T.arg("cols", T.buffer([_i64(v) for v in cs.cols_shape(nr)], "float32"))
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            yield ib, X, Y


@contextlib.contextmanager
def _panel_rows(x_shape: list[int], cs: ConvShape, nr: int, lanes: int):
    """The im2col PrimFunc's frame, as CPUIm2col schedules the gather: x and cols, the parallel
    loop over (n, g, jb, k) and in it the serial loop over the panel's vectors. Yields (the
    builder, X, Y, (n, g, jb, k), v, j0: the vector's first output position); the function is
    the builder's get() after the block."""
    from tvm.script.ir_builder import tirx as T

    nb, kg = cs.panels(nr), cs.kg
    with _im2col_func(x_shape, cs, nr) as (ib, X, Y):
        with T.parallel(_i64(0), _i64(cs.n * cs.groups * nb * kg)) as f:
            k = f % _i64(kg)
            jb = f // _i64(kg) % _i64(nb)
            g = f // _i64(kg * nb) % _i64(cs.groups)
            n = f // _i64(kg * nb * cs.groups)
            with T.serial(_i64(0), _i64(nr // lanes)) as v:
                yield ib, X, Y, (n, g, jb, k), v, jb * _i64(nr) + v * _i64(lanes)


def strided_im2col(x_shape: list[int], cs: ConvShape, nr: int, lanes: int):
    """The PrimFunc cols[n, g, jb, k, jr] = x[n, g*Cg + k // kw, (jb*NR + jr)*s + (k % kw)*d - pad]
    (zero outside x), x of `x_shape` (its last extent may exceed the conv's input length: a
    previous conv's whole panels)."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    i64 = _i64
    s, dl, kw, pb, size = cs.strides[0], cs.dilation[0], cs.kernel[0], cs.pad_begin[0], cs.size[0]
    width = int(x_shape[-1])
    with _panel_rows(x_shape, cs, nr, lanes) as (ib, X, Y, (n, g, jb, k), v, j0):
        c = g * i64(cs.cg) + k // i64(kw)
        first = j0 * i64(s) + k % i64(kw) * i64(dl) - i64(pb)  # the vector's first column's position
        used = first + i64((lanes - 1) * s)  # its last column's position
        loaded = first + i64(lanes * s - 1)  # the last float its load reads
        with T.If(tirx.all(first >= i64(0), used < i64(size), loaded < i64(width))):
            with T.Then():
                src = X[n, c, tirx.Ramp(first, i64(1), lanes * s)]
                T.buffer_store(Y, tirx.Shuffle([src], [tirx.const(i * s, "int32") for i in range(lanes)]),
                               [n, g, jb, k, tirx.Ramp(v * i64(lanes), i64(1), lanes)])
            with T.Else():  # the padding, the input's end, the panel's tail past L
                with T.serial(i64(0), i64(lanes)) as jr:
                    j = j0 + jr
                    a = j * i64(s) + k % i64(kw) * i64(dl) - i64(pb)
                    inside = tirx.all(j < i64(cs.length), a >= i64(0), a < i64(size))
                    safe = tirx.max(tirx.min(a, i64(size - 1)), i64(0))
                    T.buffer_store(Y, tirx.if_then_else(inside, X[n, c, safe], tirx.const(0, "float32")),
                                   [n, g, jb, k, v * i64(lanes) + jr])
    return ib.get()


def applies_2d(cs: ConvShape, lanes: int, nr: int) -> bool:
    """A 2-D conv whose output rows hold whole vectors (OW >= lanes), column stride 1-4: its
    columns by vector loads along the input rows (the gather: one load per element). Measured
    (Zen 5, 2 threads, the whole conv + SiLU, interleaved, rows / gather): MobileViT's fusion-like
    3x3 (192 -> 96 at 32 x 32) 1.14 / 1.29 ms, its stem (3 -> 16, stride 2, 256 x 256) 0.21 / 0.26;
    the columns are still K x L floats written (0.40 ms of the 3x3's 1.26)."""
    return len(cs.size) == 2 and 1 <= cs.strides[1] <= MAX_STRIDE and cs.out[1] >= lanes and nr % lanes == 0


def applies_narrow(cs: ConvShape, lanes: int) -> bool:
    """A 2-D conv whose output rows are narrower than a vector (ResNet's 14 x 14 and 7 x 7
    stages, OW < lanes), which im2col_2d leaves to the gather; and a strided one whose rows are
    no whole number of vectors, where im2col_2d's straddling vectors take its divmod loop.
    Measured in ResNet-50 (Zen 5, 2 threads, per call, rows -> these loops): the stride-2 3x3 at
    56 -> 28 wide 0.83 -> 0.43 ms; but stride-1 rows of 56 and 28 0.24 -> 1.05 and 0.18 -> 0.48
    (these loops are scalar; the row loads are not), so those stay im2col_2d's."""
    return len(cs.size) == 2 and (cs.out[1] < lanes or (cs.strides[1] > 1 and cs.out[1] % lanes != 0))


def im2col_narrow(x_shape: list[int], cs: ConvShape, nr: int):
    """The PrimFunc cols[n, g, jb, k, jr] as im2col_2d's, for the convs applies_narrow takes:
    one parallel item per (n, g, k) row of the columns, the output positions walked as (oh, ow)
    loops, so no index is divided by OW, and the row's tail past L zeroed. The gather computed
    (oh, ow) = divmod(j, OW) per element and, with the previous GEMM's (N, C, H*W) -> (N, C, H, W)
    reshape fused in, a second divmod by H*W: ResNet-50's 3x3 convs at 14 x 14 (256 channels)
    took 0.99 ms each, 14% of the model."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    i64 = _i64
    (h, w), (kh, kw), (sh, sw), (dh, dw) = cs.size, cs.kernel, cs.strides, cs.dilation
    (ph, pw), (oh_n, ow_n) = cs.pad_begin, cs.out
    nb, kg = cs.panels(nr), cs.kg
    with _im2col_func(x_shape, cs, nr) as (ib, X, Y):
        with T.parallel(i64(0), i64(cs.n * cs.groups * kg)) as f:
            k = f % i64(kg)
            g = f // i64(kg) % i64(cs.groups)
            n = f // i64(kg * cs.groups)
            c = g * i64(cs.cg) + k // i64(kh * kw)
            ty, tx = k // i64(kw) % i64(kh), k % i64(kw)
            with T.serial(i64(0), i64(oh_n)) as oh:
                r = oh * i64(sh) + ty * i64(dh) - i64(ph)
                sr = tirx.max(tirx.min(r, i64(h - 1)), i64(0))
                with T.serial(i64(0), i64(ow_n)) as ow:
                    col = ow * i64(sw) + tx * i64(dw) - i64(pw)
                    inside = tirx.all(r >= i64(0), r < i64(h), col >= i64(0), col < i64(w))
                    sc = tirx.max(tirx.min(col, i64(w - 1)), i64(0))
                    j = oh * i64(ow_n) + ow
                    T.buffer_store(Y, tirx.if_then_else(inside, X[n, c, sr, sc], tirx.const(0, "float32")),
                                   [n, g, j // i64(nr), k, j % i64(nr)])
            if nb * nr > cs.length:
                with T.serial(i64(cs.length), i64(nb * nr)) as j:
                    T.buffer_store(Y, tirx.const(0, "float32"), [n, g, j // i64(nr), k, j % i64(nr)])
    return ib.get()


def im2col_2d(x_shape: list[int], cs: ConvShape, nr: int, lanes: int):
    """The PrimFunc cols[n, g, jb, k, jr] = x[n, g*Cg + c, oh*sh + kh*dh - ph, ow*sw + kw*dw - pw]
    for k = (c, kh, kw) and jb*NR + jr = oh*OW + ow (zero outside x and past L): a vector of
    `lanes` outputs of one output row is one contiguous load of the input row (lanes * sw floats,
    then a shuffle keeping every sw-th); vectors that straddle two output rows, touch the padding
    or pass L take the guarded scalar loop."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    i64 = _i64
    (h, w), (kh, kw), (sh, sw), (dh, dw) = cs.size, cs.kernel, cs.strides, cs.dilation
    (ph, pw), ow_n = cs.pad_begin, cs.out[1]
    with _panel_rows(x_shape, cs, nr, lanes) as (ib, X, Y, (n, g, jb, k), v, j0):
        c = g * i64(cs.cg) + k // i64(kh * kw)
        ty, tx = k // i64(kw) % i64(kh), k % i64(kw)
        oh, ow0 = j0 // i64(ow_n), j0 % i64(ow_n)
        r = oh * i64(sh) + ty * i64(dh) - i64(ph)
        first = ow0 * i64(sw) + tx * i64(dw) - i64(pw)  # its first input column
        whole = tirx.all(j0 + i64(lanes) <= i64(cs.length), ow0 + i64(lanes) <= i64(ow_n),
                         r >= i64(0), r < i64(h), first >= i64(0), first + i64(lanes * sw - 1) < i64(w))
        with T.If(whole):
            with T.Then():
                src = X[n, c, r, tirx.Ramp(first, i64(1), lanes * sw)]
                val = src if sw == 1 else tirx.Shuffle([src], [tirx.const(i * sw, "int32") for i in range(lanes)])
                T.buffer_store(Y, val, [n, g, jb, k, tirx.Ramp(v * i64(lanes), i64(1), lanes)])
            with T.Else():
                with T.serial(i64(0), i64(lanes)) as jr:
                    j = j0 + jr
                    a = j // i64(ow_n) * i64(sh) + ty * i64(dh) - i64(ph)
                    b = j % i64(ow_n) * i64(sw) + tx * i64(dw) - i64(pw)
                    inside = tirx.all(j < i64(cs.length), a >= i64(0), a < i64(h), b >= i64(0), b < i64(w))
                    sa = tirx.max(tirx.min(a, i64(h - 1)), i64(0))
                    sb = tirx.max(tirx.min(b, i64(w - 1)), i64(0))
                    T.buffer_store(Y, tirx.if_then_else(inside, X[n, c, sa, sb], tirx.const(0, "float32")),
                                   [n, g, jb, k, v * i64(lanes) + jr])
    return ib.get()
