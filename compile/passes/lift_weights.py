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
STEP_ENTRY = "decode"  # = compile.decode.entries.STEP_ENTRY (passes import nothing from compile.decode)
INPLACE_ENTRY = "decode_inplace"  # = compile.decode.inplace.INPLACE_ENTRY


@dataclass
class LiftedWeight:
    name: str  # the parameter's name, after the user's inputs
    data: object  # tvm.runtime.Tensor (the constant's own buffer: not copied)


def _nbytes(t) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n * t.dtype.itemsize


def _content_key(const) -> tuple:
    import hashlib

    t = const.value
    return (str(t.dtype), tuple(int(d) for d in t.shape), hashlib.blake2b(t.numpy().tobytes()).digest())


def lift_weights_pass(out: list, min_bytes: int = LIFT_MIN_BYTES, entries: tuple[str, ...] = (ENTRY, STEP_ENTRY, INPLACE_ENTRY)):
    """A module pass: the constants of `main` of at least min_bytes become its trailing
    parameters w0, w1, ... (first use first), appended to `out` as LiftedWeight. Further entries
    present (`decode`, compile/decode/entries.py: main specialised at seq 1; `decode_inplace`,
    compile/decode/inplace.py) take the same
    parameter list: their constants are main's by content (each function's passes made their
    own prepacked copy), one more parameter of every entry where none is."""
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
            return const if lifted is None else lifted

    @tvm.transform.module_pass(opt_level=0, name="BlockforgeLiftWeights")
    def lift(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        names = [gv.name_hint for gv in mod.get_global_vars()]
        funcs = [e for e in entries if e in names and isinstance(mod[e], relax.Function)]
        if ENTRY not in funcs:
            return mod
        # every entry's constant node -> its index in `lifted`: one parameter however often it is
        # used. Keyed by the node's address: each visit may hand out a new Python wrapper of the
        # same node. Content keys only when a second entry exists (main alone: as before).
        lifted: list = []
        uses: dict[str, dict] = {}
        by_content: dict | None = {} if len(funcs) > 1 else None
        for name in funcs:
            found: dict = {}

            def visit(e, found=found, first=name == ENTRY):
                if not isinstance(e, tvm.ir.expr.GenericConst) or e.__chandle__() in found \
                        or _nbytes(e.value) < min_bytes:
                    return
                key = _content_key(e) if by_content is not None else None
                at = None if first or key is None else by_content.get(key)
                if at is None:
                    at = len(lifted)
                    lifted.append(e)
                    if key is not None:
                        by_content.setdefault(key, at)
                found[e.__chandle__()] = at

            relax.analysis.post_order_visit(mod[name].body, visit)
            uses[name] = found
        if not lifted:
            return mod
        out.extend(LiftedWeight(f"w{i}", c.value) for i, c in enumerate(lifted))
        mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for name in funcs:
            func = mod[name]
            params = [relax.Var(f"w{i}", c.ty) for i, c in enumerate(lifted)]  # each function its own vars
            body = _Lift(mod, {h: params[i] for h, i in uses[name].items()}).visit_expr(func.body)
            mod[name] = relax.Function([*func.params, *params], body, func.ret_ty, func.is_pure, func.attrs,
                                       func.span)
        return mod

    return lift
