"""Software prefetch of the next weight panel in the CPU matmul's micro-kernel (ablation
`panel-prefetch`).

CPUMatmul runs a prepacked GEMM as tiles (jo, io): column panel jo of the weights, (K, NR)
contiguous, times row tile io, io inner. The first row tile of a panel streams it from DRAM;
the rest re-read it from L2, and then the hardware prefetcher, driven by misses, is idle: the
next panel's DRAM transfer starts only when its first tile misses. At few rows (CLIP
ViT-B/32's 50 tokens: 9 row tiles, 25 FLOP per weight byte) that transfer is as long as the
panel's compute, and a whole model's weights (CLIP: 352 MB) do not stay in any cache.

Here every k step of row tile io < NR/16 also prefetches one 64-byte line of row k of panel
jo + 1 (line io): after NR/16 tiles the next panel is in flight in full, while this one
computes; the later tiles prefetch nothing. The loop CPUMatmul marks (PREFETCH_LOOP, the
micro-tile's row loop) gets the prefetch in front of it; the weight's indices are the matmul
block's own, with the row and column of the tile's first element.

By default only in GEMMs of 19-64 static rows (schedule/matmul.py PREFETCH_ROWS; settings.panel_prefetch:
"all" every static-M packed GEMM, "off" none). Measured on a loaded 2-core Zen 5 first (CLIP
ViT-B/32 0.94x-1.15x of the build without: the noise of such a machine), then quiet, whole models,
the build with it over the build without in both build orders: CLIP 0.983 / 0.911 and 1.012 /
0.914, Wav2Vec2-base (49 rows) 0.903 / 1.006: geometric means 0.946-0.962; ViT-B/16 (197 rows)
1.029, so more rows stay without.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from blockforge.compile.passes.exprs import substitute_vars

# Loop annotation CPUMatmul puts on the micro-tile's row loop of a prepacked GEMM (value: the
# panel width NR in elements).
PREFETCH_LOOP = "blockforge.panel_prefetch"
LINE_BYTES = 64


def _all(root, kind) -> list:
    out = []
    tvm_ffi.structural_walk(root, [(kind, out.append)], order="pre")
    return out


def _update_block(stmt):
    found = _all(stmt, tvm.s_tir.stmt.SBlockRealize)
    return found[0] if found else None


def _weight_load(block, wbuf):
    loads = [e for e in _all(block.body, tvm.ir.TensorLoad) if e.source.same_as(wbuf)]
    return loads[0] if loads else None


def _prefetch_for(loop: tirx.For):
    realize = _update_block(loop.body)
    if realize is None or len(realize.block.writes) != 1:
        return None
    block = realize.block
    # the update's reads: the accumulator (after decompose_reduction), A, then the panels
    reads = [r.source for r in block.reads if not r.source.same_as(block.writes[0].source)]
    if len(reads) != 2:
        return None
    wbuf = reads[1]
    load = _weight_load(block, wbuf)
    if load is None or len(load.indices) != 3 or len(wbuf.shape) != 3:
        return None
    nb, nr = int(wbuf.shape[0]), int(wbuf.shape[2])
    lines = max(1, nr * wbuf.dtype.bits // 8 // LINE_BYTES)
    # block vars -> the loops' values, at the tile's first row (this loop's var = 0) and column
    # (every loop inside it = 0)
    zero = [(f.loop_var, tirx.const(0, str(f.extent.ty))) for f in [loop, *_all(loop.body, tirx.For)]]
    bind = [(iv.var, substitute_vars(v, zero)) for iv, v in zip(block.iter_vars, realize.iter_values)]
    ana = tvm.sym.Analyzer()
    idx = [ana.simplify(substitute_vars(i, bind)) for i in load.indices]
    rows = [iv for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    if len(rows) < 2:
        return None
    row0 = ana.simplify(next(val for k, val in bind if k.same_as(rows[-2].var)))
    mr = int(loop.extent)
    dt = str(loop.extent.ty)  # the index type of the loops (int64)
    panel = tirx.min(idx[0] + tirx.const(1, dt), tirx.const(nb - 1, dt))
    tile = ana.simplify(tirx.floordiv(row0, tirx.const(mr, dt)))
    col = ana.simplify(tirx.floormod(tile, tirx.const(lines, dt)) * tirx.const(nr // lines, dt))
    addr = tirx.address_of(tirx.BufferLoad(wbuf, [panel, idx[1], col]))
    # llvm.prefetch(ptr, rw=0 read, locality=2 (prefetcht1: to L2), cache type 1 data)
    pf = tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", addr, tirx.const(0, "int32"),
                                             tirx.const(2, "int32"), tirx.const(1, "int32")))
    # Only the first NR/16 row tiles of a panel: together they cover the next panel once. In
    # every tile, the redundant prefetches cost ViT-B/16 (33 row tiles) 1.033x single-core.
    return tirx.IfThenElse(tile < tirx.const(lines, dt), pf, None)


def _rewrite(func: tirx.PrimFunc) -> tirx.PrimFunc:
    def post(s):
        if isinstance(s, tirx.For) and PREFETCH_LOOP in s.annotations:
            pf = _prefetch_for(s)
            ann = {k: v for k, v in s.annotations.items() if k != PREFETCH_LOOP}
            loop = tirx.For(s.loop_var, s.min, s.extent, s.kind, s.body, s.thread_binding, ann)
            return loop if pf is None else tirx.SeqStmt([pf, loop])
        return None

    return tvm_ffi.structural_map(func, (tirx.For, lambda s: post(s) or s))


def strip(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The annotation removed, no prefetch (ablation `panel-prefetch`)."""
    def post(s):
        if isinstance(s, tirx.For) and PREFETCH_LOOP in s.annotations:
            ann = {k: v for k, v in s.annotations.items() if k != PREFETCH_LOOP}
            return tirx.For(s.loop_var, s.min, s.extent, s.kind, s.body, s.thread_binding, ann)
        return None

    return tvm_ffi.structural_map(func, (tirx.For, lambda s: post(s) or s))


def panel_prefetch(enabled: bool = True):
    """The pass, after the schedule phase's rules (enabled=False: the marks only removed)."""
    @tvm.transform.module_pass(opt_level=0, name="BlockforgePanelPrefetch")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = {}
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                new = _rewrite(func) if enabled else strip(func)
                if not new.same_as(func):
                    out[gv] = new
        for gv, func in out.items():
            mod[gv] = func
        return mod

    return _pass
