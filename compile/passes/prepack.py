"""Weight prepacking for CPU matmuls: constant W (K, N) becomes Wp (N/NR, K, NR) at compile time.

The register-tiled kernel (cpu_schedule.CPUMatmul) streams an NR-wide column panel of the
weights for every k; in row-major W consecutive k are N floats apart (12 KiB for N=3072),
so each step touches a new page and cache line. Packed, the panel is contiguous. Measured
on a 128x3072x768 GEMM (2 threads, AVX-512): 439 GFLOP/s row-major, 518 packed.
The packed product is computed by a `packed_matmul` block that CPUMatmul recognises.

An N no panel width divides (a vocabulary: GPT-2's 50257, BERT's 30522) is padded with zero
columns to whole panels and the product cropped back (the crop block CPUMatmul computes at the
tile, as conv-gemm's): unpacked, such a matmul fell to a schedule parallel over rows only, so
a decode step (M = 1) ran GPT-2's LM head on one core.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

PACKED_BLOCK = "packed_matmul"
CROP_BLOCK = "packed_crop"
# Padding to whole panels wastes at most this share of the columns: N >= PAD_MIN_PANELS panels.
PAD_MIN_PANELS = 4
# Whole row tiles for a ragged static M while the recomputed rows are at most this share of
# the work (see packed_matmul). Measured (loaded machine, interleaved): CLIP vision's 50 rows as
# 54 (8% more work) 1.06x slower whole-model than guarded; ViT's 197 as 198 (0.5%) faster.
# BERT's 128 as 132 (3%) stays guarded.
WHOLE_TILES_WASTE = 0.02


def whole_tile_rows(m, mr: int | None) -> int | None:
    """M rounded up to whole MR-row tiles, when a static M is ragged and the recomputed rows
    are at most WHOLE_TILES_WASTE of the work; else None (the guarded tile)."""
    m = int(m) if isinstance(m, (int, tvm.tirx.IntImm)) else None
    if mr is None or m is None or m % mr == 0:
        return None
    rows = -(-m // mr) * mr
    return rows if rows - m <= WHOLE_TILES_WASTE * m else None


def packed_matmul(a: te.Tensor, wp: te.Tensor, n: int | None = None, mr: int | None = None) -> te.Tensor:
    """a (.., M, K) x the packed weights (N/NR, K, NR); n: the real N when the last panel is
    padded (the product is then cropped to it). mr: the kernel's row tile; a static M it does
    not divide (ViT's 197 tokens) is computed over whole tiles, the rows past M re-reading row
    M - 1, and cropped: otherwise the split's row guard sits in every tile's k loop (a compare
    and branch per k, and accumulators spilled around it: benchmarks/vit_gemm.py)."""
    nb, kdim, nr = wp.shape
    k = te.reduce_axis((0, kdim), name="k")
    m = a.shape[-2]
    rows = whole_tile_rows(m, mr)
    row = (lambda i: tvm.tirx.min(i, m - 1)) if rows else (lambda i: i)

    def f(*idx):
        *batch, i, j = idx
        return te.sum(a[(*batch, row(i), k)] * wp[j // nr, k, j % nr], axis=k)

    y = te.compute((*a.shape[:-2], rows or m, nb * nr), f, name=PACKED_BLOCK)
    if (n is None or n == int(nb) * int(nr)) and not rows:
        return y
    return te.compute((*a.shape[:-1], n or nb * nr), lambda *idx: y[idx], name=CROP_BLOCK)


def pack_weights(wt: np.ndarray, nr: int) -> np.ndarray:
    """W (K, N) -> (ceil(N/NR), K, NR), zero columns in the last panel's tail."""
    k, n = wt.shape
    nb = -(-n // nr)
    if nb * nr != n:
        wt = np.concatenate([wt, np.zeros((k, nb * nr - n), wt.dtype)], axis=1)
    return np.ascontiguousarray(wt.reshape(k, nb, nr).transpose(1, 0, 2))


@mutator
class _Prepack(PyExprMutator):
    def __init__(self, mod, nr: int, pad: bool, mr: int | None):
        super().__init__(mod)
        self.nr, self.pad, self.mr = nr, pad, mr

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if getattr(call.op, "name", None) != "relax.matmul" or len(call.args) != 2:
            return call
        x, w = call.args
        if not isinstance(w, tvm.ir.expr.GenericConst):
            return call
        wt = w.value.numpy()
        if wt.ndim != 2 or wt.dtype != np.float32 or getattr(x.ty, "dtype", None) != "float32":
            return call
        if call.attrs.out_dtype not in (None, "", "float32") and str(call.attrs.out_dtype) not in ("float32", "void"):
            return call
        k, n = wt.shape
        ragged = n % self.nr != 0
        if (ragged and not self.pad) or n < (PAD_MIN_PANELS if ragged else 1) * self.nr \
                or len(getattr(x.ty, "shape", None) or []) < 2:
            return call
        wp = pack_weights(wt, self.nr)
        return self.builder_.call_te(packed_matmul, x, relax.const(wp), n if ragged else None, self.mr,
                                     primfunc_name_hint="matmul")


def prepack_pass(nr: int, pad: bool = True, mr: int | None = None):
    """pad=False: a ragged N stays unpacked (ablation `pad-panels`); mr: the row tile a ragged
    static M is computed in whole (None: guarded, ablation `row-tiles`)."""
    @tvm.transform.module_pass(opt_level=0, name="BlockforgePrepackWeights")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from blockforge.compile.passes.exprs import rewrite_functions

        return rewrite_functions(mod, _Prepack(mod, nr, pad, mr))

    return _pass
