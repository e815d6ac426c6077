"""Two TVM passes guarded for models with symbolic dims (a decoder's past length).

1. Kernels that only write symbolic dims' values are not fused.

`shape_to_tensor(shape_of(mask))` (TVM's GatherND converter normalising negative indices; the
shape values of compile/frontend/symbolic.py) legalizes to a PrimFunc whose inputs are the dims
as scalars (`m: T.int64`). FuseOps puts it in a group whose other kernels take another dim
through tir_vars, and FuseTIR then fails in RenewDefs ("Check failed: (VarRemapGet(source) ==
nullptr)"): GPT-2/Llama/Qwen2 exported by dynamo with the past left symbolic hit it. Marked
opaque (pattern 8), such a kernel runs on its own: a few int64 elements, once per call.

2. RewriteDataflowReshape (lower) turns reshape kernels into views. Its reshape-pattern check
aborts instead of answering no on some symbolic extents: GPT-2 compiled with seq bound to 5 (or
128) and past symbolic, "The padding factor (past + 5) * 8 is not divisible by past + 5". The
rewrite is an optimisation: where it fails, the module keeps its reshape kernels (a copy each).
It also aborts on a one-input kernel whose body is not a block ("func->body->IsInstance<
SBlockRealizeNode>()"): blockforge's hand-written kernels (qkv_heads). Those are hidden from it
(their body replaced by a no-op for the pass, which then sees no input used and skips them) and
put back after, so one such kernel no longer turns every reshape of the model into a copy
(GPT-2 small: 48 reshape copies, ~6 ms of a 131 ms run, quiet pass 2026-12-02)."""

from __future__ import annotations

import logging

_log = logging.getLogger("blockforge.pipeline")

OPAQUE = 8  # relay/relax OpPatternKind kOpaque


def _scalar_inputs_only(f) -> bool:
    params = list(f.params)
    return len(params) > 1 and all(str(p.ty) in ("int64", "int32") for p in params[:-1])


def opaque_scalar_kernels():
    """A module pass, placed after AnnotateTIROpPattern and before FuseOps."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="OpaqueScalarKernels")
    def run(mod, ctx):
        for gv, f in list(mod.functions_items()):
            if isinstance(f, tvm.tirx.PrimFunc) and _scalar_inputs_only(f):
                mod[gv] = f.with_attr("op_pattern", OPAQUE)
        return mod
    return run


def _block_bodied(f) -> bool:
    from tvm.s_tir import SBlockRealize

    return isinstance(f.body, SBlockRealize)


def is_reshape(f) -> bool:
    """TVM's reshape-pattern check of one kernel, a no where it would abort (see 2.): a kernel
    whose body is not a block, some symbolic extents."""
    import tvm
    from tvm import relax

    if not _block_bodied(f):
        return False
    try:
        return bool(relax.analysis.has_reshape_pattern(f))
    except tvm.error.InternalError:
        return False


def guarded_reshape_views(rewrite):
    """`rewrite` (TVM's RewriteDataflowReshape) applied, or skipped where it aborts (see 2.)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="GuardedRewriteDataflowReshape")
    def run(mod, ctx):
        hidden = {gv: f for gv, f in mod.functions_items()
                  if isinstance(f, tvm.tirx.PrimFunc) and not _block_bodied(f)}
        seen = mod
        if hidden:
            funcs = dict(mod.functions_items())
            funcs.update({gv: f.with_body(tvm.tirx.Evaluate(0)) for gv, f in hidden.items()})
            seen = tvm.IRModule(funcs, attrs=mod.attrs)
        try:
            out = rewrite(seen)
        except tvm.error.InternalError as e:
            _log.info("RewriteDataflowReshape skipped (reshapes stay kernels): %s",
                      str(e).strip().splitlines()[-1][:200])
            return mod
        for gv, f in hidden.items():
            out[gv] = f
        return out
    return run
