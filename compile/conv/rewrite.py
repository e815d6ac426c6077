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

from blockforge.compile.conv import depthwise, strided
from blockforge.compile.passes.fast_math import is_patch_conv
from blockforge.compile.passes.kernels import add_kernel
from blockforge.compile.passes.prepack import PACKED_BLOCK, pack_weights
from blockforge.compile.schedule.base import MR

IM2COL_BLOCK = "conv_im2col"
CROP_BLOCK = "conv_crop"
# Measured per shape class (conv1d 512 ch x 1500, k=5; 2 threads, shared machine, load ~18,
# ms, interleaved with ORT): TVM's own direct conv vs this rewrite, by output rows per group Og:
#   groups=1 (Og 512)  1826 vs 36    groups=16 (Og 32)  361 vs 35    groups=128 (Og 4)  17.8 vs 13.3
#   depthwise (Og 1)   1.03 vs 48  (a GEMM of one row per group: 1/6 of each 6-row tile is work)
# Whisper's k=3 convs (stride 1 / 2, 80->512 / 512->512, 3000 frames): 1282 vs 49, 4320 vs 112.
# So depthwise-like convs (Og < 4) stay direct: depthwise.py's kernel for Og = Cg = 1, TVM's
# conv otherwise; the rest become GEMMs.
MIN_GROUP_ROWS = 4
# The columns are a workspace of K*L floats per batch item and group (Whisper's conv2: 9 MiB,
# Wav2Vec2's positional conv: 25 MiB); a big image conv would need many GiB (1x64x2048x2048, k7:
# 48 GiB) where TVM's direct conv needs none: beyond this, the conv stays direct.
MAX_COLS_BYTES = 256 << 20
OUT_EWISE_FUSABLE = 4  # relax's OpPatternKind kOutEWiseFusable (a matmul's)
OPAQUE = 8  # kOpaque: FuseOps fuses nothing with it
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

    def panels(self, nr: int) -> int:
        """NR-wide panels of output positions (the last one's tail past L unused)."""
        return -(-self.length // nr)

    def cols_shape(self, nr: int) -> tuple[int, int, int, int, int]:
        """The im2col columns: (batch, group, panel, k, NR), the GEMM's right operand."""
        return self.n, self.groups, self.panels(nr), self.kg, nr

    def cols_bytes(self, nr: int) -> int:
        return 4 * int(np.prod(self.cols_shape(nr)))

    def flops(self) -> int:
        return 2 * self.n * self.o * self.kg * self.length

    def used_taps(self) -> list[tuple[int, int]] | None:
        """Per spatial dim, the first and last kernel tap that reads x (not padding) for at least
        one output position; None where some dim has none (every output is the bias)."""
        spans = []
        for size, pb, k, st, dl, out in zip(self.size, self.pad_begin, self.kernel, self.strides,
                                             self.dilation, self.out):
            at = np.arange(out)[:, None] * st + np.arange(k)[None, :] * dl - pb  # (out, k)
            used = np.flatnonzero(((at >= 0) & (at < size)).any(axis=0))
            if used.size == 0:
                return None
            spans.append((int(used[0]), int(used[-1])))
        return spans

    def trimmed(self, spans) -> "ConvShape":
        """The same convolution over taps spans[i] only: the pads shrink by the dropped taps
        (they may go negative: the gather's guard reads zero wherever a tap falls outside x),
        the output size is unchanged."""
        kernel = [hi - lo + 1 for lo, hi in spans]
        pb = [p - lo * dl for p, (lo, _), dl in zip(self.pad_begin, spans, self.dilation)]
        pe = [p - (k - 1 - hi) * dl for p, k, (_, hi), dl in zip(self.pad_end, self.kernel, spans, self.dilation)]
        cs = ConvShape([self.n, self.c, *self.size], [self.o, self.cg, *kernel], self.strides, pb + pe,
                       self.dilation, self.groups)
        assert cs.out == self.out, (cs.out, self.out)
        return cs


def trim_taps(cs: ConvShape, wt: np.ndarray) -> tuple[ConvShape, np.ndarray]:
    """Drop the kernel taps that read only padding for every output (exact: they multiply
    zeros). Wav2Vec2's positional conv (k=128, pads 64, 49 frames) keeps taps 15-112: 98 of 128,
    so its columns and GEMM are 23% smaller."""
    spans = cs.used_taps()
    if spans is None or all(lo == 0 and hi == k - 1 for (lo, hi), k in zip(spans, cs.kernel)):
        return cs, wt
    index = (slice(None), slice(None), *(slice(lo, hi + 1) for lo, hi in spans))
    return cs.trimmed(spans), np.ascontiguousarray(wt[index])


def im2col(x: te.Tensor, cs: ConvShape, nr: int) -> te.Tensor:
    """cols[n, g, jb, k, jr] (the GEMM's right operand, NR-wide panels); zero outside x."""
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

    return te.compute(cs.cols_shape(nr), f, name=IM2COL_BLOCK)


def conv_gemm(w: te.Tensor, cols: te.Tensor, cs: ConvShape, crop: bool = True) -> te.Tensor:
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
    if nb * nr == cs.length or not crop:
        return y
    return te.compute((cs.n, cs.o, cs.length), lambda n, o, j: y[n, o, j], name=CROP_BLOCK)


# Output positions in NR-wide column panels waste the panel's tail: ResNet's 7 x 7 (L = 49) and
# 14 x 14 (196) stages fill 77% of their 64-wide panels. Where the panels would use less than
# this share of their width and the conv is 1x1 with no padding (the GEMM then reads x in
# place, at any stride), the GEMM runs the other way round (conv_gemm_rows): positions as the
# rows (MR-row tiles: 54 rows for 49, 198 for 196), output channels as the columns. Measured
# on Ice Lake (2 threads, interleaved with ORT, ms, columns -> rows, two processes): ResNet-50's
# 1x1s at 14 x 14 1024 -> 256 1.10 -> 0.66, 256 -> 1024 0.84 -> 0.86 / 0.80 -> 0.67; at 7 x 7
# 2048 -> 512 0.73 -> 0.68 / 0.71, 512 -> 2048 0.74 -> 0.72 / 0.69; but inside the 7 x 7
# bottleneck (benchmarks/conv.py resnet_s4, both build orders, 40 rounds) 1.03x slower, the
# 14 x 14 one 0.89x: so only where positions pass one panel (L > NR).
# Its 3x3s were slower so (s4 2.46 -> 3.00 ms): their columns in 6-row panels took 2.5x the
# im2col time (a row tile's positions 6 floats apart per k), and the GEMM's 4608 x 64 weight
# panel, re-streamed by each row tile, gained nothing: they keep the column panels.
ROWS_BELOW = 0.9


def rows_applies(cs: ConvShape, nr: int, lanes: int) -> bool:
    """The conv's GEMM transposed (positions as rows): a 1x1 conv with no padding (x read in
    place), one group, output channels in whole vectors, positions past one panel and filling
    their column panels below ROWS_BELOW."""
    return cs.groups == 1 and cs.o % lanes == 0 and all(k == 1 for k in cs.kernel) \
        and not any(cs.pad_begin + cs.pad_end) and nr < cs.length < ROWS_BELOW * cs.panels(nr) * nr


def rows_panel(o: int, nr: int, lanes: int) -> int:
    """The widest of NR, 2 and 1 vectors that divides the output channels."""
    return next(w for w in (nr, 2 * lanes, lanes) if o % w == 0)


def conv_gemm_rows(x: te.Tensor, wp: te.Tensor, cs: ConvShape, mr: int) -> te.Tensor:
    """A 1x1 unpadded conv y[n, o, j] = sum_c x[n, c, position j at the stride] * W[o, c],
    computed as yt[n, j, o] over whole MR-row tiles of positions j (the rows past L re-read
    position L - 1; a prepacked GEMM: wp is W^T's panels (O/NR, C, NR)), then written back
    transposed and cropped to the L real positions (a block CPUMatmul computes at the tile, as
    the column crop)."""
    nb, kdim, nrw = (int(d) for d in wp.shape)
    rows = -(-cs.length // mr) * mr
    k = te.reduce_axis((0, kdim), name="k")

    def a(n, j, c):
        j = tirx.min(j, cs.length - 1)
        if len(cs.size) == 1:
            return x[n, c, j * cs.strides[0]]
        return x[n, c, j // cs.out[1] * cs.strides[0], j % cs.out[1] * cs.strides[1]]

    yt = te.compute((cs.n, rows, nb * nrw), lambda n, j, o: te.sum(a(n, j, k) * wp[o // nrw, k, o % nrw], axis=k),
                    name=PACKED_BLOCK)
    return te.compute((cs.n, cs.o, cs.length), lambda n, o, j: yt[n, j, o], name=CROP_BLOCK)


PAD_BLOCK = "conv_pad"
WIDE_PAD_BLOCK = "conv_pad_wide"
PANEL_ATTR = "conv_panel_width"  # on an implicit GEMM's block: its NR (CPUMatmul's packed path)


def implicit(cs: ConvShape) -> bool:
    """A stride-1 1-D conv: im2col column (c, t) is row c of x shifted by t * dilation, so the
    GEMM reads x (padded) directly, a contiguous vector per (c, t) and panel: no columns.
    (pad_input's phases make this hold at any stride, but measured interleaved, load 16:
    Whisper's stride-2 conv ran 1.16x slower so than from im2col columns, Wav2Vec2's strided
    stack 0.97x: the (c, t) vectors of a panel are 1536 rows apart where the columns are one
    contiguous panel. Strided convs keep their columns. Re-measured per shape, each of
    Wav2Vec2-base's strided extractor convs 2-6 alone + GELU, 40 reps, load 10-12, each A/B
    in both build orders (the order swung the short layers: layer 6 read 0.29 with implicit
    built second, 4.36 with it built first): implicit / im2col 1.06, 1.07, 1.17, 1.33, 1.11,
    the geometric means of the two orders.)"""
    return len(cs.size) == 1 and cs.strides == [1]


def pad_input(x: te.Tensor, cs: ConvShape, nr: int, lanes: int) -> te.Tensor:
    """x with its padding as zeros, split into the stride's phases and long enough for whole
    panels of every tap (rounded up to whole vectors): xp[n, c, r, m] = x[n, c, m * s + r - pad]."""
    nb, s = cs.panels(nr), cs.strides[0]
    width = -(-(nb * nr + cs.dilation[0] * (cs.kernel[0] - 1) // s) // lanes) * lanes
    pb, size = cs.pad_begin[0], cs.size[0]

    def f(n, c, r, m):
        q = m * s + r - pb
        return tirx.if_then_else(tirx.all(q >= 0, q < size), x[n, c, tirx.max(tirx.min(q, size - 1), 0)],
                                 tirx.const(0, x.dtype))

    return te.compute((cs.n, cs.c, s, width), f, name=PAD_BLOCK)


def conv_gemm_implicit(w: te.Tensor, xp: te.Tensor, cs: ConvShape, nr: int) -> te.Tensor:
    """y[n, g*Og + o, j] = sum_(c, t) w[g, o, (c, t)] * x_padded[n, g*Cg + c, j * s + t * dilation]
    (xp: pad_input's phases), over whole panels of nr (the caller crops): the packed_matmul
    block CPUMatmul schedules with the panel width from PANEL_ATTR (its B operand is no
    packed tensor)."""
    nb, kw, dl, s = cs.panels(nr), cs.kernel[0], cs.dilation[0], cs.strides[0]
    k = te.reduce_axis((0, cs.kg), name="k")

    def f(n, o, j):
        g = o // cs.og if cs.groups > 1 else 0
        q = k % kw * dl
        return te.sum(w[g, o % cs.og if cs.groups > 1 else o, k] * xp[n, g * cs.cg + k // kw, q % s, j + q // s], axis=k)

    return te.compute((cs.n, cs.o, nb * nr), f, name=PACKED_BLOCK, attrs={PANEL_ATTR: nr})


# A stride-1 2-D conv reads, for tap (th, tw), the padded image shifted by th * Wp + tw: over the
# positions j = oh * Wp + ow of the padded width Wp, each (channel, tap) operand is one contiguous
# run of the flat padded image, so the GEMM reads it in place, as the 1-D implicit GEMM does, and
# no K x L columns are written (ResNet-50's 3x3s: 9x their input). The Wp - OW positions past each
# output row are computed and dropped; where that costs more than WIDE_MAX_PANELS the panels of the
# positions themselves, the conv keeps its columns.
WIDE_MAX_PANELS = 1.15


def wide_width(cs: ConvShape) -> int:
    """Wp: the padded input's width, the wide GEMM's positions per output row."""
    return cs.size[1] + cs.pad_begin[1] + cs.pad_end[1]


def wide_rows(cs: ConvShape, nr: int) -> int:
    """R: the padded image's rows, enough that the wide GEMM's whole panels read inside it for every tap."""
    wp = wide_width(cs)
    reach = -(-cs.out[0] * wp // nr) * nr + (cs.kernel[0] - 1) * cs.dilation[0] * wp + (cs.kernel[1] - 1) * cs.dilation[1]
    return -(-reach // wp)


def wide_applies(cs: ConvShape, nr: int) -> bool:
    """A stride-1 2-D conv, one group, kernel beyond 1x1, no negative pads, Og >= MIN_GROUP_ROWS,
    whose wide positions (OH * Wp) take at most WIDE_MAX_PANELS x the panels of its own (OH * OW),
    and whose padded image's offsets fit wide_taps' int32."""
    if len(cs.size) != 2 or cs.strides != [1, 1] or cs.groups != 1 or cs.kernel == [1, 1] \
            or min(cs.pad_begin + cs.pad_end) < 0 or cs.og < MIN_GROUP_ROWS:
        return False
    return -(-cs.out[0] * wide_width(cs) // nr) <= WIDE_MAX_PANELS * cs.panels(nr) \
        and cs.c * wide_rows(cs, nr) * wide_width(cs) < 2**31


def pad_wide(x: te.Tensor, cs: ConvShape, nr: int) -> te.Tensor:
    """x with its padding as zeros, (N, C, R, Wp) (R: wide_rows; the rows past the image zero)."""
    wp, rows, (h, w), (pt, pl) = wide_width(cs), wide_rows(cs, nr), cs.size, cs.pad_begin

    def f(n, c, r, q):
        a, b = r - pt, q - pl
        inside = tirx.all(a >= 0, a < h, b >= 0, b < w)
        return tirx.if_then_else(inside, x[n, c, tirx.max(tirx.min(a, h - 1), 0), tirx.max(tirx.min(b, w - 1), 0)],
                                 tirx.const(0, x.dtype))

    return te.compute((cs.n, cs.c, rows, wp), f, name=WIDE_PAD_BLOCK)


def wide_taps(cs: ConvShape, rows: int) -> np.ndarray:
    """Per k = (c, th, tw), where its run starts in the flat padded image: c * R * Wp + th * dh *
    Wp + tw * dw (int32). A table, not the divisions by KH * KW and KW in the k loop."""
    wp = wide_width(cs)
    c, th, tw = np.meshgrid(np.arange(cs.cg), np.arange(cs.kernel[0]), np.arange(cs.kernel[1]), indexing="ij")
    return (c * rows * wp + th * cs.dilation[0] * wp + tw * cs.dilation[1]).reshape(-1).astype(np.int32)


def conv_gemm_wide(w: te.Tensor, xp: te.Tensor, taps: te.Tensor, cs: ConvShape, nr: int) -> te.Tensor:
    """y[n, o, j] = sum_k w[0, o, k] * xp[n, taps[k] + j] over whole panels of the positions
    j = oh * Wp + ow (xp: pad_wide's image, flat; taps: wide_taps); the packed_matmul block
    CPUMatmul schedules with the panel width from PANEL_ATTR."""
    nb = -(-cs.out[0] * wide_width(cs) // nr)
    k = te.reduce_axis((0, cs.kg), name="k")
    return te.compute((cs.n, cs.o, nb * nr),
                      lambda n, o, j: te.sum(w[0, o, k] * xp[n, taps[k].astype("int64") + j], axis=k),
                      name=PACKED_BLOCK, attrs={PANEL_ATTR: nr})


def _geometry(call) -> tuple[ConvShape, np.ndarray] | None:
    """The convolution's shape and weight when a rewrite here applies: float32, constant weight,
    static shapes, canonical layouts."""
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
    return (cs, wt) if cs.valid() else None


def _pointwise(call) -> bool:
    """A 1x1 conv2d, stride 1, no padding (dilation is then moot)."""
    a = call.attrs
    ks = call.args[1].ty.shape
    return len(ks) == 4 and int(ks[2]) == 1 and int(ks[3]) == 1 and all(int(v) == 1 for v in a.strides) \
        and not any(int(v) for v in a.padding)


def _gemm_fits(cs: ConvShape, nr: int) -> bool:
    return cs.og >= MIN_GROUP_ROWS and cs.cols_bytes(nr) <= MAX_COLS_BYTES


# Elementwise ops a crop slides past (crop(f(y)) == f(crop(y))): a 1-D conv's GEMM output
# stays in whole NR panels through its bias and activation, so they fold into the GEMM's
# write-back as one unguarded vector loop; the crop (a slice) moves to where the values leave
# the chain and fuses into the consumer (the next conv's im2col reads the panels directly).
# Before: the crop's tail guard in the tile made the whole epilogue scalar (GELU's polynomial
# on every output), 1.7x the time of the same conv at a length of whole panels.
_UNARY = {"relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.relu", "relax.nn.silu", "relax.sigmoid", "relax.tanh",
          "relax.erf", "relax.exp", "relax.negative", "relax.sqrt", "relax.clip", "relax.nn.leakyrelu"}
_BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
           "relax.power"}
SLICE_OP = "relax.strided_slice"


def _axes(permute) -> list[int] | None:
    """A permute_dims call's axes (None: the default, all reversed)."""
    axes = permute.attrs.axes
    return None if axes is None else [int(a) for a in axes]


def _split_view_args(value, views):
    """value's args with each view var replaced by views[var], other tensors as (arg, static
    shape), and the views' shape; None where two views differ or a tensor's shape is unknown."""
    args, shape = [], None
    for a in value.args:
        if isinstance(a, relax.Var) and a in views:
            view = [int(d) for d in a.ty.shape]
            if shape is not None and view != shape:
                return None
            shape = view
            args.append(views[a])
        elif not isinstance(a, relax.Var) and getattr(a, "ty", None) is None:
            args.append(a)  # (no tensor: clip's bounds)
        else:
            st = _static(getattr(getattr(a, "ty", None), "shape", None) or [])
            if st is None or len(st) > 4:
                return None
            args.append((a, st))
    return None if shape is None else (args, shape)


def _broadcasts_along_last(e) -> bool:
    """The same value for every position of the cropped (last) axis: a tensor whose
    right-aligned last dim is 1 or a scalar; or no tensor at all (clip's bounds)."""
    shape = getattr(getattr(e, "ty", None), "shape", None)
    if shape is None:
        return not isinstance(e, relax.Var)
    shape = _static(shape)
    return shape is not None and (len(shape) == 0 or shape[-1] == 1)


@mutator
class _ConvGemm(PyExprMutator):
    def __init__(self, mod, nr: int, panels: bool, implicit: bool, lanes: int, trim: bool, strided_loads: bool,
                 depthwise: bool, pointwise: bool, channels_last: bool, narrow: bool = True, rows: bool = True,
                 wide: bool = True):
        super().__init__(mod)
        self.depthwise, self.pointwise, self.channels_last = depthwise, pointwise, depthwise and channels_last
        self.pending_flat = []  # (the 4-D view call returned, its 3-D (N, O, L) var, its wide geometry)
        # var bound to a 2-D conv's (N, O, OH, OW) view -> (its (N, O, L) var, None), or for a wide
        # GEMM (conv_gemm_wide) -> (its (N, O, panels) var, (OH, Wp, OW): the view's crop)
        self.flat = {}
        self.pending_tokens = []  # (a view call returned, its tokens (N, L, C) var)
        self.tokens = {}  # var bound to an (N, C, H, W) or (N, C, L) view of tokens -> the tokens var
        self.nr, self.panels, self.implicit, self.lanes, self.trim = nr, panels, implicit, lanes, trim
        self.strided_loads, self.narrow, self.rows, self.wide = strided_loads, narrow, rows, wide
        self.pending = []  # (the slice call returned for a conv, the whole-panel GEMM var, L)
        self.padded = {}  # var bound to a crop -> (its whole-panel var, L)

    def visit_var_binding_(self, binding):
        value = self.visit_expr(binding.value)
        sunk = self._sink_tokens(value) if self.channels_last else None
        if isinstance(sunk, relax.Var) and isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, sunk)  # a view of tokens viewed back as tokens: the tokens
            return
        if sunk is None and self.pointwise:
            sunk = self._sink_flat(value)
        sunk = sunk if sunk is not None else self._sink(value)
        if sunk is not None:
            value = sunk
        if isinstance(binding.var, relax.DataflowVar):
            var = self.builder_.emit(value, name_hint=binding.var.name)
        else:
            var = self.builder_.emit_output(value, name_hint=binding.var.name)
        self.set_var_remap(binding.var, var)
        self._record(value, var)

    def _record(self, value, var) -> None:
        """var is bound to value: where value is a crop or a view this pass returned (pending*),
        the var is what later ops see through (padded, flat, tokens)."""
        for call, full, length in self.pending:
            if value.same_as(call):
                self.padded[var] = (full, length)
        for call, flat, wide in self.pending_flat:
            if value.same_as(call):
                self.flat[var] = (flat, wide)
        for call, tok in self.pending_tokens:
            if value.same_as(call):
                self.tokens[var] = tok

    def _tokens_view(self, tok, shape):
        """The tokens (N, L, C) seen as (N, C, L) (shape of rank 3) or (N, C, H, W): what the
        graph's ops expect, recorded so _sink_tokens takes it apart again."""
        b = self.builder_
        t = relax.op.permute_dims(tok, [0, 2, 1])
        call = t if len(shape) == 3 else relax.op.reshape(b.emit(t), shape)
        self.pending_tokens.append((call, tok))
        return call

    def _tokens_source(self, x, cs: ConvShape):
        """t where the conv's input x is reshape(permute_dims(t, [0, 2, 1]), (N, C, H, W)) of tokens
        t (N, H*W, C) (SegFormer's Mix-FFN); None otherwise."""
        try:
            r = self.lookup_binding(x)
            p = self.lookup_binding(r.args[0]) if getattr(getattr(r, "op", None), "name", "") == "relax.reshape" else None
        except Exception:  # (a parameter: no binding)
            return None
        if getattr(getattr(p, "op", None), "name", "") != "relax.permute_dims" or _axes(p) != [0, 2, 1]:
            return None
        t = p.args[0]
        st = _static(getattr(t.ty, "shape", None) or [])
        return t if st == [cs.n, cs.size[0] * cs.size[1], cs.c] else None

    def _sink_tokens(self, value):
        """Ops on a view of tokens computed on the tokens: an elementwise op with per-channel
        operands (the conv's bias, (1, C, 1, 1) -> (1, 1, C)) on them, the view it returns; the
        reshape (N, C, H, W) -> (N, C, H*W) a view too; permute_dims back to (N, L, C) the tokens
        var itself. So the transposes around the channels-last conv go unused. None: no such op."""
        op = getattr(getattr(value, "op", None), "name", None)
        if op is None or not any(isinstance(a, relax.Var) and a in self.tokens for a in value.args):
            return None
        b = self.builder_
        if op == "relax.permute_dims":
            v = value.args[0]
            if len(v.ty.shape) == 3 and _axes(value) == [0, 2, 1]:
                return self.tokens[v]
            return None
        if op == "relax.reshape":
            v = value.args[0]
            n, c, *hw = (int(d) for d in v.ty.shape)
            want = _static(value.ty.shape)
            if len(hw) == 2 and want == [n, c, hw[0] * hw[1]]:
                return self._tokens_view(self.tokens[v], want)
            return None
        if op not in _UNARY and op not in _BINARY:
            return None
        split = _split_view_args(value, self.tokens)
        if split is None:
            return None
        args, shape = split
        spatial, c = len(shape) - 2, shape[1]
        out = []
        for a in args:
            if not isinstance(a, tuple):
                out.append(a)
                continue
            a, st = a
            if len(st) == 0 or st == [1]:
                out.append(a)
                continue
            # right-aligned to (N, C, *spatial): every spatial dim 1, C's dim 1 or C, N's 1
            tail = st[-spatial:] if len(st) >= spatial else st
            ch = st[-spatial - 1] if len(st) > spatial else 1
            if any(d != 1 for d in tail) or ch not in (1, c) or any(d != 1 for d in st[:-spatial - 1]):
                return None
            out.append(b.emit(relax.op.reshape(a, (1, 1, ch))))
        tok = b.emit(relax.Call(value.op, out, value.attrs, value.ty_args))
        return self._tokens_view(tok, shape)

    def _pattern(self, call, kind: int):
        """call (a call_te's call_tir) with its PrimFunc's op_pattern set to kind, for FuseOps."""
        gv = call.args[0]
        self.builder_.update_func(gv, self.builder_.get()[gv].with_attr("op_pattern", kind))
        return call

    def _emit(self, value):
        """value bound to a new var, recorded as visit_var_binding_ does."""
        var = self.builder_.emit(value)
        self._record(value, var)
        return var

    def _view(self, flat, shape, wide=None):
        """reshape(flat, shape): a 2-D conv's (N, O, L) result as (N, O, OH, OW), recorded so its
        elementwise consumers sink below the reshape (_sink_flat). wide = (OH, Wp, OW): flat is a
        wide GEMM's whole panels, whose first OH * Wp positions are (OH, Wp) rows, the first OW of
        each the output's."""
        if wide is None:
            call = relax.op.reshape(flat, shape)
        else:
            b, (oh, wp, ow) = self.builder_, wide
            n, o, cols = (int(d) for d in flat.ty.shape)
            rows = flat if cols == oh * wp else b.emit(relax.op.strided_slice(flat, axes=[2], begin=[0], end=[oh * wp]))
            grid = b.emit(relax.op.reshape(rows, (n, o, oh, wp)))
            call = relax.op.strided_slice(grid, axes=[3], begin=[0], end=[ow])
        self.pending_flat.append((call, flat, wide))
        return call

    def _sink_flat(self, value):
        """f(view(y), c) -> view(f(y, c')) for an elementwise f and operands c constant over the
        spatial positions (a per-channel bias (1, O, 1, 1) becomes (1, O, 1)): FuseOps then puts f
        into the GEMM's epilogue, where the reshape between them stopped it (MobileViT's BN + SiLU
        after every conv ran as a kernel of its own). Relax ops only: TVM imports Clip (ReLU6) as
        a TIR kernel already, which stays after the reshape. None when it does not apply."""
        op = getattr(getattr(value, "op", None), "name", None)
        if op not in _UNARY and op not in _BINARY:
            return None
        b = self.builder_
        wides = {self.flat[a][1] for a in value.args if isinstance(a, relax.Var) and a in self.flat}
        if len(wides) > 1:
            return None  # (views of different layouts: their flat vars do not line up)
        split = _split_view_args(value, {v: f for v, (f, _) in self.flat.items()})
        if split is None:
            return None
        args, shape = [], split[1]
        for a in split[0]:
            if isinstance(a, tuple):  # per channel: the spatial dims' 1s become one
                a, st = a
                if any(d != 1 for d in st[-2:]):
                    return None
                a = a if len(st) <= 1 else b.emit(relax.op.reshape(a, st[:-1]))
            args.append(a)
        flat = relax.Call(value.op, args, value.attrs, value.ty_args)
        sunk = self._sink(flat)  # a 1-D GEMM's panels: the crop slides past f too
        fv = self._emit(sunk if sunk is not None else flat)
        if len(getattr(fv.ty, "shape", [])) != 3:
            return None  # (a broadcast that changed the rank)
        return self._view(fv, shape, *wides)

    def _crop(self, full, length: int, fusable: bool):
        """The first `length` positions of `full`. fusable: a slice FuseOps puts into the GEMM
        (the crop stage CPUMatmul computes in the tile); else, after an epilogue chain, its own
        copy kernel: fused back, the chain's guard would be the tile's again."""
        if fusable:
            call = relax.op.strided_slice(full, axes=[2], begin=[0], end=[length])
        else:
            b = self.builder_
            n, c, _ = (int(d) for d in full.ty.shape)
            call = b.call_te(lambda t: te.compute((n, c, length), lambda i, o, j: t[i, o, j], name=CROP_BLOCK), full,
                             primfunc_name_hint="conv_crop")
            self._pattern(call, OPAQUE)
        self.pending.append((call, full, length))
        return call

    def _sink(self, value):
        """f(crop(y), c) -> crop(f(y, c)) for an elementwise f and operands c that do not vary
        along the cropped axis; None when it does not apply."""
        op = getattr(getattr(value, "op", None), "name", None)
        if not self.panels or (op not in _UNARY and op not in _BINARY):
            return None
        args, length, hit = [], None, False
        for a in value.args:
            if isinstance(a, relax.Var) and a in self.padded:
                full, n = self.padded[a]
                if length is not None and n != length:
                    return None
                length, hit = n, True
                args.append(full)
            elif _broadcasts_along_last(a):
                args.append(a)
            else:
                return None
        if not hit:
            return None
        full = self.builder_.emit(relax.Call(value.op, args, value.attrs, value.ty_args))
        if len(getattr(full.ty, "shape", [])) != 3:
            return None  # (a broadcast that changed the rank: the 3-D slice no longer fits)
        return self._crop(full, length, fusable=False)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", None) not in _LAYOUTS:
            return call
        if call.op.name == "relax.nn.conv2d" and is_patch_conv(call) and not (self.pointwise and _pointwise(call)):
            return call  # fast_math's patch-conv rewrite (optimize, after this phase) or TVM's conv
        found = _geometry(call)
        if found is None:
            return call
        cs, wt = found
        if self.pointwise and len(cs.size) == 2 and _pointwise(call) and _gemm_fits(cs, self.nr):
            # a 1x1 conv is a 1-D one over the H*W positions (x viewed (N, C, H*W)): the GEMM
            # reads x in place (the implicit path) and writes NCHW, where the patch-conv rewrite
            # transposed x to tokens and the product back (2 copies of each tensor)
            b = self.builder_
            n, c, h, w = _static(call.args[0].ty.shape)
            x3 = b.emit(relax.op.reshape(call.args[0], (n, c, h * w)))
            cs3 = ConvShape([n, c, h * w], [cs.o, cs.cg, 1], [1], [0, 0], [1], cs.groups)
            y3 = self._emit(self._conv_gemm(x3, cs3, wt.reshape(cs.o, cs.cg, 1)))
            return self._view(y3, (n, cs.o, h, w))
        tokens = self._tokens_source(call.args[0], cs) \
            if self.channels_last and depthwise.tokens_applies(cs, self.lanes) else None
        if tokens is not None:  # channels-last: no transposes around it (depthwise.py)
            b = self.builder_
            wk = relax.const(np.ascontiguousarray(wt.reshape(cs.c, *cs.kernel).transpose(1, 2, 0)))  # (KH, KW, C)
            dw = b.call_te(lambda t, k: depthwise.depthwise_tokens(t, k, cs), tokens, wk,
                           primfunc_name_hint="conv_depthwise_tokens")
            self._pattern(dw, OUT_EWISE_FUSABLE)
            return self._tokens_view(b.emit(dw), (cs.n, cs.c, *cs.out))
        if self.depthwise and depthwise.applies(cs):
            wk = relax.const(np.ascontiguousarray(wt.reshape(cs.c, *cs.kernel)))
            dw = self.builder_.call_te(lambda t, k: depthwise.depthwise(t, k, cs, self.lanes), call.args[0], wk,
                                       primfunc_name_hint="conv_depthwise")
            # its consumers (bias, activation) fuse into its row loop, as a GEMM's
            return self._pattern(dw, OUT_EWISE_FUSABLE)
        if self.wide and self.pointwise and wide_applies(cs, self.nr):
            # (pointwise: _sink_flat moves the bias and activation into the wide GEMM's epilogue)
            return self._view(self.builder_.emit(self._conv_gemm_wide(call.args[0], cs, wt)), (cs.n, cs.o, *cs.out),
                              wide=(cs.out[0], wide_width(cs), cs.out[1]))
        if not _gemm_fits(cs, self.nr):
            return call
        return self._conv_gemm(call.args[0], cs, wt) if len(cs.out) == 1 else \
            self._view(self.builder_.emit(self._conv_gemm(call.args[0], cs, wt)), (cs.n, cs.o, *cs.out))

    def _conv_gemm_wide(self, x, cs: ConvShape, wt):
        """The stride-1 2-D conv as the wide implicit GEMM (conv_gemm_wide) over pad_wide's
        padded image, viewed flat: the GEMM's (N, O, panels) call."""
        b = self.builder_
        wmat = relax.const(np.ascontiguousarray(wt.reshape(1, cs.o, cs.kg)))
        pad = b.call_te(lambda t: pad_wide(t, cs, self.nr), x, primfunc_name_hint="conv_pad")
        # opaque: FuseOps fused the flattening reshape into it, which CPUIm2col then did not
        # schedule (0.22 ms serial for ResNet's 128 x 28 x 28); alone, the reshape is a view
        padded = b.emit(self._pattern(pad, OPAQUE))
        _, _, rows, wp = (int(d) for d in padded.ty.shape)
        xp = b.emit(relax.op.reshape(padded, (cs.n, cs.c * rows * wp)))
        taps = relax.const(wide_taps(cs, rows))
        return self._pattern(b.call_te(lambda a, t, o: conv_gemm_wide(a, t, o, cs, self.nr), wmat, xp, taps,
                                       primfunc_name_hint="conv_gemm"), OUT_EWISE_FUSABLE)

    def _conv_gemm_rows(self, x, cs: ConvShape, wt):
        """The conv as the transposed GEMM (conv_gemm_rows), reading x in place: its (N, O, L) value."""
        b = self.builder_
        wp = relax.const(pack_weights(np.ascontiguousarray(wt.reshape(cs.o, cs.kg).T),
                                      rows_panel(cs.o, self.nr, self.lanes)))
        return self._pattern(b.call_te(lambda t, w: conv_gemm_rows(t, w, cs, MR), x, wp, primfunc_name_hint="conv_gemm"),
                             OUT_EWISE_FUSABLE)

    def _conv_gemm(self, x, cs: ConvShape, wt):
        """The conv as im2col (or the padded input) + packed GEMM: 1-D, its (N, O, L) value (in
        whole panels and cropped where those apply); 2-D, the (N, O, OH*OW) GEMM."""
        if self.trim:
            cs, wt = trim_taps(cs, wt)
        b = self.builder_
        # The input cropped from a previous conv's whole panels: the gather reads those panels
        # (its indices stay below L, so the same values) and the crop goes unused.
        x = self.padded.get(x, (x, None))[0]
        if self.rows and rows_applies(cs, self.nr, self.lanes):
            return self._conv_gemm_rows(x, cs, wt)
        wmat = relax.const(np.ascontiguousarray(wt.reshape(cs.groups, cs.og, cs.kg)))
        one_d = len(cs.out) == 1
        panels = one_d and self.panels  # (2-D: the reshape to (OH, OW) needs the crop first)
        if panels and self.implicit and implicit(cs):
            if cs.kernel == [1] and cs.pad_begin == [0] and cs.length % self.nr == 0:
                # no padding, whole panels: x itself is the padded input (a 1x1 conv's, in place)
                xp = b.emit(relax.op.reshape(x, (cs.n, cs.c, 1, cs.size[0])))
            else:
                xp = b.emit(b.call_te(lambda t: pad_input(t, cs, self.nr, self.lanes), x, primfunc_name_hint="conv_pad"))
            gemm = b.call_te(lambda a, t: conv_gemm_implicit(a, t, cs, self.nr), wmat, xp, primfunc_name_hint="conv_gemm")
        else:
            vector_rows = not one_d and self.strided_loads and strided.applies_2d(cs, self.lanes, self.nr)
            xs = _static(x.ty.shape)
            if not one_d and self.narrow and strided.applies_narrow(cs, self.lanes):
                kernel = strided.im2col_narrow(xs, cs, self.nr)
            elif vector_rows:
                kernel = strided.im2col_2d(xs, cs, self.nr, self.lanes)
            elif panels and self.strided_loads and strided.applies(cs, self.lanes, self.nr):
                kernel = strided.strided_im2col(xs, cs, self.nr, self.lanes)
            else:
                kernel = None
            if kernel is not None:
                gv = add_kernel(b, kernel, "conv_im2col")
                cols = b.emit(relax.call_tir(gv, [x], out_ty=relax.TensorType(list(cs.cols_shape(self.nr)), "float32")))
            else:
                cols = b.emit(b.call_te(lambda t: im2col(t, cs, self.nr), x, primfunc_name_hint="conv_im2col"))
            gemm = b.call_te(lambda a, c: conv_gemm(a, c, cs, crop=not panels), wmat, cols,
                             primfunc_name_hint="conv_gemm")
        # A GEMM to FuseOps, so the bias and activation after it fuse into its epilogue (the
        # group index o // Og hides that from AnnotateTIROpPattern: it said reduction, 3).
        self._pattern(gemm, OUT_EWISE_FUSABLE)
        if not panels or cs.length % self.nr == 0:
            return gemm  # not emitted: the caller binds it (an alias binding would stop FuseOps)
        return self._crop(b.emit(gemm), cs.length, fusable=True)


def conv_gemm_pass(nr: int, panels: bool = True, implicit_gemm: bool = True, lanes: int = 16,
                   trim: bool = True, strided_loads: bool = True, depthwise: bool = True,
                   pointwise: bool = True, channels_last: bool = True, narrow: bool = True,
                   rows: bool = True, wide: bool = True) -> tvm.transform.Pass:
    """Every conv1d/conv2d the rewrite covers but patch convolutions (fast_math's), as im2col
    + packed GEMM with panels of nr (panels: 1-D outputs stay in whole panels through their
    elementwise consumers, cropped after them; implicit_gemm: stride-1 1-D convs read their
    padded input in the GEMM instead of columns; trim: taps that only ever read padding dropped;
    strided_loads: strided 1-D convs' columns by contiguous loads and a shuffle, conv/strided.py;
    depthwise: depthwise convs on the direct kernel of conv/depthwise.py, not TVM's conv;
    pointwise: 1x1 conv2d as a 1-D conv over H*W (not fast_math's patch conv), and the elementwise
    consumers of every 2-D conv's GEMM moved before its (N, O, OH, OW) reshape, into its epilogue;
    channels_last: a depthwise conv between token layouts on depthwise.py's channels-last kernel;
    narrow: 2-D convs with output rows narrower than a vector, or strided rows of no whole
    vectors, their columns row by row (strided.im2col_narrow), not by the gather or im2col_2d's
    straddling vectors); rows: 1x1 unpadded one-group convs whose positions fill column panels
    badly (ResNet's 14 x 14 stage) as the transposed GEMM, positions as rows (conv_gemm_rows); wide:
    stride-1 2-D convs as an implicit GEMM over the padded image's rows (conv_gemm_wide), no
    columns."""

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeConvGemm")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from blockforge.compile.passes.exprs import rewrite_functions

        # (unused: the crops the chain slid past)
        return rewrite_functions(mod, _ConvGemm(mod, nr, panels, implicit_gemm, lanes, trim, strided_loads, depthwise, pointwise,
                                                channels_last, narrow, rows, wide), unused=True)

    return _pass
