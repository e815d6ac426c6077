"""CPUElementwise: kernels of elementwise steps only, inlined into one pass, vectorised."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.schedule.base import CPURule, const_int, has_root, log_skip, schedule_elementwise, vector_lanes
from blockforge.compile.schedule.reduction import is_reduction


# Below this many elements a kernel runs on one core: a parallel launch cost ~7 us on the 2-core
# Zen 4 VM, more than a vectorised add of 12288 floats (1.6 us); at 98304 floats (GPT-2's
# residual at seq 128) the launch pays in the model, not in a hot loop (see the class doc).
MIN_PARALLEL = 16384
TRANSPOSE_TILE = 16  # rows of a transposing kernel's tile: 16 input lines, each read once


def _offset_steps(sch, block) -> list[tuple[int, ...]] | None:
    """For each buffer the block reads (one element each): how far its flat offset moves when each
    iteration var steps by 1 (one entry per var, outermost first), measured at a few points of the
    iteration space (index maps through reshapes are div/mod expressions: sampled, not solved;
    a step that differs between the points makes it None)."""
    import tvm
    import tvm_ffi

    blk = sch.get(block)
    ivs = [iv.var for iv in blk.iter_vars]
    exts = [const_int(iv.dom.extent) for iv in blk.iter_vars]
    if len(ivs) < 2 or None in exts or exts[-1] < 2:
        return None
    ana = tvm.sym.Analyzer()
    out = []
    for region in blk.reads:
        if any(const_int(r.extent) != 1 for r in region.region):
            return None
        shape = [const_int(d) for d in region.source.shape]
        if None in shape:
            return None
        flat, stride = tirx.const(0, "int64"), 1
        for r, d in zip(reversed(region.region), reversed(shape)):
            flat = flat + tirx.Cast("int64", r.min) * tirx.const(stride, "int64")
            stride *= d

        def at(point):
            values = {x: tirx.const(p, str(x.ty.dtype)) for x, p in zip(ivs, point)}
            return const_int(ana.simplify(tvm_ffi.structural_map(flat, (tirx.Var, lambda v: values.get(v, v)))))

        steps = set()
        for frac in (0, 3, 7):  # a few points, away from the ends so every step stays inside
            base = [min(e - 2, e * frac // 10) if e > 2 else 0 for e in exts]
            o = at(base)
            moved = [at(base[:k] + [base[k] + 1] + base[k + 1:]) if exts[k] > 1 else o for k in range(len(exts))]
            if o is None or None in moved:  # an index read from data (a gather): not an affine map
                return None
            steps.add(tuple(m - o for m in moved))
        if len(steps) != 1:
            return None
        out.append(steps.pop())
    return out


def transposes(sch, block) -> int | None:
    """The axis to tile with the innermost when the block reads some input across its lines as
    the output is written along its own: that input's offset steps by more than one element with
    the innermost output axis and by one with this axis (a transpose, also through reshapes:
    MobileViT's unfold, SegFormer's and ConvNeXt's (H*W, C) <-> (C, H, W)); else None."""
    steps = _offset_steps(sch, block)
    for st in steps or ():
        if abs(st[-1]) > 1:
            unit = [k for k in range(len(st) - 1) if st[k] == 1]
            if unit:
                return unit[-1]
    return None


def schedule_transpose(sch, block, lanes: int, axis: int) -> bool:
    """Tiles of TRANSPOSE_TILE rows of `axis` x a vector of the innermost axis: both split, the
    tile's two inner loops innermost, every other loop outside and fused with the tile loops into
    one parallel loop. Each tile reads 16 input lines (a vector's gather touches one element of
    each) that its 16 rows then use whole, where the untiled loop fetched a line per element.
    Half a vector or 8 rows where the whole one does not divide (ConvNeXt's rows of 56: vectors
    of 8); returns False (nothing changed) if neither does."""
    loops = sch.get_loops(block)
    exts = [const_int(sch.get(lp).extent) for lp in loops]
    if len(loops) < 2 or exts[-1] is None or exts[axis] is None:
        return False
    width = next((w for w in (lanes, lanes // 2) if w >= 4 and exts[-1] % w == 0), None)
    rows = next((t for t in (TRANSPOSE_TILE, TRANSPOSE_TILE // 2) if exts[axis] % t == 0), None)
    if width is None or rows is None:
        return False
    ao, ai = sch.split(loops[axis], [None, rows])
    bo, bi = sch.split(loops[-1], [None, width])
    others = [lp for k, lp in enumerate(loops[:-1]) if k != axis]
    sch.reorder(*others, ao, bo, ai, bi)
    sch.vectorize(bi)
    sch.parallel(sch.fuse(*others, ao, bo))
    return True


class CPUElementwise(CPURule):
    """A function of elementwise steps only (no reduction): inlined into its last block,
    rows parallel, the innermost axis vectorised. The last rule tried: every other rule's
    kernels (GEMM epilogues, row reductions, im2col) keep theirs.

    int8 modules' quantize / dequantize / activation chains ran as serial loops through one
    full buffer per step (the QDQ BERT-base FFN's gelu chain 0.52 ms). Float modules had their
    lone elementwise kernels left to TVM's serial scalar loop too: a residual add whose rows are
    symbolic (a decoder's one-build prompt; a reshape beside it made CPURowReduction take the
    static build's), 1.23 ms of GPT-2's prompt at seq 128; with it the prompt ran 0.979-0.992x
    (40 interleaved rounds in each of three build orders on Zen 4, `elementwise` ablation:
    benchmarks/results/quiet-2026-12-06b/prefill_orders.log), of which vectorising alone gave
    nothing (two exploration A/Bs): the parallel rows did."""

    def __init__(self, tile_transposes: bool = True):
        super().__init__()
        self.tile_transposes = tile_transposes  # False: the ablation `transpose-tiles`

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        if not has_root(sch):
            return None
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        if not blocks or any(is_reduction(sch.get(b)) for b in blocks):
            return None
        for b in blocks[:-1]:
            try:
                sch.compute_inline(b)
            except Exception as e:
                log_skip("CPUElementwise", func, f"step {sch.get(b).name_hint} not inlined", e)
        try:
            for b in sch.get_child_blocks(sch.get_sblock("root", "main")):
                if len(sch.get_loops(b)) >= 1:
                    lanes = vector_lanes(target)
                    axis = transposes(sch, b) if self.tile_transposes else None
                    if axis is None or not schedule_transpose(sch, b, lanes, axis):
                        schedule_elementwise(sch, b, lanes, MIN_PARALLEL)
        except Exception as e:  # a kernel this rule cannot shape keeps TVM's loops, never fails the build
            log_skip("CPUElementwise", func, "not scheduled", e)
            return None
        return sch
