"""Default CPU schedules, so an untuned build is not punished with TVM's naive loops.

TVM's default llvm pipeline leaves matmuls as scalar triple loops (~100x slower than
ONNX Runtime on an MHA block). These dlight-style rules give every matmul-like and
row-reduction kernel a reasonable schedule; MetaSchedule records, where present, are
applied first and win (ApplyDefaultSchedule skips already-scheduled functions).

Matmul micro-kernel (C[..., i, j] += A[..., i, k] * B[..., k, j], j contiguous in B and C):
    for (batch, j_outer, i_outer) in parallel:        # B panel K x NR stays in L2 across i
        acc[MR][NR] = 0                                # MR*NR/lanes vector registers
        for k: acc[ii][jj] += A[i, k] * B[k, jj]       # broadcast A, FMA NR-wide rows of B
        C[i, j] = epilogue(acc)                        # bias/activation/scale fused in-tile
"""

from __future__ import annotations

import logging

from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

# Measured on a 2-core Zen 5 (AVX-512), BERT-base FFN at seq 128, ms (MR x NR/lanes, K block):
#   4x2/256 10.8  6x2/256 8.5  8x2/256 7.1  4x4/256 7.5  8x2/512 6.9  12x2/256 7.5  6x4/256 6.7
# 6 x 4 vectors = 24 accumulators of the 32 AVX-512 registers.
MR = 6  # rows per micro-tile
NR_VECS = 4  # vectors per row of the micro-tile
K_BLOCK = 256
# Loop annotation read by TVM's LoopPartition pass: the loop is split where a guard inside
# it (a split's tail predicate) changes value, so the guard-free part vectorises.
PARTITION_HINT = "pragma_loop_partition_hint"


_log = logging.getLogger("blockforge.schedule")


def _why(rule: str, func, what: str, e: BaseException | None = None) -> None:
    """A rule that does not (fully) apply says why in the log, instead of swallowing it."""
    name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else "?"
    reason = f": {str(e).strip().splitlines()[-1][:200]}" if e is not None and str(e).strip() else ""
    _log.info("%s on %s: %s%s", rule, name, what, reason)


def vector_lanes(target: Target) -> int:
    """float32 lanes of the target's widest vector registers, from the target's own features
    (mcpu/mattr), not the build machine's: TVM's llvm_get_vector_width answered 512 bits for
    `-mcpu=haswell` and for plain x86-64 on this AVX-512 host, so AVX2 cross builds got 16-lane
    tiles (6 rows x 2 zmm-wide accumulators: twice the 16 ymm registers AVX2 has)."""
    from tvm.target.codegen import target_has_features

    try:
        if target_has_features("avx512f", target):
            return 16
        if target_has_features("avx", target):
            return 8
    except Exception:  # not an x86 LLVM target
        pass
    return 4  # SSE, NEON, and anything narrower-or-unknown: 128-bit


def _cores(target: Target) -> int:
    n = target.attrs.get("num-cores") if target.attrs is not None else None
    return int(n) if n else 1


def _const(e) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else None


def _single_reduction(sch: s_tir.Schedule):
    blocks = sch.get_child_blocks(sch.get_sblock("root", "main")) if _has_root(sch) else None
    if blocks is None:
        return None, []
    red, others = [], []
    for b in blocks:
        kinds = {iv.iter_type for iv in sch.get(b).iter_vars}
        if kinds == {tirx.IterVar.DataPar, tirx.IterVar.CommReduce}:
            red.append(b)
        elif kinds <= {tirx.IterVar.DataPar}:
            others.append(b)
        else:
            return None, []
    return (red[0] if len(red) == 1 else None), blocks


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root", "main")
        return True
    except Exception:
        return False


def _is_nn_matmul(block) -> tuple[bool, int | None]:
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
        return r.min if _const(r.extent) == 1 else None

    def second_last(region):
        r = region.region[-2] if len(region.region) >= 2 else None
        return r.min if r is not None and _const(r.extent) == 1 else None

    ok = (last(c).same_as(j) if last(c) is not None else False) and \
         (last(b) is not None and last(b).same_as(j)) and \
         (second_last(b) is not None and second_last(b).same_as(k)) and \
         (last(a) is not None and last(a).same_as(k)) and \
         (second_last(a) is not None and second_last(a).same_as(i))
    return ok, _const(ivs[-2].dom.extent)


def _inline_producers(sch, blocks, mm, rule: str, func) -> int | None:
    """Compute the matmul's producers (e.g. a transpose fused in) into place; returns the
    matmul's index among `blocks`, or None (and says why) when one cannot be inlined."""
    idx = [i for i, b in enumerate(blocks) if b.same_as(mm)][0]
    for b in blocks[:idx]:
        try:
            sch.compute_inline(b)
        except Exception as e:
            _why(rule, func, f"producer {sch.get(b).name_hint} cannot be inlined", e)
            return None
    return idx


def _collapse_epilogue(sch, epilogue, rule: str, func) -> None:
    """Inline an elementwise epilogue chain (bias, gelu's several blocks, scale) into its
    last block; a step that cannot be inlined stays a separate loop nest."""
    for b in epilogue[:-1]:
        try:
            sch.compute_inline(b)
        except Exception as e:
            _why(rule, func, f"epilogue {sch.get(b).name_hint} not inlined", e)


def _is_crop(sch, b, mm) -> bool:
    """An epilogue block over fewer output positions than the matmul computes (conv/rewrite.py's
    GEMM runs whole panels, then keeps the first L columns)."""
    ext = [_const(iv.dom.extent) for iv in sch.get(b).iter_vars]
    mm_ext = [_const(iv.dom.extent) for iv in sch.get(mm).iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    return len(ext) == len(mm_ext) and ext != mm_ext


def _fold_into_writeback(sch, epilogue, rule: str, func, mm=None) -> None:
    """Fold what is left of the epilogue into the accumulator's write-back (after cache_write).
    Not a crop: TVM 0.27's reverse_compute_inline of a block over a smaller domain writes the
    whole tile, past the crop's end (row 1 of a (66, 200) conv output overwritten by row 0's tail)."""
    for b in epilogue:
        if _alive(sch, b) and not (mm is not None and _is_crop(sch, b, mm)):
            try:
                sch.reverse_compute_inline(b)
            except Exception as e:
                _why(rule, func, f"epilogue {sch.get(b).name_hint} not folded into the write-back", e)


class CPURule(CPUScheduleRule):
    """blockforge's CPU rules: `schedule` gets a fresh Schedule of a PrimFunc built for an
    LLVM target (dlight's CPUScheduleRule says which targets), and returns it or None."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        return self.schedule(s_tir.Schedule(func), func, target)

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        raise NotImplementedError


class CPUMatmul(CPURule):
    """Register-tiled, vectorised, parallel matmul with the epilogue fused in-tile."""

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        mm, blocks = _single_reduction(sch)
        if mm is None:
            return None
        ok, n = _is_nn_matmul(sch.get(mm))
        packed_nr = _packed_nr(sch.get(mm))
        if packed_nr:
            ok, n = True, _const(sch.get(mm).iter_vars[-2].dom.extent)
        if not ok:
            return None
        # Producers are computed into place; epilogue blocks are inlined into the
        # accumulator write-back below.
        idx = _inline_producers(sch, blocks, mm, "CPUMatmul", func)
        if idx is None:
            return None
        lanes = vector_lanes(target)
        *batch, i, j, k = sch.get_loops(mm)
        m_sym = _const(sch.get(i).extent) is None
        if n is None:
            # Symbolic N (e.g. attention scores over a symbolic seq): full NR-wide panels
            # and a guarded tail, split apart by LoopPartition (the hint on jo below), so
            # the panels keep their vector code; a guard inside a vector loop scalarises it.
            nr = packed_nr or NR_VECS * lanes
        else:
            widths = [w for w in (NR_VECS * lanes, 2 * lanes, lanes) if n % w == 0]
            if m_sym and not packed_nr:  # the panels are the parallel work then: enough of them
                widths = [w for w in widths if n // w >= 2 * _cores(target)] or widths[-1:]
            nr = packed_nr or next(iter(widths), None)
            if nr is None:
                nr = n if n < lanes else None
        if nr is None:
            return None
        io, ii = sch.split(i, [None, MR])
        jo, ji = sch.split(j, [None, nr])
        kext = _const(sch.get(k).extent)
        # The loop whose last iterations are guarded goes inside, serial, for LoopPartition:
        # symbolic N -> the column panels (jo); symbolic M -> the row tiles (io): a row
        # guard inside the micro-kernel costs a branch per row and k (the BERT-base
        # projections at seq 128: 2.2x the static build's time; partitioned, ~1.0x).
        outer = [io, jo] if n is None else [jo, io]
        if kext is not None and kext > K_BLOCK and kext % K_BLOCK == 0:
            ko, ki = sch.split(k, [None, K_BLOCK])
            sch.reorder(*batch, *outer, ko, ki, ii, ji)
            k_outer = ko
        else:
            sch.reorder(*batch, *outer, k, ii, ji)
            k_outer = k
        # Collapse the elementwise epilogue chain (bias, gelu's several blocks, scale) into
        # its last block, then fold that into the write-back of the accumulator.
        epilogue = list(blocks[idx + 1:])
        _collapse_epilogue(sch, epilogue, "CPUMatmul", func)
        acc = sch.cache_write(mm, 0, "local")
        _fold_into_writeback(sch, epilogue, "CPUMatmul", func, mm)
        sch.reverse_compute_at(acc, outer[-1], preserve_unit_loops=True)
        for b in epilogue:
            if _alive(sch, b) and _is_crop(sch, b, mm):
                # In the tile, after its write-back: the crop's own bounds guard the tail panel.
                sch.reverse_compute_at(b, outer[-1], preserve_unit_loops=True)
        # Epilogue blocks that cannot be inlined (e.g. gelu reading its input twice) stay
        # as separate loops after the matmul: parallel over rows, vectorised along j.
        for b in blocks[idx + 1:]:
            if _alive(sch, b) and not _is_crop(sch, b, mm):
                _schedule_elementwise(sch, b, vector_lanes(target))
        # Vectorize and parallelize while the update is still a complete reduction block.
        sch.vectorize(ji)
        sch.unroll(ii)
        _vectorize_inner(sch, acc, nr)
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


def _packed_nr(block) -> int | None:
    """NR of a prepacked matmul block (weights laid out (N/NR, K, NR)), else None."""
    from .prepack import PACKED_BLOCK

    if not block.name_hint.startswith(PACKED_BLOCK) or len(block.reads) != 2:
        return None
    w = block.reads[1].source  # (N/NR, K, NR); conv/rewrite.py's im2col: (batch, group, L/NR, K, NR)
    return _const(w.shape[-1]) if len(w.shape) >= 3 else None


def panel_width(target: Target) -> int:
    """The NR the CPU matmul kernel uses for wide N: NR_VECS vectors."""
    return NR_VECS * vector_lanes(target)


def _alive(sch, b) -> bool:
    try:
        sch.get(b)
        return True
    except Exception:
        return False


def _schedule_elementwise(sch, block, lanes: int) -> None:
    loops = sch.get_loops(block)
    ext = _const(sch.get(loops[-1]).extent)
    if ext is not None and ext % lanes == 0:
        _, vi = sch.split(loops[-1], [None, lanes])
        sch.vectorize(vi)
    if len(loops) > 1:
        sch.parallel(sch.fuse(*loops[:-1]))


def _vectorize_inner(sch, block, width: int) -> None:
    loops = sch.get_loops(block)
    inner = loops[-1]
    ext = _const(sch.get(inner).extent)
    if ext is not None and ext == width:
        sch.vectorize(inner)
        if len(loops) >= 2 and _const(sch.get(loops[-2]).extent) is not None:
            sch.unroll(loops[-2])


class CPURowReduction(CPURule):
    """Softmax / LayerNorm style kernels: one parallel loop over rows, every reduction and
    elementwise step of a row inside it, vectorised.

        for row in parallel:
            part[0:L] = identity;  for ko: part[0:L] = op(part[0:L], x[row, ko*L : ko*L+L])   # rfactor
            r = op(part[0], ..., part[L-1])                                                # L scalar steps
            for jo: y[row, jo*L : jo*L+L] = f(x[row, ...], r)                              # elementwise
        (a symbolic or ragged row length: the last chunk is guarded, and partitioned off)

    Measured (1 thread, CPU time, this 2-vCPU AMD EPYC VM, AVX-512): the BERT-base per-head
    softmaxes at seq 512 (12 x 512 x 512, fp32) 5.8 ms with scalar reductions, 2.0 ms so.
    The blocks are fused by `merge` of their own row loops, not `compute_at`: compute_at
    regenerates an rfactor block's loops and drops its tail guard when the row length is
    symbolic (TVM 0.27), reading past the row.
    """

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        if not _has_root(sch):
            return None
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        if len(blocks) < 2:
            return None
        n_rows = _row_structure(sch, blocks)
        if n_rows is None:
            return None
        if any(_const(iv.dom.extent) is None for iv in sch.get(blocks[-1]).iter_vars):
            # Symbolic rows or row length: the fused row loop's bindings divide by a
            # variable, which the checked decompose_reduction refuses (not quasi-affine).
            # The steps below are the same and valid (rows are independent); such
            # workloads are never MetaSchedule-tuned, so no trace is replayed with checks.
            sch = s_tir.Schedule(func, enable_check=False)
            blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        lanes = vector_lanes(target)
        _inline_single_use(sch, blocks)
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        partials = []
        for b in blocks:
            if _is_reduction(sch.get(b)):
                loop = sch.get_loops(b)[-1]
                ext = _const(sch.get(loop).extent)
                if ext is None or ext >= lanes:
                    _, ki = sch.split(loop, [None, lanes])
                    rf = sch.rfactor(ki, 0)
                    *_, ko, ki = sch.get_loops(rf)  # partial results in lanes: (rows, ko, ki)
                    if ext is None or ext % lanes:
                        sch.annotate(ko, PARTITION_HINT, 1)
                    sch.vectorize(ki)
                    partials.append((rf, ko))
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        rows = [sch.fuse(*sch.get_loops(b)[:n_rows]) if n_rows > 1 else sch.get_loops(b)[0] for b in blocks]
        row = sch.merge(*rows) if len(rows) > 1 else rows[0]  # a lone reduction block: nothing to merge
        for b in blocks:
            if not _is_reduction(sch.get(b)) and len(sch.get_loops(b)) > 1:
                _vectorize_row(sch, sch.get_loops(b)[-1], lanes)
        # Parallel and vectorized while the partials are complete reduction blocks; then
        # their init leaves the ko loop. It must for a symbolic row length: inside, a
        # ragged first chunk (a row shorter than a vector) leaves lanes uninitialised.
        sch.parallel(row)
        for rf, ko in partials:
            try:
                init = sch.decompose_reduction(rf, ko)
            except Exception as e:  # a static ragged row (>= one full vector): init in loop is exact
                _why("CPURowReduction", func, "partial-result init stays in the loop", e)
                continue
            sch.vectorize(sch.get_loops(init)[-1])
        return sch


class CPUMatmulRaggedN(CPURule):
    """Matmuls CPUMatmul leaves alone because N is no multiple of the vector width: ViT's
    197 tokens make the attention scores (B, h, 197, 64) x (B, h, 64, 197), which TVM's
    default lowering runs as scalar dot products reading B with a stride of N. Measured
    (1, 12, 197, 64) x (1, 12, 64, 197) * 0.125, 2 threads, shared machine, interleaved:
    56.7 ms default lowering, 4.0 ms with this rule (benchmarks/ragged_matmul.py).

    Rows are tiled by MR and parallel; for each k the MR rows of the accumulator (MR x N,
    in L1) are updated along j, contiguous in B and C: an innermost unit-stride loop that
    LLVM's loop vectorizer turns into vectors plus a scalar tail (TVM's own vectorize needs
    a lanes-divisible extent).
    """

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        mm, blocks = _single_reduction(sch)
        if mm is None:
            return None
        ok, n = _is_nn_matmul(sch.get(mm))
        lanes = vector_lanes(target)
        if not ok or n is None or n % lanes == 0 or n < lanes or _packed_nr(sch.get(mm)):
            return None  # CPUMatmul's (or nobody's) case
        idx = _inline_producers(sch, blocks, mm, "CPUMatmulRaggedN", func)
        if idx is None:
            return None
        epilogue = list(blocks[idx + 1:])
        _collapse_epilogue(sch, epilogue, "CPUMatmulRaggedN", func)
        *batch, i, j, k = sch.get_loops(mm)
        iext = _const(sch.get(i).extent)
        mr = next((m for m in (MR, 4, 2) if iext is not None and iext % m == 0), 1)
        io, ii = sch.split(i, [None, mr])
        acc = sch.cache_write(mm, 0, "local")  # (MR, N) rows: ~5 KiB at N=197, in L1
        _fold_into_writeback(sch, epilogue, "CPUMatmulRaggedN", func)
        sch.reorder(*batch, io, k, ii, j)
        sch.reverse_compute_at(acc, io, preserve_unit_loops=True)
        for b in blocks[idx + 1:]:
            if _alive(sch, b):
                _schedule_elementwise(sch, b, lanes)
        outer = sch.fuse(*batch, io) if batch else io
        sch.parallel(outer)
        sch.unroll(ii)
        sch.decompose_reduction(mm, k)
        return sch


def _is_reduction(block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)


def _row_structure(sch, blocks) -> int | None:
    """The number of leading row axes all blocks share (same extents, and every block
    reading another's output reads that row only), or None when this is not a row kernel."""
    import tvm_ffi

    last = sch.get(blocks[-1])
    n_rows = len(last.iter_vars) - 1
    if n_rows < 1:
        return None
    row_ext = [iv.dom.extent for iv in last.iter_vars[:n_rows]]
    written = []
    for b in blocks:
        blk = sch.get(b)
        kinds = [iv.iter_type for iv in blk.iter_vars]
        if tirx.IterVar.CommReduce in kinds:
            if kinds[-1] != tirx.IterVar.CommReduce or any(t != tirx.IterVar.DataPar for t in kinds[:-1]):
                return None
        elif any(t != tirx.IterVar.DataPar for t in kinds):
            return None
        n_iters = len(blk.iter_vars)  # a row's values, or one value per row (LayerNorm's mean)
        if n_iters not in (n_rows, n_rows + 1) or len(sch.get_loops(b)) != n_iters or \
                (n_iters == n_rows and tirx.IterVar.CommReduce in kinds):
            return None
        if not all(tvm_ffi.structural_equal(iv.dom.extent, e) for iv, e in zip(blk.iter_vars, row_ext)):
            return None
        rows = [iv.var for iv in blk.iter_vars[:n_rows]]
        for r in blk.reads:
            if any(r.source.same_as(w) for w in written):
                lead = r.region[:n_rows]
                if len(r.region) < n_rows or not all(_const(x.extent) == 1 and x.min.same_as(v)
                                                     for x, v in zip(lead, rows)):
                    return None
        written += [w.source for w in blk.writes]
    return n_rows


def _inline_single_use(sch, blocks) -> None:
    """Inline elementwise steps read by exactly one later block (softmax's x - max into exp):
    one pass over the row instead of two; steps read twice stay (no recomputation)."""
    for b in blocks[:-1]:
        blk = sch.get(b)
        if _is_reduction(blk) or len(blk.writes) != 1:
            continue
        buf = blk.writes[0].source
        readers = [c for c in blocks if _alive(sch, c) and not c.same_as(b)
                   and any(r.source.same_as(buf) for r in sch.get(c).reads)]
        if len(readers) == 1:
            try:
                sch.compute_inline(b)
            except Exception:
                pass


def _vectorize_row(sch, loop, lanes: int) -> None:
    ext = _const(sch.get(loop).extent)
    if ext is not None and ext < lanes:
        return
    jo, ji = sch.split(loop, [None, lanes])
    if ext is None or ext % lanes:
        sch.annotate(jo, PARTITION_HINT, 1)
    sch.vectorize(ji)


class CPUElementwise(CPURule):
    """A function of elementwise steps only (no reduction): inlined into its last block,
    rows parallel, the innermost axis vectorised. Used in int8 modules only (pipeline:
    their quantize / dequantize / activation chains, which TVM's default lowering ran as
    serial loops through one full buffer per step: the QDQ BERT-base FFN's gelu chain
    0.52 ms). Float modules keep their schedules as they were."""

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        if not _has_root(sch):
            return None
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        if not blocks or any(_is_reduction(sch.get(b)) for b in blocks):
            return None
        for b in blocks[:-1]:
            try:
                sch.compute_inline(b)
            except Exception as e:
                _why("CPUElementwise", func, f"step {sch.get(b).name_hint} not inlined", e)
        for b in sch.get_child_blocks(sch.get_sblock("root", "main")):
            if len(sch.get_loops(b)) >= 1:
                _schedule_elementwise(sch, b, vector_lanes(target))
        return sch


def default_cpu_rules() -> list:
    return [CPUMatmul(), CPUMatmulRaggedN(), CPURowReduction()]
