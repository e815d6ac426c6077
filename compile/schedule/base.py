"""What every CPU rule shares: the rule base, the target's vector width, micro-tile sizes."""

from __future__ import annotations

import logging
import math

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


def log_skip(rule: str, func, what: str, e: BaseException | None = None) -> None:
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


def nr_vecs(target: Target) -> int:
    """Vectors per row of the matmul micro-tile: NR_VECS (6 x 4 = 24 accumulators) where the
    target has 32 vector registers (AVX-512, aarch64), 2 (6 x 2 = 12, beside 2 weight vectors
    and the broadcast) on x86 without AVX-512, whose 16 registers 24 accumulators overflowed:
    BERT-base FFN built for x86-64-avx2 spilled and ran at 172 GFLOP/s on Zen 5 (ymm FMA: 239)."""
    from tvm.target.codegen import target_has_features

    try:
        x86 = bool(target_has_features("sse2", target))
    except Exception:  # (a target TVM cannot ask)
        x86 = False
    return 2 if x86 and vector_lanes(target) < 16 else NR_VECS


def panel_group(nr: int, n: int | None, lanes: int, rows: int | None = None) -> int:
    """How many `nr`-wide weight panels a micro-tile reads side by side, so that each row keeps
    NR_VECS vector FMA chains where the panels are narrower (AVX2's 2 vectors: nr_vecs): 1 where
    N is unknown or not whole groups, or where `rows` x the group's vectors would pass the 12
    accumulators 16 registers leave room for (None: no such bound)."""
    wide = NR_VECS * lanes
    if n is None or wide % nr or (n // nr) % (wide // nr) or (rows is not None and rows * wide > 12 * lanes):
        return 1
    return wide // nr


def target_cores(target: Target) -> int:
    n = target.attrs.get("num-cores") if target.attrs is not None else None
    return int(n) if n else 1


def const_int(e) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else None


def single_reduction(sch: s_tir.Schedule):
    blocks = sch.get_child_blocks(sch.get_sblock("root", "main")) if has_root(sch) else None
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


def has_root(sch) -> bool:
    try:
        sch.get_sblock("root", "main")
        return True
    except Exception:
        return False


class CPURule(CPUScheduleRule):
    """blockforge's CPU rules: `schedule` gets a fresh Schedule of a PrimFunc built for an
    LLVM target (dlight's CPUScheduleRule says which targets), and returns it or None."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        return self.schedule(s_tir.Schedule(func), func, target)

    def schedule(self, sch: s_tir.Schedule, func: tirx.PrimFunc, target: Target):
        raise NotImplementedError


def block_alive(sch, b) -> bool:
    try:
        sch.get(b)
        return True
    except Exception:
        return False


def schedule_elementwise(sch, block, lanes: int, min_parallel: int = 0) -> None:
    """The innermost loop vectorised (when lanes divide it), the loops outside it fused and
    parallel -- unless the block's static element count is under min_parallel."""
    loops = sch.get_loops(block)
    exts = [const_int(sch.get(lp).extent) for lp in loops]
    if exts[-1] is not None and exts[-1] % lanes == 0:
        _, vi = sch.split(loops[-1], [None, lanes])
        sch.vectorize(vi)
    small = None not in exts and math.prod(exts) < min_parallel
    if len(loops) > 1 and not small:
        sch.parallel(sch.fuse(*loops[:-1]))


def schedule_lane_partials(sch, block, parallel: bool) -> None:
    """A row reduction into vector-lane partials, part[i, lane] = reduce over k of x[i, k*L + lane]
    (loops i, lane, k): rows outer (parallel if asked), k, the lanes vectorised; then its init."""
    i, lane, k = sch.get_loops(block)
    sch.reorder(i, k, lane)
    if parallel:
        sch.parallel(i)
    sch.vectorize(lane)  # while still a complete reduction block; then the init out
    init = sch.decompose_reduction(block, k)
    sch.vectorize(sch.get_loops(init)[-1])


def vectorize_inner(sch, block, width: int) -> None:
    loops = sch.get_loops(block)
    inner = loops[-1]
    ext = const_int(sch.get(inner).extent)
    if ext is not None and ext == width:
        sch.vectorize(inner)
        if len(loops) >= 2 and const_int(sch.get(loops[-2]).extent) is not None:
            sch.unroll(loops[-2])
