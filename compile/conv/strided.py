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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockforge.compile.conv.rewrite import ConvShape

MAX_STRIDE = 4  # a load of lanes * s floats per vector of lanes: beyond 4, mostly unused bytes


def applies(cs: ConvShape, lanes: int, nr: int) -> bool:
    """Strides 2-4 of a 1-D conv with more than one panel of outputs (at one panel, Wav2Vec2's
    layer 6 (L = 49), the kernel took 14 us against the gather's 9)."""
    return len(cs.size) == 1 and 2 <= cs.strides[0] <= MAX_STRIDE and nr % lanes == 0 and cs.length > nr


def strided_im2col(x_shape: list[int], cs: ConvShape, nr: int, lanes: int):
    """The PrimFunc cols[n, g, jb, k, jr] = x[n, g*Cg + k // kw, (jb*NR + jr)*s + (k % kw)*d - pad]
    (zero outside x), x of `x_shape` (its last extent may exceed the conv's input length: a
    previous conv's whole panels)."""
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    i64 = lambda v: tirx.const(v, "int64")  # noqa: E731
    s, dl, kw, pb, size = cs.strides[0], cs.dilation[0], cs.kernel[0], cs.pad_begin[0], cs.size[0]
    nb, kg, width = cs.panels(nr), cs.kg, int(x_shape[-1])
    rows = cs.n * cs.groups * nb * kg
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("conv_im2col")
            X = T.arg("x", T.buffer([i64(v) for v in x_shape], "float32"))
            Y = T.arg("cols", T.buffer([i64(v) for v in cs.cols_shape(nr)], "float32"))
            T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
            with T.parallel(i64(0), i64(rows)) as f:  # (n, g, jb, k) fused, as CPUIm2col's
                k = f % i64(kg)
                jb = f // i64(kg) % i64(nb)
                g = f // i64(kg * nb) % i64(cs.groups)
                n = f // i64(kg * nb * cs.groups)
                c = g * i64(cs.cg) + k // i64(kw)
                off = k % i64(kw) * i64(dl) - i64(pb)  # x position of column 0 of panel 0
                with T.serial(i64(0), i64(nr // lanes)) as v:
                    j0 = jb * i64(nr) + v * i64(lanes)  # the vector's first column
                    first = j0 * i64(s) + off
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
                                a = j * i64(s) + off
                                inside = tirx.all(j < i64(cs.length), a >= i64(0), a < i64(size))
                                safe = tirx.max(tirx.min(a, i64(size - 1)), i64(0))
                                T.buffer_store(Y, tirx.if_then_else(inside, X[n, c, safe], tirx.const(0, "float32")),
                                               [n, g, jb, k, v * i64(lanes) + jr])
    return ib.get()
