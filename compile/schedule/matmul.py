"""CPUMatmul: GEMMs on prepacked weight panels, MR x NR register micro-tiles."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.passes.panel_prefetch import PREFETCH_LOOP
from blockforge.compile.schedule.base import CPURule, K_BLOCK, MR, PARTITION_HINT, nr_vecs, panel_group, block_alive, const_int, log_skip, schedule_elementwise, single_reduction, target_cores, vector_lanes, vectorize_inner


def is_nn_matmul(block) -> tuple[bool, int | None]:
    """(A[..., i, k] * B[..., k, j] with j last in B and C, static N)."""
    ivs = block.iter_vars
    if len(ivs) < 3 or ivs[-1].iter_type != tirx.IterVar.CommReduce:
        return False, None
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in ivs[:-1]):
        return False, None
    if len(block.reads) != 2 or len(block.writes) != 1:
        return False, None
    i, j, k = ivs[-3].var, ivs[-2].var, ivs[-1].var
    a, b = block.reads
    c = block.writes[0]

    def last(region):
        r = region.region[-1]
        return r.min if const_int(r.extent) == 1 else None

    def second_last(region):
        r = region.region[-2] if len(region.region) >= 2 else None
        return r.min if r is not None and const_int(r.extent) == 1 else None

    ok = (last(c).same_as(j) if last(c) is not None else False) and \
         (last(b) is not None and last(b).same_as(j)) and \
         (second_last(b) is not None and second_last(b).same_as(k)) and \
         (last(a) is not None and last(a).same_as(k)) and \
         (second_last(a) is not None and second_last(a).same_as(i))
    return ok, const_int(ivs[-2].dom.extent)


def inline_producers(sch, blocks, mm, rule: str, func) -> int | None:
    """Compute the matmul's producers (e.g. a transpose fused in) into place; returns the
    matmul's index among `blocks`, or None (and says why) when one cannot be inlined."""
    idx = [i for i, b in enumerate(blocks) if b.same_as(mm)][0]
    for b in blocks[:idx]:
        try:
            sch.compute_inline(b)
        except Exception as e:
            log_skip(rule, func, f"producer {sch.get(b).name_hint} cannot be inlined", e)
            return None
    return idx


def collapse_epilogue(sch, epilogue, rule: str, func) -> None:
    """Inline an elementwise epilogue chain (bias, gelu's several blocks, scale) into its
    last block; a step that cannot be inlined stays a separate loop nest."""
    for b in epilogue[:-1]:
        try:
            sch.compute_inline(b)
        except Exception as e:
            log_skip(rule, func, f"epilogue {sch.get(b).name_hint} not inlined", e)


def is_crop(sch, b, mm) -> bool:
    """An epilogue block over fewer output positions than the matmul computes (conv/rewrite.py's
    GEMM runs whole panels, then keeps the first L columns)."""
    ext = [const_int(iv.dom.extent) for iv in sch.get(b).iter_vars]
    mm_ext = [const_int(iv.dom.extent) for iv in sch.get(mm).iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    return len(ext) == len(mm_ext) and ext != mm_ext


def crops_rows_only(sch, b, mm) -> bool:
    """A crop of the row tail only (prepack's whole row tiles): its columns are the matmul's."""
    ext = [const_int(iv.dom.extent) for iv in sch.get(b).iter_vars]
    mm_ext = [const_int(iv.dom.extent) for iv in sch.get(mm).iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    return ext[-1] == mm_ext[-1] and ext[-1] is not None


def fold_into_writeback(sch, epilogue, rule: str, func, mm=None) -> None:
    """Fold what is left of the epilogue into the accumulator's write-back (after cache_write).
    Not a crop: TVM 0.27's reverse_compute_inline of a block over a smaller domain writes the
    whole tile, past the crop's end (row 1 of a (66, 200) conv output overwritten by row 0's tail)."""
    for b in epilogue:
        if block_alive(sch, b) and not (mm is not None and is_crop(sch, b, mm)):
            try:
                sch.reverse_compute_inline(b)
            except Exception as e:
                log_skip(rule, func, f"epilogue {sch.get(b).name_hint} not folded into the write-back", e)


# Static rows of the prepacked GEMMs whose micro-tile prefetches the next weight panel by default
# (settings.panel_prefetch "few-rows"). At most 64: few rows read few FLOPs per weight byte (CLIP
# ViT-B/32's 50 rows, 25), so the next panel's DRAM transfer is as long as this panel's compute;
# the measured wins are at 49-50 rows (settings.panel_prefetch), ViT-B/16's 197 gained nothing. At
# least NR/16 = 4 row tiles (19 rows): the first 4 tiles of a panel together cover the next one
# (passes/panel_prefetch.py); a decode step's 1 row is left as it was measured.
PREFETCH_ROWS = (3 * MR + 1, 64)


class CPUMatmul(CPURule):
    """Register-tiled, vectorised, parallel matmul with the epilogue fused in-tile.
    prefetch: a prepacked GEMM's micro-tile marked for passes/panel_prefetch.py (False:
    ablation `panel-prefetch`), where its static rows are within `rows` (None: any)."""

    def __init__(self, prefetch: bool = True, rows: tuple[int, int] | None = PREFETCH_ROWS):
        super().__init__()
        self.prefetch = prefetch
        self.rows = rows

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        mm, blocks = single_reduction(sch)
        if mm is None:
            return None
        ok, n = is_nn_matmul(sch.get(mm))
        packed_nr = packed_panel_width(sch.get(mm))
        if packed_nr:
            ok, n = True, const_int(sch.get(mm).iter_vars[-2].dom.extent)
        if not ok:
            return None
        # Producers are computed into place; epilogue blocks are inlined into the
        # accumulator write-back below.
        idx = inline_producers(sch, blocks, mm, "CPUMatmul", func)
        if idx is None:
            return None
        lanes = vector_lanes(target)
        *batch, i, j, k = sch.get_loops(mm)
        m_rows = const_int(sch.get(i).extent)
        m_sym = m_rows is None
        if n is None:
            # Symbolic N (e.g. attention scores over a symbolic seq): full NR-wide panels
            # and a guarded tail, split apart by LoopPartition (the hint on jo below), so
            # the panels keep their vector code; a guard inside a vector loop scalarises it.
            nr = packed_nr or nr_vecs(target) * lanes
        else:
            widths = [w for w in dict.fromkeys((nr_vecs(target) * lanes, 2 * lanes, lanes)) if n % w == 0]
            if m_sym and not packed_nr:  # the panels are the parallel work then: enough of them
                widths = [w for w in widths if n // w >= 2 * target_cores(target)] or widths[-1:]
            nr = packed_nr or next(iter(widths), None)
            if nr is None:
                nr = n if n < lanes else None
        if nr is None:
            return None
        io, ii = sch.split(i, [None, MR])
        # A few rows on narrow panels (AVX2's 2 ymm, schedule.base.nr_vecs) are too few FMA
        # chains: a decode step's 1 x 768 x 3072 ran 0.157 ms against 0.111 on 4-vector panels
        # (x86-64-avx2 build, Zen 5). Panels are then read in groups of `group`, side by side.
        # (while rows x the group's vectors stay within AVX2's 12 accumulators: 4 rows grouped
        # spilled, 0.419 ms against 0.172 for 4 x 768 x 3072)
        group = panel_group(nr, n, lanes, m_rows) if packed_nr and m_rows is not None else 1
        if group > 1:
            jo, jg, ji = sch.split(j, [None, group, nr])
        else:
            (jo, ji), jg = sch.split(j, [None, nr]), None
        kext = const_int(sch.get(k).extent)
        # The loop whose last iterations are guarded goes inside, serial, for LoopPartition:
        # symbolic N -> the column panels (jo); symbolic M -> the row tiles (io): a row
        # guard inside the micro-kernel costs a branch per row and k (the BERT-base
        # projections at seq 128: 2.2x the static build's time; partitioned, ~1.0x).
        outer = [io, jo] if n is None else [jo, io]
        inner = [ii, jg, ji] if jg is not None else [ii, ji]
        if kext is not None and kext > K_BLOCK and kext % K_BLOCK == 0:
            ko, ki = sch.split(k, [None, K_BLOCK])
            sch.reorder(*batch, *outer, ko, ki, *inner)
            k_outer = ko
        else:
            sch.reorder(*batch, *outer, k, *inner)
            k_outer = k
        # Collapse the elementwise epilogue chain (bias, gelu's several blocks, scale) into
        # its last block, then fold that into the write-back of the accumulator.
        epilogue = list(blocks[idx + 1:])
        collapse_epilogue(sch, epilogue, "CPUMatmul", func)
        acc = sch.cache_write(mm, 0, "local")
        fold_into_writeback(sch, epilogue, "CPUMatmul", func, mm)
        sch.reverse_compute_at(acc, outer[-1], preserve_unit_loops=True)
        column_crop = False
        for b in epilogue:
            if block_alive(sch, b) and is_crop(sch, b, mm):
                # In the tile, after its write-back: the crop's own bounds guard the tail panel.
                sch.reverse_compute_at(b, outer[-1], preserve_unit_loops=True)
                if crops_rows_only(sch, b, mm):  # the guard is on rows: the columns stay vectors
                    sch.vectorize(sch.get_loops(b)[-1])
                else:
                    column_crop = True
        # Epilogue blocks that cannot be inlined (e.g. gelu reading its input twice) stay
        # as separate loops after the matmul: parallel over rows, vectorised along j.
        for b in blocks[idx + 1:]:
            if block_alive(sch, b) and not is_crop(sch, b, mm):
                schedule_elementwise(sch, b, vector_lanes(target))
        # Vectorize and parallelize while the update is still a complete reduction block.
        sch.vectorize(ji)
        sch.unroll(ii)
        if jg is not None:
            sch.unroll(jg)
        if packed_nr and n is not None and not m_sym and self.prefetch and not column_crop \
                and (self.rows is None or self.rows[0] <= m_rows <= self.rows[1]) \
                and "conv_panel_width" not in sch.get(mm).annotations:
            # the next weight panel prefetched from this micro-tile's k loop (passes/panel_prefetch.py).
            # Not with a crop of the columns (N no panel width divides: a decoder's LM head): LLVM
            # then keeps the crop's 64-bit column indices in 8 zmm across the last k block and
            # spills the accumulators every k step (98 vector stack moves against 7): 37 x 768 x
            # 3121 took 1.27x / 1.50x the time with it on Zen 4, 1.77x / 1.35x on Zen 5; 20 rows
            # 1.07x-1.33x; 50 rows 0.95x (Zen 4) and 1.00x-1.03x (Zen 5).
            sch.annotate(ii, PREFETCH_LOOP, nr)
        vectorize_inner(sch, acc, nr * group)
        if n is None or m_sym:
            par = sch.fuse(*batch, outer[0]) if batch else outer[0]
            sch.annotate(outer[1], PARTITION_HINT, 1)
        else:
            par = sch.fuse(*batch, jo, io)
        sch.parallel(par)
        init = sch.decompose_reduction(mm, k_outer)
        sch.vectorize(sch.get_loops(init)[-1])
        sch.unroll(sch.get_loops(init)[-2])
        return sch


def packed_panel_width(block) -> int | None:
    """NR of a prepacked matmul block (weights laid out (N/NR, K, NR)), else None."""
    from blockforge.compile.passes.prepack import PACKED_BLOCK

    if not block.name_hint.startswith(PACKED_BLOCK):
        return None
    if "conv_panel_width" in block.annotations:  # conv/rewrite.py's implicit GEMMs (read x itself)
        return int(block.annotations["conv_panel_width"])
    if len(block.reads) != 2:
        return None
    w = block.reads[1].source  # (N/NR, K, NR); conv/rewrite.py's im2col: (batch, group, L/NR, K, NR)
    return const_int(w.shape[-1]) if len(w.shape) >= 3 else None


def panel_width(target: Target) -> int:
    """The NR the CPU matmul kernel uses for wide N: nr_vecs(target) vectors."""
    return nr_vecs(target) * vector_lanes(target)
