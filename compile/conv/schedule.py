"""The schedules of the conv-gemm im2col (rewrite.py; the GEMM itself is CPUMatmul's) and of
the depthwise kernel (depthwise.py).

TVM's default lowering runs the gather as one serial scalar loop nest. Here the panel rows
(batch x group x panel x k) are the parallel loop and each row of NR positions is vectorised
(lanes wide). It is a gather even for stride 1: the clamped, guarded index is no ramp to TVM.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.conv.depthwise import (CONV_BLOCK, PAD_BLOCK as DW_PAD_BLOCK, TOKENS_CONV_BLOCK,
                                               TOKENS_MAX_ROWS, TOKENS_PAD_BLOCK, WIDTH_ATTR)
from blockforge.compile.conv.rewrite import IM2COL_BLOCK, PAD_BLOCK, WIDE_PAD_BLOCK
from blockforge.compile.schedule.base import PARTITION_HINT, CPURule, const_int, has_root, log_skip, vector_lanes


class CPUIm2col(CPURule):
    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        try:
            blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        except Exception:
            return None
        if len(blocks) != 1 or sch.get(blocks[0]).name_hint not in (IM2COL_BLOCK, PAD_BLOCK, WIDE_PAD_BLOCK):
            return None
        if sch.get(blocks[0]).name_hint == WIDE_PAD_BLOCK:  # (n, c, row, q): rows parallel
            n, c, r, _ = sch.get_loops(blocks[0])
            sch.parallel(sch.fuse(n, c, r))
            return sch
        if sch.get(blocks[0]).name_hint == PAD_BLOCK:  # (n, c, phase, p): rows parallel, p whole vectors
            n, c, r, p = sch.get_loops(blocks[0])
            sch.parallel(sch.fuse(n, c, r))
            _, pi = sch.split(p, [None, vector_lanes(target)])
            sch.vectorize(pi)
            return sch
        n, g, jb, k, jr = sch.get_loops(blocks[0])
        lanes = vector_lanes(target)
        nr = int(sch.get(jr).extent)
        # k in the parallel loop too: the deep Wav2Vec2 layers have one panel (L=49), and TVM
        # splits a parallel loop into one contiguous range per thread (contiguous writes still).
        sch.parallel(sch.fuse(n, g, jb, k))
        if nr % lanes == 0:
            _, ji = sch.split(jr, [None, lanes])
            sch.vectorize(ji)
        return sch


# The register tile: up to DW_VECS vectors of a row's columns, and as many rows as make
# DW_CHAINS independent accumulators (an FMA's latency x its 2 a cycle). ConvNeXt's 7x7 at
# 14 x 14 (one vector a row) ran one chain of 49 FMAs per row, 2.4x ORT's time.
DW_VECS = 4
DW_CHAINS = 8
DW_UNROLL_TAPS = 16


def _divisor(n: int, most: int) -> int:
    return max(d for d in range(1, most + 1) if n % d == 0)


def _kernel_blocks(sch: s_tir.Schedule, pad_name: str, conv_name: str):
    """(pad, conv, the blocks after conv: FuseOps' consumers, conv's loops, their static extents)
    of a depthwise kernel; None if the function is not one."""
    if not has_root(sch):
        return None
    blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
    names = [sch.get(b).name_hint for b in blocks]
    if pad_name not in names or conv_name not in names or names.index(pad_name) > names.index(conv_name):
        return None
    conv = blocks[names.index(conv_name)]
    loops = sch.get_loops(conv)
    return (blocks[names.index(pad_name)], conv, blocks[names.index(conv_name) + 1:], loops,
            [const_int(sch.get(lp).extent) for lp in loops])


def _register_tile(sch: s_tir.Schedule, conv, at, rh, unrolled, vector):
    """The conv's accumulators as a local tile written back under loop `at`: `unrolled` loops
    unrolled, `vector` vectorised, the init decomposed at the taps' first loop rh with its tile's
    (rows, vectors, lanes) likewise. Returns the write-back block."""
    acc = sch.cache_write(conv, 0, "local")
    sch.reverse_compute_at(acc, at, preserve_unit_loops=True)
    for lp in unrolled:
        sch.unroll(lp)
    sch.vectorize(vector)
    init = sch.decompose_reduction(conv, rh)
    *_, i_rows, i_vecs, i_lanes = sch.get_loops(init)
    sch.unroll(i_rows)
    sch.unroll(i_vecs)
    sch.vectorize(i_lanes)
    return acc


def _epilogue(sch: s_tir.Schedule, after, at, lanes: int) -> None:
    """FuseOps' consumers of the conv (select, bias, activation) under loop `at`: inlined into the
    last one where they inline, that one's innermost loop vectorised (a tail past whole vectors,
    ConvNeXt's 56 columns, split off at its guard)."""
    for b in after[:-1]:
        try:
            sch.compute_inline(b)
        except Exception:
            sch.reverse_compute_at(b, at)
    if not after:
        return
    last = after[-1]
    sch.reverse_compute_at(last, at)
    inner = sch.get_loops(last)[-1]
    ext = const_int(sch.get(inner).extent)
    if ext is not None and ext >= lanes:
        vo, vi = sch.split(inner, [None, lanes])
        if ext % lanes:
            sch.annotate(vo, PARTITION_HINT, 1)
        sch.vectorize(vi)


class CPUDepthwise(CPURule):
    """depthwise.py's kernel: per (batch, channel) (the parallel loop) the padded plane, then per
    few output rows a tile of vectors in registers over the kernel's taps, then those rows'
    crop/stride select and epilogue (bias, activation: FuseOps' consumers) from cache."""

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        found = _kernel_blocks(sch, DW_PAD_BLOCK, CONV_BLOCK)
        if found is None:
            return None
        pad, conv, after, loops, exts = found
        lanes = vector_lanes(target)
        if len(loops) != 7 or None in exts or exts[3] * exts[4] % lanes:
            log_skip("CPUDepthwise", func, "not the depthwise kernel's static 7 loops of whole vectors")
            return None
        n, c, row, j, p, rh, rw = loops
        nc = sch.fuse(n, c)
        sch.parallel(nc)
        q = sch.fuse(j, p)  # the columns at stride 1 (depthwise.py)
        vecs = exts[3] * exts[4] // lanes
        u = _divisor(vecs, DW_VECS)
        r = _divisor(exts[2], -(-DW_CHAINS // u))
        ro, ri = sch.split(row, [None, r])
        qo, qu, qi = sch.split(q, [None, u, lanes])
        sch.reorder(ro, qo, rh, rw, ri, qu, qi)
        # kh unrolled, the tile's rows share their loads of the plane's rows (56 x 56, 7x7: 0.13 ms
        # against 0.17 as a loop); but a tall tile of a big kernel kept every shared load live and
        # spilled (14 x 14, 7x7, 7 rows: 0.12 ms unrolled, 0.052 as a loop; ORT 0.051)
        acc = _register_tile(sch, conv, qo, rh, (rh, rw, ri, qu) if exts[5] * exts[6] <= DW_UNROLL_TAPS or r <= 2
                             else (rw, ri, qu), qi)
        *_, aj, ap = sch.get_loops(acc)  # its columns as (j, phase), as the conv's
        _, ai = sch.split(sch.fuse(aj, ap), [None, lanes])
        sch.vectorize(ai)
        sch.compute_at(pad, nc)
        for lp in sch.get_loops(pad)[-2:]:  # the plane's rows and columns: split at the guard
            sch.annotate(lp, PARTITION_HINT, 1)
        _epilogue(sch, after, ro, lanes)
        return sch


# The channels-last tile: DW_TOKEN_POSITIONS positions of a row x DW_TOKEN_VECS channel vectors
# (8 accumulators; each tap's weight vector read once for the positions).
DW_TOKEN_POSITIONS = 4
DW_TOKEN_VECS = 2
DW_TOKEN_ROWS = TOKENS_MAX_ROWS  # output rows per parallel item (4 and 8 no faster): their padded rows copied once


class CPUDepthwiseTokens(CPURule):
    """depthwise.py's channels-last kernel: per (batch, tile of output rows) (the parallel loop)
    the padded input rows it reads, then per DW_TOKEN_POSITIONS positions x DW_TOKEN_VECS channel
    vectors a register tile over the taps, then those rows' epilogue (bias, GELU: FuseOps')."""

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        found = _kernel_blocks(sch, TOKENS_PAD_BLOCK, TOKENS_CONV_BLOCK)
        if found is None:
            return None
        pad, conv, after, loops, exts = found
        lanes = vector_lanes(target)
        ow = sch.get(conv).annotations.get(WIDTH_ATTR)
        if len(loops) != 5 or None in exts or ow is None or exts[1] % int(ow) or exts[2] % lanes:
            log_skip("CPUDepthwiseTokens", func, "not the channels-last kernel's static loops of whole vectors")
            return None
        ow = int(ow)
        n, p, c, rh, rw = loops
        oh = exts[1] // ow
        r = _divisor(oh, DW_TOKEN_ROWS)
        ro, ri, j = sch.split(p, [None, r, ow])
        par = sch.fuse(n, ro)
        sch.parallel(par)
        jt = _divisor(ow, DW_TOKEN_POSITIONS)
        jo, ji = sch.split(j, [None, jt])
        vecs = _divisor(exts[2] // lanes, DW_TOKEN_VECS)
        co, cv, ci = sch.split(c, [None, vecs, lanes])
        sch.reorder(ri, jo, co, rh, rw, ji, cv, ci)
        acc = _register_tile(sch, conv, co, rh, (rh, rw, ji, cv) if exts[3] * exts[4] <= DW_UNROLL_TAPS
                             else (rw, ji, cv), ci)
        *_, ac = sch.get_loops(acc)
        sch.vectorize(sch.split(ac, [None, lanes])[1])
        sch.compute_at(pad, par)  # the rows the tile reads, once
        *_, pr, pm, pc = sch.get_loops(pad)
        for lp in (pr, pm):
            sch.annotate(lp, PARTITION_HINT, 1)
        sch.vectorize(sch.split(pc, [None, lanes])[1])
        _epilogue(sch, after, co, lanes)  # per tile, from the accumulators just written (per row tile: to L2)
        return sch
