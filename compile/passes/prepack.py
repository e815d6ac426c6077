"""Weight prepacking for CPU matmuls: constant W (K, N) becomes Wp (N/NR, K, NR) at compile time.

The register-tiled kernel (cpu_schedule.CPUMatmul) streams an NR-wide column panel of the
weights for every k; in row-major W consecutive k are N floats apart (12 KiB for N=3072),
so each step touches a new page and cache line. Packed, the panel is contiguous. Measured
on a 128x3072x768 GEMM (2 threads, AVX-512): 439 GFLOP/s row-major, 518 packed.
The packed product is computed by a `packed_matmul` block that CPUMatmul recognises.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.expr_functor import PyExprMutator, mutator

PACKED_BLOCK = "packed_matmul"


def _packed_matmul(a: te.Tensor, wp: te.Tensor) -> te.Tensor:
    nb, kdim, nr = wp.shape
    k = te.reduce_axis((0, kdim), name="k")

    def f(*idx):
        *batch, i, j = idx
        return te.sum(a[(*batch, i, k)] * wp[j // nr, k, j % nr], axis=k)

    return te.compute((*a.shape[:-1], nb * nr), f, name=PACKED_BLOCK)


@mutator
class _Prepack(PyExprMutator):
    def __init__(self, mod, nr: int):
        super().__init__(mod)
        self.nr = nr

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
        if n % self.nr or n < self.nr or len(getattr(x.ty, "shape", None) or []) < 2:
            return call
        wp = np.ascontiguousarray(wt.reshape(k, n // self.nr, self.nr).transpose(1, 0, 2))
        return self.builder_.call_te(_packed_matmul, x, relax.const(wp), primfunc_name_hint="matmul")


def prepack_pass(nr: int):
    @tvm.transform.module_pass(opt_level=0, name="BlockforgePrepackWeights")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        m = _Prepack(mod, nr)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                m.builder_.update_func(gv, m.visit_expr(func))
        return m.builder_.get()

    return _pass
