"""Depthwise convolutions (one input channel per output channel) as a direct vectorised kernel.

The im2col + GEMM path (rewrite.py) is wrong for them: a GEMM of one output row per group
fills 1/6 of each micro-tile. TVM's own conv2d is a serial scalar loop nest under a padded
copy of the whole input. Here, per (batch, channel), the parallel loop:

    xp[r, m]  = x[r - pad_h, m - pad_w]   (zero outside x)          the channel's padded plane
    acc[i, q] = sum_(kh, kw) xp[i*sh + kh*dh, q + kw*dw] * w[c, kh, kw]   q < Q, whole vectors
    y[i, j]   = acc[i, j*sw]                                          j < OW (a select block)

The plane is built once per channel (in cache: MobileViT's largest, 130 x 130 floats, is 66
KiB) and each tap reads it as contiguous vectors. A strided conv is computed at every column
along the width (stride 1) and every sw-th is kept: TVM scalarises a strided vector load (a
load and an insert per lane), and one per tap cost more than the sw-fold columns. Rows are not
wasted: the row stride only picks which plane rows a tap reads.

Measured in models of the convs alone (benchmarks/conv.py --ab conv-depthwise, Zen 5, 2 threads,
interleaved with ORT and OpenVINO): this kernel / TVM's conv 0.29 (MobileViT's 3x3 pair, stride 2
then 1, + SiLU), 0.22 (SegFormer's 3x3 at 128 x 128 x 128 + GELU), 0.23 / 0.22 (ConvNeXt's 7x7 at
96 x 56 x 56 / 384 x 14 x 14); 0.44x-0.86x ORT's time, the best peer on each.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tvm import te, tirx

if TYPE_CHECKING:
    from blockforge.compile.conv.rewrite import ConvShape

PAD_BLOCK = "dw_pad"
CONV_BLOCK = "dw_conv"
SELECT_BLOCK = "dw_select"
# The channel's padded plane is a kernel-local buffer per parallel iteration; beyond this the
# conv stays TVM's (a 1-channel 2048 x 2048 image would be a 16 MiB plane per thread).
MAX_PLANE_BYTES = 4 << 20
# Column strides computed at stride 1 and subsampled: sw times the work along the width.
MAX_STRIDE = 4


def applies(cs: ConvShape) -> bool:
    """One input and one output channel per group (Og = Cg = 1), 1-D or 2-D."""
    if not (len(cs.size) in (1, 2) and cs.valid() and cs.cg == 1 and cs.og == 1 and cs.groups > 1
            and cs.strides[-1] <= MAX_STRIDE):
        return False
    hp, wp = _plane(cs, 16)
    return 4 * hp * wp <= MAX_PLANE_BYTES


def _dims(cs: ConvShape):
    """(rows, cols) geometry as 2-D: a 1-D conv is one row."""
    if len(cs.size) == 1:
        return ([1, cs.size[0]], [1, cs.kernel[0]], [1, cs.strides[0]], [1, cs.dilation[0]],
                [0, cs.pad_begin[0]], [1, cs.out[0]])
    return cs.size, cs.kernel, cs.strides, cs.dilation, cs.pad_begin, cs.out


def columns(cs: ConvShape, lanes: int) -> int:
    """Q: the columns acc computes per row at stride 1: whole vectors, sw per kept output."""
    _, _, (_, sw), _, _, (_, ow) = _dims(cs)
    step = lanes * sw // math.gcd(lanes, sw)
    return -(-(ow * sw) // step) * step


def _plane(cs: ConvShape, lanes: int) -> tuple[int, int]:
    _, (kh, kw), (sh, _), (dh, dw), _, (oh, _) = _dims(cs)
    return (oh - 1) * sh + (kh - 1) * dh + 1, columns(cs, lanes) + (kw - 1) * dw


def depthwise(x: te.Tensor, w: te.Tensor, cs: ConvShape, lanes: int) -> te.Tensor:
    """y = the depthwise conv of x (N, C, *size) by w (C, *kernel); the blocks CPUDepthwise
    schedules (conv/schedule.py)."""
    (h, wd), (kh, kw), (sh, sw), (dh, dw), (ph, pw), (oh, ow) = _dims(cs)
    one_d = len(cs.size) == 1
    hp, wp = _plane(cs, lanes)
    q = columns(cs, lanes)

    def pad(n, c, r, m):
        a, b = r - ph, m - pw
        inside = tirx.all(a >= 0, a < h, b >= 0, b < wd)
        # likely(): TVM's LoopPartition splits the plane's loops where the guard changes, so
        # the interior copy is guard-free and LLVM vectorises it
        at = (n, c, b) if one_d else (n, c, a, b)
        return tirx.if_then_else(tirx.likely(inside), x[at], tirx.const(0, x.dtype))

    xp = te.compute((cs.n, cs.c, hp, wp), pad, name=PAD_BLOCK)
    rh, rw = te.reduce_axis((0, kh), name="kh"), te.reduce_axis((0, kw), name="kw")
    wt = (lambda c, a, b: w[c, b]) if one_d else (lambda c, a, b: w[c, a, b])
    # columns as (j, phase): the kept ones are phase 0, an affine read for the select (a j * sw
    # index, TVM's reverse_compute_at cannot invert)
    acc = te.compute((cs.n, cs.c, oh, q // sw, sw),
                     lambda n, c, i, j, p: te.sum(xp[n, c, i * sh + rh * dh, j * sw + p + rw * dw] * wt(c, rh, rw),
                                                  axis=[rh, rw]),
                     name=CONV_BLOCK)
    if one_d:
        return te.compute((cs.n, cs.c, ow), lambda n, c, j: acc[n, c, 0, j, 0], name=SELECT_BLOCK)
    return te.compute((cs.n, cs.c, oh, ow), lambda n, c, i, j: acc[n, c, i, j, 0], name=SELECT_BLOCK)


# Channels-last: a depthwise conv between token layouts (SegFormer's Mix-FFN: Linear, tokens
# (N, H*W, C) -> image (N, C, H, W), the 3x3 depthwise conv, -> tokens, GELU, Linear). The NCHW
# kernel above needs both transposes (SegFormer-b0: 2 x 8 MiB a call at its first stage); here
# the conv reads and writes the tokens, vectorised along C: the whole model 0.87x its time with
# the NCHW kernel and the transposes (whole_ab.py --abba, both build orders).
TOKENS_PAD_BLOCK = "dwc_pad"
TOKENS_CONV_BLOCK = "dwc_conv"
WIDTH_ATTR = "dw_out_width"  # on the conv block: OW, the row length of its (OH*OW) positions


TOKENS_MAX_ROWS = 2  # output rows per parallel item (conv/schedule.py DW_TOKEN_ROWS, at most)


def tokens_applies(cs: ConvShape, lanes: int) -> bool:
    """As applies, channels a whole number of vectors; the padded input rows one parallel item
    copies (its output rows' reach: a dilated kernel's can be the whole padded image) at most
    MAX_PLANE_BYTES, as the NCHW kernel's plane."""
    if not (len(cs.size) == 2 and cs.valid() and cs.cg == 1 and cs.og == 1 and cs.groups > 1 and cs.c % lanes == 0):
        return False
    (_, _), (kh, kw), (sh, sw), (dh, dw), _, (_, ow) = _dims(cs)
    rows, wp = TOKENS_MAX_ROWS * sh + (kh - 1) * dh, (ow - 1) * sw + (kw - 1) * dw + 1
    return 4 * rows * wp * cs.c <= MAX_PLANE_BYTES


def depthwise_tokens(t: te.Tensor, w: te.Tensor, cs: ConvShape) -> te.Tensor:
    """y[n, i*OW + j, c] = sum_(kh, kw) x[n, i*sh + kh*dh - ph, j*sw + kw*dw - pw, c] * w[kh, kw, c]
    for t = x as tokens (N, H*W, C) and w (KH, KW, C); zero outside x (a padded copy of the rows
    a tile reads: CPUDepthwise computes it per row tile)."""
    (h, wd), (kh, kw), (sh, sw), (dh, dw), (ph, pw), (oh, ow) = _dims(cs)
    hp, wp = (oh - 1) * sh + (kh - 1) * dh + 1, (ow - 1) * sw + (kw - 1) * dw + 1

    def pad(n, r, m, c):
        a, b = r - ph, m - pw
        inside = tirx.all(a >= 0, a < h, b >= 0, b < wd)
        return tirx.if_then_else(tirx.likely(inside), t[n, a * wd + b, c], tirx.const(0, t.dtype))

    xp = te.compute((cs.n, hp, wp, cs.c), pad, name=TOKENS_PAD_BLOCK)
    rh, rw = te.reduce_axis((0, kh), name="kh"), te.reduce_axis((0, kw), name="kw")
    return te.compute((cs.n, oh * ow, cs.c),
                      lambda n, p, c: te.sum(xp[n, p // ow * sh + rh * dh, p % ow * sw + rw * dw, c] * w[rh, rw, c],
                                             axis=[rh, rw]),
                      name=TOKENS_CONV_BLOCK, attrs={WIDTH_ATTR: ow})
