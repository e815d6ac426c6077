"""The weights out of the executable: large constants of the entry function become parameters.

TVM serializes a Relax VM executable with its constants inside (SaveToBytes), and
export_library copies that string again into module.so's imports blob: a BERT-base compile
held its 415 MiB of weights three to four times at the end of the build (issue #18). Lifted,
the executable holds only code and small constants; compile writes the weights tensor by
tensor into weights.bin beside module.so (compile/artifact/weights.py), and the loaders pass
them after the user's inputs.

Runs after every pass that changes constants (prepack, legalize's FoldConstant), before
`lower`: VMShapeLower then checks the lifted parameters' shapes and dtypes at each call as it
does the inputs', so weights that do not fit the module are an error, not a wild read.
"""

from __future__ import annotations

from dataclasses import dataclass

# Constants below this stay embedded (scalars, LayerNorm epsilons, shape helpers): each lifted
# tensor is one more argument per call and one entry in the manifest.
LIFT_MIN_BYTES = 1024
ENTRY = "main"


@dataclass
class LiftedWeight:
    name: str  # the parameter's name, after the user's inputs
    data: object  # tvm.runtime.Tensor (the constant's own buffer: not copied)


def _nbytes(t) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n * t.dtype.itemsize


def lift_weights_pass(out: list, min_bytes: int = LIFT_MIN_BYTES):
    """A module pass: the constants of `main` of at least min_bytes become its trailing
    parameters w0, w1, ... (first use first), appended to `out` as LiftedWeight."""
    import tvm
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Lift(PyExprMutator):
        def __init__(self, mod, params: dict):
            super().__init__(mod)
            self.params = params

        def visit_generic_const_(self, const):
            lifted = self.params.get(const.__chandle__())
            return const if lifted is None else lifted[1]

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeLiftWeights")
    def lift(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if ENTRY not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        func = mod[ENTRY]
        if not isinstance(func, relax.Function):
            return mod
        # the constant's node -> (constant, parameter): one parameter however often it is used. Keyed
        # by the node's address: each visit may hand out a new Python wrapper of the same node.
        params: dict = {}

        def visit(e):
            if isinstance(e, tvm.ir.expr.GenericConst) and e.__chandle__() not in params \
                    and _nbytes(e.value) >= min_bytes:
                params[e.__chandle__()] = (e, relax.Var(f"w{len(params)}", e.ty))

        relax.analysis.post_order_visit(func.body, visit)
        if not params:
            return mod
        body = _Lift(mod, params).visit_expr(func.body)
        new = relax.Function([*func.params, *(v for _, v in params.values())], body, func.ret_ty, func.is_pure, func.attrs,
                             func.span)
        out.extend(LiftedWeight(str(v.name), c.value) for c, v in params.values())
        mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        mod[ENTRY] = new
        return mod

    return lift
