"""CPURowReduction: softmax/LayerNorm-style row reductions, vectorised along the row."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.target import Target

from blockforge.compile.schedule.base import CPURule, PARTITION_HINT, block_alive, const_int, has_root, log_skip, vector_lanes


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
        if not has_root(sch):
            return None
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        if len(blocks) < 2:
            return None
        if not any(is_reduction(sch.get(b)) for b in blocks):
            # no reduction: CPUElementwise's (a reshape -> transpose -> reshape chain, MobileViT's
            # unfold, took this rule's row loop and missed the transpose tiles)
            return None
        n_rows = _row_structure(sch, blocks)
        copies = n_rows is None and _inline_copies(sch, blocks)
        if copies:
            # rms_norm's legalization: float32 -> float32 casts of x, of the 1-D weight (no row
            # axis) and of the result, which hid its row structure (left serial, issue #20)
            blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
            n_rows = _row_structure(sch, blocks)
        if n_rows is None:
            return None
        if any(const_int(iv.dom.extent) is None for iv in sch.get(blocks[-1]).iter_vars):
            # Symbolic rows or row length: the fused row loop's bindings divide by a
            # variable, which the checked decompose_reduction refuses (not quasi-affine).
            # The steps below are the same and valid (rows are independent); such
            # workloads are never MetaSchedule-tuned, so no trace is replayed with checks.
            sch = s_tir.Schedule(func, enable_check=False)
            blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
            if copies:  # the fresh schedule has them again
                _inline_copies(sch, blocks)
                blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        lanes = vector_lanes(target)
        _inline_single_use(sch, blocks)
        blocks = sch.get_child_blocks(sch.get_sblock("root", "main"))
        partials = []
        for b in blocks:
            if is_reduction(sch.get(b)):
                loop = sch.get_loops(b)[-1]
                ext = const_int(sch.get(loop).extent)
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
            if not is_reduction(sch.get(b)) and len(sch.get_loops(b)) > 1:
                _vectorize_row(sch, sch.get_loops(b)[-1], lanes)
        # Parallel and vectorized while the partials are complete reduction blocks; then
        # their init leaves the ko loop. It must for a symbolic row length: inside, a
        # ragged first chunk (a row shorter than a vector) leaves lanes uninitialised.
        sch.parallel(row)
        for rf, ko in partials:
            try:
                init = sch.decompose_reduction(rf, ko)
            except Exception as e:  # a static ragged row (>= one full vector): init in loop is exact
                log_skip("CPURowReduction", func, "partial-result init stays in the loop", e)
                continue
            sch.vectorize(sch.get_loops(init)[-1])
        return sch


def is_reduction(block) -> bool:
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
        if len(sch.get_loops(b)) != n_iters:
            return None
        # a keepdims reduction (InstanceNormalization's mean and variance, (N, C, 1)): unit
        # axes between the rows and the reduced one count as none
        units = n_iters - n_rows - 1 if tirx.IterVar.CommReduce in kinds else 0
        if units > 0:
            if any(const_int(iv.dom.extent) != 1 for iv in blk.iter_vars[n_rows:-1]):
                return None
            n_iters -= units
        if n_iters not in (n_rows, n_rows + 1) or \
                (n_iters == n_rows and tirx.IterVar.CommReduce in kinds):
            return None
        if not all(tvm_ffi.structural_equal(iv.dom.extent, e) for iv, e in zip(blk.iter_vars, row_ext)):
            return None
        rows = [iv.var for iv in blk.iter_vars[:n_rows]]
        for r in blk.reads:
            if any(r.source.same_as(w) for w in written):
                lead = r.region[:n_rows]
                if len(r.region) < n_rows or not all(const_int(x.extent) == 1 and x.min.same_as(v)
                                                     for x, v in zip(lead, rows)):
                    return None
        written += [w.source for w in blk.writes]
    return n_rows


def _inline_copies(sch, blocks) -> bool:
    """Inline the blocks that only copy a value (same dtype, no arithmetic): free to recompute
    (tirx.BufferLoad is a constructor function here, of tvm.ir TensorLoad nodes: checked by name).
    The last block is inlined backwards into its producer. Whether any was."""
    done = False
    for i, b in enumerate(blocks):
        blk = sch.get(b)
        body = blk.body
        if is_reduction(blk) or not isinstance(body, tirx.BufferStore) or type(body.value).__name__ not in ("BufferLoad", "TensorLoad") \
                or str(body.value.ty) != str(body.buffer.dtype):
            continue
        try:
            if i == len(blocks) - 1:
                sch.reverse_compute_inline(b)
            else:
                sch.compute_inline(b)
            done = True
        except Exception:
            pass
    return done


def _inline_single_use(sch, blocks) -> None:
    """Inline elementwise steps read by exactly one later block (softmax's x - max into exp):
    one pass over the row instead of two; steps read twice stay (no recomputation)."""
    for b in blocks[:-1]:
        blk = sch.get(b)
        if is_reduction(blk) or len(blk.writes) != 1:
            continue
        buf = blk.writes[0].source
        readers = [c for c in blocks if block_alive(sch, c) and not c.same_as(b)
                   and any(r.source.same_as(buf) for r in sch.get(c).reads)]
        if len(readers) == 1:
            try:
                sch.compute_inline(b)
            except Exception:
                pass


def _vectorize_row(sch, loop, lanes: int) -> None:
    ext = const_int(sch.get(loop).extent)
    if ext is not None and ext < lanes:
        return
    jo, ji = sch.split(loop, [None, lanes])
    if ext is None or ext % lanes:
        sch.annotate(jo, PARTITION_HINT, 1)
    sch.vectorize(ji)
