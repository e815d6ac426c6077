"""Kernels that only write symbolic dims' values are not fused.

`shape_to_tensor(shape_of(mask))` (TVM's GatherND converter normalising negative indices; the
shape values of compile/frontend/symbolic.py) legalizes to a PrimFunc whose inputs are the dims
as scalars (`m: T.int64`). FuseOps puts it in a group whose other kernels take another dim
through tir_vars, and FuseTIR then fails in RenewDefs ("Check failed: (VarRemapGet(source) ==
nullptr)"): GPT-2/Llama/Qwen2 exported by dynamo with the past left symbolic hit it. Marked
opaque (pattern 8), such a kernel runs on its own: a few int64 elements, once per call."""

from __future__ import annotations

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
