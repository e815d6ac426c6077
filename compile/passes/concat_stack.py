"""A concat along the last axis of equal parts as a stack and a reshape (ablation `concat-stack`).

TOPI's concatenate computes each output element through a chain of if_then_else over the
parts, on the concat axis. When that axis is the last one, the one CPU schedules vectorise, the
16 lanes of a vector see 16 conditions, and LLVM reads every part under a mask: gathers (and
the int8 store after it byte by byte). A QDQ MHA keeps the seeds' per-head attention and ends
in the concat of its 12 heads (1, S, 64) -> (1, S, 768) with the output projection's quantize
fused after it: 0.46-0.50 ms of the BERT-base QDQ block's ~15.5 ms at seq 512, for a copy of
1.5 MB.

Parts of one shape (..., d), with d a whole number of vectors, stacked on a new axis before the
last, (..., n, d), and reshaped to (..., n*d) are the same elements in the same order; the
stack's condition is on the part axis, one per vector, and every read is a plain vector load
(the kernel alone: 0.08-0.09 ms against 0.91 ms, tests/test_concat_stack.py).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from blockforge.compile.passes.exprs import bound_value, op_name, rewrite_functions, static_shape

LANES = 16  # a part's last dim must be a whole number of these (float32 zmm; fewer lanes divide it)


def _parts(mutator, call):
    fields = call.args[0]
    if not isinstance(fields, relax.Tuple):
        fields = bound_value(mutator, fields)
    return list(fields.fields) if isinstance(fields, relax.Tuple) else None


@mutator
class _ConcatAsStack(PyExprMutator):
    def __init__(self, mod, lanes: int):
        super().__init__(mod)
        self.lanes = lanes

    def visit_call_(self, call):
        new = super().visit_call_(call)
        if op_name(new) != "relax.concat":
            return new
        parts = _parts(self, new)
        out = getattr(new.ty, "shape", None)
        if not parts or len(parts) < 2 or out is None:
            return new
        shapes = [getattr(p.ty, "shape", None) for p in parts]
        dtypes = {str(getattr(p.ty, "dtype", "")) for p in parts}
        if any(s is None for s in shapes) or len(dtypes) != 1:
            return new
        ndim = len(shapes[0])
        axis = new.attrs.axis
        axis = None if axis is None else int(axis)
        if ndim == 0 or axis not in (-1, ndim - 1):
            return new
        last = static_shape([shapes[0][-1]])
        if last is None or last[0] % self.lanes:
            return new
        import tvm_ffi

        if any(len(s) != ndim or not tvm_ffi.structural_equal(s, shapes[0]) for s in shapes[1:]):
            return new
        stacked = self.builder_.emit(relax.op.stack(parts, axis=ndim - 1))  # (..., n, d)
        return relax.op.reshape(stacked, out)  # (..., n * d)


def concat_stack_pass(lanes: int = LANES):
    """The module pass (optimize phase; after the matchers that read a concat of heads:
    fuse-attention, int8-combine and attention-heads run before it)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeConcatAsStack")
    def concat_stack(mod, _ctx):
        return rewrite_functions(mod, _ConcatAsStack(mod, lanes), dce=True)

    return concat_stack
